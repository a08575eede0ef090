"""What a committed checkpoint looks like on disk, read back: ``.metadata`` (safely), the manifest, completeness.

Read-only: the write side of the commit protocol is ``commit``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from cpuckpt.errors import CheckpointCorrupt, IntegrityError
from cpuckpt.format.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, manifest_from_json
from cpuckpt.format.unpickle import unpickle_metadata

__all__ = ["METADATA_NAME", "is_complete", "load_metadata", "manifest_from_json_part", "read_manifest"]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"


def is_complete(path: str | os.PathLike) -> bool:
    """True when the checkpoint in ``path`` was committed (its ``.metadata`` exists)."""
    return (Path(path) / METADATA_NAME).is_file()


def manifest_from_json_part(data: bytes) -> list[FileEntry]:
    """A rank's part is a manifest whose ``files`` are that rank's files."""
    return list(manifest_from_json(data).files.values())


def read_manifest(path: Path) -> Manifest | None:
    """The checkpoint's manifest, or None for a stock checkpoint (or one from a too-new writer)."""
    try:
        text = (path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = manifest_from_json(text)
    except (ValueError, TypeError) as e:
        raise IntegrityError(f"{path / MANIFEST_NAME}: unreadable manifest: {e}") from e
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
        CheckpointCorrupt: present but unreadable, not DCP metadata, or referring to globals
            outside DCP's metadata classes (a hostile or foreign pickle).
    """
    md_path = path / METADATA_NAME
    try:
        data = md_path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(
            f"{path}: no {METADATA_NAME}: not a checkpoint, or a save that did not complete"
        ) from None
    try:
        md = unpickle_metadata(data)
    except Exception as e:
        raise CheckpointCorrupt(f"{md_path}: refused or unreadable metadata: {e}") from e
    if not isinstance(md, Metadata):
        raise CheckpointCorrupt(f"{md_path}: holds a {type(md).__name__}, not DCP Metadata")
    return md
