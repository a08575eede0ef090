"""The load fast path: ``dcp.load``'s result without DCP's planner, where that result is provably the same.

DCP plans a load generically: it walks the state dict twice (``_init_state_dict``, flattening),
sweeps saved against requested chunks per tensor, builds ``ReadItem`` objects and, with several
ranks, gathers every plan on rank 0 and scatters it back: tens of microseconds per item, the bulk
of a load from RAM. In the common case the plan is known without any of that. :func:`plan_fast`
accepts a load only when all of these hold (anything else is left to DCP, unchanged):

- no planner, or exactly DCP's ``DefaultLoadPlanner`` with its flattening on (a subclass, such as
  megatron-core's ``MCoreLoadPlanner``, or any other planner always goes to DCP);
- the state dict is nested ``dict``s whose leaves are plain ``torch.Tensor``/``nn.Parameter``
  (strided, not on ``meta``) or non-tensor values, lists holding no tensor or container;
- its flattened keys (DCP's: ``".".join(str(k) ...)``, no duplicates) are exactly the keys of
  ``.metadata``; every tensor was saved as one chunk at offset zero with the target's shape, every
  non-tensor as bytes.

Then DCP's default planner would issue one full-chunk ``ReadItem`` per tensor (the target, not
narrowed, is the destination; ``commit_tensor`` does nothing) and one bytes item per non-tensor
(``set_element(state_dict, path, torch.load(bytes, weights_only=False))``), with no global
planning; :func:`load` does exactly that through :meth:`StorageReader.read_whole` (the same reads,
checks and copies, a dtype change included), except that bytes items are decoded as the reader's
``read_data`` decodes them: ``weights_only`` semantics unless ``integrity.trusted``
(:func:`~cpuckpt.format.unpickle.load_value`). ``Stateful`` values are handled as ``dcp.load``
handles them. With several ranks, one all-reduce agrees on the path first (every rank takes the
same one), and failures are agreed on after the reads (:func:`~cpuckpt.errors.rank_error`, as
``run_dcp`` raises them for DCP's path).

Owns: the eligibility check and the fast path's state-dict side. Must not: read files itself
(``backend.reader``), plan resharded loads.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_loader as _loader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from cpuckpt.backend.collectives import gather_failures, raise_if_failed
from cpuckpt.backend.reader import StorageReader
from cpuckpt.errors import is_interrupt
from cpuckpt.format.unpickle import load_value

__all__ = ["FastPlan", "load", "plan_fast"]

logger = logging.getLogger(__name__)

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass
class FastPlan:
    """What the fast path reads: tensors by flattened key, and the paths of the bytes items."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    blobs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # flattened key -> path in the state dict


def plan_fast(state_dict: dict[str, Any], metadata: Metadata, planner: Any = None) -> FastPlan | None:
    """The fast path's plan of loading ``metadata``'s checkpoint into ``state_dict``; None: leave it to DCP.

    ``state_dict`` is what DCP would plan over (``Stateful`` values already replaced by their state
    dicts). Pure: reads nothing, changes nothing. The module docstring lists the conditions.
    """
    if planner is not None and not (type(planner) is DefaultLoadPlanner and planner.flatten_state_dict
                                    and planner.flatten_sharded_tensors):
        return None
    saved = metadata.state_dict_metadata
    plan = FastPlan()
    stack: list[tuple[tuple[str, ...], Any]] = [((str(k),), v) for k, v in reversed(state_dict.items())]
    names: set[str] = set()
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((path + (str(k),), v) for k, v in reversed(value.items()))
            continue
        if isinstance(value, Mapping):
            return None  # DCP's _init_state_dict replaces a non-dict Mapping by None: leave that to DCP
        fqn = ".".join(path)
        md = saved.get(fqn)
        if md is None or fqn in names:
            return None  # DCP raises (strict), skips it (allow_partial_load) or finds the key duplicated
        names.add(fqn)
        if isinstance(value, torch.Tensor):
            if not _whole(value, md):
                return None
            plan.tensors.append((fqn, value))
        elif isinstance(value, list) and any(isinstance(v, (torch.Tensor, Mapping, list)) for v in value):
            return None  # DCP walks into such a list
        elif isinstance(md, BytesStorageMetadata):
            plan.blobs[fqn] = path
        else:
            return None
    if len(names) != len(saved):
        return None  # saved keys the state dict lacks: DCP's pre-2.4 key fallback may apply
    return plan


