"""Reused memory images: a rank's data files in a RAM root (tmpfs), saved into by device-to-host copies.

An ``ImageFile`` is one data file in a RAM-backed directory. It is reserved with ``posix_fallocate``
(a full tmpfs fails there with ENOSPC, never with SIGBUS in the middle of a copy), mapped
``MAP_SHARED`` once and, when CUDA is present, pinned with ``cudaHostRegister`` once, so a save is
a copy from the device straight into the file's pages: no host pool, no ``pwrite``. ``ImageJob``
fills the images of one save with the same bytes the normal pipeline writes (``fill_chunk``, and
``DeviceCopier`` for GPU sources), so stock DCP readers load the directory once ``.metadata`` is
there. With ``memory.checksum`` (and ``integrity.checksum: crc32c``) each chunk's crc32c is computed
from the image on worker threads after the copies (GPU: each chunk after its own): ``staged`` waits
for the copies only, ``done`` (and so the memory commit) for the checksums too. ``persist_image`` copies an image to
durable storage through the file backends, checksumming each chunk on the way (the writer process
does that, off the trainer's path) and comparing with the memory checkpoint's checksums when it has
them, so a RAM page damaged after the save is never made durable.

Capacity and file size. The mapping is ``capacity`` bytes (the size asked, rounded up to 2 MiB) and
is only replaced when a larger size is asked; the file itself is always exactly ``nbytes`` long and
every page of it is allocated. The mapping may therefore extend past the end of the file; nothing
ever touches the mapping past ``nbytes`` (that would be SIGBUS). Shrinking the file (``ftruncate``)
drops the pages past its new end from tmpfs, so when it grows again those offsets get *new* pages.
A ``cudaHostRegister`` range pins the physical pages it saw when it was registered, so a range
that reached past the end would keep stale pages and a later copy through it would land outside
the file. Hence the pinned ranges never reach past the file's last page: the image is registered in
segments (whole chunks of the caller, so no chunk's copy crosses two registrations), a segment that
would reach past a new, smaller end is unregistered before the file is truncated, and the missing
segments are registered after the file grew. A save of the same size re-registers nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import crc32c
import torch

from cpuckpt import faultpoint
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, CheckpointTimeoutError, CpuckptError, StagingError, StorageIOError
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.format.manifest import FileEntry
from cpuckpt.transfer.copy_gate import GATE
from cpuckpt.transfer.files import BufferedFileBackend, get_backend
from cpuckpt.transfer.save_job import _Stats
from cpuckpt.transfer.staging import CopyFence, CopyWindow, DeviceCopier, Slot, fill_chunk, own_host_sources
from cpuckpt.transfer.threads import run_parallel, shared_executor, wait_future
from cpuckpt.transfer.tracing import nvtx_range

__all__ = ["ImageFile", "ImageJob", "ImageSet", "persist_image"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
CAPACITY_ROUND_BYTES = 2 * _MiB  # mappings grow in these steps, so a slightly larger save reuses them
PIN_SEGMENT_MIN_BYTES = 64 * _MiB  # registrations are whole chunks, at least this large
_PAGE = mmap.PAGESIZE


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _os_error(what: str, e: OSError, path: Path, nbytes: int | None = None) -> StorageIOError:
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return StorageIOError(f"{what} failed on memory image {path}{size}: [errno {e.errno}] {e.strerror or e}",
                          path=str(path), nbytes=nbytes, errno_=e.errno)


def _consume_cuda_error() -> None:
    """Clear the CUDA runtime's last error that a failed ``cudaHostRegister`` leaves behind.

    (E.g. a file on a disk filesystem, not tmpfs.) The runtime keeps it until someone asks, and
    PyTorch asks after its next kernel launch, which would then fail for no fault of its own (on the
    H200: a device gather of the next save raised "invalid argument"). A tiny launch here takes it.
    """
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError is a RuntimeError: the stale error, now cleared
        pass


class ImageFile:
    """One data file in a RAM root: preallocated, mapped MAP_SHARED once, pinned once (CUDA).

    ``nbytes`` is the file's size, ``capacity`` the bytes mapped (``>= nbytes``), ``pinned`` whether
    ``[0, nbytes)`` is registered with CUDA, ``remaps`` how often the file was (re)mapped and
    ``pins`` how many ranges were registered (both only grow while the image is reused).
    Not thread-safe: one save at a time uses an image (``ImageSet`` serialises ``ensure``).

    Raises:
        StorageIOError: the file cannot be opened (a symbolic link is refused).
    """

    def __init__(self, path: str | os.PathLike, *, pin: bool = True) -> None:
        self.path = Path(path)
        self.pin = pin
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self.path, flags, 0o600)
            self.nbytes = os.fstat(self._fd).st_size
        except OSError as e:
            raise _os_error("open", e, self.path) from e
        self.capacity = 0
        self.pinned = False
        self.remaps = 0
        self.pins = 0
        self._mmap: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._base = 0  # address of the mapping
        self._regs: dict[int, int] = {}  # registered ranges: offset -> length
        self._segment = PIN_SEGMENT_MIN_BYTES
        self._pin_failed = False
        self._allocated = 0  # [0, _allocated) was reserved by this object and not truncated since

    # -- sizing -----------------------------------------------------------------------------------
    def ensure(self, nbytes: int, *, chunk_bytes: int | None = None) -> None:
        """Make the file exactly ``nbytes`` long with every page allocated, mapped (and pinned).

        A size up to ``capacity`` keeps the mapping (and every registration below the file's last
        page); a larger one maps the file again, ``nbytes`` rounded up to 2 MiB. ``chunk_bytes`` is
        the unit the caller copies in: registrations are whole multiples of it, so no chunk's copy
        crosses two of them. Only bytes past those this object already reserved (and did not
        truncate since) are passed to ``posix_fallocate``; pages punched out of the file by
        someone else are not noticed.

        Raises:
            StorageIOError: the filesystem cannot reserve ``nbytes`` (ENOSPC: names the path, the
                bytes asked and the bytes free), or truncating or mapping failed. The image is
                then left as it was (a failed reservation) or unmapped.
        """
        if nbytes < 0:
            raise ValueError(f"memory image {self.path}: negative size {nbytes}")
        if self._fd < 0:
            raise StagingError(f"memory image {self.path} is closed")
        if chunk_bytes:
            segment = chunk_bytes * max(1, -(-PIN_SEGMENT_MIN_BYTES // chunk_bytes))
            if segment != self._segment:
                self._unregister(list(self._regs))  # re-registered below in the new unit
                self._segment = segment
        self._reserve(nbytes)  # also extends the file; a failure leaves the image as it was
        try:
            if nbytes > self.capacity:
                self._remap(nbytes)
            else:
                # Pages past the new last page leave the file: no registration may keep them.
                last_page = _round_up(nbytes, _PAGE)
                self._unregister([off for off, n in self._regs.items() if off + n > last_page])
                self._truncate(nbytes)
        except BaseException:
            try:
                self.nbytes = min(os.fstat(self._fd).st_size, self.capacity)
            except OSError:
                self.nbytes = 0
            raise
        self.nbytes = nbytes
        self._register_missing()

    def _reserve(self, nbytes: int) -> None:
        # Only the bytes past what this object allocated itself: posix_fallocate walks every page of
        # its range, ~14 ms per GiB on tmpfs even when all are there (a stall on the trainer's path).
        start = self._allocated
        if nbytes <= start:
            return
        try:
            os.posix_fallocate(self._fd, start, nbytes - start)
        except OSError as e:
            try:
                st = os.fstatvfs(self._fd)
                free = f"{st.f_bavail * st.f_frsize} bytes free"
            except OSError:
                free = "free space unknown"
            hint = " (the RAM filesystem is full)" if e.errno == errno.ENOSPC else ""
            raise StorageIOError(
                f"reserving {nbytes} bytes for memory image {self.path} failed{hint}: [errno {e.errno}] "
                f"{e.strerror or e}; {free} on its filesystem",
                path=str(self.path), offset=0, nbytes=nbytes, errno_=e.errno,
            ) from e
        self._allocated = nbytes

    def _truncate(self, nbytes: int) -> None:
        try:
            os.ftruncate(self._fd, nbytes)
        except OSError as e:
            raise _os_error("ftruncate", e, self.path, nbytes) from e
        self._allocated = min(self._allocated, nbytes)

    def _remap(self, nbytes: int) -> None:
        self._unmap()
        capacity = _round_up(nbytes, CAPACITY_ROUND_BYTES)
        # mmap needs the file to span the mapping: extend it (sparse, nothing allocated), map,
        # then cut it back to its exact size. The pages past it are never touched.
        self._truncate(capacity)
        try:
            m = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            self._truncate(nbytes)
            if isinstance(e, OSError):
                raise _os_error("mmap", e, self.path, capacity) from e
            raise StorageIOError(f"mmap failed on memory image {self.path} ({capacity} bytes): {e}",
                                 path=str(self.path), nbytes=capacity) from e
        self._truncate(nbytes)
        self._mmap = m
        self._tensor = torch.frombuffer(m, dtype=torch.uint8)
        self._view = memoryview(m)
        self._base = self._tensor.data_ptr()
        self.capacity = capacity
        self.remaps += 1
        self._pin_failed = False  # a new mapping: try pinning again

    # -- pinning ----------------------------------------------------------------------------------
    def _wanted(self) -> list[tuple[int, int]]:
        last_page = min(_round_up(self.nbytes, _PAGE), self.capacity)
        return [(off, min(self._segment, last_page - off)) for off in range(0, last_page, self._segment)]

    def _register_missing(self) -> None:
        wanted = self._wanted()
        if not (self.pin and wanted and not self._pin_failed and torch.cuda.is_available()):
            self.pinned = bool(wanted) and all(self._regs.get(off) == n for off, n in wanted)
            return
        self._unregister([off for off, n in self._regs.items() if (off, n) not in wanted])
        cudart = torch.cuda.cudart()
        for off, n in wanted:
            if self._regs.get(off) == n:
                continue
            err = cudart.cudaHostRegister(self._base + off, n, 0)
            if int(err) != 0:
                _consume_cuda_error()
                logger.warning("cudaHostRegister of %d bytes of memory image %s failed (error %s); saving into it "
                               "unpinned", n, self.path, err)
                self._unregister(list(self._regs))
                self._pin_failed = True
                self.pinned = False
                return
            self._regs[off] = n
            self.pins += 1
        self.pinned = True

    def _unregister(self, offsets: Sequence[int]) -> None:
        if not offsets:
            return
        cudart = torch.cuda.cudart()
        for off in offsets:
            self._regs.pop(off, None)
            cudart.cudaHostUnregister(self._base + off)
        self.pinned = False

    # -- access -----------------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Bytes of the file reserved (``posix_fallocate``) by this object and not truncated away since."""
        return self._allocated

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the file's ``nbytes`` bytes (writes go to the file)."""
        if self._tensor is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._tensor[: self.nbytes]

    def view(self) -> memoryview:
        """A writable memoryview of the same bytes."""
        if self._view is None:
            return memoryview(bytearray())
        return self._view[: self.nbytes]

    def _unmap(self) -> None:
        self._unregister(list(self._regs))
        self.pinned = False
        self._tensor = None
        m, view, self._mmap, self._view = self._mmap, self._view, None, None
        self.capacity = 0
        self._base = 0
        if m is None:
            return
        try:
            if view is not None:
                view.release()
            m.close()
        except BufferError:
            logger.debug("memory image %s: views still referenced; unmapped when they are collected", self.path)

    def close(self) -> None:
        """Unpin, unmap and close the file descriptor; the file stays. Idempotent."""
        self._unmap()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (f"ImageFile({str(self.path)!r}, nbytes={self.nbytes}, capacity={self.capacity}, "
                f"pinned={self.pinned}, remaps={self.remaps})")


