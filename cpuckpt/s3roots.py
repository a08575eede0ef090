"""Checkpoint roots in object storage (``s3://bucket/run``): listing, ``latest``, retention, cleaning.

The object-storage twin of ``roots`` (which hands ``s3://`` roots to the functions here): a checkpoint is a
"directory" (common prefix) directly under the root whose objects all carry checkpoint names; it is
*complete* as ``backend.s3commit.check_complete`` says (``.metadata`` there and accepted, the manifest's
data objects of their sizes). ``latest`` is an object holding the checkpoint's name, replaced whole by one
PUT and only after a commit, and never trusted alone. Deleting a checkpoint deletes its ``.metadata`` first,
so an interrupted deletion leaves an incomplete prefix, never a damaged "complete" one; retention never
deletes the newest complete checkpoint.

Limits: a multipart upload in progress creates no object, so a live save's prefix may not be listed at all
until its first part object or manifest part lands; cleaning only touches prefixes whose newest object and
newest upload are older than ``min_age_s``. Loads in other processes are not visible (no marker objects):
retention protects only this process's loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from cpuckpt import faultpoint
from cpuckpt.backend import s3commit
from cpuckpt.backend.committed import METADATA_NAME
from cpuckpt.config import Config, S3Config, resolve_config
from cpuckpt.errors import CpuckptError, IntegrityError
from cpuckpt.paths import S3Url
from cpuckpt.rootinfo import CHECKPOINT_FILE, LATEST_NAME, LEFTOVER_FILE, CheckpointInfo, ordered
from cpuckpt.transfer.objstore import ObjectStore, Upload, open_store

__all__ = ["after_commit", "apply_retention", "clean_incomplete", "find_latest", "list_checkpoints", "read_latest",
           "update_latest"]

logger = logging.getLogger(__name__)


def _store(cfg: S3Config | None) -> ObjectStore:
    return open_store(cfg if cfg is not None else resolve_config(None).s3, threads=4)


def _objects(store: ObjectStore, url: S3Url) -> list[tuple[str, float]]:
    """(name relative to ``url``, mtime) of every object under the prefix ``url``."""
    base = url.contents
    return [(o.key[len(base.key):], o.mtime) for o in store.list(base)]


def _inspect(store: ObjectStore, url: S3Url, objects: list[tuple[str, float]]) -> CheckpointInfo:
    c = s3commit.check_complete(store, url)
    newest = max((m for _, m in objects), default=0.0)
    return CheckpointInfo(url, c.complete, c.step, c.committed_at if c.committed_at is not None else newest,
                          c.reason, committed=c.committed)


def _checkpoint_file(name: str) -> bool:
    """An object directly under a checkpoint prefix, named as a checkpoint's files are."""
    return "/" not in name and bool(CHECKPOINT_FILE.match(name))


def _looks_like_checkpoint(objects: list[tuple[str, float]]) -> bool:
    return bool(objects) and all(_checkpoint_file(n) for n, _ in objects)


def _scan(store: ObjectStore, root: S3Url) -> list[tuple[CheckpointInfo, list[tuple[str, float]]]]:
    out = []
    for name in store.list_dirs(root):
        url = root / name
        objects = _objects(store, url)
        if _looks_like_checkpoint(objects):
            out.append((_inspect(store, url, objects), objects))
    return out


def inspect_prefix(url: S3Url, cfg: S3Config | None = None) -> CheckpointInfo | None:
    """``url`` itself as a checkpoint (None when its objects are not a checkpoint's): ``cpuckpt ls`` of a
    checkpoint prefix, as of a local checkpoint directory. The listing stops at the first object that is not a
    checkpoint file (a root's first checkpoint's), so a root, a bucket included, is never listed whole here."""
    store = _store(cfg)
    base = url.contents
    objects = []
    for o in store.list(base):
        name = o.key[len(base.key):]
        if not _checkpoint_file(name):
            return None
        objects.append((name, o.mtime))
    return _inspect(store, url, objects) if objects else None


def list_checkpoints(root: S3Url, cfg: S3Config | None = None) -> list[CheckpointInfo]:
    """Every checkpoint prefix directly under ``root``, oldest first (``rootinfo.ordered``)."""
    infos = [info for info, _ in _scan(_store(cfg), root)]
    return ordered(infos, lambda c: c.step, lambda c: c.mtime, lambda c: c.path.name)


def find_latest(root: S3Url, cfg: S3Config | None = None) -> S3Url | None:
    """The newest complete checkpoint under ``root``, or None (the listing decides, not ``latest``)."""
    complete = [c for c in list_checkpoints(root, cfg) if c.complete]
    return complete[-1].path if complete else None  # type: ignore[return-value]


def read_latest(root: S3Url, cfg: S3Config | None = None) -> S3Url | None:
    """The checkpoint ``<root>/latest`` names, if that object exists and the checkpoint is complete."""
    store = _store(cfg)
    data = store.get(root / LATEST_NAME)
    try:
        name = (data or b"").decode().strip()
    except UnicodeDecodeError:
        return None
    if not name or "/" in name or name in (".", ".."):
        return None
    url = root / name
    return url if s3commit.check_complete(store, url).complete else None


def update_latest(root: S3Url, path: S3Url, cfg: S3Config | None = None) -> None:
    """Make ``<root>/latest`` name ``path`` (one PUT replaces the object whole).

    Raises:
        IntegrityError: ``path`` is not a complete checkpoint directly under ``root``.
    """
    if path.parent != root:
        raise IntegrityError(f"{path}: not directly under the checkpoint root {root}")
    store = _store(cfg)
    if not s3commit.check_complete(store, path).complete:
        raise IntegrityError(f"{path}: refusing to point {root / LATEST_NAME} at an incomplete checkpoint")
    store.put(root / LATEST_NAME, (path.name + "\n").encode())


