"""What a complete checkpoint is, in a memory slot and in the durable root, per kind of files. Reads only.

The memory tier's ring, restart order, persist-newest-at-exit and stale-request checks need two answers
about the checkpoints they see, and nothing else: which save (and step) a slot holds complete, and which
complete durable checkpoints exist with the steps they rank by (:class:`Durable`). A :class:`SlotFormat` gives them:

- :class:`DcpSlots` (the default): DCP checkpoint directories (``.metadata`` + cpuckpt manifest), what
  :meth:`cpuckpt.tier.memory.MemoryTier.save` writes;
- an adapter's own format for a *file set*: a directory of the adapter's files committed by a JSON
  *marker* written last, with at least ``save_id`` (which save the directory holds) and, for ordering,
  ``global_step`` (the DeepSpeed adapter's tag directories). The writer process persists such a set with a
  ``kind: files`` request (:mod:`cpuckpt.tier.persister`); :func:`marker_save_id`, :func:`marker_step` and
  :func:`part_path` are the names both sides share.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from cpuckpt.backend.committed import check_complete, load_metadata, read_manifest
from cpuckpt.errors import IntegrityError
from cpuckpt.roots import list_checkpoints

__all__ = ["Committed", "DcpSlots", "Durable", "SlotFormat", "marker_save_id", "marker_step", "part_path",
           "read_marker_json", "read_pointer"]

PART_PREFIX = ".cpuckpt-part-"  # a file set's per-rank done marker in the durable directory (removed at commit)


@dataclass(frozen=True)
class Committed:
    """A complete checkpoint found in a directory: its step (None: none recorded), its save's id and when it was
    committed (the manifest's ``created_unix``, the coordinator's clock: the same in every node's copy; 0.0 when the
    format records none). Two saves of one step (a rewind) are told apart by it, newest commit first."""

    step: int | None
    save_id: str
    created: float = 0.0


class Durable(NamedTuple):
    """A complete checkpoint of the durable root: ``rank`` is the step it ranks by among the memory tier's (its own,
    or for one that records none, e.g. a stock ``dcp.save`` the job made before it used the tier, the highest step
    committed before it, -1 for none: :func:`cpuckpt.rootinfo.ordered`'s rule), ``step`` the one it records (None:
    none)."""

    rank: int
    path: Path
    step: int | None


class SlotFormat(Protocol):
    """How the memory tier recognises complete checkpoints (see the module docstring). Reads only, no collectives."""

    def committed(self, directory: Path) -> Committed | None:
        """The complete checkpoint ``directory`` holds, or None (incomplete, torn, empty)."""
        ...

    def durable(self, root: Path) -> list[Durable]:
        """Every complete checkpoint of the durable ``root`` the tier may restart from, with the step it ranks by."""
        ...


class DcpSlots:
    """DCP checkpoint directories: complete by :func:`cpuckpt.backend.committed.check_complete`."""

    def committed(self, directory: Path) -> Committed | None:
        status = check_complete(directory)
        if not status.complete:
            return None
        manifest = read_manifest(directory)
        return Committed(status.step, manifest.save_id, manifest.created_unix) if manifest is not None else None

    def durable(self, root: Path) -> list[Durable]:
        out, highest = [], -1
        for c in list_checkpoints(root):  # oldest first, by the rule that ranks a step-less one
            if c.step is not None:
                highest = max(highest, c.step)
            if c.complete:
                out.append(Durable(c.step if c.step is not None else highest, c.path, c.step))
        return out


def missing_files(directory: Path) -> list[str]:
    """The data files a complete DCP slot's ``.metadata`` names that its manifest does not list: a node's slot of a
    checkpoint saved across nodes holds only its node's ranks' files. [] when it holds them all, or when it is no
    complete checkpoint (its load reports that). A restart on fewer nodes must not pick such a slot: the load
    would fail midway."""
    if not check_complete(directory).complete:
        return []
    manifest = read_manifest(directory)
    try:
        metadata = load_metadata(directory)
    except (IntegrityError, OSError):
        return []
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(named - set(manifest.files if manifest is not None else ()))


def read_marker_json(path: Path) -> dict[str, Any] | None:
    """A file set's marker as a JSON object, or None (missing, unreadable, not an object)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def marker_save_id(path: Path) -> str | None:
    """The save a file set's marker at ``path`` commits (None: no marker, or one without a save id)."""
    data = read_marker_json(path)
    save_id = data.get("save_id") if data is not None else None
    return save_id if isinstance(save_id, str) and save_id else None


def read_pointer(pointer: Path) -> str | None:
    """The name a ``latest`` pointer holds: the file's text, or, for a symlink to a directory beside it (a hand-made
    pointer), that directory's name; None: no pointer, an empty or undecodable one, or one leading elsewhere."""
    try:
        return pointer.read_text().strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    except IsADirectoryError:
        target = Path(os.path.realpath(pointer))
        return target.name if target.parent == Path(os.path.realpath(pointer.parent)) else None


def marker_step(path: Path) -> int | None:
    """The ``global_step`` a file set's marker at ``path`` records (None: none, or no marker)."""
    data = read_marker_json(path)
    step = data.get("global_step") if data is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def part_path(dest: Path, rank: int) -> Path:
    """Rank ``rank``'s done marker of a file set being persisted into ``dest``."""
    return dest / f"{PART_PREFIX}{rank}.json"
