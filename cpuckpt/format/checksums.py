"""Per-chunk checksum kinds of data files (``FileEntry.checksum``) and how to compute each. Pure: bytes in, ints out.

Two kinds (docs/FORMAT.md §3.5):

- ``crc32c``: CRC-32C of the chunk's bytes; what every writer records for the files it writes.
- ``blocksum64``: the chunk zero-padded to whole 4096-byte blocks, read as signed little-endian int32 words;
  block ``b``'s word sum ``s_b`` weighted by ``b + 1``; the total mod 2**64. One reduction, so a GPU can compute it
  over device bytes where a CRC would be a serial scan; additive over disjoint byte ranges (:func:`blocksum64` with
  ``offset``), so the few bytes of a chunk written by the host and its device bytes are summed apart. The block
  weights make swapping two blocks with different sums change the value, which a plain word sum would miss.

numpy is imported on the first :func:`blocksum64` only: the memory tier's writer process imports this module and
starts in a fraction of a second when it never meets the kind.
"""

from __future__ import annotations

from typing import Any, Protocol

import crc32c

__all__ = ["BLOCKSUM64", "CRC32C", "KINDS", "blocksum64", "chunk_checksum", "verifiable"]

CRC32C = "crc32c"
BLOCKSUM64 = "blocksum64"
KINDS = (CRC32C, BLOCKSUM64)  # the kinds a reader verifies; anything else ("none", a newer writer's) is not

BLOCK_BYTES = 4096
_WORDS = BLOCK_BYTES // 4
_MASK = (1 << 64) - 1


class _Checksummed(Protocol):
    checksum: str
    chunk_checksums: Any  # a FileEntry's list, a TagFile's tuple


def verifiable(entry: _Checksummed) -> bool:
    """Whether ``entry`` (a ``FileEntry``, a ``TagFile``) has chunk checksums of a kind this reader computes."""
    return entry.checksum in KINDS and bool(entry.chunk_checksums)


def chunk_checksum(kind: str, data: Any) -> int:
    """The checksum of kind ``kind`` of a whole chunk's bytes ``data`` (bytes-like; a memoryview is not copied).

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    if kind == CRC32C:
        return crc32c.crc32c(data)
    if kind == BLOCKSUM64:
        return blocksum64(data)
    raise ValueError(f"unknown chunk checksum kind {kind!r} (known: {', '.join(KINDS)})")


def blocksum64(data: Any, offset: int = 0) -> int:
    """The blocksum64 contribution of the bytes ``data`` lying at byte ``offset`` of a chunk (every other byte zero).

    With ``offset`` 0 and the whole chunk, the chunk's blocksum64. The contributions of any partition of a chunk
    into byte ranges, summed mod 2**64, are the chunk's: a signed int32 word is ``sum_{k<3} u8(b_k) * 256**k +
    i8(b_3) * 2**24``, each byte's part its own, so a range may start or end inside a word. Whole aligned blocks
    are reduced in place by numpy (which releases the GIL); only the partial blocks at the two edges are copied,
    zero-padded, each at most one block.

    Raises:
        ValueError: ``offset`` is negative.
    """
    if offset < 0:
        raise ValueError(f"blocksum64 offset {offset} is negative")
    import numpy as np  # here, not at the top: see the module docstring

    view = memoryview(data).cast("B")
    n = len(view)
    total = 0
    lo = 0  # of view
    head = min(n, -offset % BLOCK_BYTES)  # bytes up to the first block boundary at or after offset
    if head:
        total += _partial_block(np, view[:head], offset)
        lo = head
    nblocks = (n - lo) // BLOCK_BYTES
    if nblocks:
        first = (offset + lo) // BLOCK_BYTES
        words = np.frombuffer(view, dtype="<i4", count=nblocks * _WORDS, offset=lo).reshape(nblocks, _WORDS)
        sums = words.sum(axis=1, dtype=np.int64)  # |sum| < 2**41: exact
        weights = np.arange(first + 1, first + 1 + nblocks, dtype=np.int64)
        # int64 array arithmetic wraps mod 2**64: the low 64 bits, which are all the checksum keeps
        total += int((sums * weights).sum(dtype=np.int64))
        lo += nblocks * BLOCK_BYTES
    if lo < n:
        total += _partial_block(np, view[lo:], offset + lo)
    return total & _MASK


def _partial_block(np: Any, piece: Any, offset: int) -> int:
    """The contribution of ``piece`` (within one block) at chunk byte ``offset``: copied into a zeroed block."""
    block, at = divmod(offset, BLOCK_BYTES)
    buf = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    buf[at:at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
    return (block + 1) * int(buf.view("<i4").sum(dtype=np.int64))
