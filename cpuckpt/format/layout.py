"""Pure layout planning: items -> a file image per data file. No I/O, no threads, no torch.

Every file is planned completely before a byte is copied, so a chunk can be written the moment it
is filled. A file image is a run of records; each record is ``head + data + tail`` (a tensor
record) or raw bytes (a non-tensor item). Large tensors start their data on an alignment boundary
(the padding is free at that size); small ones are packed, so they cost what stock records cost.
The image is cut into chunks of ``chunk_bytes`` (aligned), the unit of staging, checksumming and
``pwrite``; O_DIRECT needs no per-record padding because whole aligned chunks are written.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Chunk", "FileLayout", "LayoutCache", "LayoutItem", "Placement", "PlannedFiles", "Segment", "plan_files"]


@dataclass(frozen=True)
class LayoutItem:
    """One item to place: a tensor record (``head``/``tail`` around ``data_nbytes``) or raw bytes."""

    data_nbytes: int
    head: bytes = b""
    tail: bytes = b""
    payload: bytes | memoryview | None = None  # raw bytes of a non-tensor item (written as-is)

    @property
    def record_nbytes(self) -> int:
        return len(self.head) + self.data_nbytes + len(self.tail)


@dataclass(frozen=True)
class Placement:
    """Where item ``item`` landed: its record and its data bytes, as absolute file offsets."""

    item: int
    file: int
    record_offset: int
    record_nbytes: int
    data_offset: int
    data_nbytes: int


@dataclass(frozen=True)
class Segment:
    """A contiguous run of image bytes with one source.

    ``payload`` set: constant bytes (a skeleton part, or a non-tensor item). Otherwise the bytes
    ``[src_offset, src_offset + nbytes)`` of item ``item``'s tensor data.
    """

    file_offset: int
    nbytes: int
    item: int
    src_offset: int = 0
    payload: bytes | memoryview | None = None


@dataclass(frozen=True)
class Chunk:
    """``[offset, offset + nbytes)`` of file ``file``; ``offset`` is aligned, ``nbytes`` too except the last."""

    file: int
    index: int
    offset: int
    nbytes: int


@dataclass
class FileLayout:
    """The complete image of one data file."""

    index: int
    nbytes: int = 0
    segments: list[Segment] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list, repr=False)
    # chunk index -> a prepared batched copy of that chunk (transfer.fillplan.FillProgram), set by a
    # save that repeats an earlier one; chunks without one are filled segment by segment
    fill_programs: dict[int, Any] | None = field(default=None, repr=False)
    # the whole file's host bytes and device-copy ops, prepared for a save whose device bytes another process copies
    # (transfer.fillplan.OffloadProgram); set by a save that repeats an earlier one
    offload_program: Any = field(default=None, repr=False)

    def segments_in(self, start: int, stop: int) -> Iterator[Segment]:
        """Segments overlapping ``[start, stop)``, in file order."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        segs = self.segments
        while i < len(segs) and segs[i].file_offset < stop:
            if segs[i].file_offset + segs[i].nbytes > start:
                yield segs[i]
            i += 1


def plan_files(
    items: Sequence[LayoutItem],
    *,
    num_files: int,
    chunk_bytes: int,
    align_bytes: int,
    align_data_min_bytes: int,
) -> tuple[list[FileLayout], list[Placement]]:
    """Assign items to ``num_files`` files (balanced by bytes) and lay each file out.

    Returns the file layouts and one placement per item, in item order.
    """
    if chunk_bytes % align_bytes:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of align_bytes {align_bytes}")
    num_files = max(1, min(num_files, len(items)))
    members: list[list[int]] = [[] for _ in range(num_files)]
    if num_files == 1:
        members[0] = list(range(len(items)))
    else:
        loads = [0] * num_files
        for i in sorted(range(len(items)), key=lambda k: -items[k].record_nbytes):
            f = loads.index(min(loads))
            members[f].append(i)
            loads[f] += items[i].record_nbytes
    files = [FileLayout(index=f) for f in range(num_files)]
    placements: list[Placement | None] = [None] * len(items)
    for f, idxs in enumerate(members):
        layout = files[f]
        cursor = 0
        for i in idxs if num_files == 1 else sorted(idxs):  # keep the caller's order inside a file
            it = items[i]
            if it.payload is None and it.data_nbytes >= align_data_min_bytes > 0:
                cursor += -(cursor + len(it.head)) % align_bytes
            placements[i] = Placement(
                item=i,
                file=f,
                record_offset=cursor,
                record_nbytes=it.record_nbytes,
                data_offset=cursor + len(it.head),
                data_nbytes=it.data_nbytes,
            )
            _add_segments(layout.segments, i, it, cursor)
            cursor += it.record_nbytes
        layout.nbytes = cursor
        layout._starts = [s.file_offset for s in layout.segments]
        layout.chunks = [
            Chunk(file=f, index=k, offset=off, nbytes=min(chunk_bytes, cursor - off))
            for k, off in enumerate(range(0, cursor, chunk_bytes))
        ]
    return files, placements  # type: ignore[return-value]


