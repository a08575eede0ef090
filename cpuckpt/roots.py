"""Checkpoint roots: which checkpoints are complete, the ``latest`` pointer, retention, cleaning, SIGTERM.

A *root* is a directory whose subdirectories are checkpoints (``<root>/step_100``, ...). This module
never writes data files and runs no collectives: the coordinator calls :func:`after_commit` once a
save is committed, and users call :func:`find_latest`, :func:`list_checkpoints`,
:func:`clean_incomplete`, :func:`apply_retention` and :func:`install_sigterm_handler` directly.

A checkpoint directory is *complete* as :func:`cpuckpt.backend.committed.check_complete` defines it:
its ``.metadata`` is a non-empty file that the restricted unpickler accepts and, if it holds a
cpuckpt manifest of the same save, the manifest parses and every data file it lists exists with the
listed size. (Checksums are not read: that is the load's job. Inspecting a checkpoint costs one read
of ``.metadata`` and one ``stat`` per data file.) Deleting a checkpoint first removes its
``.metadata`` (and fsyncs the directory), so a deletion that is interrupted leaves an incomplete
directory, never a damaged "complete" one.

Cross-process limits: checkpoints being *written* are protected only when the writer is this
process (its in-flight ``async_save`` handles, and the save being committed). Checkpoints being
*loaded* are protected by a ``.cpuckpt-loading-<host>-<pid>-<id>`` marker file that
:func:`cpuckpt.load` creates in the checkpoint for the duration of the load, which protects them
from retention run by any process that sees the same filesystem. A marker of a process that died
on this host is ignored; a marker from another host is honoured until it is deleted by hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from cpuckpt import faultpoint, s3roots
from cpuckpt.backend import inflight, s3commit
from cpuckpt.backend.committed import METADATA_NAME, check_complete
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CpuckptError, IntegrityError
from cpuckpt.paths import S3Url, checkpoint_path, is_s3, local_path
from cpuckpt.procs import pid_alive
from cpuckpt.rootinfo import CHECKPOINT_FILE as _CKPT_FILE
from cpuckpt.rootinfo import LATEST_NAME, LOADING_PREFIX, REMOVING_PREFIX, CheckpointInfo, ordered
from cpuckpt.rootinfo import LEFTOVER_FILE as _LEFTOVER_FILE
from cpuckpt.transfer.files import fsync_dir, write_atomic
from cpuckpt.transfer.objstore import open_store

__all__ = [
    "LATEST_NAME",
    "CheckpointInfo",
    "after_commit",
    "apply_retention",
    "clean_incomplete",
    "committed_once",
    "find_latest",
    "install_sigterm_handler",
    "list_checkpoints",
    "loading",
    "ordered",
    "read_latest",
    "update_latest",
]

logger = logging.getLogger(__name__)

# Per process, like the directories it protects: retention after any stream's commit must skip what a
# load of this process reads. Must not stand for other processes' loads (their marker files do).
_LOADING: dict[str, int] = {}  # resolved path -> loads in progress in this process
_LOADING_LOCK = threading.Lock()


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Say whether the checkpoint in ``path`` is complete (see the module docstring) and its step.

    Raises:
        ConfigError: ``path`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(path)
    if isinstance(where, S3Url):
        c = s3commit.check_complete(open_store(resolve_config(None).s3, threads=4), where)
        return CheckpointInfo(where, c.complete, c.step, c.committed_at or 0.0, c.reason, committed=c.committed)
    path = Path(where)
    c = check_complete(path)
    mtime = c.committed_at if c.committed_at is not None else _mtime(path)
    return CheckpointInfo(path, c.complete, c.step, mtime, c.reason, c.unreadable, c.committed)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _looks_like_checkpoint(path: Path) -> bool:
    """A directory holding at least one checkpoint file name, and nothing that is not one."""
    try:
        names = [e.name for e in os.scandir(path)]
    except OSError:
        return False
    return bool(names) and all(_CKPT_FILE.match(n) for n in names) and any(
        n == METADATA_NAME or n.endswith(".distcp") or n.endswith(".cpuckpt-part.json") or n.startswith(".cpuckpt")
        for n in names)


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Every checkpoint directory directly under ``root``, oldest first.

    Only directories holding nothing but checkpoint files (FORMAT.md section 1) are listed, so
    unrelated directories in ``root`` are never reported, cleaned or deleted. Ordering: :func:`ordered`,
    by manifest step and commit time (when ``.metadata`` was written: it is written last).

    An ``s3://bucket/run`` root lists its checkpoint prefixes (``s3roots``), with the ``s3`` settings of the
    default config (``CPUCKPT_S3_*`` and the AWS variables apply).

    Raises:
        ConfigError: ``root`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(root, "checkpoint root")
    if isinstance(where, S3Url):
        return s3roots.list_checkpoints(where)
    root = Path(where)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    out = [inspect_checkpoint(Path(e.path)) for e in entries if not e.name.startswith(REMOVING_PREFIX)
           and e.is_dir(follow_symlinks=False) and _looks_like_checkpoint(Path(e.path))]
    return ordered(out, lambda c: c.step, lambda c: c.mtime, lambda c: c.path.name)


def committed_once(c: CheckpointInfo) -> bool:
    """``c`` had its commit marker (``.metadata``, non-empty) when inspected: incomplete now means damaged after the
    commit, not a torn save (a restart raises over it rather than start from scratch, and cleaning leaves it). One
    that could not be read (EIO, EACCES) may be committed: it counts as such. From ``c``'s own look, never another:
    a save committing meanwhile (a writer of the previous run) is not damage."""
    return c.unreadable or c.committed


def find_latest(root: str | os.PathLike) -> Path | S3Url | None:
    """The newest *complete* checkpoint under ``root``, or None.

    The directory scan is the source of truth; the ``latest`` pointer is not trusted alone, so a
    torn save is never returned, whatever state the pointer is in. "Newest" is :func:`ordered`'s
    rule. Checksums are not read: :func:`cpuckpt.load_latest` falls back past a damaged one.

    Raises:
        ConfigError: ``root`` is a URL other than ``s3://``.

    Example:
        >>> path = cpuckpt.find_latest("/ckpt")
        >>> if path is not None:
        ...     cpuckpt.load(state_dict, path)
    """
    listed = list_checkpoints(root)
    for c in listed:
        if c.unreadable:
            logger.warning("find_latest: %s %s; it is not a candidate", c.path, c.reason)
    complete = [c for c in listed if c.complete]
    return complete[-1].path if complete else None


def read_latest(root: str | os.PathLike) -> Path | S3Url | None:
    """The checkpoint that ``<root>/latest`` names, if the file exists and that checkpoint is complete.

    Raises:
        ConfigError: ``root`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(root, "checkpoint root")
    if isinstance(where, S3Url):
        return s3roots.read_latest(where)
    root = where
    try:
        name = (Path(root) / LATEST_NAME).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name or "/" in name or name in (".", ".."):
        return None
    path = Path(root) / name
    return path if inspect_checkpoint(path).complete else None


def update_latest(root: str | os.PathLike, path: str | os.PathLike, *, fsync: bool = True) -> None:
    """Atomically make ``<root>/latest`` name ``path`` (tmp + fsync + rename + directory fsync).

    The file holds the checkpoint's directory name and a newline, so shell scripts can read it.

    Raises:
        IntegrityError: ``path`` is not a complete checkpoint directly under ``root``.
        CpuckptError: ``<root>/latest`` exists and is not a regular file.
        ConfigError: ``root`` or ``path`` is a URL other than ``s3://``.
    """
    if is_s3(root) or is_s3(path):
        s3_root, s3_path = checkpoint_path(root, "checkpoint root"), checkpoint_path(path)
        if not (isinstance(s3_root, S3Url) and isinstance(s3_path, S3Url)):
            raise IntegrityError(f"{path}: not directly under the checkpoint root {root}")
        s3roots.update_latest(s3_root, s3_path)
        return
    root, path = Path(local_path(root, "checkpoint root")), Path(local_path(path))
    if path.resolve().parent != root.resolve():
        raise IntegrityError(f"{path}: not directly under the checkpoint root {root}")
    if not inspect_checkpoint(path).complete:
        raise IntegrityError(f"{path}: refusing to point {root / LATEST_NAME} at an incomplete checkpoint")
    target = root / LATEST_NAME
    if target.exists() and not target.is_file():
        raise CpuckptError(f"{target} exists and is not a file; rename it or turn checkpoint.update_latest off")
    write_atomic(target, (path.name + "\n").encode(), fsync=fsync)


# --------------------------------------------------------------------------------------- loading


def _marker_alive(name: str) -> bool:
    """A loading marker counts unless it belongs to a process of this host that no longer exists."""
    rest = name[len(LOADING_PREFIX):]
    try:
        host, pid_s, _ = rest.rsplit("-", 2)
        pid = int(pid_s)
    except ValueError:
        return True
    if host != socket.gethostname():
        return True
    return pid_alive(pid)


def is_being_loaded(path: str | os.PathLike) -> bool:
    """True while this process, or a live process with a loading marker, loads ``path``."""
    if is_s3(path):  # no marker objects: this process's loads only
        with _LOADING_LOCK:
            return bool(_LOADING.get(str(path), 0))
    path = Path(path)
    with _LOADING_LOCK:
        if _LOADING.get(str(path.resolve()), 0):
            return True
    try:
        names = [e.name for e in os.scandir(path)]
    except OSError:
        return False
    return any(n.startswith(LOADING_PREFIX) and _marker_alive(n) for n in names)


@contextlib.contextmanager
def loading(path: str | os.PathLike) -> Iterator[None]:
    """Protect ``path`` from retention while the block runs (used by :func:`cpuckpt.load`).

    Registers the path in this process and creates a marker file in it; if the marker cannot be
    created (read-only filesystem), only this process's registry protects it.
    """
    key = str(path) if is_s3(path) else str(Path(path).resolve())
    with _LOADING_LOCK:
        _LOADING[key] = _LOADING.get(key, 0) + 1
    marker: Path | None = None
    if not is_s3(path):  # object storage: this process's registry only (s3roots' limits)
        marker = Path(path) / f"{LOADING_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            marker.touch()
        except OSError as e:
            logger.debug("cannot create loading marker %s: %s", marker, e)
            marker = None
    try:
        yield
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.unlink()
        with _LOADING_LOCK:
            _LOADING[key] -= 1
            if not _LOADING[key]:
                del _LOADING[key]


# ------------------------------------------------------------------------------ cleaning, retention


def _delete_checkpoint(path: Path, *, fsync: bool) -> None:
    """Un-commit first (remove .metadata, fsync the directory), then remove the rest."""
    with contextlib.suppress(FileNotFoundError):
        (path / METADATA_NAME).unlink()
        if fsync:
            fsync_dir(path)
    faultpoint.hit("retention:metadata-removed")
    shutil.rmtree(path)


def clean_incomplete(root: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = (),
                     min_age_s: float = 0.0, fsync: bool = True, dry_run: bool = False) -> list[Path]:
    """Delete leftovers of crashed saves under ``root``; returns what was (``dry_run``: would be) removed.

    Removed: checkpoint directories without a valid commit (see :func:`list_checkpoints`) in which
    nothing was modified for ``min_age_s`` seconds, a stray ``latest.tmp`` in ``root``, and ``*.tmp``,
    manifest parts and O_DIRECT probes inside complete checkpoints. Never removed: the directories
    in ``keep``, any save this process has in flight, and anything younger than ``min_age_s``.

    After a commit the coordinator passes ``min_age_s = timeout_s``: a live save, in this or any
    other process, touches its directory at least once per ``timeout_s`` (every wait of a save is
    bounded by it), so only dead saves are that old. With ``min_age_s = 0`` (the default for direct
    calls) another process's in-flight save in the same root *is* removed.

    An ``s3://`` root: ``s3roots.clean_incomplete`` (incomplete prefixes and their multipart uploads).

    Raises:
        ConfigError: ``root`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(root, "checkpoint root")
    if isinstance(where, S3Url):
        return s3roots.clean_incomplete(where, keep=[k for k in map(checkpoint_path, keep) if isinstance(k, S3Url)],
                                        min_age_s=min_age_s, dry_run=dry_run)  # type: ignore[return-value]
    root = Path(where)
    protected = {str(Path(p).resolve()) for p in [*keep, *(h.path for h in inflight.pending())]}
    removed: list[Path] = []
    for info in list_checkpoints(root):
        if str(info.path.resolve()) in protected or is_being_loaded(info.path):
            continue
        if not info.complete and min_age_s > 0 and time.time() - _newest_mtime(info.path) < min_age_s:
            continue
        if not info.complete and committed_once(info):  # damaged after its commit, or unreadable: perhaps
            logger.warning("not removing %s: committed once, incomplete now (%s)", info.path, info.reason)
            continue  # salvageable, or complete after all: cleaning removes torn saves only
        if not info.complete:
            if not dry_run:
                logger.info("removing incomplete checkpoint %s (%s)", info.path, info.reason)
                _delete_checkpoint(info.path, fsync=fsync)
            removed.append(info.path)
            continue
        for entry in os.scandir(info.path):
            if _LEFTOVER_FILE.match(entry.name) and _untouched_for(entry, min_age_s):
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                removed.append(Path(entry.path))
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.name == LATEST_NAME + ".tmp" and entry.is_file(follow_symlinks=False) and \
                    _untouched_for(entry, min_age_s):  # a younger one may be a commit's, about to be renamed
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _untouched_for(entry: os.DirEntry, min_age_s: float) -> bool:
    if min_age_s <= 0:  # a direct call's default: whatever its clock says
        return True
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime >= min_age_s
    except FileNotFoundError:
        return False


