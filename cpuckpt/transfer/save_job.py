"""One rank's save of planned file images: stage chunks into the host pool, write them as they are ready.

The layout of every file is known before the first byte is copied. Chunks are staged in file order:
CPU tensor bytes by a few fill threads (memcpy releases the GIL), GPU tensor bytes by
device-to-host copies enqueued from the caller's thread on a side stream. Writer threads take chunks
in order, wait for their copies, checksum and ``pwrite`` them, and release the slot. ``staged``
completes when every chunk is in host memory (the caller may change its tensors from then on);
``done`` completes when every file and the directory are fsynced.

*snapshot*: the pool holds every chunk, so staging never waits for storage (stall = copy time). GPU
sources: the caller's path only enqueues copies (one lease of every slot, one CUDA event at the end);
the writes are handed over once every copy completed.
*streaming*: the pool is smaller; staging waits for writes to free slots, so host memory stays at
the pool size whatever the shard size. GPU sources: one CUDA event per chunk, each chunk handed to
the writers as soon as it is enqueued.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import torch

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, CpuckptError, is_interrupt
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.format.manifest import FileEntry
from cpuckpt.transfer.device_snapshot import DeviceSnapshot, snapshot_sources
from cpuckpt.transfer.device_snapshot import release as release_snapshot
from cpuckpt.transfer.files import FileBackend, fsync_dir, get_backend
from cpuckpt.transfer.staging import (
    CopyFence,
    CopyWindow,
    DeviceCopier,
    HostPool,
    LeaseOrder,
    Slot,
    fill_chunk,
    get_pool,
    own_host_sources,
)
from cpuckpt.transfer.threads import shared_executor, wait_future
from cpuckpt.transfer.tracing import nvtx_range

__all__ = ["SaveJob", "choose_mode"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


def choose_mode(cfg: Config, image_nbytes: int, *, in_flight: int = 1) -> str:
    """Resolve ``staging.mode: auto``: snapshot unless a configured pool cannot hold the images."""
    mode = cfg.staging.mode
    if mode != "auto":
        return mode
    pool_bytes = cfg.staging.pool_bytes
    if pool_bytes == 0 or pool_bytes >= image_nbytes * in_flight:
        return "snapshot"
    return "streaming"


@dataclass
class _Stats:
    stage_s: float = 0.0
    write_s: float = 0.0
    nbytes: int = 0
    mode: str = ""
    backend: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def _cuda_device(sources: list[torch.Tensor | None]) -> torch.device | None:
    """The device of the first CUDA source (``is_cuda`` is a few times cheaper than ``device.type``)."""
    for s in sources:
        if s is not None and s.is_cuda:
            return s.device
    return None


class SaveJob:
    """Stages and writes one rank's files. Create, then ``start()`` from the thread that owns the tensors,
    or from another thread with ``start_after``, a CUDA event the owner recorded on its stream when it
    handed them over (its later kernels must not write them before the copies: see ``fence``)."""

    def __init__(self, directory: Path, names: list[str], files: list[FileLayout],
                 sources: list[torch.Tensor | None], cfg: Config, *, rank: int, mode: str,
                 in_flight: int = 1, start_after: Any = None) -> None:
        self.directory = directory
        self.names = names
        self.files = files
        self.sources = sources
        self.cfg = cfg
        self.rank = rank
        self.mode = mode
        self.in_flight = in_flight
        self.start_after = start_after  # CUDA event: the device copies wait for it, not for the current stream
        self.staged: cf.Future[None] = cf.Future()
        self.done: cf.Future[list[FileEntry]] = cf.Future()
        self.stats = _Stats(mode=mode)
        self._chunks: list[Chunk] = [c for f in files for c in f.chunks]
        self._crcs = [[0] * len(f.chunks) for f in files]
        self._cancel = threading.Event()
        self._staged_event = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending_writes = 0
        self._submitting = True
        self._remaining_fills = len(self._chunks)
        self._fds: list[int | None] = [None] * len(names)  # opened by the first write into each file
        self._open_lock = threading.Lock()
        self._backend: FileBackend | None = None
        self._pool: HostPool | None = None
        self._writers: cf.ThreadPoolExecutor | None = None
        self._fillers: cf.ThreadPoolExecutor | None = None
        self._t0 = 0.0
        self.started_at = 0.0  # perf_counter() when start() began
        # GPU sources: the end of the device-to-host copies enqueued so far (``AsyncSaveHandle.wait_stream``).
        # None: no device copies, so every byte is copied by host threads (``staged``).
        self.fence: CopyFence | None = None
        self._snapshot: DeviceSnapshot | None = None  # staging.device_snapshot: the device buffer it copied into

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin staging and writing; returns once GPU copies are enqueued (snapshot) or, in streaming
        mode, once the last chunk has a slot. Files are opened by the writer threads, off the caller's path."""
        cfg = self.cfg
        self._t0 = self.started_at = time.perf_counter()
        self.stats.nbytes = sum(f.nbytes for f in self.files)
        try:
            self._backend = get_backend(cfg.io.backend, self.directory, cfg.layout.align_bytes)
            self.stats.backend = self._backend.name
            nslots = len(self._chunks) * self.in_flight if self.mode == "snapshot" else self._streaming_slots()
            self._pool = get_pool(cfg.io.chunk_bytes, max(nslots, 1), pin=cfg.staging.pin,
                                  pretouch=cfg.staging.pretouch)
        except BaseException as e:
            self._fail(e)
            self._finalize()
            raise
        if not self._chunks:
            self._mark_staged()
        self._writers = shared_executor(cfg.io.threads, f"cpuckpt-io-{self.rank}")
        order = LeaseOrder()
        device = _cuda_device(self.sources)
        try:
            if device is not None:
                with nvtx_range("cpuckpt.stage.d2h"):
                    self._stage_on_device(order, device)
            elif self._chunks:
                self._fillers = shared_executor(cfg.io.threads, f"cpuckpt-stage-{self.rank}")
                for ticket, chunk in enumerate(self._chunks):
                    fill = self._fillers.submit(self._fill_on_host, chunk, order, ticket)
                    self._submit_write(chunk, fill)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            with self._lock:
                self._submitting = False
                idle = self._pending_writes == 0
            if idle:
                self._finalize()

    def wait_staged(self, timeout_s: float | None = None) -> None:
        """Block until every chunk is in host memory; Ctrl-C here cancels the job and propagates."""
        wait_future(self.staged, self.cfg.timeout_s if timeout_s is None else timeout_s,
                    f"staging of rank {self.rank}'s checkpoint files", on_interrupt=self.cancel)

    def wait_done(self, timeout_s: float | None = None) -> list[FileEntry]:
        """Block until every file is durable; Ctrl-C here cancels the job and propagates."""
        return wait_future(self.done, self.cfg.timeout_s if timeout_s is None else timeout_s,
                           f"writing rank {self.rank}'s checkpoint files to {self.directory}",
                           on_interrupt=self.cancel)

    def cancel(self, reason: BaseException) -> None:
        """Abort: pending chunks are skipped, the error is reported by ``staged``/``done``."""
        self._fail(reason)

    # -- staging --------------------------------------------------------------------------------
    def _streaming_slots(self) -> int:
        configured = self.cfg.staging.pool_bytes // self.cfg.io.chunk_bytes
        return max(configured, 2 * self.cfg.io.threads, 2)

    def _stage_on_device(self, order: LeaseOrder, device: torch.device) -> None:
        copier = DeviceCopier(device, after=self.start_after)
        copier.protect(self.sources)
        fence = self.fence = CopyFence(device, self.cfg.timeout_s)
        if self.mode != "snapshot":
            with copier.enqueueing():
                self._enqueue_streaming(copier, order)
            return
        # Snapshot: nothing on the caller's path but the copies (one lease of every slot, one event after
        # the last copy); the writes are handed over once staged, by the waiter (a writer woken per chunk
        # had taken the GIL from the caller).
        pool = self._require(self._pool)
        slots = pool.lease_each(len(self._chunks), self.cfg.timeout_s, cancel=self._cancel)
        if self.cfg.staging.device_snapshot and self._chunks:
            # The trainer's tensors are read by one device-to-device copy; ordering waits for it only, and
            # the copies to the host read the snapshot (transfer.device_snapshot).
            try:
                self.sources, self._snapshot = snapshot_sources(self.sources, device, copier.stream,
                                                                torch.cuda.current_stream(device))
                fence.event = copier.record()
            except BaseException:
                for slot in slots:
                    pool.release(slot)
                raise
        if self.cfg.staging.d2h_window_bytes and self._chunks:
            self.sources = own_host_sources(self.sources)  # the feeder copies host bytes after the call
            if self._snapshot is None:
                fence.enqueuing()
            self._submit_pending(f"cpuckpt-d2h-feed-{self.rank}", self._feed_then_write, copier, slots)
            return
        try:
            last = self._enqueue_snapshot(copier, slots, None)
        except BaseException:
            release_snapshot(self._snapshot, None)  # enqueue waited for what it had enqueued
            for slot in slots:
                pool.release(slot)
            raise
        if self._snapshot is None:
            fence.event = last
        else:
            release_snapshot(self._snapshot, last)
        self._submit_waiter(last, slots)

    def _enqueue_snapshot(self, copier: DeviceCopier, slots: list[Slot], window: CopyWindow | None) -> Any:
        """Enqueue every chunk's copies into its slot (:meth:`DeviceCopier.enqueue`); the event after the last."""
        targets = ((chunk, slot, self.files[chunk.file]) for chunk, slot in zip(self._chunks, slots))
        return copier.enqueue(targets, self.sources, window=window, cancel=self._cancel)

    def _feed_then_write(self, copier: DeviceCopier, slots: list[Slot]) -> None:
        last = None
        try:
            last = self._enqueue_snapshot(copier, slots, CopyWindow(self.cfg.staging.d2h_window_bytes))
        except BaseException as e:
            self._fail(e)
        finally:
            if self._snapshot is None:
                self._require(self.fence).finish(last)
            else:  # the fence is the device-to-device copy's; a failed enqueue waited for its copies
                release_snapshot(self._snapshot, last)
        self._wait_then_write(last, slots)

    def _enqueue_streaming(self, copier: DeviceCopier, order: LeaseOrder) -> None:
        """Lease, copy and hand each chunk to the writers in turn (a write frees the slot a later chunk needs)."""
        pool, fence = self._require(self._pool), self._require(self.fence)
        event = None
        for ticket, chunk in enumerate(self._chunks):
            if self._cancel.is_set():
                return
            slot = pool.lease(self.cfg.timeout_s, order=order, ticket=ticket, cancel=self._cancel)
            try:
                event = fence.event = copier.fill(slot, self.files[chunk.file], chunk, self.sources)
            except BaseException:
                pool.release(slot)
                raise
            ready: cf.Future[tuple[Slot, object]] = cf.Future()
            ready.set_result((slot, event))
            self._submit_write(chunk, ready)
        self._submit_waiter(event, [])

    def _submit_waiter(self, last: object, slots: list[Slot]) -> None:
        """One waiter marks the whole shard staged when the last copy (stream order) completed, then
        hands ``slots`` (snapshot: one per chunk, in order) to the writers."""
        self._submit_pending(f"cpuckpt-d2h-wait-{self.rank}", self._wait_then_write, last, slots, copies_end=last)

    def _submit_pending(self, executor: str, task: Callable[..., None], arg: object, slots: list[Slot], *,
                        copies_end: Any = None) -> None:
        """Run ``task(arg, slots)`` on a one-thread executor as a pending write: no finalize before it
        handed every write over. If it cannot be submitted (interpreter shutdown), the slots go back once
        the copies into them ended (``copies_end``, a CUDA event) and the error is raised."""
        with self._lock:
            self._pending_writes += 1
        try:
            self._fillers = shared_executor(1, executor)
            self._fillers.submit(self._run_pending, task, arg, slots)
        except BaseException:
            with self._lock:
                self._pending_writes -= 1
            if copies_end is not None:
                copies_end.synchronize()
            pool = self._require(self._pool)
            for slot in slots:
                pool.release(slot)
            if isinstance(self.fence, CopyFence):
                self.fence.finish(self.fence.event)  # nobody will enqueue more: order() must not wait
            raise

    def _wait_then_write(self, last: object, slots: list[Slot]) -> None:
        try:
            if last is not None:
                last.synchronize()  # type: ignore[attr-defined]
        except BaseException as e:
            self._fail(e)
        else:
            self._mark_staged()
        for chunk, slot in zip(self._chunks, slots):
            ready: cf.Future[tuple[Slot, object]] = cf.Future()
            ready.set_result((slot, None))
            self._submit_write(chunk, ready)  # after a failure each write releases its slot unwritten

    def _fill_on_host(self, chunk: Chunk, order: LeaseOrder, ticket: int) -> tuple[Slot, None]:
        pool = self._require(self._pool)
        slot = pool.lease(self.cfg.timeout_s, order=order, ticket=ticket, cancel=self._cancel)
        try:
            fill_chunk(slot, self.files[chunk.file], chunk, self.sources)
        except BaseException:
            pool.release(slot)
            raise
        self._count_fill()
        return slot, None

    def _count_fill(self) -> None:
        with self._lock:
            self._remaining_fills -= 1
            last = self._remaining_fills == 0
        if last:
            self._mark_staged()

    def _mark_staged(self) -> None:
        self.stats.stage_s = time.perf_counter() - self._t0
        self._staged_event.set()
        if not self.staged.done():
            self.staged.set_result(None)

    # -- writing --------------------------------------------------------------------------------
    def _submit_write(self, chunk: Chunk, ready: cf.Future) -> None:
        writers = self._require(self._writers)
        with self._lock:
            self._pending_writes += 1
        writers.submit(self._write_task, chunk, ready)

    def _write_task(self, chunk: Chunk, ready: cf.Future) -> None:
        self._run_pending(self._write_when_ready, chunk, ready)

    def _run_pending(self, task: Callable[..., None], *args: object) -> None:
        """Run a pending write (or the copies' waiter, which hands writes over); the last to end finalizes."""
        try:
            task(*args)
        finally:
            with self._lock:
                self._pending_writes -= 1
                idle = self._pending_writes == 0 and not self._submitting
            if idle:
                self._finalize()

    def _write_when_ready(self, chunk: Chunk, ready: cf.Future) -> None:
        try:
            slot, event = ready.result()
        except BaseException as e:
            self._fail(e)
            return
        pool, backend = self._require(self._pool), self._require(self._backend)
        try:
            if self.mode == "snapshot" and not self._staged_event.wait(self.cfg.timeout_s):
                # Snapshot writers start after staging: the stall is then copies only, with no
                # writer thread competing for the GIL (writing earlier would save < copy time).
                raise CheckpointTimeoutError(f"rank {self.rank}: staging not finished after {self.cfg.timeout_s} s")
            if event is not None:
                event.synchronize()
            if self._cancel.is_set():
                return
            with nvtx_range("cpuckpt.write"):
                self._checksum_and_write(chunk, slot, backend)
        except BaseException as e:
            self._fail(e)
        finally:
            pool.release(slot)

    def _checksum_and_write(self, chunk: Chunk, slot: Slot, backend: FileBackend) -> None:
        n = chunk.nbytes
        if self.cfg.integrity.checksum == "crc32c":
            self._crcs[chunk.file][chunk.index] = crc32c.crc32c(slot.view[:n])
        align = self.cfg.layout.align_bytes
        io_n = -(-n // align) * align if backend.aligned else n
        if io_n > n:
            slot.tensor[n:io_n].zero_()
        backend.pwrite(self._fd(chunk.file, backend), slot.view[:io_n], chunk.offset,
                       str(self.directory / self.names[chunk.file]))

    def _fd(self, file: int, backend: FileBackend) -> int:
        """File ``file``'s descriptor, opened at first use (by a writer thread, or by ``_finalize``)."""
        fd = self._fds[file]
        if fd is not None:
            return fd
        with self._open_lock:
            fd = self._fds[file]
            if fd is None:
                if self._cancel.is_set():
                    raise CpuckptError(f"rank {self.rank}: save to {self.directory} cancelled")
                fd = self._fds[file] = backend.open_write(str(self.directory / self.names[file]))
        return fd

    def _finalize(self) -> None:
        """Every submitted write has ended: close the files (on failure) or make them durable."""
        if self._cancel.is_set():
            if self._backend is not None:
                fds, self._fds = self._fds, []
                for fd in fds:
                    if fd is not None:
                        self._backend.close(fd)
            self._shutdown()
            # Reported only now that no task holds a slot or a file, so a retry starts clean.
            if not self.done.done() and self._error is not None:
                self.done.set_exception(self._error)
            return
        backend = self._require(self._backend)
        try:
            try:  # a file no write touched (no chunks: an empty file) is created here
                opened = [self._fd(i, backend) for i in range(len(self.names))]
            except BaseException:
                for fd in self._fds:
                    if fd is not None:
                        backend.close(fd)
                raise
            finally:
                self._fds = []
            for i, (fd, layout) in enumerate(zip(opened, self.files)):
                path = str(self.directory / self.names[i])
                try:
                    backend.finish_write(fd, layout.nbytes, path, self.cfg.io.fsync)
                except BaseException:
                    for other in opened[i + 1 :]:
                        backend.close(other)
                    raise
            if self.cfg.io.fsync:
                fsync_dir(self.directory)
        except BaseException as e:
            self._fail(e)
            if not self.done.done() and self._error is not None:
                self.done.set_exception(self._error)  # every task has ended: report now
            return
        self.stats.write_s = time.perf_counter() - self._t0
        entries = [
            FileEntry(name=n, nbytes=f.nbytes, chunk_bytes=self.cfg.io.chunk_bytes,
                      checksum=self.cfg.integrity.checksum, chunk_checksums=c)
            for n, f, c in zip(self.names, self.files, self._crcs)
        ]
        self._shutdown()
        logger.debug("rank %d: %d bytes staged in %.3f s, durable in %.3f s (%s, %s)", self.rank,
                     self.stats.nbytes, self.stats.stage_s, self.stats.write_s, self.mode, self.stats.backend)
        if not self.done.done():
            self.done.set_result(entries)

    @staticmethod
    def _require(obj: _T | None) -> _T:
        """Internal invariant: set up by ``start()`` before any task runs."""
        if obj is None:
            raise RuntimeError("SaveJob used before start()")
        return obj

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            first = not self._cancel.is_set()
            self._cancel.set()
        if not first:
            return
        if isinstance(e, CheckpointTimeoutError | CpuckptError | OSError):
            err = e
        elif is_interrupt(e):  # Ctrl-C on the waiting thread: the waiter re-raises the interrupt itself
            err = CpuckptError(f"rank {self.rank}: save to {self.directory} interrupted ({type(e).__name__})")
            err.__cause__ = e
        else:
            err = CpuckptError(f"rank {self.rank}: saving to {self.directory} failed: {e!r}")
            err.__cause__ = e
        logger.error("rank %d: save to %s failed: %s", self.rank, self.directory, err)
        self._error = err
        self._staged_event.set()  # release writers gated on staging; they see the cancel flag
        if not self.staged.done():
            self.staged.set_exception(err)
        if self._pool is not None:
            self._pool.wake()

    def _shutdown(self) -> None:
        """Drop references to the shared thread pools (their threads live on for the next save)."""
        self._fillers = self._writers = None
