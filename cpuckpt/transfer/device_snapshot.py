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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DeviceSnapshot", "DeviceSnapshots", "release"]

logger = logging.getLogger(__name__)

_ALIGN = 512  # each source's bytes start at this alignment in the buffer


@dataclass
class DeviceSnapshot:
    """One reusable device buffer; ``busy`` is the CUDA event after the last copy that reads it."""

    buffer: torch.Tensor
    lock: threading.Lock  # its owner's (:class:`DeviceSnapshots`)
    busy: Any = None
    held: bool = True
    # the views of the last save into it, by their sizes: a repeated save reuses them (588 slices took ~2 ms of
    # the trainer's thread on the 2-core box), and its sources then lie where they did (OffloadProgram.ops)
    views: tuple[tuple[int, ...], list[torch.Tensor]] | None = None


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
                         caller_stream: Any) -> tuple[list[torch.Tensor | None], DeviceSnapshot | None]:
        """Copy every source on ``device`` into a device buffer, enqueued on ``stream`` (already ordered after
        the trainer's writes); returns the sources with views of the buffer in their place, and the buffer
        (None when no source is on ``device``). Hand the buffer back with :func:`release`.

        A newly allocated buffer may be memory the trainer's stream (``caller_stream``) used and freed:
        ``stream`` then waits for that stream once.
        """
        idx = [i for i, s in enumerate(sources) if s is not None and s.is_cuda and s.device == device]
        if not idx:
            return list(sources), None
        sizes = tuple(sources[i].numel() for i in idx)  # type: ignore[union-attr]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        snap, fresh = self._take(device, total)
        try:
            if fresh:
                stream.wait_stream(caller_stream)
            elif snap.busy is not None:
                stream.wait_event(snap.busy)  # the previous save's copies out of it come first
            if snap.views is not None and snap.views[0] == sizes:
                views = snap.views[1]
            else:
                views = [snap.buffer[o : o + n] for o, n in zip(offsets, sizes)]
                snap.views = (sizes, views)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(views, [sources[i] for i in idx], non_blocking=True)  # type: ignore[misc]
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


def release(snap: DeviceSnapshot | None, last_reader: Any) -> None:
    """Give ``snap`` back; ``last_reader`` is the CUDA event after the last copy reading it (None: none
    was enqueued, or the copies were waited for)."""
    if snap is None:
        return
    with snap.lock:
        snap.busy = last_reader
        snap.held = False
