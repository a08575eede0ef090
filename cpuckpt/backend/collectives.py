"""Checkpoint collectives: the gloo groups, DCP's save entry point, and errors raised alike on every rank.

Checkpoint collectives run on dedicated gloo groups (created once, on first use, by every rank),
never on the trainer's NCCL group, and a group is never used by two threads at once. DCP's
``CheckpointException`` derives from ``BaseException``; :func:`run_dcp` turns it into the same
:class:`~cpuckpt.errors.CpuckptError` on every rank (see :func:`cpuckpt.errors.rank_error`).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as _saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from cpuckpt.errors import CpuckptError, FailureReport, is_interrupt, rank_error

__all__ = [
    "agree_or_raise",
    "checkpoint_group",
    "dcp_save",
    "from_rank",
    "gather_failures",
    "new_gloo_group",
    "one_contract",
    "peers",
    "raise_if_failed",
    "resolve_stateful",
    "run_dcp",
]

# Per process, as process groups are (creating one is collective: once per group keeps the ranks in
# step). Must not be used by two threads at once: planning collectives run on the trainer's thread only.
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


def peers(group: Any) -> Any:
    """``group``, or None where it holds this process alone: an agreement among one rank is that rank's own value,
    and a gloo collective on a group of one still costs ~0.2-0.4 ms (six or more per memory save every iteration)."""
    if group is not None and dist.get_world_size(group) == 1:
        return None
    return group


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


def run_dcp(fn: Callable[[], Any], what: str, path: str | os.PathLike, *, rank: int | None = None) -> Any:
    """Run a DCP collective; a ``CheckpointException`` becomes the same cpuckpt error on every rank.

    DCP gathers every rank's exception before raising, so each rank holds the same failures and
    builds the same error from them; the ``CheckpointException`` (with the originals) is its cause.
    DCP also catches ``KeyboardInterrupt``/``SystemExit``: when this rank's (``rank``, in DCP's group;
    default: the one failure raised in this process) is one, it is re-raised as itself, so Ctrl-C is
    never an ordinary exception. The peers raise the contract's error naming it.
    """
    try:
        return fn()
    except CheckpointException as e:
        failures = {r: (f[0] if isinstance(f, tuple) else f) for r, f in (getattr(e, "failures", {}) or {}).items()}
        interrupt = _local_interrupt(failures, rank)
        if interrupt is not None:
            raise interrupt from None
        reports = [FailureReport.of(f, r) for r, f in sorted(failures.items())]
        raise (rank_error(reports, f"{what} of {path}") or CpuckptError(f"{what} of {path} failed: {e}")) from e


def _local_interrupt(failures: dict[int, BaseException], rank: int | None) -> BaseException | None:
    """This rank's ``KeyboardInterrupt``/``SystemExit`` among DCP's gathered failures, if it had one.

    Without ``rank``: the failure that was raised in this process (it has a traceback; a peer's arrived
    pickled, without one).
    """
    if rank is not None:
        mine = [failures[rank]] if rank in failures else []
    else:
        mine = [f for f in failures.values() if isinstance(f, BaseException) and f.__traceback__ is not None]
    return next((f for f in mine if is_interrupt(f)), None)


def gather_failures(error: BaseException | None, rank: int, group: Any) -> list[FailureReport | None]:
    """All-gather every rank's failure (``None`` = fine) on ``group``; collective when ``group`` is set."""
    mine = None if error is None else FailureReport.of(error, rank)
    if peers(group) is None:  # no group, or this rank alone
        return [mine]
    reports: list[FailureReport | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    return reports


def agree_or_raise(error: BaseException | None, rank: int, group: Any, what: str) -> None:
    """Raise the same error on every rank of ``group`` when any rank's ``error`` is set; collective.

    One all-reduce of a flag when every rank is fine; the reports are gathered only after a failure.
    A local ``KeyboardInterrupt``/``SystemExit`` is raised as itself, after the peers learned of it.
    """
    group = peers(group)
    if group is not None:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
        reports = gather_failures(error, rank, group)
    elif error is None:
        return
    else:
        reports = [FailureReport.of(error, rank)]
    if is_interrupt(error):
        raise error  # type: ignore[misc]
    raise_if_failed(reports, what, error)


def from_rank(compute: Callable[[], Any], group: Any, what: str, src: int = 0) -> Any:
    """``compute()`` on rank ``src`` of ``group``, its value given to every rank in one broadcast; collective. A
    failure there travels in that broadcast and is raised on every rank at once (the same error; an interrupt as
    itself on ``src``), not while the others wait until the group's timeout; no other collective is added (a save
    across nodes calls it every time). ``group`` None (or of this process alone): this process computes it."""
    if group is not None and not 0 <= src < dist.get_world_size(group):
        raise ValueError(f"from_rank: src {src} is not a rank of a group of {dist.get_world_size(group)}")
    group = peers(group)
    rank = dist.get_rank(group) if group is not None else src
    box: list[Any] = [None]
    error: BaseException | None = None
    value: Any = None
    if rank == src:
        report, value, payload, error = _outcome(compute, rank)
        box = [(report, payload)]
    if group is not None:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    report, payload = box[0]
    _raise_reported([report], what, error)
    return value if rank == src else pickle.loads(payload)


def from_every_rank(compute: Callable[[], Any], group: Any, what: str) -> list[Any]:
    """``compute()`` on every rank of ``group``, every rank's value to every rank in one all-gather (by rank);
    collective. A failure on any rank travels in it and is raised on every rank alike (an interrupt as itself where
    it happened), not while the others wait in a later collective until the group's timeout. ``group`` None (or of
    this process alone): this process's value alone."""
    group = peers(group)
    rank = dist.get_rank(group) if group is not None else 0
    report, value, payload, error = _outcome(compute, rank)
    every: list[Any] = [(report, payload)]
    if group is not None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (report, payload), group=group)
    _raise_reported([r for r, _ in every], what, error)
    return [value if r == rank else pickle.loads(p) for r, (_, p) in enumerate(every)]


