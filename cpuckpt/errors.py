"""The exception hierarchy of cpuckpt, and how one rank's failure becomes the same error on every rank.

Every error also inherits the matching builtin. Pure: no I/O, no torch, no collectives (the caller
moves :class:`FailureReport`\\ s between ranks; they always pickle, whatever the original was).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CheckpointCorrupt",
    "CheckpointTimeoutError",
    "ConfigError",
    "CpuckptError",
    "FailureReport",
    "IntegrityError",
    "StagingError",
    "StorageIOError",
    "UnsafeCheckpointError",
    "as_storage_error",
    "is_interrupt",
    "rank_error",
]


class CpuckptError(Exception):
    """Root of every cpuckpt error (an ``Exception``, unlike DCP's ``CheckpointException``).

    Errors raised on behalf of a group (a save or load of several ranks) also carry ``rank``, the
    lowest rank that failed, and ``failures``, ``{rank: message}`` of every rank that failed.
    """

    rank: int | None = None
    failures: dict[int, str] | None = None


class ConfigError(CpuckptError, ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value."""


class StorageIOError(CpuckptError, OSError):
    """A read or write failed; keeps errno, path, offset and length of the failed call."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        nbytes: int | None = None,
        errno_: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno_
        self.filename = path
        self.path = path
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple:
        # Errors cross ranks pickled (DCP gathers them): keep errno, path, offset, length, rank.
        return (_rebuild_storage_io_error, (self.args[0], self.path, self.offset, self.nbytes, self.errno),
                dict(self.__dict__))


def _rebuild_storage_io_error(message: str, path: str | None, offset: int | None, nbytes: int | None,
                              errno_: int | None) -> StorageIOError:
    return StorageIOError(message, path=path, offset=offset, nbytes=nbytes, errno_=errno_)


class IntegrityError(CpuckptError):
    """A checkpoint is incomplete or damaged: checksum, size or commit marker is wrong."""


class CheckpointCorrupt(IntegrityError):
    """Loaded bytes do not match what was written (names the file and byte offset)."""


class UnsafeCheckpointError(CheckpointCorrupt):
    """A non-tensor value names a global that a safe load does not resolve (it could run code).

    ``key`` is the value's state-dict key, ``names`` the refused globals (``module.name``). The
    message says how to allow them: ``torch.serialization.add_safe_globals`` or ``integrity.trusted``.
    """

    def __init__(self, message: str, *, key: str | None = None, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.names = tuple(names)

    def __reduce__(self) -> tuple:
        return (_rebuild_unsafe_checkpoint_error, (self.args[0], self.key, self.names), dict(self.__dict__))


def _rebuild_unsafe_checkpoint_error(message: str, key: str | None, names: tuple[str, ...]) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(message, key=key, names=names)


class StagingError(CpuckptError, RuntimeError):
    """Copying tensors into host memory failed (device error, pool exhausted, ...)."""


class CheckpointTimeoutError(CpuckptError, TimeoutError):
    """A bounded wait (writer threads, pool lease, peer ranks) ran out."""


class RamRootError(CpuckptError):
    """The memory tier's RAM root cannot be used; the message names the path, the reason and the fix."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)

    def __reduce__(self) -> tuple:
        return (_rebuild_ram_root_error, (self.args[0], self.path), dict(self.__dict__))


def _rebuild_ram_root_error(message: str, path: str | None) -> RamRootError:
    return RamRootError(message, path=path)


def is_interrupt(exc: BaseException | None) -> bool:
    """True for ``KeyboardInterrupt``, ``SystemExit`` and other ``BaseException``\\ s that are not errors.

    They are never wrapped into a cpuckpt error (a trainer's ``except Exception`` must not swallow
    Ctrl-C): entry points re-raise them as themselves, after telling background work to stop.
    DCP's ``CheckpointException`` is not one: it carries errors, and ``run_dcp`` unwraps it.
    """
    if exc is None or isinstance(exc, Exception):
        return False
    # By name: this module imports no torch.
    return not any(c.__name__ == "CheckpointException" and c.__module__.startswith("torch.")
                   for c in type(exc).__mro__)


def as_storage_error(exc: OSError, what: str, path: str | os.PathLike | None = None) -> StorageIOError:
    """``exc`` as a :class:`StorageIOError` (itself when it is one), keeping errno and the path.

    ``what`` says what was being done (``"create checkpoint directory"``); ``path`` defaults to the
    error's own ``filename``.
    """
    if isinstance(exc, StorageIOError):
        return exc
    where = str(path) if path is not None else (None if exc.filename is None else os.fsdecode(exc.filename))
    reason = exc.strerror or str(exc) or type(exc).__name__
    err = StorageIOError(f"{what} {where}: [errno {exc.errno}] {reason}" if where else f"{what}: {reason}",
                         path=where, errno_=exc.errno)
    err.__cause__ = exc
    return err


@dataclass(frozen=True)
class FailureReport:
    """One rank's failure, reduced to what always pickles: the cross-rank transport of an error."""

    rank: int
    error_class: str  # name of the cpuckpt class to raise (see rank_error)
    message: str
    errno: int | None = None
    path: str | None = None
    offset: int | None = None
    nbytes: int | None = None

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> FailureReport:
        """Describe ``exc`` raised on ``rank``; an error that already names its rank keeps it."""
        if isinstance(exc, CpuckptError) and exc.failures:
            rank = exc.rank if exc.rank is not None else rank
            message = exc.failures.get(rank, str(exc))
        else:
            message = str(exc) or type(exc).__name__
        return cls(
            rank=rank, error_class=_class_for(exc).__name__, message=message,
            errno=getattr(exc, "errno", None) if isinstance(exc, OSError) else None,
            path=_path_of(exc), offset=getattr(exc, "offset", None), nbytes=getattr(exc, "nbytes", None),
        )


def rank_error(reports: Sequence[FailureReport | None], what: str) -> CpuckptError | None:
    """The error every rank raises when ``reports`` (one entry per rank, ``None`` = fine) hold failures.

    Every rank builds it from the same reports, so every rank raises the same class and message
    (no rank takes a different ``except`` branch and then waits in a collective that the others
    left). The class is the lowest failing rank's: its own cpuckpt class, ``StorageIOError`` for any
    other ``OSError`` (errno, path kept), ``CheckpointTimeoutError`` for a timeout, else ``CpuckptError``.
    Chain the local original with ``raise err from original`` on the rank that has one.

    Returns:
        None when no rank failed.
    """
    failed = sorted((r for r in reports if r is not None), key=lambda r: r.rank)
    if not failed:
        return None
    first = failed[0]
    message = f"{what} failed on rank {first.rank}: {first.message}"
    if len(failed) > 1:
        others = "; ".join(f"rank {r.rank}: {_short(r.message)}" for r in failed[1:])
        message += f" (also failed: {others})"
    cls = _CLASSES.get(first.error_class, CpuckptError)
    if cls is StorageIOError:
        err: CpuckptError = StorageIOError(message, path=first.path, offset=first.offset, nbytes=first.nbytes,
                                           errno_=first.errno)
    else:
        err = cls(message)
    err.rank = first.rank
    err.failures = {r.rank: r.message for r in failed}
    return err


def _class_for(exc: BaseException) -> type[CpuckptError]:
    if isinstance(exc, CpuckptError):
        return type(exc) if type(exc).__name__ in _CLASSES else _nearest(type(exc))
    if isinstance(exc, TimeoutError):
        return CheckpointTimeoutError
    if isinstance(exc, OSError):
        return StorageIOError
    return CpuckptError


def _nearest(cls: type) -> type[CpuckptError]:
    for base in cls.__mro__:
        if base.__name__ in _CLASSES and _CLASSES[base.__name__] is base:
            return base
    return CpuckptError


def _path_of(exc: BaseException) -> str | None:
    path = getattr(exc, "path", None) or getattr(exc, "filename", None)
    return None if path is None else str(path)


def _short(message: str, limit: int = 200) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


_CLASSES: dict[str, type[CpuckptError]] = {
    c.__name__: c
    for c in (CpuckptError, ConfigError, StorageIOError, IntegrityError, CheckpointCorrupt, UnsafeCheckpointError,
              StagingError, CheckpointTimeoutError, RamRootError)
}
