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
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("megatron.core")

STUBS = str(Path(__file__).resolve().parent / "cpu_ci_cuda_stubs")
ENV = {"CPU_CI_CUDA_STUBS": "1", "PYTHONPATH": os.pathsep.join([STUBS, os.environ.get("PYTHONPATH", "")])}
ROWS, COLS = 8, 6
# The watched queues' bound. A dead worker must be found before it: the error names the death (WorkerDiedError), not
# this timeout. Elapsed times include spawning megatron-core's persistent worker (seconds of imports; tens of seconds
# on a loaded 2-core box), so they are held to this bound, not to a detection time.
WATCH_S = 60


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


def rank_validations(device: str) -> dict[str, int]:
    """How often megatron-core's ``FullyParallelSaveStrategyWrapper``, as the Megatron-LM hook hands it over
    (:func:`validate_structure_once`), validates the sharding over two saves of the same structure: per group
    (one rank alone: nothing to distribute; the world) and ``do_cache_distribution`` (Megatron-LM's
    ``--ckpt-assume-constant-structure``)."""
    import types

    import torch.distributed as dist
    from cpuckpt.integrations.megatron.hook import validate_structure_once
    from megatron.core.dist_checkpointing.strategies import fully_parallel
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    calls: list[int] = []
    real = fully_parallel.validate_sharding_integrity

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    wrapper = validate_structure_once(types.SimpleNamespace(
        FullyParallelSaveStrategyWrapper=fully_parallel.FullyParallelSaveStrategyWrapper))
    fully_parallel.validate_sharding_integrity = counted
    try:
        out = {}
        for name, group, constant in (("alone, constant", alone, True), ("alone, not constant", alone, False),
                                      ("world, constant", None, True)):
            calls.clear()
            strategy = wrapper(TorchDistSaveShardedStrategy("torch_dist", 1), group, do_cache_distribution=constant)
            for step in (1, 2):  # what Megatron hands it: the sharded items (common values extracted before)
                strategy.apply_saving_parallelization({k: v for k, v in _sharded(step, device).items()
                                                       if k != "iteration"})
            out[name] = len(calls)
        return out
    finally:
        fully_parallel.validate_sharding_integrity = real


def rank_sync_cases(root: str) -> dict:
    """The synchronous round trips (fp32, then bf16) and the stock save loaded through ours, in one launch of the
    ranks (each case its own directory): megatron-core is imported and the ranks set up once, not three times."""
    out: dict = {"validations": rank_validations(_setup()[2])}
    for bf16 in (False, True):
        case = Path(root) / ("bf16" if bf16 else "fp32")
        case.mkdir(parents=True, exist_ok=True)
        out[bf16] = rank_sync_roundtrip(str(case), bf16)
    rank_stock_save_our_load(root)  # raises (the rank's error) unless the stock checkpoint loads bit-exact
    return out


def test_sync_save_stock_and_resharded_load(run_ranks, tmp_path):
    """fp32 and bf16: cpuckpt's save loads through stock megatron-core and, resharded, through ours; and a stock
    torch_dist checkpoint loads through ours, resharded (the cases of one launch)."""
    results = run_ranks(2, rank_sync_cases, str(tmp_path), timeout_s=240, env=ENV)
    for r in results:  # a constant structure is validated once, also where the group has nothing to distribute
        assert r.pop("validations") == {"alone, constant": 1, "alone, not constant": 2, "world, constant": 1}, r
    for bf16, r in results[0].items():
        assert r["backend"] == "torch_dist", (bf16, r)
        assert r["manifest"], f"bf16={bf16}: cpuckpt's manifest missing: the save did not go through cpuckpt"
        # (common state: common.pt up to 0.16, a ShardedObject from 0.17)
        assert ".metadata" in r["files"], (bf16, r)
    assert sorted(results[0]) == [False, True], results[0]


def rank_async(root: str, queue, fully_parallel: bool) -> dict:
    """Two async saves through Megatron's AsyncCallsQueue ``queue``; tensors change right after scheduling."""
    import cpuckpt.integrations.megatron as ckpt_mg
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing

    _, _, device = _setup()
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
    for step in (1, 2):
        path = Path(root) / f"iter_{step}"
        _check(dist_checkpointing.load(_template(device), str(path)), step, device)
        _check(dist_checkpointing.load(_template(device, split_dim=1), str(path),
                                       sharded_strategy=ckpt_mg.load_strategy()), step, device, split_dim=1)
    from cpuckpt.integrations.megatron.worker import _channel_dir

    return {"finalized": finalized, "leftovers": sorted(p.name for p in _channel_dir().glob(
        f"cpuckpt-megatron-p{os.getpid()}-*"))}


