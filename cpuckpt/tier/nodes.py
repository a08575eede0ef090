"""The memory tier across nodes: which ranks share a RAM root, each node's own commit, the restart agreement.

A *node* is a RAM root: the ranks whose :class:`~cpuckpt.tier.ramroot.RamRoot` is the same directory
of the same boot of the same host (:func:`node_key`). Not the rendezvous node rank, which a restart may
change, and not the hostname alone (two launches on one host with their own ``memory.root`` are two
nodes; so are the containers of one host). Every node's slot ``slot-<k>`` holds only its own ranks'
images, so each node commits its own copy of a memory save (:func:`node_commit`): once every rank's
files are in, the coordinator sends the global ``.metadata`` and the manifest's header to every rank
(one broadcast), each node's *leader* (its lowest rank) merges its node's manifest parts into a manifest
that lists only its node's files and writes it, then ``.metadata``, into its slot, and one all-gather
agrees on the outcome. A node's slot is then complete *for the ranks it holds*: ``check_complete`` and
stock readers accept it, but a rank can load from it only the tensors whose files the node holds.
Items several ranks save (replicated values) are written once per node (:mod:`.nodecopies`) and each
leader's ``.metadata`` names its own node's copy, so a node's slot holds everything its ranks load.

At restart each rank lists the (step, save id) of its node's slots that hold every file it needs
(:func:`needed_files`: the files of its load plan when the state dict is known, else its own files),
and the ranks keep those held on every node (:func:`agree_held`, one all-gather); the newest of them
wins, else the newest durable checkpoint. No collective here runs anywhere but on the trainers.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from cpuckpt.backend.collectives import resolve_stateful
from cpuckpt.backend.commit import commit_checkpoint
from cpuckpt.backend.committed import check_complete, load_metadata, read_manifest
from cpuckpt.backend.writer import StorageWriter
from cpuckpt.background import CommitHook
from cpuckpt.errors import FailureReport, IntegrityError
from cpuckpt.format.manifest import Manifest
from cpuckpt.tier.nodecopies import node_storage
from cpuckpt.tier.nodefiles import committed_node_files
from cpuckpt.tier.ramroot import BOOT_ID_PATH

__all__ = ["NodeMap", "agree_held", "committed_slot", "held_saves", "needed_files", "node_commit", "node_key"]

logger = logging.getLogger(__name__)

Held = tuple[int, str]  # (step, save id) of a memory checkpoint


def node_key(root: str | os.PathLike) -> str:
    """``host:boot id:RAM root path``: the ranks that share this key share one RAM root (one node)."""
    try:
        boot = BOOT_ID_PATH.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}:{os.path.realpath(root)}"


@dataclasses.dataclass(frozen=True)
class NodeMap:
    """Every rank's node key (index = rank in the tier's group) and this rank's place among them."""

    rank: int
    keys: tuple[str, ...]

    @classmethod
    def gather(cls, key: str, rank: int, world_size: int, group: Any) -> NodeMap:
        """Collective (one all-gather of the keys); a single process is one node."""
        if group is None or world_size == 1:
            return cls(rank, (key,))
        keys: list[Any] = [None] * world_size
        dist.all_gather_object(keys, key, group=group)
        return cls(rank, tuple(keys))

    @property
    def single(self) -> bool:
        """Every rank shares one RAM root (the memory commit is the ordinary, coordinator's one)."""
        return len(set(self.keys)) == 1

    @property
    def node_ranks(self) -> list[int]:
        """The ranks on this rank's node, ascending."""
        return [r for r, k in enumerate(self.keys) if k == self.keys[self.rank]]

    @property
    def leader(self) -> int:
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.leader == self.rank

    @property
    def nodes(self) -> int:
        return len(set(self.keys))


def node_commit(nodes: NodeMap, *, fsync: bool = False) -> CommitHook:
    """The :class:`~cpuckpt.background.CommitHook` of a memory save across nodes (see the module docstring).

    Never raises for a commit that fails (an unreadable part, a file of the wrong size, the
    coordinator's metadata): it becomes the outcome every rank returns. Only a failing collective raises.
    """

    def commit(writer: StorageWriter, gathered: list | None, group: Any,
               coordinator: int) -> list[FailureReport | None] | None:
        sent: Any = None
        if writer.is_coordinator:
            try:
                metadata, results = writer.pending_commit(gathered)
                sent = (metadata, writer.manifest_header(len(results)), node_storage(results, nodes.keys))
            except Exception as e:  # every rank gets it as the outcome
                failed = FailureReport.of(e, writer.rank)
                sent = dataclasses.replace(failed, message=f"commit failed (coordinator): {failed.message}")
        box = [sent]
        dist.broadcast_object_list(box, src=coordinator, group=group)
        if isinstance(box[0], FailureReport):
            return [box[0]]
        metadata, manifest, copies = box[0]
        mine: FailureReport | None = None
        if nodes.is_leader:
            try:
                own = copies.get(nodes.keys[nodes.rank])
                if own:  # this node's copies of replicated items (tier.nodecopies), not another node's
                    metadata = copy.copy(metadata)
                    metadata.storage_data = {**(metadata.storage_data or {}), **own}
                commit_checkpoint(writer.path, metadata, [f"__{r}_" for r in nodes.node_ranks], manifest, fsync=fsync)
            except Exception as e:  # agreed below, raised on every rank
                failed = FailureReport.of(e, writer.rank)
                mine = dataclasses.replace(failed, message=f"memory commit of node {nodes.keys[nodes.rank]} "
                                                           f"failed: {failed.message}")
        reports: list[Any] = [None] * len(nodes.keys)
        dist.all_gather_object(reports, mine, group=group)
        return reports if any(r is not None for r in reports) else None

    return commit


