"""Processes of this host: whether a pid is alive, and which host this is. Base layer (no torch), shared by roots,
the RAM root and run files."""

from __future__ import annotations

import hashlib
import os
import socket

__all__ = ["host_tag", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with that pid exists (one we may not signal counts as alive).

    0 and negative pids name process groups for ``kill``, never one process: not alive.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_tag() -> str:
    """This host in a file name: the first 12 hex digits of the sha256 of its hostname.

    A digest, not the name: a hostname may hold dashes and dots and run to 253 characters, a field of a name
    parsed from its left needs a fixed shape. A pid recorded with another host's tag says nothing about this
    host's processes.
    """
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]