# (name, persistent worker, fully parallel strategy). The persistent cases share one queue, as a Megatron-LM run
# (--use-persistent-ckpt-worker) keeps one worker for all its saves: the worker is spawned once (seconds of imports).
ASYNC_CASES = (("temporal", False, False), ("persistent", True, False), ("persistent-fully-parallel", True, True))


def rank_async_cases(root: str) -> dict:
    """:func:`rank_async` for each of :data:`ASYNC_CASES` (caller, strategy), in one launch of the ranks (each case
    its own directory and strategy; the temporal case its own queue, the persistent ones one queue and so one spawned
    worker, which takes the fully parallel case's saves after the others): megatron-core is imported and the ranks
    set up once, not three times. Each queue is closed after its last case; ``"closed"``: the channel files of this
    rank left once both are."""
    from cpuckpt.integrations.megatron.worker import _channel_dir
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    queues = {persistent: AsyncCallsQueue(persistent=persistent) for persistent in {p for _, p, _ in ASYNC_CASES}}
    last = {persistent: name for name, persistent, _ in ASYNC_CASES}
    out = {}
    for name, persistent, fully_parallel in ASYNC_CASES:
        case = Path(root) / name
        case.mkdir(parents=True, exist_ok=True)
        out[name] = rank_async(str(case), queues[persistent], fully_parallel)
        if last[persistent] == name:
            queues[persistent].close()
    return {"cases": out, "closed": sorted(p.name for p in _channel_dir().glob(f"cpuckpt-megatron-p{os.getpid()}-*"))}


def test_async_save_through_megatron_callers(run_ranks, tmp_path):
    results = run_ranks(2, rank_async_cases, str(tmp_path), timeout_s=240, env=ENV)
    for r in results:
        assert r["closed"] == [], f"channel files left behind after close: {r['closed']}"
        assert list(r["cases"]) == [name for name, _, _ in ASYNC_CASES], r
        for name, case in r["cases"].items():
            assert case["finalized"] == [1, 2], (name, case)
            assert case["leftovers"] == [], f"{name}: channel files left behind: {case['leftovers']}"


def rank_async_failure(root: str, persistent: bool, config: dict | None, watch: bool = False,
                       hook: str | None = None, queue=None, close: bool = True) -> dict:
    """A failing save must raise at finalize on every rank, within the timeout, never hang.

    Faults come from ``cpuckpt.testing.faults``: the ``fault:`` backend in ``config``, or the stage
    action of ``$CPUCKPT_TEST_HOOK`` at ``megatron-worker:rank<r>``, which reaches Megatron's caller
    process by fork (temporal) or with the request (persistent worker, spawned).

    ``queue``: an ``AsyncCallsQueue`` of the kind ``persistent`` names to save through (default: a new one);
    ``close``: close it (``abort=True``) at the end.
    """
    import time

    import cpuckpt.integrations.megatron as ckpt_mg
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.testing import faults

    faults.install(hook)  # None: $CPUCKPT_TEST_HOOK

    _, _, device = _setup()
    if queue is None:
        queue = AsyncCallsQueue(persistent=persistent)
    assert queue.persistent is persistent
    if watch:
        from cpuckpt.integrations.megatron.guard import watch_async_queue

        watch_async_queue(queue, timeout_s=WATCH_S)
    path = Path(root) / "iter_1"
    path.mkdir(parents=True, exist_ok=True)
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
    if close:
        queue.close(abort=True)
    from cpuckpt.integrations.megatron.worker import _channel_dir

    return {"error": error, "contract": contract, "elapsed": elapsed,
            "metadata_json": (path / "metadata.json").exists(),
            "dcp_metadata": (path / ".metadata").exists(),
            "leftovers": sorted(p.name for p in _channel_dir().glob(f"cpuckpt-megatron-p{os.getpid()}-*"))}


