"""Per-item cost of the save call path for many small tensors, warm, in one run (see BENCHMARKING.md).

``python -m benchmarks.bench_callpath [--items 1422] [--shape 8x8] [--reps 15] [--rounds 3] [--out DIR] [--smoke]``
(CPU box or device machine; tensors on CUDA when present unless ``--device cpu``). One process, one
rank. The state is ``--items`` fp32 tensors of ``--shape`` plus a few non-tensor values; each save
passes fresh ``detach()`` aliases of the same tensors (what ``module.state_dict()`` returns) after the
trainer changed their values in place. Per save:

* call: wall time of ``cpuckpt.async_save`` (device synchronised before);
* stall: from the call to ``handle.staged.wait()`` returning (device synchronised after): the time the
  training thread is blocked;

each divided by the number of items, median (min-max) over ``--reps`` warm saves. A process keeps
one plan and one item cache per process group, so the variants run in blocks, round-robin over
``--rounds`` rounds so drift hits them alike; each block starts with ``WARMUP`` saves (the first
plans with DCP) that are not counted. Variants:

* ``pool``: ``async_save`` to a new directory (``--dir``, default tmpfs), staged in the host pool;
* ``images``: ``async_save(sink=ImageSet(...))`` into one reused memory-image directory (the memory
  tier's path, without its writer process);
* each ``cached`` (the previous save's resolved items reused: ``backend.itemcache``) and ``plan reuse``
  (the before: a ``DefaultSavePlanner`` subclass whose own ``resolve_data`` keeps every save on the
  plan-reuse path, which resolves each item through the planner).

The target (BENCHMARKING.md): <= 10 us per item on the call path with an unchanged structure. Raw
results go to ``DIR/bench_callpath.json``; ``--smoke`` runs a tiny case to keep the script working.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import cpuckpt
from benchmarks.common import ResultLog, device_sync, format_table, summarize
from cpuckpt.tier.images import ImageSet

logger = logging.getLogger("benchmarks.bench_callpath")

WARMUP = 3  # per block: DCP plans the first save, the second builds the item cache


class PlannerResolved(DefaultSavePlanner):
    """DCP's default planner with ``resolve_data`` of its own: saves stay on the plan-reuse path (the before)."""

    def resolve_data(self, write_item: Any) -> Any:
        return super().resolve_data(write_item)


class Trainer:
    """Tensors that live across steps, changed in place between saves."""

    def __init__(self, items: int, shape: tuple[int, ...], device: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = {f"layers.{i}.weight": torch.randn(shape, generator=g).to(device) for i in range(items)}
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        self.step += 1
        with torch.no_grad():
            for t in list(self.params.values())[:: max(1, len(self.params) // 16)]:
                t.add_(1.0)  # a few in-place updates: the values change, the storages do not
        return {"model": {k: v.detach() for k, v in self.params.items()},
                "extra": {"step": self.step, "lr": 1e-3, "name": "bench"}}


def _variants(pool_dir: Path, ram_dir: Path, images: dict[str, ImageSet],
              ) -> dict[str, Callable[[dict, int], cpuckpt.AsyncSaveHandle]]:
    cfg = {"io": {"threads": 4}}
    images.update({name: ImageSet(ram_dir / name, pin=True) for name in ("cached", "plan")})

    def pool(cached: bool) -> Callable[[dict, int], cpuckpt.AsyncSaveHandle]:
        def save(sd: dict, k: int) -> cpuckpt.AsyncSaveHandle:
            path = pool_dir / f"{'c' if cached else 'p'}{k}"
            if cached:
                return cpuckpt.async_save(sd, path, cfg, step=k)
            return cpuckpt.async_save(sd, path, cfg, step=k, planner=PlannerResolved(), plan_key="bench")
        return save

    def image(cached: bool) -> Callable[[dict, int], cpuckpt.AsyncSaveHandle]:
        name = "cached" if cached else "plan"

        def save(sd: dict, k: int) -> cpuckpt.AsyncSaveHandle:
            path = ram_dir / name
            if cached:
                return cpuckpt.async_save(sd, path, cfg, step=k, sink=images[name])
            return cpuckpt.async_save(sd, path, cfg, step=k, sink=images[name], planner=PlannerResolved(),
                                      plan_key="bench")
        return save

    return {"pool, cached": pool(True), "pool, plan reuse": pool(False),
            "images, cached": image(True), "images, plan reuse": image(False)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = tuple(int(x) for x in args.shape.split("x"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    base = Path(args.dir) if args.dir else Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-callpath-", dir=base))
    log = ResultLog(logger)
    images: dict[str, ImageSet] = {}
    try:
        # one trainer per variant: each variant's cache holds its own tensors' views, as one trainer's would
        variants = _variants(work / "pool", work / "ram", images)
        trainers = {name: Trainer(args.items, shape, device) for name in variants}
        per_block = max(1, -(-args.reps // args.rounds))
        k = 0
        for _ in range(args.rounds):
            for name, save in variants.items():
                for i in range(WARMUP + per_block):
                    sd = trainers[name].state_dict()
                    device_sync()
                    t0 = time.perf_counter()
                    h = save(sd, k)
                    t1 = time.perf_counter()
                    h.staged.wait()
                    device_sync()
                    t2 = time.perf_counter()
                    h.wait()
                    k += 1
                    if name.startswith("pool"):
                        shutil.rmtree(h.path, ignore_errors=True)
                    if i >= WARMUP:
                        log.record(name, items=args.items, call_s=t1 - t0, stall_s=t2 - t0,
                                   planned=h.stats.planned, resolved=h.stats.resolved)
        rows = []
        summary: dict[str, Any] = {}
        for name in variants:
            mine = [r for r in log if r["name"] == name]
            call = summarize([r["call_s"] / args.items * 1e6 for r in mine])
            stall = summarize([r["stall_s"] / args.items * 1e6 for r in mine])
            paths = sorted({f"{r['planned']}/{r['resolved']}" for r in mine})
            summary[name] = {"call_us_per_item": call, "stall_us_per_item": stall, "paths": paths}
            rows.append([name, ", ".join(paths), _fmt(call), _fmt(stall), f"{stall['median'] * args.items / 1e3:.1f}"])
        print(format_table(
            ["variant", "path (planned/resolved)", "call us/item", "stall us/item", "stall ms"], rows,
            right=[False, False, True, True, True],
            title=f"cpuckpt save call path: {args.items} tensors of {args.shape} fp32 on {device}, "
                  f"{args.reps} warm saves each (median, min-max)",
            footnotes=["target: <= 10 us per item on the call path (stall) with an unchanged structure"]))
        result = {"items": args.items, "shape": args.shape, "device": device, "reps": args.reps,
                  "torch": torch.__version__, "summary": summary, "raw": list(log)}
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_callpath.json").write_text(json.dumps(result, indent=1, default=str))
        return result
    finally:
        cpuckpt.wait_all()
        for image_set in images.values():
            image_set.close()
        shutil.rmtree(work, ignore_errors=True)


def _fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1422)
    p.add_argument("--shape", default="8x8")
    p.add_argument("--reps", type=int, default=15, help="counted saves per variant")
    p.add_argument("--rounds", type=int, default=3, help="blocks per variant (round-robin)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dir", default=None, help="where the pool saves and images go (default: /dev/shm)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench_callpath.json")
    p.add_argument("--smoke", action="store_true", help="a tiny run that keeps the script working")
    args = p.parse_args(argv)
    if args.smoke:
        args.items, args.reps, args.rounds = 50, 2, 1
    logging.basicConfig(level=logging.WARNING)
    run(args)


if __name__ == "__main__":
    main()
