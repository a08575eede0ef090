"""Host staging: the reused, aligned host pool and the copy of tensor bytes into it.

``HostPool`` is one page-aligned host region allocated once per process and carved into slots of
``slot_bytes``. A slot is leased for one chunk and released when that chunk's write finished, so no
slot is reused early and host memory never exceeds the pool. When CUDA is present the region is
pinned once (cudaHostRegister), never per checkpoint, after its pages were faulted in on many
threads (``pretouch``, which ``cpuckpt.prepare_pool`` asks for: also without pinning) so the first
checkpoint does not pay for them. Leases of one save are granted in chunk order (``LeaseOrder``),
so filling may run ahead of writing by at most the pool without deadlock.

``fill_chunk`` copies one chunk of a file image into a slot: skeleton bytes, tensor bytes and
zeroed gaps. ``DeviceCopier`` orders those copies after the trainer's current CUDA stream on a side
stream and records one event per chunk, so a writer thread can start on a chunk as soon as its
device-to-host copies completed while later chunks are still copying. This is the only module that
touches CUDA streams.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import mmap
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpuckpt.errors import CheckpointTimeoutError, StagingError
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.transfer.fillplan import FillProgram
from cpuckpt.transfer.pacing import PACER
from cpuckpt.transfer.threads import usable_cpus

__all__ = [
    "CopyFence", "DeviceCopier", "HostPool", "LeaseOrder", "Slot", "caller_device", "existing_pool", "fill_chunk",
    "flat_bytes", "get_pool", "offload_ops", "own_host_sources", "pool_state", "release_pool", "unmap",
]

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """A leased run of the pool: ``tensor`` (uint8) and ``view`` (memoryview) over the same bytes."""

    index: int
    count: int
    tensor: torch.Tensor
    view: memoryview


PRETOUCH_THREADS = 16


def pretouch_pages(t: torch.Tensor) -> None:
    """Fault in every page of ``t`` (uint8) by zeroing it on up to ``PRETOUCH_THREADS`` threads.

    One thread faults ~2.3 GB/s (13 GB: 5.6 s on the H200 machine, where a trainer's torch may run
    one intra-op thread); 16 threads took 0.7 s. ``zero_`` releases the GIL, so the threads overlap.
    """
    n = t.numel()
    threads = max(1, min(PRETOUCH_THREADS, usable_cpus(), n // (64 << 20)))
    if threads == 1:
        t.zero_()
        return
    step = -(-n // threads)
    step += -step % (2 << 20)  # huge-page aligned pieces
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="cpuckpt-pretouch") as ex:
        list(ex.map(lambda lo: t[lo : lo + step].zero_(), range(0, n, step)))


class LeaseOrder:
    """Grants the leases of one save in ticket order (0, 1, 2, ...)."""

    def __init__(self) -> None:
        self.next_ticket = 0


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
        self._used = [False] * nslots
        self._nfree = nslots
        self._cond = threading.Condition()
        self.pinned = False
        t0 = time.perf_counter()
        pin = pin and torch.cuda.is_available()
        pretouch = pretouch or pin  # pinning faults every page in anyway, on one driver thread: touch on many first
        if pretouch:
            pretouch_pages(self._tensor)
        if pin:
            self._pin()
        logger.info("host pool: %d x %d bytes%s%s in %.3f s", nslots, slot_bytes, ", pinned" if self.pinned else "",
                    ", pre-touched" if pretouch else "", time.perf_counter() - t0)

    def _pin(self) -> None:
        err = torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of a %d-byte pool failed (error %s); staging unpinned", self.nbytes, err)
            return
        self.pinned = True

    def pin(self, slot: Slot, device: Any = None) -> bool:
        """Whether ``slot`` is pinned: the pool is pinned whole at creation (``ReadSlots`` pins per slot)."""
        return self.pinned

    def lease(self, timeout_s: float, *, count: int = 1, order: LeaseOrder | None = None,
              ticket: int | None = None, cancel: threading.Event | None = None) -> Slot:
        """Take ``count`` adjacent free slots, waiting for releases (back-pressure).

        With ``order``/``ticket`` the lease waits until every lower ticket of that order was granted.

        Raises:
            CheckpointTimeoutError: nothing came free within ``timeout_s``.
            StagingError: ``count`` exceeds the pool, or ``cancel`` was set while waiting.
        """
        if count > self.nslots:
            raise StagingError(f"host pool: {count} slots asked of a pool of {self.nslots}")
        start = -1

        def found() -> bool:
            nonlocal start
            start = self._find_run(count) if order is None or ticket == order.next_ticket else -1
            return start >= 0

        with self._cond:
            self._wait_for(found, count, timeout_s, cancel)
            for i in range(start, start + count):
                self._used[i] = True
            self._nfree -= count
            if order is not None:
                order.next_ticket += 1
                self._cond.notify_all()
        lo, hi = start * self.slot_bytes, (start + count) * self.slot_bytes
        return Slot(start, count, self._tensor[lo:hi], self._view[lo:hi])

    def lease_each(self, n: int, timeout_s: float, *, cancel: threading.Event | None = None) -> list[Slot]:
        """Take ``n`` single slots at once (one lock acquisition; a snapshot save leases all its chunks).

        Waits until ``n`` slots are free; nothing is held while waiting, so two such leases cannot deadlock.

        Raises:
            CheckpointTimeoutError: ``n`` slots did not come free within ``timeout_s``.
            StagingError: ``n`` exceeds the pool, or ``cancel`` was set while waiting.
        """
        if n > self.nslots:
            raise StagingError(f"host pool: {n} slots asked of a pool of {self.nslots}")
        with self._cond:
            self._wait_for(lambda: self._nfree >= n, n, timeout_s, cancel)
            free = [i for i, used in enumerate(self._used) if not used][:n]
            for i in free:
                self._used[i] = True
            self._nfree -= n
        size, tensor, view = self.slot_bytes, self._tensor, self._view
        return [Slot(i, 1, tensor[i * size : (i + 1) * size], view[i * size : (i + 1) * size]) for i in free]

    def _wait_for(self, ready: Callable[[], bool], n: int, timeout_s: float, cancel: threading.Event | None) -> None:
        """Wait on ``_cond`` (held) until ``ready()``, releases waking it up (back-pressure); a trainer
        whose ticks pace earlier saves' copies enqueues them first (the slots come free as they go on)."""
        if ready():
            return
        PACER.drain_for_wait()
        self._wait_slots(ready, n, timeout_s, cancel)

    def _wait_slots(self, ready: Callable[[], bool], n: int, timeout_s: float, cancel: threading.Event | None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if cancel is not None and cancel.is_set():
                raise StagingError("host pool: lease abandoned, the save was cancelled")
            if ready():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckpointTimeoutError(
                    f"host pool: {n} free slot(s) of {self.nslots} not available within {timeout_s:.0f} s"
                )
            self._cond.wait(min(remaining, 1.0))

    def _find_run(self, count: int) -> int:
        if self._nfree < count:
            return -1
        run = 0
        for i, used in enumerate(self._used):
            run = 0 if used else run + 1
            if run == count:
                return i - count + 1
        return -1

    def release(self, slot: Slot) -> None:
        with self._cond:
            for i in range(slot.index, slot.index + slot.count):
                self._used[i] = False
            self._nfree += slot.count
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake waiting leases so they notice a cancellation."""
        with self._cond:
            self._cond.notify_all()

    @property
    def free_slots(self) -> int:
        with self._cond:
            return self._nfree

    def close(self) -> None:
        """Unpin, then unmap (only when no slot is leased).

        Views handed out for finished chunks may still be referenced by completed futures; the
        mapping is then freed by the garbage collector once the last of them goes.
        """
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self.pinned = False
        del self._tensor
        unmap(self._view, self._mmap, "host pool")


def unmap(view: memoryview, mapping: mmap.mmap, what: str) -> None:
    """Release ``view`` and close ``mapping`` now, or, while views of it are still referenced (completed
    futures may hold slots' views), leave it to the garbage collector."""
    try:
        view.release()
        mapping.close()
    except BufferError:
        logger.debug("%s: views still referenced; unmapped when they are collected", what)


# Per process: pinning costs 0.4-0.6 s/GiB, so one bounded pool is registered once and every stream's saves
# lease from it. Must not be replaced or shrunk while a slot is leased, nor shared with another process.
_POOL: HostPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(slot_bytes: int, nslots: int, *, pin: bool, pretouch: bool = False) -> HostPool:
    """The process's pool, created at first use and reused while its slots are large and many enough.

    A pool that is too small is replaced (once idle) by one large enough for both uses. A new pool is
    touched at creation when it is pinned, or with ``pretouch`` (``cpuckpt.prepare_pool``) also without.

    Raises:
        StagingError: the pool is too small and in use by another save.
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
                    f"{nslots} x {slot_bytes} bytes; set staging.pool_bytes large enough for every save in flight"
                )
            nslots = max(nslots, pool.nbytes // slot_bytes)
            logger.info("replacing host pool of %d bytes by %d bytes", pool.nbytes, slot_bytes * nslots)
            pool.close()
            _POOL = None
        _POOL = HostPool(slot_bytes, nslots, pin=pin, pretouch=pretouch)
        return _POOL


def existing_pool(slot_bytes: int, nslots: int = 1) -> HostPool | None:
    """The process's pool when it exists with ``nslots`` slots of at least ``slot_bytes``; never creates one."""
    pool = _POOL
    return pool if pool is not None and pool.slot_bytes >= slot_bytes and pool.nslots >= nslots else None


def pool_state() -> tuple[int, bool]:
    """``(nbytes, pinned)`` of the process's pool, ``(0, False)`` when there is none; never creates one."""
    pool = _POOL
    return (pool.nbytes, bool(pool.pinned)) if pool is not None else (0, False)


def release_pool() -> None:
    """Free the process's pool (e.g. at the end of training); the next save makes a new one."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def caller_device() -> int | None:
    """The calling thread's CUDA device where CUDA is in use, for a thread of ours that pins for it: a new thread's
    is device 0, so every rank of a node would make a context there and pin for it alone (a registration is not
    portable). None: CUDA not in use (the thread pins nothing, or under device 0 as the caller would)."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def consume_cuda_error() -> None:
    """Clear the CUDA runtime's last error that a failed ``cudaHostRegister`` leaves behind.

    (E.g. a file on a disk filesystem, not tmpfs.) The runtime keeps it until someone asks, and
    PyTorch asks after its next kernel launch, which would then fail for no fault of its own (on the
    H200: a device gather of the next save raised "invalid argument"). A tiny launch here takes it.
    """
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError is a RuntimeError: the stale error, now cleared
        pass


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (made contiguous first if it is not)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views: materialise the values
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def own_host_sources(sources: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``sources`` with every CPU tensor cloned, for copies paced after the call returned
    (``staging.d2h_window_bytes``): the caller may change its CPU tensors at once (the ordering contract),
    and nothing else makes it wait for the pieces before that."""
    return [s.clone() if s is not None and not s.is_cuda else s for s in sources]


def fill_chunk(slot: Slot, layout: FileLayout, chunk: Chunk, sources: Sequence[torch.Tensor | None],
               *, deferred: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               described: Callable[[int, torch.Tensor, int, int], bool] | None = None) -> None:
    """Copy the image bytes of ``chunk`` into ``slot``: skeletons, tensor bytes, zeros in gaps.

    With ``deferred`` the tensor copies are appended there as (dst, src) pairs instead, for the
    caller to issue in one batch. ``described(file_offset, src, src_offset, nbytes)`` is asked first
    about each tensor run: True means the caller copies those bytes itself (another process's copy,
    described by offsets: no tensor views are made for it). A chunk's host fill program is used only
    when neither is given.
    """
    start, stop = chunk.offset, chunk.offset + chunk.nbytes
    buf, view = slot.tensor, slot.view
    cursor = start
    program = _host_program(layout, chunk) if deferred is None and described is None else None
    try:
        if program is not None:  # one batched copy of prepared pieces (transfer.fillplan)
            program.fill(buf[: chunk.nbytes])
            return
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
                if described is not None and described(lo, src, s, hi - lo):  # type: ignore[arg-type]
                    cursor = hi
                    continue
                pair = (buf[lo - start : hi - start], src[s : s + hi - lo])  # type: ignore[index]
                if deferred is None:
                    pair[0].copy_(pair[1])
                else:
                    deferred.append(pair)
            cursor = hi
        if cursor < stop:
            buf[cursor - start : stop - start].zero_()
    except RuntimeError as e:
        raise StagingError(f"copying bytes [{cursor}, {stop}) of file {chunk.file} into host memory failed: {e}") from e


def offload_ops(ops: array, base: int, is_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda
                ) -> Callable[[int, int], Callable[[int, torch.Tensor, int, int], bool]]:
    """``fill_chunk``'s ``described`` for a process that copies device bytes out of one buffer: per chunk
    ``k`` of file ``file``, each run of a device source whose bytes start at address ``base`` (the device
    snapshot) becomes the op ``(k, offset in the buffer, file, file offset, nbytes)`` in ``ops`` (the
    fields of :data:`cpuckpt.transfer.sinks.OP_FIELDS`); host sources are left to ``fill_chunk``."""

    def for_chunk(k: int, file: int) -> Callable[[int, torch.Tensor, int, int], bool]:
        def described(file_offset: int, src: torch.Tensor, src_offset: int, nbytes: int) -> bool:
            if not is_device(src):
                return False
            ops.extend((k, src.data_ptr() - base + src_offset, file, file_offset, nbytes))
            return True

        return described

    return for_chunk


def _host_program(layout: FileLayout, chunk: Chunk) -> FillProgram | None:
    programs = layout.fill_programs
    if not programs:
        return None
    program = programs.get(chunk.index)
    return program if program is not None and program.device is None else None


class CopyFence:
    """The end of a save's device-to-host copies, for ordering GPU work after them without a host wait.

    ``event`` is recorded on the copier's side stream after the last copy enqueued so far;
    ``devices`` are the CUDA devices the copies read from.
    """

    def __init__(self, device: torch.device, timeout_s: float = 600.0) -> None:
        self.event: Any = None
        self.devices: set[torch.device] = {device}
        self.timeout_s = timeout_s
        self._final = threading.Event()  # ``event`` is the last copy's (cleared while pieces are pending)
        self._final.set()
        self._drain: Callable[[], None] | None = None

    def enqueuing(self, drain: Callable[[], None]) -> None:
        """Copies are still being enqueued (paced: ``staging.d2h_window_bytes``); ``order`` first calls
        ``drain``, which enqueues the rest, then waits for :meth:`finish`."""
        self._drain = drain
        self._final.clear()

    def finish(self, event: Any) -> None:
        """Every copy is enqueued; ``event`` follows the last."""
        self.event = event
        self._final.set()

    def order(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream of every device in ``devices``) wait for the copies.

        A GPU-side wait (``cudaStreamWaitEvent``): the host does not block. Copies of a paced save not yet
        enqueued are enqueued first, on this thread (:meth:`~cpuckpt.transfer.pacing.Pacer.drain`).
        Kernels enqueued on that stream afterwards run only once every copy of the save has completed.

        Raises:
            CheckpointTimeoutError: the copies were not all enqueued within ``timeout_s``.
        """
        if not self._final.is_set():
            if self._drain is not None:
                self._drain()
            if not self._final.wait(self.timeout_s):
                raise CheckpointTimeoutError(f"device-to-host copies not all enqueued within {self.timeout_s:.0f} s")
        event = self.event
        if event is None:
            return
        if stream is not None:
            stream.wait_event(event)
            return
        for device in sorted(self.devices, key=str):
            torch.cuda.current_stream(device).wait_event(event)


class DeviceCopier:
    """Enqueues device-to-host chunk copies on a side stream ordered after the trainer's stream."""

    def __init__(self, device: torch.device, after: Any = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._caller_stream = torch.cuda.current_stream(device)
        # Copies start only after kernels already queued on the trainer's stream (that may still
        # write the tensors) have finished; ``after`` (a CUDA event the trainer recorded when it handed
        # the tensors over) when the copies are enqueued later, from another thread: waiting for the
        # stream then would also wait for the trainer's next kernels.
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(self._caller_stream)
        self._scratch: torch.Tensor | None = None  # device gathers (fillplan), reused chunk after chunk
        self._entered = False  # inside enqueueing(): the side stream is already current

    @contextlib.contextmanager
    def enqueueing(self) -> Iterator[None]:
        """Make the side stream current for a run of :meth:`fill` calls: one stream switch per save
        instead of one per chunk (each ``torch.cuda.stream`` context cost ~50 µs on the H200)."""
        with torch.cuda.stream(self.stream):
            self._entered = True
            try:
                yield
            finally:
                self._entered = False

    def _on_stream(self) -> Any:
        return contextlib.nullcontext() if self._entered else torch.cuda.stream(self.stream)

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of one device buffer that every gather of this copier reuses in stream order.

        Allocated on the caller's (trainer's) stream, so the caching allocator gives the block back to
        training afterwards (a block allocated on a side stream stays cached for that stream, and the
        streams come from a pool of 32); ``record_stream`` delays its reuse until the side stream's
        copies are done.
        """
        scratch = self._scratch
        if scratch is None or scratch.numel() < nbytes:
            with torch.cuda.stream(self._caller_stream):  # not the side stream ``enqueueing`` made current
                scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            scratch.record_stream(self.stream)
            self._scratch = scratch
        return scratch[:nbytes]

    def protect(self, sources: Sequence[torch.Tensor | None]) -> None:
        """Keep the caching allocator from reusing source memory before our copies ran."""
        stream = self.stream
        for s in sources:
            if s is not None and s.is_cuda:
                s.record_stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on the side stream (keeps device memory alive for the allocator)."""
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def copy_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """``copy`` of many pairs with one stream switch and one ``_foreach_copy_`` call: a load's
        per-item Python (a stream context per item) had cost as much as the copies themselves."""
        for t in (*srcs, *dsts):
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)

    def drain(self) -> None:
        """Wait for every copy enqueued so far, after a failure (no copy may land in memory handed back);
        an error here is dropped: the failure that led here is the one reported."""
        with contextlib.suppress(BaseException):
            self.stream.synchronize()

    def record(self) -> Any:
        """An event marking everything enqueued so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def fill(self, slot: Slot, layout: FileLayout, chunk: Chunk, sources: Sequence[torch.Tensor | None], *,
             record: bool = True, batch: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        """Fill ``slot`` asynchronously; returns the CUDA event that marks its completion (None when
        ``record`` is false: the caller records one event after a run of chunks, ~10 µs saved per chunk).

        A chunk with a device program (``transfer.fillplan``) is gathered on the device into a scratch
        buffer and copied to the host in one copy; a host program is copied at once; any other chunk
        is copied segment by segment: with ``batch`` (and ``record`` false) its (dst, src) pairs are
        appended there for one :meth:`copy_batch` after a run of chunks (one call for a whole save
        instead of one per chunk).
        """
        programs = layout.fill_programs
        program = programs.get(chunk.index) if programs else None
        if program is not None and program.device == self.device:
            scratch = self._scratch_for(chunk.nbytes)
            with self._on_stream():
                program.fill(scratch)
                slot.tensor[: chunk.nbytes].copy_(scratch, non_blocking=True)
        elif program is not None and program.device is None:  # host bytes only: copied now
            fill_chunk(slot, layout, chunk, sources)
        else:
            if batch is not None and not record:
                fill_chunk(slot, layout, chunk, sources, deferred=batch)
                return None
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            fill_chunk(slot, layout, chunk, sources, deferred=pairs)
            self.copy_batch(pairs)
        return self.record() if record else None

    def enqueue(self, targets: Iterable[tuple[Chunk, Slot, FileLayout]], sources: Sequence[torch.Tensor | None], *,
                cancel: threading.Event, each: Callable[[Chunk, Any], object] | None = None) -> Any:
        """Enqueue the copies of every (chunk, slot, layout) of a save at once; returns the event after the
        last copy (paced saves go piece by piece instead: :mod:`.pacing`).

        ``each`` gets every chunk's own event (the memory images' checksums); without it, every chunk's
        copies go in one :meth:`copy_batch`. Stops early once ``cancel`` is set. On a failure the copies
        already enqueued are waited for before it is raised (no copy may land in memory handed back).
        """
        record = each is not None
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with self.enqueueing():
                for chunk, slot, layout in targets:
                    if cancel.is_set():
                        break
                    event = self.fill(slot, layout, chunk, sources, record=record, batch=batch)
                    if each is not None:
                        each(chunk, event)
                self.copy_batch(batch)
                return self.record()
        except BaseException:
            self.drain()
            raise

    def copy_batch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue the (dst, src) pairs :meth:`fill` deferred, in one ``_foreach_copy_`` (the per-copy
        Python overhead is stall time); empties ``pairs``."""
        if pairs:
            with self._on_stream():
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=True)
            pairs.clear()
