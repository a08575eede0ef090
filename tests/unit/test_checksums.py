"""Chunk checksum kinds: blocksum32 against a slow reference of its definition, its additivity, the dispatch."""

from __future__ import annotations

import itertools
import random
import struct

import crc32c
import numpy as np
import pytest

from cpuckpt.format.checksums import BLOCKSUM32, CRC32C, KINDS, blocksum32, chunk_checksum, verifiable
from cpuckpt.format.manifest import FileEntry

B = 4096


def _reference(data: bytes, offset: int = 0) -> int:
    """The definition, word by word: the chunk zero except ``data`` at ``offset``, padded to whole blocks."""
    end = offset + len(data)
    padded = bytearray(-(-end // B) * B)
    padded[offset:end] = data
    total = 0
    for b in range(len(padded) // B):
        s = sum(struct.unpack_from("<1024I", padded, b * B)) % 2**32
        total += (2 * b + 1) * s
    return total % 2**32


def _rand(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


LENGTHS = [0, 1, 2, 3, 4, 5, 7, 4095, 4096, 4097, 8191, 8192, 3 * B + 5, 5 * B, 5 * B + 4093]
OFFSETS = [0, 1, 2, 3, 4, 5, 4092, 4095, 4096, 4097, 5000, 3 * B + 1]


@pytest.mark.parametrize("offset", OFFSETS)
def test_blocksum32_matches_the_definition(offset):
    rng = random.Random(offset)
    for n in LENGTHS:
        data = _rand(rng, n)
        assert blocksum32(data, offset) == _reference(data, offset), (n, offset)


def test_blocksum32_extreme_words_and_types():
    # words 2**31, 2**31-1 and 2**32-1: block sums beyond 32 bits wrap, and so does the result, into [0, 2**32)
    for word in (b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff"):
        data = word * (7 * 1024 + 3)
        got = blocksum32(data)
        assert got == _reference(data) and 0 <= got < 2**32
    data = random.Random(1).randbytes(3 * B + 17)
    want = _reference(data)
    assert blocksum32(bytearray(data)) == want
    assert blocksum32(memoryview(data)) == want
    assert blocksum32(np.frombuffer(data[:3 * B], dtype=np.float32)) == _reference(data[:3 * B])  # a typed buffer
    assert blocksum32(memoryview(b"x" + data)[1:]) == want  # an unaligned bulk


def test_blocksum32_weights_wrap_mod_2_32():
    # a large offset: weights and products beyond 64 bits; the low 32 bits are still the definition's
    data = random.Random(2).randbytes(2 * B + 9)
    offset = (2**50 + 3) * B + 2
    got = blocksum32(data, offset)
    first = offset // B
    padded = bytearray(3 * B + B)
    padded[offset - first * B:offset - first * B + len(data)] = data
    want = sum((2 * (first + b) + 1) * sum(struct.unpack_from("<1024I", padded, b * B)) for b in range(4)) % 2**32
    assert got == want


def test_blocksum32_is_additive_over_byte_ranges():
    rng = random.Random(3)
    for n in (1, 5, 4096, 4099, 3 * B + 5, 9 * B + 4093):
        chunk = _rand(rng, n)
        whole = blocksum32(chunk)
        for _ in range(20):
            cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(1, 8)))})
            parts = sum(blocksum32(chunk[a:b], a) for a, b in itertools.pairwise(cuts))
            assert parts % 2**32 == whole, (n, cuts)


def test_blocksum32_sees_every_single_changed_byte_even_in_the_top_bits_of_late_blocks():
    """The odd weights: a change of one byte by d at any place moves the value by d * 256**k * (2b + 1) mod 2**32,
    never 0 (with weights b + 1, block 8191's weight 2**13 times a top bit 2**31 vanished mod 2**32)."""
    data = bytearray(8192 * B)
    whole = blocksum32(data)
    for block in (0, 1, 4095, 8191):
        for byte in range(4):
            at = block * B + 4 * 17 + byte
            data[at] = 0x80
            assert blocksum32(data) != whole, (block, byte)
            data[at] = 0


def test_blocksum32_sees_a_flipped_bit_and_swapped_blocks():
    rng = random.Random(4)
    data = bytearray(_rand(rng, 4 * B + 100))
    whole = blocksum32(data)
    for _ in range(50):
        i, bit = rng.randrange(len(data)), rng.randrange(8)
        data[i] ^= 1 << bit
        assert blocksum32(data) != whole, (i, bit)
        data[i] ^= 1 << bit
    assert blocksum32(data) == whole
    a, b = bytes(data[0:B]), bytes(data[2 * B:3 * B])
    assert blocksum32(a) != blocksum32(b)  # different sums (random data)
    swapped = bytearray(data)
    swapped[0:B], swapped[2 * B:3 * B] = b, a
    assert blocksum32(swapped) != whole


def test_blocksum32_format_example():
    """The worked example of docs/FORMAT.md §3.5."""
    ones = b"\x01\x00\x00\x00" * 1024
    assert blocksum32(ones) == 1024
    assert blocksum32(ones + b"\x02\x00\x00\x00") == 1024 + 3 * 2  # block 1 weighs 3
    assert blocksum32(ones + b"\xff\xff\xff\xff") == (1024 + 3 * (2**32 - 1)) % 2**32 == 1021  # wraps
    assert blocksum32(b"") == 0


def test_blocksum32_refuses_a_negative_offset():
    with pytest.raises(ValueError, match="negative"):
        blocksum32(b"abc", -1)


def test_chunk_checksum_dispatches_by_kind():
    data = random.Random(5).randbytes(B + 3)
    assert chunk_checksum(CRC32C, data) == crc32c.crc32c(data)
    assert chunk_checksum(CRC32C, b"123456789") == 3808858755
    assert chunk_checksum(BLOCKSUM32, memoryview(data)) == _reference(data)
    assert set(KINDS) == {"crc32c", "blocksum32"}
    with pytest.raises(ValueError, match="none"):
        chunk_checksum("none", data)


def test_verifiable():
    assert verifiable(FileEntry("f", 4, 4, "crc32c", [1]))
    assert verifiable(FileEntry("f", 4, 4, "blocksum32", [1]))
    assert not verifiable(FileEntry("f", 4, 4, "none", [0]))
    assert not verifiable(FileEntry("f", 0, 4, "crc32c", []))
    assert not verifiable(FileEntry("f", 4, 4, "sha256", [1]))
