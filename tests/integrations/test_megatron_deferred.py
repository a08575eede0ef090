"""Saves started after their call (integrations/megatron/deferred.py): what the call must freeze, and a start that
fails leaving the saves recorded after it to the next start point. Real megatron-core objects; no process group."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from cpuckpt.integrations.megatron import deferred, strategy
from cpuckpt.integrations.megatron.flatstate import leaves
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def test_the_call_freezes_what_the_next_iteration_changes_before_its_optimizer_step():
    counters = {"large_value_counts": {"loss": 1}}  # the rerun state machine's, updated during the backward
    generator = torch.Generator().manual_seed(5)  # an RNG tracker's state with CUDA graphs: advanced by dropout
    on_device = {"exp_avg": torch.empty(2, device="meta")}  # a distributed optimizer's bucket: only its step writes
    bias = torch.zeros(3)
    state = {"rerun": ShardedObject("rerun_state_machine", counters, (1,), (0,), replica_id=0),
             "rng": ShardedObject("rng_state", [generator], (1,), (0,), replica_id=0),
             "bucket": ShardedObject("optimizer.bucket", on_device, (1,), (0,), replica_id=0),
             "extra": ShardedObject("layer._extra_state", None, (1,), (0,), replica_id=0),
             "expert_bias": ShardedTensor.from_rank_offsets("router.expert_bias", bias, replica_id=0),
             "qb_beta": ShardedTensor.from_rank_offsets("router.qb_beta", bias.clone(), replica_id=0)}
    values = leaves(state)  # what async_save hands both passes
    assert strategy._snapshot_eager(values) == 2 and strategy._freeze_objects(values) == 2
    counters["large_value_counts"]["loss"] = 2
    torch.rand(4, generator=generator)
    bias.add_(1.0)
    assert state["rerun"].data == {"large_value_counts": {"loss": 1}}
    assert torch.equal(torch.rand(1, generator=state["rng"].data[0]),
                       torch.rand(1, generator=torch.Generator().manual_seed(5))), "the generator as it was"
    assert state["bucket"].data is on_device and state["extra"].data is None
    assert torch.equal(state["expert_bias"].data, torch.zeros(3)) and state["qb_beta"].data is not bias


def _saved(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_frozen_objects_save_as_deep_copies_do_and_keep_their_values():
    """The call's copies of host objects (strategy._private_copy, not copy.deepcopy: Python per value) write the
    bytes torch.save writes for deep copies, shared storages and views included, and do not follow the originals."""
    import collections
    import copy
    import random

    import numpy as np

    rng = torch.get_rng_state()
    big = torch.arange(8, dtype=torch.float32)
    tagged = torch.ones(2)
    tagged.note = "attribute"  # a Python attribute: deep-copied, not cloned
    values = {
        "megatron_rng": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                          "torch_rng_state": rng, "rng_tracker_states": {"model-parallel-rng": rng[:16].clone()}}],
        "view": big[2:5],  # a view of a larger storage: saved whole
        "shared": [big, big.view(2, 4)],  # one storage twice: saved once
        "grad": torch.zeros(3, requires_grad=True),
        "tagged": tagged,
        "nested": (1, ["list", {"in": (2.5, None)}], b"x"),
    }
    inner = {"counts": [1, 2]}
    values["twice"] = [inner, (inner, "tuple")]  # one object reached twice stays one object
    values["whole_and_view"] = [big, big[2:5]]  # one storage, whole and in part: saved once
    key = torch.ones(1)
    values["tensor_key"] = {key: 1, "value": key}  # deepcopy copies keys too
    inside: list = []
    values["loop"] = (inside, "loop")  # a tuple reached again through its own list
    inside.append(values["loop"])
    values["ordered"] = collections.OrderedDict(a=torch.ones(2), b=[3])
    values["parameter"] = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    values["empty"] = [torch.empty(0), torch.empty(0, 3)]
    values["array"] = np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2]  # a strided view
    private = {"megatron_rng", "nested", "twice", "loop", "array"}  # copied without deepcopy, the rest by it
    for k, v in values.items():
        if k in private:
            strategy._private_copy(v, {})
        else:
            with pytest.raises(strategy._NotPlain):
                strategy._private_copy(v, {})
    state = {k: ShardedObject(f"obj.{k}", v, (1,), (0,), replica_id=0) for k, v in values.items()}
    want = {k: _saved(copy.deepcopy(v)) for k, v in values.items()}
    assert strategy._freeze_objects(leaves(state)) == len(values)
    for k in values:
        assert _saved(state[k].data) == want[k], k
    assert state["megatron_rng"].data is not values["megatron_rng"]
    assert torch.equal(state["megatron_rng"].data[0]["torch_rng_state"], rng)
    rng.zero_()  # the originals change after the call (the trainer's next iteration)
    big.add_(1.0)
    values["nested"][1][1]["in"] = "changed"
    assert _saved(state["megatron_rng"].data) == want["megatron_rng"]
    assert _saved(state["shared"].data) == want["shared"] and _saved(state["view"].data) == want["view"]
    assert state["nested"].data == (1, ["list", {"in": (2.5, None)}], b"x")
    twice = state["twice"].data
    assert twice[0] is twice[1][0] and twice[0] is not inner
    assert state["loop"].data[0][0] is state["loop"].data
    # Megatron-LM's RNG state is all plain values, arrays and whole tensors: copied without deepcopy


def test_a_start_that_fails_leaves_the_saves_after_it_recorded_in_order():
    started: list[str] = []

    def failing() -> None:
        raise RuntimeError("no room")

    try:
        deferred.defer(lambda: started.append("a"))
        deferred.defer(failing)
        deferred.defer(lambda: started.append("c"))
        with pytest.raises(RuntimeError, match="no room"):
            deferred.start_all()
        assert started == ["a"] and len(deferred._STARTS) == 1, "c still recorded"
        assert deferred.start_all() == 1 and started == ["a", "c"]
    finally:
        deferred._STARTS.clear()


def test_the_reservation_wrapper_of_setup_is_found_again_by_a_later_install():
    """A later install updates the reservation's run on its own wrapper, found through an outer wrapper's
    ``__wrapped__`` (not a copy of its attributes on the outer one), and does not wrap twice."""
    import functools

    from cpuckpt.integrations.megatron import hook

    class Training:
        @staticmethod
        def setup_model_and_optimizer():
            return [torch.nn.Linear(1, 1)], None, None

    first, second = object(), object()
    hook._reserve_slots_after_setup(first, Training)
    reserve = Training.setup_model_and_optimizer

    @functools.wraps(reserve, updated=())
    def outer():  # another library's wrapper around the hook's
        return reserve()

    Training.setup_model_and_optimizer = outer
    hook._reserve_slots_after_setup(second, Training)
    assert Training.setup_model_and_optimizer is outer
    assert reserve._cpuckpt_run is second and "_cpuckpt_run" not in outer.__dict__


def test_a_config_naming_the_start_point_still_loads():
    """``megatron.start_at: finalize`` (what configs/megatron.yaml shipped) loads; the removed ``forward`` is refused
    by name."""
    from cpuckpt.integrations.megatron.settings import split_config

    from cpuckpt.errors import ConfigError

    assert split_config({"megatron": {"ordering": "optimizer", "start_at": "finalize"}})[1].start_at == "finalize"
    with pytest.raises(ConfigError, match="start_at"):
        split_config({"megatron": {"start_at": "forward"}})
