"""Per-process files in a shared directory (``/dev/shm``), named so that anyone can tell when their owner is gone.

Base layer (no torch). A process that leaves small liveness or channel files next to other users'
files (the Megatron adapter's ``.status``/``.alive``/``.worker`` files) names them

    ``cpuckpt-<tag>-p<pid>-b<boot>-h<host>-n<pidns>-<rest>``

``pid`` is the owning process, ``boot`` the first 12 hex digits of ``/proc/sys/kernel/random/boot_id``,
``host`` :func:`cpuckpt.procs.host_tag` (a digest of the hostname), ``pidns`` :func:`cpuckpt.procs.pid_ns_tag`
(the pid namespace's inode number in hex; left out, ``-n`` and all, where ``/proc/self/ns/pid`` cannot be read).
An owner killed with SIGKILL cannot remove its files; the next run (:func:`clean_stale`, called by whoever creates
such files) and ``cpuckpt clean --ram`` remove those whose owner is gone. A pid is asked about only where it means
something: boot, host and pid namespace all recorded and all this process's (containers on one node may share
the hostname, the boot and ``/dev/shm`` yet count pids apart; nodes may share a hostname and a directory). A file
of this host and another boot is an earlier boot's (its owner ended with it) only when it was last modified before
this boot started (``btime`` of ``/proc/stat``, less :data:`BOOT_MARGIN_S`); every other file whose owner cannot
be asked here (another host's, another pid namespace's, one of another boot modified since this boot started, a
name of an older cpuckpt: ``cpuckpt-<tag>-p<pid>-b<boot>[-h<host>]-<rest>``, no namespace) is removed only once
untouched for ``min_age_s``. cpuckpt itself needs to know nothing about the tag.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from cpuckpt.procs import host_tag, pid_alive, pid_ns_tag

__all__ = ["BOOT_MARGIN_S", "FOREIGN_MIN_AGE_S", "Here", "RunFile", "boot_tag", "boot_time", "clean_stale", "parse",
           "run_dir", "run_file_base"]

logger = logging.getLogger(__name__)

PREFIX = "cpuckpt-"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
PROC_STAT_PATH = Path("/proc/stat")
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^cpuckpt-(?P<tag>[a-z0-9][a-z0-9-]*?)-p(?P<pid>\d+)-b(?P<boot>[0-9a-f]{12}|noboot)"
                      r"(?:-h(?P<host>[0-9a-f]{12})(?:-n(?P<pidns>[0-9a-f]{1,16}))?)?(?:[-.]|$)")
_TAG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
# A file whose owner cannot be asked here (another host's, another pid namespace's, another boot's modified since
# this boot started) goes once untouched this long: a guess, so a long one (no save holds its channel files for a
# day; the Megatron caller's .alive beats every second).
FOREIGN_MIN_AGE_S = 24 * 3600.0
# A file of this host's tag and another boot counts as an earlier boot's only when last modified this long before
# this boot's start: btime is whole seconds, derived from the wall clock, which may be stepped after boot.
BOOT_MARGIN_S = 60.0


def boot_tag() -> str:
    """This boot's tag: the first 12 hex digits of the kernel's boot id (``noboot`` without procfs)."""
    try:
        text = BOOT_ID_PATH.read_text().strip().replace("-", "").lower()
    except OSError:
        return "noboot"
    return text[:12] if re.fullmatch(r"[0-9a-f]{12,}", text) else "noboot"


def boot_time() -> float | None:
    """When this boot started (unix seconds, ``btime`` of ``/proc/stat``); None without it."""
    try:
        text = PROC_STAT_PATH.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "btime":
            try:
                return float(value.strip())
            except ValueError:
                return None
    return None


class Here(NamedTuple):
    """Where a run file is judged: this process's boot, host, pid namespace (None: unreadable), and the time
    its boot started (None: unknown)."""

    boot: str
    host: str
    pidns: str | None
    btime: float | None

    @classmethod
    def now(cls) -> Here:
        return cls(boot_tag(), host_tag(), pid_ns_tag(), boot_time())


def run_dir() -> Path:
    """``/dev/shm`` where it is writable, else the temp directory."""
    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return Path(tempfile.gettempdir())


def run_file_base(tag: str, extra: str = "", directory: str | os.PathLike | None = None) -> str:
    """A fresh path prefix ``<dir>/cpuckpt-<tag>-p<pid>-b<boot>-h<host>-n<pidns>-[<extra>-]<uuid12>`` owned by
    this process (no ``-n<pidns>`` where the pid namespace cannot be read: its pid is then never asked about)."""
    if not _TAG_RE.match(tag):
        raise ValueError(f"run file tag {tag!r}: lowercase letters, digits and dashes only")
    where = Path(directory) if directory is not None else run_dir()
    middle = f"{extra}-" if extra else ""
    pidns = pid_ns_tag()
    owner = f"p{os.getpid()}-b{boot_tag()}-h{host_tag()}" + (f"-n{pidns}" if pidns is not None else "")
    return str(where / f"{PREFIX}{tag}-{owner}-{middle}{uuid.uuid4().hex[:12]}")


class RunFile:
    """What a run file's name says about its owner (``host`` None: a name of an older cpuckpt, no host recorded;
    ``pidns`` None: no pid namespace recorded, an older cpuckpt's name or an unreadable ``/proc/self/ns/pid``)."""

    def __init__(self, name: str, tag: str, pid: int, boot: str, host: str | None = None,
                 pidns: str | None = None) -> None:
        self.name, self.tag, self.pid, self.boot, self.host, self.pidns = name, tag, pid, boot, host, pidns

    def owner_alive(self, mtime: float | None = None, here: Here | None = None) -> bool | None:
        """Whether the owner runs: False when it surely does not, None when this process cannot tell.

        ``mtime``: the file's modification time (unix s); ``here``: where it is judged (default :meth:`Here.now`).
        Its pid is asked about (alive, or gone or a zombie) only when the boot, host and pid namespace it records
        are all ``here``'s. A file of ``here``'s host and another boot is an earlier boot's, its owner gone, when
        ``mtime`` is before ``here.btime`` less :data:`BOOT_MARGIN_S`. Anything else is None: another host's;
        another pid namespace's, or one not recorded (an older name) or not readable here; another boot's
        modified since this boot started (a node of the same hostname sharing the directory), or without an
        ``mtime`` or a boot time to compare; an older name (no host) of another boot.
        """
        here = Here.now() if here is None else here
        if self.host is not None and self.host != here.host:
            return None
        if self.boot != here.boot:
            if (self.host is None or "noboot" in (self.boot, here.boot) or mtime is None or here.btime is None
                    or mtime >= here.btime - BOOT_MARGIN_S):
                return None
            return False
        if self.pidns is None or self.pidns != here.pidns:
            return None
        return _running(self.pid)

    def owner_gone(self, mtime: float | None = None, here: Here | None = None) -> bool:
        """True when the owner surely cannot be running (:meth:`owner_alive` is False)."""
        return self.owner_alive(mtime, here) is False


