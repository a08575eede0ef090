"""Restricted unpickling of DCP ``.metadata``: only DCP's metadata classes, torch dtypes and plain containers.

Pure: no I/O. Loading an untrusted checkpoint must never run pickled code.
"""

from __future__ import annotations

import importlib
import io
import pathlib
import pickle
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["unpickle_metadata"]


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}
# DCP's metadata classes, and its plan classes: megatron-core stores every rank's SavePlan in
# ``.metadata`` (``all_local_plans``) to reuse the global metadata on the next save.
for _module in (dcp_metadata, dcp_planner):
    for _name in dir(_module):
        _obj = getattr(_module, _name)
        if isinstance(_obj, type) and getattr(_obj, "__module__", "") == _module.__name__:
            _ALLOWED[(_module.__name__, _name)] = _obj
# megatron-core's own plan/metadata dataclasses, resolved only if a checkpoint names them.
_LAZY_ALLOWED = {("megatron.core.dist_checkpointing.strategies.torch", n) for n in ("MCoreSavePlan", "MCoreMetadata")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes, torch dtypes and a few plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if (module, name) in _LAZY_ALLOWED:
            return getattr(importlib.import_module(module), name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def unpickle_metadata(data: bytes) -> Any:
    """Unpickle ``data`` resolving only the allowed globals.

    Raises:
        pickle.UnpicklingError: it names a global outside the allowed set.
    """
    return _MetadataUnpickler(io.BytesIO(data)).load()
