"""Reading data files that live in RAM (tmpfs, ramfs) by mapping them instead of reading them.

A file in a RAM filesystem is already in memory: ``pread`` into a staging slot is a copy for
nothing. The reader maps such a file read-only (:class:`MappedFile`) and checksums and copies
straight from the mapping. For host-to-device copies a mapped range must be pinned first; the two
ways the memory-tier issue names are selected by ``h2d`` (see :data:`H2D_MODES`): ``bounce`` leaves
RAM files to the ordinary chunk path (``pread`` into a pinned slot, then H2D: two copies, no
registration of the file), ``register`` registers each chunk of the mapping with ``cudaHostRegister`` (read-only)
on the reader's thread while other threads copy theirs, copies from it and unregisters it, ``ring``
copies each chunk of the mapping through a small pinned ring (``transfer.pinned_ring``).

Owns: detection (``statfs``), the mapping, per-range registration. Must not: write to a file,
touch CUDA streams (copies go through ``transfer.staging.DeviceCopier``).

A mapped file that shrinks while it is read raises SIGBUS: the reader checks every file's size
against its manifest right before mapping it, and only files of a RAM filesystem are mapped
(checkpoints there are never rewritten in place by another process while loaded: the memory tier
writes a new save into another slot than the one being loaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import threading
import warnings
from pathlib import Path

import torch

from cpuckpt.errors import StorageIOError

__all__ = ["H2D_MODES", "MappedFile", "in_ram"]

logger = logging.getLogger(__name__)

H2D_MODES = ("auto", "bounce", "register", "ring")  # how a RAM file reaches the GPU (auto: see StorageReader)
_RAM_MAGIC = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC (linux/magic.h)
_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: pin without write access (no copy-on-write)
_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every context (chunks may go to several devices)
_PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


@functools.lru_cache(maxsize=256)
def _fs_magic(directory: str) -> int | None:
    libc = _libc()
    if libc is None or not hasattr(libc, "statfs"):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type first
    if libc.statfs(os.fsencode(directory), buf) != 0:
        return None
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little", signed=True) & 0xFFFFFFFF


def in_ram(path: str | os.PathLike) -> bool:
    """True when ``path``'s directory is on tmpfs or ramfs (Linux ``statfs``); False when unknown.

    Cached per directory: a checkpoint directory does not change filesystems during a process.
    """
    return _fs_magic(str(Path(path).parent)) in _RAM_MAGIC


class MappedFile:
    """A read-only ``MAP_SHARED`` mapping of one file, with optional per-range CUDA registration.

    Thread-safe for concurrent :meth:`register`/:meth:`unregister` of distinct ranges.

    Raises:
        StorageIOError: opening or mapping failed (the message names the file).
    """

    def __init__(self, path: str | os.PathLike, nbytes: int) -> None:
        self.path = str(path)
        self.nbytes = nbytes
        self._mmap: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._regs: set[int] = set()
        self.registered_nbytes = 0
        self.failed_registrations = 0
        self._device: torch.device | None = None  # where ranges were registered (unregistered there)
        if nbytes == 0:
            self._tensor = torch.empty(0, dtype=torch.uint8)
            self._view = memoryview(b"")
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                self._mmap = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except (OSError, ValueError) as e:
            errno_ = getattr(e, "errno", None)
            raise StorageIOError(f"mapping {self.path} ({nbytes} bytes) for reading failed: {e}", path=self.path,
                                 nbytes=nbytes, errno_=errno_) from e
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; the tensor is only ever a copy source.
            warnings.simplefilter("ignore", UserWarning)
            self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._view = memoryview(self._mmap)
        self._base = self._tensor.data_ptr()

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the file's bytes (read-only memory: a copy source only)."""
        return self._tensor

    def view(self) -> memoryview:
        """A read-only memoryview of the file's bytes."""
        return self._view

    def register(self, lo: int, hi: int, device: torch.device | None = None) -> bool:
        """Pin the pages of ``[lo, hi)`` for device copies to ``device`` (registered under it: a read
        thread's current device is device 0) (``lo`` page-aligned); False when CUDA refused.

        The range is extended to its last page (inside the mapping). A refusal is logged once per
        file and leaves the range unpinned: copies from it still work, at pageable speed.
        """
        if self._mmap is None or hi <= lo or lo % _PAGE:
            return False
        n = min(-(-hi // _PAGE) * _PAGE, len(self._mmap)) - lo
        if n <= 0:
            return False
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(self._base + lo, n, _HOST_REGISTER_READ_ONLY | _PORTABLE)
        if int(err) != 0:
            with self._lock:
                self.failed_registrations += 1
                first = self.failed_registrations == 1
            if first:
                logger.warning("cudaHostRegister (read-only) of %d bytes of %s failed (error %s); copying from it "
                               "unpinned", n, self.path, err)
            return False
        with self._lock:
            self._regs.add(lo)
            self.registered_nbytes += n
            self._device = self._device or device
        return True

    def unregister(self, lo: int) -> None:
        """Unpin the range registered at ``lo`` (its device copies must have completed)."""
        with self._lock:
            if lo not in self._regs:
                return
            self._regs.discard(lo)
        with torch.cuda.device(self._device):
            torch.cuda.cudart().cudaHostUnregister(self._base + lo)

    def close(self) -> None:
        """Unregister what is left and unmap; views still referenced keep the mapping until collected."""
        with self._lock:
            left, self._regs = list(self._regs), set()
        if left:
            with torch.cuda.device(self._device):
                for lo in left:
                    torch.cuda.cudart().cudaHostUnregister(self._base + lo)
        if self._mmap is None:
            return
        del self._tensor
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            logger.debug("%s: views of the mapping still referenced; unmapped when they are collected", self.path)
        self._mmap = None

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
