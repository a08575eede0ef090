"""How fast ``cudaHostRegister`` pins a RAM-root image, and what faulting its pages in first gains.

The memory tier's copy process pins every slot's image before a job trains (3 x 5.2 GB took it 7.1-10.4 s on an
H200, 2 GB/s; DeepSpeed's 3 x 13.6 GB about 20 s): the job's start waits for it. One driver thread faults each of
an image's ~1.3 M pages in as it pins them. This measures, on the machine it runs on (needs a GPU):

    python -m benchmarks.bench_pin [--gb 5.2] [--modes plain,segment16,whole16,plain] [--threads 1] [--dir /dev/shm]

Per mode: a fresh file of ``--gb`` in ``--dir`` (allocated with ``posix_fallocate``, mapped ``MAP_SHARED``, as the
tier's images are), its segments (the tier's, ``pinning.segments``: 64 MiB for 32 MiB chunks) registered by
``--threads`` threads, then one 256 MiB device-to-host copy into it (a pinned destination copies at link speed) and
the unregistration:

* ``plain``: registered as they are (what the tier did before ``pinning.populate``);
* ``segment<P>``: each segment's pages faulted in by ``pinning.populate`` on P threads just before it is
  registered (what the copy process and the trainer's pins do now; needs ``--threads 1``);
* ``whole<P>``: the whole image faulted in on P threads first, then registered (the bound for overlapping them).

The table goes to stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import mmap
import os
import sys
import time

import torch

from benchmarks.common import format_table
from cpuckpt.tier import pinning

CHUNK = 32 << 20  # io.chunk_bytes' default: the tier's segments are 64 MiB
PROBE = 32 << 20  # inside the first segment: a copy may not span two registrations


def pin_once(directory: str, nbytes: int, mode: str, threads: int) -> list[object]:
    """An image of ``nbytes`` pinned as ``mode`` says by ``threads`` threads: the table row (see ``main``)."""
    kind = mode.rstrip("0123456789")
    faulting = int(mode[len(kind):] or 0)
    if kind not in ("plain", "segment", "whole") or (kind != "plain") != (faulting >= 1):
        raise SystemExit(f"bench_pin: unknown mode {mode!r}")
    if kind == "segment" and threads != 1:
        raise SystemExit("bench_pin: segment<P> registers on one thread (--threads 1), as the tier does")
    path = os.path.join(directory, f"cpuckpt-bench-pin-{os.getpid()}-{mode}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        base = host.data_ptr()
        segments = [(base + off, n) for off, n in pinning.segments(nbytes, pinning.segment_bytes(CHUNK))]
        faulted_s = 0.0
        with cf.ThreadPoolExecutor(max(1, faulting)) as faulters, cf.ThreadPoolExecutor(threads) as pinners:

            def fault(ptr: int, n: int) -> None:
                nonlocal faulted_s
                t = time.perf_counter()
                if not pinning.populate(ptr, n, faulters, faulting):
                    raise RuntimeError("madvise(MADV_POPULATE_WRITE) failed or is not available here (debug log: why)")
                faulted_s += time.perf_counter() - t

            def register(segment: tuple[int, int]) -> int:
                if kind == "segment":
                    fault(*segment)
                return int(cudart.cudaHostRegister(segment[0], segment[1], 0))

            t0 = time.perf_counter()
            if kind == "whole":
                fault(base, nbytes)
            codes = list(pinners.map(register, segments))
            pinned = time.perf_counter() - t0
        if any(codes):
            raise RuntimeError(f"cudaHostRegister failed: {sorted(set(codes))}")
        src = torch.empty(PROBE, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        host[:PROBE].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        d2h = time.perf_counter() - t1
        t2 = time.perf_counter()
        for ptr, _ in segments:
            cudart.cudaHostUnregister(ptr)
        unregistered = time.perf_counter() - t2
        del host
        mm.close()
        gb = nbytes / 1e9
        return [mode, threads, round(gb, 2), round(faulted_s, 2), round(pinned - faulted_s, 2), round(pinned, 2),
                round(gb / pinned, 2), round(unregistered, 2), round(PROBE / d2h / 1e9, 1)]
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_pin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=5.2)
    ap.add_argument("--modes", default="plain,segment16,whole16,plain", help="one run each, in this order")
    ap.add_argument("--threads", type=int, default=1, help="threads registering the segments")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bench_pin needs a GPU\n")
        return 2
    torch.cuda.init()
    nbytes = int(a.gb * 1e9) // mmap.PAGESIZE * mmap.PAGESIZE
    rows = [pin_once(a.dir, nbytes, m, a.threads) for m in a.modes.split(",") if m]
    sys.stdout.write(format_table(["mode", "register threads", "GB", "fault s", "register s", "pinned s", "GB/s",
                                   "unregister s", "D2H GB/s"], rows,
                                  title="cudaHostRegister of a tmpfs image (fault s: pinning.populate)") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
