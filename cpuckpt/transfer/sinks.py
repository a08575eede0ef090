"""Where a save's staged chunks go: the seam between the save engine (``SaveJob``) and its destinations.

The engine plans nothing and knows no destination: it copies each chunk into a *slot* handed out by
the sink's :class:`SlotSource`, computes the chunk's crc32c when the sink asks for it, and hands the
chunk to :meth:`Sink.write`. Every staging feature (device snapshot, paced copies, fill
programs) therefore applies to every sink:

- :class:`PoolSink` (here): slots leased from the process's pinned host pool; ``write`` is a
  ``pwrite`` through the file backend, the slot goes back to the pool; ``finish`` fsyncs the files
  and the directory.
- the memory tier's image sink (``cpuckpt.tier.images``): slots are views of the mapped RAM images,
  so a copy lands in its final place and ``write`` has nothing to do. With ``memory.copy_process`` it
  *offloads*: a process of its own copies the device snapshot's bytes into the images and computes the
  checksums (:meth:`Sink.submit_offload`), so neither runs in the trainer's process.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from cpuckpt.config import Config
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.transfer.files import FileBackend, fsync_dir, get_backend
from cpuckpt.transfer.staging import HostPool, LeaseOrder, Slot, get_pool

__all__ = ["AUTO", "DeviceCopies", "MappedBytes", "Offloaded", "PoolSink", "Sink", "SinkFactory", "SlotSource",
           "pool_sink"]

AUTO = "auto"  # Sink.checksum_kind: blocksum32 where the GPU sums a save's device bytes, crc32c elsewhere
OP_FIELDS = 5  # a copy of DeviceCopies.ops: chunk position, offset in the buffer, file index, file offset, bytes


@dataclass
class DeviceCopies:
    """A save's device bytes for a sink that copies them itself: ``buffer`` (the device snapshot, uint8 on one
    GPU), ``ready`` (an interprocess CUDA event after the snapshot) and ``ops`` (:data:`OP_FIELDS` int64 per
    copy, in chunk order)."""

    buffer: torch.Tensor
    ready: Any
    ops: array
    # blocksum32: the device bytes' share is summed on the GPU (SaveJob), the sink sums only the rest of each chunk
    host_share: bool = False


class Offloaded(Protocol):
    """A save a sink's own process took over: ``copied`` once its copies completed (the snapshot buffer may be
    reused; also set when it failed, once no copy of it still runs), ``done`` with each file's chunk checksums
    (empty lists without checksums)."""

    copied: cf.Future[None]
    done: cf.Future[list[list[int]]]


class SlotSource(Protocol):
    """Hands out the memory chunks are staged into. ``ticket`` is the chunk's position in the save
    (file order), so a source whose slots *are* the destination returns that chunk's place."""

    def lease(self, timeout_s: float, *, order: LeaseOrder | None = None, ticket: int | None = None,
              cancel: threading.Event | None = None) -> Slot: ...

    def lease_each(self, n: int, timeout_s: float, *, cancel: threading.Event | None = None) -> list[Slot]: ...

    def release(self, slot: Slot) -> None: ...

    def wake(self) -> None: ...


class Sink(Protocol):
    """One save's destination for one rank's files (made per save by a :class:`SinkFactory`).

    Attributes:
        name: what the statistics call it (the file backend's name, ``image``).
        checksum: the engine computes each chunk's checksum before ``write``.
        checksum_kind: which one (:mod:`cpuckpt.format.checksums`): crc32c, or blocksum32 (the memory tier's); or
            ``auto`` (the memory tier's): blocksum32 for a save whose device snapshot the GPU sums, crc32c otherwise.
            The save job resolves it per save.
        holds_every_chunk: its slots are the destination itself (one per chunk, nothing to recycle):
            the save is staged as a snapshot whatever the pool size.
        write_as_copied: GPU chunks are handed over as soon as their own copy completed, overlapping
            later copies (a checksum-only sink); otherwise after every copy (no thread competes with
            the trainer's interpreter while it stages).
        offloads: its own process computes the checksums (:meth:`submit_offload` once the chunks are
            staged) and, given a device snapshot, copies its bytes too; the engine computes none.
    """

    name: str
    checksum: bool
    checksum_kind: str
    holds_every_chunk: bool
    write_as_copied: bool
    offloads: bool

    def submit_offload(self, copies: DeviceCopies | None, kind: str) -> Offloaded:
        """(``offloads`` only.) Hand the save's checksums (of ``kind``, :mod:`cpuckpt.format.checksums`), and with
        ``copies`` its device bytes, to the sink's process; the host bytes are in the slots already."""
        ...

    def open(self, nslots: int, done: cf.Future) -> SlotSource:
        """Before any byte moves: the slots (``nslots`` wanted for pooled staging). ``done`` is the save's
        result, for a destination that must not be reused before it completed."""
        ...

    def write(self, chunk: Chunk, slot: Slot) -> None:
        """``chunk``'s bytes are in ``slot``: make them the destination's (one call per chunk, any thread)."""
        ...

    def finish(self) -> None:
        """Every write succeeded: make them durable (or nothing, for memory)."""
        ...

    def abort(self) -> None:
        """The save failed and no task runs any more: close what is open; leave nothing half-owned."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures of this save for ``SaveJob.stats.extra``."""
        ...


