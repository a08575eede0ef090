"""A save's GPU bytes copied into spare device memory first (``staging.device_snapshot``).

With ``ordering: stream/optimizer`` the trainer's next writes to saved tensors wait, on the GPU, for
the save's copies to end. Device-to-host copies run at PCIe speed (55 GB/s on the H200): a 14.6 GB
DeepSpeed state takes 0.27 s, longer than the next forward and backward, so the optimizer step
waits for the rest. A device-to-device copy into a buffer of the same device runs at memory speed
(a few ms for the same bytes); the ordering then waits for that copy only, and the copies to the
host read the buffer while training goes on.

Buffers are kept for later saves (allocating 14 GB per save would fight the trainer for memory): a
save takes the smallest idle buffer that fits (or allocates one), and gives it back once its
device-to-host copies are enqueued, with the event after the last of them; the next save's
device-to-device copy waits for that event on the GPU, so a buffer is never overwritten while it
is read. Two files of one checkpoint (DeepSpeed's model and optimizer states) take two buffers.
The buffers belong to one stream of saves (:class:`DeviceSnapshots`, a checkpointer's), never to the
process. Starts no thread, touches no host memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCK_BYTES", "DeviceSnapshot", "DeviceSnapshots", "Mirror", "device_chunk_sums", "device_share",
           "release"]

logger = logging.getLogger(__name__)

_ALIGN = 512  # each source's bytes start at this alignment in the buffer


@dataclass
class DeviceSnapshot:
    """One reusable device buffer; ``busy`` is the CUDA event after the last copy that reads it."""

    buffer: torch.Tensor
    lock: threading.Lock  # its owner's (:class:`DeviceSnapshots`)
    busy: Any = None
    held: bool = True
    # the views of the last save into it, by their sizes (and places, mirrored): a repeated save reuses them (588
    # slices took ~2 ms of the trainer's thread on the 2-core box), and its sources then lie where they did
    # (OffloadProgram.ops)
    views: tuple[tuple, list[torch.Tensor]] | None = None
    weights: torch.Tensor | None = None  # blocksum32's block weights 2b + 1 per chunk (mirrored saves)
    mirror: Mirror | None = None  # the layout of the last save into it when mirrored (None: packed)


@dataclass(frozen=True)
class Mirror:
    """Where a save's device sources lie in its files, for a snapshot laid out as the files are: each file at
    ``bases[f]`` of the buffer (a multiple of ``chunk_bytes``), each source at its file's base plus its data's file
    offset (``places[i]``: (file position, offset), one per device source in order), zeros elsewhere. Then one
    reduction over the buffer gives the device bytes' share of every chunk's blocksum32 (:mod:`cpuckpt.format.
    checksums`), in the save's chunk order, without a byte read back on the host."""

    places: tuple[tuple[int, int], ...]
    bases: tuple[int, ...]
    nbytes: int  # the buffer bytes the files take: a multiple of chunk_bytes
    chunk_bytes: int


BLOCK_BYTES = 4096  # blocksum32's block