def _newest_mtime(path: Path) -> float:
    newest = _mtime(path)
    with contextlib.suppress(OSError):
        for e in os.scandir(path):
            with contextlib.suppress(OSError):
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def apply_retention(root: str | os.PathLike, keep_last: int, keep_every: int = 0, *,
                    protect: Iterable[str | os.PathLike] = (), fsync: bool = True) -> list[Path]:
    """Delete complete checkpoints under ``root`` that the retention rules do not keep; returns them.

    Kept: the ``keep_last`` newest complete checkpoints (``0`` keeps all), those whose step is a
    multiple of ``keep_every`` (when ``keep_every > 0``), the newest complete checkpoint always,
    anything in ``protect``, and any checkpoint being loaded (see :func:`loading`). Incomplete
    directories are left to :func:`clean_incomplete`.

    Raises:
        ConfigError: ``root`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(root, "checkpoint root")
    if isinstance(where, S3Url):
        with _LOADING_LOCK:
            loads = [k for k in _LOADING if k.startswith("s3://")]
        return s3roots.apply_retention(where, keep_last, keep_every, loading=loads,  # type: ignore[return-value]
                                       protect=[p for p in map(checkpoint_path, protect) if isinstance(p, S3Url)])
    root = local_path(root, "checkpoint root")
    if keep_last <= 0:
        return []
    complete = [c for c in list_checkpoints(root) if c.complete]
    if not complete:
        return []
    protected = {str(Path(p).resolve()) for p in protect}
    keep = {str(c.path.resolve()) for c in complete[-keep_last:]}
    keep.add(str(complete[-1].path.resolve()))
    removed: list[Path] = []
    for c in complete:
        key = str(c.path.resolve())
        if key in keep or key in protected:
            continue
        if keep_every > 0 and c.step is not None and c.step % keep_every == 0:
            continue
        if is_being_loaded(c.path):
            logger.info("retention: keeping %s, it is being loaded", c.path)
            continue
        logger.info("retention: removing %s (step %s)", c.path, c.step)
        _delete_checkpoint(c.path, fsync=fsync)
        removed.append(c.path)
    return removed


def after_commit(path: str | os.PathLike, config: Config) -> None:
    """Coordinator, right after ``path`` was committed: pointer, cleaning, retention in its parent.

    Does nothing unless ``checkpoint.update_latest``, ``checkpoint.clean_incomplete`` or
    ``checkpoint.keep_last`` is set. Leftovers are cleaned only once untouched for ``timeout_s``
    (see :func:`clean_incomplete`). The checkpoint is already committed when this runs, so a
    failure here is logged as a warning and does not fail the save.
    """
    cc = config.checkpoint
    if not (cc.update_latest or cc.clean_incomplete or cc.keep_last):
        return
    if is_s3(path):
        with _LOADING_LOCK:
            loads = [k for k in _LOADING if k.startswith("s3://")]
        s3roots.after_commit(checkpoint_path(path), config, loading=loads)  # type: ignore[arg-type]
        return
    path = Path(path)
    root = path.parent
    fsync = config.io.fsync
    try:
        if cc.update_latest:
            _advance_latest(root, path, fsync=fsync)
        if cc.clean_incomplete:
            clean_incomplete(root, keep=[path], min_age_s=config.timeout_s, fsync=fsync)
        if cc.keep_last:
            apply_retention(root, cc.keep_last, cc.keep_every, protect=[path], fsync=fsync)
    except (OSError, CpuckptError) as e:
        logger.warning("checkpoint %s is committed, but maintaining its root %s failed: %s", path, root, e)


def _advance_latest(root: Path, path: Path, *, fsync: bool) -> None:
    """``latest`` only moves forward: a checkpoint committed late (a persist from the memory tier, a slow
    save) with an older step than the one ``latest`` names leaves it alone."""
    current = read_latest(root)
    if current is not None and current != path:
        old, new = inspect_checkpoint(current).step, inspect_checkpoint(path).step
        if old is not None and new is not None and new < old:
            logger.info("%s stays at %s (step %d): %s (step %d) is older", root / LATEST_NAME, current.name, old,
                        path.name, new)
            return
    update_latest(root, path, fsync=fsync)


# ------------------------------------------------------------------------------------------ SIGTERM

_SIGTERM_LOCK = threading.Lock()


def install_sigterm_handler(grace_s: float | None = None, config: Config | None = None, *,
                            then: Callable[[float], None] | None = None) -> Any:
    """On SIGTERM, give in-flight ``async_save``\\ s up to ``grace_s`` to commit, then chain on.

    Call from the main thread (Python delivers signals there). The handler waits for this
    process's in-flight saves until the grace period ends. Saves that are not committed by then
    stay recognisably incomplete (no ``.metadata``). Then it runs the handler that was installed
    before it: a Python handler is called, ``SIG_IGN`` returns, and the default action is taken by
    re-raising SIGTERM with the default disposition restored (the process ends by SIGTERM).

    Args:
        grace_s: seconds to wait; default ``config.checkpoint.sigterm_grace_s`` (30).
        config: where to read the default grace period from.
        then: called with the grace period's deadline (``time.monotonic()``) once the in-flight saves
            are waited for, inside the grace period (the memory tier makes its newest checkpoint durable).

    Returns:
        The previous handler.
    """
    if grace_s is None:
        grace_s = (config or Config()).checkpoint.sigterm_grace_s
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        # A second SIGTERM during the grace period (it runs in this same thread) must not wait on the
        # first one's lock forever: it skips the waiting and chains at once.
        if _SIGTERM_LOCK.acquire(blocking=False):
            try:
                deadline = time.monotonic() + grace_s
                pending = inflight.pending()
                logger.warning("SIGTERM: waiting up to %.1f s for %d in-flight checkpoint save(s)", grace_s,
                               len(pending))
                for h in pending:
                    try:
                        h.wait(max(0.001, deadline - time.monotonic()))
                    except Exception as e:  # reported, then the trainer's handler still runs
                        logger.warning("SIGTERM: save of %s not committed: %s", h.path, e)
                if then is not None:
                    try:
                        then(deadline)
                    except Exception as e:
                        logger.warning("SIGTERM: %s", e)
            finally:
                _SIGTERM_LOCK.release()
        else:
            logger.warning("SIGTERM again during the grace period: not waiting any longer")
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    return previous
