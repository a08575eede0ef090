"""Chunk checksum kinds: blocksum64 against a slow reference of its definition, its additivity, the dispatch."""

from __future__ import annotations

import itertools
import random
import struct

import crc32c
import numpy as np
import pytest

from cpuckpt.format.checksums import BLOCKSUM64, CRC32C, KINDS, blocksum64, chunk_checksum, verifiable
from cpuckpt.format.manifest import FileEntry

B = 4096


def _reference(data: bytes, offset: int = 0) -> int:
    """The definition, word by word: the chunk zero except ``data`` at ``offset``, padded to whole blocks."""
    end = offset + len(data)
    padded = bytearray(-(-end // B) * B)
    padded[offset:end] = data
    total = 0
    for b in range(len(padded) // B):
        s = sum(struct.unpack_from("<1024i", padded, b * B))
        total += (b + 1) * s
    return total % 2**64


def _rand(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


LENGTHS = [0, 1, 2, 3, 4, 5, 7, 4095, 4096, 4097, 8191, 8192, 3 * B + 5, 5 * B, 5 * B + 4093]
OFFSETS = [0, 1, 2, 3, 4, 5, 4092, 4095, 4096, 4097, 5000, 3 * B + 1]


@pytest.mark.parametrize("offset", OFFSETS)
def test_blocksum64_matches_the_definition(offset):
    rng = random.Random(offset)
    for n in LENGTHS:
        data = _rand(rng, n)
        assert blocksum64(data, offset) == _reference(data, offset), (n, offset)


def test_blocksum64_extreme_words_and_types():
    # every word -2**31 (most negative) or 2**31-1: sums far from zero, the result wraps into [0, 2**64)
    for word in (b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff"):
        data = word * (7 * 1024 + 3)
        got = blocksum64(data)
        assert got == _reference(data) and 0 <= got < 2**64
    data = random.Random(1).randbytes(3 * B + 17)
    want = _reference(data)
    assert blocksum64(bytearray(data)) == want
    assert blocksum64(memoryview(data)) == want
    assert blocksum64(np.frombuffer(data[:3 * B], dtype=np.float32)) == _reference(data[:3 * B])  # a typed buffer
    assert blocksum64(memoryview(b"x" + data)[1:]) == want  # an unaligned bulk


def test_blocksum64_weights_wrap_mod_2_64():
    # a large offset: weights and products beyond int64; the low 64 bits are still the definition's
    data = random.Random(2).randbytes(2 * B + 9)
    offset = (2**50 + 3) * B + 2
    got = blocksum64(data, offset)
    first = offset // B
    padded = bytearray(3 * B + B)
    padded[offset - first * B:offset - first * B + len(data)] = data
    want = sum((first + 1 + b) * sum(struct.unpack_from("<1024i", padded, b * B)) for b in range(4)) % 2**64
    assert got == want


def test_blocksum64_is_additive_over_byte_ranges():
    rng = random.Random(3)
    for n in (1, 5, 4096, 4099, 3 * B + 5, 9 * B + 4093):
        chunk = _rand(rng, n)
        whole = blocksum64(chunk)
        for _ in range(20):
            cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(1, 8)))})
            parts = sum(blocksum64(chunk[a:b], a) for a, b in itertools.pairwise(cuts))
            assert parts % 2**64 == whole, (n, cuts)


def test_blocksum64_sees_a_flipped_bit_and_swapped_blocks():
    rng = random.Random(4)
    data = bytearray(_rand(rng, 4 * B + 100))
    whole = blocksum64(data)
    for _ in range(50):
        i, bit = rng.randrange(len(data)), rng.randrange(8)
        data[i] ^= 1 << bit
        assert blocksum64(data) != whole, (i, bit)
        data[i] ^= 1 << bit
    assert blocksum64(data) == whole
    a, b = bytes(data[0:B]), bytes(data[2 * B:3 * B])
    assert blocksum64(a) != blocksum64(b)  # different sums (random data)
    swapped = bytearray(data)
    swapped[0:B], swapped[2 * B:3 * B] = b, a
    assert blocksum64(swapped) != whole


def test_blocksum64_format_example():
    """The worked example of docs/FORMAT.md §3.5."""
    ones = b"\x01\x00\x00\x00" * 1024
    assert blocksum64(ones) == 1024
    assert blocksum64(ones + b"\xff\xff\xff\xff") == 1022
    assert blocksum64(b"\xff\xff\xff\xff") == 2**64 - 1  # a negative total wraps
    assert blocksum64(b"") == 0


def test_blocksum64_refuses_a_negative_offset():
    with pytest.raises(ValueError, match="negative"):
        blocksum64(b"abc", -1)


def test_chunk_checksum_dispatches_by_kind():
    data = random.Random(5).randbytes(B + 3)
    assert chunk_checksum(CRC32C, data) == crc32c.crc32c(data)
    assert chunk_checksum(CRC32C, b"123456789") == 3808858755
    assert chunk_checksum(BLOCKSUM64, memoryview(data)) == _reference(data)
    assert set(KINDS) == {"crc32c", "blocksum64"}
    with pytest.raises(ValueError, match="none"):
        chunk_checksum("none", data)


def test_verifiable():
    assert verifiable(FileEntry("f", 4, 4, "crc32c", [1]))
    assert verifiable(FileEntry("f", 4, 4, "blocksum64", [1]))
    assert not verifiable(FileEntry("f", 4, 4, "none", [0]))
    assert not verifiable(FileEntry("f", 0, 4, "crc32c", []))
    assert not verifiable(FileEntry("f", 4, 4, "sha256", [1]))
