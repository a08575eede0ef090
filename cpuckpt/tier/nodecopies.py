"""Replicated items across nodes: every node's memory slot holds its own copy.

DCP writes an item that several ranks save (the same key and offset: a replicated tensor, a step
counter) once, into one rank's file (``dedup_save_plans``). On one node that is free; across nodes
it leaves the other nodes' slots without bytes their ranks load, so a restart from memory would have
to read them from the durable root (or from another node). :func:`with_node_copies` wraps the save's
planner so that, after DCP's own global planning, one rank of every *other* node that saves such an
item writes it too (the item as DCP planned it, so its index and chunk are the same). DCP's global
``.metadata`` is unchanged and names DCP's copy; :func:`node_storage` collects, at the coordinator,
where each node's copies of the duplicated items landed, and each node's leader points its own
slot's ``.metadata`` at them (:mod:`cpuckpt.tier.nodes`). The durable checkpoint keeps the
coordinator's node's ``.metadata``: every file is persisted, so every copy it names is there.

Cost: a replicated item is written once per node instead of once per job (bytes the memory tier
holds anyway: each node's ranks have the values in their own state).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["add_node_copies", "node_storage", "with_node_copies"]

logger = logging.getLogger(__name__)

# Per process, as classes are: one subclass per planner class keeps its identity (a plan cache key) stable
# for every stream. Must not hold instances or any save's state.
_CLASSES: dict[type, type] = {}  # planner class -> its node-copies subclass (one per class: a stable identity)


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, tuple(index.offset) if index.offset is not None else None


def add_node_copies(all_plans: Sequence[SavePlan], global_plan: Sequence[SavePlan],
                    node_keys: Sequence[str]) -> list[SavePlan]:
    """``global_plan`` with each item DCP deduplicated also written by one rank of every other node that saves it.

    ``all_plans`` are the ranks' local plans as DCP gathered them (before deduplication), ``node_keys`` the
    node of each rank (index = rank). The added item is DCP's planned one (same index and chunk).
    """
    planned: dict[tuple, WriteItem] = {}
    have: set[tuple[str, tuple]] = set()
    for rank, plan in enumerate(global_plan):
        for item in plan.items:
            key = _key(item.index)
            planned[key] = item
            have.add((node_keys[rank], key))
    extra: list[list[WriteItem]] = [[] for _ in global_plan]
    for rank, plan in enumerate(all_plans):
        node = node_keys[rank]
        for item in plan.items:
            key = _key(item.index)
            if (node, key) in have or key not in planned:
                continue
            have.add((node, key))
            extra[rank].append(planned[key])
    return [dataclasses.replace(plan, items=[*plan.items, *more]) if more else plan
            for plan, more in zip(global_plan, extra)]


def with_node_copies(planner: Any, node_keys: Sequence[str]) -> Any:
    """``planner`` (None: DCP's ``DefaultSavePlanner``) as an instance of a subclass whose global plan adds
    the node copies (:func:`add_node_copies`); everything else, including its state, is the planner's own."""
    base = DefaultSavePlanner() if planner is None else planner
    cls = type(base)
    sub = _CLASSES.get(cls)
    if sub is None:
        def create_global_plan(self: Any, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
            global_plan, metadata = super(sub, self).create_global_plan(all_plans)
            if getattr(self, "_enable_plan_caching", False):  # its plans are deltas against a cache
                logger.warning("cpuckpt memory tier: the planner caches its plans; replicated items stay in one "
                               "node's slot")
                return global_plan, metadata
            global_plan = add_node_copies(all_plans, global_plan, self._cpuckpt_node_keys)
            if hasattr(self, "global_plan"):
                self.global_plan = global_plan
            return global_plan, metadata

        sub = type(f"NodeCopies{cls.__name__}", (cls,), {"create_global_plan": create_global_plan,
                                                          "__module__": __name__})
        sub.__qualname__ = sub.__name__
        _CLASSES[cls] = sub
    wrapped = sub.__new__(sub)
    wrapped.__dict__.update(base.__dict__)
    wrapped._cpuckpt_node_keys = tuple(node_keys)
    return wrapped


def node_storage(results: Sequence[Sequence[WriteResult]], node_keys: Sequence[str]) -> dict[str, dict]:
    """For every node, where its own copies of items written by several ranks landed: ``{node: {index: info}}``.

    Only items with more than one result appear (the node copies); the lowest rank of a node wins.
    """
    writers: dict[MetadataIndex, int] = {}
    for wrs in results:
        for wr in wrs:
            writers[wr.index] = writers.get(wr.index, 0) + 1
    out: dict[str, dict] = {}
    for rank in range(len(results) - 1, -1, -1):  # descending: the lowest rank's copy is set last
        for wr in results[rank]:
            if writers[wr.index] > 1:
                out.setdefault(node_keys[rank], {})[wr.index] = wr.storage_data
    return out
