"""Megatron's sharded state offered flat (integrations/megatron/flatstate.py): its objects packed as megatron-core's
translation packs them, plain ones pickled once per stream. Real megatron-core objects; no process group needed."""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("megatron.core")

from cpuckpt.integrations.megatron import flatstate
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def _state(n: object) -> dict:
    return {
        # one per layer: a module's _extra_state without Transformer Engine (None), as GPTModel makes them
        "extra": [ShardedObject("decoder.layers.mlp._extra_state", None, (3,), (i,), replica_id=0) for i in range(3)],
        "n": ShardedObject("n", n, (1,), (0,), replica_id=0),
        "t": ShardedObject("t", torch.arange(3), (1,), (0,), replica_id=0),
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0),
    }


def _objects(flat) -> dict:
    return {name: torch.load(io.BytesIO(leaf.getvalue()), weights_only=True)
            for (name, offset), leaf in zip(flat.names, flat.leaves) if offset is None}


def test_plain_objects_are_pickled_once_per_stream_and_load_as_megatron_core_packs_them(monkeypatch):
    saves: list = []
    real = torch.save
    monkeypatch.setattr(flatstate.torch, "save", lambda obj, f, *a, **k: (saves.append(obj), real(obj, f, *a, **k)))
    packed: dict = {}
    first = flatstate.flat_state(_state(1), True, packed)
    objects = _objects(first)
    assert objects.pop("n/shard_0_1") == [1] and torch.equal(objects.pop("t/shard_0_1")[0], torch.arange(3))
    assert objects == {f"decoder.layers.mlp._extra_state/shard_{i}_3": [None] for i in range(3)}
    assert len(saves) == 3 and saves[:2] == [[None], [1]], "[None] pickled once for three layers"
    saves.clear()
    again = flatstate.flat_state(_state(1), True, packed)
    assert _objects(again).keys() == _objects(first).keys()
    assert len(saves) == 1 and isinstance(saves[0][0], torch.Tensor), "only the tensor object is pickled again"
    saves.clear()
    changed = _objects(flatstate.flat_state(_state(True), True, packed))
    assert changed["n/shard_0_1"] == [True] and type(changed["n/shard_0_1"][0]) is bool, "True is not 1"
    assert len(saves) == 2
    saves.clear()
    negative = _objects(flatstate.flat_state(_state(-0.0), True, packed))["n/shard_0_1"]
    assert str(negative) == "[-0.0]" and len(saves) == 2, "a float is pickled every save (-0.0 == 0.0)"
    saves.clear()
    flatstate.flat_state(_state(1), True, None)
    assert len(saves) == 5, "without a stream's cache every object is pickled"


def _nested() -> dict:
    """A sharded state dict shaped like Megatron-LM's: nested dicts and lists, tensors split and replicated (int and
    tuple replica ids, main and not), objects (grouped by their unique key), a key repeated across shards."""
    w = torch.arange(12.0).view(4, 3)
    return {
        "model": {
            "layers": [
                {"w": ShardedTensor.from_rank_offsets("dec.w", w[:2], (0, 0, 2), replica_id=0),
                 "b": ShardedTensor.from_rank_offsets("dec.b", torch.ones(3), replica_id=(0, 1))},
                {"w": ShardedTensor.from_rank_offsets("dec.w", w[2:], (0, 1, 2), replica_id=0),
                 "b": ShardedTensor.from_rank_offsets("dec.b", torch.ones(3), replica_id=(0, 0))},
            ],
            "extra": [ShardedObject("dec._extra_state", None, (2,), (i,), replica_id=i) for i in range(2)],
        },
        "optimizer": {"state": {"exp_avg": ShardedTensor.from_rank_offsets("opt.exp_avg", torch.zeros(5),
                                                                          replica_id=1)}},
        "rng": ShardedObject("rng_state", [1, 2], (1,), (0,), replica_id=0),
    }


@pytest.mark.parametrize("keep_only_main_replica", [True, False])
def test_grouping_is_megatron_cores_own(keep_only_main_replica: bool):
    """The fast grouping gives megatron-core's groups: the same keys in the same order, the same objects in each."""
    from megatron.core.dist_checkpointing.strategies.torch import _replace_state_dict_keys_with_sharded_keys

    state = _nested()
    theirs = _replace_state_dict_keys_with_sharded_keys(state, keep_only_main_replica)[0]
    ours = flatstate.grouped(state, keep_only_main_replica)
    assert list(ours) == list(theirs)
    assert all(len(ours[k]) == len(theirs[k]) and all(a is b for a, b in zip(ours[k], theirs[k])) for k in theirs)
    if keep_only_main_replica:
        assert "opt.exp_avg" not in ours and len(ours["dec.b"]) == 1 and len(ours["dec._extra_state/shard_0_2"]) == 1


