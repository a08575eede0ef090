"""Checkpoint paths given by a user: local paths, and ``s3://bucket/prefix`` URLs where supported. Base layer
(no torch, no I/O).

Every entry point that takes a path or a root passes it through :func:`local_path` (local only) or
:func:`checkpoint_path` (local or ``s3://``). Another URL scheme is refused with a :class:`ConfigError`:
without that check ``"gs://bucket/run"`` would silently become the local directory ``gs:/bucket/run`` under
the working directory, and ``find_latest`` would report it as if it were remote.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from .errors import ConfigError

__all__ = ["S3Url", "checkpoint_path", "is_s3", "local_path"]

# "scheme://", and "scheme:/" too: pathlib.Path("s3://b/x") collapses the slashes to "s3:/b/x".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")
# S3's rules for bucket names (3-63 lower-case letters, digits, dots, hyphens), checked so a typo fails here.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Url:
    """``s3://bucket/key``: a checkpoint (the key is its prefix, without a trailing slash) or one object of it.

    ``url / "name"`` is the object ``name`` under it, as ``Path / "name"`` is for a directory.
    """

    bucket: str
    key: str

    @classmethod
    def parse(cls, text: str, what: str = "checkpoint path") -> S3Url:
        """Raises :class:`ConfigError` naming ``what`` for a malformed URL (no bucket, a bad bucket name)."""
        if not text.startswith("s3://"):
            raise ConfigError(f"{what} {text!r} is not an s3:// URL")
        bucket, _, key = text[len("s3://"):].partition("/")
        if not _BUCKET.match(bucket):
            raise ConfigError(f"{what} {text!r}: {bucket!r} is not a valid S3 bucket name")
        parts = [p for p in key.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ConfigError(f"{what} {text!r}: '.' and '..' are not allowed in an S3 key")
        return cls(bucket, "/".join(parts))

    def __truediv__(self, name: str) -> S3Url:
        rel = str(PurePosixPath(name))
        return S3Url(self.bucket, f"{self.key}/{rel}" if self.key else rel)

    @property
    def contents(self) -> S3Url:
        """The listing prefix of the objects under it: ``key/``, or ``""`` for a bucket (never ``"/"``)."""
        return S3Url(self.bucket, f"{self.key}/" if self.key else "")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Url:
        return S3Url(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __fspath__(self) -> str:  # lets error messages and logs that call os.fspath name it
        return str(self)


def _text(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return os.fsdecode(text) if isinstance(text, bytes) else text


def is_s3(path: str | os.PathLike | S3Url) -> bool:
    """True for an ``s3://`` URL (a string, or an :class:`S3Url`)."""
    return isinstance(path, S3Url) or _text(path).startswith("s3://")


def local_path(path: str | os.PathLike, what: str = "checkpoint path") -> str:
    """Return ``path`` as a string, or raise :class:`ConfigError` when it is a URL (``scheme://...``)."""
    text = _text(path)
    m = _SCHEME.match(text)
    if m is not None:
        supported = " (s3:// works for save, load, async_save, StorageWriter and StorageReader)" \
            if m.group(1) == "s3" else ""
        raise ConfigError(f"{what} {text!r}: URLs ({m.group(1)}://) are not supported here{supported}; give a "
                          f"local directory (a mounted file system works)")
    return text


def checkpoint_path(path: str | os.PathLike | S3Url, what: str = "checkpoint path") -> str | S3Url:
    """A local path as a string, or an ``s3://`` URL as an :class:`S3Url`; any other URL is refused.

    Raises:
        ConfigError: another scheme, or a malformed ``s3://`` URL, naming ``what``.
    """
    if isinstance(path, S3Url):
        return path
    text = _text(path)
    if text.startswith("s3://"):
        return S3Url.parse(text, what)
    return local_path(text, what)
