"""The writer process: persists memory checkpoints of one rank to the durable root, outliving its trainer.

Started per rank by :class:`cpuckpt.tier.memory.MemoryTier` (``python -m cpuckpt.tier.persister``) at the
first persist or replica request, in a session of its own (``setsid``), so a signal to the trainer's process
group does not reach it. It holds ``<ram root>/.writer-<rank>.lock`` (flock) while it runs, which is how trainers
tell a live writer from a dead one; the trainer takes that lock for it before it starts (``--lock-fd``).
For every owed request of its queue (:mod:`cpuckpt.tier.queue`), oldest first:

1. wait until the slot is committed in memory for that save (``.metadata`` and a manifest with the
   request's ``save_id``); if the trainer died before that, the request fails: that checkpoint was
   never committed, so it is never persisted or listed;
2. copy this rank's files to the durable directory through the file backends (O_DIRECT where
   allowed), computing each chunk's crc32c on the way and comparing it with the memory manifest's
   when that has checksums (``memory.checksum``): a RAM page damaged since the memory commit fails
   the persist (``CheckpointCorrupt``), and that destination is never committed; fsync;
3. write this rank's manifest part there (atomic, fsynced): the per-rank *done marker*;
4. coordinator only: wait for every rank's part, then commit (merged manifest, then ``.metadata``,
   as a trainer's commit does) and run ``latest``/retention per the config. No collective: a dead
   trainer cannot block it, and a rank whose part never comes fails the request after ``timeout_s``.
   Across nodes its own slot holds only its node's files; it needs only the global ``.metadata`` and
   the manifest's header from there (every node's slot has them), the parts come from the durable root.

A *replicate* request (``memory.replicas``, the node leader's writer) sends the slot, once committed
in memory, to each partner node's writer (:mod:`cpuckpt.tier.replica`); with ``--listen`` this writer
also receives partners' replicas into its RAM root on a thread of its own. A failed replica is reported
as such (``replica: ...``) and never fails training: it only means that copy does not exist.

It exits when its trainer is gone and nothing is owed, or when asked to stop and nothing is owed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cpuckpt import faultpoint
from cpuckpt.backend.commit import clear_commit, commit_checkpoint
from cpuckpt.backend.committed import (
    METADATA_NAME,
    check_complete,
    metadata_damage,
    parse_metadata,
    read_manifest,
    read_metadata_bytes,
)
from cpuckpt.backend.s3commit import S3Target
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, CheckpointTimeoutError, IntegrityError, StorageIOError
from cpuckpt.format.manifest import FileEntry, Manifest, manifest_from_json, part_name
from cpuckpt.format.metapickle import with_checkpoint_id
from cpuckpt.paths import S3Url, is_s3
from cpuckpt.roots import after_commit
from cpuckpt.tier import s3persist
from cpuckpt.tier.formats import marker_save_id, marker_step, part_path, read_pointer
from cpuckpt.tier.imagecopy import persist_image
from cpuckpt.tier.queue import Outcome, PersistQueue, PersistRequest
from cpuckpt.tier.ramroot import acquire_lock, leaving_marker, lock_holder, mark_leaving
from cpuckpt.tier.replica import Endpoint, Listener, send_slot
from cpuckpt.transfer.files import fsync_dir, write_atomic
from cpuckpt.transfer.objstore import open_store
from cpuckpt.transfer.threads import new_executor

__all__ = ["main", "persist_one", "replicate_one"]

logger = logging.getLogger(__name__)

POLL_S = 0.02


def _committed_save_id(slot: Path) -> str | None:
    """The save committed in memory in ``slot``: its manifest's id, when ``.metadata`` is there and the manifest
    still names that save after (a save refilling the slot removes both first and writes ``.metadata`` last: a
    manifest read, then a ``.metadata`` seen, then the same manifest again is that save's commit)."""
    first = read_manifest(slot)
    if first is None or not (slot / METADATA_NAME).exists():
        return None
    again = read_manifest(slot)
    return first.save_id if again is not None and again.save_id == first.save_id else None


def _wait_memory_commit(req: PersistRequest, deadline: float, queue: PersistQueue | None,
                        committed: Callable[[Path], str | None] = _committed_save_id) -> Manifest | None:
    """Wait until ``committed(slot)`` names the request's save; its DCP manifest (None for a file set)."""
    slot = Path(req.slot)
    while True:
        if queue is not None and queue.outcome(req.seq) is not None:
            raise IntegrityError(f"{slot}: the trainer cancelled the persist of {req.save_id[:8]} (step {req.step})")
        if committed(slot) == req.save_id:
            if committed is not _committed_save_id:
                return None
            manifest = read_manifest(slot)
            if manifest is not None:
                return manifest
        if not lock_held(Path(req.trainer_lock)) and committed(slot) != req.save_id:
            raise IntegrityError(f"{slot}: save {req.save_id[:8]} (step {req.step}) was never committed in memory "
                                 f"(its trainer, pid {req.trainer_pid}, ended first); it is not persisted")
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(f"{slot}: save {req.save_id[:8]} not committed in memory within the timeout")
        time.sleep(POLL_S)


def _durable_save_id(dest: Path) -> str | None:
    """The save committed in ``dest`` (None when incomplete)."""
    if not check_complete(dest).complete:
        return None
    manifest = read_manifest(dest)
    return manifest.save_id if manifest is not None else None


# A rank's writer goes on to its next request once its part is written, while the coordinator's writer may still be
# committing that save: a later persist of the same destination (a fixed name: a DeepSpeed tag saved again, a rewind)
# must not clear it under that commit. Each writer remembers the save of the last part it wrote per part path.
_MY_LAST_PART: dict[Path, str] = {}
FAILED_NAME = ".cpuckpt-persist-failed"  # the coordinator's word that the commit of the save it names failed


def _after_the_commit_of_my_last_part(req: PersistRequest, part: Path, dest: Path, deadline: float,
                                      queue: PersistQueue | None) -> None:
    """Before this rank changes ``dest`` for ``req``: wait while the part it wrote there for an earlier save is
    still there (the coordinator removes the parts as the last step of its commit, also when it is redone after
    the commit: :func:`_finish_redone_commit`), unless the coordinator says that commit failed, the trainer
    withdrew ``req``, or the deadline passed (the coordinator is gone: go on, warned). The commit file alone is
    not enough: the coordinator still removes ``<saving>`` and the parts after it."""
    earlier = _MY_LAST_PART.get(part)
    if earlier is None or earlier == req.save_id or req.coordinator:
        return
    while _part_save_id(part) == earlier and _failed_save(dest) != earlier:
        if queue is not None and queue.outcome(req.seq) is not None:
            raise IntegrityError(f"{dest}: the trainer cancelled the persist of {req.save_id[:8]} (step {req.step})")
        if time.monotonic() > deadline:
            logger.warning("%s: the commit of save %s (this rank's part written) never came; persisting save %s "
                           "over it", dest, earlier[:8], req.save_id[:8])
            return
        time.sleep(POLL_S)


def _remember_part(part: Path, save_id: str) -> None:
    """The part just written, remembered for the next persist of its destination; the newest 256 only (a long run's
    destinations are mostly unique: iter_N, global_stepN)."""
    _MY_LAST_PART.pop(part, None)
    _MY_LAST_PART[part] = save_id
    while len(_MY_LAST_PART) > 256:
        del _MY_LAST_PART[next(iter(_MY_LAST_PART))]


def _finish_redone_commit(req: PersistRequest, dest: Path, parts: list[Path]) -> None:
    """A coordinator redone after its commit (its writer died between the commit and what follows it): the parts of
    that save are removed (the other ranks' writers wait for that before the next save of this name), and a failure
    word of an earlier attempt."""
    for part in parts:
        if _part_save_id(part) == req.save_id:
            part.unlink(missing_ok=True)
    (dest / FAILED_NAME).unlink(missing_ok=True)


def _mark_saving(path: Path, save_id: str) -> None:
    """``<saving>`` of a writer's persist: never empty (``cpuckpt clean`` keeps a tag whose saving file has bytes,
    its persist owed; an engine's own save leaves it empty). Holds the save id where known."""
    path.parent.mkdir(parents=True, exist_ok=True)  # again: a cleaner may have moved a dead copy aside meanwhile
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(f"{save_id}\n")


def _failed_save(dest: Path) -> str | None:
    try:
        return (dest / FAILED_NAME).read_text().strip() or None
    except OSError:
        return None


def _mark_failed(req: PersistRequest, dest: Path) -> None:
    """The coordinator's failed commit, said in ``dest`` for the other ranks' writers waiting on it (best effort)."""
    if req.coordinator and dest.is_dir():
        try:
            write_atomic(dest / FAILED_NAME, req.save_id.encode(), fsync=False)
        except OSError as e:
            logger.warning("%s: could not say that the commit of %s failed: %s", dest, req.save_id[:8], e)


def _part_save_id(part: Path) -> str | None:
    try:
        return manifest_from_json(part.read_bytes()).save_id or None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def persist_one(req: PersistRequest, queue: PersistQueue | None = None) -> Outcome:
    """Persist one request (steps 1-4 above); the outcome says what happened, never raises.

    Idempotent: a request whose save is already committed in ``dest`` (a writer that died between its
    commit and its outcome file, redone) succeeds at once, and a rank whose part for that save is
    already there does not write again. Parts carry the save id, so the coordinator never commits a
    part that an earlier, failed attempt left behind.
    """
    if req.kind == "replicate":
        return replicate_one(req, queue)
    if req.kind == "files":
        return persist_files(req, queue)
    if is_s3(req.dest):
        return _persist_one_s3(req, queue)
    t0 = time.perf_counter()
    cfg = Config.from_dict(req.config, source="persist request", env=False)
    deadline = time.monotonic() + cfg.timeout_s
    dest, slot = Path(req.dest), Path(req.slot)
    prefix = f"__{req.rank}_"
    part = dest / part_name(prefix)
    nbytes = 0
    try:
        if _durable_save_id(dest) == req.save_id:
            if req.coordinator:  # redone after its commit: what followed the commit may not have run
                _finish_redone_commit(req, dest, [dest / part_name(f"__{r}_") for r in range(req.world_size)])
                after_commit(dest, cfg)
            return Outcome(req.seq, True, seconds=time.perf_counter() - t0)
        manifest = _wait_memory_commit(req, deadline, queue)
        if manifest is not None:  # a damaged .metadata fails here, before dest is touched (and at the commit)
            _slot_metadata(req, slot, manifest)
        dest.mkdir(parents=True, exist_ok=True)
        if _part_save_id(part) != req.save_id:
            _after_the_commit_of_my_last_part(req, part, dest, deadline, queue)
            # Whatever stands in dest (an older checkpoint of this name, a failed attempt) is made
            # incomplete before this rank overwrites a byte of it, on every rank.
            clear_commit(dest)  # fsynced even without io.fsync (FORMAT.md §2)
            part.unlink(missing_ok=True)
            entries = []
            for e in (e for name, e in sorted(manifest.files.items()) if name.startswith(prefix)):
                out = persist_image(slot / e.name, dest / e.name, cfg, expect=e)
                if out.nbytes != e.nbytes:
                    raise IntegrityError(f"{slot / e.name}: {out.nbytes} bytes persisted, the memory manifest "
                                         f"says {e.nbytes}")
                out.records = e.records
                entries.append(out)
                nbytes += out.nbytes
            if _committed_save_id(slot) != req.save_id:  # the trainer reused the slot under us: never commit that
                raise IntegrityError(f"{slot}: overwritten by another save while persisting {req.save_id[:8]}")
            write_atomic(part, Manifest(save_id=req.save_id, files={e.name: e for e in entries}).to_json().encode(),
                         fsync=cfg.io.fsync)
            if cfg.io.fsync:
                fsync_dir(dest)
        _remember_part(part, req.save_id)  # also when redone with its part there (a respawned writer)
        if req.coordinator:
            _commit_durable(req, cfg, manifest, dest, slot, deadline, t0, queue)
    except Exception as e:  # the outcome file carries it to the trainer
        _mark_failed(req, dest)
        logger.error("persist of step %s (%s) to %s failed: %s", req.step, req.save_id[:8], dest, e)
        return Outcome(req.seq, False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    return Outcome(req.seq, True, seconds=time.perf_counter() - t0, nbytes=nbytes)


def _persist_one_s3(req: PersistRequest, queue: PersistQueue | None) -> Outcome:
    """:func:`persist_one` to an ``s3://`` prefix (``tier.s3persist``): the same steps, objects for files, and
    no clearing: a prefix that holds a committed checkpoint of another save (or a stock one) is refused with
    EEXIST before any byte is uploaded, on every rank; one committed by this save is done already."""
    t0 = time.perf_counter()
    cfg = Config.from_dict(req.config, source="persist request", env=False)
    deadline = time.monotonic() + cfg.timeout_s
    dest, slot = S3Url.parse(req.dest, "memory tier durable checkpoint"), Path(req.slot)
    prefix = f"__{req.rank}_"
    nbytes = 0
    try:
        store = open_store(cfg.s3, threads=cfg.io.threads)
        if s3persist.committed_save_id(store, dest) == req.save_id:
            return Outcome(req.seq, True, seconds=time.perf_counter() - t0)
        try:  # objects are written once: never upload over a committed checkpoint (StorageWriter.clear's rule)
            S3Target(store, dest, cfg.timeout_s).refuse_committed()
        except StorageIOError:
            if s3persist.committed_save_id(store, dest) == req.save_id:  # our coordinator committed meanwhile
                return Outcome(req.seq, True, seconds=time.perf_counter() - t0)
            raise
        manifest = _wait_memory_commit(req, deadline, queue)
        if manifest is None:
            raise IntegrityError(f"{slot}: no memory manifest for save {req.save_id[:8]}")
        _slot_metadata(req, slot, manifest)  # a damaged .metadata fails here, before any upload (and at the commit)
        part = dest / part_name(prefix)
        if s3persist.part_save_id(store, part) != req.save_id:
            entries = []
            for e in (e for name, e in sorted(manifest.files.items()) if name.startswith(prefix)):
                out = s3persist.persist_image_s3(slot / e.name, dest / e.name, store, cfg, expect=e)
                out.records = e.records
                entries.append(out)
                nbytes += out.nbytes
            if _committed_save_id(slot) != req.save_id:  # the trainer reused the slot under us: never commit that
                raise IntegrityError(f"{slot}: overwritten by another save while persisting {req.save_id[:8]}")
            store.put(part, Manifest(save_id=req.save_id, files={e.name: e for e in entries}).to_json().encode())
        if req.coordinator:
            prefixes = s3persist.await_parts(store, dest, req.save_id, req.world_size, deadline,
                                             lambda: queue is not None and queue.outcome(req.seq) is not None)
            metadata = parse_metadata(_slot_metadata(req, slot, manifest), slot / METADATA_NAME)
            metadata.storage_meta.checkpoint_id = str(dest)
            S3Target(store, dest, cfg.timeout_s).commit(metadata, prefixes, _durable_manifest(req, manifest, t0),
                                                        parts_of=req.save_id)
            after_commit(dest, cfg)
    except Exception as e:  # the outcome file carries it to the trainer
        logger.error("persist of step %s (%s) to %s failed: %s", req.step, req.save_id[:8], dest, e)
        return Outcome(req.seq, False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    return Outcome(req.seq, True, seconds=time.perf_counter() - t0, nbytes=nbytes)


def persist_files(req: PersistRequest, queue: PersistQueue | None = None) -> Outcome:
    """Persist this rank's part of a file set (an adapter's own files, committed by a marker: ``kind: files``).

    The steps of the module docstring, for files named by the request: (1) wait until ``slot/<marker>`` names the
    request's save; (2) make ``dest`` incomplete (its marker removed, ``<saving>`` created, directory fsynced)
    before a byte of it changes; copy this rank's files, each chunk checked against the memory checksums; then
    this rank's part (``.cpuckpt-part-<rank>.json``: save id and files); (3) the coordinator waits for every
    rank's part of this save, installs the slot's marker in ``dest`` atomically (the durable commit), removes
    ``<saving>`` and the parts, and writes ``pointer`` unless it names a file set of a newer step. Idempotent
    like :func:`persist_one`; never raises.
    """
    t0 = time.perf_counter()
    cfg = Config.from_dict(req.config, source="persist request", env=False)
    deadline = time.monotonic() + cfg.timeout_s
    dest, slot = Path(req.dest), Path(req.slot)
    part = part_path(dest, req.rank)
    nbytes = 0
    try:
        if marker_save_id(dest / req.marker) == req.save_id:
            if req.coordinator:  # redone after its commit: what followed the commit may not have run
                if req.saving:
                    (dest / req.saving).unlink(missing_ok=True)
                    if marker_save_id(dest / req.marker) != req.save_id:  # a rank went on meanwhile (past its wait)
                        _mark_saving(dest / req.saving, "")
                _finish_redone_commit(req, dest, [part_path(dest, r) for r in range(req.world_size)])
                if req.pointer:
                    _move_pointer(Path(req.pointer[0]), str(req.pointer[1]), req, cfg)
            return Outcome(req.seq, True, seconds=time.perf_counter() - t0)
        _wait_memory_commit(req, deadline, queue, lambda d: marker_save_id(d / req.marker))
        dest.mkdir(parents=True, exist_ok=True)
        if _part_save_id(part) != req.save_id:
            _after_the_commit_of_my_last_part(req, part, dest, deadline, queue)
            (dest / req.marker).unlink(missing_ok=True)  # whatever stands in dest is not this save from here on
            if req.saving:
                _mark_saving(dest / req.saving, req.save_id)
            part.unlink(missing_ok=True)
            if cfg.io.fsync:
                fsync_dir(dest)
            entries = {}
            for name, entry in req.files:
                expect = FileEntry(**entry)
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                out = persist_image(slot / name, dest / name, cfg, expect=expect)
                if out.nbytes != expect.nbytes:
                    raise IntegrityError(f"{slot / name}: {out.nbytes} bytes persisted, the memory marker says "
                                         f"{expect.nbytes}")
                entries[name] = out
                nbytes += out.nbytes
            if marker_save_id(slot / req.marker) != req.save_id:  # the trainer reused the slot under us
                raise IntegrityError(f"{slot}: overwritten by another save while persisting {req.save_id[:8]}")
            write_atomic(part, Manifest(save_id=req.save_id, files=entries).to_json().encode(), fsync=cfg.io.fsync)
            if cfg.io.fsync:
                fsync_dir(dest)
        _remember_part(part, req.save_id)  # also when redone with its part there (a respawned writer)
        if req.coordinator:
            _commit_files(req, cfg, dest, slot, deadline, queue)
    except Exception as e:  # the outcome file carries it to the trainer
        _mark_failed(req, dest)
        logger.error("persist of step %s (%s) to %s failed: %s", req.step, req.save_id[:8], dest, e)
        return Outcome(req.seq, False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    return Outcome(req.seq, True, seconds=time.perf_counter() - t0, nbytes=nbytes)


def _commit_files(req: PersistRequest, cfg: Config, dest: Path, slot: Path, deadline: float,
                  queue: PersistQueue | None) -> None:
    """The coordinator's durable commit of a file set: every rank's part of this save, then the marker, then the
    pointer. No collective (the parts are files); bounded by ``timeout_s``."""
    parts = [part_path(dest, r) for r in range(req.world_size)]
    _await_parts(req, dest, {p.name: p for p in parts}, deadline, queue)
    try:
        marker = (slot / req.marker).read_bytes()
    except OSError as e:
        raise IntegrityError(f"{slot}: its marker {req.marker} is gone before the durable commit of "
                             f"{req.save_id[:8]}: {e}") from e
    if marker_save_id(slot / req.marker) != req.save_id:
        raise IntegrityError(f"{slot}: overwritten by another save before the durable commit of {req.save_id[:8]}")
    if queue is not None and queue.outcome(req.seq) is not None:  # withdrawn after every part came in
        raise IntegrityError(f"{dest}: the trainer cancelled the persist of {req.save_id[:8]} (step {req.step}); "
                             "not committed")
    write_atomic(dest / req.marker, _durable_marker(marker, parts, dest), fsync=cfg.io.fsync, withdraw=True)
    if req.saving:
        (dest / req.saving).unlink(missing_ok=True)
    (dest / FAILED_NAME).unlink(missing_ok=True)  # an earlier save's failed commit, said here
    for p in parts:
        p.unlink(missing_ok=True)
    if cfg.io.fsync:  # committed already: removals not yet durable leave leftovers (cleaning's), not a failure
        try:
            fsync_dir(dest)
        except OSError as e:
            logger.warning("%s: committed; the removal of its parts is not durable: %s", dest, e)
    if req.pointer:
        _move_pointer(Path(req.pointer[0]), str(req.pointer[1]), req, cfg)


def _durable_marker(marker: bytes, parts: list[Path], dest: Path) -> bytes:
    """The slot's marker for the durable copy: a file whose memory checksums are not crc32c (blocksum32, which a
    GPU can sum) records the checksums its persist computed instead (every rank's part), as a durable checkpoint's
    manifest does, so that a release that knows crc32c only verifies it; the marker is otherwise the slot's."""
    data = json.loads(marker)
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not any(isinstance(f, dict) and f.get("checksum") not in ("crc32c", "none")
                                               for f in files.values()):
        return marker
    persisted: dict[str, FileEntry] = {}
    for part in parts:
        persisted.update(manifest_from_json(part.read_bytes()).files)
    for name, f in files.items():
        if not isinstance(f, dict) or f.get("checksum") in ("crc32c", "none"):
            continue
        entry = persisted.get(name)
        if entry is None:
            raise IntegrityError(f"{dest}: no rank's part lists {name}, which the marker names")
        crcs = entry.chunk_checksums if entry.checksum == "crc32c" else []
        f.update(checksum="crc32c" if crcs else "none", chunk_bytes=entry.chunk_bytes, chunk_checksums=list(crcs))
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _move_pointer(pointer: Path, text: str, req: PersistRequest, cfg: Config) -> None:
    """Point ``pointer`` at ``text`` unless it names a file set of a newer step (a later save committed durably
    first, e.g. one written straight to the durable root): a persist never moves it back."""
    current = read_pointer(pointer) or ""
    newer = marker_step(pointer.parent / current / req.marker) if current and current != text else None
    if newer is not None and req.step is not None and newer > req.step:
        logger.info("%s names %s (step %d), newer than step %d: left as it is", pointer, current, newer, req.step)
        return
    write_atomic(pointer, text.encode(), fsync=cfg.io.fsync)


def replicate_one(req: PersistRequest, queue: PersistQueue | None = None) -> Outcome:
    """Send the slot of ``req``, once committed in memory, to every partner; never raises.

    Every partner is tried; the outcome fails (``replica: ...``) when any did not commit its copy.
    """
    t0 = time.perf_counter()
    cfg = Config.from_dict(req.config, source="replicate request", env=False)
    errors, nbytes = [], 0
    try:
        # a file set's memory commit is its marker (naming the save); a DCP slot's, its .metadata and manifest
        committed = (lambda d: marker_save_id(d / req.marker)) if req.marker else _committed_save_id
        _wait_memory_commit(req, time.monotonic() + cfg.timeout_s, queue, committed)
    except Exception as e:  # never committed in memory: nothing to replicate
        errors.append(f"{type(e).__name__}: {e}")
    else:
        faultpoint.hit(f"replicate:step{req.step}")  # tests: a replica held back (cpuckpt.testing.faults)
        for host, port in req.partners:
            try:
                nbytes += send_slot(Endpoint(host, int(port)), req.token, source=req.source, slot=Path(req.slot),
                                    save_id=req.save_id, into="replica", timeout_s=cfg.timeout_s)
            except Exception as e:  # the next partner still gets its copy
                errors.append(f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    if errors:
        logger.warning("replica of step %s (%s) incomplete: %s", req.step, req.save_id[:8], "; ".join(errors))
        return Outcome(req.seq, False, error="replica: " + "; ".join(errors), seconds=seconds, nbytes=nbytes)
    logger.info("replicated step %s (%s): %d bytes to %d partner(s) in %.3f s", req.step, req.save_id[:8], nbytes,
                len(req.partners), seconds)
    return Outcome(req.seq, True, seconds=seconds, nbytes=nbytes)


def _await_parts(req: PersistRequest, dest: Path, parts: dict[str, Path], deadline: float,
                 queue: PersistQueue | None) -> None:
    """Poll until every rank's part *of this save* (``parts``: name -> path) is in ``dest``; a part of an earlier
    attempt does not count. Raises when the trainers withdrew the persist (a part failed on another rank:
    stop waiting for it) or after ``deadline``."""
    while missing := [name for name, path in parts.items() if _part_save_id(path) != req.save_id]:
        if queue is not None and queue.outcome(req.seq) is not None:
            raise IntegrityError(f"{dest}: the trainer cancelled the persist of {req.save_id[:8]} (step {req.step}) "
                                 f"while {missing} were missing; not committed")
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(f"{dest}: {missing} for save {req.save_id[:8]} never arrived; not committed")
        time.sleep(POLL_S)


def _commit_durable(req: PersistRequest, cfg: Config, memory: Manifest, dest: Path, slot: Path,
                    deadline: float, t0: float, queue: PersistQueue | None = None) -> None:
    prefixes = [f"__{r}_" for r in range(req.world_size)]
    _await_parts(req, dest, {f"the part of {p}": dest / part_name(p) for p in prefixes}, deadline, queue)
    data = _slot_metadata(req, slot, memory)
    # the slot's pickle renamed without torch; where torch is in already (a replica's or `latest`'s completeness
    # check imported it), or the shape or size is another, unpickled (C speed) and renamed
    metadata = None if "torch" in sys.modules else with_checkpoint_id(data, str(dest))
    if metadata is None:
        metadata = parse_metadata(data, slot / METADATA_NAME)
        metadata.storage_meta.checkpoint_id = str(dest)
    commit_checkpoint(dest, metadata, prefixes, _durable_manifest(req, memory, t0), fsync=cfg.io.fsync,
                      parts_of=req.save_id)  # a rank's writer gone on to a later save of this name replaced its part
    (dest / FAILED_NAME).unlink(missing_ok=True)  # an earlier save's failed commit, said here
    after_commit(dest, cfg)


def _slot_metadata(req: PersistRequest, slot: Path, manifest: Manifest) -> bytes:
    """The ``.metadata`` bytes of the request's save in ``slot`` (its memory ``manifest``), for its durable commit.
    Raises when the slot holds another save by now, or bytes other than those committed with the manifest (damaged
    in RAM: a durable commit of them would be complete and wrong)."""
    data = read_metadata_bytes(slot)
    if _committed_save_id(slot) != req.save_id:
        raise IntegrityError(f"{slot}: overwritten by another save before the durable commit of {req.save_id[:8]}")
    damage = metadata_damage(manifest, data)
    if damage:
        raise CheckpointCorrupt(f"{slot}: {damage}; not persisted")
    return data


def _durable_manifest(req: PersistRequest, memory: Manifest, t0: float) -> Manifest:
    """The durable checkpoint's manifest header: the memory save's, with this persist's time."""
    return Manifest(cpuckpt_version=memory.cpuckpt_version, torch_version=memory.torch_version,
                    save_id=memory.save_id, step=memory.step, created_unix=memory.created_unix,
                    world_size=memory.world_size, config=req.config,
                    timings={**memory.timings, "coordinator_persist_s": time.perf_counter() - t0})


def lock_held(path: Path) -> bool:
    """Whether some process holds ``path``'s flock (released when its holder exits, zombie or not)."""
    return lock_holder(path) is not None


def serve(queue: PersistQueue, trainer_lock: Path, writer_lock: Path | None = None) -> int:
    """Process owed requests until the trainer is gone (or stop was asked) and nothing is owed.

    Leaving, it marks itself so beside ``writer_lock`` (:func:`~cpuckpt.tier.ramroot.mark_leaving`), then looks at the
    trainer's lock once more: a new trainer that took it meanwhile, and adopted this writer without seeing the mark,
    keeps it serving (the mark is withdrawn); one that saw the mark waits for this process to end instead."""
    failures = 0
    while True:
        owed = queue.owed()
        if owed:
            outcome = persist_one(owed[0], queue)
            if queue.outcome(outcome.seq) is not None and not outcome.ok:
                continue  # cancelled by the trainer: its outcome stands
            failures += not outcome.ok
            queue.finish(outcome)
            continue
        # Listed again *after* the trainer's lock was seen free (or stop seen): the listing above may predate a
        # request the trainer queued just before it died (this writer paused or preempted between the listing and
        # the probe, e.g. SIGSTOPped); a trainer queues before it releases its lock, so this listing holds it.
        if (queue.stop_requested() or not lock_held(trainer_lock)) and not queue.owed():
            if writer_lock is None:
                return 1 if failures else 0
            mark_leaving(writer_lock)
            if queue.stop_requested() or not lock_held(trainer_lock):
                return 1 if failures else 0
            leaving_marker(writer_lock).unlink(missing_ok=True)  # a new trainer came: it may have adopted this writer
            continue
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cpuckpt.tier.persister", description=__doc__.splitlines()[0])
    ap.add_argument("--queue", required=True, help="this rank's queue directory")
    ap.add_argument("--lock", required=True, help="the writer lock file of this rank")
    ap.add_argument("--lock-fd", type=int, default=-1, help="a descriptor of --lock, already locked for this process "
                    "by the trainer that started it (so the writer counts as alive while its imports run)")
    ap.add_argument("--trainer-lock", required=True, help="the trainer's rank lock: the writer exits once it is free "
                    "and nothing is owed")
    ap.add_argument("--listen", default="", help="receive partners' replicas on this address (memory.replicas)")
    ap.add_argument("--root", default="", help="the RAM root replicas are received into")
    ap.add_argument("--headroom", type=int, default=0, help="memory.headroom_bytes (the RAM bound of replicas)")
    ap.add_argument("--timeout", type=float, default=600.0, help="timeout_s: bound on a replica connection")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpuckpt-writer[%(process)d] %(message)s",
                        stream=sys.stderr)
    # A scheduler's SIGTERM (Slurm signals every process of the step) must not cut a persist short: the
    # writer ends by itself once its trainer is gone and nothing is owed (SIGKILL still ends it).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    lock_fd = args.lock_fd if args.lock_fd >= 0 else acquire_lock(args.lock, wait_s=30.0)
    if lock_fd is None:
        logger.error("%s is held by another writer of this rank (pid %s); exiting", args.lock, lock_holder(args.lock))
        return 2
    listener, rx = None, None
    try:
        if args.listen:  # after the lock: the endpoint names this writer's pid, which trainers check
            listener = Listener(Path(args.root), args.listen, headroom_bytes=args.headroom, timeout_s=args.timeout)
            rx = new_executor(1, "cpuckpt-replica-rx")
            rx.submit(listener.serve_forever)
            listener.publish()
        return serve(PersistQueue(args.queue), Path(args.trainer_lock), Path(args.lock))
    finally:
        if listener is not None and rx is not None:
            listener.stop()
            rx.shutdown(wait=True)
        os.close(lock_fd)


if __name__ == "__main__":
    raise SystemExit(main())