FAILURES = {  # name: (the stage action in the worker, persistent worker, config, watched queue); ENOSPC first: it
    # asserts that no channel file is left, and a killed worker's may stay behind. ENOSPC's error contract is cpuckpt's
    # (its worker reports the error through its channel, alike for either caller): a forked worker, not one spawned
    # for it (seconds of imports); the raised and killed cases cover both callers.
    "enospc": ("", False, {"io": {"backend": f"fault:{errno.ENOSPC}@4096"}, "timeout_s": 60}, False),
    "raised-temporal": ("megatron-worker:rank1=raise", False, None, False),
    "raised-persistent": ("megatron-worker:rank1=raise", True, None, False),
    "killed-temporal": ("megatron-worker:rank0=kill", False, None, False),
    # megatron-core's own persistent caller would wait forever for the killed worker
    "killed-persistent-watched": ("megatron-worker:rank0=kill", True, None, True),
}


def rank_async_failures(root: str) -> dict:
    """Every case of :data:`FAILURES` in one launch, a directory each; a queue each, except that the persistent cases
    share one (one spawned worker per rank, seconds of imports, as a Megatron-LM run keeps one): the worker that
    raised lives on and takes the next case's save (watched from then on, as a queue can be wrapped at any time),
    which kills it; the queue is closed after the last of them."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    persistent_queue = AsyncCallsQueue(persistent=True)
    last_persistent = [name for name, (_, persistent, _, _) in FAILURES.items() if persistent][-1]
    return {name: rank_async_failure(str(Path(root) / name), persistent, config, watch, hook=hook,
                                     queue=persistent_queue if persistent else None,
                                     close=not persistent or name == last_persistent)
            for name, (hook, persistent, config, watch) in FAILURES.items()}


def test_a_failed_or_dead_worker_raises_on_every_rank(run_ranks, tmp_path):
    cases = run_ranks(2, rank_async_failures, str(tmp_path), timeout_s=240, env=ENV)
    for name in ("raised-temporal", "raised-persistent"):  # a worker that raised: its rank's error on every rank
        results = [c[name] for c in cases]
        for r in results:
            assert r["error"] is not None and "checkpoint worker of rank 1" in r["error"], (name, r)
            assert not r["metadata_json"], ("metadata.json written for a failed save", name)
            assert r["contract"]["type"] == "cpuckpt.errors.CpuckptError" and r["contract"]["rank"] == 1, (name, r)
        assert results[0]["contract"]["message"] == results[1]["contract"]["message"], (name, results)
    results = [c["killed-temporal"] for c in cases]
    for r in results:
        assert r["error"] is not None and "ended without reporting" in r["error"], r
        assert not r["metadata_json"]
        assert r["contract"]["type"] == "cpuckpt.errors.CpuckptError" and r["contract"]["rank"] == 0, r
    assert results[0]["contract"]["message"] == results[1]["contract"]["message"], results
    for r in (c["killed-persistent-watched"] for c in cases):
        assert r["error"] is not None and "WorkerDiedError" in r["error"], r
        assert ("rank 0's" in r["error"]) or ("another rank's" in r["error"]), r
        assert not r["metadata_json"]
        assert r["elapsed"] < WATCH_S, r
    results = [c["enospc"] for c in cases]
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


class _Call(NamedTuple):
    """megatron-core's ``_ActiveAsyncRequest`` as the watchdog reads it."""

    idx: int
    async_caller: Any
    async_request: Any


def _megatron_lm_tracker(root: Path, step: int, rank: int) -> Callable[[], None]:
    """Megatron-LM's ``iter_finalize_fn``: rank 0 writes the tracker when the save is finalized."""

    def iter_finalize_fn() -> None:
        if rank == 0:
            (root / "latest_checkpointed_iteration.txt").write_text(str(step))

    return iter_finalize_fn


def _outcome(fn: Callable[[], Any]) -> dict:
    try:
        fn()
    except Exception as e:
        return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                "errno": getattr(e, "errno", None), "rank": getattr(e, "rank", None)}
    return {"type": None}


