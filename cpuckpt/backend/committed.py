"""What a committed checkpoint looks like on disk, read back: ``.metadata`` (safely), the manifest, completeness.

Read-only: the write side of the commit protocol is ``commit``.

Completeness, defined once here (:func:`check_complete`), in three steps:

1. *committed*: ``.metadata``, the commit marker written last by a save, is a non-empty regular file
   (:func:`is_complete`: one ``stat``, nothing read; what a successful save guarantees, and what
   stock DCP looks for);
2. ``.metadata`` is accepted by the restricted unpickler as DCP ``Metadata`` (not parsed when it is the pickle
   whose crc32c the manifest of its save records: a cpuckpt save's own, which the load parses);
3. if a cpuckpt manifest of the same save is there, it parses, ``.metadata`` has the crc32c it
   records (:func:`metadata_damage`; manifests of format 1 record none), and every data file it lists
   exists with the listed size (:func:`size_mismatches`). A stock DCP checkpoint (or a manifest of an earlier
   save that a stock save committed over): every data file ``.metadata``'s records name exists and reaches the
   end of its last record (:func:`short_stock_data`).

The data files' checksums are not read (that is the load's and ``cpuckpt verify``'s job): the whole
check costs one read of ``.metadata`` and one ``stat`` per data file. ``find_latest``, retention, the ``latest``
pointer and ``cpuckpt ls`` use the whole check, so a checkpoint damaged after its commit is never
picked; :func:`is_complete` is step 1 alone, for callers that only ask "did the save commit?".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import crc32c

from cpuckpt.errors import CheckpointCorrupt, IntegrityError, as_storage_error
from cpuckpt.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    WRITER_MARK,
    FileEntry,
    Manifest,
    manifest_from_json,
)
from cpuckpt.format.metapickle import holds_text

if TYPE_CHECKING:  # torch is imported where metadata is unpickled: the writer process mostly never does
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "METADATA_NAME",
    "Completeness",
    "SizeMismatch",
    "check_complete",
    "check_slot_complete",
    "expects_manifest",
    "inside_checkpoint",
    "is_complete",
    "load_metadata",
    "manifest_from_json_part",
    "metadata_damage",
    "parse_metadata",
    "read_manifest",
    "read_metadata_bytes",
    "same_save",
    "short_stock_data",
    "size_mismatch",
    "size_mismatches",
]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"


def is_complete(path: str | os.PathLike) -> bool:
    """True when the checkpoint in ``path`` was committed: ``.metadata`` is a non-empty regular file.

    Step 1 of :func:`check_complete` alone (one ``stat``, nothing is read): the commit protocol's
    answer to "did the save complete?". Whether the files are still intact is
    ``check_complete(path).complete`` (what ``find_latest`` and retention use).
    """
    try:
        return _commit_marker(Path(path))[1] == ""
    except OSError:
        return False


def _commit_marker(path: Path) -> tuple[float | None, str]:
    """(mtime of ``.metadata`` or None, why it is not a commit marker: "" when it is one).

    Raises:
        OSError: ``stat`` failed for another reason than a missing file (permissions, EIO).
    """
    try:
        st = (path / METADATA_NAME).stat()
    except (FileNotFoundError, NotADirectoryError):
        return None, f"no {METADATA_NAME}"
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return st.st_mtime, f"{METADATA_NAME} is empty or not a file"
    return st.st_mtime, ""


@dataclass(frozen=True)
class Completeness:
    """The answer of :func:`check_complete`."""

    complete: bool
    reason: str = ""  # why it is incomplete ("" when complete)
    step: int | None = None  # the manifest's; None for stock DCP checkpoints and unusable manifests
    committed_at: float | None = None  # mtime of .metadata; None when there is none
    # A read or stat failed for another reason than a missing file (permissions, EIO, a stale NFS handle): whether
    # it is complete is unknown. Never loaded as the latest, and never deleted by cleaning or retention.
    unreadable: bool = False
    # The commit marker (a non-empty ``.metadata``) was there in this same look: incomplete then means damaged since
    # the commit, not a torn save. From the one look, never a second one (a commit landing in between is no damage).
    committed: bool = False


def _unreadable(error: OSError, mtime: float | None, step: int | None = None) -> Completeness:
    return Completeness(False, f"cannot be read: {error}", step, mtime, unreadable=True)


def check_complete(path: str | os.PathLike) -> Completeness:
    """Whether the checkpoint in ``path`` is complete (the module docstring's three steps), and why not.

    Never raises for a damaged checkpoint: every problem becomes ``complete=False`` and a reason; one that could
    not be read (not missing: permissions, EIO) is also ``unreadable``.
    """
    path = Path(path)
    try:
        mtime, why = _commit_marker(path)
    except OSError as e:
        return _unreadable(e, None)
    if why:
        return Completeness(False, why, None, mtime)
    return _as_committed(path, _check_committed(path, mtime))


def _as_committed(path: Path, found: Completeness) -> Completeness:
    """``found`` of a checkpoint whose commit marker was there: committed, unless the marker went while it was read
    (cleaning or retention removing it, a save of the directory clearing it): no damage, a checkpoint going."""
    if not found.complete and not os.path.lexists(path / METADATA_NAME):
        return Completeness(False, f"no {METADATA_NAME}", None, None)
    return dataclasses.replace(found, committed=True)


def _check_committed(path: Path, mtime: float | None) -> Completeness:
    """:func:`check_complete` of a checkpoint whose commit marker is there."""
    try:
        data = read_metadata_bytes(path)
        manifest = _manifest_file(path)
        if manifest is not None and _committed_with(manifest, data):
            return _with_sizes(path, manifest, mtime, data)  # a cpuckpt save's own pickle: the load parses it
        metadata = parse_metadata(data, path / METADATA_NAME)  # restricted unpickler: garbage or hostile is refused
    except IntegrityError as e:
        return Completeness(False, str(e), None, mtime)
    except OSError as e:
        return _unreadable(e, mtime)
    if manifest is None or not same_save(manifest, metadata):  # stock DCP (or stock DCP committed over us)
        if expects_manifest(metadata):
            return Completeness(False, NO_MANIFEST, None, mtime)
        try:
            short = short_stock_data(metadata, lambda rel: _stat_size(path / rel), "on disk")
        except OSError as e:
            return _unreadable(e, mtime)
        return Completeness(not short, short, None, mtime)
    return _with_sizes(path, manifest, mtime, data)


def _stat_size(path: Path) -> int | None:
    """``path``'s size, None when missing.

    Raises:
        OSError: ``stat`` failed for another reason than a missing file.
    """
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def check_slot_complete(path: str | os.PathLike) -> Completeness:
    """:func:`check_complete` for a memory tier slot, without unpickling ``.metadata``, so that a writer process
    sending replicas imports no torch (0.2 s of imports instead of 3.5 s and 250 MB of memory per rank).

    Only the tier writes into a slot, always with a manifest: the slot is complete when ``.metadata`` is a whole
    pickle (its last byte the STOP opcode) holding the manifest's save id as a string record (the tier's ids are
    unique per save), its crc32c is the one the manifest records, and the manifest's data files have their sizes:
    a ``.metadata`` damaged in RAM after its commit is never sent to a partner (where it would replace the
    partner's previous replica) nor persisted. Whatever reads the checkpoint still parses it with the restricted
    unpickler.
    """
    path = Path(path)
    try:
        mtime, why = _commit_marker(path)
    except OSError as e:
        return _unreadable(e, None)
    if why:
        return Completeness(False, why, None, mtime)
    return _as_committed(path, _check_slot_committed(path, mtime))


def _check_slot_committed(path: Path, mtime: float | None) -> Completeness:
    """:func:`check_slot_complete` of a slot whose commit marker is there."""
    try:
        data = read_metadata_bytes(path)
        manifest = _manifest_file(path)
    except IntegrityError as e:
        return Completeness(False, str(e), None, mtime)
    except OSError as e:
        return _unreadable(e, mtime)
    if manifest is None:
        return Completeness(False, f"no {MANIFEST_NAME}", None, mtime)
    if not _names_save(manifest, data):
        return Completeness(False, f"{METADATA_NAME} does not name the manifest's save {str(manifest.save_id)[:8]!r}",
                            manifest.step, mtime)
    return _with_sizes(path, manifest, mtime, data)


def _committed_with(manifest: Manifest, data: bytes) -> bool:
    """Whether ``data`` is the ``.metadata`` committed with ``manifest``: a whole pickle with the crc32c the manifest
    records, naming its save. Then step 2 (unpickling: ~15 ms for 1,200 tensors on a 2-core box) is left to the
    load: listing a root of many checkpoints reads each one's ``.metadata`` without parsing it."""
    return (manifest.metadata_crc32c is not None and crc32c.crc32c(data) == manifest.metadata_crc32c
            and _names_save(manifest, data))


def _names_save(manifest: Manifest, data: bytes) -> bool:
    """``data`` is a whole pickle (its last byte the STOP opcode) holding the manifest's save id as a string record."""
    save_id = manifest.save_id
    return isinstance(save_id, str) and bool(save_id) and data.endswith(pickle.STOP) and holds_text(data, save_id)


def metadata_damage(manifest: Manifest, data: bytes | int) -> str:
    """Why ``data`` (a ``.metadata``'s bytes, or their crc32c) is not the pickle committed with ``manifest``: its
    crc32c differs from the one the manifest records; "" when it is the same, or the manifest records none
    (format 1)."""
    if manifest.metadata_crc32c is None:
        return ""
    actual = data if isinstance(data, int) else crc32c.crc32c(data)
    if actual == manifest.metadata_crc32c:
        return ""
    return (f"{METADATA_NAME} is not the one committed with the manifest (crc32c {actual}, the manifest says "
            f"{manifest.metadata_crc32c}): damaged after its commit")


def _with_sizes(path: Path, manifest: Manifest, mtime: float | None, data: bytes) -> Completeness:
    """The last steps of both checks: complete when ``.metadata`` (``data``) is the pickle committed with the
    manifest and every data file the manifest lists has its size."""
    damage = metadata_damage(manifest, data)
    if damage:
        return Completeness(False, damage, manifest.step, mtime)
    try:
        problems = size_mismatches(path, manifest.files, first=True)
    except OSError as e:
        return _unreadable(e, mtime, manifest.step)
    if problems:
        return Completeness(False, f"{problems[0].name}: {problems[0].what}", manifest.step, mtime)
    return Completeness(True, "", manifest.step, mtime)


def expects_manifest(metadata: Metadata) -> bool:
    """``metadata`` was written by cpuckpt (:data:`~cpuckpt.format.manifest.WRITER_MARK`): its manifest belongs beside
    it, and a checkpoint without one of its save is damaged (its checksums gone), not a stock one."""
    modules = getattr(getattr(metadata, "storage_meta", None), "modules", None)
    return isinstance(modules, list) and WRITER_MARK in modules


NO_MANIFEST = (f"its {METADATA_NAME} was written by cpuckpt, but its manifest {MANIFEST_NAME} is missing or of "
               "another save: its checksums are gone")


def same_save(manifest: Manifest, metadata: Metadata) -> bool:
    """False when ``.metadata`` names another save than the manifest: another writer (stock DCP)
    committed over a cpuckpt checkpoint, so the manifest describes old files and must be ignored."""
    md_save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return not (md_save_id and manifest.save_id and md_save_id != manifest.save_id)


# --------------------------------------------------------------------------------------- data file sizes


@dataclass(frozen=True)
class SizeMismatch:
    """A data file whose size on disk is not what the manifest lists (or that is missing)."""

    name: str  # as the manifest lists it
    file: Path
    expected: int | None  # None: any size (only existence was checked)
    actual: int | None  # None: the file is missing

    @property
    def what(self) -> str:
        if self.actual is None:
            return "data file is missing"
        return f"{self.actual} bytes on disk, the manifest says {self.expected} (truncated or overwritten)"

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def size_mismatch(file: str | os.PathLike, expected: int | None, name: str = "") -> SizeMismatch | None:
    """None when ``file`` exists and has ``expected`` bytes (any size when ``expected`` is None).

    Raises:
        OSError: ``stat`` failed for another reason than a missing file.
    """
    file = Path(file)
    size = _stat_size(file)
    if size is None or (expected is not None and size != expected):
        return SizeMismatch(name or file.name, file, expected, size)
    return None


def size_mismatches(path: Path, files: Mapping[str, FileEntry] | Iterable[FileEntry], *,
                    first: bool = False) -> list[SizeMismatch]:
    """The data files in ``path`` whose size differs from their manifest entries (missing ones too).

    ``files``: a manifest's ``files`` (name -> entry), or entries (named by ``entry.name``).
    ``first``: stop at the first mismatch.

    Raises:
        OSError: a ``stat`` failed for another reason than a missing file.
    """
    pairs = files.items() if isinstance(files, Mapping) else ((e.name, e) for e in files)
    out = []
    for name, entry in pairs:
        problem = size_mismatch(path / name, entry.nbytes, name)
        if problem is not None:
            out.append(problem)
            if first:
                break
    return out


def manifest_from_json_part(data: bytes, save_id: str = "") -> list[FileEntry]:
    """A rank's part is a manifest whose ``files`` are that rank's files. With ``save_id``, the part of another
    save into the same directory (a rank gone on to a later save of that name, or one an earlier attempt left) is
    refused: a commit of it would name that save's data under this one's ``.metadata``."""
    part = manifest_from_json(data)
    if save_id and part.save_id != save_id:
        raise ValueError(f"it is the part of save {part.save_id[:8] or '(unnamed)'}, not of {save_id[:8]}")
    return list(part.files.values())


def _manifest_file(path: Path) -> Manifest | None:
    """The parsed manifest file, whatever its version; None when there is none.

    Raises:
        IntegrityError: it does not parse.
    """
    try:
        text = (path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return manifest_from_json(text)
    except (ValueError, TypeError) as e:
        raise IntegrityError(f"{path / MANIFEST_NAME}: unreadable manifest: {e}") from e


def read_manifest(path: Path) -> Manifest | None:
    """The checkpoint's manifest, or None for a stock checkpoint (or one from a too-new writer)."""
    manifest = _manifest_file(path)
    if manifest is None:
        return None
    if manifest.min_reader_version > FORMAT_VERSION:
        logger.warning(
            "%s was written by a newer cpuckpt (format %d needs reader >= %d); reading it as a stock "
            "DCP checkpoint without checksums", path, manifest.format_version, manifest.min_reader_version,
        )
        return None
    return manifest


def load_metadata(path: Path) -> Metadata:
    """Unpickle ``path/.metadata`` without running arbitrary code.

    Raises:
        IntegrityError: missing: the save was never committed (or this is not a checkpoint).
        StorageIOError: it cannot be read (errno and path of the failed read).
        CheckpointCorrupt: present but unreadable, not DCP metadata, or referring to globals
            outside DCP's metadata classes (a hostile or foreign pickle).
    """
    return parse_metadata(read_metadata_bytes(path), path / METADATA_NAME)


def read_metadata_bytes(path: Path) -> bytes:
    """``path/.metadata``'s bytes, not unpickled.

    Raises:
        IntegrityError: missing: the save was never committed (or this is not a checkpoint).
        StorageIOError: it cannot be read (errno and path of the failed read).
    """
    md_path = path / METADATA_NAME
    try:
        return md_path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(
            f"{path}: no {METADATA_NAME}: not a checkpoint, or a save that did not complete"
        ) from None
    except OSError as e:  # unreadable (permissions, a file where the directory should be, EIO): errno and path kept
        raise as_storage_error(e, "cannot read", md_path) from e


def inside_checkpoint(relative_path: str) -> bool:
    """Whether a data file name a ``.metadata`` records stays inside its checkpoint directory (relative, no
    ``..``): every reader, ``verify`` and ``ls`` included, refuses one that does not."""
    p = PurePosixPath(relative_path)
    return bool(p.parts) and not p.is_absolute() and ".." not in p.parts


def short_stock_data(metadata: Metadata, size_of: Callable[[str], int | None], where: str) -> str:
    """The first data file a stock ``.metadata``'s records name that is missing or ends before its last record does
    ("" when none): a stock checkpoint is complete only without one. ``size_of``: a file's size (None: missing);
    ``where``: "on disk", "in the store"."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        if isinstance(info, _StorageInfo):
            need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        size = size_of(rel)
        if size is None:
            return f"{rel}: data file is missing ({where})"
        if size < end:
            return f"{rel}: {size} bytes {where}, its records in {METADATA_NAME} end at {end} (truncated)"
    return ""


def parse_metadata(data: bytes, where: object) -> Metadata:
    """``.metadata``'s bytes as DCP ``Metadata``, through the restricted unpickler (``where`` names it in errors).

    Raises:
        CheckpointCorrupt: refused by the unpickler, unreadable, or not DCP metadata (of DCP's classes, but with a
            field missing or of another type: a damaged attribute name still unpickles).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    from cpuckpt.format.unpickle import unpickle_metadata

    try:
        md = unpickle_metadata(data)
    except Exception as e:
        raise CheckpointCorrupt(f"{where}: refused or unreadable metadata: {str(e) or type(e).__name__}") from e
    if not isinstance(md, Metadata):
        raise CheckpointCorrupt(f"{where}: holds a {type(md).__name__}, not DCP Metadata")
    problem = _malformed(md)
    if problem:
        raise CheckpointCorrupt(f"{where}: malformed DCP metadata: {problem}")
    return md


def _field(obj: object, name: str) -> object:
    """``obj``'s own value of field ``name`` (None when it has none): a field the pickle did not set must not be
    answered by a class-level default."""
    own = getattr(obj, "__dict__", None)
    return own.get(name) if own is not None else getattr(obj, name, None)


def _malformed(md: Metadata) -> str:
    """What of ``md``'s structure the loaders rely on is missing or of another type ("" when nothing): the
    restricted unpickler admits DCP's classes with any attributes, and one damaged name (memoized, so shared by
    every entry) would otherwise surface as an ``AttributeError`` in the middle of a load."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # FileSystemWriter's (and cpuckpt's) records
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    entries = _field(md, "state_dict_metadata")
    if not isinstance(entries, dict):
        return "no state_dict_metadata"
    storage = _field(md, "storage_data")
    if storage is not None and not (isinstance(storage, dict) and all(type(k) is MetadataIndex
                                                                      and isinstance(_field(k, "fqn"), str)
                                                                      for k in storage)):
        return "storage_data is not a map of MetadataIndex"
    for index, info in (storage or {}).items():
        if not isinstance(info, _StorageInfo):
            continue
        rel = _field(info, "relative_path")
        if not (isinstance(rel, str) and isinstance(_field(info, "offset"), int)
                and isinstance(_field(info, "length"), int)):
            return f"the storage record of {_field(index, 'fqn')!r} is not a whole _StorageInfo"
        if not inside_checkpoint(rel):
            return f"the storage record of {_field(index, 'fqn')!r} names {rel!r}, outside the checkpoint directory"
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):  # sizes and offsets: any sequence (torch.Size, tuples of some
            chunks = _field(entry, "chunks")  # writers' chunks, Megatron-FSDP's uneven DTensors), as DCP takes them
            if not (isinstance(_field(entry, "properties"), TensorProperties)
                    and isinstance(_field(entry, "size"), tuple | list) and isinstance(chunks, list)
                    and all(isinstance(c, ChunkStorageMetadata) and isinstance(_field(c, "offsets"), tuple | list)
                            and isinstance(_field(c, "sizes"), tuple | list) for c in chunks)):
                return f"the entry of {fqn!r} is not a whole TensorStorageMetadata"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"the entry of {fqn!r} is a {type(entry).__name__}"
    return ""
