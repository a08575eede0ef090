"""The trainer thread's host work per memory save of a Megatron-shaped state, on the CPU box (an instrument).

``python -m benchmarks.bench_megatron_callpath [--layers 24] [--saves 40] [--replayed] [--profile N] [--smoke]``

A save every iteration costs Megatron-LM jobs Python on the trainer's thread, not copies (BENCHMARKS.md, session 31).
This drives megatron-core's ``dist_checkpointing.save`` with cpuckpt's strategy into the memory tier the way the
Megatron-LM hook does (a watched persistent ``AsyncCallsQueue``, ``ordering: optimizer``: the save starts at the next
top of the iteration), one gloo rank, and times per save:

* ``build``: the sharded state dict (``ShardedTensor``/``ShardedObject`` per parameter and optimizer state, as
  ``generate_state_dict`` builds it every save; megatron-core's work, listed for scale);
* ``save``: ``dist_checkpointing.save`` (megatron-core's ``save_preprocess``, then our strategy's call) and the
  request scheduled;
* ``top``: ``maybe_finalize_async_calls`` at the next top of the iteration (our deferred start, and the finalize of
  the saves that ended);

medians over ``--saves`` saves after ``--warmup``. The state: per layer 6 weights (bf16 model weights, fp32 main
weights, Adam's two moments: 4 tensors each), an embedding, RNG state as ``ShardedObject``s and a few common values;
24 layers make 580 tensors (the Megatron-LM job's device snapshot holds 588). Megatron-LM's cleanup of the
non-persistent directory (the ring's: a few file-system calls) is left out. The last save is loaded back through
stock megatron-core and compared bit for bit. ``--profile N`` prints the N functions of cpuckpt's and
megatron-core's with the most cumulative time over the counted saves (cProfile; slower). No GPU is used: the state
is CPU tensors, so ``top`` also holds the wait for their host fills (the contract for CPU tensors; on a GPU the copy
process copies a device snapshot after the start returns): this measures the Python around the copies, not them.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import os
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("benchmarks.bench_megatron_callpath")

TRACKER = "latest_checkpointed_iteration.txt"
HIDDEN = 64  # small tensors: the Python per tensor is what is measured, not bytes


def _cuda_noops() -> None:
    """megatron-core's async machinery calls torch.cuda functions even on a gloo job; on a CPU box they are no-ops
    here (as in tests/integrations' stubs). With a GPU nothing is patched."""
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1


class Model:
    """Persistent tensors, as a model and its optimizer hold them across iterations."""

    def __init__(self, layers: int) -> None:
        shapes = {"qkv": (3 * HIDDEN, HIDDEN), "proj": (HIDDEN, HIDDEN), "fc1": (4 * HIDDEN, HIDDEN),
                  "fc2": (HIDDEN, 4 * HIDDEN), "ln1": (HIDDEN,), "ln2": (HIDDEN,)}
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        for layer in range(layers):
            for name, shape in shapes.items():
                key = f"decoder.layers.{layer}.{name}.weight"
                self.params[key] = {"model": torch.randn(shape).to(torch.bfloat16), "fp32": torch.randn(shape),
                                    "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
        emb = (512, HIDDEN)
        self.params["embedding.word_embeddings.weight"] = {"model": torch.randn(emb).to(torch.bfloat16),
                                                           "fp32": torch.randn(emb), "exp_avg": torch.zeros(emb),
                                                           "exp_avg_sq": torch.zeros(emb)}

    def step(self) -> None:
        for tensors in self.params.values():
            tensors["fp32"].add_(1.0)

    def sharded_state_dict(self, iteration: int) -> dict[str, Any]:
        """A new sharded state dict over the same tensors (``generate_state_dict``'s shape, simplified)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        model = {k: ShardedTensor.from_rank_offsets(k, t["model"]) for k, t in self.params.items()}
        state = {f"optimizer.state.{kind}.{k}": ShardedTensor.from_rank_offsets(f"optimizer.state.{kind}.{k}", t[kind])
                 for k, t in self.params.items() for kind in ("fp32", "exp_avg", "exp_avg_sq")}
        rng = [ShardedObject("rng_state", {"random": (3, iteration), "torch": torch.ByteTensor(5056),
                                           "cuda": torch.ByteTensor(16)}, (1, 1, 1), (0, 0, 0), replica_id=0)]
        return {"model": model, "optimizer": {"param_state": state,
                                              "param_groups": [{"lr": 1e-4, "step": iteration, "params": list(range(
                                                  len(self.params)))}]},
                "rng_state": rng, "iteration": iteration, "checkpoint_version": 3.0,
                "opt_param_scheduler": {"num_steps": iteration * 4, "max_lr": 1e-4}, "args": {"hidden": HIDDEN}}


class _Capture:
    """What a replayed save's marker stands for (``megatron: {reuse_state_dict: true}``): the model's and optimizer's
    ``ShardedTensor``s of one build, handed back save after save (:func:`cpuckpt.integrations.megatron.replay.take`)."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors

    def replayed(self) -> list[Any]:
        return list(self.tensors)


def replayed_state_dict(model: Model, iteration: int, capture: _Capture | None) -> tuple[dict[str, Any], _Capture]:
    """The state dict of a replayed save: Megatron-LM's small parts built, the tensors behind the replay's marker
    (built once, at the first save)."""
    from cpuckpt.integrations.megatron.replay import MARKER_KEY, ReplayedTensors

    sd = model.sharded_state_dict(iteration)
    if capture is None:  # a full build first (validated by megatron-core), as Megatron-LM's first save
        return sd, _Capture([*sd["model"].values(), *sd["optimizer"]["param_state"].values()])
    small = {k: v for k, v in sd.items() if k != "model"}
    small["optimizer"] = {"param_groups": sd["optimizer"]["param_groups"]}
    small[MARKER_KEY] = ReplayedTensors(MARKER_KEY, capture)
    return small, capture


def _verify(dist_checkpointing: Any, model: Model, path: Path, iteration: int) -> None:
    """The last save loads (stock megatron-core, through the slot's link) with the model's bytes: the saves timed
    were real ones."""
    template = model.sharded_state_dict(iteration)
    for sh in [*template["model"].values(), *template["optimizer"]["param_state"].values()]:
        sh.data = torch.full_like(sh.data, float("nan"))
    loaded = dist_checkpointing.load(template, str(path))
    for key, tensors in model.params.items():
        got = loaded["model"][key], *(loaded["optimizer"]["param_state"][f"optimizer.state.{kind}.{key}"]
                                      for kind in ("fp32", "exp_avg", "exp_avg_sq"))
        want = tensors["model"], tensors["fp32"], tensors["exp_avg"], tensors["exp_avg_sq"]
        if not all(torch.equal(g, w) for g, w in zip(got, want)):
            raise AssertionError(f"{path}: {key} does not load as saved")
    if loaded["iteration"] != iteration:
        raise AssertionError(f"{path}: iteration {loaded['iteration']} loaded, {iteration} saved")
    print(f"verified: {path.name} loads bit-exact ({4 * len(model.params)} tensors)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    _cuda_noops()
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.guard import watch_async_queue
    from cpuckpt.integrations.megatron.hook import order_optimizer_steps
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy, order_pending_saves
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config

    tmp = Path(tempfile.mkdtemp(prefix="cpuckpt-callpath-", dir=args.dir))  # after the imports, which may fail
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    cfg = {"io": {"chunk_bytes": "1MiB", "threads": 2, "backend": "buffered"}, "timeout_s": 120,
           "memory": {"root": str(tmp / "ram"), "slots": 3, "headroom_bytes": 0, "persist_every": 0}}
    queue = watch_async_queue(AsyncCallsQueue(persistent=True), 120)
    router = MegatronMemory(tmp / "save", tmp / "save" / "non_persistent", Config.from_dict(cfg),
                            queue_of=lambda: queue)
    order_optimizer_steps()  # what the hook installs: the optimizer steps order their writes after the saves
    strategy = CpuckptSaveStrategy(cfg, memory=router, ordering="optimizer")
    np_dir = router.np_dir
    model = Model(args.layers)
    times: dict[str, list[float]] = {"build": [], "save": [], "top": []}
    profile = cProfile.Profile() if args.profile else None
    capture: _Capture | None = None
    total = args.warmup + args.saves
    try:
        for it in range(1, total + 1):
            counted = it > args.warmup
            if profile is not None and it == args.warmup + 1:
                profile.enable()
            t0 = time.perf_counter()
            queue.maybe_finalize_async_calls(blocking=False)  # the top of the iteration: starts the last save
            t1 = time.perf_counter()
            order_pending_saves()  # the wrapped optimizer step's first call
            model.step()
            t2 = time.perf_counter()
            if args.replayed:
                sd, capture = replayed_state_dict(model, it, capture)
            else:
                sd = model.sharded_state_dict(it)
            t3 = time.perf_counter()
            path = np_dir / f"iter_{it:07d}"
            path.mkdir(parents=True, exist_ok=True)
            # validated once, as Megatron-LM does under --ckpt-assume-constant-structure (every save otherwise)
            request = dist_checkpointing.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                              validate_access_integrity=it == 1, **mcore_async_kwargs())

            def tracker(it: int = it) -> None:  # Megatron-LM's finalize: the directory's tracker
                (np_dir / TRACKER).write_text(str(it))

            request.add_finalize_fn(tracker)
            queue.schedule_async_request(request)
            t4 = time.perf_counter()
            del sd
            if counted:
                if it > args.warmup + 1:  # the top of this iteration finalized a counted save
                    times["top"].append((t1 - t0) * 1e3)
                times["build"].append((t3 - t2) * 1e3)
                times["save"].append((t4 - t3) * 1e3)
        if profile is not None:
            profile.disable()
        queue.maybe_finalize_async_calls(blocking=True)
        _verify(dist_checkpointing, model, np_dir / f"iter_{total:07d}", total)
    finally:
        queue.close()
        router.close()
        # megatron-core's caller logs its rank when collected: before the group goes
        queue = router = strategy = capture = request = None  # type: ignore[assignment]
        gc.collect()
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"layers": args.layers, "tensors": 4 * len(model.params), "saves": args.saves,
           **{k: statistics.median(v) for k, v in times.items() if v}}
    print(f"megatron-shaped state: {out['tensors']} tensors, {args.saves} saves; medians per save (ms):")
    for k in ("build", "save", "top"):
        if k in out:
            print(f"  {k:6s} {out[k]:7.2f}  (min {min(times[k]):.2f}, max {max(times[k]):.2f})")
    if profile is not None:
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative")
        rows = [(fn, st) for fn, st in stats.stats.items() if "cpuckpt" in fn[0] or "megatron" in fn[0]]  # type: ignore[attr-defined]
        rows.sort(key=lambda r: -r[1][3])
        print(f"cumulative ms per save (cProfile, {args.saves} saves):")
        for (file, line, name), st in rows[: args.profile]:
            short = file.split("site-packages/")[-1]
            print(f"  {st[3] / args.saves * 1e3:8.3f}  {name} ({short}:{line})")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--saves", type=int, default=40, help="counted saves")
    p.add_argument("--warmup", type=int, default=6, help="saves not counted (the first plans, caches fill)")
    p.add_argument("--profile", type=int, default=0, help="print the N cpuckpt/megatron functions with the most "
                                                         "cumulative time (cProfile)")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--replayed", action="store_true", help="hand the tensors as a replayed save does (the same "
                                                          "ShardedTensors behind the replay's marker every save)")
    p.add_argument("--smoke", action="store_true", help="a tiny run that keeps the script working")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.saves, args.warmup = 2, 3, 3
    logging.basicConfig(level=logging.WARNING)
    run(args)


if __name__ == "__main__":
    main()