def _delete_checkpoint(store: ObjectStore, url: S3Url) -> None:
    """Un-commit first (``.metadata``), then every other object, then its uploads."""
    store.delete(url / METADATA_NAME)
    faultpoint.hit("retention:metadata-removed")
    for name, _ in _objects(store, url):
        store.delete(url / name)
    for upload in store.list_uploads(url.contents):
        store.abort_upload(upload)


def clean_incomplete(root: S3Url, *, keep: Iterable[S3Url] = (), min_age_s: float = 0.0,
                     cfg: S3Config | None = None, dry_run: bool = False) -> list[S3Url]:
    """Delete leftovers of crashed saves under ``root``; returns what was (``dry_run``: would be) removed.

    Removed once untouched for ``min_age_s``: incomplete checkpoints (their objects and multipart uploads),
    multipart uploads under a checkpoint prefix that holds no object yet (a save killed before any upload
    completed), and manifest parts left in complete checkpoints. Never: ``keep``, a complete checkpoint's data.
    """
    store = _store(cfg)
    keep_keys = {str(k) for k in keep}
    now = time.time()
    removed: list[S3Url] = []
    uploads = store.list_uploads(root.contents)

    def owner(upload: Upload) -> S3Url | None:  # the checkpoint prefix directly under root it belongs to
        rest = upload.url.key[len(root.key) + 1:] if root.key else upload.url.key
        return root / rest.split("/", 1)[0] if "/" in rest else None

    by_prefix: dict[str, list[Upload]] = {}
    for u in uploads:
        o = owner(u)
        if o is not None:
            by_prefix.setdefault(str(o), []).append(u)
    seen: set[str] = set()
    for info, objects in _scan(store, root):
        url: S3Url = info.path  # type: ignore[assignment]
        seen.add(str(url))
        mine = by_prefix.get(str(url), [])
        newest = max([m for _, m in objects] + [u.initiated for u in mine], default=0.0)
        if str(url) in keep_keys or now - newest < min_age_s:
            continue
        if not info.complete:
            faultpoint.hit(f"clean:incomplete:{url.name}")
            if not dry_run:
                logger.info("removing incomplete checkpoint %s (%s)", url, info.reason)
                _delete_checkpoint(store, url)
            removed.append(url)
            continue
        for name, _ in objects:
            if LEFTOVER_FILE.match(name):
                if not dry_run:
                    store.delete(url / name)
                removed.append(url / name)
    for prefix, mine in by_prefix.items():  # uploads of prefixes with no object at all
        if prefix in seen or prefix in keep_keys or now - max(u.initiated for u in mine) < min_age_s:
            continue
        for u in mine:
            if not dry_run:
                logger.info("aborting the multipart upload of %s a dead save left", u.url)
                store.abort_upload(u)
            removed.append(u.url)
    return removed


def apply_retention(root: S3Url, keep_last: int, keep_every: int = 0, *, protect: Iterable[S3Url] = (),
                    loading: Iterable[str] = (), cfg: S3Config | None = None) -> list[S3Url]:
    """Delete complete checkpoints the rules do not keep (``roots.apply_retention``'s rules); returns them.
    The newest complete one is always kept; so are ``protect`` and ``loading`` (URLs this process loads)."""
    if keep_last <= 0:
        return []
    store = _store(cfg)
    complete = [c for c in ordered([i for i, _ in _scan(store, root)], lambda c: c.step, lambda c: c.mtime,
                                   lambda c: c.path.name) if c.complete]
    if not complete:
        return []
    keep = {str(c.path) for c in complete[-keep_last:]} | {str(complete[-1].path)} | {str(p) for p in protect}
    keep |= set(loading)
    removed: list[S3Url] = []
    for c in complete:
        if str(c.path) in keep or (keep_every > 0 and c.step is not None and c.step % keep_every == 0):
            continue
        logger.info("retention: removing %s (step %s)", c.path, c.step)
        _delete_checkpoint(store, c.path)  # type: ignore[arg-type]
        removed.append(c.path)  # type: ignore[arg-type]
    return removed


def after_commit(path: S3Url, config: Config, *, loading: Iterable[str] = ()) -> None:
    """Coordinator, right after ``path`` was committed: ``latest``, cleaning, retention in its parent prefix.
    Only what ``checkpoint.*`` turns on; a failure is logged (the checkpoint is committed already)."""
    cc = config.checkpoint
    if not (cc.update_latest or cc.clean_incomplete or cc.keep_last):
        return
    root = path.parent
    try:
        if cc.update_latest:
            current = read_latest(root, config.s3)
            old = s3commit.check_complete(_store(config.s3), current).step if current not in (None, path) else None
            new = s3commit.check_complete(_store(config.s3), path).step
            if old is not None and new is not None and new < old:
                logger.info("%s stays at %s (step %d): %s (step %d) is older", root / LATEST_NAME, current, old,
                            path, new)
            else:
                update_latest(root, path, config.s3)
        if cc.clean_incomplete:
            clean_incomplete(root, keep=[path], min_age_s=config.timeout_s, cfg=config.s3)
        if cc.keep_last:
            apply_retention(root, cc.keep_last, cc.keep_every, protect=[path], loading=loading, cfg=config.s3)
    except (OSError, CpuckptError) as e:
        logger.warning("checkpoint %s is committed, but maintaining its root %s failed: %s", path, root, e)
