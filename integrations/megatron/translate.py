"""Megatron's sharded state dict in PyTorch's terms, translated once per structure (issue 29's per-save Python).

megatron-core's ``mcore_to_pyt_state_dict`` builds a PyTorch-side object per sharded tensor at every save
(~1,200 of them for a 24-layer GPT: ~7 ms of the trainer's thread on the CPU box, part of the ~30 ms a
Megatron-LM save spent translating on the H200). A job saving every iteration saves the same tensors over and
over, so :class:`Translations` keeps each key's translated object and hands it out again while the key's shards
are the same: the same storage and place (data pointer, shape, strides, dtype, device) and the same sharding
(global shape and offset, fragmentation, replica, flattening). Anything else about a shard, or a new key, is
translated anew; sharded objects (RNG states, ...) hold values and are translated at every save. A kept object
holds the earlier save's tensor, which keeps its storage alive, so a data pointer seen again is that same memory.
"""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

__all__ = ["Translations"]


def _signature(shards: list[Any]) -> tuple | None:
    """What must repeat for a key's translation to be reused; None: never reused (objects, tensors without data)."""
    out = []
    for sh in shards:
        if not isinstance(sh, ShardedTensor) or sh.data is None:
            return None
        d = sh.data
        fr = sh.flattened_range
        out.append((d.data_ptr(), tuple(d.shape), d.stride(), d.dtype, d.device, sh.global_shape, sh.global_offset,
                    sh.axis_fragmentations, sh.replica_id, sh.prepend_axis_num,
                    None if fr is None else (fr.start, fr.stop, fr.step), sh.allow_shape_mismatch))
    return tuple(out)


class Translations:
    """The translated objects of the last save of one stream of saves, by sharded key (see the module)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple, Any]] = {}
        self.reused = 0  # keys handed out again at the last translate (for tests and telemetry)

    def translate(self, sharded: dict[str, list[Any]]) -> dict[str, Any]:
        """``mcore_to_pyt_state_dict(sharded, False)``, reusing what repeats; the keys in ``sharded``'s order."""
        out: dict[str, Any] = {}
        fresh: dict[str, list[Any]] = {}
        signatures: dict[str, tuple | None] = {}
        for key, shards in sharded.items():
            sig = signatures[key] = _signature(shards)
            kept = self._kept.get(key)
            if sig is not None and kept is not None and kept[0] == sig:
                out[key] = kept[1]
            else:
                fresh[key] = shards
        self.reused = len(out)
        if fresh:
            out.update(mcore_to_pyt_state_dict(fresh, False))
        self._kept = {key: (sig, out[key]) for key, sig in signatures.items() if sig is not None}
        return {key: out[key] for key in sharded}