def rank_megatron_finalize_fails_on_rank_0(root: str, on_failure: str) -> dict:
    """Megatron's own finalize functions of a cpuckpt save (megatron-core's ``metadata.json``, Megatron-LM's
    tracker) fail with ENOSPC on rank 0 alone: of a call the trainer completes (the watchdog runs them) and of a
    worker's call (megatron-core's finalize runs them; its ``metadata_finalize_fn`` ends in a barrier). Then the next
    save of each kind, which succeeds: every rank must still be in step."""
    import types
    from collections import deque

    import cpuckpt.integrations.megatron as ckpt_mg
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.guard import DIR_MARK, DONE_MARK, FINALIZE_MARK, watch_async_queue
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    rank, _, device = _setup()
    out: dict = {}
    full = [True]  # rank 0's disk is full

    # 1. A call the trainer completes (the memory tier's shape): cpuckpt's finalize, then Megatron's.
    own = types.SimpleNamespace(async_calls=deque(), maybe_finalize_async_calls=lambda blocking, no_dist: [])
    watch_async_queue(own, timeout_s=WATCH_S, on_failure=on_failure)
    trainer_root = Path(root) / "trainer"

    def schedule(step: int) -> None:
        directory = trainer_root / f"iter_{step:07d}"
        directory.mkdir(parents=True, exist_ok=True)

        def ours(abandoned: bool = False) -> None:
            pass

        setattr(ours, FINALIZE_MARK, True)
        setattr(ours, DIR_MARK, str(directory))
        setattr(ours, DONE_MARK, lambda: True)

        def metadata() -> None:
            if rank == 0 and full[0]:
                raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata.json"))
            if rank == 0:
                (directory / "metadata.json").write_text("{}")

        fns = [ours, metadata, _megatron_lm_tracker(trainer_root, step, rank)]
        own.async_calls.append(_Call(step, None, types.SimpleNamespace(async_fn=None, async_fn_args=(),
                                                                       finalize_fns=fns)))

    schedule(1)
    out["trainer"] = _outcome(lambda: own.maybe_finalize_async_calls(blocking=False))
    out["trainer_tracker_after_failure"] = (trainer_root / "latest_checkpointed_iteration.txt").exists()

    # 2. A worker's call: megatron-core's own finalize runs megatron-core's metadata_finalize_fn and the tracker.
    queue = watch_async_queue(AsyncCallsQueue(persistent=False), timeout_s=WATCH_S, on_failure=on_failure)
    original_save_config = serialization.save_config

    def save_config(config: Any, checkpoint_dir: str) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(checkpoint_dir) / "metadata.json"))
        original_save_config(config, checkpoint_dir)

    serialization.save_config = save_config  # only rank 0 writes metadata.json
    worker_root = Path(root) / "worker"

    def save(step: int) -> None:
        path = worker_root / f"iter_{step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        request = dist_checkpointing.save(_sharded(step, device), str(path), sharded_strategy=ckpt_mg.save_strategy(),
                                          async_sharded_save=True, **mcore_async_kwargs())
        request.add_finalize_fn(_megatron_lm_tracker(worker_root, step, rank))
        queue.schedule_async_request(request)

    try:
        save(1)
        out["worker"] = _outcome(lambda: queue.maybe_finalize_async_calls(blocking=True))
        out["worker_tracker_after_failure"] = (worker_root / "latest_checkpointed_iteration.txt").exists()

        # 3. Space again: the next saves of both kinds finalize on every rank, and the trackers name them.
        full[0] = False
        schedule(2)
        own.maybe_finalize_async_calls(blocking=False)
        save(2)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        serialization.save_config = original_save_config
        queue.close(abort=True)
    dist.barrier()
    if rank == 0:
        out["trackers"] = [(r / "latest_checkpointed_iteration.txt").read_text() for r in (trainer_root, worker_root)]
    return out


@pytest.mark.parametrize("on_failure", ["raise", "continue"])
def test_megatron_finalize_failing_on_rank_0_fails_every_rank_alike(run_ranks, tmp_path, on_failure):
    results = run_ranks(2, rank_megatron_finalize_fails_on_rank_0, str(tmp_path), on_failure, timeout_s=240, env=ENV)
    for kind in ("trainer", "worker"):
        outcomes = [r[kind] for r in results]
        assert outcomes[0] == outcomes[1], (kind, outcomes)  # the same branch, class and message on every rank
        if on_failure == "continue":  # logged on every rank: nothing raised
            assert outcomes[0]["type"] is None, (kind, outcomes)
        else:  # the contract's error: a StorageIOError (an OSError) naming the rank, the path and the checkpoint
            o = outcomes[0]
            assert o["type"] == "cpuckpt.errors.StorageIOError" and o["errno"] == errno.ENOSPC, (kind, o)
            assert o["rank"] == 0 and "failed on rank 0" in o["message"], (kind, o)
            assert "metadata.json" in o["message"] and f"{kind}/iter_0000001" in o["message"], (kind, o)
        # no tracker names a checkpoint whose metadata.json could not be written
        assert not results[0][f"{kind}_tracker_after_failure"], (kind, results[0])
    assert results[0]["trackers"] == ["2", "2"], results[0]


