"""Processes of this host: whether a pid is alive, which host this is, and which pid namespace this process is in.
Base layer (no torch), shared by roots, the RAM root and run files."""

from __future__ import annotations

import hashlib
import os
import socket

__all__ = ["host_tag", "pid_alive", "pid_ns_tag"]


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with that pid exists (one we may not signal counts as alive).

    A pid names a process only in its own pid namespace (:func:`pid_ns_tag`): the answer is about the caller's.

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


PID_NS_PATH = "/proc/self/ns/pid"


def pid_ns_tag() -> str | None:
    """This process's pid namespace in a file name: the inode number of ``/proc/self/ns/pid`` in hex; None where
    it cannot be read (no procfs, a sandbox hiding it).

    Containers on one kernel may share the hostname and the boot id (host network, host IPC, one ``/dev/shm``)
    yet each count pids in its own namespace: a pid says something only to a process of the namespace that
    recorded it. An inode number is unique on its boot only, so it means something only next to the boot id.
    Read anew at each call: a process forked after ``unshare(CLONE_NEWPID)`` is in another namespace than its
    parent.
    """
    try:
        return format(os.stat(PID_NS_PATH).st_ino, "x")
    except OSError:
        return None
