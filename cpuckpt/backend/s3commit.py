"""The commit protocol on object storage, where nothing can be renamed: write side and read side.

A checkpoint ``s3://bucket/prefix`` holds the same objects as a directory would (``__<r>_0.distcp``, the
manifest ``.cpuckpt.json``, ``.metadata``), with the same keys and offsets. Order of a save:

1. every rank checks that the bucket can be used (:meth:`S3Target.prepare`);
2. the coordinator refuses a path that holds a committed checkpoint (objects are written once: an
   overwrite would replace the data objects of a complete checkpoint before its ``.metadata`` could be
   removed, and a rename does not exist to make it safe), and aborts multipart uploads a killed save left
   under the prefix (:meth:`S3Target.clear`);
3. every rank uploads its data objects (``transfer.s3sink``), then its manifest part;
4. the coordinator checks every data object's size against the parts, writes the manifest, and last
   ``.metadata`` with a conditional PUT (``If-None-Match: *``): of two writers racing to one path only one
   commits, the other gets :class:`StorageIOError` with ``EEXIST``. Then the parts are deleted.

A save that fails or is killed before step 4 leaves no ``.metadata``: stock DCP, the S3 Connector's
reader and cpuckpt all see an incomplete checkpoint. The read side (:func:`load_metadata`,
:func:`read_manifest`, :func:`size_mismatches`, :func:`check_complete`) mirrors ``committed`` for URLs.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import pickle
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import crc32c

from cpuckpt import faultpoint
from cpuckpt.backend.committed import (
    METADATA_NAME,
    NO_MANIFEST,
    Completeness,
    expects_manifest,
    manifest_from_json_part,
    metadata_damage,
    parse_metadata,
    same_save,
    short_stock_data,
)
from cpuckpt.errors import IntegrityError, StorageIOError
from cpuckpt.format.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, manifest_from_json, part_name
from cpuckpt.paths import S3Url
from cpuckpt.transfer.objstore import ObjectInfo, ObjectStore

if TYPE_CHECKING:  # the writer process commits without torch
    from torch.distributed.checkpoint.metadata import Metadata

    from cpuckpt.transfer.s3sink import S3SinkFactory

__all__ = ["S3Target", "check_complete", "load_metadata", "manifest_save_id", "read_manifest", "read_metadata_bytes",
           "size_mismatches"]

logger = logging.getLogger(__name__)

# Another save's manifest with no .metadata beside it, older than this and than this save's data, is a dead save's:
# a live writer's .metadata PUT (megatron-core's can be hundreds of MB, with the client's retries) follows sooner
MANIFEST_DEAD_AFTER_S = 60.0


class S3Target:
    """The :class:`~cpuckpt.backend.commit.CommitTarget` of a checkpoint in object storage."""

    def __init__(self, store: ObjectStore, url: S3Url, timeout_s: float) -> None:
        self.store = store
        self.url = url
        self.timeout_s = timeout_s  # a save silent this long is dead: the manifest it left is a leftover

    @property
    def sink(self) -> S3SinkFactory:
        from cpuckpt.transfer.s3sink import S3SinkFactory  # trainer side (torch): the writer process makes no sinks

        return S3SinkFactory(self.store, self.url)

    def prepare(self) -> None:
        self.store.check_bucket(self.url)

    def refuse_committed(self) -> None:
        """Raise EEXIST if ``.metadata`` is there: objects are written once, so nothing may overwrite them."""
        if self.store.head(self.url / METADATA_NAME) is not None:
            raise StorageIOError(
                f"{self.url} holds a committed checkpoint: checkpoints in object storage are written once "
                "(nothing can be renamed, so an overwrite could not be made safe); save to a new path, or delete "
                "this one first", path=str(self.url / METADATA_NAME), errno_=errno.EEXIST)

    def clear(self) -> None:
        self.refuse_committed()
        for upload in self.store.list_uploads(self.url.contents):
            logger.info("%s: aborting the multipart upload of %s a killed save left", self.url, upload.url)
            self.store.abort_upload(upload)
        faultpoint.hit("clear-commit:done")

    def write_part(self, prefix: str, data: bytes) -> None:
        self.store.put(self.url / part_name(prefix), data)

    def commit(self, metadata: Metadata, prefixes: list[str], manifest: Manifest, parts_of: str = "") -> None:
        """As :func:`cpuckpt.backend.commit.commit_checkpoint` (``parts_of`` too), for objects."""
        for prefix in prefixes:
            part = self.url / part_name(prefix)
            data = self.store.get(part)
            if data is None:
                raise IntegrityError(f"{part}: manifest part of a rank is missing")
            try:
                entries = manifest_from_json_part(data, parts_of)
            except (ValueError, TypeError) as e:
                raise IntegrityError(f"{part}: manifest part of a rank is unreadable: {e}") from e
            problems = size_mismatches(self.store, self.url, entries, first=True)
            if problems:
                raise IntegrityError(problems[0])
            for entry in entries:
                manifest.files[entry.name] = entry
        if self.store.head(self.url / METADATA_NAME) is not None:
            raise StorageIOError(f"{self.url}: another save committed this checkpoint first ({METADATA_NAME} "
                                 "appeared while this save uploaded); this save's objects may have replaced some "
                                 "of its data, which its checksums will report at load",
                                 path=str(self.url / METADATA_NAME), errno_=errno.EEXIST)
        pickled = pickle.dumps(metadata)
        manifest.metadata_crc32c = crc32c.crc32c(pickled)
        faultpoint.hit(f"before-rename:{MANIFEST_NAME}")
        self._put_manifest(manifest)
        faultpoint.hit(f"before-rename:{METADATA_NAME}")
        if not self.store.put(self.url / METADATA_NAME, pickled, if_absent=True) \
                and not self._committed_by(metadata):
            raise StorageIOError(f"{self.url}: another save committed this checkpoint first (conditional PUT of "
                                 f"{METADATA_NAME} refused); this save's objects may have replaced some of its "
                                 "data, which its checksums will report at load",
                                 path=str(self.url / METADATA_NAME), errno_=errno.EEXIST)
        faultpoint.hit(f"after-rename:{METADATA_NAME}")
        for prefix in prefixes:
            self.store.delete(self.url / part_name(prefix))
        faultpoint.hit("commit:parts-deleted")

    def _put_manifest(self, manifest: Manifest) -> None:
        """Write the manifest only where there is none, so that of two saves racing to one prefix only one gets to
        its ``.metadata``: a loser that replaced the winner's manifest left one of another save beside the winner's
        ``.metadata``, which is then ignored, and the load checked nothing while reading the loser's objects. One of
        this save (a retried commit, a PUT whose response was lost) is kept. Another save's is dead when it is older
        than this save's own data (the server's clock for both): a live writer PUTs its ``.metadata`` right after its
        manifest, not a whole upload later; so is one untouched for ``timeout_s``. A dead one is deleted first.

        Raises:
            StorageIOError: EEXIST, another live save's manifest is there.
        """
        url = self.url / MANIFEST_NAME
        for attempt in range(2):
            if self.store.put(url, manifest.to_json().encode(), if_absent=True):
                return
            if manifest_save_id(self.store, url) == manifest.save_id:
                return  # this save's own, from an earlier attempt
            info = self.store.head(url)
            if attempt or info is None or not self._dead(info.mtime, manifest):
                break
            logger.info("%s: deleting the manifest a dead save left (%.0f s old)", self.url, time.time() - info.mtime)
            self.store.delete(url)
        raise StorageIOError(f"{self.url}: another save is committing this checkpoint (its {MANIFEST_NAME} is there "
                             f"without a {METADATA_NAME}); this save's objects may have replaced some of its data, "
                             "which its checksums will report at load", path=str(url), errno_=errno.EEXIST)

    def _dead(self, mtime: float, manifest: Manifest) -> bool:
        """Whether another save's manifest written at ``mtime`` (the server's time) is a dead save's: untouched for
        ``timeout_s``, or older than this save's own data and than :data:`MANIFEST_DEAD_AFTER_S` (a live writer's
        ``.metadata`` PUT, retries included, follows its manifest sooner), with still no ``.metadata`` beside it."""
        age = time.time() - mtime
        if age < self.timeout_s:
            ours = next(iter(sorted(manifest.files)), None)
            first = self.store.head(self.url / ours) if ours is not None else None
            if first is None or mtime >= first.mtime or age < MANIFEST_DEAD_AFTER_S:
                return False
        return self.store.head(self.url / METADATA_NAME) is None

    def _committed_by(self, metadata: Metadata) -> bool:
        """Whether the ``.metadata`` that refused our conditional PUT is our own: the client retries a PUT
        whose response was lost, and the retry is refused by the write that succeeded."""
        ours = getattr(metadata.storage_meta, "save_id", None)
        try:
            theirs = getattr(load_metadata(self.store, self.url).storage_meta, "save_id", None)
        except IntegrityError:  # gone again, or not ours to read: not committed by this save
            return False
        if ours and theirs == ours:
            logger.info("%s: the conditional PUT of %s was refused by this save's own earlier attempt (its "
                        "response was lost); committed", self.url, METADATA_NAME)
            return True
        return False


def size_mismatches(store: ObjectStore, url: S3Url, files: Mapping[str, FileEntry] | Iterable[FileEntry], *,
                    first: bool = False) -> list[str]:
    """The data objects under ``url`` whose size differs from their manifest entries (missing ones too), as
    messages naming the object."""
    pairs = files.items() if isinstance(files, Mapping) else ((e.name, e) for e in files)
    out = []
    for name, entry in pairs:
        info = store.head(url / name)
        if info is None or info.nbytes != entry.nbytes:
            what = "data object is missing" if info is None else \
                f"{info.nbytes} bytes in the store, the manifest says {entry.nbytes} (truncated or overwritten)"
            out.append(f"{url / name}: {what}")
            if first:
                break
    return out


def load_metadata(store: ObjectStore, url: S3Url) -> Metadata:
    """Unpickle ``url/.metadata`` with the restricted unpickler (as ``committed.load_metadata``).

    Raises:
        IntegrityError: missing (a save that did not complete, or not a checkpoint).
        StorageIOError: it cannot be read.
        CheckpointCorrupt: present but refused or not DCP metadata.
    """
    return parse_metadata(read_metadata_bytes(store, url), url / METADATA_NAME)


def read_metadata_bytes(store: ObjectStore, url: S3Url) -> bytes:
    """``url/.metadata``'s bytes, not unpickled.

    Raises:
        IntegrityError: missing (a save that did not complete, or not a checkpoint).
        StorageIOError: it cannot be read.
    """
    data = store.get(url / METADATA_NAME)
    if data is None:
        raise IntegrityError(f"{url}: no {METADATA_NAME}: not a checkpoint, or a save that did not complete")
    return data


def read_manifest(store: ObjectStore, url: S3Url) -> Manifest | None:
    """The checkpoint's manifest; None for a stock checkpoint (or one from a too-new writer).

    Raises:
        IntegrityError: it does not parse.
    """
    data = store.get(url / MANIFEST_NAME)
    if data is None:
        return None
    try:
        manifest = manifest_from_json(data)
    except (ValueError, TypeError) as e:
        raise IntegrityError(f"{url / MANIFEST_NAME}: unreadable manifest: {e}") from e
    if manifest.min_reader_version > FORMAT_VERSION:
        logger.warning("%s was written by a newer cpuckpt (reader >= %d); reading it as a stock DCP checkpoint",
                       url, manifest.min_reader_version)
        return None
    return manifest


def check_complete(store: ObjectStore, url: S3Url) -> Completeness:
    """``committed.check_complete`` for a URL: ``.metadata`` there and accepted, the manifest of the same save
    parses and records ``.metadata``'s crc32c (format 2 on), every data object it lists has its size. Never
    raises for a damaged checkpoint.

    Raises:
        StorageIOError: an object could not be read (server gone, timeout, 5xx after retries). Never reported
            as "incomplete": cleaning deletes incomplete prefixes, and a read error says nothing about one.
    """
    info = store.head(url / METADATA_NAME)
    if info is None or info.nbytes == 0:
        return Completeness(False, f"no {METADATA_NAME}" if info is None else f"{METADATA_NAME} is empty")
    faultpoint.hit(f"s3-complete:{url.name}")
    return dataclasses.replace(_check_committed(store, url, info), committed=True)


def _check_committed(store: ObjectStore, url: S3Url, info: ObjectInfo) -> Completeness:
    """:func:`check_complete` of a prefix whose ``.metadata`` object is there, not empty (``info``)."""
    try:
        data = read_metadata_bytes(store, url)
        metadata = parse_metadata(data, url / METADATA_NAME)
        manifest = read_manifest(store, url)
    except IntegrityError as e:  # gone since the HEAD, refused or unparsable: damage, not a read error
        return Completeness(False, str(e), None, info.mtime)
    if manifest is None or not same_save(manifest, metadata):  # stock DCP: its records' objects, long enough
        if expects_manifest(metadata) and (manifest is not None or store.head(url / MANIFEST_NAME) is None):
            return Completeness(False, NO_MANIFEST, None, info.mtime)  # (a too-new writer's: read as stock)
        short = _short_stock_object(store, url, metadata)
        return Completeness(not short, short, None, info.mtime)
    damage = metadata_damage(manifest, data)
    if damage:
        return Completeness(False, damage, manifest.step, info.mtime)
    problems = size_mismatches(store, url, manifest.files, first=True)
    if problems:
        return Completeness(False, problems[0], manifest.step, info.mtime)
    return Completeness(True, "", manifest.step, info.mtime)


def _short_stock_object(store: ObjectStore, url: S3Url, metadata: Metadata) -> str:
    """:func:`~cpuckpt.backend.committed.short_stock_data` of a prefix: sizes from one listing of it (a request per
    1,000 objects, made only if a record names an object), not a HEAD per object."""
    sizes: dict[str, int] = {}

    def size_of(rel: str) -> int | None:
        if not sizes:
            base = url.contents
            sizes.update({o.key[len(base.key):]: o.nbytes for o in store.list(base)})
        return sizes.get(rel)

    return short_stock_data(metadata, size_of, "in the store")


def manifest_save_id(store: ObjectStore, url: S3Url) -> str | None:
    """The save a manifest object (a checkpoint's, or a rank's part) belongs to (None: none there, or unusable)."""
    try:
        data = store.get(url)
        return manifest_from_json(data).save_id or None if data is not None else None
    except (ValueError, TypeError, KeyError):
        return None