def _whole(t: torch.Tensor, md: Any) -> bool:
    """True when ``t`` is a plain tensor that ``md`` describes as saved whole, in one chunk, with its shape."""
    if type(t) not in _PLAIN_TENSORS or t.layout != torch.strided or t.is_meta:
        return False
    if not isinstance(md, TensorStorageMetadata) or len(md.chunks) != 1 or md.size != t.shape:
        return False
    chunk = md.chunks[0]
    return chunk.sizes == md.size and not any(chunk.offsets)


def load(state_dict: dict[str, Any], reader: StorageReader, metadata: Metadata, *, planner: Any = None,
         process_group: Any = None) -> bool:
    """``dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)``,
    through the fast path when every rank can take it.

    ``metadata`` is the checkpoint's (``reader.use_metadata`` was given it). Collective when
    ``process_group`` is set (a gloo group). Returns whether the fast path ran.

    Raises:
        CpuckptError: the fast path failed on a rank: the same error on every rank, the lowest failing
            rank's class (``CheckpointCorrupt``, ``StorageIOError``, ...), as ``run_dcp`` raises DCP's.
        CheckpointException: DCP's path failed (``run_dcp`` turns it into a cpuckpt error).
    """
    inner = _inner_load()
    if inner is None:  # a torch without DCP's inner load: its public entry point, no fast path
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
        return False
    keys = sorted(state_dict.keys())  # as dcp.load: every rank plans the same order
    resolved = {k: _state_of(state_dict[k]) for k in keys}
    plan = plan_fast(resolved, metadata, planner)
    fast = _agree(plan is not None, process_group)
    if fast:
        _load_fast(resolved, plan, reader, process_group)  # type: ignore[arg-type]
    else:
        if plan is None:
            logger.debug("load of %s: DCP's planner (the fast path's conditions do not hold)", reader.path)
        no_dist = not (dist.is_available() and dist.is_initialized())
        inner(state_dict=resolved, storage_reader=reader, process_group=process_group, no_dist=no_dist,
              planner=planner)
    for k in keys:
        elem = state_dict[k]
        if _is_stateful(elem):
            elem.load_state_dict(resolved[k])
        else:
            state_dict[k] = resolved[k]
    return fast


def _load_fast(state_dict: dict[str, Any], plan: FastPlan, reader: StorageReader, group: Any) -> None:
    rank = dist.get_rank(group) if group is not None else 0
    error: BaseException | None = None
    try:
        metadata = reader.read_metadata()  # the preloaded one; stamps this load's id as DCP's path does
        reader.set_up_storage_reader(metadata, rank == 0)
        blobs = reader.read_whole(plan.tensors, list(plan.blobs))
        trusted, where = reader.config.integrity.trusted, str(reader.path)
        for fqn, path in plan.blobs.items():
            # what DefaultLoadPlanner.load_bytes does with a flattened state dict, but weights_only unless trusted
            set_element(state_dict, path, load_value(blobs[fqn], fqn, trusted=trusted, where=where))
    except BaseException as e:
        error = e
    if group is None and is_interrupt(error):
        raise error  # type: ignore[misc]  # Ctrl-C: itself, never a cpuckpt error
    # One error for every rank, built as run_dcp builds it from DCP's gathered failures (also without a group:
    # DCP's path wraps a lone process's failure the same way).
    reports = gather_failures(error, rank, group)
    if is_interrupt(error):
        raise error  # type: ignore[misc]  # this rank's Ctrl-C as itself; the peers raise the error naming it
    raise_if_failed(reports, f"load of {reader.path}", error)


def _agree(mine: bool, group: Any) -> bool:
    """True when every rank of ``group`` can take the fast path (one all-reduce); ``mine`` without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return mine
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _is_stateful(value: Any) -> bool:
    # isinstance against the runtime-checkable Protocol costs ~15 us: tensors skip it
    return not isinstance(value, torch.Tensor) and isinstance(value, Stateful)


def _state_of(value: Any) -> Any:
    return value.state_dict() if _is_stateful(value) else value


@functools.lru_cache(maxsize=1)
def _inner_load() -> Any:
    """DCP's ``_load_state_dict`` when it takes the arguments ``dcp.load`` passes it (torch 2.0-2.13 do)."""
    inner = getattr(_loader, "_load_state_dict", None)
    wanted = {"state_dict", "storage_reader", "process_group", "no_dist", "planner"}
    if inner is None or not wanted <= set(inspect.signature(inner).parameters):
        return None
    return inner
