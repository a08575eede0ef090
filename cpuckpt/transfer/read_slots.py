"""Staging slots for one load in a process without a host pool: pinned one slot at a time, while reading.

A restarted trainer has no pinned pool yet. Pinning one before the first read costs its whole size up
front (on the H200: 16 x 32 MiB pinned in 0.15-1.0 s, touched first 0.18-0.23 s), and a fresh process's
4 GiB load from tmpfs then ran at 3.3-9.75 GB/s against 16-20 GB/s once a pool existed. :class:`ReadSlots`
pins nothing at creation: each slot is registered (``cudaHostRegister``) by the read thread that first
copies from it to a GPU, after its first ``pread`` faulted its pages in, so the pinning of one slot
overlaps the reads and copies of the others (the same load: 12.9-13.2 GB/s with 16 slots, 13.0-13.4 with 12,
11.1-11.5 with 8), and a load into CPU tensors pins nothing at all.

Slots are registered separately, so a lease is always one slot (a copy never spans two
registrations). The process pool (``staging.get_pool``) stays what saves use; a process that loads
often but never saves can make one (``cpuckpt.prepare_pool``) for its loads to read through. A slot is
registered under the device it is copied to (a read thread's current device is device 0, where a rank
of another GPU must not make a context) and portable (later chunks may go to another device).
:meth:`close` unpins and unmaps: the slots live for one load; :meth:`close_later` does it off the
caller's path.

Owns: one anonymous page-aligned mapping (O_DIRECT-ready), its per-slot registrations, the free list.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading

import torch

from cpuckpt.errors import CheckpointTimeoutError, StagingError
from cpuckpt.transfer.staging import Slot, unmap

__all__ = ["ReadSlots"]

logger = logging.getLogger(__name__)

_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every context, not only the registering one


class ReadSlots:
    """``nslots`` slots of ``slot_bytes`` with blocking leases; a slot is pinned at :meth:`pin` (``pin``:
    whether pinning is wanted at all, e.g. ``staging.pin``).

    Slots start on page boundaries (a page is never shared by two registrations). Once closed, no slot is
    leased again; a close while slots are still leased (a read thread outliving a timed-out load) is
    carried out by the last release, so nothing is unpinned or unmapped under a copy.
    """

    def __init__(self, slot_bytes: int, nslots: int, *, pin: bool = True) -> None:
        if slot_bytes <= 0 or nslots <= 0:
            raise ValueError(f"read slots need slot_bytes > 0 and nslots > 0, got {slot_bytes} x {nslots}")
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self._stride = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.nbytes = self._stride * nslots
        self._want_pin = pin and torch.cuda.is_available()
        self._mmap = mmap.mmap(-1, self.nbytes)
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._view = memoryview(self._mmap)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(nslots):
            self._free.put(i)
        self._pinned = [False] * nslots  # each entry is only changed by the thread holding that slot
        self._failed = threading.Event()  # a registration was refused: the rest copy unpinned too
        self._lock = threading.Lock()
        self._leased = 0
        # -> "closing" (close asked while leased: the last release closes) -> "tearing down" -> "closed"
        # (unpinned and unmapped: set last, so whoever sees "closed" sees the mapping gone)
        self._state = "open"
        self._device: torch.device | None = None  # where the first slot was registered (unregistered there)
        self.pinned_nbytes = 0

    def lease(self, timeout_s: float) -> Slot:
        """A free slot, waiting up to ``timeout_s`` for one to be released.

        Raises:
            CheckpointTimeoutError: none came free in time.
            StagingError: the slots were closed.
        """
        try:
            i = self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise CheckpointTimeoutError(f"read slots: none of {self.nslots} free within {timeout_s:.0f} s") from None
        with self._lock:
            if self._state != "open":
                self._free.put(i)
                raise StagingError("read slots: leased after the load closed them")
            self._leased += 1
        lo = i * self._stride
        return Slot(i, 1, self._tensor[lo : lo + self.slot_bytes], self._view[lo : lo + self.slot_bytes])

    def release(self, slot: Slot) -> None:
        with self._lock:
            self._leased -= 1
            last = self._leased == 0 and self._state == "closing"
        self._free.put(slot.index)
        if last:
            self._teardown()

    def pin(self, slot: Slot, device: torch.device) -> bool:
        """Pin ``slot`` for host-to-device copies to ``device`` (once; the caller holds the lease). False:
        copies from it run unpinned (pinning not wanted, no CUDA, or the driver refused: logged once)."""
        i = slot.index
        if self._pinned[i]:
            return True
        if not self._want_pin or self._failed.is_set():
            return False
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(slot.tensor.data_ptr(), self.slot_bytes, _PORTABLE)
        if int(err) != 0:
            if not self._failed.is_set():
                self._failed.set()
                logger.warning("cudaHostRegister of a %d-byte read slot failed (error %s); this load copies "
                               "unpinned", self.slot_bytes, err)
            return False
        self._pinned[i] = True
        with self._lock:
            self.pinned_nbytes += self.slot_bytes
            self._device = self._device or device
        return True

    def close(self) -> None:
        """Unpin every slot and unmap, now or, while slots are still leased, at the last release (their
        reads may still be copying from them). Idempotent."""
        with self._lock:
            if self._state != "open":
                return
            self._state = "closing"
            leased = self._leased
        if leased:
            logger.warning("read slots: %d of %d slots still leased at close; unpinned and unmapped at their "
                           "release", leased, self.nslots)
            return
        self._teardown()

    def _teardown(self) -> None:
        with self._lock:
            if self._state in ("tearing down", "closed"):
                return
            self._state = "tearing down"
        if self._device is not None:
            with torch.cuda.device(self._device):
                for i, pinned in enumerate(self._pinned):
                    if pinned:
                        torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr() + i * self._stride)
                        self._pinned[i] = False
        del self._tensor
        unmap(self._view, self._mmap, "read slots")
        with self._lock:
            self._state = "closed"

    def close_later(self) -> None:
        """:meth:`close` on a thread of its own: a load returns without waiting for the unpinning. Not a daemon: the
        interpreter's exit waits for it (a daemon thread still freeing the slots' tensor when the interpreter
        finalizes is ended inside torch's C++ and aborts the process: "terminate called without an active
        exception", exit code -6, seen in a CI run of a process that exited right after a load)."""
        threading.Thread(target=self.close, name="cpuckpt-read-slots-close").start()

    def __enter__(self) -> ReadSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
