"""``save``/``load``: thin sugar over ``dcp.save``/``dcp.load`` with cpuckpt's writer and reader.

Checkpoint collectives run on a dedicated gloo group (created once, on first use, by every rank),
never on the trainer's NCCL group. DCP's ``CheckpointException`` derives from ``BaseException``;
these functions unwrap it and raise the first rank's cpuckpt error (or a ``CpuckptError``).
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as _saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .checkpoints import after_commit, loading
from .commit import load_metadata
from .config import Config
from .errors import CpuckptError
from .reader import StorageReader
from .staging import get_pool
from .telemetry import record_load, record_save
from .writer import StorageWriter, resolve_config

__all__ = ["checkpoint_group", "dcp_save", "load", "prepare_pool", "save"]

logger = logging.getLogger(__name__)

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


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    step: int | None = None,
    process_group: Any = None,
    planner: Any = None,
) -> None:
    """Save ``state_dict`` (DTensors, ShardedTensors, tensors on any device, other objects) to ``path``.

    Every rank calls it. Files are stock DCP-compatible; ``path/.metadata`` appears only once every
    rank's files are durable.

    Args:
        state_dict: what to save, as for ``dcp.save``.
        path: checkpoint directory.
        config: a :class:`Config`, a YAML path, a dict, or None.
        step: training step, recorded in the manifest.
        process_group: the trainer's group; checkpoint collectives use a gloo group over its ranks.
        planner: a DCP ``SavePlanner`` (default: DCP's default planner).

    Raises:
        CpuckptError: any rank failed; the message names the rank and the cause.

    Example:
        >>> cpuckpt.save({"model": model.state_dict()}, "/ckpt/step_100", step=100)
    """
    t0 = time.perf_counter()
    writer = StorageWriter(path, config, step=step)
    group = checkpoint_group(process_group, writer.config.timeout_s)
    _call(lambda: dcp_save(state_dict, writer, planner=planner, process_group=group), "save", path)
    elapsed = time.perf_counter() - t0
    record_save(writer.config, path=path, rank=writer.rank, step=step, stall_s=elapsed, persist_s=elapsed,
                nbytes=writer.last_write_nbytes, mode="streaming", files=len(writer.job.names) if writer.job else 0)
    if writer.is_coordinator:
        after_commit(path, writer.config)  # `latest`, cleaning, retention: only when configured


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    process_group: Any = None,
    planner: Any = None,
) -> None:
    """Load ``path`` in place into ``state_dict`` (resharding as needed), like ``dcp.load``.

    Reads cpuckpt checkpoints (verifying checksums when configured) and stock DCP checkpoints.

    Raises:
        CheckpointCorrupt: a file is missing, truncated or fails its checksum.
        IntegrityError: the checkpoint is not committed (no ``.metadata``).
    """
    t0 = time.perf_counter()
    reader = StorageReader(path, config)
    # DCP (torch 2.13) swallows read_metadata's exception and raises a bare AssertionError
    # ("metadata is None; ..."), so an uncommitted checkpoint is reported here, on every rank.
    load_metadata(Path(path))
    group = checkpoint_group(process_group, reader.config.timeout_s)
    with loading(path):  # retention never deletes a checkpoint while it is being loaded
        _call(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group), "load",
              path)
    rank = dist.get_rank(group) if group is not None else 0
    record_load(reader.config, path=path, rank=rank, seconds=time.perf_counter() - t0,
                nbytes=reader.last_read_nbytes, files=len({getattr(s, "relative_path", None)
                                                           for s in reader.storage_data.values()}))


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy with every ``Stateful`` value replaced by its ``state_dict()``, as dcp.save does.

    Tensors are skipped before the Protocol check: ``isinstance`` against a runtime-checkable
    Protocol costs ~15 us per value, stall time for flat state dicts of thousands of tensors.
    """
    return {k: (v.state_dict() if not isinstance(v, torch.Tensor) and isinstance(v, Stateful) else v)
            for k, v in state_dict.items()}


def dcp_save(state_dict: dict[str, Any], writer: StorageWriter, *, planner: Any = None,
             process_group: Any = None) -> Any:
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


def prepare_pool(nbytes: int, config: Config | str | os.PathLike | dict | None = None) -> None:
    """Create, pre-touch and pin this process's host pool now, sized for a shard of ``nbytes``.

    Call it at start-up so that the first snapshot-mode ``async_save`` does not pay for fresh
    memory (~0.4 s/GiB on the lent VM) or for pinning it.
    """
    cfg = resolve_config(config)
    chunk = cfg.io.chunk_bytes
    # Records add ~2 KB each and large tensors are aligned: leave a few chunks of slack.
    nslots = -(-nbytes // chunk) + max(4, nbytes // chunk // 64)
    get_pool(chunk, max(nslots, cfg.staging.pool_bytes // chunk), pin=cfg.staging.pin, pretouch=True)


def _call(fn: Any, what: str, path: str | os.PathLike) -> None:
    try:
        fn()
    except CheckpointException as e:
        raise _unwrap(e, what, path) from e


def _unwrap(e: CheckpointException, what: str, path: str | os.PathLike) -> BaseException:
    # DCP keeps {rank: (exception, traceback summary)} of every failed rank.
    failures = {r: (f[0] if isinstance(f, tuple) else f) for r, f in (getattr(e, "failures", {}) or {}).items()}
    for rank in sorted(failures):
        if isinstance(failures[rank], CpuckptError):
            return failures[rank]
    if failures:
        rank = min(failures)
        return CpuckptError(f"{what} of {path} failed on rank {rank}: {failures[rank]!r}")
    return CpuckptError(f"{what} of {path} failed: {e}")