def rank_plan_reuse(root: str, reuse_plan: bool, use_cached: bool, fully_parallel: bool) -> list[str]:
    """Six async saves through Megatron's queue; every save changes every value, two change the structure.

    1: planned by DCP; 2: new tensor objects, same structure; 3: step 2's tensor objects, new values
    written in place; 4: 'w' split along dim 1 (every rank's shard changes shape); 5: as 4, new values;
    6: a new key. Right after each save is scheduled the trainer overwrites the tensors (-7). Each
    checkpoint must load bit-exact with its own step's values, never an earlier step's (a stale plan
    or stale tensor references would write those).
    """
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.strategy import CpuckptLoadStrategy, CpuckptSaveStrategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    rank, world, device = _setup()
    base = CpuckptSaveStrategy(reuse_plan=reuse_plan)
    base.use_cached_ckpt_structure = use_cached  # as Megatron-LM sets it for --ckpt-assume-constant-structure
    strategy = FullyParallelSaveStrategyWrapper(base, dist.group.WORLD) if fully_parallel else base

    def extra_local(step: int) -> torch.Tensor:
        return _full("x", step, device).chunk(world, dim=0)[rank].contiguous()

    def state(step: int, split: int, tensors: tuple | None = None) -> tuple[dict, tuple]:
        w = _full("w", step, device).chunk(world, dim=split)[rank].contiguous()
        b = _full("b", step, device)[0].contiguous()
        if tensors is not None:  # the previous step's tensor objects, new values in place
            tensors[0].copy_(w)
            tensors[1].copy_(b)
            w, b = tensors
        sd = {"w": ShardedTensor.from_rank_offsets("layer.w", w, (split, rank, world)),
              "b": ShardedTensor.from_rank_offsets("layer.b", b, replica_id=rank),
              "obj": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
              "iteration": step}
        if step >= 6:
            sd["extra"] = ShardedTensor.from_rank_offsets("layer.extra", extra_local(step), (0, rank, world))
        return sd, (w, b)

    queue = AsyncCallsQueue(persistent=False)
    planned, tensors = [], None
    for step in range(1, 7):
        split = 1 if step >= 4 else 0
        sd, tensors = state(step, split, tensors if step == 3 else None)
        path = Path(root) / f"iter_{step}"
        path.mkdir(exist_ok=True)
        request = dist_checkpointing.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                          **mcore_async_kwargs())
        planned.append(f"{base.last_save_stats.planned}/{base.last_save_stats.resolved}")
        queue.schedule_async_request(request)
        for t in tensors:  # the trainer moves on at once
            t.fill_(-7.0)
        if "extra" in sd:
            sd["extra"].data.fill_(-7.0)
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for step in range(1, 7):
        split = 1 if step >= 4 else 0
        path = str(Path(root) / f"iter_{step}")
        for load_strategy in (None, CpuckptLoadStrategy()):  # stock megatron-core, then ours
            template = _template(device, split_dim=split)
            if step >= 6:
                template["extra"] = ShardedTensor.from_rank_offsets(
                    "layer.extra", torch.full_like(extra_local(step), float("nan")), (0, rank, world))
            kwargs = {} if load_strategy is None else {"sharded_strategy": load_strategy}
            loaded = dist_checkpointing.load(template, path, **kwargs)
            _check(loaded, step, device, split_dim=split)
            if step >= 6:
                assert torch.equal(loaded["extra"].cpu(), extra_local(step).cpu()), f"extra differs at step {step}"
    return planned


@pytest.mark.parametrize(("reuse_plan", "use_cached", "fully_parallel"),
                         [(True, False, False), (False, True, True), (False, False, False)],
                         ids=["reuse", "use_cached_ckpt_structure-fully-parallel", "reuse-off"])
