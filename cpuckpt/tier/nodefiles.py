"""A file set's node listing: which files one node's memory slot holds of a checkpoint spanning nodes. Reads and
writes one small JSON file; no collectives, no torch.

An adapter's file set (:mod:`cpuckpt.tier.formats`: a directory of its own files committed by a JSON marker, the
DeepSpeed adapter's tags) lists every rank's files in its marker. Across nodes each node's slot holds only the
files its own ranks wrote (and the node's own copies of files that every rank reads, such as DeepSpeed's model
states), so the marker alone would call every node's slot torn. Before the marker, each node's leader writes
``.cpuckpt-node.json`` into its slot: the save id, the step, the marker's name, the world size, the node's ranks
and, for every file the slot holds, the rank that wrote it here with its size and chunk checksums. A slot is
complete *for its node* (:func:`committed_node_files`) when that listing and the marker name the same save and
every listed file has its listed size. The listing is what the replica protocol sends of a file set (its files,
then the listing, then the marker: :mod:`cpuckpt.tier.replica`) and what the restart agreement reads
(:mod:`cpuckpt.tier.nodes`, :mod:`cpuckpt.tier.recovery`).

The durable copy never has a listing: each rank persists the files it owns, and the coordinator's writer copies
the marker, which lists them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from cpuckpt.backend.committed import size_mismatches
from cpuckpt.format.manifest import FileEntry
from cpuckpt.tier.formats import marker_save_id
from cpuckpt.transfer.files import write_atomic

__all__ = ["NODE_FILES_NAME", "NodeFiles", "committed_node_files", "read_node_files", "write_node_files"]

logger = logging.getLogger(__name__)

NODE_FILES_NAME = ".cpuckpt-node.json"


@dataclass(frozen=True)
class NodeFiles:
    """The content of ``.cpuckpt-node.json``. New fields need defaults (older listings still parse)."""

    save_id: str
    step: int | None
    marker: str  # the file set's marker, written after this listing (the memory commit)
    world_size: int
    ranks: tuple[int, ...]  # the node's ranks when it saved
    files: dict[str, FileEntry] = field(default_factory=dict)  # what this slot holds
    writers: dict[str, int] = field(default_factory=dict)  # file -> the rank that wrote it into this slot

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeFiles:
        """Raises ValueError (or KeyError, TypeError) for anything that is not a listing."""
        data = json.loads(text)
        files = {str(n): FileEntry(**e) for n, e in data["files"].items()}
        return cls(save_id=str(data["save_id"]), step=data.get("step"), marker=str(data["marker"]),
                   world_size=int(data["world_size"]), ranks=tuple(int(r) for r in data["ranks"]), files=files,
                   writers={str(n): int(r) for n, r in data.get("writers", {}).items()})

    def owned(self) -> tuple[tuple[int, str], ...]:
        """(rank, file) of every file the slot holds: what each of the node's ranks reads at a restart."""
        return tuple(sorted((self.writers.get(n, -1), n) for n in self.files))


def write_node_files(slot: Path, listing: NodeFiles) -> None:
    """The node leader, once every rank of its node wrote its files and before the marker: the listing."""
    write_atomic(slot / NODE_FILES_NAME, listing.to_json().encode(), fsync=False)


def read_node_files(slot: Path) -> NodeFiles | None:
    """The slot's listing, or None (none, unreadable or malformed: the slot is not complete for a node)."""
    try:
        return NodeFiles.from_json((slot / NODE_FILES_NAME).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("cpuckpt memory tier: %s: not a node listing (%s)", slot / NODE_FILES_NAME, e)
        return None


def committed_node_files(slot: Path) -> NodeFiles | None:
    """The listing of the file set committed in ``slot`` for its node: the listing and the marker name the same
    save and every listed file has its size. None otherwise (no listing: a one-node or durable directory)."""
    listing = read_node_files(slot)
    if listing is None or not listing.save_id or marker_save_id(slot / listing.marker) != listing.save_id:
        return None
    try:
        if size_mismatches(slot, listing.files, first=True):
            return None
    except OSError:
        return None
    return listing
