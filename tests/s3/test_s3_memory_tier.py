"""The memory tier with an ``s3://`` durable root, 2 real gloo ranks, the real server: "stage in RAM, flush to the
shared store in the background". Every step is committed in memory; every 2nd is persisted by the writer
processes to object storage (multipart uploads of the slot images, checked against the memory manifest's
crc32c, ``.metadata`` last by conditional PUT); ``close()`` makes the newest durable. The durable checkpoints are
ordinary ``s3://`` checkpoints: listed by ``list_checkpoints``, loaded bit-exact with 2 ranks through the tier
(``load_latest`` picks the newest) and with 1 rank by ``cpuckpt.load`` (resharded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20


def _cfg(ram: str) -> dict:
    return {"io": {"chunk_bytes": "5MiB", "threads": 2},
            "memory": {"root": ram, "persist_every": 2, "slots": 2, "headroom_bytes": 0}, "timeout_s": 60}


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {f"r{rank}": {"w": torch.randn(3 * MiB, generator=g), "b": torch.randint(0, 9, (33,), generator=g)}}


def _train(durable: str, ram: str) -> list[bool]:
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(ram))
    for step in (1, 2, 3):
        tier.save(_state(step, rank), step).wait()
    tier.wait_persisted()
    cpuckpt.wait_all()
    tier.close()  # step 3 made durable too
    return [tier.persisted(s) for s in (1, 2, 3)]


def _resume(durable: str, ram: str) -> int | None:
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(ram))
    out = {f"r{rank}": {"w": torch.zeros(3 * MiB), "b": torch.zeros(33, dtype=torch.int64)}}
    path = tier.load_latest(out)
    want = _state(3, rank)
    assert torch.equal(out[f"r{rank}"]["w"], want[f"r{rank}"]["w"]) and torch.equal(out[f"r{rank}"]["b"],
                                                                                  want[f"r{rank}"]["b"])
    step = tier.step_of(path)
    tier.close()
    return step


def test_memory_tier_persists_to_s3(run_ranks, s3_env, s3_url, tmp_path):
    import cpuckpt

    ram = str(tmp_path / "ram")
    assert run_ranks(2, _train, s3_url, ram, env=s3_env) == [[False, True, True]] * 2
    listed = [(c.path.name, c.complete, c.step) for c in cpuckpt.list_checkpoints(s3_url)]
    assert listed == [("step_2", True, 2), ("step_3", True, 3)], listed
    assert run_ranks(2, _resume, s3_url, str(tmp_path / "ram2"), env=s3_env) == [3, 3]
    whole = {f"r{r}": {"w": torch.zeros(3 * MiB), "b": torch.zeros(33, dtype=torch.int64)} for r in range(2)}
    cpuckpt.load(whole, f"{s3_url}/step_2", {"io": {"chunk_bytes": "5MiB"}})  # 2 ranks -> 1, no tier
    for r in range(2):
        assert torch.equal(whole[f"r{r}"]["w"], _state(2, r)[f"r{r}"]["w"]), r
    assert not Path(ram).exists(), "close() left the RAM root"


def _persist_step_2(durable: str, ram: str, value: float) -> tuple[bool, str]:
    """One run that saves (and persists) step 2 holding ``value``; (step 2 durable, the error raised, if any)."""
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(ram))
    error = ""
    try:
        tier.save({f"r{rank}": torch.full((1000,), value)}, 2).wait()
        tier.wait_persisted()
        tier.close()
    except cpuckpt.CpuckptError as e:
        error = f"{type(e).__name__}: {e}"
        tier.close()
    return tier.persisted(2), error


def test_persist_never_overwrites_a_committed_durable_checkpoint(run_ranks, s3_env, s3_url, tmp_path):
    """A second run persisting the same step into the same root fails with EEXIST before uploading a byte: the
    first run's step_2 keeps its step, its checksums and its values (the probe: run 2's data under run 1's
    metadata, step None, loaded with no error)."""
    import cpuckpt
    from cpuckpt.backend.s3commit import read_manifest
    from cpuckpt.paths import S3Url
    from cpuckpt.transfer.objstore import open_store

    assert run_ranks(2, _persist_step_2, s3_url, str(tmp_path / "ram1"), 1.0, env=s3_env) == [(True, "")] * 2
    url = S3Url.parse(s3_url) / "step_2"
    store = open_store(cpuckpt.Config().s3)
    first = read_manifest(store, url)
    assert first is not None and first.step == 2
    data_etags = {n: store.head(url / n) for n in first.files}
    second = run_ranks(2, _persist_step_2, s3_url, str(tmp_path / "ram2"), 2.0, env=s3_env)
    assert len(second) == 2 and all("holds a committed checkpoint" in err for _, err in second), second
    assert read_manifest(store, url) == first
    assert {n: store.head(url / n) for n in first.files} == data_etags  # not one data object rewritten
    listed = [(c.path.name, c.complete, c.step) for c in cpuckpt.list_checkpoints(s3_url)]
    assert listed == [("step_2", True, 2)], listed
    out = {f"r{r}": torch.zeros(1000) for r in range(2)}
    cpuckpt.load(out, str(url), {"io": {"chunk_bytes": "5MiB"}})
    assert all(torch.equal(v, torch.full((1000,), 1.0)) for v in out.values()), out
