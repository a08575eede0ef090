"""transfer.save_job: ``staging.pool_bytes`` picks the staging mode (there is no mode key) and sizes the pool.

Single process, CPU tensors, through the public ``cpuckpt.save``/``async_save``/``load``: a default config
snapshots its async saves and streams its synchronous ones through the small pool, as before the mode key
was removed; a pool smaller than the shard streams within that bound; a pool at least the shard snapshots
in a pool of that size, which a later synchronous save reuses.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import cpuckpt
from cpuckpt.transfer import staging
from cpuckpt.transfer.save_job import choose_mode

CHUNK = 64 << 10
SHARD_FLOATS = 1 << 20  # 4 MiB of float32: 64 chunks


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)
    staging.release_pool()
    yield
    staging.release_pool()


def _cfg(pool_bytes: int | str = 0, in_flight: int = 1) -> dict:
    return {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered", "fsync": False},
            "staging": {"pool_bytes": pool_bytes, "pin": False}, "async": {"max_in_flight": in_flight},
            "timeout_s": 30}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(SHARD_FLOATS, generator=g), "b": torch.randn(7, generator=g), "step": seed}


def _assert_loads(path, seed: int, cfg: dict) -> None:
    out = {"w": torch.empty(SHARD_FLOATS), "b": torch.empty(7), "step": -1}
    cpuckpt.load(out, path, cfg)
    want = _state(seed)
    assert torch.equal(out["w"].view(torch.int32), want["w"].view(torch.int32))
    assert torch.equal(out["b"].view(torch.int32), want["b"].view(torch.int32)) and out["step"] == seed


def _pool(pool_bytes: int | str) -> cpuckpt.Config:
    return cpuckpt.Config.from_dict({"staging": {"pool_bytes": pool_bytes}})


def test_mode_follows_pool_bytes():
    shard = 100 << 20
    assert choose_mode(cpuckpt.Config.from_dict({}), shard) == "snapshot"  # the default: pool_bytes 0
    assert choose_mode(_pool("64MiB"), shard) == "streaming"
    assert choose_mode(_pool(shard), shard) == "snapshot"
    # every save in flight must fit for a snapshot
    assert choose_mode(_pool(shard), shard, in_flight=2) == "streaming"
    assert choose_mode(_pool(2 * shard), shard, in_flight=2) == "snapshot"


def test_default_async_snapshots_and_sync_streams_through_the_small_pool(tmp_path):
    cfg = _cfg()
    cpuckpt.save(_state(1), tmp_path / "sync", cfg)
    assert staging.pool_state()[0] == 2 * 2 * CHUNK  # 2 chunks per io thread
    _assert_loads(tmp_path / "sync", 1, cfg)
    h = cpuckpt.async_save(_state(2), tmp_path / "async", cfg)
    h.wait()
    assert h.stats.mode == "snapshot"
    assert staging.pool_state()[0] >= SHARD_FLOATS * 4  # grown to hold the whole shard
    _assert_loads(tmp_path / "async", 2, cfg)


def test_pool_smaller_than_the_shard_streams_within_it(tmp_path):
    cfg = _cfg(pool_bytes=8 * CHUNK)
    h = cpuckpt.async_save(_state(3), tmp_path / "a", cfg)
    h.wait()
    assert h.stats.mode == "streaming"
    assert staging.pool_state()[0] == 8 * CHUNK
    _assert_loads(tmp_path / "a", 3, cfg)


def test_pool_at_least_the_shard_snapshots_in_a_pool_of_that_size(tmp_path):
    pool_bytes = 2 * SHARD_FLOATS * 4  # two shards
    cfg = _cfg(pool_bytes=pool_bytes)
    h = cpuckpt.async_save(_state(4), tmp_path / "a", cfg)
    h.wait()
    assert h.stats.mode == "snapshot"
    assert staging.pool_state()[0] == pool_bytes  # the configured size, not just the shard's chunks
    cpuckpt.save(_state(5), tmp_path / "b", cfg)  # a synchronous save streams through the same pool
    assert staging.pool_state()[0] == pool_bytes
    _assert_loads(tmp_path / "a", 4, cfg)
    _assert_loads(tmp_path / "b", 5, cfg)


def test_two_in_flight_need_room_for_both_to_snapshot(tmp_path):
    one_shard = SHARD_FLOATS * 4 + 64 * CHUNK // 8  # a shard and a little: not two
    cfg = _cfg(pool_bytes=one_shard, in_flight=2)
    h = cpuckpt.async_save(_state(6), tmp_path / "a", cfg)
    h.wait()
    assert h.stats.mode == "streaming"
    _assert_loads(tmp_path / "a", 6, cfg)


def test_a_write_task_that_raises_fails_the_save_never_commits_zeros(tmp_path, monkeypatch):
    """A pending task that raises instead of reporting (a refused hand-over, a bug) fails the job: the save
    is never committed with the chunks it did not write and their checksums of 0."""
    from cpuckpt.transfer.save_job import SaveJob

    real = SaveJob._write_when_ready
    calls = []
    lock = threading.Lock()

    def flaky(self, chunk, ready):
        with lock:  # the third task to start raises (decided now: the writers run in parallel)
            calls.append(chunk.index)
            third = len(calls) == 3
        real(self, chunk, ready)  # its slot goes back; then the task raises instead of reporting
        if third:
            raise RuntimeError("planted: a write task that raises")

    monkeypatch.setattr(SaveJob, "_write_when_ready", flaky)
    with pytest.raises(cpuckpt.CpuckptError, match="planted"):
        cpuckpt.save(_state(1), tmp_path / "ck", _cfg())
    assert not (tmp_path / "ck" / ".metadata").exists()
    calls.clear()
    h = cpuckpt.async_save(_state(2), tmp_path / "ck2", _cfg())
    with pytest.raises(cpuckpt.CpuckptError, match="planted"):
        h.wait()
    assert not (tmp_path / "ck2" / ".metadata").exists()
    monkeypatch.setattr(SaveJob, "_write_when_ready", real)
    cpuckpt.save(_state(3), tmp_path / "ck3", _cfg())  # every slot went back: the next save has the pool
    _assert_loads(tmp_path / "ck3", 3, _cfg())
