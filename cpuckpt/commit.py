"""The commit protocol: what makes a checkpoint complete, and reading ``.metadata`` safely.

A save is complete when ``.metadata`` exists. The coordinator removes any old ``.metadata`` before
the first data byte is written, and writes the new one last, after every rank's files are durable
and the merged manifest is on disk (each via tmp + fsync + rename, then a directory fsync). A
directory without ``.metadata`` is therefore recognisably incomplete, to stock DCP and to us.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import pathlib
import pickle
import signal
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointCorrupt, IntegrityError
from .fileio import fsync_dir
from .manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_from_json, part_name

__all__ = [
    "METADATA_NAME",
    "clear_commit",
    "commit_checkpoint",
    "is_complete",
    "load_metadata",
    "read_manifest",
    "test_hook",
    "write_atomic",
]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"

TEST_HOOK_ENV = "CPUCKPT_TEST_HOOK"


def test_hook(stage: str) -> None:
    """Test hook: act at a named stage of the commit path when ``$CPUCKPT_TEST_HOOK`` asks for it.

    ``CPUCKPT_TEST_HOOK="<stage>=kill"`` SIGKILLs this process when it reaches ``<stage>``;
    ``"<stage>=sleep:<seconds>"`` sleeps there; ``"<stage>=raise"`` raises ``RuntimeError``. Several
    ``;``-separated entries may be given. Stages:
    ``before-rename:<name>`` / ``after-rename:<name>`` around every atomic write (``<name>`` is
    ``.metadata``, ``.cpuckpt.json``, ``__<r>_.cpuckpt-part.json`` or ``latest``),
    ``clear-commit:done``, ``commit:parts-deleted``, ``retention:metadata-removed``, and
    ``megatron-worker:rank<r>`` in the Megatron adapter's worker. Used by the
    fault suite to kill a save at exact points; unset (the normal case) it costs one dict lookup.
    """
    spec = os.environ.get(TEST_HOOK_ENV)
    if not spec:
        return
    for entry in spec.split(";"):
        where, _, action = entry.rpartition("=")
        if where != stage:
            continue
        if action == "kill":
            logger.warning("test hook: SIGKILL at %s", stage)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("sleep:"):
            time.sleep(float(action[len("sleep:"):]))
        elif action == "raise":
            raise RuntimeError(f"test hook: raise at {stage}")


def write_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``path`` via a temporary file, fsync, rename, and fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    test_hook(f"before-rename:{path.name}")
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
    test_hook(f"after-rename:{path.name}")


def clear_commit(path: Path, *, fsync: bool = True) -> None:
    """Make an existing checkpoint in ``path`` incomplete before it is overwritten."""
    removed = False
    for name in (METADATA_NAME, MANIFEST_NAME):
        try:
            (path / name).unlink()
            removed = True
        except FileNotFoundError:
            pass
    if removed and fsync:
        fsync_dir(path)
    test_hook("clear-commit:done")


def is_complete(path: str | os.PathLike) -> bool:
    """True when the checkpoint in ``path`` was committed (its ``.metadata`` exists)."""
    return (Path(path) / METADATA_NAME).is_file()


def commit_checkpoint(path: Path, metadata: Metadata, prefixes: list[str], manifest: Manifest, *, fsync: bool) -> None:
    """Coordinator only: merge the ranks' manifest parts, check file sizes, write manifest then ``.metadata``.

    Raises:
        IntegrityError: a rank's part is missing or a data file's size differs from what it wrote.
    """
    for prefix in prefixes:
        part = path / part_name(prefix)
        try:
            entries = manifest_from_json_part(part.read_bytes())
        except (OSError, ValueError, TypeError) as e:
            raise IntegrityError(f"{part}: manifest part of a rank is missing or unreadable: {e}") from e
        for entry in entries:
            size = (path / entry.name).stat().st_size
            if size != entry.nbytes:
                raise IntegrityError(f"{path / entry.name}: {size} bytes on disk, the writer wrote {entry.nbytes}")
            manifest.files[entry.name] = entry
    write_atomic(path / MANIFEST_NAME, manifest.to_json().encode(), fsync=fsync)
    write_atomic(path / METADATA_NAME, pickle.dumps(metadata), fsync=fsync)
    for prefix in prefixes:
        try:
            (path / part_name(prefix)).unlink()
        except FileNotFoundError:
            pass
    test_hook("commit:parts-deleted")


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
    from .manifest import FORMAT_VERSION

    if manifest.min_reader_version > FORMAT_VERSION:
        logger.warning(
            "%s was written by a newer cpuckpt (format %d needs reader >= %d); reading it as a stock "
            "DCP checkpoint without checksums", path, manifest.format_version, manifest.min_reader_version,
        )
        return None
    return manifest


# ------------------------------------------------------------------------------ safe .metadata load

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}
# DCP's metadata classes, and its plan classes: megatron-core stores every rank's SavePlan in
# ``.metadata`` (``all_local_plans``) to reuse the global metadata on the next save.
for _module in (dcp_metadata, dcp_planner):
    for _name in dir(_module):
        _obj = getattr(_module, _name)
        if isinstance(_obj, type) and getattr(_obj, "__module__", "") == _module.__name__:
            _ALLOWED[(_module.__name__, _name)] = _obj
# megatron-core's own plan/metadata dataclasses, resolved only if a checkpoint names them.
_LAZY_ALLOWED = {("megatron.core.dist_checkpointing.strategies.torch", n) for n in ("MCoreSavePlan", "MCoreMetadata")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes, torch dtypes and a few plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if (module, name) in _LAZY_ALLOWED:
            return getattr(importlib.import_module(module), name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


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
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointCorrupt(f"{md_path}: refused or unreadable metadata: {e}") from e
    if not isinstance(md, Metadata):
        raise CheckpointCorrupt(f"{md_path}: holds a {type(md).__name__}, not DCP Metadata")
    return md
