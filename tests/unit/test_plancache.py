"""structure_signature: equal for new values, different for anything a rank's DCP write items hold.

Everything here is built without a process group: plain tensors, a non-dict Mapping, an unknown
tensor subclass, and megatron-core's ``_Checkpointable`` tensors (what ``mcore_to_pyt_state_dict``
produces on torch >= 2.6), single and several shards per key. torch ``ShardedTensor``s and DTensors
need a group: tests/dist/test_plan_reuse.py covers them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from cpuckpt.format.plancache import structure_signature


class _Box(Mapping):
    def __init__(self, **items: Any) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _plain(fill: float = 0.0, *, shape=(4, 3), dtype=torch.float32, grad: bool = False, nested=(2,)) -> dict:
    return {"a": torch.full(shape, fill, dtype=dtype).requires_grad_(grad),
            "box": _Box(t=torch.full(nested, fill)), "meta": {"step": int(fill), "names": ["x"] * 2}}


def test_values_do_not_matter_structure_does():
    base = structure_signature(_plain(1.0))
    assert base is not None
    assert structure_signature(_plain(2.0)) == base  # values (and a non-tensor's value) only
    assert hash(base) == hash(structure_signature(_plain(2.0)))
    for changed in (_plain(shape=(3, 4)), _plain(dtype=torch.bfloat16), _plain(grad=True), _plain(nested=(3,)),
                    {**_plain(), "new": torch.zeros(1)}, {**_plain(), "meta": {"step": 1, "names": ["x"] * 3}},
                    {**_plain(), "meta": {"step": 1.0, "names": ["x"] * 2}}, {**_plain(), "empty": {}}):
        assert structure_signature(changed) != base


def test_unknown_tensor_subclass_is_not_reusable():
    class Odd(torch.Tensor):
        pass

    assert structure_signature({"x": torch.zeros(2).as_subclass(Odd)}) is None


def _checkpointable(step: int, *, rows: int = 8, split: int = 0, dtype=torch.float32, shards: int = 1) -> dict:
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )

    full = torch.full((rows, 6), float(step), dtype=dtype)
    parts = [CheckpointableShardedTensor.from_sh_ten(ShardedTensor.from_rank_offsets(
        "w", full.chunk(4, dim=split)[k].contiguous(), (split, k, 4))) for k in range(shards)]
    return {"w": parts[0] if shards == 1 else LocalShardsContainer(parts), "obj": b"pickled"}


@pytest.mark.parametrize("shards", [1, 2])
def test_megatron_checkpointable_shards(shards):
    base = structure_signature(_checkpointable(1, shards=shards))
    assert base is not None
    assert structure_signature(_checkpointable(2, shards=shards)) == base
    for changed in (_checkpointable(1, rows=12, shards=shards),  # global shape and local sizes
                    _checkpointable(1, split=1, shards=shards),  # offsets and local shape
                    _checkpointable(1, dtype=torch.bfloat16, shards=shards),
                    _checkpointable(1, shards=3 - shards)):  # another number of local shards
        assert structure_signature(changed) != base
