"""backend.dcp_stager: the ``dcp.async_save`` door and ``staging.pool_bytes`` (single process, CPU tensors)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt.transfer import staging

CHUNK = 64 << 10

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, on purpose


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)
    staging.release_pool()
    yield
    staging.release_pool()


def _cfg(pool_bytes: int) -> dict:
    return {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered", "fsync": False},
            "staging": {"pool_bytes": pool_bytes, "pin": False}, "timeout_s": 30}


def _door_save(sd: dict, path, cfg: dict) -> None:
    resp = dcp.async_save(sd, storage_writer=cpuckpt.StorageWriter(path, cfg))
    resp.staging_completion.result(timeout=30)
    resp.upload_completion.result(timeout=30)


@pytest.mark.parametrize("pool_bytes", [0, 4 << 20])
def test_door_saves_with_no_pool_size_or_a_larger_one(tmp_path, pool_bytes):
    """Regression: with ``staging.pool_bytes`` larger than the state dict the door's pool held only the
    snapshot and 2 x io.threads chunks, and the write after it (a synchronous save streaming through
    ``pool_bytes // chunk_bytes`` slots) failed with "host pool ... is in use and too small"."""
    cfg = _cfg(pool_bytes)
    sd = {"w": torch.randn(256, 256), "b": torch.arange(5), "step": 3}
    _door_save(sd, tmp_path / "ck", cfg)
    if pool_bytes:
        assert staging.pool_state()[0] == pool_bytes
    out = {"w": torch.empty(256, 256), "b": torch.empty(5, dtype=torch.int64), "step": 0}
    cpuckpt.load(out, tmp_path / "ck", cfg)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3


def test_door_refuses_a_pool_smaller_than_the_state_dict(tmp_path):
    """A pool smaller than the shard means streaming, which DCP's stage-before-plan cannot do."""
    sd = {"w": torch.randn(256, 256)}  # 256 KiB
    with pytest.raises(cpuckpt.ConfigError, match=r"staging\.pool_bytes \(131072\) is smaller") as e:
        _door_save(sd, tmp_path / "ck", _cfg(2 * CHUNK))
    assert "dcp.async_save cannot stream" in str(e.value) and "cpuckpt.async_save" in str(e.value)
    assert not (tmp_path / "ck" / ".metadata").exists()
    _door_save(sd, tmp_path / "ok", _cfg(0))  # the refusal left the pool usable