def test_plan_reuse_never_writes_stale_values(run_ranks, tmp_path, reuse_plan, use_cached, fully_parallel):
    # NeMo-RL#3312: an async save that cached the checkpoint structure wrote an earlier step's weights.
    results = run_ranks(2, rank_plan_reuse, str(tmp_path), reuse_plan, use_cached, fully_parallel,
                        timeout_s=300, env=ENV)
    # with reuse, a save of the previous save's tensor objects (3) takes the items cached from the flat state
    # (integrations/megatron/flatstate.py): no translation, no DCP; new tensor objects (2, 5) reuse the plan only
    expected = (["dcp/planner", "reused/planner", "reused/cached", "dcp/planner", "reused/planner", "dcp/planner"]
                if reuse_plan or use_cached else ["dcp/planner"] * 6)
    for planned in results:
        assert planned == expected, planned


# ------------------------------------------------------------- dead checkpoint workers (Megatron hardening)
# Each runs with megatron-core's queue ("mcore") and, where megatron-core >= 0.17 and nvidia-resiliency-ext
# are installed (the GPU machine), with nvidia-resiliency-ext's ("nvrx", Megatron-LM's default).
def _has_nvrx() -> bool:
    import importlib.util

    from megatron.core.package_info import __version__

    return importlib.util.find_spec("nvidia_resiliency_ext") is not None and \
        tuple(int(x) for x in __version__.split(".")[:2]) >= (0, 17)


KINDS = ["mcore", pytest.param("nvrx", marks=pytest.mark.skipif(not _has_nvrx(), reason="needs megatron-core >= 0.17 "
                                                                                         "and nvidia-resiliency-ext"))]


def _queue(kind: str):
    """A persistent-worker ``AsyncCallsQueue`` of ``kind``, and the ``dist_checkpointing.save`` kwargs for it."""
    import torch
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs

    if kind == "nvrx":
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        # without a GPU its worker may not touch CUDA: cpu_shm_mode skips that (no effect on cpuckpt's requests)
        return AsyncCallsQueue(persistent=True, **({} if torch.cuda.is_available() else {"cpu_shm_mode": True})), \
            {"async_strategy": "nvrx"}
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=True), mcore_async_kwargs()


def _worker_pids(queue) -> list[int]:
    """This rank's checkpoint worker process(es) of the queue's pending calls (any megatron-core version)."""
    from cpuckpt.integrations.megatron.compat import AsyncQueueShape

    shape = AsyncQueueShape(queue)
    return sorted({p.pid for call in shape.pending() for p in shape.processes(call.async_caller)})


def _leftovers() -> list[str]:
    from cpuckpt.integrations.megatron.worker import _channel_dir

    return sorted(p.name for p in _channel_dir().glob(f"cpuckpt-megatron-p{os.getpid()}-*"))


def rank_worker_dies_before_request(root: str, kind: str) -> dict:
    """Rank 0's persistent worker is SIGKILLed before it takes the first save: it never writes to
    cpuckpt's channel, so only the queue side can see it (megatron-core would wait forever)."""
    import signal
    import time

    import cpuckpt.integrations.megatron as ckpt_mg
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import async_utils

    rank, _, device = _setup()
    queue, save_kwargs = _queue(kind)
    ckpt_mg.watch_async_queue(queue, timeout_s=WATCH_S)
    path = Path(root) / "iter_1"
    path.mkdir(exist_ok=True)
    request = dist_checkpointing.save(_sharded(1, device), str(path), sharded_strategy=ckpt_mg.save_strategy(),
                                      async_sharded_save=True, **save_kwargs)
    alive_file = Path(request.async_fn_args[0] + ".alive")
    # megatron-core 0.17+: the worker is started before any save (Megatron-LM's init_persistent_async_worker).
    # (nvidia-resiliency-ext replaces a dead pre-started worker itself, so there it is killed as on 0.16.)
    if kind == "mcore" and hasattr(async_utils.AsyncCallsQueue, "warmup_persistent_caller"):
        async_utils.AsyncCallsQueue.warmup_persistent_caller(rank)
        worker = async_utils.PersistentAsyncCaller._persistent_process
        if rank == 0:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(30)
        queue.schedule_async_request(request)
    else:  # the first save spawns it; a spawned worker needs seconds to start, so it dies first
        queue.schedule_async_request(request)
        worker = queue.persistent_caller.process
        if rank == 0:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(30)
    taken = alive_file.exists() if rank == 0 else None  # did the killed worker ever write to the channel?
    dist.barrier()
    t0 = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    elapsed = time.monotonic() - t0
    queue.close(abort=True)
    return {"error": error, "elapsed": elapsed, "killed_exitcode": worker.exitcode if rank == 0 else None,
            "taken": taken, "metadata_json": (path / "metadata.json").exists(), "leftovers": _leftovers()}


