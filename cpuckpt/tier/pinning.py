"""Which ranges of a memory image stay registered with CUDA (``cudaHostRegister``): the rule shared by the
trainer's own mapping (:class:`~cpuckpt.tier.images.ImageFile`) and the copy process's (:mod:`cpuckpt.tier.copier`).

A registration pins the physical pages it saw when it was made. Truncating a tmpfs file drops the pages past
its new end, and offsets that grow back get *new* pages: a copy through a registration made before would land
in the dropped pages, outside the file (and a checksum read from the file would agree with the wrong bytes).
So images are registered in segments of whole copy chunks that never reach past the file's last page, and a
segment stays registered only while every page under it stayed in the file since it was registered: it lies
below the smallest size the file had meanwhile (``intact``) and is still a segment of the file's current size.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import functools
import logging
import mmap
import os
import sys
from collections.abc import Mapping

from cpuckpt.transfer.threads import usable_cpus

__all__ = ["MIN_SEGMENT_BYTES", "PAGE", "populate", "prefault_threads", "round_up", "segment_bytes", "segments",
           "stale"]

logger = logging.getLogger(__name__)

MIN_SEGMENT_BYTES = 64 << 20  # registrations are whole chunks, at least this large
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+ (Python's mmap names it from 3.12 on only)
POPULATE_PIECE_MIN_BYTES = 4 << 20  # smaller pieces gain less than a thread's hand-off costs
PREFAULT_THREADS = 16  # threads faulting an image's pages in before it is pinned (staging's pretouch: 16 took 0.7 s
# for 13 GB on the H200 machine, one thread 5.6 s)
_populate_works: bool | None = None  # unknown until the first call; False once the kernel refused it


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def segment_bytes(chunk_bytes: int | None) -> int:
    """The registration unit for copies of ``chunk_bytes``: whole chunks (no chunk's copy crosses two
    registrations), at least :data:`MIN_SEGMENT_BYTES`."""
    if not chunk_bytes:
        return MIN_SEGMENT_BYTES
    return chunk_bytes * max(1, -(-MIN_SEGMENT_BYTES // chunk_bytes))


def segments(nbytes: int, segment: int, mapped: int | None = None) -> list[tuple[int, int]]:
    """The (offset, length) registrations of a file of ``nbytes``: ``segment`` apart, up to its last page (and
    no further than the ``mapped`` bytes of the mapping they are made in)."""
    last_page = round_up(nbytes, PAGE)
    if mapped is not None:
        last_page = min(last_page, mapped)
    return [(off, min(segment, last_page - off)) for off in range(0, last_page, segment)]


def stale(registered: Mapping[int, int], wanted: list[tuple[int, int]] | None, intact: int) -> list[int]:
    """Offsets of the ``registered`` (offset: length) ranges to drop: those reaching past the first ``intact``
    bytes' pages (the smallest the file was since they were made: pages past it may be new), and, with
    ``wanted`` (:func:`segments` of the file now), those that are not one of them."""
    keep_below = round_up(max(0, intact), PAGE)
    want = set(wanted) if wanted is not None else None
    return [off for off, n in registered.items()
            if off + n > keep_below or (want is not None and (off, n) not in want)]


def prefault_threads() -> int:
    """Threads for :func:`populate`: :data:`PREFAULT_THREADS`, at most one per CPU this process may run on (its
    affinity, not the machine's count)."""
    return max(1, min(PREFAULT_THREADS, usable_cpus()))


def populate(address: int, nbytes: int, pool: cf.Executor | None, parts: int) -> bool:
    """Fault the mapped range ``[address, address + nbytes)`` in for writing, in up to ``parts`` page-aligned pieces on
    ``pool``, without touching its bytes (``MADV_POPULATE_WRITE``), so that the ``cudaHostRegister`` after it pins
    pages already mapped instead of faulting each in on the driver's one thread (a registration of a RAM-root image
    ran at 2.6-3.3 GB/s; how much of that is the faults: ``benchmarks.bench_pin``). False where it did not complete: a
    kernel without it (before 5.14, or not Linux; then never tried again) or a range it refused; the registration
    faults the pages itself (some pieces may have been faulted in all the same). A pool that refuses work (no thread
    could start, or the interpreter is exiting) returns False likewise; pieces it took before refusing may still run
    after (they only fault pages in, or fail on a range unmapped meanwhile): pinning never fails for want of it."""
    global _populate_works
    if _populate_works is False or nbytes <= 0:
        return False
    if not sys.platform.startswith("linux"):
        _populate_works = False
        return False
    start = address - address % PAGE  # the range's first page (a segment of a mapping: that page is in it)
    nbytes += address - start
    libc = _libc()
    parts = max(1, min(parts, nbytes // POPULATE_PIECE_MIN_BYTES))
    step = round_up(-(-nbytes // parts), PAGE)

    def one(off: int) -> int:
        if libc.madvise(start + off, min(step, nbytes - off), MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno() or errno.EINVAL

    offsets = range(0, nbytes, step)
    try:
        codes = list(pool.map(one, offsets)) if pool is not None and len(offsets) > 1 else [one(o) for o in offsets]
    except RuntimeError as e:  # "can't start new thread", "cannot schedule new futures after interpreter shutdown"
        logger.debug("the prefault of %d bytes was skipped: %s", nbytes, e)
        return False
    failed = next((c for c in codes if c), 0)
    if failed in (errno.EINVAL, errno.ENOSYS, errno.EPERM) and _populate_works is None:
        # never worked here: a kernel before 5.14, or a filter refusing it
        logger.info("madvise(MADV_POPULATE_WRITE) unavailable (%s); pinning faults the pages itself",
                    os.strerror(failed))
        _populate_works = False
        return False
    if failed:  # e.g. EFAULT past the file's end: the registration after it reports what is wrong with the range
        logger.debug("madvise(MADV_POPULATE_WRITE) of %d bytes failed: %s", nbytes, os.strerror(failed))
        return False
    _populate_works = True
    return True


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
