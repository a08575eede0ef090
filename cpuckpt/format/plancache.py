"""Reuse the previous save's DCP plan when the state dict's structure is unchanged. Pure: no I/O.

DCP plans every save from scratch: each rank builds its write items, the coordinator gathers them
over the group, deduplicates replicated tensors, builds the global metadata and scatters the plans
back. That is tens of microseconds of Python per tensor on the trainer's thread: most of an async
save's stall once a state dict holds thousands of tensors. Training saves the same structure again
and again, so ``async_save`` keeps each rank's final plan (and the coordinator's metadata) and, when
*every* rank finds its structure unchanged (one all-reduce), skips DCP planning. The file layout is
still computed afresh (non-tensor items may change size), and ``storage_data`` is rebuilt from the
ranks' results at commit.

The signature covers what the plan depends on: every leaf's path, and for tensors their type,
shape, dtype, device type and, for DTensors, the mesh and placements. Values do not matter.
ShardedTensors and custom planners always take DCP's path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["CachedPlan", "reused_metadata", "structure_signature"]


@dataclass(frozen=True)
class CachedPlan:
    """One rank's plan of a previous save, reusable for a state dict of the same signature."""

    signature: tuple
    plan: SavePlan  # this rank's final local plan: its write items and its file prefix
    metadata: Metadata | None  # the coordinator's global metadata (None on other ranks)
    is_coordinator: bool
    rank: int


def structure_signature(state_dict: dict[str, Any]) -> tuple | None:
    """A hashable description of everything DCP's plan depends on, or None if not reusable."""
    out: list[tuple] = []
    if not _walk(state_dict, (), out):
        return None
    return tuple(out)


def _walk(obj: Any, path: tuple, out: list[tuple]) -> bool:
    if isinstance(obj, torch.Tensor):
        kind = type(obj).__name__
        if kind == "DTensor":
            mesh = obj.device_mesh
            out.append((path, "D", tuple(obj.shape), obj.dtype, obj.device.type, id(mesh), tuple(mesh.shape),
                        tuple(str(p) for p in obj.placements), tuple(obj.to_local().shape)))
        elif kind in ("Tensor", "Parameter"):
            out.append((path, "T", tuple(obj.shape), obj.dtype, obj.device.type))
        else:  # ShardedTensor and other subclasses: let DCP plan them
            return False
        return True
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not _walk(v, (*path, k), out):
                return False
        return True
    if isinstance(obj, list | tuple):
        out.append((path, type(obj).__name__, len(obj)))
        return all(_walk(v, (*path, i), out) for i, v in enumerate(obj))
    if type(obj).__name__ == "ShardedTensor":
        return False
    out.append((path, "O", type(obj).__name__))
    return True


def reused_metadata(cached: CachedPlan) -> Metadata:
    """A fresh copy of the coordinator's metadata; ``storage_data`` is filled in at commit."""
    if cached.metadata is None:
        raise RuntimeError("only the coordinator keeps the global metadata of a cached plan")
    md = copy.copy(cached.metadata)
    md.storage_data = None
    md.storage_meta = None
    return md
