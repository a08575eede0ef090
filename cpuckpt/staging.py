"""Host staging: the reused, aligned host pool and the copy of tensor bytes into it.

``HostPool`` is one page-aligned host region allocated once per process and carved into slots of
``slot_bytes``; a slot is leased for one chunk and released when that chunk's write finished, so
no slot is reused early and host memory never exceeds the pool. When CUDA is present the region is
pinned once (cudaHostRegister), never per checkpoint. ``fill_chunk`` copies one chunk of a file
image into a slot: skeleton bytes, tensor bytes (any device; GPU bytes are copied device-to-host)
and zeroed gaps.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import CheckpointTimeoutError, StagingError
from .layout import Chunk, FileLayout

__all__ = ["HostPool", "Slot", "fill_chunk", "flat_bytes", "get_pool"]

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """A leased piece of the pool: ``tensor`` (uint8) and ``view`` (memoryview) over the same bytes."""

    index: int
    tensor: torch.Tensor
    view: memoryview


class HostPool:
    """A fixed host region of ``nslots * slot_bytes`` bytes with blocking slot leases."""

    def __init__(self, slot_bytes: int, nslots: int, *, pin: bool = True, pretouch: bool = False) -> None:
        if slot_bytes <= 0 or nslots <= 0:
            raise ValueError(f"pool needs slot_bytes > 0 and nslots > 0, got {slot_bytes} x {nslots}")
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.nbytes = slot_bytes * nslots
        self._mmap = mmap.mmap(-1, self.nbytes)  # page-aligned: O_DIRECT-ready
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._view = memoryview(self._mmap)
        self._free = list(range(nslots - 1, -1, -1))
        self._cond = threading.Condition()
        self.pinned = False
        if pretouch:
            self._tensor.zero_()
        if pin and torch.cuda.is_available():
            self._pin()

    def _pin(self) -> None:
        err = torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of a %d-byte pool failed (error %s); staging unpinned", self.nbytes, err)
            return
        self.pinned = True

    def lease(self, timeout_s: float) -> Slot:
        """Take a free slot, waiting for one to be released (back-pressure).

        Raises:
            CheckpointTimeoutError: no slot came free within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._free:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CheckpointTimeoutError(
                        f"host pool: no free slot of {self.nslots} within {timeout_s:.0f} s"
                    )
                self._cond.wait(min(remaining, 1.0))
            i = self._free.pop()
        lo = i * self.slot_bytes
        return Slot(i, self._tensor[lo : lo + self.slot_bytes], self._view[lo : lo + self.slot_bytes])

    def release(self, slot: Slot) -> None:
        with self._cond:
            self._free.append(slot.index)
            self._cond.notify()

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        """Unpin and unmap (only when no slot is leased)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self.pinned = False
        self._view.release()
        del self._tensor
        self._mmap.close()


_POOL: HostPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(slot_bytes: int, nslots: int, *, pin: bool, pretouch: bool) -> HostPool:
    """The process's pool, created at first use and reused while its slots are large and many enough.

    A pool that is too small is replaced (once idle) by one large enough for both uses.
    """
    global _POOL
    with _POOL_LOCK:
        pool = _POOL
        if pool is not None and pool.slot_bytes >= slot_bytes and pool.nslots >= nslots:
            return pool
        if pool is not None:
            if pool.free_slots != pool.nslots:
                raise StagingError(
                    f"host pool ({pool.nslots} x {pool.slot_bytes} bytes) is in use and too small for "
                    f"{nslots} x {slot_bytes} bytes; raise staging.pool_bytes or io.chunk_bytes consistently"
                )
            slot_bytes, nslots = max(slot_bytes, pool.slot_bytes), max(nslots, pool.nslots)
            logger.info("replacing host pool of %d bytes by %d bytes", pool.nbytes, slot_bytes * nslots)
            pool.close()
            _POOL = None
        _POOL = HostPool(slot_bytes, nslots, pin=pin, pretouch=pretouch)
        return _POOL


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (made contiguous first if it is not)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def fill_chunk(slot: Slot, layout: FileLayout, chunk: Chunk, sources: Sequence[torch.Tensor | None]) -> None:
    """Copy the image bytes of ``chunk`` into ``slot``: skeletons, tensor bytes, zeros in gaps."""
    start, stop = chunk.offset, chunk.offset + chunk.nbytes
    buf, view = slot.tensor, slot.view
    cursor = start
    try:
        for seg in layout.segments_in(start, stop):
            lo, hi = max(seg.file_offset, start), min(seg.file_offset + seg.nbytes, stop)
            if lo > cursor:
                buf[cursor - start : lo - start].zero_()
            s = lo - seg.file_offset
            if seg.payload is not None:
                view[lo - start : hi - start] = memoryview(seg.payload)[s : s + hi - lo]
            else:
                src = sources[seg.item]
                s += seg.src_offset
                buf[lo - start : hi - start].copy_(src[s : s + hi - lo])  # type: ignore[index]
            cursor = hi
        if cursor < stop:
            buf[cursor - start : stop - start].zero_()
    except RuntimeError as e:
        raise StagingError(f"copying bytes [{cursor}, {stop}) of file {chunk.file} into host memory failed: {e}") from e