def parse(name: str) -> RunFile | None:
    """The owner recorded in a run file's name; None for any other name."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return RunFile(name, m.group("tag"), int(m.group("pid")), m.group("boot"), m.group("host"), m.group("pidns"))


def _running(pid: int) -> bool:
    """:func:`~cpuckpt.procs.pid_alive`, and not a zombie (a killed owner whose parent has not reaped it). The
    zombie test reads ``/proc/<pid>/stat`` only where ``/proc`` is this pid namespace's (``/proc/self`` is this
    pid): a ``/proc`` of another namespace would show another process under that number."""
    if not pid_alive(pid):
        return False
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return True
    except OSError:
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return True
    return not fields or fields[0] not in ("Z", "X")


def clean_stale(directory: str | os.PathLike | None = None, *, dry_run: bool = False,
                uid: int | None = None, min_age_s: float = FOREIGN_MIN_AGE_S) -> list[Path]:
    """Remove the run files in ``directory`` (default :func:`run_dir`) whose owner is gone; returns them.

    Only regular files of ``uid`` (default: this user) that match the run file name are touched:
    never a directory, a symlink, or another user's file (the directory is shared, sticky /dev/shm).
    A file whose owner this process cannot ask (:meth:`RunFile.owner_alive` None: another host's, another pid
    namespace's, another boot's modified since this boot started, an older name) goes only once untouched for
    ``min_age_s``: a pid check here says nothing about it.
    """
    where = Path(directory) if directory is not None else run_dir()
    uid = os.geteuid() if uid is None else uid
    here = Here.now()
    try:
        names = sorted(os.listdir(where))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        info = parse(name)
        if info is None:
            continue
        path = where / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        alive = info.owner_alive(st.st_mtime, here)
        if alive:
            continue
        age_s = time.time() - st.st_mtime
        if alive is None and age_s < min_age_s:
            continue
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if alive is None:
                logger.info("removed stale %s (its owner cannot be asked here, untouched for %.0f s)", path, age_s)
            elif info.boot != here.boot:
                logger.info("removed stale %s (written on an earlier boot of this host: modified before this boot "
                            "started)", path)
            else:
                logger.info("removed stale %s (owner pid %d gone)", path, info.pid)
        removed.append(path)
    return removed