@pytest.mark.parametrize("kind", KINDS)
def test_persistent_worker_killed_before_first_save_raises_on_every_rank(run_ranks, tmp_path, kind):
    results = run_ranks(2, rank_worker_dies_before_request, str(tmp_path), kind, timeout_s=120, env=ENV)
    assert results[0]["killed_exitcode"] == -9, results
    assert results[0]["taken"] is False, "the worker took the save before it was killed: not the case under test"
    for r in results:
        assert r["error"] is not None and "WorkerDiedError" in r["error"], r
        assert "rank 0's persistent checkpoint worker ended" in r["error"] and "exit code -9" in r["error"], r
        assert not r["metadata_json"], "metadata.json written for a save no worker took"
        assert r["elapsed"] < WATCH_S, r
        assert r["leftovers"] == [], "channel files left behind"


def rank_continue_after_failure(root: str, stage_hooks: list[str], kind: str) -> dict:
    """``on_failure: continue``: save k fails (``stage_hooks[k]`` acts in rank 0's worker: a kill, a raise), the save
    after the last failure must succeed on the workers then running and load; a failed save gets no metadata.json;
    every rank logs each failure."""
    import logging
    import time

    import cpuckpt.integrations.megatron as ckpt_mg
    from megatron.core import dist_checkpointing

    from cpuckpt.testing import faults

    _, _, device = _setup()
    errors: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    logging.getLogger("cpuckpt.integrations.megatron.guard").addHandler(Grab())
    queue, save_kwargs = _queue(kind)
    ckpt_mg.watch_async_queue(queue, timeout_s=WATCH_S, config={"megatron": {"on_failure": "continue"}})
    strategy = ckpt_mg.save_strategy()
    pids, elapsed = [], []
    steps = range(1, len(stage_hooks) + 2)
    for step in steps:
        faults.install(stage_hooks[step - 1] if step <= len(stage_hooks) else "")  # travels with its request
        path = Path(root) / f"iter_{step}"
        path.mkdir(exist_ok=True)
        request = dist_checkpointing.save(_sharded(step, device), str(path), sharded_strategy=strategy,
                                          async_sharded_save=True, **save_kwargs)
        queue.schedule_async_request(request)
        pids.append(_worker_pids(queue))
        t0 = time.monotonic()
        queue.maybe_finalize_async_calls(blocking=True)  # must neither raise nor hang
        elapsed.append(time.monotonic() - t0)
    queue.close()
    last = Path(root) / f"iter_{steps[-1]}"
    _check(dist_checkpointing.load(_template(device), str(last)), steps[-1], device)
    _check(dist_checkpointing.load(_template(device, split_dim=1), str(last),
                                   sharded_strategy=ckpt_mg.load_strategy()), steps[-1], device, split_dim=1)
    return {"errors": errors, "pids": pids, "elapsed": elapsed,
            "metadata_json": [(Path(root) / f"iter_{s}" / "metadata.json").exists() for s in steps],
            "leftovers": _leftovers()}


@pytest.mark.parametrize("kind", KINDS)
def test_on_failure_continue_respawns_a_killed_worker_keeps_one_that_raised_and_the_next_save_loads(run_ranks,
                                                                                                   tmp_path, kind):
    # nvidia-resiliency-ext's queue (the GPU machine): the killed worker only, as it always ran
    hooks = ["megatron-worker:rank0=kill", "megatron-worker:rank0=raise"][: 2 if kind == "mcore" else 1]
    results = run_ranks(2, rank_continue_after_failure, str(tmp_path), hooks, kind, timeout_s=180, env=ENV)
    for r in results:
        assert len(r["errors"]) == len(hooks) and all("training continues" in e for e in r["errors"]), r
        killed, *raised = r["errors"]
        # found by the channel ("ended without reporting") or by the persistent worker's exit ("worker ended")
        found = ("WorkerDiedError", "ended without reporting", "persistent checkpoint worker ended")
        assert any(m in killed for m in found), r
        assert all("checkpoint worker of rank 0" in e or "ended without reporting" in e for e in raised), r
        assert r["metadata_json"] == [False] * len(hooks) + [True], r
        assert r["leftovers"] == [], "channel files left behind"
        assert all(t < WATCH_S for t in r["elapsed"][: len(hooks)]), r
        # a dead worker is replaced on every rank; one that raised lives on
        assert r["pids"][0] and r["pids"][1] and set(r["pids"][0]).isdisjoint(r["pids"][1]), r
        if raised:
            assert r["pids"][1] == r["pids"][2], r


