"""Per-chunk checksum kinds of data files (``FileEntry.checksum``) and how to compute each. Pure: bytes in, ints out.

Two kinds (docs/FORMAT.md §3.5):

- ``crc32c``: CRC-32C of the chunk's bytes; what every writer records for the files it writes.
- ``blocksum32``: the chunk zero-padded to whole 4096-byte blocks, read as little-endian 32-bit words; block ``b``'s
  word sum ``s_b`` (mod 2**32) weighted by ``2b + 1``; the total mod 2**32. Linear mod 2**32 in every byte, so it is
  additive over disjoint byte ranges (:func:`blocksum32` with ``offset``): the bytes of a chunk written by the host
  and its device bytes are summed apart. A GPU sums the blocks in 32-bit integers, with no wider copy of the data
  (a sum in 64 bits made torch convert every word first: twice the data's size in device memory). The odd weights
  make every single changed byte change the value, and swapping two blocks with different sums usually does.

numpy is imported on the first :func:`blocksum32` only: the memory tier's writer process imports this module and
starts in a fraction of a second when it never meets the kind.
"""

from __future__ import annotations

from typing import Any, Protocol

import crc32c

__all__ = ["BLOCKSUM32", "CRC32C", "KINDS", "blocksum32", "blocksum32_except", "blocksum32_plus", "chunk_checksum",
           "verifiable"]

CRC32C = "crc32c"
BLOCKSUM32 = "blocksum32"
KINDS = (CRC32C, BLOCKSUM32)  # the kinds a reader verifies; anything else ("none", a newer writer's) is not

BLOCK_BYTES = 4096
_WORDS = BLOCK_BYTES // 4
_MASK = (1 << 32) - 1


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
    if kind == BLOCKSUM32:
        return blocksum32(data)
    raise ValueError(f"unknown chunk checksum kind {kind!r} (known: {', '.join(KINDS)})")


def blocksum32(data: Any, offset: int = 0) -> int:
    """The blocksum32 contribution of the bytes ``data`` lying at byte ``offset`` of a chunk (every other byte zero).

    With ``offset`` 0 and the whole chunk, the chunk's blocksum32. The contributions of any partition of a chunk
    into byte ranges, summed mod 2**32, are the chunk's (each byte's part is ``u8 * 256**(position % 4) * (2b + 1)``,
    its own), so a range may start or end inside a word. Whole aligned blocks are reduced in place by numpy (which
    releases the GIL); only the partial blocks at the two edges are copied, zero-padded, each at most one block.

    Raises:
        ValueError: ``offset`` is negative.
    """
    if offset < 0:
        raise ValueError(f"blocksum32 offset {offset} is negative")
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
        words = np.frombuffer(view, dtype="<u4", count=nblocks * _WORDS, offset=lo).reshape(nblocks, _WORDS)
        sums = words.sum(axis=1, dtype=np.uint64) & np.uint64(_MASK)  # s_b mod 2**32 (< 2**42 before: exact)
        weights = 2 * np.arange(first, first + nblocks, dtype=np.uint64) + np.uint64(1)
        # uint64 array arithmetic wraps mod 2**64, a multiple of 2**32: the low 32 bits stay exact
        total += int((sums * weights).sum(dtype=np.uint64))
        lo += nblocks * BLOCK_BYTES
    if lo < n:
        total += _partial_block(np, view[lo:], offset + lo)
    return total & _MASK


def blocksum32_except(view: Any, offset: int, ranges: Any) -> int:
    """blocksum32 of the chunk ``view`` (at file offset ``offset``) without the bytes of ``ranges`` ((file offset,
    bytes) pairs within the chunk, in any order, overlaps counted once): the share of the bytes another party did
    not sum (the memory tier's copy process: the host-written bytes, the GPU having summed the device bytes)."""
    total, cursor, end = 0, offset, offset + len(view)
    for start, nbytes in sorted(ranges):
        if start > cursor:
            total += blocksum32(view[cursor - offset : start - offset], cursor - offset)
        cursor = max(cursor, start + nbytes)
    if cursor < end:
        total += blocksum32(view[cursor - offset :], cursor - offset)
    return total & _MASK


def blocksum32_plus(*shares: int) -> int:
    """The blocksum32 of a chunk from its byte ranges' shares (any ints, negative ones too): their sum mod 2**32."""
    return sum(shares) & _MASK


def _partial_block(np: Any, piece: Any, offset: int) -> int:
    """The contribution of ``piece`` (within one block) at chunk byte ``offset``: copied into a zeroed block."""
    block, at = divmod(offset, BLOCK_BYTES)
    buf = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    buf[at:at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
    return (2 * block + 1) * int(buf.view("<u4").sum(dtype=np.uint64))
