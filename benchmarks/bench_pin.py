"""How fast ``cudaHostRegister`` pins a RAM-root image: one thread against several on disjoint segments.

The memory tier's copy process pins every slot's image before a job trains (3 x 5.2 GB took it 7.5-8.3 s on an
H100, 2 GB/s; DeepSpeed's 3 x 13.6 GB about 20 s): the job's start waits for it. This measures whether pinning the
segments of one image from several threads is faster, and whether faulting the mapping's pages in first on several
threads (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) leaves the registration less to do, on the machine it runs on
(needs a GPU):

    python -m benchmarks.bench_pin [--gb 5.2] [--threads 1,4,8,1] [--populate 0,8] [--dir /dev/shm]

Per run: a fresh file of ``--gb`` in ``--dir`` (allocated with ``posix_fallocate``, mapped ``MAP_SHARED``, as the
tier's images are), with ``--populate`` P > 0 its pages faulted in by P threads (disjoint ranges), its 256 MiB
segments registered by N threads, then one 256 MiB device-to-host copy into it (a
pinned destination copies at link speed) and the unregistration. The table goes to stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import mmap
import os
import sys
import time

import torch

from benchmarks.common import format_table

SEGMENT = 256 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap names it from 3.12 on only


def populate(base: int, nbytes: int, threads: int) -> None:
    """Fault ``[base, base + nbytes)`` in for writing on ``threads`` threads (ctypes releases the interpreter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    step = -(-nbytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE

    def one(off: int) -> None:
        if libc.madvise(base + off, min(step, nbytes - off), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(0, nbytes, step)))


def pin_once(directory: str, nbytes: int, threads: int, populating: int) -> list[object]:
    """An image of ``nbytes`` pinned by ``threads`` threads, its pages faulted in first by ``populating`` threads
    (none with 0): the table row (see ``main``)."""
    path = os.path.join(directory, f"cpuckpt-bench-pin-{os.getpid()}-{threads}-{populating}")
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
        if populating:
            populate(base, nbytes, populating)
        populated = time.perf_counter() - t0
        with cf.ThreadPoolExecutor(threads) as pool:
            codes = list(pool.map(register, segments))
        pinned = time.perf_counter() - t0
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
        return [threads, populating, round(gb, 2), round(populated, 2), round(pinned - populated, 2),
                round(gb / pinned, 2), round(unregistered, 2), round(SEGMENT / d2h / 1e9, 1)]
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_pin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=5.2)
    ap.add_argument("--threads", default="1,4,8,1", help="thread counts, one run each, in this order")
    ap.add_argument("--populate", default="0", help="threads faulting the pages in first (0: none), one run each per "
                                                     "thread count")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bench_pin needs a GPU\n")
        return 2
    torch.cuda.init()
    nbytes = int(a.gb * 1e9) // SEGMENT * SEGMENT
    rows = [pin_once(a.dir, nbytes, int(n), int(p)) for n in a.threads.split(",") if n
            for p in a.populate.split(",") if p]
    sys.stdout.write(format_table(["threads", "populate threads", "GB", "populate s", "register s", "GB/s (both)",
                                   "unregister s", "D2H GB/s"], rows,
                                  title="cudaHostRegister of a tmpfs image, by threads") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
