"""What blocksum32's reduction of a device snapshot costs the GPU, alone and beside a training-shaped step.

With ``memory.checksum_kind: auto`` (the default) a save whose device snapshot the copy process copies gets its
checksums from one reduction over the snapshot on the GPU (:func:`cpuckpt.transfer.device_snapshot.device_share`),
enqueued on the copy stream after the snapshot's copy, beside the trainer's next step. At a DeepSpeed save every 8
iterations (13.6 GB) a save cost less within its run with it than with crc32c, but the runs with it were slower in the
iterations a save's effects had left (BENCHMARKS.md, session 44); this says what the reduction and the snapshot's copy
cost a step beside them, on the machine it runs on (needs a GPU):

    python -m benchmarks.bench_blocksum [--gb 4.7,13.6] [--reps 7] [--step-ms 120]
    python -m benchmarks.bench_blocksum --smoke      # CPU: small buffers, the reduction checked against the definition

First the CUDA reduction over a 64 MiB snapshot is checked against the definition (the host's blocksum32). Then per
size, a buffer laid out as a save's files (one file of whole chunks of ``io.chunk_bytes``, random words):

* ``reduce ms``: the reduction and its pinned copy alone (CUDA events; median of ``--reps``), and ``GB/s`` over it;
* ``launch ms``: the host time of that call (the trainer's thread pays it where the save starts there);
* ``d2d ms``: a device-to-device copy of the same bytes alone, in ``--pieces`` tensors by one ``_foreach_copy_`` (the
  snapshot's copy: one copy per saved tensor; a single contiguous copy is faster);
* ``step ms``: a training-shaped step alone (bf16 matmuls and memory-bound element-wise ops, calibrated to about
  ``--step-ms``), then with, enqueued on a side stream just before it, the reduction (``+reduce``: its host launch
  included, as the step's first kernels wait behind it), the copy (``+d2d``) and both in a save's order (``+both``):
  the step's added milliseconds, the median of the differences with the step alone measured in the same round (the
  four are interleaved in each of the ``--reps`` rounds, so that the GPU's drift falls on all alike).

The table goes to stdout (medians; ``--json`` writes the rows too).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import format_table

logger = logging.getLogger("benchmarks.bench_blocksum")


def _snapshot(nbytes: int, chunk: int, device: torch.device) -> object:
    """A :class:`DeviceSnapshot` of ``nbytes`` (rounded up to whole chunks) laid out as one file, random words."""
    import threading

    from cpuckpt.transfer.device_snapshot import DeviceSnapshot, Mirror

    nbytes = -(-nbytes // chunk) * chunk
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffer.view(torch.int32).random_(-(2**31), 2**31 - 1)
    snap = DeviceSnapshot(buffer, threading.Lock())
    snap.mirror = Mirror(places=((0, 0),), bases=(0,), nbytes=nbytes, chunk_bytes=chunk)
    return snap


def _check(snap: object, chunk: int) -> None:
    """The reduction equals the definition's blocksum32 over every chunk (host, numpy)."""
    from cpuckpt.format.checksums import blocksum32
    from cpuckpt.transfer.device_snapshot import BLOCK_BYTES, device_chunk_sums

    buffer = snap.buffer  # type: ignore[attr-defined]
    weights = 2 * torch.arange(chunk // BLOCK_BYTES, dtype=torch.int64, device=buffer.device) + 1
    sums = device_chunk_sums(buffer, snap.mirror, weights)  # type: ignore[attr-defined]
    host = buffer.cpu().numpy()
    want = [blocksum32(host[o : o + chunk]) for o in range(0, host.size, chunk)]
    got = [int(v) % 2**32 for v in sums.tolist()]
    if got != want:
        raise AssertionError(f"device reduction differs from the definition: {got[:4]} != {want[:4]}")


def _timed(fn: Callable[[], None], stream: torch.cuda.Stream) -> float:
    """Milliseconds of GPU time ``fn`` enqueues on ``stream``, measured with events, after a synchronize."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


class Step:
    """A training-shaped step on the current stream: bf16 matmuls (compute-bound) and element-wise adds over 256 MiB
    (memory-bound), repeated ``units`` times."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
        self.b = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
        self.x = torch.randn(64 << 20, dtype=torch.float32, device=device)
        self.units = 1

    def __call__(self) -> None:
        for _ in range(self.units):
            self.c = self.a @ self.b
            self.x.add_(1.0)

    def calibrate(self, target_ms: float) -> None:
        stream = torch.cuda.current_stream()
        self.units = 8
        per_unit = statistics.median(_timed(self, stream) for _ in range(3)) / self.units
        self.units = max(1, round(target_ms / per_unit))


def measure(gb: float, chunk: int, reps: int, step: Step, pieces: int) -> list[object]:
    """One table row for a snapshot of ``gb`` GB."""
    from cpuckpt.transfer.device_snapshot import device_share

    device = torch.device("cuda")
    snap = _snapshot(int(gb * 1e9), chunk, device)
    side = torch.cuda.Stream()
    buffer = snap.buffer  # type: ignore[attr-defined]
    other = torch.empty_like(buffer)
    size = -(-buffer.numel() // pieces)
    sources, targets = list(buffer.split(size)), list(other.split(size))
    main = torch.cuda.current_stream()

    def reduce() -> None:
        device_share(snap, side)  # type: ignore[arg-type]

    def d2d() -> None:
        with torch.cuda.stream(side):
            torch._foreach_copy_(targets, sources, non_blocking=True)

    def both() -> None:
        d2d()
        reduce()

    reduce()  # the weights, the allocator's first blocks
    torch.cuda.synchronize()
    launch = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reduce()
        launch.append(1e3 * (time.perf_counter() - t0))
    reduce_ms = statistics.median(_timed(reduce, side) for _ in range(reps))
    d2d_ms = statistics.median(_timed(d2d, side) for _ in range(reps))

    def beside(work: Callable[[], None] | None) -> float:
        def run() -> None:
            if work is not None:
                side.wait_stream(main)
                work()
            step()

        return _timed(run, main)

    rounds = [[beside(w) for w in (None, reduce, d2d, both)] for _ in range(reps)]  # interleaved: drift falls alike
    alone = statistics.median(r[0] for r in rounds)
    added = [statistics.median(r[k] - r[0] for r in rounds) for k in (1, 2, 3)]
    nbytes = buffer.numel()
    return [f"{nbytes / 1e9:.2f}", f"{reduce_ms:.2f}", f"{nbytes / reduce_ms / 1e6:.0f}",
            f"{statistics.median(launch):.2f}", f"{d2d_ms:.2f}", f"{alone:.1f}", *(f"{a:+.2f}" for a in added)]


HEADER = ["GB", "reduce ms", "GB/s", "launch ms", "d2d ms", "step ms", "+reduce", "+d2d", "+both"]


def smoke(chunk: int) -> None:
    """CPU: the reduction over small buffers equals the definition (no timings)."""
    for nbytes in (chunk, 3 * chunk):
        _check(_snapshot(nbytes, chunk, torch.device("cpu")), chunk)
    print(f"bench_blocksum smoke: the reduction equals blocksum32 over {1 + 3} chunks of {chunk} bytes (CPU)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", default="4.7,13.6", help="snapshot sizes, GB (comma-separated)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--pieces", type=int, default=1024, help="tensors of the snapshot's device copy")
    p.add_argument("--step-ms", type=float, default=120.0)
    p.add_argument("--chunk-mib", type=int, default=32, help="io.chunk_bytes of the snapshot's files")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    chunk = args.chunk_mib << 20
    if args.smoke:
        smoke(1 << 20)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_blocksum needs a GPU (--smoke runs the CPU check)")
    _check(_snapshot(64 << 20, chunk, torch.device("cuda")), chunk)  # the CUDA reduction equals the definition
    step = Step(torch.device("cuda"))
    step.calibrate(args.step_ms)
    rows = []
    for gb in filter(None, args.gb.split(",")):
        rows.append(measure(float(gb), chunk, args.reps, step, args.pieces))
        torch.cuda.empty_cache()  # the buffers of one size are gone before the next size's
    print(f"blocksum32's reduction on {torch.cuda.get_device_name()} (medians of {args.reps}; step: {step.units} "
          f"units, ~{args.step_ms:.0f} ms; +: the step's added ms with that work on a side stream)")
    print(format_table(HEADER, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"header": HEADER, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