class SinkFactory(Protocol):
    """Makes the sink of one save (``StorageWriter(sink=...)``; default: :func:`pool_sink`)."""

    def __call__(self, directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> Sink: ...


class MappedBytes(Protocol):
    """A file's bytes already in (mapped) memory, which a load copies from instead of reading it."""

    nbytes: int
    pinned: bool

    def tensor(self) -> torch.Tensor: ...

    def view(self) -> memoryview: ...


class PoolSink:
    """Chunks staged in the process's pinned pool, ``pwrite`` through ``io.backend``, fsynced at the end."""

    holds_every_chunk = False
    write_as_copied = False
    offloads = False
    checksum_kind = "crc32c"

    def __init__(self, directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> None:
        self.directory = directory
        self.names = names
        self.files = files
        self.cfg = cfg
        self.rank = rank
        self.checksum = cfg.integrity.checksum == "crc32c"
        self.name = cfg.io.backend
        self._backend: FileBackend | None = None
        self._pool: HostPool | None = None
        self._fds: list[int | None] = [None] * len(names)  # opened by the first write into each file
        self._open_lock = threading.Lock()
        self._closed = False

    def open(self, nslots: int, done: cf.Future) -> SlotSource:
        cfg = self.cfg
        self._backend = get_backend(cfg.io.backend, self.directory, cfg.layout.align_bytes)
        self.name = self._backend.name
        self._pool = get_pool(cfg.io.chunk_bytes, max(nslots, 1), pin=cfg.staging.pin)
        return self._pool

    def write(self, chunk: Chunk, slot: Slot) -> None:
        backend = self._require_backend()
        n = chunk.nbytes
        align = self.cfg.layout.align_bytes
        io_n = -(-n // align) * align if backend.aligned else n
        if io_n > n:
            slot.tensor[n:io_n].zero_()
        backend.pwrite(self._fd(chunk.file, backend), slot.view[:io_n], chunk.offset,
                       str(self.directory / self.names[chunk.file]))

    def _fd(self, file: int, backend: FileBackend) -> int:
        """File ``file``'s descriptor, opened at first use (by a writer thread, or by ``finish``)."""
        fd = self._fds[file]
        if fd is not None:
            return fd
        with self._open_lock:
            if self._closed:
                raise RuntimeError(f"rank {self.rank}: files of {self.directory} already closed")
            fd = self._fds[file]
            if fd is None:
                fd = self._fds[file] = backend.open_write(str(self.directory / self.names[file]))
        return fd

    def finish(self) -> None:
        backend = self._require_backend()
        try:  # a file no write touched (no chunks: an empty file) is created here
            opened = [self._fd(i, backend) for i in range(len(self.names))]
        except BaseException:
            self.abort()
            raise
        with self._open_lock:
            self._closed, self._fds = True, []
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

    def abort(self) -> None:
        with self._open_lock:
            self._closed, fds, self._fds = True, self._fds, []
        if self._backend is not None:
            for fd in fds:
                if fd is not None:
                    self._backend.close(fd)

    def submit_offload(self, copies: DeviceCopies | None, kind: str) -> Offloaded:
        raise NotImplementedError("the pool sink computes nothing in another process")

    def stats(self) -> dict[str, float]:
        return {}

    def _require_backend(self) -> FileBackend:
        if self._backend is None:
            raise RuntimeError("PoolSink used before open()")
        return self._backend


def pool_sink(directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *, rank: int) -> PoolSink:
    """The default :class:`SinkFactory`: files through the pinned pool."""
    return PoolSink(directory, names, files, cfg, rank=rank)
