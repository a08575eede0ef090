"""The Megatron adapter's ``ordering: optimizer`` with real megatron-core on 2 gloo ranks.

The strategy returns once the save's device-to-host copies are enqueued; the next optimizer step
orders itself after them (``hook.order_optimizer_steps`` wraps megatron-core's optimizer classes);
a MoE ``expert_bias``, which Megatron updates in ``finalize_model_grads`` *before* that step, is
cloned at save time. Proven here (on CPU in CI; on the device the same test runs with GPU tensors
and the persistent caller, which does not synchronize the device):

- without the optimizer steps wrapped, the strategy refuses the mode with a ``ConfigError`` that
  names the fix;
- after a save scheduled through Megatron's ``AsyncCallsQueue``, the "finalize_model_grads" update of
  ``expert_bias`` runs at once, a wrapped megatron-core optimizer step orders the pending copies
  before its own body runs, and the "step" then overwrites every saved tensor; the checkpoint holds
  the save's values bit-exact (loaded back through megatron-core with stock torch_dist).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

STUBS = str(Path(__file__).resolve().parent / "cpu_ci_cuda_stubs")
ENV = {"CPU_CI_CUDA_STUBS": "1", "PYTHONPATH": os.pathsep.join([STUBS, os.environ.get("PYTHONPATH", "")])}
BIAS_KEY = "decoder.layers.0.mlp.router.expert_bias"


def _setup() -> str:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, STUBS)
    import cpu_ci_cuda_stubs

    cpu_ci_cuda_stubs.install()
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return "cuda"
    return "cpu"


def _values(step: int, device: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(8, 6, generator=g).to(device), "b": torch.randn(6, generator=g).to(device),
            "bias": torch.randn(4, generator=g).to(device)}


def _sharded(v: dict) -> dict:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "w": ShardedTensor.from_rank_offsets("layer.w", v["w"], (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("layer.b", v["b"], replica_id=rank),
        "bias": ShardedTensor.from_rank_offsets(BIAS_KEY, v["bias"], replica_id=rank),
        "iteration": 3,
    }


def rank_optimizer_ordering(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import hook, strategy
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from cpuckpt.errors import ConfigError

    device = _setup()
    rank = dist.get_rank()
    out: dict = {}
    ours = strategy.CpuckptSaveStrategy(ordering="optimizer")
    path = Path(root) / "iter_3"
    path.mkdir(parents=True, exist_ok=True)
    try:
        ours.async_save(_sharded(_values(3, device)), path)
    except ConfigError as e:
        out["refused"] = str(e)
    out["wrapped"] = hook.order_optimizer_steps()

    live = _values(3, device)  # the trainer's tensors
    want = {k: t.detach().cpu().clone() for k, t in live.items()}
    queue = AsyncCallsQueue(persistent=torch.cuda.is_available())
    request = dist_checkpointing.save(_sharded(live), str(path), sharded_strategy=ours, async_sharded_save=True,
                                      **mcore_async_kwargs())
    queue.schedule_async_request(request)
    out["pending_after_save"] = len(strategy._PENDING)
    live["bias"].add_(1.0)  # finalize_model_grads' expert_bias update, before the optimizer step
    bare = FP32Optimizer.__new__(FP32Optimizer)  # the real (wrapped) step; its body needs a built optimizer
    try:
        bare.step()
    except AttributeError:
        pass  # the original body ran after the ordering (and failed on the bare instance)
    out["pending_after_step"] = len(strategy._PENDING)
    with torch.no_grad():  # the step's updates: every saved tensor changes
        live["w"].fill_(-7.0)
        live["b"].fill_(-7.0)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()

    template = _sharded({k: torch.full_like(t, float("nan")) for k, t in live.items()})
    loaded = dist_checkpointing.load(template, str(path))
    for key in ("w", "b", "bias"):
        got = loaded[key].detach().cpu()
        assert torch.equal(got.view(torch.uint8), want[key].view(torch.uint8)), f"rank {rank}: {key} differs"
    return out


@pytest.mark.timeout(240)
def test_optimizer_ordering_keeps_the_save_step(run_ranks, tmp_path):
    results = run_ranks(2, rank_optimizer_ordering, str(tmp_path), timeout_s=180, env=ENV)
    for rank, out in enumerate(results):
        assert "order_optimizer_steps()" in out["refused"], (rank, out)
        assert {"MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer"} <= set(out["wrapped"]), (rank, out)
        assert out["pending_after_save"] == 1, (rank, out)
        assert out["pending_after_step"] == 0, (rank, out)  # the wrapped step ordered the save before its body


def rank_deferred_start(root: str) -> dict:
    """With a watched queue the save is only recorded; the queue's next finalize starts it (deferred.py)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import deferred, hook, strategy
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.guard import watch_async_queue
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.optimizer.optimizer import FP32Optimizer

    device = _setup()
    rank = dist.get_rank()
    hook.order_optimizer_steps()
    queue = watch_async_queue(AsyncCallsQueue(persistent=torch.cuda.is_available()), 60.0)
    ours = strategy.CpuckptSaveStrategy(ordering="optimizer")
    out: dict = {"enabled": deferred.enabled()}

    held: list = []

    def save(step: int, live: dict) -> Path:
        path = Path(root) / f"iter_{step}"
        path.mkdir(parents=True, exist_ok=True)
        sharded = _sharded(live)
        held[:] = [weakref.ref(sharded["w"])]
        request = dist_checkpointing.save(sharded, str(path), sharded_strategy=ours, async_sharded_save=True,
                                          **mcore_async_kwargs())
        del sharded
        queue.schedule_async_request(request)
        return path

    def check(path: Path, want: dict) -> None:
        template = _sharded({k: torch.full_like(t, float("nan")) for k, t in want.items()})
        loaded = dist_checkpointing.load(template, str(path))
        for key in ("w", "b", "bias"):
            got = loaded[key].detach().cpu()
            assert torch.equal(got.view(torch.uint8), want[key].cpu().view(torch.uint8)), f"rank {rank}: {key}"

    # 1. A training iteration: recorded at the save, started by the next (non-blocking) finalize, ordered by the step.
    live = _values(3, device)
    want = {k: t.detach().cpu().clone() for k, t in live.items()}
    path = save(3, live)
    out["recorded"] = len(deferred._STARTS)
    out["pending_at_save"] = len(strategy._PENDING)
    out["files_at_save"] = sorted(p.name for p in path.glob("__*"))
    gc.collect()
    out["held_while_recorded"] = held[0]() is not None
    queue.maybe_finalize_async_calls(blocking=False)
    out["recorded_after_finalize"] = len(deferred._STARTS)
    out["pending_after_finalize"] = len(strategy._PENDING)
    gc.collect()  # started, not finalized: Megatron's sharded state dict is no longer held (it would age into the
    out["held_after_start"] = held[0]() is not None  # trainer's oldest GC generation, bringing full collections)
    live["bias"].add_(1.0)  # finalize_model_grads' expert_bias update (cloned at the save)
    bare = FP32Optimizer.__new__(FP32Optimizer)
    try:
        bare.step()
    except AttributeError:
        pass  # the wrapped step ordered the save, then its body failed on the bare instance
    out["pending_after_step"] = len(strategy._PENDING)
    with torch.no_grad():
        live["w"].fill_(-7.0)
        live["b"].fill_(-7.0)
    queue.maybe_finalize_async_calls(blocking=True)
    check(path, want)

    # 2. The last save of a run: a blocking finalize right after it starts it first (no start point came).
    live = _values(4, device)
    want = {k: t.detach().cpu().clone() for k, t in live.items()}
    path = save(4, live)
    out["recorded_last"] = len(deferred._STARTS)
    queue.maybe_finalize_async_calls(blocking=True)
    check(path, want)
    out["recorded_end"] = len(deferred._STARTS)

    # 3. A memory-tier (non-persistent) save is deferred the same way; the link appears when it starts.
    from cpuckpt.integrations.megatron.memory import MegatronMemory

    from cpuckpt.config import Config

    cfg = Config.from_dict({"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
                            "memory": {"root": str(Path(root) / "ram"), "slots": 2, "headroom_bytes": 0}})
    memory = MegatronMemory(Path(root) / "save", Path(root) / "np", cfg)
    ours = strategy.CpuckptSaveStrategy(cfg, ordering="optimizer", memory=memory)
    live = _values(5, device)
    want = {k: t.detach().cpu().clone() for k, t in live.items()}
    link = Path(root) / "np" / "iter_0000005"
    link.mkdir(parents=True, exist_ok=True)
    request = dist_checkpointing.save(_sharded(live), str(link), sharded_strategy=ours, async_sharded_save=True,
                                      **mcore_async_kwargs())
    queue.schedule_async_request(request)
    out["memory_recorded"] = len(deferred._STARTS)
    out["memory_link_at_save"] = link.is_symlink()
    queue.maybe_finalize_async_calls(blocking=True)
    out["memory_link_after"] = link.is_symlink()
    check(link, want)
    memory.close()

    queue.close()
    memory.close()
    return out


