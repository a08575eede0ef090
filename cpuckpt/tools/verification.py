"""Full verification of a checkpoint (``cpuckpt verify``): every byte of every data file. Reads only.

For a cpuckpt checkpoint, ``.metadata``'s crc32c is compared with the one the manifest records
(format 2 on), every chunk of every file in the manifest is read and its checksum (of the entry's kind:
crc32c or blocksum32) compared with the manifest, every file's size with the manifest's, and every
``.metadata`` record must lie inside a listed file. For a stock DCP checkpoint (no manifest) every record is
read and must load: its zip CRCs are checked and a tensor record is loaded with
``torch.load(weights_only=True)``; a non-tensor record that ``weights_only`` refuses (an arbitrary pickled
object) is CRC-checked only, and reported as a note, never unpickled.

All damage is collected (the scan does not stop at the first bad chunk), each naming the file and
the byte range.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpuckpt.backend import s3commit
from cpuckpt.backend.committed import (
    METADATA_NAME,
    NO_MANIFEST,
    expects_manifest,
    metadata_damage,
    parse_metadata,
    read_manifest,
    read_metadata_bytes,
    same_save,
)
from cpuckpt.config import resolve_config
from cpuckpt.errors import CheckpointCorrupt, IntegrityError
from cpuckpt.format.checksums import KINDS, chunk_checksum, verifiable
from cpuckpt.format.manifest import MANIFEST_NAME, FileEntry
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.tier.tagmarker import MARKER_NAME, SAVING_NAME, TagFile, check_dir, held_files
from cpuckpt.transfer.objstore import ObjectStore, open_store

__all__ = ["Damage", "VerifyReport", "verify_checkpoint"]

_READ_BYTES = 8 * 1024 * 1024  # stock records are read in pieces of at most this


@dataclass
class Damage:
    """One problem: which file, which bytes, what is wrong."""

    file: str
    lo: int
    hi: int
    what: str

    @property
    def where(self) -> str:
        """The byte range, when the damage has one (a whole file's, such as a garbled marker's, has none)."""
        return f"bytes [{self.lo}, {self.hi}): " if self.hi > self.lo else ""

    def __str__(self) -> str:
        return f"{self.file}: {self.where}{self.what}"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`."""

    path: Path | S3Url
    kind: str  # "cpuckpt", "dcp" or "deepspeed" (a tag of cpuckpt's DeepSpeed engine)
    files: int = 0
    chunks: int = 0  # chunks (cpuckpt) or records (stock) checked
    nbytes: int = 0  # bytes read
    damage: list[Damage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)  # files or records whose contents could not be checked

    @property
    def ok(self) -> bool:
        return not self.damage


class _Files:
    """A checkpoint directory's data files: sizes and byte ranges."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def size(self, name: str) -> int | None:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    def read(self, name: str, lo: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``lo`` (fewer at the end). Raises FileNotFoundError when it is missing."""
        with open(self.root / name, "rb", buffering=0) as f:
            return os.pread(f.fileno(), n, lo)