def needed_files(metadata: Metadata, rank: int, state_dict: dict[str, Any] | None = None,
                 planner: Any = None) -> set[str]:
    """The data files rank ``rank`` reads to load ``metadata``'s checkpoint into ``state_dict``.

    With a state dict: the files of its local load plan (a copy of ``planner``, default DCP's
    ``DefaultLoadPlanner``; no collective). Deduplicated replicated items sit in one rank's file, so
    this may name other ranks' files. Without one (or when the plan cannot be made, e.g. a key the
    checkpoint lacks: the load itself reports that): the rank's own files, ``__<rank>_*``.
    """
    storage = metadata.storage_data or {}
    if state_dict is not None:
        try:
            own = copy.copy(planner) if planner is not None else DefaultLoadPlanner()
            own.set_up_planner(resolve_stateful(state_dict), metadata, False)
            plan = own.create_local_plan()
            return {storage[item.storage_index].relative_path for item in plan.items}
        except Exception as e:  # the load reports it; here only the fallback rule applies
            logger.debug("cpuckpt memory tier: no local load plan for rank %d (%s); needing its own files", rank, e)
    prefix = f"__{rank}_"
    return {info.relative_path for info in storage.values() if info.relative_path.startswith(prefix)}


def held_saves(slots: list[Path], rank: int, world_size: int, state_dict: dict[str, Any] | None = None,
               planner: Any = None) -> dict[Held, Path]:
    """The memory checkpoints this rank's node holds complete *for this rank*, by (step, save id).

    A checkpoint of another world size is never held: the ranks' files sit on the nodes of the old
    world, so a restart with a different world size reshards from the durable tier. An adapter's file set
    (:mod:`cpuckpt.tier.nodefiles`) is held when its node listing is complete and names this rank among the
    ranks of the node that wrote it (that node's slot holds every file those ranks read).
    """
    out: dict[Held, Path] = {}
    for slot in slots:
        committed = committed_slot(slot, world_size)
        if committed is None:
            listing = committed_node_files(slot)  # an adapter's file set: complete for the ranks its node had
            if (listing is not None and listing.world_size == world_size and rank in listing.ranks
                    and listing.step is not None):
                out[(listing.step, listing.save_id)] = slot
            continue
        step, manifest, metadata = committed
        missing = needed_files(metadata, rank, state_dict, planner) - set(manifest.files)
        if missing:
            logger.info("cpuckpt memory tier: %s (step %s) lacks %d file(s) rank %d needs (%s, ...): held by "
                        "other nodes only", slot, step, len(missing), rank, sorted(missing)[0])
            continue
        out[(step, manifest.save_id)] = slot
    return out


def committed_slot(slot: Path, world_size: int) -> tuple[int, Manifest, Metadata] | None:
    """(step, manifest, ``.metadata``) of the memory checkpoint committed in ``slot`` with this world size;
    None when there is none (incomplete, no save id, another world size, unreadable metadata)."""
    c = check_complete(slot)
    manifest = read_manifest(slot) if c.complete else None
    if manifest is None or c.step is None or not manifest.save_id or manifest.world_size != world_size:
        return None
    try:
        return c.step, manifest, load_metadata(slot)
    except (IntegrityError, OSError) as e:
        logger.warning("cpuckpt memory tier: %s: %s", slot, e)
        return None


def agree_held(mine: dict[Held, Path], world_size: int, group: Any) -> dict[Held, Path]:
    """The entries of ``mine`` that every rank holds too (one all-gather; collective)."""
    if group is None or world_size == 1:
        return dict(mine)
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, sorted(mine), group=group)
    common: set[Held] = set(mine)
    for held in every:
        common &= {tuple(h) for h in held}
    return {h: p for h, p in mine.items() if h in common}