@pytest.mark.timeout(240)
def test_a_watched_queue_starts_the_save_after_the_timer(run_ranks, tmp_path):
    results = run_ranks(2, rank_deferred_start, str(tmp_path), timeout_s=180, env=ENV)
    for rank, out in enumerate(results):
        assert out["enabled"], (rank, out)
        assert out["recorded"] == 1 and out["pending_at_save"] == 0, (rank, out)
        assert out["files_at_save"] == [], (rank, out)  # nothing planned or written inside save_checkpoint
        assert out["recorded_after_finalize"] == 0 and out["pending_after_finalize"] == 1, (rank, out)
        assert out["held_while_recorded"] and not out["held_after_start"], (rank, out)
        assert out["pending_after_step"] == 0, (rank, out)
        assert out["recorded_last"] == 1 and out["recorded_end"] == 0, (rank, out)
        assert out["memory_recorded"] == 1 and not out["memory_link_at_save"], (rank, out)
        assert out["memory_link_after"], (rank, out)


def _megatron_lm_cleanup(save_dir, leave_ckpt_num=1, do_async=False) -> None:
    """What Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` does (megatron/training/checkpointing.py,
    not on PyPI): on rank 0, remove every ``iter_*`` directory of ``save_dir`` but the newest ``leave_ckpt_num``,
    without looking at pending saves."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    found = sorted(Path(save_dir).glob("iter_*"), key=lambda p: int(p.name[len("iter_"):]))
    for p in found[:-leave_ckpt_num]:
        shutil.rmtree(p)


def rank_cleanup_finalizes_older_saves(root: str, wrapped: bool) -> dict:
    """Three non-persistent saves left pending (their worker slow to report), then Megatron-LM's cleanup:
    wrapped by the hook, it first finalizes the saves into the directories it removes."""
    import functools
    import types

    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import hook, strategy
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.guard import watch_async_queue
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    device = _setup()
    queue = watch_async_queue(AsyncCallsQueue(persistent=torch.cuda.is_available()), 60.0)
    module = types.SimpleNamespace(cleanup_old_non_persistent_checkpoint=_megatron_lm_cleanup)
    if wrapped:
        hook._finalize_before_cleanup(module, queue_of=lambda: queue)
    ours = strategy.CpuckptSaveStrategy()
    np_dir = Path(root) / "non_persistent"
    tracker = np_dir / "latest_checkpointed_iteration.txt"
    for step in (8, 16, 24):
        module.cleanup_old_non_persistent_checkpoint(str(np_dir), leave_ckpt_num=1, do_async=False)
        dist.barrier()
        path = np_dir / f"iter_{step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        request = dist_checkpointing.save(_sharded(_values(step, device)), str(path), sharded_strategy=ours,
                                          async_sharded_save=True, **mcore_async_kwargs())
        if dist.get_rank() == 0:  # Megatron-LM's iter_finalize_fn: the tracker names the save once finalized
            request.add_finalize_fn(functools.partial(tracker.write_text, str(step)))
        queue.schedule_async_request(request)  # no finalize in between: its worker has not reported yet
    out: dict = {"pending": sorted(Path(fn.cpuckpt_dir).name for call in queue.async_calls
                                   for fn in call.async_request.finalize_fns if hasattr(fn, "cpuckpt_dir"))}
    dist.barrier()
    out["dirs"] = sorted(p.name for p in np_dir.iterdir() if p.name.startswith("iter_"))
    if dist.get_rank() == 0:  # what a crash now restarts from
        named = np_dir / f"iter_{int(tracker.read_text()):07d}" if tracker.exists() else None
        out["tracked"] = (named.name, (named / "metadata.json").is_file()) if named else None
    if not wrapped:  # finalizing now would fail on rank 0 only (it writes metadata.json) and hang rank 1
        queue.async_calls.clear()
        return out
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    if out["dirs"]:  # the kept saves load (metadata.json written), with their own values
        out["loads"] = []
        for name in out["dirs"]:
            want = _values(int(name[len("iter_"):]), device)
            template = _sharded({k: torch.full_like(t, float("nan")) for k, t in want.items()})
            loaded = dist_checkpointing.load(template, str(np_dir / name))
            out["loads"].append(all(torch.equal(loaded[k].cpu(), want[k].cpu()) for k in ("w", "b", "bias")))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapped", [True, False], ids=["hooked", "megatron-lm-alone"])
def test_cleanup_finalizes_the_saves_it_removes(run_ranks, tmp_path, wrapped):
    results = run_ranks(2, rank_cleanup_finalizes_older_saves, str(tmp_path), wrapped, timeout_s=180, env=ENV)
    for rank, out in enumerate(results):
        # the cleanup before the save of 24 removed iter_8 and kept iter_16
        assert out["dirs"] == ["iter_0000016", "iter_0000024"], (rank, out)
        if wrapped:  # ... after finalizing every pending save (8 and 16): the tracker names 16, kept; both load
            assert out["pending"] == ["iter_0000024"], (rank, out)
            assert out["loads"] == [True, True], (rank, out)
            if rank == 0:
                assert out["tracked"] == ("iter_0000016", True), (rank, out)
        else:  # Megatron-LM alone: the save of 8 is still pending, its directory (and metadata.json) gone
            assert out["pending"] == ["iter_0000008", "iter_0000016", "iter_0000024"], (rank, out)
            if rank == 0:  # and no save finalized yet: no tracker
                assert out["tracked"] is None, (rank, out)


