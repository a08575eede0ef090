"""Reused memory images: a rank's data files in a RAM root (tmpfs), saved into by device-to-host copies.

An ``ImageFile`` is one data file in a RAM-backed directory. It is reserved with ``posix_fallocate``
(a full tmpfs fails there with ENOSPC, never with SIGBUS in the middle of a copy), mapped
``MAP_SHARED`` once and, when CUDA is present, pinned with ``cudaHostRegister`` once, so a save is
a copy from the device straight into the file's pages: no host pool, no ``pwrite``. An ``ImageSet``
is the save engine's sink factory (``StorageWriter(sink=images)``): its ``ImageSink`` hands the engine
views of the images as slots, so a save fills them with the same bytes the pool path writes, with every
staging feature of the engine (device snapshot, copy window, gate, fill programs), and stock DCP
readers load the directory once ``.metadata`` is there. With ``memory.checksum`` (and
``integrity.checksum: crc32c``) each chunk's crc32c is computed from the image (GPU: each chunk after
its own copy): ``staged`` waits for the copies only, ``done`` (and so the memory commit) for the
checksums too. The writer process copies the images to durable storage (``tier.imagecopy``).

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
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, StagingError, StorageIOError
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.tier import pinning
from cpuckpt.tier.copier import CopyProcess, ImageDesc
from cpuckpt.tier.imagecopy import os_error as _os_error
from cpuckpt.transfer.pacing import PACER
from cpuckpt.transfer.sinks import DeviceCopies, Offloaded
from cpuckpt.transfer.staging import Slot, consume_cuda_error

__all__ = ["ImageFile", "ImageSet", "ImageSink"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
CAPACITY_ROUND_BYTES = 2 * _MiB  # mappings grow in these steps, so a slightly larger save reuses them


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
        self._segment = pinning.MIN_SEGMENT_BYTES
        self._pin_failed = False
        # [0, _allocated) was reserved by this object (or by its maker: adopt_allocated), not truncated since
        self._allocated = 0
        # For another process that maps and pins the file (the copy process, :meth:`describe`): this object's
        # name (a new object: that process maps the file anew), and the smallest the file was since it was last
        # described (its registrations past that are dropped: pinning.stale).
        self._uid = uuid.uuid4().hex
        self._smallest = self.nbytes

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
            segment = pinning.segment_bytes(chunk_bytes)
            if segment != self._segment:
                self._unregister(list(self._regs))  # re-registered below in the new unit
                self._segment = segment
        self._reserve(nbytes)  # also extends the file; a failure leaves the image as it was
        try:
            if nbytes > self.capacity:
                self._remap(nbytes)
            else:
                # Pages past the new last page leave the file: no registration may keep them.
                self._unregister(pinning.stale(self._regs, None, nbytes))
                self._truncate(nbytes)
        except BaseException:
            try:
                self.nbytes = min(os.fstat(self._fd).st_size, self.capacity)
            except OSError:
                self.nbytes = 0
            raise
        self.nbytes = nbytes
        self._register_missing()

    def adopt_allocated(self, nbytes: int) -> None:
        """The file's first ``nbytes`` were allocated (``posix_fallocate``) by its maker just now, before this object
        opened it: not walked again (~80 ms per GiB on tmpfs even when every page is there). Only for a file this
        object has allocated nothing of, at least that long."""
        st = os.fstat(self._fd)
        if self._allocated == 0 and st.st_size >= nbytes and st.st_blocks * 512 >= nbytes:
            self._allocated = nbytes

    def _reserve(self, nbytes: int) -> None:
        # Only the bytes past what this object allocated itself: posix_fallocate walks every page of its range,
        # ~14 ms per GiB on tmpfs even when all are there (80-130 on the CPU box; a stall on the trainer's path).
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
        self._smallest = min(self._smallest, nbytes)

    def _remap(self, nbytes: int) -> None:
        self._unmap()
        capacity = pinning.round_up(nbytes, CAPACITY_ROUND_BYTES)
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
        return pinning.segments(self.nbytes, self._segment, self.capacity)

    def _register_missing(self) -> None:
        wanted = self._wanted()
        if not (self.pin and wanted and not self._pin_failed and torch.cuda.is_available()):
            self.pinned = bool(wanted) and all(self._regs.get(off) == n for off, n in wanted)
            return
        self._unregister([off for off, n in self._regs.items() if (off, n) not in wanted])
        missing = [(off, n) for off, n in wanted if self._regs.get(off) != n]
        if missing:
            threads = pinning.prefault_threads()  # started as populate's pieces need them
            with cf.ThreadPoolExecutor(threads, thread_name_prefix="cpuckpt-prefault") as pool:
                self._register(missing, pool, threads)
        if not self._pin_failed:
            self.pinned = True

    def _register(self, missing: list[tuple[int, int]], pool: cf.Executor, threads: int) -> None:
        """Pin each missing segment, its pages faulted in on ``pool`` first (:func:`pinning.populate`)."""
        cudart = torch.cuda.cudart()
        for off, n in missing:
            pinning.populate(self._base + off, n, pool, threads)
            err = cudart.cudaHostRegister(self._base + off, n, 0)
            if int(err) != 0:
                consume_cuda_error()
                logger.warning("cudaHostRegister of %d bytes of memory image %s failed (error %s); saving into it "
                               "unpinned", n, self.path, err)
                self._unregister(list(self._regs))
                self._pin_failed = True
                self.pinned = False
                return
            self._regs[off] = n
            self.pins += 1

    def _unregister(self, offsets: Sequence[int]) -> None:
        if not offsets:
            return
        cudart = torch.cuda.cudart()
        for off in offsets:
            self._regs.pop(off, None)
            cudart.cudaHostUnregister(self._base + off)
        self.pinned = False

    # -- access -----------------------------------------------------------------------------------
    def describe(self) -> ImageDesc:
        """The image as a copy process maps and pins it, for a message sent to it before any other description of
        this image (:meth:`ImageSet.describe` under the copy process's lock): (path, this object's name, its size,
        the smallest size it had since the last description). Every later description reports from here on."""
        desc = (str(self.path), self._uid, self.nbytes, self._smallest)
        self._smallest = self.nbytes
        return desc

    @property
    def allocated(self) -> int:
        """Bytes of the file reserved (``posix_fallocate``) by this object, or by its maker just before it was opened
        (:meth:`adopt_allocated`), and not truncated away since."""
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
                 before_grow: Callable[[int], None] | None = None, copier: CopyProcess | None = None) -> None:
        self.directory = Path(directory)
        self.pin = pin
        self.copier = copier  # memory.copy_process: the rank's copy process, which the sinks offload to
        self.before_grow = before_grow  # called with the bytes an image is about to grow by (a space check)
        self._files: dict[str, ImageFile] = {}
        # per image: the ``done`` of the last job that filled it (a DeepSpeed tag's files are one job each)
        self._last_done: dict[str, cf.Future] = {}
        self._reserved: set[str] = set()  # made by reserve() and not claimed by a job yet
        self._closed = False  # close() began: nothing is reserved or prepared any more
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
        an existing image may be in use by a job, so it is never resized, but one :meth:`reserve` made and no
        job claimed yet is (an estimate, now the first save's size). Returns whether it made or resized one."""
        with self._lock:
            if self._closed or (name in self._files and name not in self._reserved):
                return False
            self._image(name, nbytes, chunk_bytes)
            return True

    def reserve(self, name: str, nbytes: int, *, chunk_bytes: int | None = None,
                allocated: int | None = None) -> bool:
        """Make image ``name`` about ``nbytes`` long ahead of the first job of this set, unless a file of that name
        is here already (it may hold a checkpoint; ``allocated`` not None: the caller made that file just now, the
        first ``allocated`` bytes of it allocated, and it is taken), a job has claimed any image here (from then on
        the jobs make their own), or the set is closed. The first job's own size is then a truncation (or, larger, a
        remap); a reserved image no job of the slot's first commit claimed is removed then (:meth:`drop_unclaimed`);
        one that fails to be made is removed at once. Returns whether it made one."""
        with self._lock:
            if (self._closed or self._last_done or name in self._files
                    or (allocated is None and os.path.lexists(self.directory / name))):
                return False
            try:
                self._image(name, nbytes, chunk_bytes, allocated=allocated or 0)
            except BaseException:
                # made here (the name was free): a half-made image in no set would never be dropped, a stray file
                img = self._files.pop(name, None)
                if img is not None:
                    img.close()
                    try:
                        img.path.unlink(missing_ok=True)
                    except OSError:
                        logger.warning("memory image %s: removing it after a failed reservation failed", img.path)
                raise
            self._reserved.add(name)
            return True

    def drop_unclaimed(self) -> None:
        """The slot's first save committed: reserved images none of its jobs claimed are closed and removed (no
        RAM held for nothing, no stray file beside the checkpoint). Called at the commit, not at a claim: a
        DeepSpeed tag's files are claimed by one job each. Nothing is reserved once a job claimed, so an empty set
        is final and needs no lock (a commit callback must not wait behind an image being made)."""
        if not self._reserved:
            return
        with self._lock:
            for name in self._reserved:
                img = self._files.pop(name, None)
                if img is not None:
                    img.close()
                    # never raised: a commit callback or a close must go on (the file holds no checkpoint)
                    if _remove_unused(img.path, "reserved and no save claimed it"):
                        logger.info("memory image %s was reserved and no save claimed it; removed", img.path)
            self._reserved.clear()

    def _image(self, name: str, nbytes: int, chunk_bytes: int | None, *, allocated: int = 0) -> ImageFile:
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
            if allocated:
                img.adopt_allocated(allocated)
        img.ensure(nbytes, chunk_bytes=chunk_bytes)
        return img

    def __call__(self, directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> ImageSink:
        """The sink of a save into these images (``StorageWriter(sink=image_set)``)."""
        return ImageSink(self, directory, names, files, cfg, rank=rank)

    def claim(self, done: cf.Future, names: list[str]) -> list[cf.Future]:
        """A job takes the images ``names``; returns the ``done`` of the previous jobs that filled them (they must
        end before any byte moves: an image is resized or remapped only while no job copies into it). Jobs of
        other images of the set go on (a tag's optimizer file does not wait for its model file)."""
        with self._lock:
            self._reserved -= set(names)  # theirs now: never resized by prepare() nor dropped
            previous = {id(f): f for n in names if (f := self._last_done.get(n)) is not None}
            for n in names:
                self._last_done[n] = done
            return list(previous.values())

    def describe(self, files: Sequence[ImageFile]) -> list[ImageDesc]:
        """``files`` (images of this set) as the copy process maps them (:meth:`ImageFile.describe`), under the
        set's lock: no image is resized while it is described."""
        with self._lock:
            return [img.describe() for img in files]

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
        """Close every image (unpin, unmap); the files stay, but those reserved and never claimed are removed (they
        hold no checkpoint; a RAM root kept after the close would hold them until ``cpuckpt clean --ram``)."""
        self.drop_unclaimed()
        with self._lock:
            self._closed = True
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


class AllocatedAhead:
    """New image files made, and their pages allocated, on threads (a file each, 8 at a time; no CUDA there): tmpfs
    allocates one file's pages under its inode lock, ~4 GB/s, separate files in parallel. A reservation then takes
    each (:meth:`ImageSet.reserve` with ``allocated=``), mapping and pinning it on its own thread. :meth:`close`
    stops any file from being made after it and removes those no set took (a failure, a close, an interrupt); a file
    still being allocated then is removed by its own thread once its allocation ends (an unlink would wait for it
    behind the inode lock, holding up a Ctrl-C)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._files: dict[Path, tuple[ImageSet, int]] = {}  # made here: its set, bytes allocated (-1: in progress)

    def allocate(self, files: Sequence[tuple[Path, ImageSet, int]]) -> None:
        """Make ``files`` (path, the set that will take it, bytes) and allocate them; returns once all ended. A
        failure of one is logged (the reservation allocates it, or says why); an interrupt stops the files not
        started and is raised at once; without threads (interpreter exit) nothing is made."""
        pool = cf.ThreadPoolExecutor(min(8, len(files)), thread_name_prefix="cpuckpt-allocate")
        try:
            for done in [pool.submit(self._make, *file) for file in files]:
                done.result()
        except RuntimeError:  # no new thread at interpreter exit: the reservation allocates
            self._stop()
        except BaseException:
            self._stop()
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _make(self, path: Path, images: ImageSet, nbytes: int) -> None:
        with self._lock:  # made and listed at once: every file made is removed unless a set takes it
            if self._stopped:
                return
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError:
                return  # there meanwhile, or the directory refuses it: the reservation says why
            self._files[path] = (images, -1)
        allocated = 0
        try:
            os.posix_fallocate(fd, 0, nbytes)
            allocated = nbytes
        except OSError as e:
            logger.debug("allocating %s ahead failed: %s", path, e)
        finally:
            os.close(fd)
            with self._lock:
                stopped = self._stopped
                self._files[path] = (images, allocated)
            if stopped:  # close() came while this was allocated: nobody takes it
                _remove_unused(path, "allocated ahead and not taken")

    def allocated(self, path: Path) -> int | None:
        """The bytes of ``path`` allocated here, None if it was not made here or is still being allocated (its thread
        removes it: the file is not the reservation's to take)."""
        with self._lock:
            made = self._files.get(path)
        return None if made is None or made[1] < 0 else made[1]

    def _stop(self) -> list[tuple[Path, ImageSet]]:
        """No file is made from now on; the files made and allocated (or failed) by now."""
        with self._lock:
            self._stopped = True
            return [(path, images) for path, (images, n) in self._files.items() if n >= 0]

    def close(self) -> None:
        """No file is made from now on; those no set took are removed (one still being allocated by its thread)."""
        for path, images in self._stop():
            if images.get(path.name) is None:
                _remove_unused(path, "allocated ahead and not taken")


def _remove_unused(path: Path, why: str) -> bool:
    """Remove an image file that holds no checkpoint; a failure is a warning (returns False), never raised."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("memory image %s, %s: removing it failed: %s", path, why, e)
        return False
    return True


class ImageSink:
    """A save straight into this rank's image files (the save engine's sink; :class:`ImageSet` makes it).

    Its slots are views of the mapped images, one per chunk, so each device-to-host copy (or host fill)
    lands in its final place and there is nothing to write. With ``memory.checksum`` (and
    ``integrity.checksum: crc32c``) the engine computes each chunk's crc32c from the image: GPU chunks
    each once its own copy completed, overlapping later copies (``write_as_copied``); host fills once all
    ended (fills and checksums would compete for the same cores, and ``staged`` is what the trainer
    waits for). Bytes past each layout's end are never touched.
    """

    name = "image"
    holds_every_chunk = True
    write_as_copied = True

    def __init__(self, images: ImageSet, directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> None:
        self.images = images
        self.directory = Path(directory)
        self.names = names
        self.files = files
        self.cfg = cfg
        self.rank = rank
        self.checksum = cfg.memory.checksum and cfg.integrity.checksum == "crc32c"
        self.checksum_kind = cfg.memory.checksum_kind
        self.offloads = images.copier is not None
        self._chunks: list[Chunk] = [c for f in files for c in f.chunks]
        self._targets: list[tuple[torch.Tensor, memoryview]] | None = None
        self._opened: list[ImageFile] = []
        self._remaps = 0

    # -- Sink -----------------------------------------------------------------------------------------
    def open(self, nslots: int, done: cf.Future) -> ImageSink:
        """Claim the images for this save (a save still copying into them, or one that failed with copies
        in flight, ends first) and size them. Raises ``CheckpointTimeoutError`` if that one does not end."""
        previous = self.images.claim(done, self.names)
        if previous:
            PACER.drain_for_wait()  # the previous save's copies, if this thread's ticks were to enqueue them
            cf.wait(previous, timeout=self.cfg.timeout_s)
            if not all(f.done() for f in previous):
                raise CheckpointTimeoutError(f"rank {self.rank}: the previous save into {self.directory} has "
                                             f"not ended after {self.cfg.timeout_s} s")
        remaps, opened = 0, []
        for name, layout in zip(self.names, self.files):
            old = self.images.get(name)
            remaps -= old.remaps if old is not None else 0
            opened.append(self.images.image(name, layout.nbytes, chunk_bytes=self.cfg.io.chunk_bytes))
        self._remaps = remaps + sum(img.remaps for img in opened)
        self._targets = [(img.tensor(), img.view()) for img in opened]
        self._opened = opened
        return self

    def submit_offload(self, copies: DeviceCopies | None, kind: str) -> Offloaded:
        """The copy process takes the checksums (of ``kind``; and with ``copies`` the device bytes) of this save."""
        copier = self.images.copier
        if copier is None or not self._opened:
            raise RuntimeError("ImageSink.submit_offload without a copy process or before open()")
        opened = list(self._opened)
        chunks = [(c.file, c.offset, c.nbytes) for c in self._chunks]

        def files() -> list[ImageDesc]:
            return self.images.describe(opened)

        checksum = kind if self.checksum else ""
        if copies is None:
            return copier.submit(files, chunks, chunk_bytes=self.cfg.io.chunk_bytes, checksum=checksum)
        return copier.submit(files, chunks, chunk_bytes=self.cfg.io.chunk_bytes, checksum=checksum,
                             buffer=copies.buffer, ready=copies.ready, ops=copies.ops,
                             host_share=copies.host_share)

    def write(self, chunk: Chunk, slot: Slot) -> None:
        """Nothing to do: the copy landed in the image."""

    def finish(self) -> None:
        self._targets = None  # drop the views, so an image can be remapped or closed
        self._opened = []

    def abort(self) -> None:
        self._targets = None
        self._opened = []

    def stats(self) -> dict[str, float]:
        return {"image_remaps": float(self._remaps)}

    # -- SlotSource: chunk ``ticket``'s place in its image --------------------------------------------
    def lease(self, timeout_s: float, *, order: object = None, ticket: int | None = None,
              cancel: threading.Event | None = None) -> Slot:
        if ticket is None:
            raise ValueError("image slots are leased by chunk (ticket)")
        return self._slot(self._chunks[ticket])

    def lease_each(self, n: int, timeout_s: float, *, cancel: threading.Event | None = None) -> list[Slot]:
        return [self._slot(c) for c in self._chunks[:n]]

    def release(self, slot: Slot) -> None:
        """Nothing to give back: the slot is the image."""

    def wake(self) -> None:
        """Nothing waits for an image slot."""

    def _slot(self, chunk: Chunk) -> Slot:
        targets = self._targets
        if targets is None:
            raise RuntimeError("ImageSink used before open()")
        tensor, view = targets[chunk.file]
        lo, hi = chunk.offset, chunk.offset + chunk.nbytes
        return Slot(index=-1, count=0, tensor=tensor[lo:hi], view=view[lo:hi])
