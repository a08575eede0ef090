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

import mmap
from collections.abc import Mapping

__all__ = ["MIN_SEGMENT_BYTES", "PAGE", "round_up", "segment_bytes", "segments", "stale"]

MIN_SEGMENT_BYTES = 64 << 20  # registrations are whole chunks, at least this large
PAGE = mmap.PAGESIZE


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