def _add_segments(out: list[Segment], i: int, it: LayoutItem, offset: int) -> None:
    if it.payload is not None:
        if it.data_nbytes:
            out.append(Segment(offset, it.data_nbytes, i, payload=it.payload))
        return
    if it.head:
        out.append(Segment(offset, len(it.head), i, payload=it.head))
    offset += len(it.head)
    if it.data_nbytes:
        out.append(Segment(offset, it.data_nbytes, i))
    offset += it.data_nbytes
    if it.tail:
        out.append(Segment(offset, len(it.tail), i, payload=it.tail))


class PlannedFiles(NamedTuple):
    """What :meth:`LayoutCache.plan` returns: ``plan_files``'s result, and whether it came from the cache."""

    files: list[FileLayout]
    placements: list[Placement]
    cached: bool


class LayoutCache:
    """``plan_files``, remembered for the last few distinct item lists (one cache per save stream).

    A save that reuses its plan has the same records in the same order as the save before, so its
    layout is the same; only the bytes of its non-tensor items (same lengths: they are part of the
    key) differ, and are bound afresh into a copy of the cached segments. The key holds every input
    ``plan_files`` reads: the settings, and per item its data length, its skeleton bytes (cached,
    shared objects: hashed once) and whether it is raw bytes.
    """

    def __init__(self, maxsize: int = 4) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, tuple[list[FileLayout], list[Placement], list[tuple[int, int, int]]]] = \
            OrderedDict()
        self._lock = threading.Lock()  # saves may plan on two threads (the dcp.async_save door's executor)

    def plan(self, items: Sequence[LayoutItem], *, num_files: int, chunk_bytes: int, align_bytes: int,
             align_data_min_bytes: int) -> PlannedFiles:
        key = (num_files, chunk_bytes, align_bytes, align_data_min_bytes,
               tuple((it.data_nbytes, it.head, it.tail, None if it.payload is None else len(it.payload))
                     for it in items))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            files, placements = plan_files(items, num_files=num_files, chunk_bytes=chunk_bytes,
                                           align_bytes=align_bytes, align_data_min_bytes=align_data_min_bytes)
            where = [(s.item, f.index, k) for f in files for k, s in enumerate(f.segments)
                     if items[s.item].payload is not None]
            # kept without the payloads (they belong to this save): a placeholder until bound again
            kept = [_with_segments(f, [dataclasses.replace(s, payload=b"") if items[s.item].payload is not None
                                       else s for s in f.segments]) for f in files]
            with self._lock:
                self._entries[key] = (kept, placements, where)
                if len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
            return PlannedFiles(files, placements, False)
        kept, placements, where = entry
        files = [_with_segments(f, list(f.segments)) for f in kept]
        for item, f, k in where:
            files[f].segments[k] = dataclasses.replace(files[f].segments[k], payload=items[item].payload)
        return PlannedFiles(files, placements, True)


def _with_segments(layout: FileLayout, segments: list[Segment]) -> FileLayout:
    """A layout sharing ``layout``'s chunks and segment starts (never changed) with its own segment list."""
    return FileLayout(index=layout.index, nbytes=layout.nbytes, segments=segments, chunks=layout.chunks,
                      _starts=layout._starts)
