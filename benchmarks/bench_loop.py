"""A plain training loop checkpointing every iteration through ``cpuckpt.MemoryTier``, timed on its own wall clock.

The shape of issue 29's floor measurement, written here: 4.84 GB of state in 1,152 tensors (24 layers of four
2048 x 2048 weights and eight 2048-vectors, fp32, with AdamW's two moments and step counters), bf16 autocast
matmuls over ``--tokens`` rows (about 150 ms per iteration on one H200), foreach AdamW, and the two ``.item()``
reads a Megatron-LM iteration makes (the loss, the gradient norm before clipping). Each variant runs in this
process one after the other, after ``--warm`` iterations, for ``--iters`` iterations:

``none``       no checkpoints (the reference of every ratio)
``mem``        a memory checkpoint every iteration: ``MemoryTier.save(..., ordering="stream")`` after the step,
               ``wait_stream()`` right before the next optimizer step, the copies paced from the loop's module
               calls (``staging.d2h_window_bytes`` 64 MiB); 3 slots reserved before the loop, no persists
``mem+nocrc``  the same without crc32c of the images (``memory.checksum: false``)
``memsnap``    ``mem`` with ``staging.device_snapshot``: the step waits for a device-to-device copy only
``memcopy``    ``memsnap`` with ``memory.copy_process``: the snapshot's device-to-host copies and the checksums
               run in a process of ours (CUDA IPC), none of them in the loop's process

The result is the wall time per iteration (from one iteration's end, after its ``.item()``, to the next's) as a
median and a mean, and the mean's ratio to ``none``'s; the largest single iteration against the median. With
``--smoke`` it runs on the CPU with a tiny state (the code paths, no speed).

    python3 -m benchmarks.bench_loop --out $OUT            # one H200
    python3 -m benchmarks.bench_loop --smoke --out /tmp/l  # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_table

logger = logging.getLogger("bench_loop")

VARIANTS = ("none", "mem", "mem+nocrc", "memsnap", "memcopy")


class Layer(torch.nn.Module):
    """Four square weights (two matmuls forward, as an MLP's pair twice) and eight small vectors."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(dim, dim) / dim**0.5) for _ in range(4)])
        self.v = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(dim)) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in (0, 2):
            h = torch.nn.functional.gelu((x @ self.w[k]) * self.v[k] + self.v[k + 4])
            x = x + (h @ self.w[k + 1]) * self.v[k + 1] + self.v[k + 5]
        return x


class Model(torch.nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(dim) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _config(name: str, ram: Path, device: str) -> dict[str, Any]:
    return {"io": {"threads": 8, "chunk_bytes": "32MiB"}, "timeout_s": 300,
            "staging": {"d2h_window_bytes": "64MiB", "device_snapshot": name in ("memsnap", "memcopy"),
                        "pin": device == "cuda"},
            "memory": {"root": str(ram), "slots": 3, "persist_every": 0, "headroom_bytes": 0,
                       "checksum": name != "mem+nocrc", "copy_process": name == "memcopy"}}


def _state(model: Model, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(name: str, model: Model, opt: torch.optim.Optimizer, x: torch.Tensor, warm: int, iters: int,
                root: Path, device: str) -> dict[str, Any]:
    """``warm`` + ``iters`` iterations; the wall time of each of the last ``iters`` (an iteration's end to the next)."""
    import cpuckpt

    tier = None
    if name != "none":
        tier = cpuckpt.MemoryTier(root / "durable", _config(name, root / "ram", device))
        nbytes = sum(t.numel() * t.element_size() for t in _leaf_tensors(_state(model, opt)))
        tier.reserve(int(nbytes * 1.02))
    pending = None
    ends: list[float] = []
    try:
        _sync(device)
        for it in range(warm + iters):
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            loss_value = loss.item()  # the loss report
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True).item()  # the grad norm
            if pending is not None:
                pending.wait_stream()  # the step writes what the last save is still copying
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tier is not None:
                pending = tier.save(_state(model, opt), it + 1, ordering="stream")
            ends.append(time.perf_counter())
            if not (loss_value == loss_value and norm == norm):
                raise RuntimeError(f"{name}: the loss or the gradient norm is NaN at iteration {it}")
        _sync(device)
        if pending is not None:
            pending.wait()
    finally:
        if tier is not None:
            tier.close(persist_newest=False)
    walls = [b - a for a, b in zip(ends[warm - 1:], ends[warm:])]  # iterations warm+1 .. warm+iters
    med = statistics.median(walls)
    return {"variant": name, "iterations": len(walls), "median_ms": round(1e3 * med, 2),
            "mean_ms": round(1e3 * statistics.fmean(walls), 2), "max_ms": round(1e3 * max(walls), 2),
            "max_over_median": round(max(walls) / med, 2), "walls_ms": [round(1e3 * w, 2) for w in walls]}


def _leaf_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaf_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _leaf_tensors(v)]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--warm", type=int, default=5, help="iterations before the timed ones (at least 1)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dir", default=None, help="where the RAM root goes (default: a temporary folder in /dev/shm)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny state: the code paths only")
    args = ap.parse_args(argv)
    args.warm = max(1, args.warm)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.layers, args.dim, args.tokens, args.warm, args.iters = 2, 64, 32, 1, 3
    torch.manual_seed(0)
    model = Model(args.layers, args.dim).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(args.tokens, args.dim, device=device)
    root = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-loop-", dir=args.dir or ("/dev/shm" if Path("/dev/shm").is_dir()
                                                                                  else None)))
    results: dict[str, Any] = {"args": vars(args), "device": device, "runs": []}
    try:
        for name in [v for v in args.variants.split(",") if v]:
            if name not in VARIANTS:
                ap.error(f"unknown variant {name}; known: {VARIANTS}")
            r = run_variant(name, model, opt, x, args.warm, args.iters, root / name.replace("+", "_"), device)
            logger.info("%s: median %.1f ms, mean %.1f ms, max %.1f ms", name, r["median_ms"], r["mean_ms"],
                        r["max_ms"])
            results["runs"].append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in _leaf_tensors(_state(model, opt)))
    ntensors = len(_leaf_tensors(_state(model, opt)))
    base = next((r["mean_ms"] for r in results["runs"] if r["variant"] == "none"), None)
    rows = [[r["variant"], r["median_ms"], r["mean_ms"], round(r["mean_ms"] / base, 3) if base else None,
             f'{r["max_ms"]} ({r["max_over_median"]}x)'] for r in results["runs"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loop.json").write_text(json.dumps(results, indent=1))
    print(format_table(["variant", "median ms/it", "mean ms/it", "mean x none", "largest ms (x median)"], rows,
                       title=f"a plain loop, a memory checkpoint every iteration: {nbytes / 1e9:.3f} GB in "
                             f"{ntensors} tensors, {device}",
                       footnotes=["wall clock from one iteration's end (after its .item() calls) to the next"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