def _outcome(compute: Callable[[], Any], rank: int) -> tuple[FailureReport | None, Any, bytes | None,
                                                              BaseException | None]:
    """``compute()``'s value and its pickle (made here, so that a value that cannot be pickled fails here, as this
    rank's failure, not in the collective while the others wait), or this rank's failure: (report, value, pickle,
    error)."""
    try:
        value = compute()
        return None, value, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), None
    except BaseException as e:
        return FailureReport.of(e, rank), None, None, e


def _raise_reported(reports: list[FailureReport | None], what: str, error: BaseException | None) -> None:
    """The same error on every rank when a report says some rank failed; this rank's interrupt as itself."""
    if any(report is not None for report in reports):
        if error is not None and is_interrupt(error):
            raise error
        raise_if_failed(reports, what, error)


@contextlib.contextmanager
def one_contract(what: str, rank: int | Callable[[], int] = 0) -> Iterator[None]:
    """An entry point's outermost guard: an exception that is not yet a cpuckpt error becomes one.

    ``OSError`` -> ``StorageIOError`` (errno, path), ``TimeoutError`` -> ``CheckpointTimeoutError``,
    anything else -> ``CpuckptError``, chained to the original (:func:`~cpuckpt.errors.rank_error` of
    this rank's report; ``rank`` may be a callable, asked only then). Cpuckpt errors and interrupts
    pass unchanged. Raised on one rank only: failures that peers must share are agreed before.
    """
    try:
        yield
    except CpuckptError:
        raise
    except Exception as e:
        r = rank() if callable(rank) else rank
        raise rank_error([FailureReport.of(e, r)], what) from e  # type: ignore[misc]


def raise_if_failed(reports: list[FailureReport | None], what: str, local: BaseException | None = None) -> None:
    """Raise :func:`~cpuckpt.errors.rank_error` of ``reports``, chained to this rank's own ``local`` error."""
    err = rank_error(reports, what)
    if err is not None:
        raise err from local
