"""Batched chunk fills: a chunk of a file image copied by one ``torch.cat`` of prepared pieces.

``fill_chunk`` walks a chunk's segments in Python (a skeleton slice, a tensor slice, ...): a few
microseconds per record on every save, most of the staging time of a chunk of many small tensors.
A save that repeats an earlier save's layout and sources (``backend.itemcache``) prepares such a
chunk once as a *program*: uint8 pieces that concatenate to exactly the chunk's bytes, the skeleton
bytes and gaps between two tensors' data merged into one constant piece, and views of the
tensors' bytes. Filling the chunk is then one ``torch.cat(pieces, out=...)`` (C++, no Python per
record). When every tensor piece of a chunk lives on one CUDA device, the program keeps its
constants on that device: ``DeviceCopier.fill`` gathers the chunk there and copies it to the host
in one device-to-host copy instead of one per segment.

Pieces whose bytes differ from save to save (non-tensor items' pickles, the contiguous copies of
non-contiguous tensors) are placeholders (``Dynamic``), bound per save by ``bind_programs``.
A save whose device bytes another process copies (``memory.copy_process``) fills on the host only the
skeletons, gaps, non-tensor payloads and CPU tensors, and describes the device runs as ops for that
process: an :class:`OffloadProgram` prepares that once per layout (the constant bytes of a chunk merged
into a few runs, the device runs as ops whose only per-save part is where each source lies in the
device snapshot), instead of ``fill_chunk``'s walk over every segment (~2.75 ms per save of Megatron-LM's
588 tensors on the H100's host, ~10 ms on the 2-core box).

No threads, no I/O.
"""

from __future__ import annotations

import dataclasses
import threading
from array import array
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cpuckpt.format.layout import FileLayout

__all__ = ["MIN_PIECES", "Dynamic", "FillProgram", "OffloadProgram", "bind_programs", "build_offload_programs",
           "build_programs", "without_device_programs"]

MIN_PIECES = 8  # a chunk of fewer pieces costs little to fill segment by segment (large tensors)
# A host cat is cut into runs of at most this many bytes, below ATen's parallel grain (32768 elements):
# on the (loaded) 2-core box 2,845 small pieces took 0.5 ms as runs of < 32 KiB and 7-15 ms as one cat,
# whose larger output goes through ATen's parallel path.
RUN_BYTES = 32 * 1024 - 1


@dataclass(frozen=True)
class Dynamic:
    """Bytes ``[src_offset, src_offset + nbytes)`` of item ``item``'s per-save source or payload."""

    item: int
    src_offset: int
    nbytes: int


@dataclass(frozen=True)
class FillProgram:
    """One chunk's bytes as ordered uint8 pieces on ``device`` (None: host memory)."""

    pieces: list[torch.Tensor | Dynamic]  # torch.cat(pieces) == the chunk's image bytes, once bound
    device: torch.device | None
    dynamic: tuple[int, ...] = ()  # indexes of the Dynamic placeholders in ``pieces``
    runs: tuple[tuple[int, int, int, int], ...] = ()  # host: (chunk offset, end, first piece, end piece)

    def bound(self, sources: Sequence[torch.Tensor | None], payloads: Mapping[int, torch.Tensor]) -> FillProgram:
        """This program with its placeholders replaced by this save's bytes."""
        if not self.dynamic:
            return self
        pieces = list(self.pieces)
        for k in self.dynamic:
            d = pieces[k]
            src = payloads.get(d.item)  # type: ignore[union-attr]
            if src is None:
                src = sources[d.item]  # type: ignore[union-attr]
            if src is None:
                raise RuntimeError(f"fill program: item {d.item} has neither a source nor a payload")  # type: ignore[union-attr]
            pieces[k] = src[d.src_offset : d.src_offset + d.nbytes]  # type: ignore[union-attr]
        return FillProgram(pieces, self.device, (), self.runs)

    def fill(self, out: torch.Tensor) -> None:
        """Copy the chunk into ``out`` (uint8, exactly the chunk's length, on ``device``)."""
        if self.dynamic:
            raise RuntimeError("fill program used before its per-save pieces were bound (bind_programs)")
        pieces = self.pieces
        if self.device is not None:
            torch.cat(pieces, out=out)  # type: ignore[arg-type]  # one batched kernel per ~100 pieces
            return
        for lo, hi, k0, k1 in self.runs:
            if k1 - k0 == 1:
                out[lo:hi].copy_(pieces[k0])  # type: ignore[arg-type]  # a large piece: a parallel copy
            else:
                torch.cat(pieces[k0:k1], out=out[lo:hi])  # type: ignore[arg-type]


