"""Checkpoint paths given by a user: local paths only, until a URL scheme is supported. Base layer (no torch)."""

from __future__ import annotations

import os
import re

from .errors import ConfigError

__all__ = ["local_path"]

# "scheme://", and "scheme:/" too: pathlib.Path("s3://b/x") collapses the slashes to "s3:/b/x".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def local_path(path: str | os.PathLike, what: str = "checkpoint path") -> str:
    """Return ``path`` as a string, or raise :class:`ConfigError` when it is a URL (``scheme://...``).

    Without this check ``"s3://bucket/run"`` would silently become the local directory ``s3:/bucket/run``
    under the working directory, and ``find_latest`` would report it as if it were remote.
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    m = _SCHEME.match(text)
    if m is not None:
        raise ConfigError(f"{what} {text!r}: URLs ({m.group(1)}://) are not supported; give a local directory "
                          f"(a mounted file system works)")
    return text
