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