def build_programs(files: Sequence[FileLayout], sources: Sequence[torch.Tensor | None], *,
                   dynamic: Collection[int], payload_items: Collection[int]) -> None:
    """Prepare a program for every chunk of ``files`` of at least ``MIN_PIECES`` pieces (``fill_programs``).

    ``sources[i]`` is item ``i``'s flat uint8 source, kept for later saves; items in ``dynamic`` get new
    sources every save, items in ``payload_items`` (non-tensor items) new payloads. A chunk gets a
    device program when every tensor piece is on one CUDA device and it holds no payload.
    """
    to_device: list[tuple[FillProgram, list[int]]] = []  # programs whose constants still have to move
    for layout in files:
        programs: dict[int, FillProgram] = {}
        for chunk in layout.chunks:
            pieces, devices, has_payload = _pieces(layout, chunk.offset, chunk.offset + chunk.nbytes, sources,
                                                   dynamic, payload_items)
            if len(pieces) < MIN_PIECES:
                continue
            cuda = {d for d in devices if d.type == "cuda"}
            device = next(iter(cuda)) if len(cuda) == 1 and len(devices) == 1 and not has_payload else None
            if device is None and cuda:
                continue  # mixed devices, or device bytes beside a payload: segment by segment
            dyn = tuple(k for k, p in enumerate(pieces) if isinstance(p, Dynamic))
            program = FillProgram(pieces, device, dyn, () if device is not None else _runs(pieces))
            programs[chunk.index] = program
            if device is not None:
                to_device.append((program, [k for k, p in enumerate(pieces) if isinstance(p, torch.Tensor)
                                            and p.device.type == "cpu"]))
        layout.fill_programs = programs or None
    _move_constants(to_device)


def bind_programs(files: Sequence[FileLayout], sources: Sequence[torch.Tensor | None],
                  payloads: Mapping[int, torch.Tensor]) -> list[FileLayout]:
    """Layouts whose programs hold this save's bytes (the ones without placeholders are shared)."""
    out = []
    for layout in files:
        programs = layout.fill_programs
        if programs and any(p.dynamic for p in programs.values()):
            programs = {k: p.bound(sources, payloads) for k, p in programs.items()}
            layout = dataclasses.replace(layout, fill_programs=programs)
        out.append(layout)
    return out


def without_device_programs(files: Sequence[FileLayout]) -> list[FileLayout]:
    """``files`` without their device programs (host programs kept). A device program's pieces are views of the
    tensors the layout was prepared for: a save whose copies must read a device snapshot of them instead (the
    trainer may write the tensors once the snapshot is made) cannot use one."""
    out = []
    for layout in files:
        programs = layout.fill_programs
        if programs and any(p.device is not None for p in programs.values()):
            kept = {k: p for k, p in programs.items() if p.device is None}
            layout = dataclasses.replace(layout, fill_programs=kept or None)
        out.append(layout)
    return out


def _runs(pieces: Sequence[torch.Tensor | Dynamic]) -> tuple[tuple[int, int, int, int], ...]:
    """Consecutive pieces grouped into runs of at most ``RUN_BYTES`` (a larger piece is a run alone)."""
    runs = []
    lo = cursor = k0 = 0
    for k, p in enumerate(pieces):
        n = p.nbytes if isinstance(p, Dynamic) else p.numel()
        if k > k0 and cursor + n - lo > RUN_BYTES:
            runs.append((lo, cursor, k0, k))
            lo, k0 = cursor, k
        cursor += n
    if k0 < len(pieces):
        runs.append((lo, cursor, k0, len(pieces)))
    return tuple(runs)


