"""Megatron adapter with real megatron-core ``dist_checkpointing`` on 2 gloo ranks.

Sharded state dicts are built from megatron-core ``ShardedTensor``s split along dim 0 (tensor
parallel style), replicated tensors (``replica_id``), ``ShardedObject``s and common (non-sharded)
values, i.e. the shapes GPTModel and its optimizer produce. Saving goes through
``dist_checkpointing.save`` and Megatron's own ``AsyncCallsQueue`` (temporal = forked, persistent =
spawned worker); loading through ``dist_checkpointing.load`` with the stock torch_dist strategy and
with ours.

Without a GPU, megatron-core's async machinery needs four torch.cuda calls stubbed: the stubs are a
test fixture (``cpu_ci_cuda_stubs``), applied only when CUDA is absent, also in the spawned worker
(through a fixture ``sitecustomize``). On the device the same tests run unstubbed, with GPU tensors.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

STUBS = str(Path(__file__).resolve().parent / "cpu_ci_cuda_stubs")
ENV = {"CPU_CI_CUDA_STUBS": "1", "PYTHONPATH": os.pathsep.join([STUBS, os.environ.get("PYTHONPATH", "")])}
ROWS, COLS = 8, 6


# ----------------------------------------------------------------------------------- rank side
def _setup() -> tuple[int, int, str]:
    """Rank setup: CPU-CI stubs (no-op with a GPU), the device the test tensors live on."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, STUBS)
    import cpu_ci_cuda_stubs

    cpu_ci_cuda_stubs.install()
    device = "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device = "cuda"
    return dist.get_rank(), dist.get_world_size(), device


def _full(name: str, step: int, device: str):
    import torch

    g = torch.Generator().manual_seed(hash((name, step)) % 2**31)
    return torch.randn(ROWS, COLS, generator=g).to(device)


