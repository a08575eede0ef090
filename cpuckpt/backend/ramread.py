"""Reading data files that live in RAM (tmpfs, ramfs) by mapping them instead of reading them.

A file in a RAM filesystem is already in memory: ``pread`` into a staging slot is a copy for
nothing. The reader maps such a file read-only (:class:`MappedFile`) and checksums and copies
straight from the mapping, for host targets. A file with GPU targets takes the ordinary chunk path
(``pread`` into a pinned slot, then host-to-device): on the H200 that beat pinning the mapping's
chunks while copying them and a small pinned ring (BENCHMARKS.md, memory tier, round four).

Owns: detection (``statfs``), the mapping. Must not: write to a file, touch CUDA.

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
import warnings
from pathlib import Path

import torch

from cpuckpt.errors import StorageIOError

__all__ = ["MappedFile", "in_ram"]

logger = logging.getLogger(__name__)

_RAM_MAGIC = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC (linux/magic.h)


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
    """A read-only ``MAP_SHARED`` mapping of one file.

    Raises:
        StorageIOError: opening or mapping failed (the message names the file).
    """

    def __init__(self, path: str | os.PathLike, nbytes: int) -> None:
        self.path = str(path)
        self.nbytes = nbytes
        self._mmap: mmap.mmap | None = None
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

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the file's bytes (read-only memory: a copy source only)."""
        return self._tensor

    def view(self) -> memoryview:
        """A read-only memoryview of the file's bytes."""
        return self._view

    def close(self) -> None:
        """Unmap; views still referenced keep the mapping until collected."""
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
