"""File backends: pwrite/pread/fsync of data files and directories. The only module issuing syscalls.

A backend is chosen by name (``io.backend``): ``direct`` (O_DIRECT: buffer, offset and length
aligned), ``buffered`` (page cache), ``auto`` (probe the directory once: O_DIRECT where the
filesystem accepts it, else buffered with a warning), or a name added by :func:`register_backend`.
A registered name is either plain (``io.backend: <name>``: the factory is called without arguments)
or a prefix (``io.backend: <name>:<spec>``: the factory is called with the whole string).
Every OSError becomes a :class:`StorageIOError` naming file, offset and length.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

from cpuckpt import faultpoint
from cpuckpt.errors import ConfigError, StorageIOError

__all__ = [
    "BufferedFileBackend",
    "DirectFileBackend",
    "FileBackend",
    "fsync_dir",
    "get_backend",
    "register_backend",
    "unregister_backend",
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


BackendFactory = Callable[..., FileBackend]

# Per process: io.backend names resolve alike for every stream; O_DIRECT support is the device's (st_dev).
_BACKENDS: dict[str, BackendFactory] = {"buffered": BufferedFileBackend, "direct": DirectFileBackend}
_PROBED: dict[int, bool] = {}  # st_dev -> O_DIRECT works there (probed once)
_PROBE_LOCK = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``io.backend`` select a backend made by ``factory`` (a class or any callable).

    ``io.backend: <name>`` calls ``factory()``; ``io.backend: <name>:<spec>`` calls
    ``factory("<name>:<spec>")`` (the whole string), so one factory serves a family of settings.
    A factory should raise :class:`ConfigError` for a spec it does not understand.

    Raises:
        ValueError: ``name`` is empty, contains ``:``, or is ``auto``.
    """
    if not name or ":" in name or name == "auto":
        raise ValueError(f"register_backend: bad backend name {name!r} (non-empty, no ':', not 'auto')")
    _BACKENDS[name] = factory


def unregister_backend(name: str) -> BackendFactory | None:
    """Forget the backend ``name`` (the built-in ones included); returns its factory, None if unknown."""
    return _BACKENDS.pop(name, None)


def get_backend(name: str, directory: str | os.PathLike, align_bytes: int = 4096) -> FileBackend:
    """Return the backend ``name`` for files in ``directory`` (``auto`` probes O_DIRECT once per device).

    ``<prefix>:<spec>`` goes to the factory registered as ``<prefix>``, called with the whole name.

    Raises:
        ConfigError: ``name`` is not a known backend, its factory does not take (or needs) a spec, or
            refused it.
    """
    if name == "auto":
        return DirectFileBackend() if _direct_supported(directory, align_bytes) else BufferedFileBackend()
    prefix, colon, _ = name.partition(":")
    factory = _BACKENDS.get(prefix)
    if factory is None:
        known = ", ".join(sorted([*_BACKENDS, "auto"]))
        raise ConfigError(f"io.backend: unknown backend {name!r}; known: {known}")
    args = (name,) if colon else ()
    try:
        inspect.signature(factory).bind(*args)
    except TypeError:
        how = f"takes no spec ('{prefix}')" if colon else f"needs a spec ('{prefix}:<spec>')"
        raise ConfigError(f"io.backend: backend {prefix!r} {how}, got {name!r}") from None
    except ValueError:  # no signature to check (a builtin): just call it
        pass
    return factory(*args)


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


def write_atomic(path: Path, data: bytes, *, fsync: bool = True, withdraw: bool = False) -> None:
    """Write ``path`` via a temporary file, fsync, rename, and fsync of the directory.

    ``withdraw``: when the directory's fsync fails after the rename, remove ``path`` again before raising. For
    commit markers: a save that reports failure must not leave its checkpoint listed as committed.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    faultpoint.hit(f"before-rename:{path.name}")
    os.replace(tmp, path)
    if fsync:
        try:
            faultpoint.hit(f"fsync-dir:{path.name}")
            fsync_dir(path.parent)
        except OSError:
            if withdraw:
                _withdraw(path)
            raise
    faultpoint.hit(f"after-rename:{path.name}")


def _withdraw(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.error("%s: its directory's fsync failed after the rename, and it could not be removed again "
                     "(it may be listed although its write failed): %s", path, e)