def device_chunk_sums(buffer: torch.Tensor, mirror: Mirror, weights: torch.Tensor) -> torch.Tensor:
    """The device bytes' share of each chunk's blocksum32 (int64; the caller keeps it mod 2**32), for a buffer laid
    out as ``mirror`` says (zeros where the files hold host bytes): block sums of its 32-bit words in 32-bit integers
    (no wider copy of the buffer: a sum in 64 bits made torch convert every word first), weighted by their block's
    position in its chunk (``weights``: 2b + 1, int64) and summed per chunk: exact mod 2**32 for any chunk size
    (under 2**58 for 32 MiB chunks; int64 wraps mod 2**64 beyond)."""
    per_chunk = mirror.chunk_bytes // BLOCK_BYTES
    words = buffer[: mirror.nbytes].view(torch.int32).view(-1, BLOCK_BYTES // 4)
    blocks = words.sum(dim=1, dtype=torch.int32)  # mod 2**32, as the definition's s_b
    return (blocks.view(-1, per_chunk).to(torch.int64) * weights).sum(dim=1)


class DeviceSnapshots:
    """The device buffers of one stream of saves (a :class:`cpuckpt.Checkpointer`'s).

    Kept per stream, not per process: a save waits on the GPU for the previous reader of the buffer it
    takes, so two streams sharing buffers would order one model's save after the other's copies, and a
    stream that closes frees only its own buffers. ``allocations`` counts the buffers allocated so far
    (a save that reused one allocated none).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[DeviceSnapshot] = []
        self.allocations = 0
        # the mirrored layout of the stream's repeated save (SaveJob._mirror): (its layouts' chunk lists, the mirror)
        self.mirrors: dict[tuple, tuple[list[Any], Mirror]] = {}
        self.mirror_refused = False  # a save's mirror was refused (said once per stream)

    def __len__(self) -> int:
        """How many buffers are kept (held by a save or idle)."""
        with self._lock:
            return len(self._buffers)

    def _take(self, device: torch.device, nbytes: int) -> tuple[DeviceSnapshot, bool]:
        """The smallest idle buffer of ``device`` with ``nbytes``, or a new one; (buffer, newly allocated).

        An idle buffer too small for this save is freed first (after its last reader ended), so buffers
        grow with the state instead of piling up.
        """
        with self._lock:
            idle = [b for b in self._buffers if not b.held and b.buffer.device == device]
            fits = [b for b in idle if b.buffer.numel() >= nbytes]
            if fits:
                snap = min(fits, key=lambda b: b.buffer.numel())
                snap.held = True
                return snap, False
            for b in idle:
                self._buffers.remove(b)
        _free(idle)
        snap = DeviceSnapshot(torch.empty(nbytes, dtype=torch.uint8, device=device), self._lock)
        with self._lock:
            self._buffers.append(snap)
            self.allocations += 1
            kept = len(self._buffers)
        logger.info("device snapshot buffer of %d bytes allocated on %s (%d kept)", nbytes, device, kept)
        return snap, True

    def snapshot_sources(self, sources: Sequence[torch.Tensor | None], device: torch.device, stream: Any,
                         caller_stream: Any, mirror: Callable[[list[int]], Mirror | None] | None = None,
                         ) -> tuple[list[torch.Tensor | None], DeviceSnapshot | None]:
        """Copy every source on ``device`` into a device buffer, enqueued on ``stream`` (already ordered after
        the trainer's writes); returns the sources with views of the buffer in their place, and the buffer (None
        when no source is on ``device``). Hand the buffer back with :func:`release`.

        ``mirror(device source indices)``: the buffer laid out as the files are (:class:`Mirror`, kept as the
        buffer's ``mirror``; None: packed), for :func:`device_share`. A newly allocated buffer may be memory the
        trainer's stream (``caller_stream``) used and freed: ``stream`` then waits for that stream once.
        """
        idx = [i for i, s in enumerate(sources) if s is not None and s.is_cuda and s.device == device]
        if not idx:
            return list(sources), None
        sizes = tuple(sources[i].numel() for i in idx)  # type: ignore[union-attr]
        mirrored = mirror(idx) if mirror is not None else None
        offsets, total = [], 0
        if mirrored is not None:
            offsets = [mirrored.bases[f] + off for f, off in mirrored.places]
            total = mirrored.nbytes
        else:
            for n in sizes:
                offsets.append(total)
                total += -(-n // _ALIGN) * _ALIGN
        key: tuple = sizes if mirrored is None else (sizes, tuple(offsets))  # never equal across the two layouts
        snap, fresh = self._take(device, total)
        try:
            if fresh:
                stream.wait_stream(caller_stream)
            elif snap.busy is not None:
                stream.wait_event(snap.busy)  # the previous save's copies out of it come first
            with torch.cuda.stream(stream):
                if snap.views is not None and snap.views[0] == key:
                    views = snap.views[1]
                else:
                    views = [snap.buffer[o : o + n] for o, n in zip(offsets, sizes)]
                    if mirrored is not None:  # zeros where the files hold host bytes, kept by later saves alike
                        snap.buffer.zero_()
                    snap.views = (key, views)
                torch._foreach_copy_(views, [sources[i] for i in idx], non_blocking=True)  # type: ignore[misc]
            snap.mirror = mirrored
        except BaseException:
            release(snap, None)
            raise
        out = list(sources)
        for i, v in zip(idx, views):
            out[i] = v
        return out, snap

    def clear(self) -> int:
        """Free the idle buffers (each after its last reader ended); returns how many. A buffer a save
        still holds stays until that save released it and the next ``clear``."""
        with self._lock:
            idle = [b for b in self._buffers if not b.held]
            self._buffers = [b for b in self._buffers if b.held]
        _free(idle)
        return len(idle)


def _free(buffers: list[DeviceSnapshot]) -> None:
    for b in buffers:
        if b.busy is not None:
            b.busy.synchronize()  # its memory goes back to the allocator: no copy may still read it


def device_share(snap: DeviceSnapshot, stream: Any) -> torch.Tensor | None:
    """Enqueue on ``stream``, after the snapshot's copy into ``snap`` (a mirrored one: ``snap.mirror``), the device
    bytes' share of each chunk's blocksum32 (:func:`device_chunk_sums`), copied into pinned host memory: read it once
    an event recorded on ``stream`` after this call completed. None for a packed snapshot. Enqueued after the event
    the trainer's stream waits for (the snapshot's copy), so the trainer never waits for the sums."""
    mirror = snap.mirror
    if mirror is None:
        return None
    per_chunk = mirror.chunk_bytes // BLOCK_BYTES
    with torch.cuda.stream(stream):
        if snap.weights is None or snap.weights.numel() != per_chunk:
            snap.weights = 2 * torch.arange(per_chunk, dtype=torch.int64, device=snap.buffer.device) + 1
        on_device = device_chunk_sums(snap.buffer, mirror, snap.weights)
        sums = torch.empty(on_device.numel(), dtype=torch.int64, pin_memory=True)
        sums.copy_(on_device, non_blocking=True)
    return sums


def release(snap: DeviceSnapshot | None, last_reader: Any) -> None:
    """Give ``snap`` back; ``last_reader`` is the CUDA event after the last copy reading it (None: none
    was enqueued, or the copies were waited for)."""
    if snap is None:
        return
    with snap.lock:
        snap.busy = last_reader
        snap.held = False
