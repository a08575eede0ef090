"""Per-process files in a shared directory (``/dev/shm``), named so that anyone can tell when their owner is gone.

Base layer (no torch). A process that leaves small liveness or channel files next to other users'
files (the Megatron adapter's ``.status``/``.alive``/``.worker`` files) names them

    ``cpuckpt-<tag>-p<pid>-b<boot>-h<host>-<rest>``

``pid`` is the owning process, ``boot`` the first 12 hex digits of ``/proc/sys/kernel/random/boot_id``,
``host`` :func:`cpuckpt.procs.host_tag` (a digest of the hostname). An owner killed with SIGKILL cannot remove
its files; the next run (:func:`clean_stale`, called by whoever creates such files) and ``cpuckpt clean --ram``
remove every file of this shape whose owner is gone: one of this host whose pid no longer runs on this boot, or
that this host wrote on an earlier boot. A pid is only asked about on the host and boot that recorded it: a file
of another host (a shared directory, another container's hostname on the same kernel) is removed only once
untouched for ``min_age_s``, and so is a name of an older cpuckpt (``cpuckpt-<tag>-p<pid>-b<boot>-<rest>``, no
host) of another boot, which may come from another node. cpuckpt itself needs to know nothing about the tag.
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

from cpuckpt.procs import host_tag, pid_alive

__all__ = ["FOREIGN_MIN_AGE_S", "RunFile", "boot_tag", "clean_stale", "parse", "run_dir", "run_file_base"]

logger = logging.getLogger(__name__)

PREFIX = "cpuckpt-"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^cpuckpt-(?P<tag>[a-z0-9][a-z0-9-]*?)-p(?P<pid>\d+)-b(?P<boot>[0-9a-f]{12}|noboot)"
                      r"(?:-h(?P<host>[0-9a-f]{12}))?(?:[-.]|$)")
_TAG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
# A file whose owner this host cannot ask (another host's pid) goes once untouched this long: a guess, so a long
# one (no save holds its channel files for a day; the Megatron caller's .alive beats every second).
FOREIGN_MIN_AGE_S = 24 * 3600.0


def boot_tag() -> str:
    """This boot's tag: the first 12 hex digits of the kernel's boot id (``noboot`` without procfs)."""
    try:
        text = BOOT_ID_PATH.read_text().strip().replace("-", "").lower()
    except OSError:
        return "noboot"
    return text[:12] if re.fullmatch(r"[0-9a-f]{12,}", text) else "noboot"


def run_dir() -> Path:
    """``/dev/shm`` where it is writable, else the temp directory."""
    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return Path(tempfile.gettempdir())


def run_file_base(tag: str, extra: str = "", directory: str | os.PathLike | None = None) -> str:
    """A fresh path prefix ``<dir>/cpuckpt-<tag>-p<pid>-b<boot>-h<host>-[<extra>-]<uuid12>`` owned by this
    process."""
    if not _TAG_RE.match(tag):
        raise ValueError(f"run file tag {tag!r}: lowercase letters, digits and dashes only")
    where = Path(directory) if directory is not None else run_dir()
    middle = f"{extra}-" if extra else ""
    return str(where / f"{PREFIX}{tag}-p{os.getpid()}-b{boot_tag()}-h{host_tag()}-{middle}{uuid.uuid4().hex[:12]}")


class RunFile:
    """What a run file's name says about its owner (``host`` None: a name of an older cpuckpt, no host recorded)."""

    def __init__(self, name: str, tag: str, pid: int, boot: str, host: str | None = None) -> None:
        self.name, self.tag, self.pid, self.boot, self.host = name, tag, pid, boot, host

    def owner_alive(self, boot: str | None = None, host: str | None = None) -> bool | None:
        """Whether the owner runs: False when it cannot (this host's pid gone or a zombie, or this host's earlier
        boot); None when this host cannot tell (another host's pid, or no host recorded and another boot's)."""
        boot = boot_tag() if boot is None else boot
        host = host_tag() if host is None else host
        if self.host is not None and self.host != host:
            return None
        if self.boot != boot:
            return False if self.host is not None else None
        return _running(self.pid)

    def owner_gone(self, boot: str | None = None, host: str | None = None) -> bool:
        """True when the owner surely cannot be running (:meth:`owner_alive` is False)."""
        return self.owner_alive(boot, host) is False


def parse(name: str) -> RunFile | None:
    """The owner recorded in a run file's name; None for any other name."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return RunFile(name, m.group("tag"), int(m.group("pid")), m.group("boot"), m.group("host"))


def _running(pid: int) -> bool:
    """:func:`~cpuckpt.procs.pid_alive`, and not a zombie (a killed owner whose parent has not reaped it)."""
    if not pid_alive(pid):
        return False
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
    A file whose owner this host cannot ask (:meth:`RunFile.owner_alive` None: another host's) goes only once
    untouched for ``min_age_s``: a local pid check says nothing about it.
    """
    where = Path(directory) if directory is not None else run_dir()
    uid = os.geteuid() if uid is None else uid
    boot, host = boot_tag(), host_tag()
    try:
        names = sorted(os.listdir(where))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        info = parse(name)
        if info is None:
            continue
        alive = info.owner_alive(boot, host)
        if alive:
            continue
        path = where / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        age_s = time.time() - st.st_mtime
        if alive is None and age_s < min_age_s:
            continue
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if alive is None:
                logger.info("removed stale %s (its owner cannot be asked here, untouched for %.0f s)", path, age_s)
            else:
                logger.info("removed stale %s (owner pid %d gone)", path, info.pid)
        removed.append(path)
    return removed