def _sharded(step: int, device: str, *, split_dim: int = 0, bf16: bool = False) -> dict:
    """This rank's view: 'w' split along ``split_dim``, 'b' replicated, an object, a common value."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    w = _full("w", step, device)
    if bf16:
        w = w.to(torch.bfloat16)
    local = w.chunk(world, dim=split_dim)[rank].contiguous()
    b = _full("b", step, device)[0].contiguous()
    return {
        "w": ShardedTensor.from_rank_offsets("layer.w", local, (split_dim, rank, world)),
        "b": ShardedTensor.from_rank_offsets("layer.b", b.clone(), replica_id=rank),
        "obj": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "iteration": step,
    }


def _template(device: str, *, split_dim: int = 0, bf16: bool = False) -> dict:
    """Same keys, empty tensors, possibly another split (resharding)."""
    import torch

    sd = _sharded(-1, device, split_dim=split_dim, bf16=bf16)
    for key in ("w", "b"):
        sd[key].data = torch.full_like(sd[key].data, float("nan"))
    return sd


def _check(loaded: dict, step: int, device: str, *, split_dim: int = 0, bf16: bool = False) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    want_w = _full("w", step, device)
    if bf16:
        want_w = want_w.to(torch.bfloat16)
    want_w = want_w.chunk(world, dim=split_dim)[rank]
    assert loaded["w"].dtype == want_w.dtype
    assert torch.equal(loaded["w"].cpu(), want_w.cpu()), f"w differs after load of step {step}"
    assert torch.equal(loaded["b"].cpu(), _full("b", step, device)[0].cpu()), "b differs"
    assert loaded["obj"] == {"rank": rank, "step": step}, loaded["obj"]
    assert loaded["iteration"] == step


def rank_sync_roundtrip(root: str, bf16: bool) -> dict:
    import cpuckpt.integrations.megatron as ckpt_mg
    from megatron.core import dist_checkpointing

    _, _, device = _setup()
    path = Path(root) / "sync"
    path.mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded(1, device, bf16=bf16), str(path), sharded_strategy=ckpt_mg.save_strategy())
    # stock megatron-core (torch_dist backend from metadata.json, FileSystemReader), same split
    stock = dist_checkpointing.load(_template(device, bf16=bf16), str(path))
    _check(stock, 1, device, bf16=bf16)
    # ours, resharded: 'w' now split along dim 1
    ours = dist_checkpointing.load(_template(device, split_dim=1, bf16=bf16), str(path),
                                   sharded_strategy=ckpt_mg.load_strategy())
    _check(ours, 1, device, split_dim=1, bf16=bf16)
    import json

    meta = json.loads((path / "metadata.json").read_text())
    return {"backend": meta["sharded_backend"], "manifest": (path / ".cpuckpt.json").exists(),
            "files": sorted(p.name for p in path.iterdir())}


@pytest.mark.parametrize("bf16", [False, True])
def test_sync_save_stock_and_resharded_load(run_ranks, tmp_path, bf16):
    results = run_ranks(2, rank_sync_roundtrip, str(tmp_path), bf16, timeout_s=180, env=ENV)
    assert results[0]["backend"] == "torch_dist"
    assert results[0]["manifest"], "cpuckpt's manifest missing: the save did not go through cpuckpt"
    assert ".metadata" in results[0]["files"]  # (common state: common.pt up to 0.16, a ShardedObject from 0.17)


def rank_stock_save_our_load(root: str) -> None:
    import cpuckpt.integrations.megatron as ckpt_mg
    from megatron.core import dist_checkpointing

    _, _, device = _setup()
    path = Path(root) / "stock"
    path.mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded(3, device), str(path))  # stock torch_dist strategy
    assert not (path / ".cpuckpt.json").exists()
    loaded = dist_checkpointing.load(_template(device, split_dim=1), str(path),
                                     sharded_strategy=ckpt_mg.load_strategy())
    _check(loaded, 3, device, split_dim=1)


def test_stock_torch_dist_checkpoint_loads_through_ours(run_ranks, tmp_path):
    run_ranks(2, rank_stock_save_our_load, str(tmp_path), timeout_s=180, env=ENV)


def rank_async(root: str, persistent: bool, fully_parallel: bool) -> dict:
    """Two async saves through Megatron's AsyncCallsQueue; tensors change right after scheduling."""
    import cpuckpt.integrations.megatron as ckpt_mg
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    _, _, device = _setup()
    queue = AsyncCallsQueue(persistent=persistent)
    strategy = ckpt_mg.save_strategy(fully_parallel=fully_parallel, parallelization_group=dist.group.WORLD)
    finalized = []
    for step in (1, 2):
        path = Path(root) / f"iter_{step}"
        path.mkdir(exist_ok=True)
        sd = _sharded(step, device)
        request = dist_checkpointing.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                          **mcore_async_kwargs())
        request.add_finalize_fn(lambda s=step: finalized.append(s))
        queue.schedule_async_request(request)
        # the trainer moves on at once: the next optimizer step overwrites the saved tensors
        sd["w"].data.fill_(-7.0)
        sd["b"].data.fill_(-7.0)
        queue.maybe_finalize_async_calls(blocking=False)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for step in (1, 2):
        path = Path(root) / f"iter_{step}"
        _check(dist_checkpointing.load(_template(device), str(path)), step, device)
        _check(dist_checkpointing.load(_template(device, split_dim=1), str(path),
                                       sharded_strategy=ckpt_mg.load_strategy()), step, device, split_dim=1)
    from cpuckpt.integrations.megatron.worker import _channel_dir

    return {"finalized": finalized, "leftovers": sorted(p.name for p in _channel_dir().glob(
        f"cpuckpt-megatron-{os.getpid()}-*"))}


@pytest.mark.parametrize(("persistent", "fully_parallel"), [(False, False), (True, False), (True, True)],
                         ids=["temporal", "persistent", "persistent-fully-parallel"])
def test_async_save_through_megatron_callers(run_ranks, tmp_path, persistent, fully_parallel):
    results = run_ranks(2, rank_async, str(tmp_path), persistent, fully_parallel, timeout_s=240, env=ENV)
    for r in results:
        assert r["finalized"] == [1, 2]
        assert r["leftovers"] == [], "channel files left behind"


