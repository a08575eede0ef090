"""File backends: pwrite/pread/fsync of data files and directories. The only module issuing syscalls.

A backend is chosen by name (``io.backend``): ``direct`` (O_DIRECT: buffer, offset and length
aligned), ``buffered`` (page cache), ``auto`` (probe the directory once: O_DIRECT where the
filesystem accepts it, else buffered with a warning), or ``fault:<errno>@<bytes>`` /
``fault:<errno>@fsync`` (a first-class fault injector used by the test-suite: fails every write once
that many bytes were written, or fails the final fsync), or ``fault:KILL@<bytes>`` /
``fault:KILL@fsync`` (SIGKILLs the whole process once exactly that many bytes reached the files, or
just before a file's final fsync: deterministic crash points for the kill sweep).
Every OSError becomes a :class:`StorageIOError` naming file, offset and length.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import mmap
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import ClassVar, Protocol

from cpuckpt import faultpoint
from cpuckpt.errors import ConfigError, StorageIOError

__all__ = [
    "BufferedFileBackend",
    "DirectFileBackend",
    "FaultInjectingBackend",
    "FileBackend",
    "KillingBackend",
    "fsync_dir",
    "get_backend",
    "register_backend",
]

logger = logging.getLogger(__name__)


class FileBackend(Protocol):
    """How data files are opened, written, read and made durable.

    Writers call ``open_write`` once per file, then ``pwrite`` from several threads at disjoint
    offsets, then ``finish_write`` once. When ``aligned`` is true, every ``pwrite``/``pread`` buffer,
    offset and length passed by cpuckpt is a multiple of the alignment (the tail is padded, and
    ``finish_write`` truncates the file back to its real size).
    """

    name: str
    aligned: bool

    def open_write(self, path: str) -> int: ...
    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None: ...
    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None: ...
    def open_read(self, path: str) -> int: ...
    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str) -> int: ...
    def close(self, fd: int) -> None: ...


def _io_error(op: str, e: OSError, path: str, offset: int | None = None, nbytes: int | None = None) -> StorageIOError:
    where = f" at offset {offset}" if offset is not None else ""
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return StorageIOError(
        f"{op} failed on {path}{where}{size}: [errno {e.errno}] {e.strerror or e}",
        path=path, offset=offset, nbytes=nbytes, errno_=e.errno,
    )


class BufferedFileBackend:
    """Plain file descriptors through the page cache."""

    name = "buffered"
    aligned = False
    _write_flags: ClassVar[int] = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    _read_flags: ClassVar[int] = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

    def open_write(self, path: str) -> int:
        try:
            return os.open(path, self._write_flags, 0o644)
        except OSError as e:
            raise _io_error("open for writing", e, path) from e

    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None:
        view = memoryview(buf).cast("B")
        done, total = 0, len(view)
        while done < total:
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                raise _io_error("pwrite", e, path, offset + done, total - done) from e
            if n <= 0:
                raise StorageIOError(f"pwrite wrote nothing on {path} at offset {offset + done}",
                                     path=path, offset=offset + done, nbytes=total - done)
            done += n

    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None:
        try:
            os.ftruncate(fd, nbytes)
            if fsync:
                os.fsync(fd)
        except OSError as e:
            raise _io_error("fsync" if fsync else "ftruncate", e, path) from e
        finally:
            self.close(fd)

    def open_read(self, path: str) -> int:
        try:
            return os.open(path, self._read_flags)
        except OSError as e:
            raise _io_error("open for reading", e, path) from e

    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        view = memoryview(buf).cast("B")
        done, total = 0, len(view)
        while done < total:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise _io_error("pread", e, path, offset + done, total - done) from e
            if n == 0:
                break
            done += n
        return done

    def close(self, fd: int) -> None:
        try:
            os.close(fd)
        except OSError:
            pass


class DirectFileBackend(BufferedFileBackend):
    """O_DIRECT: bypasses the page cache; cpuckpt passes aligned buffers, offsets and lengths."""

    name = "direct"
    aligned = True
    _write_flags = BufferedFileBackend._write_flags | getattr(os, "O_DIRECT", 0)
    _read_flags = BufferedFileBackend._read_flags | getattr(os, "O_DIRECT", 0)


class FaultInjectingBackend(BufferedFileBackend):
    """Fails writes with ``errno`` once ``fail_after_bytes`` bytes were written through it, or fails
    the final fsync (``fail_fsync``). A first-class backend for tests, not a mock."""

    name = "fault"

    def __init__(self, err: int, fail_after_bytes: int, *, fail_fsync: bool = False) -> None:
        self.err = err
        self.fail_after_bytes = fail_after_bytes
        self.fail_fsync = fail_fsync
        self._written = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None:
        with self._lock:
            self._written += len(buf)
            fail = self._written > self.fail_after_bytes
        if fail:
            e = OSError(self.err, os.strerror(self.err))
            raise _io_error("pwrite", e, path, offset, len(buf)) from e
        super().pwrite(fd, buf, offset, path)

    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None:
        if self.fail_fsync:
            self.close(fd)
            e = OSError(self.err, os.strerror(self.err))
            raise _io_error("fsync", e, path) from e
        super().finish_write(fd, nbytes, path, fsync)


class KillingBackend(BufferedFileBackend):
    """SIGKILLs this process once ``kill_after_bytes`` bytes were written through it (the write that
    crosses the limit is written only up to it), or before a file's final fsync (``kill_fsync``).
    A first-class backend for crash tests: what is on disk afterwards is exactly what a crash at
    that byte leaves (minus the page cache loss of a power failure)."""

    name = "kill"

    def __init__(self, kill_after_bytes: int, *, kill_fsync: bool = False) -> None:
        self.kill_after_bytes = kill_after_bytes
        self.kill_fsync = kill_fsync
        self._written = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None:
        view = memoryview(buf).cast("B")
        with self._lock:  # held across the write: the byte count at the kill is exact
            room = self.kill_after_bytes - self._written
            if room >= len(view):
                self._written += len(view)
                super().pwrite(fd, view, offset, path)
                return
            if room > 0:
                super().pwrite(fd, view[:room], offset, path)
            logger.warning("fault backend: SIGKILL after %d bytes (in %s at offset %d)",
                           self.kill_after_bytes, path, offset + max(room, 0))
            os.kill(os.getpid(), signal.SIGKILL)

    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None:
        if self.kill_fsync:
            os.kill(os.getpid(), signal.SIGKILL)
        super().finish_write(fd, nbytes, path, fsync)


_BACKENDS: dict[str, type] = {"buffered": BufferedFileBackend, "direct": DirectFileBackend}
_PROBED: dict[int, bool] = {}
_PROBE_LOCK = threading.Lock()


def register_backend(name: str, cls: type) -> None:
    """Make ``io.backend: <name>`` select ``cls`` (constructed without arguments)."""
    _BACKENDS[name] = cls


def get_backend(name: str, directory: str | os.PathLike, align_bytes: int = 4096) -> FileBackend:
    """Return the backend ``name`` for files in ``directory`` (``auto`` probes O_DIRECT once per device).

    Raises:
        ConfigError: ``name`` is not a known backend.
    """
    if name == "auto":
        return DirectFileBackend() if _direct_supported(directory, align_bytes) else BufferedFileBackend()
    if name.startswith("fault:"):
        return _parse_fault(name)
    cls = _BACKENDS.get(name)
    if cls is None:
        known = ", ".join(sorted([*_BACKENDS, "auto", "fault:<errno>@<bytes>"]))
        raise ConfigError(f"io.backend: unknown backend {name!r}; known: {known}")
    return cls()


def _parse_fault(name: str) -> FaultInjectingBackend | KillingBackend:
    try:
        err_name, after = name[len("fault:") :].split("@")
        if err_name.upper() == "KILL":
            return KillingBackend(1 << 62, kill_fsync=True) if after == "fsync" else KillingBackend(int(after))
        err = getattr(errno_mod, err_name.upper()) if not err_name.isdigit() else int(err_name)
        if after == "fsync":
            return FaultInjectingBackend(err, 1 << 62, fail_fsync=True)
        return FaultInjectingBackend(err, int(after))
    except (ValueError, AttributeError):
        raise ConfigError(f"io.backend: bad fault spec {name!r}; expected e.g. 'fault:ENOSPC@1048576', "
                          "'fault:EIO@fsync' or 'fault:KILL@65536'") from None


def _direct_supported(directory: str | os.PathLike, align_bytes: int) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dev = directory.stat().st_dev
    with _PROBE_LOCK:
        if dev in _PROBED:
            return _PROBED[dev]
        probe = directory / f".cpuckpt-probe-{uuid.uuid4().hex}"
        buf = mmap.mmap(-1, align_bytes)
        ok = True
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.pwrite(fd, memoryview(buf), 0)
            finally:
                os.close(fd)
        except OSError as e:
            ok = False
            logger.warning("O_DIRECT refused in %s (%s); using buffered I/O", directory, e.strerror or e)
        finally:
            buf.close()
            try:
                probe.unlink()
            except OSError:
                pass
        _PROBED[dev] = ok
        return ok


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise _io_error("open directory", e, str(path)) from e
    try:
        os.fsync(fd)
    except OSError as e:
        raise _io_error("fsync directory", e, str(path)) from e
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``path`` via a temporary file, fsync, rename, and fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    faultpoint.hit(f"before-rename:{path.name}")
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
    faultpoint.hit(f"after-rename:{path.name}")
