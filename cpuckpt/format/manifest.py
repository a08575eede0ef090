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

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "manifest_from_json",
    "part_name",
]

FORMAT_VERSION = 2  # 2: metadata_crc32c
MIN_READER_VERSION = 1
MANIFEST_NAME = ".cpuckpt.json"


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
        return json.dumps(data, separators=(",", ":"), sort_keys=True)


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
        files[name] = FileEntry(**{k: v for k, v in entry.items() if k in file_known})
    kwargs["files"] = files
    return Manifest(**kwargs)
