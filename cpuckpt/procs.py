"""Processes of this host: whether a pid is alive. Base layer (no torch), shared by roots and the RAM root."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
