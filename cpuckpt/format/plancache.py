"""Reuse the previous save's DCP plan when the state dict's structure is unchanged. Pure: no I/O.

DCP plans every save from scratch: each rank builds its write items, the coordinator gathers them
over the group, deduplicates replicated tensors, builds the global metadata and scatters the plans
back. That is tens of microseconds of Python per tensor on the trainer's thread: most of an async
save's stall once a state dict holds thousands of tensors. Training saves the same structure again
and again, so ``async_save`` keeps each rank's final plan (and the coordinator's metadata) and, when
*every* rank finds its structure unchanged (one all-reduce), skips DCP planning. The file layout is
still computed afresh (non-tensor items may change size), and ``storage_data`` is rebuilt from the
ranks' results at commit.

The signature covers everything a rank's write items (its local plan) are made of, never values:
every leaf's path and container kind; for plain tensors shape, dtype, device type, ``requires_grad``
and pinning; for DTensors also the mesh, the placements and the local shape; for torch
``ShardedTensor``s the global size, the tensor properties and every local shard's offsets, sizes,
dtype, device type and shape; for tensors that implement DCP's ``_Checkpointable`` protocol
(megatron-core's ``CheckpointableShardedTensor`` and ``LocalShardsContainer``) the write items the
object itself declares plus each shard's dtype, device type and shape. Other tensor subclasses make
the state dict unreusable (None). The caller adds the planner's identity (``async_save`` does).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from cpuckpt.format import metapickle

try:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor as _TorchShardedTensor
except ImportError:  # pragma: no cover - torch without distributed
    _TorchShardedTensor = None

__all__ = ["CachedPlan", "reused_metadata", "structure_signature"]

_PLAIN = ("Tensor", "Parameter")


@dataclass(frozen=True)
class CachedPlan:
    """One rank's plan of a previous save, reusable for a state dict of the same signature."""

    signature: tuple  # (the planner's key, structure_signature(state_dict))
    plan: SavePlan  # this rank's final local plan: its write items and its file prefix
    metadata: Metadata | None  # the coordinator's global metadata (None on other ranks)
    is_coordinator: bool
    rank: int


def structure_signature(state_dict: dict[str, Any]) -> tuple | None:
    """A hashable description of everything a rank's DCP write items depend on, or None if not reusable."""
    out: list[tuple] = []
    if not _walk(state_dict, (), out):
        return None
    return tuple(out)


def _walk(obj: Any, path: tuple, out: list[tuple]) -> bool:
    if isinstance(obj, torch.Tensor):
        return _tensor(obj, path, out)
    if isinstance(obj, Mapping):  # DCP traverses any Mapping, not only dicts
        out.append((path, "M", len(obj)))
        for k, v in obj.items():
            # DCP names a value by str(key): 1 and True are equal keys of different names
            if not _walk(v, (*path, k if type(k) is str else str(k)), out):
                return False
        return True
    if isinstance(obj, list | tuple):
        out.append((path, type(obj).__name__, len(obj)))
        return all(_walk(v, (*path, i), out) for i, v in enumerate(obj))
    if _TorchShardedTensor is not None and isinstance(obj, _TorchShardedTensor):
        return _sharded_tensor(obj, path, out)
    out.append((path, "O", type(obj).__name__))
    return True


def _tensor(t: torch.Tensor, path: tuple, out: list[tuple]) -> bool:
    kind = type(t).__name__
    if kind in _PLAIN:
        out.append((path, "T", tuple(t.shape), t.dtype, t.device.type, t.requires_grad, t.is_pinned()))
        return True
    if kind == "DTensor":
        local = t.to_local()
        if type(local).__name__ not in _PLAIN:  # a DTensor over another subclass: DCP asks the local tensor
            return False
        mesh = t.device_mesh
        out.append((path, "D", tuple(t.shape), t.dtype, t.device.type, id(mesh), tuple(mesh.shape),
                    tuple(str(p) for p in t.placements), tuple(local.shape), local.requires_grad,
                    local.is_pinned()))
        return True
    if hasattr(t, "__create_write_items__"):  # DCP's _Checkpointable protocol (checked first, as DCP does)
        return _checkpointable(t, path, out)
    if _TorchShardedTensor is not None and isinstance(t, _TorchShardedTensor):
        return _sharded_tensor(t, path, out)
    return False  # other subclasses: let DCP plan them


def _sharded_tensor(st: Any, path: tuple, out: list[tuple]) -> bool:
    """torch ``ShardedTensor``: DCP writes one item per local shard (offsets, sizes, global metadata)."""
    md = st.metadata()
    p = md.tensor_properties
    shards = []
    for shard in st.local_shards():
        t, smd = shard.tensor, shard.metadata
        if type(t).__name__ not in _PLAIN:  # nested (2-D FSDP): DCP's planner may flatten it
            return False
        shards.append((tuple(smd.shard_offsets), tuple(smd.shard_sizes), t.dtype, t.device.type, tuple(t.shape)))
    out.append((path, "S", tuple(md.size), p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory,
                tuple(shards)))
    return True


def _checkpointable(t: Any, path: tuple, out: list[tuple]) -> bool:
    """A ``_Checkpointable``: its own write items are its part of the plan; each shard's tensor is written."""
    fqn = ".".join(str(k) for k in path)
    try:
        items = t.__create_write_items__(fqn, t)
        entries = []
        for wi in items:
            td = wi.tensor_data
            if td is None:
                entries.append((wi.index.offset, wi.index.index, wi.type))
                continue
            p = td.properties
            shard = t.__get_tensor_shard__(wi.index)
            entries.append((wi.index.offset, wi.index.index, wi.type, tuple(td.chunk.offsets), tuple(td.chunk.sizes),
                            tuple(td.size), p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory,
                            shard.dtype, shard.device.type, tuple(shard.shape)))
    except Exception:  # not describable here: DCP plans it (and reports its own errors)
        return False
    out.append((path, "C", type(t).__qualname__, tuple(entries)))
    return True


def reused_metadata(cached: CachedPlan) -> Metadata:
    """A fresh copy of the coordinator's metadata; ``storage_data`` is filled in at commit. Its structure is saved
    again and again: its ``.metadata`` pickle is kept per directory (:mod:`cpuckpt.format.metapickle`)."""
    if cached.metadata is None:
        raise RuntimeError("only the coordinator keeps the global metadata of a cached plan")
    metapickle.reusable(cached.metadata)
    md = copy.copy(cached.metadata)
    md.storage_data = None
    md.storage_meta = None
    return md