def _pieces(layout: FileLayout, start: int, stop: int, sources: Sequence[torch.Tensor | None],
            dynamic: Collection[int], payload_items: Collection[int],
            ) -> tuple[list[torch.Tensor | Dynamic], set[torch.device], bool]:
    pieces: list[torch.Tensor | Dynamic] = []
    devices: set[torch.device] = set()
    const = bytearray()  # skeleton bytes and zero gaps not yet emitted
    has_payload = False

    def emit_const() -> None:
        if const:
            pieces.append(torch.frombuffer(bytearray(const), dtype=torch.uint8))
            const.clear()

    cursor = start
    for seg in layout.segments_in(start, stop):
        lo, hi = max(seg.file_offset, start), min(seg.file_offset + seg.nbytes, stop)
        const.extend(bytes(lo - cursor))
        s = lo - seg.file_offset
        if seg.item in payload_items:
            emit_const()
            pieces.append(Dynamic(seg.item, s, hi - lo))
            has_payload = True
        elif seg.payload is not None:  # a tensor record's skeleton
            const.extend(memoryview(seg.payload)[s : s + hi - lo])
        else:
            emit_const()
            src = sources[seg.item]
            if src is None:
                raise ValueError(f"fill program: tensor item {seg.item} has no source")
            devices.add(src.device)
            s += seg.src_offset
            pieces.append(Dynamic(seg.item, s, hi - lo) if seg.item in dynamic else src[s : s + hi - lo])
        cursor = hi
    const.extend(bytes(stop - cursor))
    emit_const()
    return pieces, devices, has_payload


def _move_constants(programs: list[tuple[FillProgram, list[int]]]) -> None:
    """Copy the constant pieces of device programs to their devices, one host-to-device copy per device."""
    by_device: dict[torch.device, list[tuple[FillProgram, list[int]]]] = {}
    for program, where in programs:
        by_device.setdefault(program.device, []).append((program, where))  # type: ignore[arg-type]
    for device, group in by_device.items():
        host = [program.pieces[k] for program, where in group for k in where]
        if not host:
            continue
        moved = torch.cat(host).to(device).split([t.numel() for t in host])  # type: ignore[union-attr]
        it = iter(moved)
        for program, where in group:
            for k in where:
                program.pieces[k] = next(it)


@dataclass(frozen=True)
class OffloadProgram:
    """One file's host fill and device-copy ops when another process copies its device bytes (``fill_chunk`` with
    ``described``, prepared once). Chunk ``j`` is the file's ``j``-th; ops use the save's chunk numbering."""

    file: int
    constant: tuple[tuple[int, int, bytes], ...]  # (j, offset in the chunk, bytes): skeletons and zero gaps, merged
    payloads: tuple[tuple[int, int, int, int, int], ...]  # (j, offset in the chunk, segment, from, to): per save
    device: tuple[tuple[int, int, int, int, int], ...]  # (j, item, offset in its source, file offset, bytes)
    host: tuple[tuple[int, int, int, int, int], ...]  # (j, offset in the chunk, item, offset in its source, bytes)
    device_items: tuple[int, ...]  # every item of ``device``, once (each a CUDA source at every save)
    host_items: tuple[int, ...]  # every item of ``host``, once (each a CPU source at every save)
    # per snapshot buffer (its address): (where the sources lay in it, first chunk, ops); saves every iteration
    # alternate between buffers while the previous save's copies still read one
    _ops: dict[int, tuple[tuple[int, ...], int, bytes]] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def applies(self, sources: Sequence[torch.Tensor | None]) -> bool:
        """Whether this save's sources are where the program expects them (device items on a CUDA device)."""
        try:
            return (all(sources[i].is_cuda for i in self.device_items)  # type: ignore[union-attr]
                    and not any(sources[i].is_cuda for i in self.host_items))  # type: ignore[union-attr]
        except (AttributeError, IndexError):  # a source missing: not this program's save
            return False

    def fill(self, slots: Sequence[Any], layout: FileLayout, sources: Sequence[torch.Tensor | None]) -> None:
        """Write the file's host bytes into ``slots`` (the file's chunks in order; ``.view`` a memoryview and
        ``.tensor`` a uint8 tensor of each): the constants, ``layout``'s payloads (this save's), CPU tensors."""
        for j, off, data in self.constant:
            slots[j].view[off : off + len(data)] = data
        segments = layout.segments
        for j, off, k, lo, hi in self.payloads:
            payload = segments[k].payload
            if payload is None or len(payload) < hi:
                raise RuntimeError(f"offload program: segment {k} of file {self.file} has no payload of {hi} bytes")
            slots[j].view[off : off + hi - lo] = memoryview(payload)[lo:hi]
        for j, off, item, s, n in self.host:
            slots[j].tensor[off : off + n].copy_(sources[item][s : s + n])  # type: ignore[index]

    def ops(self, sources: Sequence[torch.Tensor | None], base: int, first_chunk: int) -> bytes:
        """The device runs as ops ``(chunk, offset in the buffer at ``base``, file, file offset, bytes)``
        (:data:`cpuckpt.transfer.sinks.OP_FIELDS`, int64 bytes) for sources that lie in one device buffer; the same
        as the last save's into that buffer when every source lies where it did then (the snapshot's views are
        kept per buffer)."""
        where = tuple(sources[i].data_ptr() for i in self.device_items)  # type: ignore[union-attr]
        with self._lock:
            cached = self._ops.get(base)
        if cached is not None and cached[0] == where and cached[1] == first_chunk:
            return cached[2]
        at = dict(zip(self.device_items, where))
        ops = array("q")
        f = self.file
        for j, item, s, fo, n in self.device:
            ops.extend((first_chunk + j, at[item] - base + s, f, fo, n))
        out = ops.tobytes()
        with self._lock:
            if base not in self._ops and len(self._ops) >= _OPS_KEPT:
                del self._ops[next(iter(self._ops))]  # the oldest buffer's
            self._ops[base] = (where, first_chunk, out)
        return out