class _Objects:
    """A checkpoint prefix's data objects in object storage: sizes by HEAD, ranges by ranged GET."""

    def __init__(self, store: ObjectStore, root: S3Url) -> None:
        self.store, self.root = store, root

    def size(self, name: str) -> int | None:
        info = self.store.head(self.root / name)
        return None if info is None else info.nbytes

    def read(self, name: str, lo: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self.store.get_into(self.root / name, lo, memoryview(buf))
        return bytes(buf[:got])


def verify_checkpoint(path: str | os.PathLike | S3Url, *,
                      progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Read and check every byte of the checkpoint at ``path``.

    Args:
        path: a committed checkpoint directory, or an ``s3://`` checkpoint prefix.
        progress: called with the number of bytes just read (for a progress bar).

    Returns:
        The report; ``report.ok`` is False when anything is damaged.

    Raises:
        IntegrityError: no ``.metadata`` (not committed), or an unreadable or refused ``.metadata``
            or manifest: nothing else can be checked.
    """
    where = checkpoint_path(path)
    if isinstance(where, Path | str) and _is_tag(Path(where)):
        return _verify_tag(Path(where), progress or (lambda n: None))
    files: _Files | _Objects
    if isinstance(where, S3Url):
        p: Path | S3Url = where
        store = open_store(resolve_config(None).s3)
        data = s3commit.read_metadata_bytes(store, where)
        manifest = s3commit.read_manifest(store, where)
        files = _Objects(store, where)
    else:
        p = Path(where)
        data = read_metadata_bytes(p)
        manifest = read_manifest(p)
        files = _Files(p)
    # The manifest records .metadata's crc32c: a changed byte is damage whatever it does to the unpickling (a
    # refused opcode, a save id that reads as another save's), named as such, exit 1, not "cannot verify".
    damage = metadata_damage(manifest, data) if manifest is not None else ""
    try:
        md = parse_metadata(data, p / METADATA_NAME)
    except CheckpointCorrupt as e:
        if not damage:
            raise
        assert manifest is not None
        report = VerifyReport(p, "cpuckpt")
        report.damage.append(Damage(METADATA_NAME, 0, len(data), f"{damage} ({e})"))
        _verify_files(report, files, manifest.files, progress or (lambda n: None), listed_by="the manifest")
        return report
    tick = progress or (lambda n: None)
    other_save = manifest is not None and not same_save(manifest, md)
    if other_save and damage and expects_manifest(md):  # cpuckpt's own .metadata, not the one its manifest records
        assert manifest is not None
        report = VerifyReport(p, "cpuckpt")
        report.damage.append(Damage(METADATA_NAME, 0, len(data), f"{damage}, or the manifest is another save's "
                                    f"(the manifest's save {manifest.save_id[:8]}, .metadata's "
                                    f"{str(md.storage_meta.save_id)[:8]})"))
        return report
    if other_save:
        manifest = None  # a stock save committed over a cpuckpt one: the manifest describes the old files
    if manifest is None and expects_manifest(md) and (other_save or files.size(MANIFEST_NAME) is None):
        report = VerifyReport(p, "cpuckpt")  # cpuckpt's .metadata: its checksums are gone, not a stock checkpoint
        report.damage.append(Damage(MANIFEST_NAME, 0, 0, NO_MANIFEST))
        return report
    if manifest is None:
        return _verify_stock(p, files, md, tick)
    report = VerifyReport(p, "cpuckpt")
    if damage:
        report.damage.append(Damage(METADATA_NAME, 0, len(data), damage))
    _verify_files(report, files, manifest.files, tick, listed_by="the manifest")
    # (a .metadata other than its manifest's: its records are not what was saved, only the one damage is named)
    for idx, sinfo in () if damage else (md.storage_data or {}).items():
        entry = manifest.files.get(sinfo.relative_path)
        end = int(sinfo.offset) + int(sinfo.length)
        if entry is None:
            report.damage.append(Damage(sinfo.relative_path, int(sinfo.offset), end,
                                        f".metadata record of {idx.fqn} is in a file the manifest does not list"))
        elif end > entry.nbytes:
            report.damage.append(Damage(sinfo.relative_path, int(sinfo.offset), end,
                                        f".metadata record of {idx.fqn} ends past the file's {entry.nbytes} bytes"))
    return report


def _verify_files(report: VerifyReport, files: _Files | _Objects, entries: Mapping[str, FileEntry | TagFile],
                  tick: Callable[[int], None], *, listed_by: str) -> None:
    """Every listed file at its listed size, every chunk's checksum (a manifest's files, or a DeepSpeed tag
    marker's)."""
    for name, entry in sorted(entries.items()):
        report.files += 1
        actual = files.size(name)
        if actual is None:  # missing: nothing more to read
            report.damage.append(Damage(name, 0, entry.nbytes, "data file is missing"))
            continue
        if actual != entry.nbytes:
            lo, hi = sorted((actual, entry.nbytes))
            where = "on disk" if isinstance(files, _Files) else "in the store"
            report.damage.append(Damage(name, lo, hi, f"{actual} bytes {where}, {listed_by} says {entry.nbytes} "
                                        "(truncated or overwritten)"))
        if not verifiable(entry):
            if entry.checksum not in KINDS or entry.nbytes:  # an empty file has no chunks: nothing to check
                report.notes.append(f"{name}: written with checksum {entry.checksum!r}; contents not verifiable")
                report.unverified.append(name)
            continue
        cb = entry.chunk_bytes
        for c, stored in enumerate(entry.chunk_checksums):
            lo, hi = c * cb, min((c + 1) * cb, entry.nbytes)
            data = files.read(name, lo, hi - lo)
            report.chunks += 1
            report.nbytes += len(data)
            tick(len(data))
            if len(data) < hi - lo:
                report.damage.append(Damage(name, lo + len(data), hi, "missing (file ends early)"))
                if not data:
                    continue
            crc = chunk_checksum(entry.checksum, data)
            if len(data) == hi - lo and crc != stored:
                report.damage.append(Damage(name, lo, hi, f"checksum mismatch in chunk {c}: stored "
                                            f"{entry.checksum} {stored}, read {crc}"))


def _is_tag(p: Path) -> bool:
    """A DeepSpeed tag directory written by cpuckpt's engine (its marker, or its saving file), not a DCP one."""
    return not (p / METADATA_NAME).exists() and ((p / MARKER_NAME).exists() or (p / SAVING_NAME).exists())


def _verify_tag(p: Path, tick: Callable[[int], None]) -> VerifyReport:
    """A DeepSpeed tag of cpuckpt's engine: every file its marker lists, at its size, every chunk's checksum.

    Raises:
        IntegrityError: its save never committed (no marker): nothing to check against.
    """
    status = check_dir(p)
    if status.marker is None and status.committed:  # its marker, written last, damaged since: damage, as ls says
        report = VerifyReport(p, "deepspeed")
        marker = f"{p / MARKER_NAME}: "  # the line names the marker's path once
        report.damage.append(Damage(MARKER_NAME, 0, 0, "; ".join(w.removeprefix(marker) for w in status.problems)))
        return report
    if status.marker is None:
        raise IntegrityError(f"{p}: DeepSpeed tag {status.state}: " + ("; ".join(status.problems) or "no marker"))
    report = VerifyReport(p, "deepspeed")
    _verify_files(report, _Files(p), held_files(p, status.marker), tick, listed_by="the marker")
    return report


def _verify_stock(p: Path | S3Url, files: _Files | _Objects, md: object,
                  tick: Callable[[int], None]) -> VerifyReport:
    report = VerifyReport(p, "dcp")
    storage = getattr(md, "storage_data", None) or {}
    report.files = len({s.relative_path for s in storage.values()})
    for idx, sinfo in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, int(kv[1].offset))):
        rel, lo = sinfo.relative_path, int(sinfo.offset)
        hi = lo + int(sinfo.length)
        if files.size(rel) is None:
            report.damage.append(Damage(rel, lo, hi, f"data file is missing (record of {idx.fqn})"))
            continue
        buf = bytearray()
        while len(buf) < hi - lo:
            piece = files.read(rel, lo + len(buf), min(_READ_BYTES, hi - lo - len(buf)))
            if not piece:
                break
            buf += piece
            tick(len(piece))
        report.chunks += 1
        report.nbytes += len(buf)
        if len(buf) < hi - lo:
            report.damage.append(Damage(rel, lo + len(buf), hi, f"record of {idx.fqn} is cut short (file ends)"))
            continue
        problem = _check_record(bytes(buf), is_tensor=_is_tensor(md, idx.fqn))
        if problem is None:
            continue
        if problem.startswith("note:"):
            report.notes.append(f"{rel} [{lo}, {hi}) ({idx.fqn}): {problem[5:].strip()}")  # its zip CRCs held
        else:
            report.damage.append(Damage(rel, lo, hi, f"record of {idx.fqn}: {problem}"))
    return report


def _is_tensor(md: object, fqn: str) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(getattr(md, "state_dict_metadata", {}).get(fqn), TensorStorageMetadata)


def _check_record(buf: bytes, *, is_tensor: bool) -> str | None:
    """None if the record is sound, ``"note: ..."`` if only partly checkable, else what is wrong."""
    try:
        with zipfile.ZipFile(io.BytesIO(buf)) as z:
            bad = z.testzip()  # reads every entry and checks its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"not a valid torch.save archive ({e})"
    if bad is not None:
        return f"zip entry {bad} fails its CRC-32"
    try:
        obj = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    except Exception as e:
        if is_tensor:
            return f"does not load as a tensor ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return "note: CRCs ok; holds objects torch.load(weights_only=True) refuses, so it was not unpickled"
    if is_tensor and not isinstance(obj, torch.Tensor):
        return f"holds a {type(obj).__name__}, not a tensor"
    return None

