"""The commit protocol, write side: what makes a checkpoint complete (reading it back is ``committed``).

A save is complete when ``.metadata`` exists. The coordinator removes any old ``.metadata`` before
the first data byte is written, and writes the new one last, after every rank's files are durable
and the merged manifest is on disk (each via tmp + fsync + rename, then a directory fsync). A
directory without ``.metadata`` is therefore recognisably incomplete, to stock DCP and to us.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import crc32c

from cpuckpt import faultpoint
from cpuckpt.backend.committed import METADATA_NAME, manifest_from_json_part, size_mismatches
from cpuckpt.errors import IntegrityError, as_storage_error
from cpuckpt.format.manifest import MANIFEST_NAME, Manifest, part_name
from cpuckpt.format.metapickle import dumps_metadata
from cpuckpt.transfer.files import fsync_dir, write_atomic

if TYPE_CHECKING:  # the writer process commits without torch
    from torch.distributed.checkpoint.metadata import Metadata

    from cpuckpt.transfer.sinks import SinkFactory

__all__ = ["CommitTarget", "LocalTarget", "clear_commit", "commit_checkpoint", "make_checkpoint_dir"]

logger = logging.getLogger(__name__)


def make_checkpoint_dir(path: Path) -> None:
    """Create the checkpoint directory ``path`` (and its parents) if missing.

    Raises:
        StorageIOError: it cannot be created (a file is in the way, a read-only parent, ...): errno and
            the path kept, as for any other write of a save.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise as_storage_error(e, "cannot create checkpoint directory", path) from e


def clear_commit(path: Path, *, fsync: bool = True) -> None:
    """Make an existing checkpoint in ``path`` incomplete before it is overwritten.

    ``fsync``: the directory is fsynced after the removal, so that after a crash no old ``.metadata`` comes back
    beside rewritten data. Only the memory tier's own clears of its RAM slots (gone with the machine) skip it; a
    save never does, ``io.fsync: false`` or not (FORMAT.md §2, step 1).

    Raises:
        StorageIOError: its ``.metadata`` or manifest exists and cannot be removed.
    """
    removed = False
    for name in (METADATA_NAME, MANIFEST_NAME):
        try:
            (path / name).unlink()
            removed = True
        except FileNotFoundError:
            pass
        except OSError as e:
            raise as_storage_error(e, "cannot remove the commit marker of the checkpoint being overwritten",
                                   path / name) from e
    if removed and fsync:
        fsync_dir(path)
    faultpoint.hit("clear-commit:done")


def commit_checkpoint(path: Path, metadata: Metadata | bytes, prefixes: list[str], manifest: Manifest, *,
                      fsync: bool, parts_of: str = "") -> None:
    """Coordinator only: merge the ranks' manifest parts, check file sizes, write manifest then ``.metadata``
    (``metadata``, or its pickle's bytes as they are). ``parts_of``: the save id every part must carry (the
    memory tier's persists, whose ranks' writers go on to the next request on their own).

    Raises:
        IntegrityError: a rank's part is missing, of another save, or a data file's size differs from what it
            wrote.
    """
    for prefix in prefixes:
        part = path / part_name(prefix)
        try:
            entries = manifest_from_json_part(part.read_bytes(), parts_of)
        except FileNotFoundError as e:  # its rank reported success: it wrote the part, but elsewhere (or went on)
            why = ("its rank's writer went on to another save of this name" if parts_of else "every rank must save "
                   "to this same directory, on a filesystem that all ranks share (a rank given another path, or "
                   "node-local disks)")
            raise IntegrityError(f"{part}: the manifest part of a rank that reported success is not here: {why}") from e
        except (OSError, ValueError, TypeError) as e:
            raise IntegrityError(f"{part}: manifest part of a rank is missing or unreadable: {e}") from e
        problems = size_mismatches(path, entries, first=True)
        if problems:
            raise IntegrityError(str(problems[0]))
        for entry in entries:
            manifest.files[entry.name] = entry
    pickled = metadata if isinstance(metadata, bytes) else dumps_metadata(metadata)
    manifest.metadata_crc32c = crc32c.crc32c(pickled)
    for name, data in ((MANIFEST_NAME, manifest.to_json().encode()), (METADATA_NAME, pickled)):
        try:
            write_atomic(path / name, data, fsync=fsync, withdraw=name == METADATA_NAME)
        except OSError as e:
            raise as_storage_error(e, "cannot write", path / name) from e
    for prefix in prefixes:  # committed already: a part left behind is a leftover (cleaning removes it), not a failure
        try:
            (path / part_name(prefix)).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("%s: committed; its manifest part %s could not be removed: %s", path, part_name(prefix), e)
    faultpoint.hit("commit:parts-deleted")




class CommitTarget(Protocol):
    """Where a save's checkpoint lives, as the writer sees it: one per ``StorageWriter`` path.

    Call order (the writer's, driven by DCP): every rank ``prepare`` (before planning ends), the coordinator
    ``clear`` (before any rank writes a byte), every rank ``write_part`` (its manifest part, once its files are
    durable), the coordinator ``commit`` (once every rank's part is there). ``sink`` makes each save's sink.
    """

    sink: SinkFactory

    def prepare(self) -> None: ...

    def clear(self) -> None: ...

    def write_part(self, prefix: str, data: bytes) -> None: ...

    def commit(self, metadata: Metadata, prefixes: list[str], manifest: Manifest) -> None: ...


class LocalTarget:
    """A checkpoint directory of a file system: the functions above, through the pinned pool's file sink."""

    def __init__(self, path: Path, *, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync

    @property
    def sink(self) -> SinkFactory:
        from cpuckpt.transfer.sinks import pool_sink  # trainer side (torch): the writer process never makes sinks

        return pool_sink

    def prepare(self) -> None:
        make_checkpoint_dir(self.path)

    def clear(self) -> None:
        clear_commit(self.path)  # fsynced even without io.fsync (FORMAT.md §2, step 1)

    def write_part(self, prefix: str, data: bytes) -> None:
        target = self.path / part_name(prefix)
        try:
            write_atomic(target, data, fsync=self.fsync)
        except OSError as e:
            raise as_storage_error(e, "cannot write the manifest part", target) from e

    def commit(self, metadata: Metadata, prefixes: list[str], manifest: Manifest) -> None:
        commit_checkpoint(self.path, metadata, prefixes, manifest, fsync=self.fsync)