_OPS_KEPT = 4  # snapshot buffers whose ops a program keeps (a stream of saves holds one to three)


def build_offload_programs(files: Sequence[FileLayout], sources: Sequence[torch.Tensor | None], *,
                           payload_items: Collection[int]) -> None:
    """Prepare ``offload_program`` for every file of ``files`` whose tensor sources are all given (CUDA ones are
    the device runs); ``payload_items`` are the non-tensor items, whose bytes come from each save's layout."""
    for layout in files:
        layout.offload_program = _offload_program(layout, sources, payload_items)


def _offload_program(layout: FileLayout, sources: Sequence[torch.Tensor | None],
                     payload_items: Collection[int]) -> OffloadProgram | None:
    constant: list[tuple[int, int, bytes]] = []
    payloads, device, host = [], [], []
    index = {id(seg): k for k, seg in enumerate(layout.segments)}
    for j, chunk in enumerate(layout.chunks):
        start, stop = chunk.offset, chunk.offset + chunk.nbytes
        const: list[tuple[int, bytes | memoryview]] = []  # (offset in the chunk, bytes): skeletons and gaps
        cursor = start
        for seg in layout.segments_in(start, stop):
            lo, hi = max(seg.file_offset, start), min(seg.file_offset + seg.nbytes, stop)
            if lo > cursor:
                const.append((cursor - start, bytes(lo - cursor)))
            s = lo - seg.file_offset
            if seg.item in payload_items:
                payloads.append((j, lo - start, index[id(seg)], s, s + hi - lo))
            elif seg.payload is not None:  # a tensor record's skeleton
                const.append((lo - start, memoryview(seg.payload)[s : s + hi - lo]))
            else:
                src = sources[seg.item]
                if src is None:
                    return None
                if src.is_cuda:
                    device.append((j, seg.item, s + seg.src_offset, lo, hi - lo))
                else:
                    host.append((j, lo - start, seg.item, s + seg.src_offset, hi - lo))
            cursor = hi
        if cursor < stop:
            const.append((cursor - start, bytes(stop - cursor)))
        constant += [(j, at, data) for at, data in _merged(const)]
    return OffloadProgram(layout.index, tuple(constant), tuple(payloads), tuple(device), tuple(host),
                          tuple(dict.fromkeys(d[1] for d in device)), tuple(dict.fromkeys(h[2] for h in host)))


def _merged(pieces: Sequence[tuple[int, bytes | memoryview]]) -> list[tuple[int, bytes]]:
    """Adjacent (offset, bytes) pieces joined: one write each run."""
    out: list[tuple[int, bytearray]] = []
    for at, data in pieces:
        if out and out[-1][0] + len(out[-1][1]) == at:
            out[-1][1].extend(data)
        else:
            out.append((at, bytearray(data)))
    return [(at, bytes(data)) for at, data in out]