def test_silent_worker_is_dead_after_heartbeat_timeout(run_ranks, tmp_path):
    # rank 0's worker takes the save, then stops beating (sleeps at its fault point): dead after 3 s,
    # set through the environment (CPUCKPT_MEGATRON_<KEY>). The heartbeat is cpuckpt's channel, alike for either
    # caller: a temporal (forked) worker, not a spawned one (seconds of imports); a dead persistent worker is
    # found by the tests above (killed before its first save, mid-save, while idle)
    env = dict(ENV, CPUCKPT_TEST_HOOK="megatron-worker:rank0=sleep:120", CPUCKPT_MEGATRON_HEARTBEAT_TIMEOUT_S="3")
    results = run_ranks(2, rank_async_failure, str(tmp_path), False, None, True, timeout_s=120, env=env)
    for r in results:
        assert r["error"] is not None and "WorkerDiedError" in r["error"] and "silent for" in r["error"], r
        assert not r["metadata_json"]
        assert r["elapsed"] < WATCH_S, r


def rank_worker_dies_idle(root: str, kind: str) -> dict:
    """Rank 0's persistent worker is SIGKILLed between saves (nothing pending); ``close()`` must not
    wait forever for it to acknowledge its stop (megatron-core's own close would)."""
    import signal
    import time

    import cpuckpt.integrations.megatron as ckpt_mg
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    rank, _, device = _setup()
    queue, save_kwargs = _queue(kind)
    ckpt_mg.watch_async_queue(queue, timeout_s=WATCH_S)
    path = Path(root) / "iter_1"
    path.mkdir(exist_ok=True)
    queue.schedule_async_request(dist_checkpointing.save(
        _sharded(1, device), str(path), sharded_strategy=ckpt_mg.save_strategy(), async_sharded_save=True,
        **save_kwargs))
    [pid] = _worker_pids(queue)
    queue.maybe_finalize_async_calls(blocking=True)
    if rank == 0:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    dist.barrier()
    t0 = time.monotonic()
    queue.close()
    return {"elapsed": time.monotonic() - t0, "metadata_json": (path / "metadata.json").exists()}


@pytest.mark.parametrize("kind", KINDS)
def test_close_does_not_wait_for_a_worker_that_died_idle(run_ranks, tmp_path, kind):
    results = run_ranks(2, rank_worker_dies_idle, str(tmp_path), kind, timeout_s=120, env=ENV)
    for r in results:
        assert r["metadata_json"] and r["elapsed"] < 20, r


_STUBS_PROBE = """
import sys
if sys.argv[1] == "probe":  # a spec asked for without an import (as is_torch_available() helpers do) comes first
    import importlib.util
    assert importlib.util.find_spec("torch") is not None
    assert "torch" not in sys.modules
if sys.argv[1] != "none":
    import torch
    print(torch.cuda.device_count.__name__, torch.cuda.current_device())
print("torch" in sys.modules)
"""


def test_the_spawned_processes_stubs_come_with_torch_and_only_then():
    """The fixture's sitecustomize (megatron-core's spawned worker gets the stubs through it) installs them right after
    torch is imported, also when a spec of torch was asked for first, and a process that never imports torch (a
    memory tier's writer) does not import it for the stubs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the stubs patch nothing where CUDA is present")
    env = {**os.environ, "CPU_CI_CUDA_STUBS": "1", "PYTHONPATH": STUBS}
    out = {how: subprocess.run([sys.executable, "-c", _STUBS_PROBE, how], env=env, capture_output=True, text=True,
                               timeout=120, check=True).stdout.split()
           for how in ("import", "probe", "none")}
    assert out == {"import": ["<lambda>", "cpu", "True"], "probe": ["<lambda>", "cpu", "True"], "none": ["False"]}, out
