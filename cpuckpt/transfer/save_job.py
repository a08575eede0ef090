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
The caller picks the mode: async saves by :func:`choose_mode` (from ``staging.pool_bytes``),
synchronous saves always stream.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, CpuckptError, StagingError, StorageIOError, is_interrupt
from cpuckpt.format.checksums import BLOCKSUM32, CRC32C, blocksum32_plus, chunk_checksum
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.format.manifest import FileEntry
from cpuckpt.transfer.device_snapshot import BLOCK_BYTES, DeviceSnapshot, DeviceSnapshots, Mirror, device_share
from cpuckpt.transfer.device_snapshot import release as release_snapshot
from cpuckpt.transfer.fillplan import without_device_programs
from cpuckpt.transfer.pacing import PACER
from cpuckpt.transfer.sinks import AUTO, DeviceCopies, PoolSink, Sink, SlotSource
from cpuckpt.transfer.staging import (
    CopyFence,
    DeviceCopier,
    LeaseOrder,
    Slot,
    fill_chunk,
    offload_ops,
    own_host_sources,
)
from cpuckpt.transfer.threads import shared_executor, wait_future
from cpuckpt.transfer.tracing import nvtx_range

__all__ = ["SaveJob", "choose_mode"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


def choose_mode(cfg: Config, image_nbytes: int, *, in_flight: int = 1) -> str:
    """The staging mode of an async save of ``image_nbytes`` with ``in_flight`` saves in flight, from
    ``staging.pool_bytes``: snapshot when it is 0 (the pool grows to the shard) or holds the images of
    every save in flight, streaming when it is smaller (a bounded pool, recycled while writing)."""
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
    """Stages one rank's files and hands each chunk to a sink. Create, then ``start()`` from the thread
    that owns the tensors, or from another thread with ``start_after``, a CUDA event the owner recorded
    on its stream when it handed them over (its later kernels must not write them before the copies:
    see ``fence``).

    ``sink`` is where the chunks go (default: :class:`~cpuckpt.transfer.sinks.PoolSink`, files through
    the pinned pool); a sink whose slots are the destination (``holds_every_chunk``: the memory tier's
    images) is staged as a snapshot and reported as ``mode`` ``"memory"``. ``snapshots`` are the device
    buffers of the save stream it belongs to (``staging.device_snapshot``).
    """

    def __init__(self, directory: Path, names: list[str], files: list[FileLayout],
                 sources: list[torch.Tensor | None], cfg: Config, *, rank: int, mode: str,
                 in_flight: int = 1, start_after: Any = None, sink: Sink | None = None,
                 snapshots: DeviceSnapshots | None = None) -> None:
        if len(names) != len(files):
            raise ValueError(f"{len(names)} file names for {len(files)} layouts")
        self.directory = directory
        self.names = names
        self.files = files
        self.sources = sources
        self.cfg = cfg
        self.rank = rank
        self.sink: Sink = sink if sink is not None else PoolSink(directory, names, files, cfg, rank=rank)
        self.mode = "memory" if self.sink.holds_every_chunk else mode
        self._streaming = self.mode == "streaming"
        self.in_flight = in_flight
        self.start_after = start_after  # CUDA event: the device copies wait for it, not for the current stream
        self.staged: cf.Future[None] = cf.Future()
        self.done: cf.Future[list[FileEntry]] = cf.Future()
        self.stats = _Stats(mode=self.mode)
        self._chunks: list[Chunk] = [c for f in files for c in f.chunks]
        self._crcs = [[0] * len(f.chunks) for f in files]
        self._cancel = threading.Event()
        self._staged_event = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # Tasks not ended (writes, the copies' waiter and the paced pieces, which hand writes over) and whether
        # ``start()`` still submits: the job finalizes when both are done, never while tasks are queued.
        self._pending_writes = 0
        self._submitting = False  # set by start(): a job cancelled before it started finalizes at once
        self._finalized = False  # _finalize runs once (a cancel before start() reaches it twice)
        self._remaining_fills = len(self._chunks)
        self._slots: SlotSource | None = None
        self._writers: cf.ThreadPoolExecutor | None = None
        self._fillers: cf.ThreadPoolExecutor | None = None
        self._t0 = 0.0
        self.started_at = 0.0  # perf_counter() when start() began
        # GPU sources: the end of the device-to-host copies enqueued so far (``AsyncSaveHandle.wait_stream``).
        # None: no device copies, so every byte is copied by host threads (``staged``).
        self.fence: CopyFence | None = None
        # staging.device_snapshot: the save stream's device buffers (none given: this job's own)
        self.snapshots = snapshots if snapshots is not None else DeviceSnapshots()
        self._snapshot: DeviceSnapshot | None = None  # staging.device_snapshot: the device buffer it copied into
        # blocksum32 of a mirrored snapshot's device bytes per chunk (pinned, int64), summed on the GPU
        self._device_sums: torch.Tensor | None = None
        self._sums_done: Any = None  # the CUDA event after their copy to the host
        self._offloaded = False  # the sink's process copies and checksums this save (Sink.submit_offload)
        # the kind of this save's chunk checksums: the sink's, "auto" resolved (blocksum32 once a mirrored snapshot is
        # taken, below)
        self._kind = CRC32C if self.sink.checksum_kind == AUTO else self.sink.checksum_kind

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin staging and writing; returns once GPU copies are enqueued (snapshot) or, in streaming
        mode, once the last chunk has a slot. Files are opened by the writer threads, off the caller's path.

        Raises:
            The error ``staged`` and ``done`` report, when the save failed before returning.
        """
        cfg = self.cfg
        self._t0 = self.started_at = time.perf_counter()
        self.stats.nbytes = sum(f.nbytes for f in self.files)
        try:
            with self._lock:
                if self._error is not None:  # cancelled before it started
                    raise self._error
                self._submitting = True
            nslots = self._streaming_slots() if self._streaming else self._snapshot_slots()
            self._slots = self.sink.open(nslots, self.done)
            self.stats.backend = self.sink.name
        except BaseException as e:
            self._fail(e)
            self._finalize()
            self._reraise(e)
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
            self._reraise(e)
        finally:
            with self._lock:
                self._submitting = False
                idle = self._pending_writes == 0
            if idle:
                self._finalize()

    def wait_staged(self, timeout_s: float | None = None) -> None:
        """Block until every chunk is in host memory; Ctrl-C here cancels the job and propagates. Paced
        copies still pending are enqueued first, on this thread (the caller is about to change its tensors)."""
        if not self.staged.done():
            PACER.drain()
        wait_future(self.staged, self.cfg.timeout_s if timeout_s is None else timeout_s,
                    f"staging of rank {self.rank}'s checkpoint files in {self.directory}", on_interrupt=self.cancel)

    def wait_done(self, timeout_s: float | None = None) -> list[FileEntry]:
        """Block until every file is durable (memory: in place); Ctrl-C here cancels the job and propagates."""
        return wait_future(self.done, self.cfg.timeout_s if timeout_s is None else timeout_s,
                           f"saving rank {self.rank}'s checkpoint files in {self.directory}",
                           on_interrupt=self.cancel)

    def cancel(self, reason: BaseException) -> None:
        """Abort: pending chunks are skipped, ``staged``/``done`` report ``reason`` (``done`` once no task
        still copies into a slot or writes)."""
        self._fail(reason, wrap=False)
        with self._lock:
            idle = self._pending_writes == 0 and not self._submitting
        if idle:
            self._finalize()

    # -- staging --------------------------------------------------------------------------------
    def _streaming_slots(self) -> int:
        configured = self.cfg.staging.pool_bytes // self.cfg.io.chunk_bytes
        return max(configured, 2 * self.cfg.io.threads, 2)

    def _snapshot_slots(self) -> int:
        """A slot for every chunk of every save in flight; a configured ``pool_bytes`` is the pool's size
        (the same pool as the synchronous saves' and ``prepare_pool``'s: a shard that grows within it
        does not replace it)."""
        return max(len(self._chunks) * self.in_flight, self.cfg.staging.pool_bytes // self.cfg.io.chunk_bytes)

    def _stage_on_device(self, order: LeaseOrder, device: torch.device) -> None:
        copier = DeviceCopier(device, after=self.start_after)
        copier.protect(self.sources)
        fence = self.fence = CopyFence(device, self.cfg.timeout_s)
        if self._streaming:
            with copier.enqueueing():
                self._enqueue_streaming(copier, order)
            return
        # Snapshot: nothing on the caller's path but the copies (one lease of every slot, one event after
        # the last copy); the writes are handed over by the waiter (a writer woken per chunk had taken the
        # GIL from the caller): once staged, or each after its own copy (``sink.write_as_copied``).
        source = self._require(self._slots)
        slots = source.lease_each(len(self._chunks), self.cfg.timeout_s, cancel=self._cancel)
        if self.cfg.staging.device_snapshot and self._chunks:
            # The trainer's tensors are read by one device-to-device copy; ordering waits for it only, and
            # the copies to the host read the snapshot (transfer.device_snapshot).
            try:
                offloading = self.sink.offloads and not any(
                    s is not None and s.is_cuda and s.device != device for s in self.sources)
                mirror = self._mirror if offloading and self.sink.checksum and (
                    self.sink.checksum_kind in (BLOCKSUM32, AUTO)) else None
                self.sources, self._snapshot = self.snapshots.snapshot_sources(
                    self.sources, device, copier.stream, torch.cuda.current_stream(device), mirror=mirror)
                fence.event = copier.record()  # what the trainer's next writes wait for: the copy, not the sums
                if self._snapshot is not None and mirror is not None:
                    self._device_sums = device_share(self._snapshot, copier.stream)
                    if self._device_sums is not None:
                        self._kind = BLOCKSUM32
                        self._sums_done = copier.record()
                if self._snapshot is not None:  # the copies read the snapshot, not the tensors a program holds
                    self.files = without_device_programs(self.files)
                if offloading and self._snapshot is not None:
                    self._offload_device(copier, slots)
                    return
            except BaseException:
                for slot in slots:
                    source.release(slot)
                if self._snapshot is not None:  # never handed over: free for the next save once our stream is past it
                    self._release_unsent(copier)
                raise
        if self.cfg.staging.d2h_window_bytes and self._chunks:
            # Paced from the trainer's thread (transfer.pacing): the copies overlap its next steps, a piece
            # at a time; CPU sources are copied by then, after the call returned.
            self.sources = own_host_sources(self.sources)
            with self._lock:
                self._pending_writes += 1  # ended by the pieces' end (_PacedCopies.finish)
            paced = _PacedCopies(self, copier, slots)
            if self._snapshot is None:
                fence.enqueuing(drain=PACER.drain)
            PACER.submit(paced)
            return
        events: list[tuple[int, Any]] = []  # write_as_copied: each chunk's event, handed over by the waiter
        try:
            last = self._enqueue_snapshot(copier, slots, events.append if self.sink.write_as_copied else None)
        except BaseException:
            release_snapshot(self._snapshot, None)  # enqueue waited for what it had enqueued
            for slot in slots:
                source.release(slot)
            raise
        if self._snapshot is None:
            fence.event = last
        else:
            release_snapshot(self._snapshot, last)
        self._submit_pending(f"cpuckpt-d2h-wait-{self.rank}", self._wait_then_write, (last, events), slots,
                             copies_end=last)

    def _release_unsent(self, copier: DeviceCopier) -> None:
        """The snapshot buffer of a save that failed before its hand-over goes back once this save's stream is past
        it; where not even that event can be recorded (a broken CUDA context) it stays held, and the save's own
        failure is the one raised."""
        snap, self._snapshot = self._snapshot, None
        try:
            last = copier.record()
        except Exception as e:
            logger.warning("rank %d: a device snapshot buffer stays held after a failed save: %r", self.rank, e)
            return
        release_snapshot(snap, last)

    def _mirror(self, idx: list[int]) -> Mirror | None:
        """The files' places of device sources ``idx`` for a snapshot laid out as the files are, or None (logged
        once per stream): a source's bytes are not one run of one file; chunks are not whole blocksum32 blocks; or
        the files take more GPU memory than the device bytes allow (CPU tensors in the state: GPU memory for host
        bytes): with blocksum32 asked for, twice the device bytes; with ``auto`` (the default, which nobody chose
        for its memory), a chunk per file and one more. The copy process then sums whole chunks on the host. The
        answer (a refusal too) is kept by the save stream while the kind, the layouts' geometry (their chunk lists,
        shared by every save of one plan) and the sources' sizes repeat."""
        chunk = self.cfg.io.chunk_bytes
        sizes = tuple(self.sources[i].numel() for i in idx)  # type: ignore[union-attr]
        key = (self.sink.checksum_kind, tuple(id(f.chunks) for f in self.files), tuple(idx), sizes)
        kept = self.snapshots.mirrors.get(key)
        if kept is not None and all(a is f.chunks for a, f in zip(kept[0], self.files)):
            return kept[1]
        why, mirror = self._mirror_of(idx, sizes, chunk)
        if mirror is None and not self.snapshots.mirror_refused:
            self.snapshots.mirror_refused = True
            logger.info("rank %d: memory checksums not summed on the GPU (the host sums whole chunks: "
                        "blocksum32, or with checksum_kind auto crc32c): %s", self.rank, why)
        self.snapshots.mirrors.clear()  # one stream of saves repeats one layout
        self.snapshots.mirrors[key] = ([f.chunks for f in self.files], mirror)
        return mirror

    def _mirror_of(self, idx: list[int], sizes: tuple[int, ...], chunk: int) -> tuple[str, Mirror | None]:
        if chunk % BLOCK_BYTES:
            return f"io.chunk_bytes {chunk} is not a multiple of {BLOCK_BYTES}", None
        starts: dict[int, tuple[int, int]] = {}
        covered: dict[int, int] = {}  # bytes of each item the files hold
        bases, base = [], 0
        for pos, layout in enumerate(self.files):
            bases.append(base)
            for seg in layout.segments:
                if seg.payload is not None:
                    continue
                place = (pos, seg.file_offset - seg.src_offset)
                if starts.setdefault(seg.item, place) != place:
                    return f"item {seg.item}'s bytes are not one run of one file", None
                covered[seg.item] = covered.get(seg.item, 0) + seg.nbytes
            base += -(-layout.nbytes // chunk) * chunk
        places = []
        for i, n in zip(idx, sizes):  # every byte of each source copied to its place (else the GPU sums bytes no copy
            if n == 0:                # writes); an empty one anywhere
                places.append((0, 0))
                continue
            place = starts.get(i)
            if place is None or place[1] < 0 or covered.get(i) != n or place[1] + n > self.files[place[0]].nbytes:
                return f"item {i}'s {n} bytes are not all placed in one file", None
            places.append(place)
        device = sum(sizes)
        most = device + (len(self.files) + 1) * chunk if self.sink.checksum_kind == AUTO else 2 * device + 2 * chunk
        if base > most:
            return f"the files take {base} bytes of device memory for {device} device bytes (at most {most})", None
        return "", Mirror(tuple(places), tuple(bases), base, chunk)

    def _offload_device(self, copier: DeviceCopier, slots: list[Slot]) -> None:
        """The sink's process copies the snapshot into the slots and checksums them (``memory.copy_process``):
        here only the host bytes (record skeletons, CPU tensors) are written and the copies described."""
        snap = self._require(self._snapshot)
        ops = array("q")
        base = snap.buffer.data_ptr()
        described = offload_ops(ops, base)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        first = 0  # the file's first chunk in the save's numbering (self._chunks: file after file)
        for layout in self.files:
            file_slots = slots[first : first + len(layout.chunks)]
            program = layout.offload_program  # prepared by a save of the same layout (transfer.fillplan)
            if program is not None and program.applies(self.sources):
                try:
                    program.fill(file_slots, layout, self.sources)
                except RuntimeError as e:
                    raise StagingError(f"writing the host bytes of file {layout.index} into its image failed: "
                                       f"{e}") from e
                ops.frombytes(program.ops(self.sources, base, first))
            else:
                for k, (chunk, slot) in enumerate(zip(layout.chunks, file_slots), first):
                    fill_chunk(slot, layout, chunk, self.sources, deferred=pairs, described=described(k, chunk.file))
                    for dst, src in pairs:  # host sources only: the device ones are in ops
                        dst.copy_(src)
                    pairs.clear()
            first += len(layout.chunks)
        ready = torch.cuda.Event(interprocess=True)
        ready.record(copier.stream)
        with self._lock:
            self._pending_writes += 1  # ended by the process's reply (_offload_done)
        # From here the buffer is the hand-over's to release, never the caller's except (an interrupt once the process
        # has it would free it under its copies, and the callback again later: a leak is the safer side of a race)
        self._snapshot = None
        try:
            remote = self.sink.submit_offload(DeviceCopies(snap.buffer, ready, ops,
                                                           host_share=self._device_sums is not None), self._kind)
        except BaseException:
            with self._lock:
                self._pending_writes -= 1
            release_snapshot(snap, copier.record())  # the next save's snapshot waits for this one's copy
            raise
        self._offloaded = True
        remote.copied.add_done_callback(lambda fut: self._offload_copied(snap, ready, fut))
        remote.done.add_done_callback(self._offload_done)

    def _offload_copied(self, snap: DeviceSnapshot, ready: Any, fut: cf.Future) -> None:
        """The process's copies out of the snapshot ended (or it failed with none still running): the buffer is free
        once ``ready`` (after everything this process's stream did with it: the copy in, the sums) completed."""
        release_snapshot(snap, ready)
        if fut.exception() is None:
            self._mark_staged()

    def _offload_done(self, fut: cf.Future) -> None:
        """The process's checksums (or its failure): the job's last pending task ends."""
        try:
            self._take_checksums(fut.result())
        except BaseException as e:
            self._fail(e)
        finally:
            self._end_pending()

    def _take_checksums(self, crcs: list[list[int]]) -> None:
        if not self.sink.checksum:
            return
        if [len(c) for c in crcs] != [len(f.chunks) for f in self.files]:
            raise StagingError(f"the copy process returned {[len(c) for c in crcs]} checksums for files of "
                               f"{[len(f.chunks) for f in self.files]} chunks")
        if self._device_sums is None:
            self._crcs = [list(c) for c in crcs]
            return
        # blocksum32 of the host bytes (the process's) plus that of the device bytes (the GPU's, summed after the
        # snapshot; its event ended before the process's copies began, as they wait for the later ``ready``)
        if self._sums_done is not None:
            self._sums_done.synchronize()
        device = self._device_sums.tolist()
        if len(device) != len(self._chunks):
            raise StagingError(f"the device share of the checksums has {len(device)} values for {len(self._chunks)} "
                               "chunks")
        shares = iter(device)
        self._crcs = [[blocksum32_plus(v, next(shares)) for v in c] for c in crcs]

    def _enqueue_snapshot(self, copier: DeviceCopier, slots: list[Slot],
                          each: Callable[[tuple[int, Any]], object] | None) -> Any:
        """Enqueue every chunk's copies into its slot (:meth:`DeviceCopier.enqueue`); with ``each``, every
        chunk's (position, event) goes to it as enqueued. Returns the event after the last copy."""
        position = {id(chunk): k for k, chunk in enumerate(self._chunks)}
        targets = ((chunk, slot, self.files[chunk.file]) for chunk, slot in zip(self._chunks, slots))
        on_event = None if each is None else (lambda chunk, event: each((position[id(chunk)], event)))
        return copier.enqueue(targets, self.sources, cancel=self._cancel, each=on_event)

    def _enqueue_streaming(self, copier: DeviceCopier, order: LeaseOrder) -> None:
        """Lease, copy and hand each chunk to the writers in turn (a write frees the slot a later chunk needs)."""
        source, fence = self._require(self._slots), self._require(self.fence)
        event = None
        for ticket, chunk in enumerate(self._chunks):
            if self._cancel.is_set():
                return
            slot = source.lease(self.cfg.timeout_s, order=order, ticket=ticket, cancel=self._cancel)
            try:
                event = fence.event = copier.fill(slot, self.files[chunk.file], chunk, self.sources)
            except BaseException:
                source.release(slot)
                raise
            self._submit_write(chunk, _ready(slot, event))
        self._submit_pending(f"cpuckpt-d2h-wait-{self.rank}", self._wait_then_write, (event, []), [],
                             copies_end=event)

    def _submit_pending(self, executor: str, task: Callable[..., None], arg: object, slots: list[Slot], *,
                        copies_end: Any = None, handed: set[int] | None = None) -> None:
        """Run ``task(arg, slots[, handed])`` on a one-thread executor as a pending write: no finalize
        before it handed every write over (``handed``: the positions whose writes went already). If it
        cannot be submitted (interpreter shutdown), the other slots go back once the copies into them
        ended (``copies_end``, a CUDA event) and the error is raised."""
        with self._lock:
            self._pending_writes += 1
        try:
            self._fillers = shared_executor(1, executor)
            args = (arg, slots) if handed is None else (arg, slots, handed)
            self._fillers.submit(self._run_pending, task, *args)
        except BaseException:
            with self._lock:
                self._pending_writes -= 1
            if copies_end is not None:
                copies_end.synchronize()
            source = self._require(self._slots)
            for k, slot in enumerate(slots):
                if handed is None or k not in handed:
                    source.release(slot)
            if isinstance(self.fence, CopyFence):
                self.fence.finish(self.fence.event)  # nobody will enqueue more: order() must not wait
            raise

    def _wait_then_write(self, copies: tuple[Any, list[tuple[int, Any]]], slots: list[Slot],
                         handed: set[int] | None = None) -> None:
        """Hand the writes over and mark the shard staged when the last copy (stream order) completed:
        chunks with their own event (``write_as_copied``) first, the others (one slot per chunk, in order)
        after. After a failure each write releases its slot unwritten; a write that cannot be handed over
        (its executor refused it) fails the job, and the slots not handed over go back once the copies ended."""
        last, events = copies
        handed = set() if handed is None else handed
        try:
            for k, event in events:
                self._submit_write(self._chunks[k], _ready(slots[k], event))
                handed.add(k)
            try:
                if last is not None:
                    last.synchronize()
            except BaseException as e:
                self._fail(e)
            else:
                self._mark_staged()
            for k, (chunk, slot) in enumerate(zip(self._chunks, slots)):
                if k not in handed:
                    self._submit_write(chunk, _ready(slot, None))
                    handed.add(k)
        except BaseException as e:
            self._fail(e)
            with contextlib.suppress(BaseException):
                if last is not None:
                    last.synchronize()  # no copy still lands in a slot that goes back
            source = self._require(self._slots)
            for k, slot in enumerate(slots):
                if k not in handed:
                    source.release(slot)

    def _fill_on_host(self, chunk: Chunk, order: LeaseOrder, ticket: int) -> tuple[Slot, None]:
        source = self._require(self._slots)
        slot = source.lease(self.cfg.timeout_s, order=order, ticket=ticket, cancel=self._cancel)
        try:
            if not self._cancel.is_set():
                fill_chunk(slot, self.files[chunk.file], chunk, self.sources)
        except BaseException as e:
            source.release(slot)
            self._fail(e)  # now: the writes of other chunks may be waiting for staging, not for this one
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
        if self._cancel.is_set():
            return
        self.stats.stage_s = time.perf_counter() - self._t0
        self._staged_event.set()
        _settle(self.staged, None)

    # -- writing --------------------------------------------------------------------------------
    def _submit_write(self, chunk: Chunk, ready: cf.Future) -> None:
        writers = self._require(self._writers)
        with self._lock:
            self._pending_writes += 1
        try:
            writers.submit(self._write_task, chunk, ready)
        except BaseException:  # refused (interpreter shutdown): nothing will end this write's token
            with self._lock:
                self._pending_writes -= 1
            raise

    def _write_task(self, chunk: Chunk, ready: cf.Future) -> None:
        self._run_pending(self._write_when_ready, chunk, ready)

    def _run_pending(self, task: Callable[..., None], *args: object) -> None:
        """Run a pending write (or the copies' waiter, which hands writes over); the last to end finalizes.
        A task that raises fails the job before its token goes: the job never finishes as if it had written."""
        try:
            task(*args)
        except BaseException as e:
            self._fail(e)
        finally:
            self._end_pending()

    def _end_pending(self) -> None:
        """A pending task ended; the last one (once ``start()`` submits no more) finalizes the job."""
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
        source = self._require(self._slots)
        try:
            if not self._streaming and event is None and not self._staged_event.wait(self.cfg.timeout_s):
                # Snapshot writes start after staging: the stall is then copies only, with no writer
                # thread competing for the GIL (writing earlier would save < copy time).
                raise CheckpointTimeoutError(f"rank {self.rank}: staging not finished after {self.cfg.timeout_s} s")
            if event is not None and not self._cancel.is_set():
                event.synchronize()
            if self._cancel.is_set():
                return
            with nvtx_range("cpuckpt.write"):
                if self.sink.checksum and not self.sink.offloads:
                    with slot.view[: chunk.nbytes] as view:
                        self._crcs[chunk.file][chunk.index] = chunk_checksum(self._kind, view)
                self.sink.write(chunk, slot)
        except BaseException as e:
            self._fail(e)
        finally:
            source.release(slot)

    def _finalize(self) -> None:
        """Every submitted task has ended: report the error, or finish the sink (durable) and the result.
        Reported only now that no task holds a slot or a file, so a retry starts clean. A sink that offloads
        its checksums gets the staged chunks first; the job completes with its reply."""
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
        if self.sink.offloads and self.sink.checksum and not self._offloaded and not self._cancel.is_set():
            try:
                remote = self.sink.submit_offload(None, self._kind)
            except BaseException as e:
                self._fail(e)
            else:
                remote.done.add_done_callback(self._checksums_done)
                return
        self._complete()

    def _checksums_done(self, fut: cf.Future) -> None:
        try:
            self._take_checksums(fut.result())
        except BaseException as e:
            self._fail(e)
        self._complete()

    def _complete(self) -> None:
        if not self._cancel.is_set():
            try:
                self.sink.finish()
            except BaseException as e:
                self._fail(e)
        if self._cancel.is_set():
            try:
                self.sink.abort()
            except BaseException as e:
                logger.warning("rank %d: closing the files of the failed save to %s failed: %r", self.rank,
                               self.directory, e)
            self._shutdown()
            _settle(self.staged, error=self._error)
            _settle(self.done, error=self._error)
            return
        self.stats.write_s = time.perf_counter() - self._t0
        if not self.stats.stage_s:
            self.stats.stage_s = self.stats.write_s
        self.stats.extra.update(self.sink.stats())
        checksum = self._kind if self.sink.checksum else "none"
        entries = [FileEntry(name=n, nbytes=f.nbytes, chunk_bytes=self.cfg.io.chunk_bytes, checksum=checksum,
                             chunk_checksums=c if self.sink.checksum else [])
                   for n, f, c in zip(self.names, self.files, self._crcs)]
        self._shutdown()
        logger.debug("rank %d: %d bytes staged in %.3f s, done in %.3f s (%s, %s)", self.rank,
                     self.stats.nbytes, self.stats.stage_s, self.stats.write_s, self.mode, self.stats.backend)
        _settle(self.staged, None)
        _settle(self.done, entries)

    @staticmethod
    def _require(obj: _T | None) -> _T:
        """Internal invariant: set up by ``start()`` before any task runs."""
        if obj is None:
            raise RuntimeError("SaveJob used before start()")
        return obj

    def _reraise(self, e: BaseException) -> NoReturn:
        """``start()`` fails with the job's error (Ctrl-C: the interrupt itself), chained to ``e``."""
        err = self._error
        if err is None or err is e or is_interrupt(e):
            raise e
        raise err from e

    def _fail(self, e: BaseException, *, wrap: bool = True) -> None:
        """The first failure cancels the job: the rest of its tasks skip their chunks. ``wrap``: name this
        rank's save in the error (a ``cancel`` reason of the library's own classes is kept as it is)."""
        keep = not wrap and isinstance(e, CpuckptError | OSError | TimeoutError)
        err = e if keep else self._wrap(e)
        with self._lock:
            if self._error is not None:
                return
            self._error = err
            self._cancel.set()
        logger.error("rank %d: save to %s failed: %s", self.rank, self.directory, err)
        self._staged_event.set()  # release writers gated on staging; they see the cancel flag
        _settle(self.staged, error=err)  # ``done`` follows once no task still runs (``_finalize``)
        if self._slots is not None:
            self._slots.wake()

    def _wrap(self, e: BaseException) -> BaseException:
        """The error of this rank's save: names rank and directory, keeps the class, chains ``e``."""
        prefix = f"rank {self.rank}: "
        if isinstance(e, CpuckptError) and str(e).startswith(prefix):
            return e  # already this job's (a cancel with the error another part of the save raised)
        if is_interrupt(e):  # Ctrl-C on the waiting thread: the waiter re-raises the interrupt itself
            err: CpuckptError = CpuckptError(f"{prefix}save to {self.directory} interrupted ({type(e).__name__})")
            err.__cause__ = e
            return err
        detail = str(e) if isinstance(e, CpuckptError | OSError) else repr(e)
        msg = f"{prefix}saving to {self.directory} failed: {detail}"
        if isinstance(e, StorageIOError):
            err = StorageIOError(msg, path=e.path, offset=e.offset, nbytes=e.nbytes, errno_=e.errno)
        elif isinstance(e, OSError):
            err = StorageIOError(msg, path=None if e.filename is None else str(e.filename), errno_=e.errno)
        elif isinstance(e, TimeoutError):
            err = CheckpointTimeoutError(msg)
        elif isinstance(e, CpuckptError):
            try:
                err = type(e)(msg)
            except TypeError:
                err = CpuckptError(msg)
        else:
            err = StagingError(msg)
        err.__cause__ = e
        return err

    def _shutdown(self) -> None:
        """Drop references to the shared thread pools (their threads live on for the next save)."""
        self._fillers = self._writers = None


class _PacedCopies:
    """A snapshot save's device-to-host copies as pieces of ``staging.d2h_window_bytes`` for the
    :data:`~cpuckpt.transfer.pacing.PACER`; the last piece hands the save on to its waiter and writes."""

    def __init__(self, job: SaveJob, copier: DeviceCopier, slots: list[Slot]) -> None:
        self._job = job
        self._copier = copier
        self._slots = slots
        self._next = 0  # the first chunk not enqueued
        self._last: Any = None  # the event after the newest piece
        self._handed: set[int] = set()  # chunks whose writes went with their piece (write_as_copied)
        self.owner = 0  # the thread that submitted it (Pacer.submit)

    def advance(self) -> Any:
        job = self._job
        chunks = job._chunks
        if self._next >= len(chunks) or job._cancel.is_set():
            self.finish()
            return None
        piece, first, n = job.cfg.staging.d2h_window_bytes, self._next, 0
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        with nvtx_range("cpuckpt.stage.piece"), self._copier.enqueueing():
            while self._next < len(chunks) and (n == 0 or n + chunks[self._next].nbytes <= piece):
                chunk = chunks[self._next]
                self._copier.fill(self._slots[self._next], job.files[chunk.file], chunk, job.sources,
                                  record=False, batch=batch)
                n += chunk.nbytes
                self._next += 1
            self._copier.copy_batch(batch)
            event = self._last = self._copier.record()
        if job.sink.write_as_copied:
            for k in range(first, self._next):
                job._submit_write(chunks[k], _ready(self._slots[k], event))
                self._handed.add(k)
        return event

    def abort(self, error: BaseException) -> None:
        self._job._fail(error)
        self._copier.drain()  # no copy still lands in a slot the waiter hands back
        self.finish()

    def finish(self) -> None:
        """Every piece is enqueued (or the save failed): the fence ends, the waiter takes over."""
        job = self._job
        try:
            try:
                if job._snapshot is None:
                    job._require(job.fence).finish(self._last)
                else:
                    release_snapshot(job._snapshot, self._last)
            except BaseException as e:
                job._fail(e)
            job._submit_pending(f"cpuckpt-d2h-wait-{job.rank}", job._wait_then_write, (self._last, []),
                                self._slots, copies_end=self._last, handed=self._handed)
        except BaseException as e:
            job._fail(e)
        finally:
            job._end_pending()


def _ready(slot: Slot, event: Any) -> cf.Future[tuple[Slot, Any]]:
    """A chunk's (slot, event of its copy or None) as a completed future, for ``_submit_write``."""
    fut: cf.Future[tuple[Slot, Any]] = cf.Future()
    fut.set_result((slot, event))
    return fut


def _settle(fut: cf.Future, result: object = None, *, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless it already is (a failure and a success may race from two threads)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass
