"""The exception hierarchy of cpuckpt. Every error also inherits the matching builtin."""

from __future__ import annotations

__all__ = [
    "CheckpointCorrupt",
    "CheckpointTimeoutError",
    "ConfigError",
    "CpuckptError",
    "IntegrityError",
    "StagingError",
    "StorageIOError",
]


class CpuckptError(Exception):
    """Root of every cpuckpt error (an ``Exception``, unlike DCP's ``CheckpointException``)."""


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
        # Errors cross ranks pickled (DCP gathers them): keep errno, path, offset and length.
        return (_rebuild_storage_io_error, (self.args[0], self.path, self.offset, self.nbytes, self.errno))


def _rebuild_storage_io_error(message: str, path: str | None, offset: int | None, nbytes: int | None,
                              errno_: int | None) -> StorageIOError:
    return StorageIOError(message, path=path, offset=offset, nbytes=nbytes, errno_=errno_)


class IntegrityError(CpuckptError):
    """A checkpoint is incomplete or damaged: checksum, size or commit marker is wrong."""


class CheckpointCorrupt(IntegrityError):
    """Loaded bytes do not match what was written (names the file and byte offset)."""


class StagingError(CpuckptError, RuntimeError):
    """Copying tensors into host memory failed (device error, pool exhausted, ...)."""


class CheckpointTimeoutError(CpuckptError, TimeoutError):
    """A bounded wait (writer threads, pool lease, peer ranks) ran out."""
