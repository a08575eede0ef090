"""Replicas across nodes, trainer side: endpoints and partners at start, the restart agreement over own slots
and replicas, and the restore of a lost node's slot from a copy another node holds.

At start (``memory.replicas`` > 0, ranks on several nodes) the trainers agree on the job's replica token
(rank 0's, kept in every RAM root) and exchange where each node's leader's writer listens (one broadcast,
one all-gather). Partners are the next ``replicas`` nodes in the sorted list of stable node keys
(:func:`cpuckpt.tier.replica.partners`), never the rendezvous node rank.

At restart every rank reports the memory checkpoints its node's slots hold complete for it
(:func:`cpuckpt.tier.nodes.held_saves`), and every node's leader the copies its RAM root holds, its own slots
and its replicas of other nodes (:func:`node_copies`), in one all-gather. A checkpoint is *available* when
every rank either holds it in its own node's slot or its node has no copy of it at all and another node
holds a complete copy with every file of that node's ranks (:func:`plan_restores`); the newest available
one wins, else the newest durable one. Before it is loaded, each copy's holder (a node leader's trainer)
sends it into the lost node's own slot over the replica protocol (:func:`Replication.restore`), so the
load reads only RAM roots: nothing from the durable root.

A restore overwrites a slot, so it is planned only where it destroys nothing newer (:func:`agree_available`):
never into a slot holding a complete checkpoint of the same or a newer step, and never into a slot that a
newer available checkpoint reads or restores into (an older checkpoint that needs such a slot is not
available). The receiver refuses it too (:func:`cpuckpt.tier.replica.receive`). Restores are only planned
here; they run inside :meth:`cpuckpt.MemoryTier.load` of that checkpoint, never in a query.

A rank whose load plan needs another node's file (DCP deduplicates replicated values into one rank's
file) is not helped by this yet: its node's slot lists only its node's files, so such a checkpoint stays
unavailable (the durable one is loaded), as without replicas.

Must not: run collectives outside the trainers, read the durable root.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpuckpt.errors import CheckpointTimeoutError, IntegrityError
from cpuckpt.tier.nodefiles import committed_node_files
from cpuckpt.tier.nodes import Held, NodeMap, committed_slot
from cpuckpt.tier.replica import (
    Endpoint,
    ReplicaError,
    new_token,
    partners,
    read_endpoint,
    read_token,
    replica_slots,
    send_slot,
    slot_content,
    write_token,
)

__all__ = ["Copy", "Present", "Replication", "Restore", "agree_available", "node_copies", "overwrites", "plan_restores",
           "slots_present"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Copy:
    """A complete memory checkpoint in a node's RAM root: one of its own slots or a replica of another node's."""

    holder: int  # the rank (its node's leader) whose RAM root holds it
    path: str
    slot: str  # slot-<k>: the slot of the source node it is (or is a replica of)
    replica: bool
    step: int
    save_id: str
    files: tuple[str, ...]  # data files it holds
    all_files: tuple[str, ...]  # every data file of the checkpoint (its .metadata)
    # (rank, file) a rank reads from this copy (a file set's node listing); empty: DCP's ``__<rank>_*`` of all_files
    owned: tuple[tuple[int, str], ...] = ()

    @property
    def held(self) -> Held:
        return (self.step, self.save_id)

    def needs(self, ranks: list[int]) -> set[str]:
        """The files of this checkpoint that ``ranks`` read, as far as this copy tells."""
        if self.owned:
            return {f for r, f in self.owned if r in ranks}
        return {f for f in self.all_files for r in ranks if f.startswith(f"__{r}_")}

    def covers(self, ranks: list[int]) -> bool:
        """Whether this copy holds files of every one of ``ranks`` (a file set's listing says whose they are; a DCP
        copy is judged by :meth:`needs` alone)."""
        return not self.owned or set(ranks) <= {r for r, _ in self.owned}


@dataclasses.dataclass(frozen=True)
class Restore:
    """Copy ``source`` into the own ``source.slot`` of the node led by rank ``target``, a slot that held
    ``expect`` complete (a save id; None: nothing) when planned: the receiver refuses it over anything else."""

    target: int
    source: Copy
    expect: str | None = None


# What a node's own slot holds complete, of any world size: (step, save id); a step None (saved without one) is
# never older than a restore
Present = tuple[int | None, str]


def slots_present(slots: list[Path]) -> dict[str, Present]:
    """What each of this node's own slots holds complete, whatever its world size (a restore is planned only
    over a slot that holds nothing newer, and names what it holds). Unpickles nothing."""
    return {s.name: (c.step, c.save_id) for s in slots if (c := slot_content(s)) is not None}


def node_copies(root: Path, slots: list[Path], rank: int, world_size: int) -> list[Copy]:
    """Every complete copy in this node's RAM root (own slots, then replicas) of this world size: DCP checkpoints
    and file sets with a node listing (:mod:`cpuckpt.tier.nodefiles`)."""
    out = []
    for replica, slot in [(False, s) for s in slots] + [(True, s) for _, s in replica_slots(root)]:
        committed = committed_slot(slot, world_size)
        if committed is not None:
            step, manifest, metadata = committed
            every = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
            out.append(Copy(rank, str(slot), slot.name, replica, step, manifest.save_id,
                            tuple(sorted(manifest.files)), tuple(every)))
            continue
        listing = committed_node_files(slot)
        if listing is not None and listing.world_size == world_size and listing.step is not None:
            out.append(Copy(rank, str(slot), slot.name, replica, listing.step, listing.save_id,
                            tuple(sorted(listing.files)), tuple(sorted(listing.files)), listing.owned()))
    return out


def plan_restores(nodes: NodeMap, held: list[list[Held]], copies: list[Copy]) -> dict[Held, list[Restore]]:
    """The available memory checkpoints (see the module docstring) and the restores each needs (none: every
    rank holds it already). Pure: every rank computes the same from the same gathered lists."""
    by_save: dict[Held, list[Copy]] = {}
    for c in sorted(copies, key=lambda c: (c.holder, c.replica, c.path)):
        by_save.setdefault(c.held, []).append(c)
    out: dict[Held, list[Restore]] = {}
    for save, found in by_save.items():
        restores: list[Restore] = []
        for key in sorted(set(nodes.keys)):
            ranks = [r for r, k in enumerate(nodes.keys) if k == key]
            if all(save in {tuple(h) for h in held[r]} for r in ranks):
                continue
            if any(not c.replica and nodes.keys[c.holder] == key for c in found):
                break  # the node has its own copy, yet some rank needs more than it holds: not restorable
            need = set().union(*(c.needs(ranks) for c in found))
            source = next((c for c in found if nodes.keys[c.holder] != key and need <= set(c.files)
                           and c.covers(ranks)), None)
            if source is None:
                break
            restores.append(Restore(ranks[0], source))
        else:
            out[save] = restores
    return out


class Replication:
    """One trainer's view of the job's replicas: token, every node's receiver, this node's partners."""

    def __init__(self, nodes: NodeMap, token: str, endpoints: dict[str, Endpoint], replicas: int,
                 timeout_s: float) -> None:
        self.nodes, self.token, self.endpoints, self.timeout_s = nodes, token, endpoints, timeout_s
        self.partners = [endpoints[k] for k in partners(nodes.keys, nodes.keys[nodes.rank], replicas)]
        me = nodes.keys[nodes.rank]
        # the nodes whose replicas this node receives now (it is among their partners)
        self.sources = frozenset(k for k in set(nodes.keys) if me in partners(nodes.keys, k, replicas))

    def departed(self, root: Path) -> list[Path]:
        """Replica directories in ``root`` of nodes this node no longer receives from (a node replaced or gone, a
        ring that shifted): a restart may still restore from them; nothing sends to them any more."""
        return sorted({slot.parent for source, slot in replica_slots(root) if source not in self.sources})

    @classmethod
    def start(cls, nodes: NodeMap, root: Path, writer_pid: int | None, replicas: int, group: Any,
              timeout_s: float) -> Replication:
        """Collective: agree on the token (rank 0's, kept across restarts), exchange the leaders' endpoints.

        Raises:
            CheckpointTimeoutError: this node's leader's writer published no endpoint within ``timeout_s``
                (on every rank: the outcome is agreed first).
        """
        box = [read_token(root) or new_token() if nodes.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        token = str(box[0])
        mine: Endpoint | None = None
        error = ""
        if nodes.is_leader:
            write_token(root, token)
            deadline = time.monotonic() + timeout_s
            while (mine := read_endpoint(root, writer_pid)) is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if mine is None:
                error = (f"rank {nodes.rank}: its writer (pid {writer_pid}) published no replica endpoint in {root} "
                         f"within {timeout_s} s (a writer started without memory.replicas is still running?)")
        every: list[Any] = [None] * len(nodes.keys)
        dist.all_gather_object(every, (mine, error), group=group)
        errors = [e for _, e in every if e]
        if errors:
            raise CheckpointTimeoutError("memory.replicas: " + "; ".join(errors))
        endpoints = {nodes.keys[r]: ep for r, (ep, _) in enumerate(every) if ep is not None}
        return cls(nodes, token, endpoints, replicas, timeout_s)

    def restore(self, restores: list[Restore], group: Any) -> None:
        """Collective: each copy's holder sends it into the target node's own slot; agreed on every rank.

        Raises:
            IntegrityError: some restore failed (on every rank; the caller falls back to an older checkpoint).
        """
        error = ""
        for r in restores:
            if r.source.holder != self.nodes.rank:
                continue
            endpoint = self.endpoints[self.nodes.keys[r.target]]
            t0 = time.perf_counter()
            try:
                nbytes = send_slot(endpoint, self.token, source=self.nodes.keys[r.target], slot=Path(r.source.path),
                                   save_id=r.source.save_id, into="slot", timeout_s=self.timeout_s, expect=r.expect)
                logger.info("cpuckpt memory tier: restored step %s of node %s from %s (%d bytes, %.3f s)",
                            r.source.step, self.nodes.keys[r.target], r.source.path, nbytes, time.perf_counter() - t0)
            except ReplicaError as e:
                error = str(e)
                logger.error("cpuckpt memory tier: %s", e)
        flag = torch.tensor([int(bool(error))], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise IntegrityError(f"rank {self.nodes.rank}: restoring a lost node's memory checkpoint from a replica "
                                 "failed" + (f": {error}" if error else " on another rank (see its log)"))


def agree_available(nodes: NodeMap, mine: dict[Held, Path], copies: list[Copy], present: dict[str, Present],
                    slots: list[Path], group: Any) -> tuple[dict[Held, Path], dict[Path, list[Restore]]]:
    """Collective (one all-gather): the available memory checkpoints with this rank's slot path for each, and
    the restores a path needs before it is loaded. ``copies`` and ``present`` (:func:`slots_present`): a node
    leader's, empty on the other ranks."""
    every: list[Any] = [None] * len(nodes.keys)
    dist.all_gather_object(every, (sorted(mine), copies, present), group=group)
    held = [list(h) for h, _, _ in every]
    copies = [c for _, cs, _ in every for c in cs]
    plans = plan_restores(nodes, held, copies)
    me = nodes.keys[nodes.rank]
    by_name = {s.name: s for s in slots}
    paths: dict[Held, Path] = {}
    pending: dict[Path, list[Restore]] = {}
    # What each node's own slots hold now, of any world size: a restore must never overwrite a complete
    # checkpoint of the same or a newer step (available or not: a node may hold the only copy of a newer step).
    content = {(nodes.keys[r], name): held for r, (_, _, pres) in enumerate(every) for name, held in pres.items()}
    # (node, slot) a newer available save reads or restores into: an older save that needs it is not available
    # (its restore would destroy the newer one, or the newer one's restore destroys it before it is loaded).
    claimed: set[tuple[str, str]] = set()
    for save, restores in sorted(plans.items(), reverse=True):
        uses = {(nodes.keys[c.holder], c.slot) for c in copies if c.held == save and not c.replica}
        targets = {(nodes.keys[r.target], r.source.slot) for r in restores}
        if (uses | targets) & claimed or any(overwrites(content.get(t), save) for t in targets):
            continue  # the same on every rank: computed from the gathered lists alone
        claimed |= uses | targets
        if save in mine:
            path = mine[save]
        else:
            slot = next((r.source.slot for r in restores if nodes.keys[r.target] == me), None)
            path = by_name.get(slot) if slot is not None else None
            if path is None:
                continue  # cannot happen: a save this rank lacks is available only with a restore to its node
        paths[save] = path
        if restores:
            pending[path] = [dataclasses.replace(r, expect=_held_id(content.get((nodes.keys[r.target], r.source.slot))))
                             for r in restores]
    return paths, pending


def _held_id(present: Present | None) -> str | None:
    return present[1] if present is not None else None


def overwrites(present: Present | None, restored: Held) -> bool:
    """Whether restoring ``restored`` into a slot that holds ``present`` complete destroys a checkpoint that is
    not older than it (a newer step, another save of the same step, or one of no step: which one is newer is
    not known)."""
    return present is not None and present != restored and (present[0] is None or present[0] >= restored[0])