def rank_async_failure(root: str, persistent: bool, config: dict | None, watch: bool = False) -> dict:
    """A failing save must raise at finalize on every rank, within the timeout, never hang.

    Faults come from ``cpuckpt.testing.faults``: the ``fault:`` backend in ``config``, or the stage
    action of ``$CPUCKPT_TEST_HOOK`` at ``megatron-worker:rank<r>``, which reaches Megatron's caller
    process by fork (temporal) or with the request (persistent worker, spawned).
    """
    import time

    import cpuckpt.integrations.megatron as ckpt_mg
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.testing import faults

    faults.install()

    _, _, device = _setup()
    queue = AsyncCallsQueue(persistent=persistent)
    if watch:
        from cpuckpt.integrations.megatron.guard import watch_async_queue

        watch_async_queue(queue, timeout_s=60)
    path = Path(root) / "iter_1"
    path.mkdir(exist_ok=True)
    request = dist_checkpointing.save(_sharded(1, device), str(path), sharded_strategy=ckpt_mg.save_strategy(config),
                                      async_sharded_save=True, **mcore_async_kwargs())
    queue.schedule_async_request(request)
    t0 = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        contract = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                    "is_oserror": isinstance(e, OSError), "errno": getattr(e, "errno", None),
                    "rank": getattr(e, "rank", None), "path": getattr(e, "path", None)}
    else:
        error = contract = None
    elapsed = time.monotonic() - t0
    queue.close(abort=True)
    from cpuckpt.integrations.megatron.worker import _channel_dir

    return {"error": error, "contract": contract, "elapsed": elapsed,
            "metadata_json": (path / "metadata.json").exists(),
            "dcp_metadata": (path / ".metadata").exists(),
            "leftovers": sorted(p.name for p in _channel_dir().glob(f"cpuckpt-megatron-{os.getpid()}-*"))}


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_worker_exception_raises_on_every_rank(run_ranks, tmp_path, persistent):
    env = dict(ENV, CPUCKPT_TEST_HOOK="megatron-worker:rank1=raise")
    results = run_ranks(2, rank_async_failure, str(tmp_path), persistent, None, timeout_s=240, env=env)
    for r in results:
        assert r["error"] is not None and "checkpoint worker of rank 1" in r["error"], r
        assert not r["metadata_json"], "metadata.json written for a failed save"
        assert r["contract"]["type"] == "cpuckpt.errors.CpuckptError" and r["contract"]["rank"] == 1, r
    assert results[0]["contract"]["message"] == results[1]["contract"]["message"], results


def test_dead_temporal_worker_raises_on_every_rank(run_ranks, tmp_path):
    env = dict(ENV, CPUCKPT_TEST_HOOK="megatron-worker:rank0=kill")
    results = run_ranks(2, rank_async_failure, str(tmp_path), False, None, timeout_s=240, env=env)
    for r in results:
        assert r["error"] is not None and "ended without reporting" in r["error"], r
        assert not r["metadata_json"]
        assert r["contract"]["type"] == "cpuckpt.errors.CpuckptError" and r["contract"]["rank"] == 0, r
    assert results[0]["contract"]["message"] == results[1]["contract"]["message"], results


def test_dead_persistent_worker_raises_on_every_rank_when_watched(run_ranks, tmp_path):
    # megatron-core's own persistent caller would wait forever for the killed worker
    env = dict(ENV, CPUCKPT_TEST_HOOK="megatron-worker:rank0=kill")
    results = run_ranks(2, rank_async_failure, str(tmp_path), True, None, True, timeout_s=240, env=env)
    for r in results:
        assert r["error"] is not None and "WorkerDiedError" in r["error"], r
        assert ("rank 0's" in r["error"]) or ("another rank's" in r["error"]), r
        assert not r["metadata_json"]
        assert r["elapsed"] < 30, r


def test_write_failure_raises_on_every_rank(run_ranks, tmp_path):
    config = {"io": {"backend": f"fault:{errno.ENOSPC}@4096"}, "timeout_s": 60}
    results = run_ranks(2, rank_async_failure, str(tmp_path), True, config, timeout_s=240, env=ENV)
    for r in results:
        assert r["error"] is not None and "No space left" in r["error"], r
        assert not r["metadata_json"] and not r["dcp_metadata"], "a failed save looks complete"
        assert r["leftovers"] == [], "channel files left behind"
        # The error contract: the same StorageIOError (an OSError) on every rank, errno and path kept,
        # naming the lowest failing rank (both ranks run out of space here: rank 0).
        c = r["contract"]
        assert c["type"] == "cpuckpt.errors.StorageIOError" and c["is_oserror"], r
        assert c["errno"] == errno.ENOSPC and c["rank"] == 0, r
        assert c["path"] and "__0_" in Path(c["path"]).name, r
        assert "rank 0" in c["message"], r
    assert results[0]["contract"]["message"] == results[1]["contract"]["message"], results
