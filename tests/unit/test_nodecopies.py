"""Replicated items across nodes (``tier.nodecopies``): DCP's planning, then one copy per node.

Four ranks' local plans are made by DCP's own ``DefaultSavePlanner`` (in one process, as each rank would),
the coordinator's planner is the wrapped one; ranks 0-1 are node A, ranks 2-3 node B.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from cpuckpt.backend.itemcache import default_planner_like
from cpuckpt.tier.nodecopies import add_node_copies, node_storage, with_node_copies

KEYS = ("A", "A", "B", "B")


def _state(rank: int) -> dict:
    return {f"own{rank}": torch.full((4,), float(rank)),  # saved by one rank
            "shared": torch.arange(6.0),                   # replicated: every rank saves it
            "step": 7,                                     # a replicated non-tensor value
            "half": torch.ones(3) if rank < 2 else torch.zeros(2)}  # replicated on node A only


def _local_plans() -> list:
    plans = []
    for rank in range(4):
        p = DefaultSavePlanner()
        p.set_up_planner(_state(rank), is_coordinator=rank == 0)
        plans.append(p.create_local_plan())
    return plans


def _fqns(plan) -> list[str]:
    return sorted(item.index.fqn for item in plan.items)


def test_each_node_writes_its_own_copy_of_replicated_items():
    local = _local_plans()
    planner = with_node_copies(None, KEYS)
    planner.set_up_planner(_state(0), is_coordinator=True)
    plain = DefaultSavePlanner()
    plain.set_up_planner(_state(0), is_coordinator=True)
    dcp_plan, dcp_md = plain.create_global_plan(local)
    plan, md = planner.create_global_plan(local)

    assert md.state_dict_metadata.keys() == dcp_md.state_dict_metadata.keys()  # DCP's metadata, unchanged
    for key in ("shared", "step"):
        writers = [r for r, p in enumerate(plan) if key in _fqns(p)]
        assert sorted({KEYS[r] for r in writers}) == ["A", "B"] and len(writers) == 2, (key, writers)
        assert sum(key in _fqns(p) for p in dcp_plan) == 1  # DCP alone: one copy in the whole job
    for rank in range(4):
        assert f"own{rank}" in _fqns(plan[rank])
    # An added copy is DCP's planned item itself: same index (chunk number included).
    indices = {item.index for p in plan for item in p.items if item.index.fqn == "shared"}
    assert len(indices) == 1


def test_the_wrapped_planner_keeps_its_identity_and_the_cached_item_path():
    a = with_node_copies(None, KEYS)
    b = with_node_copies(DefaultSavePlanner(), KEYS)
    assert type(a) is type(b) and isinstance(a, DefaultSavePlanner)
    assert default_planner_like(a)  # only create_global_plan differs: backend.itemcache still applies


def test_node_storage_points_each_node_at_its_own_copy():
    shared, own = MetadataIndex("shared", torch.Size([0]), 0), MetadataIndex("own0", torch.Size([0]), 0)
    results = [[WriteResult(shared, 24, "r0"), WriteResult(own, 16, "o0")], [],
               [WriteResult(shared, 24, "r2")], [WriteResult(shared, 24, "r3")]]
    assert node_storage(results, KEYS) == {"A": {shared: "r0"}, "B": {shared: "r2"}}


def test_single_node_plans_are_unchanged():
    local = _local_plans()
    plain = DefaultSavePlanner()
    plain.set_up_planner(_state(0), is_coordinator=True)
    dcp_plan, _ = plain.create_global_plan(local)
    assert add_node_copies(local, dcp_plan, ("A",) * 4) == dcp_plan