def _allocated(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_blocks * 512
    except OSError:
        return 0


class ImageSet:
    """This rank's image files in one checkpoint directory of the RAM root, reused across saves."""

    def __init__(self, directory: str | os.PathLike, *, pin: bool = True,
                 before_grow: Callable[[int], None] | None = None) -> None:
        self.directory = Path(directory)
        self.pin = pin
        self.before_grow = before_grow  # called with the bytes an image is about to grow by (a space check)
        self._files: dict[str, ImageFile] = {}
        self._last_done: cf.Future | None = None  # the ``done`` of the last job that filled these images
        self._lock = threading.Lock()

    def image(self, name: str, nbytes: int, *, chunk_bytes: int | None = None) -> ImageFile:
        """The image ``name`` (created at first use, then reused), made exactly ``nbytes`` long.

        Raises:
            StorageIOError: the directory or file cannot be created, or ``nbytes`` not reserved.
            Whatever ``before_grow`` raises (the memory tier's space check) before anything is reserved.
        """
        with self._lock:
            return self._image(name, nbytes, chunk_bytes)

    def prepare(self, name: str, nbytes: int, *, chunk_bytes: int | None = None) -> bool:
        """Make image ``name`` ``nbytes`` long (reserved, mapped, pinned) unless it already exists here:
        an existing image may be in use by a job, so it is never resized. Returns whether it made one."""
        with self._lock:
            if name in self._files:
                return False
            self._image(name, nbytes, chunk_bytes)
            return True

    def _image(self, name: str, nbytes: int, chunk_bytes: int | None) -> ImageFile:
        img = self._files.get(name)
        # an image file left by an earlier process already holds its pages: only growth is new
        have = img.allocated if img is not None else _allocated(self.directory / name)
        grow = nbytes - have
        if grow > 0 and self.before_grow is not None:
            self.before_grow(grow)
        if img is None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise _os_error("mkdir", e, self.directory) from e
            img = self._files[name] = ImageFile(self.directory / name, pin=self.pin)
        img.ensure(nbytes, chunk_bytes=chunk_bytes)
        return img

    def claim(self, done: cf.Future) -> cf.Future | None:
        """A job takes these images; returns the previous job's ``done`` (it must end before any byte moves)."""
        with self._lock:
            previous, self._last_done = self._last_done, done
            return previous

    def get(self, name: str) -> ImageFile | None:
        """The image ``name`` if it was made, as it is (no resizing)."""
        with self._lock:
            return self._files.get(name)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def reserved_nbytes(self) -> int:
        """Bytes mapped by every image (the sum of their capacities; each file holds its ``nbytes``)."""
        with self._lock:
            return sum(f.capacity for f in self._files.values())

    def close(self) -> None:
        """Close every image (unpin, unmap); the files stay."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


class ImageJob:
    """A rank's save straight into its image files: the same surface as ``SaveJob``.

    ``staged`` completes when every byte is in the images (RAM: nothing to fsync), ``done`` once
    every chunk's crc32c is computed too (``memory.checksum`` with ``integrity.checksum: crc32c``;
    else together, and ``done``'s entries carry no checksums). Checksums are computed from the image
    itself, on the ``cpuckpt-crc-<rank>`` threads. GPU sources: each chunk once its CUDA event
    completed, overlapping the (DMA) copies of later chunks. CPU sources: once every fill ended, since
    fills and checksums would compete for the same cores and ``staged`` is what the trainer waits for.
    Bytes past each layout's end are never touched.
    """

    def __init__(self, directory: Path, names: list[str], files: list[FileLayout],
                 sources: list[torch.Tensor | None], cfg: Config, *, rank: int, images: ImageSet) -> None:
        self.directory = Path(directory)
        self.names = names
        self.files = files
        self.sources = sources
        self.cfg = cfg
        self.rank = rank
        self.images = images
        self.mode = "memory"
        self.staged: cf.Future[None] = cf.Future()
        self.done: cf.Future[list[FileEntry]] = cf.Future()
        self.stats = _Stats(mode="memory", backend="image")
        self.started_at = 0.0  # perf_counter() when start() began
        self._chunks: list[Chunk] = [c for f in files for c in f.chunks]
        self._checksum = cfg.memory.checksum and cfg.integrity.checksum == "crc32c"
        self._checksum_after_copies = False  # CPU fills: every chunk's checksum is queued once all ended
        self._crcs = [[0] * len(f.chunks) for f in files]
        self._images: list[ImageFile] = []
        self._targets: list[tuple[torch.Tensor, memoryview]] | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        # Tasks not ended: copies (or the GPU copies' waiter), checksums, and ``start()`` itself while it
        # submits. Whoever submits a task holds a token of its own until the submission is done, so the
        # count cannot reach zero while tasks are still being queued (a checksum that ended first had
        # finished the job with crc32c 0 for the chunks not yet queued).
        self._pending = 0
        self._copying = 0  # of those, the copies (and ``start()``): ``staged`` completes when none is left
        self._copied = False  # every copy ended (``_copies_ended`` ran)
        self._finished = False
        self._t0 = 0.0
        # GPU sources: the end of the copies enqueued so far (``AsyncSaveHandle.wait_stream``); None: host fills.
        self.fence: CopyFence | None = None

    # -- public -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Size the images and enqueue (GPU) or start (CPU) every chunk's copies.

        Raises:
            The error ``staged`` and ``done`` report, when the save failed before returning.
        """
        self._t0 = self.started_at = time.perf_counter()
        self.stats.nbytes = sum(f.nbytes for f in self.files)
        with self._lock:
            if self._error is not None:  # cancelled before it started
                raise self._error
            self._pending += 1  # start()'s token (see __init__), given back in ``finally``
            self._copying += 1
        try:
            if len(self.names) != len(self.files):
                raise ValueError(f"{len(self.names)} file names for {len(self.files)} layouts")
            # One job at a time per set of images: a save still copying into them (or one that failed
            # with copies in flight) ends before this one resizes or overwrites a byte.
            previous = self.images.claim(self.done)
            if previous is not None:
                with GATE.lifted():  # the previous save's copies must go on even inside a held copy gate
                    cf.wait([previous], timeout=self.cfg.timeout_s)
                if not previous.done():
                    raise CheckpointTimeoutError(f"rank {self.rank}: the previous save into {self.directory} has "
                                                 f"not ended after {self.cfg.timeout_s} s")
            remaps = 0
            for name, layout in zip(self.names, self.files):
                old = self.images.get(name)
                remaps -= old.remaps if old is not None else 0
                img = self.images.image(name, layout.nbytes, chunk_bytes=self.cfg.io.chunk_bytes)
                self._images.append(img)
            self._targets = [(img.tensor(), img.view()) for img in self._images]
            gpu = [s for s in self.sources if s is not None and s.device.type == "cuda"]
            if gpu and self._chunks:
                with nvtx_range("cpuckpt.stage.d2h"):
                    self._stage_on_device(gpu[0].device)
            elif self._chunks:
                self._checksum_after_copies = self._checksum
                fillers = shared_executor(self.cfg.io.threads, f"cpuckpt-stage-{self.rank}")
                for chunk in self._chunks:
                    with self._lock:
                        self._pending += 1
                        self._copying += 1
                    try:
                        fillers.submit(self._fill_task, chunk)
                    except BaseException:  # refused (interpreter shutdown): nothing will end this chunk's token
                        with self._lock:
                            self._pending -= 1
                            self._copying -= 1
                        raise
            self.stats.extra["image_remaps"] = float(remaps + sum(img.remaps for img in self._images))
        except BaseException as e:
            self._fail(e)
            err = self._error
            if err is None or err is e:
                raise
            raise err from e
        finally:
            try:
                self._copy_ended()  # the last copy to end queues the checksums, under a token still held
            finally:
                self._task_ended()

    def wait_staged(self, timeout_s: float | None = None) -> None:
        wait_future(self.staged, self.cfg.timeout_s if timeout_s is None else timeout_s,
                    f"staging of rank {self.rank}'s memory images", on_interrupt=self.cancel)

    def wait_done(self, timeout_s: float | None = None) -> list[FileEntry]:
        return wait_future(self.done, self.cfg.timeout_s if timeout_s is None else timeout_s,
                           f"saving rank {self.rank}'s memory images in {self.directory}", on_interrupt=self.cancel)

    def cancel(self, reason: BaseException) -> None:
        """Abort: chunks not yet copied are skipped; ``staged``/``done`` report ``reason`` (``done``
        once no copy still writes into the images)."""
        self._fail(reason, wrap=False)
        with self._lock:
            idle = self._pending == 0
        if idle:
            self._finish()

    # -- staging ------------------------------------------------------------------------------------
    def _slot(self, chunk: Chunk) -> Slot:
        targets = self._targets
        if targets is None:
            raise RuntimeError("ImageJob used before start()")
        tensor, view = targets[chunk.file]
        lo, hi = chunk.offset, chunk.offset + chunk.nbytes
        return Slot(index=-1, count=0, tensor=tensor[lo:hi], view=view[lo:hi])

    def _stage_on_device(self, device: torch.device) -> None:
        copier = DeviceCopier(device)  # copies wait for kernels already queued on the current stream
        copier.protect(self.sources)
        fence = self.fence = CopyFence(device, self.cfg.timeout_s)
        if self.cfg.staging.d2h_window_bytes:  # a thread enqueues, a window ahead (SaveJob._enqueue_snapshot)
            self.sources = own_host_sources(self.sources)  # it copies host bytes after the call
            fence.enqueuing()
            self._submit_copy_task(copier, f"cpuckpt-d2h-feed-{self.rank}", self._feed_copies, copier)
            return
        events: list[tuple[Chunk, object]] = []  # checksummed: each chunk's event, for its checksum task
        fence.event = self._enqueue_copies(copier, None, lambda chunk, event: events.append((chunk, event)))
        # One waiter queues the checksums (off the caller's path: a checksum thread woken per chunk had
        # taken the GIL from the caller) and marks the images complete when the last copy completed.
        self._submit_copy_task(copier, f"cpuckpt-d2h-wait-{self.rank}", self._wait_copies, fence.event, events)

    def _enqueue_copies(self, copier: DeviceCopier, window: CopyWindow | None,
                        each: Callable[[Chunk, object], object]) -> object:
        """Enqueue every chunk's copies into the images (:meth:`DeviceCopier.enqueue`); with checksums each
        chunk's event goes to ``each``. Returns the event after the last copy."""
        targets = ((chunk, self._slot(chunk), self.files[chunk.file]) for chunk in self._chunks)
        return copier.enqueue(targets, self.sources, window=window, cancel=self._cancel,
                              each=each if self._checksum else None)

    def _submit_copy_task(self, copier: DeviceCopier, executor: str, task: Callable[..., None], *args: object) -> None:
        """Run ``task(*args)`` on a one-thread executor as the copies' task (``staged`` waits for it); if it
        cannot be submitted (interpreter shutdown), the copies already enqueued end first and it is raised."""
        with self._lock:
            self._pending += 1
            self._copying += 1
        try:
            shared_executor(1, executor).submit(task, *args)
        except BaseException:
            with self._lock:
                self._pending -= 1
                self._copying -= 1
            copier.drain()
            fence = self._require_fence()
            fence.finish(fence.event)  # nobody will enqueue more: order() must not wait
            raise

    def _feed_copies(self, copier: DeviceCopier) -> None:
        last = None
        try:
            last = self._enqueue_copies(copier, CopyWindow(self.cfg.staging.d2h_window_bytes), self._submit_checksum)
            last.synchronize()  # type: ignore[attr-defined]
        except BaseException as e:
            self._fail(e)
        finally:
            self._require_fence().finish(last)
            self._copy_ended()
            self._task_ended()

    def _require_fence(self) -> CopyFence:
        if self.fence is None:
            raise RuntimeError("ImageJob used before start()")
        return self.fence

    def _wait_copies(self, last: object, events: list[tuple[Chunk, object]]) -> None:
        try:
            try:
                for chunk, event in events:
                    self._submit_checksum(chunk, event)
            finally:
                last.synchronize()  # type: ignore[attr-defined]  # copies end before any failure is reported
        except BaseException as e:
            self._fail(e)
        finally:
            try:
                self._copy_ended()
            finally:
                self._task_ended()

    def _fill_task(self, chunk: Chunk) -> None:
        try:
            if not self._cancel.is_set():
                fill_chunk(self._slot(chunk), self.files[chunk.file], chunk, self.sources)
        except BaseException as e:
            self._fail(e)
        finally:
            try:
                self._copy_ended()  # the last one queues the checksums before this task ends: no early finish
            finally:
                self._task_ended()

    # -- checksums ----------------------------------------------------------------------------------
    def _submit_checksum(self, chunk: Chunk, event: object | None) -> None:
        with self._lock:
            self._pending += 1
        try:
            shared_executor(self.cfg.io.threads, f"cpuckpt-crc-{self.rank}").submit(self._checksum_task, chunk, event)
        except BaseException:  # the executor refused (interpreter shutdown): nothing will run it
            self._task_ended()
            raise

    def _checksum_task(self, chunk: Chunk, event: object | None) -> None:
        """crc32c of ``chunk``'s bytes in the image, once its copy completed (``event``: a GPU chunk's)."""
        try:
            if event is not None and not self._cancel.is_set():
                event.synchronize()  # type: ignore[attr-defined]
            if self._cancel.is_set():
                return
            targets = self._targets
            if targets is None:
                raise RuntimeError("ImageJob used before start()")
            with targets[chunk.file][1][chunk.offset : chunk.offset + chunk.nbytes] as view:
                self._crcs[chunk.file][chunk.index] = crc32c.crc32c(view)
        except BaseException as e:
            self._fail(e)
        finally:
            self._task_ended()

    def _copy_ended(self) -> None:
        with self._lock:
            self._copying -= 1
            copied = self._copying == 0
        if copied:
            self._copies_ended()

    def _copies_ended(self) -> None:
        """Every copy into the images completed: ``staged``; CPU fills: queue the checksums now."""
        with self._lock:
            if self._error is not None or self._copied:  # reached from start() and from the last copy
                return
            self._copied = True
            self.stats.stage_s = time.perf_counter() - self._t0
        _settle(self.staged, None)
        if self._checksum_after_copies:
            for chunk in self._chunks:
                self._submit_checksum(chunk, None)

    def _task_ended(self) -> None:
        with self._lock:
            self._pending -= 1
            idle = self._pending == 0
        if idle:
            self._finish()

    def _finish(self) -> None:
        """Nothing writes into the images any more: report the result (or the error)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            error = self._error
        self._targets = None  # drop the views, so an image can be remapped or closed
        if error is not None:
            _settle(self.staged, error=error)
            _settle(self.done, error=error)
            return
        self.stats.write_s = time.perf_counter() - self._t0
        if not self.stats.stage_s:
            self.stats.stage_s = self.stats.write_s
        self.stats.extra["checksum_s"] = self.stats.write_s - self.stats.stage_s if self._checksum else 0.0
        entries = [FileEntry(name=n, nbytes=f.nbytes, chunk_bytes=self.cfg.io.chunk_bytes,
                             checksum="crc32c" if self._checksum else "none",
                             chunk_checksums=list(c) if self._checksum else [])
                   for n, f, c in zip(self.names, self.files, self._crcs)]
        logger.debug("rank %d: %d bytes saved into memory images in %s in %.3f s (checksums done at %.3f s)",
                     self.rank, self.stats.nbytes, self.directory, self.stats.stage_s, self.stats.write_s)
        _settle(self.staged, None)
        _settle(self.done, entries)

    def _fail(self, e: BaseException, *, wrap: bool = True) -> None:
        err = self._wrap(e) if wrap else self._as_cpuckpt(e)
        with self._lock:
            if self._error is not None:
                return
            self._error = err
            self._cancel.set()
        logger.error("rank %d: save into memory images in %s failed: %s", self.rank, self.directory, err)
        _settle(self.staged, error=err)  # ``done`` follows once no copy still runs (``_finish``)

    def _as_cpuckpt(self, e: BaseException) -> BaseException:
        if isinstance(e, CpuckptError | OSError | TimeoutError):
            return e
        err = CpuckptError(f"rank {self.rank}: saving into memory images in {self.directory} failed: {e!r}")
        err.__cause__ = e
        return err

    def _wrap(self, e: BaseException) -> BaseException:
        """The error of this rank's save: names rank and directory, keeps the class, chains ``e``."""
        detail = str(e) if isinstance(e, CpuckptError | OSError) else repr(e)
        msg = f"rank {self.rank}: saving into memory images in {self.directory} failed: {detail}"
        err: CpuckptError
        if isinstance(e, StorageIOError):
            err = StorageIOError(msg, path=e.path, offset=e.offset, nbytes=e.nbytes, errno_=e.errno)
        elif isinstance(e, OSError):
            err = StorageIOError(msg, path=None if e.filename is None else str(e.filename), errno_=e.errno)
        elif isinstance(e, TimeoutError):
            err = CheckpointTimeoutError(msg)
        elif isinstance(e, CpuckptError) and not isinstance(e, StagingError):
            try:
                err = type(e)(msg)
            except TypeError:
                err = CpuckptError(msg)
        else:
            err = StagingError(msg)
        err.__cause__ = e
        return err


def _settle(fut: cf.Future, result: object = None, *, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless it already is (a failure and a success may race from two threads)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


def _expected_crcs(src: str, expect: FileEntry | None, nbytes: int, chunk_bytes: int) -> list[int] | None:
    """The memory manifest's checksums of ``src`` to compare with (None: it recorded none)."""
    if expect is None or expect.checksum != "crc32c" or not expect.chunk_checksums:
        return None
    if expect.nbytes != nbytes:
        raise CheckpointCorrupt(f"memory image {src} holds {nbytes} bytes, its memory manifest says {expect.nbytes}; "
                                "not persisted")
    nchunks = -(-nbytes // chunk_bytes)
    if len(expect.chunk_checksums) != nchunks:
        raise CheckpointCorrupt(f"memory image {src}: its memory manifest has {len(expect.chunk_checksums)} chunk "
                                f"checksums for {nchunks} chunks of {chunk_bytes} bytes; not persisted")
    return expect.chunk_checksums


def persist_image(src: str | os.PathLike, dst: str | os.PathLike, cfg: Config, *,
                  threads: int | None = None, expect: FileEntry | None = None) -> FileEntry:
    """Copy the image ``src`` to the durable file ``dst``, checksumming every chunk on the way.

    Chunks of ``io.chunk_bytes`` are read into page-aligned buffers on ``threads`` (default
    ``io.threads``) threads, checksummed (crc32c, as ``SaveJob`` does for the same bytes) and written
    at the same offset through ``io.backend`` (O_DIRECT where allowed: the last chunk is padded, and
    ``finish_write`` truncates the file to its size and fsyncs it when ``io.fsync``). The caller
    fsyncs ``dst``'s directory once its files are written.

    ``expect`` is ``src``'s entry in the memory checkpoint's manifest: when it records crc32c per chunk
    (``memory.checksum``), every chunk is compared with it after it is read and before it is written
    (its ``chunk_bytes`` is then the unit), so bytes damaged in RAM since the memory commit never reach
    ``dst`` whole; the caller must not commit ``dst`` after an error. Between reading a chunk and
    writing it, each task passes the fault point ``persist-chunk:<dst name>:<chunk index>``.

    Raises:
        CheckpointCorrupt: ``src`` does not match ``expect`` (a chunk's checksum, its size or chunk count).
        StorageIOError: reading ``src`` or writing ``dst`` failed, or ``src`` shrank meanwhile.
        CheckpointTimeoutError: not done within ``timeout_s``.
    """
    src_s, dst_s = str(src), str(dst)
    chunk_bytes, align = cfg.io.chunk_bytes, cfg.layout.align_bytes
    if expect is not None and expect.checksum == "crc32c" and expect.chunk_checksums:
        chunk_bytes = expect.chunk_bytes  # the unit the checksums were computed in
        if chunk_bytes <= 0 or chunk_bytes % align:
            raise CheckpointCorrupt(f"memory image {src_s}: its manifest's chunk_bytes {chunk_bytes} is not a positive "
                                    f"multiple of layout.align_bytes ({align}); not persisted")
    checksum = cfg.integrity.checksum == "crc32c"
    reader = BufferedFileBackend()
    backend = get_backend(cfg.io.backend, Path(dst).parent, align)
    sfd = reader.open_read(src_s)
    buffers: list[mmap.mmap] = []
    try:
        try:
            nbytes = os.fstat(sfd).st_size
        except OSError as e:
            raise _os_error("fstat", e, Path(src)) from e
        offsets = list(range(0, nbytes, chunk_bytes))
        crcs = [0] * len(offsets)
        expected = _expected_crcs(src_s, expect, nbytes, chunk_bytes)
        name = Path(dst).name
        nthreads = max(1, min(threads or cfg.io.threads, len(offsets)))
        free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(nthreads if offsets else 0):
            buffers.append(mmap.mmap(-1, chunk_bytes))  # page-aligned: O_DIRECT-ready
            free.put(buffers[-1])
        dfd = backend.open_write(dst_s)

        def copy_chunk(k: int, cancel: threading.Event) -> None:
            off = offsets[k]
            n = min(chunk_bytes, nbytes - off)
            buf = free.get()
            view = memoryview(buf)
            try:
                if cancel.is_set():
                    return
                got = reader.pread_into(sfd, view[:n], off, src_s)
                if cancel.is_set():  # another chunk failed or the wait timed out: the files may be closed
                    return
                if got != n:
                    raise StorageIOError(f"memory image {src_s} shrank while being persisted: {got} of {n} bytes "
                                         f"at offset {off}", path=src_s, offset=off, nbytes=n)
                if checksum or expected is not None:
                    crcs[k] = crc32c.crc32c(view[:n])
                if expected is not None and crcs[k] != expected[k]:
                    raise CheckpointCorrupt(
                        f"memory image {src_s}: checksum mismatch in bytes [{off}, {off + n}) (chunk {k}): recorded "
                        f"{expected[k]} at the memory commit, read {crcs[k]}; the RAM copy is damaged and is not "
                        f"persisted to {dst_s}")
                faultpoint.hit(f"persist-chunk:{name}:{k}")
                io_n = _round_up(n, align) if backend.aligned else n
                if io_n > n:
                    view[n:io_n] = bytes(io_n - n)
                backend.pwrite(dfd, view[:io_n], off, dst_s)
            finally:
                view.release()
                free.put(buf)

        try:
            run_parallel(copy_chunk, range(len(offsets)), threads=nthreads, timeout_s=cfg.timeout_s,
                         name="cpuckpt-persist")
        except CheckpointTimeoutError:
            # Tasks may still be running: closing now would let a late pwrite land in whatever file
            # reuses the descriptor number. Both descriptors are left open (a rare, bounded leak), and
            # the tasks' closures now see -1, so a late read or write fails (EBADF) instead.
            sfd = dfd = -1
            raise
        except BaseException:
            backend.close(dfd)
            raise
        backend.finish_write(dfd, nbytes, dst_s, cfg.io.fsync)
    finally:
        if sfd >= 0:
            reader.close(sfd)
        for buf in buffers:
            try:
                buf.close()
            except BufferError:  # a timed-out task still holds it: freed when it ends
                pass
    return FileEntry(name=Path(dst).name, nbytes=nbytes, chunk_bytes=chunk_bytes,
                     checksum="crc32c" if checksum else "none", chunk_checksums=crcs if checksum else [0] * len(crcs))