@pytest.mark.parametrize("odd", [(), [], 3, torch.zeros(1)])
def test_a_value_the_grouping_does_not_know_goes_to_megatron_core(odd: object):
    """A tuple, an empty list, a plain value or a bare tensor among the shards: megatron-core's grouping decides, and
    raises as it does."""
    from megatron.core.dist_checkpointing.strategies.torch import _replace_state_dict_keys_with_sharded_keys

    state = _nested()
    state["model"]["odd"] = odd
    with pytest.raises(AssertionError) as theirs:
        _replace_state_dict_keys_with_sharded_keys(state, True)
    with pytest.raises(AssertionError) as ours:
        flatstate.grouped(state, True)
    assert str(ours.value) == str(theirs.value)


def test_two_paths_flattened_to_one_name_are_refused_when_the_structure_is_first_built():
    """megatron-core refuses a state dict whose paths flatten to one name; the fast grouping does not look, but the
    build of every new structure (the item cache's first save of it) groups through megatron-core."""
    state = {"a.b": ShardedTensor.from_rank_offsets("x", torch.ones(2), replica_id=0),
             "a": {"b": ShardedTensor.from_rank_offsets("y", torch.ones(2), replica_id=0)}}
    assert list(flatstate.grouped(state, True)) == ["x", "y"]
    flat = flatstate.flat_state(state, True)
    with pytest.raises(ValueError, match="duplicated flatten key"):
        flat.build()


def _replayed(capture: object, tensors: list) -> dict:
    """A replayed save's state dict as the strategy receives it: the small state, then the captured tensors last."""
    return {"n": ShardedObject("n", 3, (1,), (0,), replica_id=0),
            "__replayed__": flatstate.CapturedTensors(tensors, capture)}


@pytest.mark.parametrize("keep_only_main_replica", [True, False])
def test_a_replays_tensors_are_flattened_once_per_capture_and_as_a_full_flattening(keep_only_main_replica):
    """The captured tensors' part of the flattening is reused while they are the same objects with the same data and
    replica ids; every save's result equals flat_state's without reuse, and vouches for them from their place on."""
    tensors = [ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4,), float(i)), replica_id=i % 2)
               for i in range(6)] + [ShardedTensor.from_rank_offsets("s", torch.ones(2, 3), (0, 0, 2), replica_id=0)]
    capture, repeated = object(), flatstate.RepeatedTensors()
    grouped = []
    real = flatstate.grouped

    def counted(state, keep):
        grouped.append(list(state))
        return real(state, keep)

    def check(state):
        fast = flatstate.flat_state(state, keep_only_main_replica, None, repeated)
        plain = flatstate.flat_state(dict(state, __replayed__=list(state["__replayed__"])), keep_only_main_replica)
        assert (fast.key, fast.names) == (plain.key, plain.names)
        assert all(a is b for a, b in zip(fast.leaves[1:], plain.leaves[1:]))
        assert fast.vouched is state["__replayed__"].capture and fast.vouched_from == 1
        assert plain.vouched is None
        return fast

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flatstate, "grouped", counted)
        check(_replayed(capture, tensors))
        check(_replayed(capture, list(tensors)))  # a new list of the same tensors
        assert grouped.count(["tensors"]) == 1
        tensors[2].replica_id = 1 - tensors[2].replica_id  # megatron-core's distribution of the main replicas moved
        check(_replayed(capture, tensors))
        tensors[3].data = tensors[3].data.clone()  # an eager clone in its place
        check(_replayed(capture, tensors))
        check(_replayed(object(), tensors))  # another capture: never reused
        assert grouped.count(["tensors"]) == 4
        state = _replayed(capture, tensors)
        flatstate.flat_state(state, not keep_only_main_replica, None, repeated)  # the other replica rule
        flatstate.flat_state(state, keep_only_main_replica, None, repeated)
        assert grouped.count(["tensors"]) == 6
    clash = dict(_replayed(capture, tensors))  # a key before the captured tensors that is also theirs: no vouch
    clash = {"t0": ShardedTensor.from_rank_offsets("t0", torch.zeros(4), replica_id=0), **clash}
    clash["__replayed__"] = flatstate.CapturedTensors(tensors, capture)
    fast = flatstate.flat_state(clash, keep_only_main_replica, None, repeated)
    plain = flatstate.flat_state(dict(clash, __replayed__=list(clash["__replayed__"])), keep_only_main_replica)
    assert fast.vouched is None and (fast.key, fast.names) == (plain.key, plain.names)
    flatstate.flat_state({"n": ShardedObject("n", 3, (1,), (0,), replica_id=0)}, keep_only_main_replica, None,
                         repeated)  # a full build's save: nothing of the capture is held any more
    assert repeated._seen is None and repeated._flat is None
