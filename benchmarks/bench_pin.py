"""How fast ``cudaHostRegister`` pins a RAM-root image: one thread against several on disjoint segments.

The memory tier's copy process pins every slot's image before a job trains (3 x 5.2 GB took it 7.5-8.3 s on an
H100, 2 GB/s; DeepSpeed's 3 x 13.6 GB about 20 s): the job's start waits for it. This measures whether pinning the
segments of one image from several threads is faster, on the machine it runs on (needs a GPU):

    python -m benchmarks.bench_pin [--gb 5.2] [--threads 1,4,8,1] [--dir /dev/shm]

Per run: a fresh file of ``--gb`` in ``--dir`` (allocated with ``posix_fallocate``, mapped ``MAP_SHARED``, as the
tier's images are), its 256 MiB segments registered by N threads, then one 256 MiB device-to-host copy into it (a
pinned destination copies at link speed) and the unregistration. The table goes to stdout.
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

SEGMENT = 256 << 20


def pin_once(directory: str, nbytes: int, threads: int) -> list[object]:
    """An image of ``nbytes`` pinned by ``threads`` threads: the table row (see ``main``)."""
    path = os.path.join(directory, f"cpuckpt-bench-pin-{os.getpid()}-{threads}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        base = host.data_ptr()
        segments = [(base + off, min(SEGMENT, nbytes - off)) for off in range(0, nbytes, SEGMENT)]

        def register(segment: tuple[int, int]) -> int:
            return int(cudart.cudaHostRegister(segment[0], segment[1], 0))

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(threads) as pool:
            codes = list(pool.map(register, segments))
        registered = time.perf_counter() - t0
        if any(codes):
            raise RuntimeError(f"cudaHostRegister failed: {sorted(set(codes))}")
        src = torch.empty(SEGMENT, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        host[:SEGMENT].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        d2h = time.perf_counter() - t1
        t2 = time.perf_counter()
        for ptr, _ in segments:
            cudart.cudaHostUnregister(ptr)
        unregistered = time.perf_counter() - t2
        del host
        mm.close()
        gb = nbytes / 1e9
        return [threads, round(gb, 2), round(registered, 2), round(gb / registered, 2), round(unregistered, 2),
                round(SEGMENT / d2h / 1e9, 1)]
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_pin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=5.2)
    ap.add_argument("--threads", default="1,4,8,1", help="thread counts, one run each, in this order")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bench_pin needs a GPU\n")
        return 2
    torch.cuda.init()
    nbytes = int(a.gb * 1e9) // SEGMENT * SEGMENT
    rows = [pin_once(a.dir, nbytes, int(n)) for n in a.threads.split(",") if n]
    sys.stdout.write(format_table(["threads", "GB", "register s", "GB/s", "unregister s", "D2H GB/s"], rows,
                                  title="cudaHostRegister of a tmpfs image, by threads") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
