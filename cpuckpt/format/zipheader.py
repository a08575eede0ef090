"""The zip local file header: where an archive entry's name and data begin. Pure: bytes in, offsets out.

Every entry of a zip archive starts with a 30-byte local header (signature ``PK\\x03\\x04``, versions,
flags, compression, times, CRC, sizes, then the lengths of the name and of the extra field); the name
and the extra field follow it, then the entry's data. ``torch.save`` archives store entries
uncompressed, so an entry's data offset is where a tensor's raw bytes lie. The record writer
(:mod:`cpuckpt.format.record`) packs this header; the record parser, the torch.save skeleton readers
and ``cpuckpt convert`` find data offsets through it.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

__all__ = ["LOCAL_HEADER", "LOCAL_SIG", "LocalHeader", "entry_data_offset", "local_header", "written_entries"]

#: signature, version needed, flags, compression, mtime, mdate, crc32, compressed size, size, name length, extra length
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
LOCAL_SIG = b"PK\x03\x04"

ReadAt = Callable[[int, int], bytes]  # (start, stop) -> the archive's bytes [start, stop) (fewer at its end)


class LocalHeader(NamedTuple):
    """Absolute offsets of one entry's name ``[name_start, name_end)`` and of its first data byte."""

    name_start: int
    name_end: int
    data_start: int


def local_header(header: bytes | bytearray | memoryview, offset: int) -> LocalHeader | None:
    """Parse the local header whose bytes start ``header`` and which sits at ``offset`` in the archive.

    Returns None when ``header`` is shorter than a header or does not start with the signature.
    """
    if len(header) < LOCAL_HEADER.size or bytes(header[:4]) != LOCAL_SIG:
        return None
    fields = LOCAL_HEADER.unpack_from(header, 0)
    name_len, extra_len = fields[-2], fields[-1]
    name_start = offset + LOCAL_HEADER.size
    return LocalHeader(name_start, name_start + name_len, name_start + name_len + extra_len)


def entry_data_offset(info: zipfile.ZipInfo, read_at: ReadAt) -> int | None:
    """Absolute offset of the data of the entry ``info`` (from the central directory); None if its
    local header is missing or damaged. ``read_at`` reads the archive's bytes."""
    h = local_header(read_at(info.header_offset, info.header_offset + LOCAL_HEADER.size), info.header_offset)
    return None if h is None else h.data_start


def written_entries(pieces: Iterable[tuple[int, bytes]], read_at: ReadAt) -> Iterator[tuple[str, int]]:
    """``(name, data offset)`` of every entry whose local header starts one of the written ``pieces``.

    ``pieces`` are ``(offset, bytes)`` runs of an archive being written (e.g. a
    :class:`~cpuckpt.format.record.SparseSink`'s); ``read_at`` reads its bytes (for the name, which may
    be written as a piece of its own).
    """
    for pos, data in pieces:
        h = local_header(data, pos)
        if h is not None:
            yield read_at(h.name_start, h.name_end).decode("utf-8", "replace"), h.data_start
