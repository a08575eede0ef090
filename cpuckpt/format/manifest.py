"""The sidecar manifest: JSON, versioned, ignored by stock tools. Pure: (de)serialization only.

Compatibility policy (see docs/FORMAT.md):
- ``format_version`` grows when fields are added; every field added later has a default, so a
  reader fills in what an older file lacks.
- A reader ignores fields it does not know.
- ``min_reader_version`` is raised only when older readers would misread the data. A reader older
  than that does not guess: it ignores the manifest and reads the checkpoint like a stock DCP one
  (the data files are stock-compatible), without checksums, and logs a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import crc32c

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "WRITER_MARK",
    "FileEntry",
    "Manifest",
    "manifest_from_json",
    "part_name",
    "signed_json",
]

FORMAT_VERSION = 3  # 2: metadata_crc32c; 3: manifest_crc32c
MIN_READER_VERSION = 1
MANIFEST_NAME = ".cpuckpt.json"
# In ``.metadata``'s ``StorageMeta.modules`` (a list DCP keeps and never reads): written by cpuckpt, so its manifest
# belongs beside it. Without one (deleted, or one of another save) the checksums are gone: the checkpoint is damaged,
# not a stock one to load unchecked.
WRITER_MARK = "cpuckpt"
_SELF_CRC = "manifest_crc32c"  # the manifest's own checksum, over its canonical JSON without this field


def part_name(prefix: str) -> str:
    """Per-rank manifest part written next to that rank's data files, merged at commit."""
    return f"{prefix}.cpuckpt-part.json"


@dataclass
class FileEntry:
    """One data file: its size, per-chunk checksums and where each tensor record's data starts."""

    name: str
    nbytes: int
    chunk_bytes: int
    checksum: str = "crc32c"
    chunk_checksums: list[int] = field(default_factory=list)
    # [record_offset, data_offset - record_offset] for every tensor record
    records: list[list[int]] = field(default_factory=list)


@dataclass
class Manifest:
    """Everything cpuckpt knows about a checkpoint beyond DCP's ``.metadata``."""

    format: str = "cpuckpt"
    format_version: int = FORMAT_VERSION
    min_reader_version: int = MIN_READER_VERSION
    cpuckpt_version: str = ""
    torch_version: str = ""
    save_id: str = ""
    # crc32c of the ``.metadata`` committed with this manifest (None: a writer of format 1): what tells a pickle
    # damaged after its commit (in RAM, on disk) from the one committed, without unpickling it
    metadata_crc32c: int | None = None
    step: int | None = None
    created_unix: float = 0.0
    world_size: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        # Not dataclasses.asdict: it deep-copies every record of every file (1,168 tensors: ~3,500 nodes and ~4 ms
        # per manifest on a committer thread that shares the trainer's interpreter, twice per save). The fields are
        # JSON values already; json.dumps walks them once.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["files"] = {name: {f.name: getattr(e, f.name) for f in fields(e)} for name, e in self.files.items()}
        return signed_json(data)


def _canonical(data: dict[str, Any]) -> str:
    """The JSON a manifest's own checksum covers: the same text from the writer's fields and a reader's parse."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def signed_json(data: dict[str, Any]) -> str:
    """A manifest's text: ``data`` (its fields as JSON values, without ``manifest_crc32c``) with its own crc32c."""
    body = _canonical(data)
    return f'{body[:-1]},"{_SELF_CRC}":{crc32c.crc32c(body.encode())}}}'


def manifest_from_json(text: str | bytes) -> Manifest:
    """Parse a manifest, filling defaults for fields an older writer did not know and dropping
    fields a newer writer added.

    Raises:
        ValueError: not JSON, or not a cpuckpt manifest.
    """
    try:
        raw = json.loads(text)
    except RecursionError:  # nested deeper than the parser goes: not a manifest (never an escaping error)
        raise ValueError("JSON nested too deep") from None
    if not isinstance(raw, dict) or raw.get("format") != "cpuckpt":
        raise ValueError("not a cpuckpt manifest")
    _check_own_crc(raw)
    known = set(Manifest.__dataclass_fields__)
    kwargs = {k: v for k, v in raw.items() if k in known}
    kwargs.setdefault("format_version", 1)  # the field is there from format 1 on: absent, the writer's was 1
    raw_files = kwargs.get("files")
    if raw_files is None:
        raw_files = {}
    if not isinstance(raw_files, dict):
        raise ValueError("manifest files is not an object")
    file_known = set(FileEntry.__dataclass_fields__)
    files = {}
    for name, entry in raw_files.items():
        if not isinstance(entry, dict):
            raise ValueError(f"manifest entry for {name!r} is not an object")
        if not _inside(name):
            raise ValueError(f"manifest names a file outside the checkpoint: {name!r}")
        files[name] = FileEntry(**{k: v for k, v in entry.items() if k in file_known})
    kwargs["files"] = files
    return Manifest(**kwargs)


def _check_own_crc(raw: dict[str, Any]) -> None:
    """The manifest's own checksum (format 3 on) must match: a damaged offset in ``records``, a damaged checksum or
    size, would otherwise load wrong bytes with nothing noticing (the chunk checksums cover the data files only).

    Raises:
        ValueError: it does not match, or a manifest of format 3 or later has none.
    """
    own = raw.pop(_SELF_CRC, None)
    if own is None:
        version, needs = raw.get("format_version", 1), raw.get("min_reader_version", MIN_READER_VERSION)
        if isinstance(version, int) and version >= 3 and not (isinstance(needs, int) and needs > FORMAT_VERSION):
            raise ValueError(f"manifest of format {version} without its {_SELF_CRC}: damaged")
        return  # formats 1-2; or a newer writer's that sums itself otherwise (read as a stock checkpoint)
    actual = crc32c.crc32c(_canonical(raw).encode())
    if own != actual:
        raise ValueError(f"manifest damaged: its crc32c is {actual}, it records {own}")


def _inside(name: str) -> bool:
    """``name`` is a path inside the checkpoint directory: relative, no ``..``, not empty (a crafted manifest must not
    make ``verify`` or the size checks open or stat a file elsewhere)."""
    parts = name.split("/")
    return bool(name) and "\0" not in name and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)
