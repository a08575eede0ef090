"""Checkpoint collectives: the gloo groups, DCP's save entry point, and errors raised alike on every rank.

Checkpoint collectives run on dedicated gloo groups (created once, on first use, by every rank),
never on the trainer's NCCL group, and a group is never used by two threads at once. DCP's
``CheckpointException`` derives from ``BaseException``; :func:`run_dcp` turns it into the same
:class:`~cpuckpt.errors.CpuckptError` on every rank (see :func:`cpuckpt.errors.rank_error`).
"""

from __future__ import annotations

import datetime
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as _saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from cpuckpt.errors import CpuckptError, FailureReport, rank_error

__all__ = [
    "checkpoint_group",
    "dcp_save",
    "gather_failures",
    "new_gloo_group",
    "raise_if_failed",
    "resolve_stateful",
    "run_dcp",
]

_GROUPS: dict[Any, Any] = {}
_GROUPS_LOCK = threading.Lock()


def checkpoint_group(process_group: Any = None, timeout_s: float | None = None) -> Any:
    """The gloo group used for checkpoint collectives (None when torch.distributed is not initialised).

    If ``process_group`` is already a gloo group it is used as is. Otherwise a gloo group over the
    same ranks is created once and cached; every rank must reach this call (it is collective).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = process_group if process_group is not None else dist.group.WORLD
    if dist.get_backend(pg) == "gloo":
        return pg
    with _GROUPS_LOCK:
        if pg not in _GROUPS:
            _GROUPS[pg] = new_gloo_group(pg, timeout_s)
        return _GROUPS[pg]


def new_gloo_group(process_group: Any = None, timeout_s: float | None = None) -> Any:
    """A new gloo group over the ranks of ``process_group`` (default: the world); collective.

    For a thread of its own (a committer): a group must never be used by two threads at once.
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    return dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo", timeout=timeout)


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy with every ``Stateful`` value replaced by its ``state_dict()``, as dcp.save does.

    Tensors are skipped before the Protocol check: ``isinstance`` against a runtime-checkable
    Protocol costs ~15 us per value, stall time for flat state dicts of thousands of tensors.
    """
    return {k: (v.state_dict() if not isinstance(v, torch.Tensor) and isinstance(v, Stateful) else v)
            for k, v in state_dict.items()}


def dcp_save(state_dict: dict[str, Any], writer: Any, *, planner: Any = None, process_group: Any = None) -> Any:
    """``dcp.save`` with our writer.

    Where torch exposes its inner ``_save_state_dict`` (2.0 through 2.13 do), call it directly after
    resolving ``Stateful`` values ourselves: ``dcp.save`` wraps every top-level key in a logging
    decorator that costs ~0.1 ms per key, which is stall time for flat state dicts of many tensors.
    """
    inner = getattr(_saver, "_save_state_dict", None)
    if inner is None or not {"state_dict", "storage_writer", "process_group", "no_dist", "planner"} <= set(
        inspect.signature(inner).parameters
    ):
        return dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
    flat = resolve_stateful(state_dict)
    no_dist = not (dist.is_available() and dist.is_initialized())
    return inner(state_dict=flat, storage_writer=writer, process_group=process_group, no_dist=no_dist,
                 planner=planner)


def run_dcp(fn: Callable[[], Any], what: str, path: str | os.PathLike) -> Any:
    """Run a DCP collective; a ``CheckpointException`` becomes the same cpuckpt error on every rank.

    DCP gathers every rank's exception before raising, so each rank holds the same failures and
    builds the same error from them; the ``CheckpointException`` (with the originals) is its cause.
    """
    try:
        return fn()
    except CheckpointException as e:
        failures = dict(getattr(e, "failures", {}) or {})
        reports = [FailureReport.of(f[0] if isinstance(f, tuple) else f, r) for r, f in sorted(failures.items())]
        raise (rank_error(reports, f"{what} of {path}") or CpuckptError(f"{what} of {path} failed: {e}")) from e


def gather_failures(error: BaseException | None, rank: int, group: Any) -> list[FailureReport | None]:
    """All-gather every rank's failure (``None`` = fine) on ``group``; collective when ``group`` is set."""
    mine = None if error is None else FailureReport.of(error, rank)
    if group is None:
        return [mine]
    reports: list[FailureReport | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    return reports


def raise_if_failed(reports: list[FailureReport | None], what: str, local: BaseException | None = None) -> None:
    """Raise :func:`~cpuckpt.errors.rank_error` of ``reports``, chained to this rank's own ``local`` error."""
    err = rank_error(reports, what)
    if err is not None:
        raise err from local
