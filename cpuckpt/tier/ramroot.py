"""The RAM root of the memory tier: its identity, who may use it, and whether it has room.

A *RAM root* is a private directory on a node-local RAM filesystem (default
``/dev/shm/cpuckpt-<uid>/<job>``) that the trainer ranks of one job on one node share. It holds:

- ``.owner.json``: the :class:`Owner` record (job, uid, host, boot id), so that a root is never
  used by another job or user, and a root that outlived its boot or host is recognised as stale;
- ``.rank-<r>.lock``: flocked by the live trainer of rank ``r`` (at most one per rank);
- ``.writer-<r>.lock``: flocked by the live writer process of rank ``r`` (see :func:`acquire_lock`);
- ``.open.lock``: serialises :meth:`RamRoot.open`, :meth:`RamRoot.remove` and :func:`clean_ram_roots`;
- the image files of the memory tier (not this module's business).

Liveness is "is the flock held", never "does the pid exist": a flock dies with the last descriptor
of its holder, so a crashed process never leaves a lock behind, and pid reuse cannot fool it. A lock
file also holds its holder's pid, only to name it in messages. Note: a child forked (without exec)
while the trainer holds its rank lock inherits the lock's descriptor and keeps the lock held; spawn
writer processes with ``spawn``/``forkserver`` or ``subprocess`` (descriptors here are close-on-exec).

Safety: a root and (for the default location) its ``cpuckpt-<uid>`` parent must be real
directories (never symlinks: /dev/shm is world-writable, anyone can plant one), owned by the user,
with no group or other permission bits. Files inside are opened with ``O_NOFOLLOW``. No torch here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import weakref
from pathlib import Path

from cpuckpt.errors import ConfigError, RamRootError
from cpuckpt.procs import pid_alive

__all__ = [
    "TINY_BYTES",
    "Owner",
    "RamRoot",
    "RamRootError",
    "acquire_lock",
    "clean_ram_roots",
    "default_root",
    "durable_name",
    "job_id_for",
    "lock_holder",
    "require_free",
]

logger = logging.getLogger(__name__)

TINY_BYTES = 256 * 1024**2  # a RAM filesystem smaller than this is "tiny" (containers mount 64 MiB /dev/shm)

# Module-level so that tests can point them elsewhere.
SHM_DIR = Path("/dev/shm")
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
CGROUP_DIR = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

OWNER_NAME = ".owner.json"
OPEN_LOCK_NAME = ".open.lock"
_LOCK_RE = re.compile(r"^\.(rank|writer)-(\d+)\.lock$")
_SAFE_JOB = re.compile(r"^[A-Za-z0-9._-]{1,100}$")

_ACQUIRE_WAIT_S = 0.25  # a concurrent liveness probe holds a lock for microseconds; ride over it
_OPEN_LOCK_WAIT_S = 10.0  # opens of other ranks hold .open.lock for milliseconds
_OWNER_READ_WAIT_S = 1.0  # a creator writes the record right after O_EXCL; give it time
_POLL_S = 0.02
_OPEN_ATTEMPTS = 5  # the root vanished under us (cleaned concurrently): start over this often


# ------------------------------------------------------------------------------------------ naming


def _safe_name(name: str) -> str:
    """``name`` if it is a plain file name, else a sanitised prefix plus a hash that keeps it unique."""
    if _SAFE_JOB.match(name) and name not in (".", ".."):
        return name
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64].lstrip(".") or "job"
    return f"{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def default_root(job: str, *, uid: int | None = None) -> Path:
    """``/dev/shm/cpuckpt-<uid>/<job>`` (job made file-name safe); under the temp dir where /dev/shm is absent.

    Creates nothing. The per-user parent keeps users apart: nobody else can create or rename
    anything in it, so nothing below it can be swapped for a symlink.
    """
    if not job:
        raise ConfigError("the memory tier needs a job id (memory.job, or one derived from the durable root)")
    uid = os.geteuid() if uid is None else uid
    base = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    return base / f"cpuckpt-{uid}" / _safe_name(job)


def _default_base(uid: int) -> Path:
    return default_root("x", uid=uid).parent


def _path_text(durable_root: str | os.PathLike) -> str:
    text = os.fspath(durable_root)
    return os.fsdecode(text) if isinstance(text, bytes) else text


def durable_name(durable_root: str | os.PathLike) -> str:
    """``durable_root`` as a RAM root's owner record names it: the directory itself, symlinks resolved (a relaunch
    may reach it by another path; a link pointed at another experiment since names another root), or a URL as it
    is."""
    text = _path_text(durable_root)
    return text.rstrip("/") if "://" in text else os.path.realpath(text)


def job_id_for(durable_root: str | os.PathLike) -> str:
    """A job id that is the same on every restart of a job that saves to ``durable_root``.

    ``<basename>-<first 12 hex digits of sha256 of the absolute path>``; URLs (``s3://...``) are
    taken as they are.
    """
    text = _path_text(durable_root)
    full = text.rstrip("/") if "://" in text else os.path.abspath(text)  # the path as given: ids of old roots stay
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(full))[:64].lstrip(".") or "root"
    return f"{base}-{hashlib.sha256(full.encode()).hexdigest()[:12]}"


# ------------------------------------------------------------------------------------------- locks


def _private_file(fd: int) -> int:
    """Make a file we just opened with mode 0600 have that mode whatever the umask; returns ``fd``."""
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _locked_fd(path: str | os.PathLike, dir_fd: int | None, wait_s: float) -> int | None:
    """Open ``path`` (created 0600) and flock it exclusively, retrying for ``wait_s``; None if still held."""
    fd = _private_file(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise


def acquire_lock(path: str | os.PathLike, *, dir_fd: int | None = None, wait_s: float = _ACQUIRE_WAIT_S) -> int | None:
    """Flock ``path`` exclusively (creating it 0600) and write our pid in it; the fd, or None if held.

    Keep the fd open as long as the lock must hold (closing it, or the process ending, releases it).
    Retries for ``wait_s``: a liveness probe of another process holds the lock for an instant.
    The writer process takes its ``.writer-<rank>.lock`` with this.
    """
    fd = _locked_fd(path, dir_fd, wait_s)
    if fd is None:
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_holder(path: str | os.PathLike, *, dir_fd: int | None = None) -> int | None:
    """The pid of the process holding the flock on ``path``; None when nobody holds it.

    Probes with a shared non-blocking flock from a fresh open file description (so it also sees a
    lock held by this very process through another descriptor) and releases it at once; shared,
    so that two concurrent probes never mistake each other for a holder. Returns -1 when the lock
    is held but its holder has not written a readable pid (yet).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        # Held. Its holder writes its pid right after locking; a stale pid may be there an instant.
        pid = None
        for _ in range(5):
            pid = _read_pid(fd)
            if pid is not None and pid_alive(pid):
                return pid
            time.sleep(_POLL_S)
        return pid if pid is not None else -1
    finally:
        os.close(fd)


def _held_locks(dir_fd: int) -> dict[str, int]:
    """``{lock file name: holder pid}`` of every trainer and writer lock held in the root."""
    held = {}
    for name in sorted(os.listdir(dir_fd)):
        if _LOCK_RE.match(name):
            with contextlib.suppress(OSError):  # vanished, or a planted symlink (ELOOP): not a lock
                pid = lock_holder(name, dir_fd=dir_fd)
                if pid is not None:
                    held[name] = pid
    return held


def _describe_held(held: dict[str, int]) -> str:
    return ", ".join(f"{name} by pid {pid}" if pid > 0 else f"{name} by an unknown process"
                     for name, pid in held.items())


# ------------------------------------------------------------------------------------- directories


def _check_dir(path: Path, uid: int, what: str) -> os.stat_result:
    """Refuse unless ``path`` is a real directory of ``uid`` that no one else can write or read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise RamRootError(f"{what} {path} does not exist; create it or set memory.root to another directory",
                           path=path) from e
    except OSError as e:
        raise RamRootError(f"cannot inspect {what} {path}: {e}; fix its permissions or set memory.root",
                           path=path) from e
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        raise RamRootError(
            f"{what} {path} is a symlink (to {target}); cpuckpt never follows symlinks there (anyone can "
            f"plant one in a shared /dev/shm): remove it, or set memory.root to the real directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        raise RamRootError(f"{what} {path} exists and is not a directory; remove it or set memory.root "
                           f"to another directory", path=path)
    if st.st_uid != uid:
        raise RamRootError(
            f"{what} {path} is owned by uid {st.st_uid}, not by uid {uid}; cpuckpt never uses another user's "
            f"RAM root: set memory.root (or memory.job) to a directory of your own", path=path)
    if st.st_mode & 0o077:
        raise RamRootError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}: group or others may access it; cpuckpt "
            f"uses only private RAM roots: check its contents and `chmod 700 {path}`, or remove it", path=path)
    return st


def _mkdir_private(path: Path) -> bool:
    """Create ``path`` with mode 0700 whatever the umask; True when this call created it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    except OSError as e:
        raise RamRootError(f"cannot create the RAM root directory {path}: {e}; fix the permissions of "
                           f"{path.parent} or set memory.root to another directory", path=path) from e
    os.chmod(path, 0o700, follow_symlinks=False)  # the umask may have removed owner bits
    return True


def _open_dir(path: Path, uid: int, what: str) -> int:
    """An fd of the checked directory (opened without following symlinks, re-checked through the fd)."""
    st = _check_dir(path, uid, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RamRootError(f"cannot open {what} {path}: {e}; it changed while being checked, or set "
                           f"memory.root to another directory", path=path) from e
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise RamRootError(f"{what} {path} was replaced while being checked; find out what replaces it, "
                           f"or set memory.root to another directory", path=path)
    return fd


def _same_file(path: str, dir_fd: int, fd: int) -> bool:
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _root_still_there(path: Path, dir_fd: int) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(dir_fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _take_open_lock(path: Path, dir_fd: int, wait_s: float) -> int | None:
    """Flock the root's ``.open.lock``; None when the root was removed meanwhile (start over)."""
    fd = _locked_fd(OPEN_LOCK_NAME, dir_fd, wait_s)
    if fd is None:
        raise RamRootError(
            f"RAM root {path}: {path / OPEN_LOCK_NAME} stayed locked for {wait_s:.0f} s (another "
            f"process is opening, cleaning or removing this root and hangs); find it with "
            f"`fuser {path / OPEN_LOCK_NAME}` and stop it", path=path)
    if _same_file(OPEN_LOCK_NAME, dir_fd, fd) and _root_still_there(path, dir_fd):
        return fd
    os.close(fd)
    return None


# ------------------------------------------------------------------------------------------- owner


@dataclasses.dataclass(frozen=True)
class Owner:
    """Contents of ``<root>/.owner.json``: whose root this is, and on which boot of which host."""

    job: str
    uid: int
    host: str
    boot_id: str
    created_unix: float
    # the durable root of the tier that made it (:func:`durable_name`; "": not recorded, an older record): two jobs
    # given one memory.job must not resume from each other's checkpoints
    durable: str = ""

    def to_json(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> Owner:
        """Parse a record; ValueError when it is not a complete one (a creator may still be writing)."""
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        types = {"job": str, "uid": int, "host": str, "boot_id": str, "created_unix": (int, float)}
        for key, kind in types.items():
            if not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
                raise ValueError(f"field {key!r} missing or of the wrong type")
        durable = obj.get("durable", "")
        if not isinstance(durable, str):
            raise ValueError("field 'durable' of the wrong type")
        return cls(job=obj["job"], uid=obj["uid"], host=obj["host"], boot_id=obj["boot_id"],
                   created_unix=float(obj["created_unix"]), durable=durable)

    @classmethod
    def current(cls, job: str, uid: int, durable: str = "") -> Owner:
        return cls(job=job, uid=uid, host=socket.gethostname(), boot_id=_boot_id(), created_unix=time.time(),
                   durable=durable)


def _boot_id() -> str:
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _read_owner(path: Path, dir_fd: int) -> tuple[Owner | None, str]:
    """The record, or (None, why) if it stays incomplete for ~1 s (its creator died while writing it)."""
    deadline = time.monotonic() + _OWNER_READ_WAIT_S
    while True:
        try:
            fd = os.open(OWNER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None, "it is missing"
        except OSError as e:
            raise RamRootError(f"cannot read {path / OWNER_NAME}: {e}; remove it (or the whole RAM root "
                               f"{path}) if no job uses it", path=path) from e
        try:
            data = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        try:
            return Owner.from_json(data), ""
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            why = f"it is not a valid owner record ({e})"
        if time.monotonic() >= deadline:
            return None, why
        time.sleep(_POLL_S)


def _replace_owner(dir_fd: int, owner: Owner) -> None:
    """Rewrite the record atomically (write a temporary file, fsync, rename, fsync the directory)."""
    tmp = OWNER_NAME + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = _private_file(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                               dir_fd=dir_fd))
    try:
        _write_fd(fd, owner.to_json())
    finally:
        os.close(fd)
    os.replace(tmp, OWNER_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _claim_owner(path: Path, dir_fd: int, job: str, uid: int, durable: str) -> Owner:
    """Create the owner record, or accept/take over/refuse the one there (caller holds .open.lock)."""
    now = Owner.current(job, uid, durable)
    try:
        fd = _private_file(os.open(OWNER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   0o600, dir_fd=dir_fd))
    except FileExistsError:
        pass
    else:
        try:
            _write_fd(fd, now.to_json())
        finally:
            os.close(fd)
        os.fsync(dir_fd)
        return now
    record, why = _read_owner(path, dir_fd)
    if record is not None and (record.job != job or record.uid != uid):
        raise RamRootError(
            f"RAM root {path} belongs to job {record.job!r} of uid {record.uid} (see {path / OWNER_NAME}), not "
            f"to job {job!r} of uid {uid}; set memory.job or memory.root so that each job has its own root, or, "
            f"if job {record.job!r} is over, remove it with `cpuckpt clean`", path=path)
    if record is not None and durable and record.durable and record.durable != durable:
        raise RamRootError(
            f"RAM root {path} of job {job!r} holds the memory checkpoints of the durable root {record.durable} (see "
            f"{path / OWNER_NAME}), not of {durable}: two jobs were given one memory.job; give each its own "
            f"memory.job (or leave it unset: it is derived from the durable root) or memory.root, or, if the job of "
            f"{record.durable} is over, remove its RAM root with `cpuckpt clean`", path=path)
    if record is not None and record.boot_id == now.boot_id and record.host == now.host:
        if durable and not record.durable:  # a record of an earlier version: it names the durable root from now on
            record = dataclasses.replace(record, durable=durable)
            _replace_owner(dir_fd, record)
        return record
    if record is None:
        reason = f"its owner record {path / OWNER_NAME} is unusable: {why}"
    else:
        reason = (f"it was created on host {record.host!r} (boot {record.boot_id or '?'}), this is host "
                  f"{now.host!r} (boot {now.boot_id or '?'})")
    held = _held_locks(dir_fd)
    if held:
        raise RamRootError(
            f"RAM root {path}: {reason}, and locks in it are still held ({_describe_held(held)}); a RAM root "
            f"must not be shared across hosts or boots: give each host its own memory.root, or stop those "
            f"processes", path=path)
    logger.warning("RAM root %s: %s, and no process holds a lock in it: taking it over as stale", path, reason)
    _replace_owner(dir_fd, now)
    return now


# ------------------------------------------------------------------------------------------- space


def _human(n: int | float) -> str:
    """Bytes for people: ``64 MiB``, ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _space(path: Path) -> tuple[int, int]:
    """(total, free to us) bytes of the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise RamRootError(f"cannot statvfs the RAM root {path}: {e}; set memory.root to a usable directory",
                           path=path) from e
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def leaving_marker(writer_lock: Path) -> Path:
    """Beside a writer's lock: the pid of that writer once its work is done and it ends (it may still drain a replica
    transfer for a while, no longer serving its queue): a new trainer waits for it to end instead of adopting it."""
    return writer_lock.with_name(writer_lock.name + ".leaving")


def mark_leaving(writer_lock: Path) -> None:
    marker = leaving_marker(writer_lock)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, marker)  # whole or absent: a trainer never reads half a pid


def leaving_pid(writer_lock: Path) -> int | None:
    """The pid :func:`mark_leaving` wrote beside ``writer_lock``, or None."""
    try:
        return int(leaving_marker(writer_lock).read_text().strip())
    except (OSError, ValueError):
        return None


def require_free(path: Path, nbytes: int, *, already_reserved: int, headroom_bytes: int, what: str) -> None:
    """Refuse ``nbytes`` more RAM-root bytes for ``what`` (a replica's files, reserved by a writer process,
    which has no :class:`RamRoot`) unless ``headroom_bytes`` stay free: the same bound as
    :meth:`RamRoot.check_space`, so own slots plus replica slots never fill the node's RAM."""
    needed = max(0, nbytes - already_reserved)
    _, free = _space(path)
    if free - needed < headroom_bytes:
        raise RamRootError(
            f"RAM root {path}: {what} needs {_human(needed)} ({needed} bytes) more, the filesystem has "
            f"{_human(free)} free, and memory.headroom_bytes={_human(headroom_bytes)} must stay free: the node "
            f"holds (memory.slots + memory.replicas x memory.slots) x shard; lower memory.replicas or "
            f"memory.slots, or make the RAM filesystem larger", path=path)


def _cgroup_room() -> tuple[int, int] | None:
    """(limit, current) of the tightest cgroup v2 memory limit over this process; None when unlimited."""
    rel = "/"
    with contextlib.suppress(OSError):
        for line in PROC_SELF_CGROUP.read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip() or "/"
    leaf = CGROUP_DIR / rel.lstrip("/")
    dirs = [leaf, *leaf.parents] if leaf != CGROUP_DIR else [leaf]
    best: tuple[int, int] | None = None
    for d in dirs:
        try:
            limit_s = (d / "memory.max").read_text().strip()
            current = int((d / "memory.current").read_text().strip())
        except (OSError, ValueError):
            limit_s = ""
        if limit_s and limit_s != "max":
            with contextlib.suppress(ValueError):
                limit = int(limit_s)
                if best is None or limit - current < best[0] - best[1]:
                    best = (limit, current)
        if d == CGROUP_DIR:
            break
    return best


# ----------------------------------------------------------------------------------------- RamRoot


def _drop_in_child(ref: weakref.ref) -> None:
    root = ref()
    if root is not None and root._lock_fd is not None:
        fd, root._lock_fd = root._lock_fd, None
        with contextlib.suppress(OSError):
            os.close(fd)


class RamRoot:
    """One rank's handle on the RAM root of its job on this node; holds the rank's trainer lock."""

    def __init__(self, path: Path, job: str, rank: int, owner: Owner, lock_fd: int, *, uid: int,
                 headroom_bytes: int, fs_total: int, fs_free: int) -> None:
        self.path = path
        self.job = job
        self.rank = rank
        self.owner = owner
        self.uid = uid
        self.headroom_bytes = headroom_bytes
        self.fs_total = fs_total
        self.fs_free = fs_free
        self._lock_fd: int | None = lock_fd
        # A child forked without exec (DataLoader workers) must not keep the trainer's lock alive after the
        # trainer lets go: it drops its copy (the lock stays held through the parent's descriptor).
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _drop_in_child(me))

    def __repr__(self) -> str:
        return f"RamRoot({str(self.path)!r}, job={self.job!r}, rank={self.rank}, open={self._lock_fd is not None})"

    def __enter__(self) -> RamRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def open(cls, path: str | os.PathLike | None, job: str, rank: int, *, headroom_bytes: int = 1 << 30,
             uid: int | None = None, durable: str = "") -> RamRoot:
        """Create or join the RAM root of ``job`` and take rank ``rank``'s trainer lock in it; ``durable``
        (:func:`durable_name`) is the durable root of the tier opening it, recorded by the first.

        ``path`` None means :func:`default_root`. Refused (:class:`RamRootError`): a root (or its
        per-user parent) that is a symlink, not a directory, not ``uid``'s or open to group/others;
        a root of another job or user, or of another durable root; a root left by another boot or host while
        some lock in it is still held (without one it is taken over, with a warning); a tiny filesystem (< 256 MiB);
        rank ``rank`` already open in a live process.
        """
        if not job:
            raise ConfigError("the memory tier needs a job id (memory.job, or one derived from the durable root)")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"RamRoot.open: rank must be an int >= 0, got {rank!r}")
        uid = os.geteuid() if uid is None else uid
        private_parent = path is None
        root = default_root(job, uid=uid) if path is None else Path(os.path.abspath(os.fspath(path)))
        if private_parent and not str(root).startswith(str(SHM_DIR) + os.sep):
            logger.warning("%s does not exist: the RAM root falls back to %s, which may not be RAM; set "
                           "memory.root to a RAM filesystem", SHM_DIR, root)
        for _ in range(_OPEN_ATTEMPTS):
            opened = cls._try_open(root, job, rank, uid=uid, headroom_bytes=headroom_bytes,
                                   private_parent=private_parent, durable=durable)
            if opened is not None:
                return opened
        raise RamRootError(f"RAM root {root} was removed {_OPEN_ATTEMPTS} times while being opened; stop whatever "
                           f"removes it (a `cpuckpt clean` loop?) or set memory.root to another directory",
                           path=root)

    @classmethod
    def _try_open(cls, root: Path, job: str, rank: int, *, uid: int, headroom_bytes: int,
                  private_parent: bool, durable: str) -> RamRoot | None:
        if private_parent:
            _mkdir_private(root.parent)
            try:
                _check_dir(root.parent, uid, "the per-user RAM directory")
                created = _mkdir_private(root)
            except RamRootError:
                if not os.path.lexists(root.parent):
                    return None  # another job's removal took the empty per-user directory just now: again
                raise
        else:
            try:
                os.makedirs(root.parent, mode=0o700, exist_ok=True)
            except OSError as e:
                raise RamRootError(f"cannot create the parent directories of the RAM root {root}: {e}; create "
                                   f"them or set memory.root to another directory", path=root) from e
            created = _mkdir_private(root)
        dir_fd = _open_dir(root, uid, "RAM root")
        try:
            total, free = _space(root)
            if total < TINY_BYTES:
                if created:
                    with contextlib.suppress(OSError):  # another rank may be in it already: leave it
                        os.rmdir(root)
                raise RamRootError(
                    f"RAM root {root}: its filesystem is only {_human(total)} in all, too small for the memory "
                    f"tier (it needs at least {_human(TINY_BYTES)}, and room for memory.slots images of every "
                    f"rank on this node plus memory.headroom_bytes); containers often mount a 64 MiB /dev/shm: "
                    f"raise it (`docker run --shm-size=16g`, or a Kubernetes emptyDir with medium: Memory "
                    f"mounted on /dev/shm), or set memory.root to a larger RAM filesystem", path=root)
            open_fd = _take_open_lock(root, dir_fd, _OPEN_LOCK_WAIT_S)
            if open_fd is None:
                return None
            try:
                owner = _claim_owner(root, dir_fd, job, uid, durable)
                name = f".rank-{rank}.lock"
                lock_fd = acquire_lock(name, dir_fd=dir_fd)
                if lock_fd is None:
                    pid = lock_holder(name, dir_fd=dir_fd)
                    who = f"process {pid}" if pid and pid > 0 else "another process"
                    raise RamRootError(
                        f"RAM root {root}: rank {rank} of job {job!r} is already open in {who} (it holds "
                        f"{root / name}); two trainers of one rank cannot share a RAM root: stop {who}, or give "
                        f"this run its own memory.job or memory.root", path=root)
            finally:
                os.close(open_fd)
        finally:
            os.close(dir_fd)
        logger.debug("opened RAM root %s for job %r rank %d (%s free of %s)", root, job, rank, _human(free),
                     _human(total))
        return cls(root, job, rank, owner, lock_fd, uid=uid, headroom_bytes=headroom_bytes, fs_total=total,
                   fs_free=free)

    def check_space(self, nbytes: int, *, already_reserved: int = 0) -> None:
        """Refuse to allocate ``nbytes`` of images unless ``headroom_bytes`` stay free afterwards.

        ``already_reserved``: bytes of those images that already exist (reused, not allocated again).
        Also warns when the allocation does not fit under the job's cgroup memory limit: tmpfs pages
        are charged to the cgroup that touches them, so the job would be OOM-killed, not refused.
        """
        needed = max(0, nbytes - already_reserved)
        self.fs_total, self.fs_free = _space(self.path)
        if self.fs_free - needed < self.headroom_bytes:
            raise RamRootError(
                f"RAM root {self.path}: the memory tier needs {_human(needed)} ({needed} bytes) more for its "
                f"images, the filesystem has {_human(self.fs_free)} ({self.fs_free} bytes) free, and "
                f"memory.headroom_bytes={_human(self.headroom_bytes)} ({self.headroom_bytes} bytes) must stay "
                f"free (NCCL, DataLoader shared memory); lower memory.slots or shard the state smaller, or make "
                f"the RAM filesystem larger (`docker run --shm-size=...`, a larger Kubernetes emptyDir sizeLimit, "
                f"or memory.root on a larger one)", path=self.path)
        room = _cgroup_room()
        if room is not None and needed > room[0] - room[1]:
            logger.warning(
                "RAM root %s: the memory tier is about to allocate %s of images, but the job's cgroup memory "
                "limit leaves only %s (memory.max %s, memory.current %s); tmpfs pages count against that limit, "
                "so the job may be OOM-killed: lower memory.slots or raise the container's memory limit",
                self.path, _human(needed), _human(max(0, room[0] - room[1])), _human(room[0]), _human(room[1]))

    def rank_alive(self, rank: int) -> int | None:
        """Pid of the live trainer holding rank ``rank``'s lock (this process too), or None."""
        return lock_holder(self.path / f".rank-{rank}.lock")

    def writer_lock_path(self, rank: int) -> Path:
        """The lock that rank ``rank``'s writer process holds while it lives (see :func:`acquire_lock`)."""
        return self.path / f".writer-{rank}.lock"

    def writer_alive(self, rank: int) -> int | None:
        """Pid of the live writer process of rank ``rank``, or None."""
        return lock_holder(self.writer_lock_path(rank))

    def wait_writer_gone(self, rank: int, timeout_s: float) -> bool:
        """Poll every 0.05 s until no writer of rank ``rank`` holds its lock; False if one still does."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.writer_alive(rank) is None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def close(self) -> None:
        """Release this rank's trainer lock (idempotent). The root and its files stay."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def remove(self) -> None:
        """Close, then delete the root and everything in it.

        Refused while any other trainer or writer still holds a lock in it (that process uses it).
        """
        self.close()
        try:
            dir_fd = _open_dir(self.path, self.uid, "RAM root")
        except RamRootError:
            if not os.path.lexists(self.path):
                return
            raise
        try:
            open_fd = _take_open_lock(self.path, dir_fd, _OPEN_LOCK_WAIT_S)
            if open_fd is None:
                return  # removed meanwhile
            try:
                held = _held_locks(dir_fd)
                if held:
                    raise RamRootError(f"RAM root {self.path} is still in use ({_describe_held(held)}); stop "
                                       f"those processes before removing it", path=self.path)
                _rmtree(self.path)
            finally:
                os.close(open_fd)
        finally:
            os.close(dir_fd)
        if self.path.parent == _default_base(self.uid):  # the per-user directory, once no job's root is left in it
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)
        logger.info("removed RAM root %s", self.path)


_LARGE_FILE_BYTES = 64 << 20


def _rmtree(path: Path) -> None:
    """Delete ``path``; first the owner record, so that an interrupted removal never looks like a live root; then
    its large files side by side (:func:`_unlink_large_files`), then the rest."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / OWNER_NAME)
    try:
        _unlink_large_files(path)
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise RamRootError(f"cannot remove the RAM root {path}: {e}; remove it by hand", path=path) from e


def _unlink_large_files(path: Path) -> None:
    """Unlink the regular files of ``path`` of 64 MiB or more, a thread per file (8 at most): tmpfs frees a file's
    pages under its inode lock, separate files in parallel (3 x 2 GiB: 0.85 s one after the other, 0.44 s side by
    side on the 2-core CPU box), and the images of a job's slots are removed at its exit. Best effort: by name in
    the directory it was found in (a descriptor: a directory swapped for a link meanwhile is not followed); what is
    left (an error, no thread at interpreter exit) ``shutil.rmtree`` removes or reports."""
    large: list[tuple[int, str]] = []  # (a descriptor of its directory, its name)
    try:
        for _parent, _dirs, names, dir_fd in os.fwalk(path):  # never follows a link
            for name in names:
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size >= _LARGE_FILE_BYTES:
                    large.append((os.dup(dir_fd), name))
        if len(large) >= 2:
            with concurrent.futures.ThreadPoolExecutor(min(8, len(large)), thread_name_prefix="cpuckpt-rmtree") as pool:
                for _ in pool.map(_unlink_in, large):
                    pass
    except (OSError, RuntimeError):  # RuntimeError: no new thread at interpreter exit
        pass
    finally:
        for fd, _ in large:
            os.close(fd)


def _unlink_in(entry: tuple[int, str]) -> None:
    with contextlib.suppress(OSError):
        os.unlink(entry[1], dir_fd=entry[0])


# ------------------------------------------------------------------------------------------- clean


def clean_ram_roots(base: str | os.PathLike | None = None, *, dry_run: bool = False,
                    uid: int | None = None) -> list[Path]:
    """Remove every stale RAM root under ``base``; returns those removed (or, ``dry_run``, those it would remove).

    ``base`` defaults to ``/dev/shm/cpuckpt-<uid>``; a ``base`` that is itself a RAM root (holds an
    ``.owner.json``) is the only candidate; a shared system directory (:func:`is_shared_dir`, e.g.
    ``/dev/shm`` itself) stands for the per-user directory in it. A root is stale when none of its
    trainer and writer locks is held. Live roots, and directories that are no RAM root of ``uid``
    (no owner record, a symlink, someone else's), are left alone and logged.
    """
    uid = os.geteuid() if uid is None else uid
    base = _default_base(uid) if base is None else Path(os.path.abspath(os.fspath(base)))
    if is_shared_dir(base):  # never judge (or advise chmod on) /dev/shm or /tmp: only our directory in it
        base = base / f"cpuckpt-{uid}"
    if not os.path.lexists(base):
        return []
    try:
        base_fd = _open_dir(base, uid, "RAM root directory")
    except RamRootError:
        if not os.path.lexists(base):  # the last job's removal took the empty per-user directory just now
            return []
        raise
    try:
        names = os.listdir(base_fd)
    finally:
        os.close(base_fd)
    candidates = [base] if OWNER_NAME in names else [base / n for n in sorted(names)]
    removed = []
    for root in candidates:
        if _clean_one(root, uid, dry_run):
            removed.append(root)
    return removed


def is_shared_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory shared by all users (world-writable and sticky: /dev/shm, /tmp).

    Such a directory is never a RAM root nor a directory of RAM roots, whatever its mode says.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX) and bool(st.st_mode & stat.S_IWOTH)


def _clean_one(root: Path, uid: int, dry_run: bool) -> bool:
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False  # a stray file or symlink: not a RAM root
    try:
        dir_fd = _open_dir(root, uid, "RAM root")
    except RamRootError as e:
        logger.warning("clean: skipping %s", e)
        return False
    try:
        if not _is_regular(OWNER_NAME, dir_fd):
            logger.info("clean: skipping %s: no %s, not a RAM root", root, OWNER_NAME)
            return False
        held = _held_locks(dir_fd)
        if not held and dry_run:
            busy = lock_holder(OPEN_LOCK_NAME, dir_fd=dir_fd) if _is_regular(OPEN_LOCK_NAME, dir_fd) else None
            if busy is not None:
                held = {OPEN_LOCK_NAME: busy}
        if held:
            logger.info("clean: keeping live RAM root %s (%s)", root, _describe_held(held))
            return False
        if dry_run:
            logger.info("clean: would remove stale RAM root %s", root)
            return True
        try:
            open_fd = _take_open_lock(root, dir_fd, 0.0)
        except RamRootError:
            logger.info("clean: keeping RAM root %s, a process is opening it", root)
            return False
        if open_fd is None:
            return False
        try:
            held = _held_locks(dir_fd)  # again, now that no one can open it meanwhile
            if held:
                logger.info("clean: keeping live RAM root %s (%s)", root, _describe_held(held))
                return False
            logger.info("clean: removing stale RAM root %s", root)
            _rmtree(root)
            return True
        finally:
            os.close(open_fd)
    finally:
        os.close(dir_fd)


def _is_regular(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise
