"""Snapshot a whole state dict into the host pool: the ``dcp.async_save`` door.

DCP stages the complete state dict *before* it plans, so this door cannot know the file layout
while copying: every tensor is copied into one leased, contiguous run of the host pool (device to
host on a side stream for GPU tensors) and the writer later packs the records from there. That is
one host memcpy more than :func:`cpuckpt.async_save`, and it needs the pool to hold the whole shard
(snapshot mode only: a ``staging.pool_bytes`` smaller than the state dict, which asks for streaming,
is refused). The trainer may change its tensors once the returned future completes.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from cpuckpt.config import Config
from cpuckpt.errors import ConfigError, StagingError
from cpuckpt.transfer.staging import DeviceCopier, HostPool, Slot, get_pool
from cpuckpt.transfer.threads import shared_executor

__all__ = ["PoolSnapshot", "snapshot_state_dict"]

logger = logging.getLogger(__name__)

_ALIGN = 64  # byte alignment of each staged tensor inside the run


class PoolSnapshot:
    """A staged copy of a state dict living in one pool lease; ``release()`` returns the memory."""

    def __init__(self, pool: HostPool, slot: Slot | None, state_dict: dict[str, Any]) -> None:
        self.pool = pool
        self.slot = slot
        self.state_dict = state_dict
        self.ready: cf.Future[dict[str, Any]] = cf.Future()

    def release(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _walk(obj, lambda t: out.append(t) or t)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, fn) for v in obj)
    return copy.deepcopy(obj)


def snapshot_state_dict(state_dict: dict[str, Any], cfg: Config, *, extra_slots: int) -> PoolSnapshot:
    """Copy every tensor of ``state_dict`` into the pool; other objects are deep-copied.

    ``extra_slots`` are kept free beside the snapshot for the writer's chunks; a configured
    ``staging.pool_bytes`` is the pool's size (the writer's synchronous save streams through it).

    Raises:
        ConfigError: ``staging.pool_bytes`` is set and smaller than the state dict's tensors (streaming,
            which this door cannot do). Only the ranks whose shard does not fit raise; DCP's collectives
            on the others then fail after their timeout.
        StagingError: a tensor type this door cannot stage, or the copy failed.
    """
    tensors = _tensors(state_dict)
    total = 0
    for t in tensors:
        if type(t) is not torch.Tensor and not _is_dtensor(t) and not isinstance(t, torch.nn.Parameter):
            raise StagingError(f"dcp.async_save door: cannot stage a {type(t).__name__}; "
                               "use cpuckpt.async_save, which stages after planning")
        loc = _local(t)
        total += -(-loc.numel() * loc.element_size() // _ALIGN) * _ALIGN
    pool_bytes = cfg.staging.pool_bytes
    if 0 < pool_bytes < total:
        raise ConfigError(
            f"staging.pool_bytes ({pool_bytes}) is smaller than this rank's state dict ({total} bytes of tensors), "
            "which means streaming, and dcp.async_save cannot stream (DCP stages the whole state dict before "
            f"planning); use cpuckpt.async_save, or set staging.pool_bytes to 0 or at least {total}"
        )
    chunk = cfg.io.chunk_bytes
    run = max(1, -(-total // chunk))
    # With pool_bytes the writer's streaming save asks for pool_bytes // chunk slots while the run is leased:
    # a pool only as large as the run + extra_slots would have to grow then, and could not (in use).
    pool = get_pool(chunk, max(run + extra_slots, pool_bytes // chunk), pin=cfg.staging.pin)
    slot = pool.lease(cfg.timeout_s, count=run)
    devices = {_local(t).device for t in tensors if _local(t).device.type == "cuda"}
    copier = DeviceCopier(next(iter(devices))) if devices else None
    cursor = 0

    def stage(t: torch.Tensor) -> torch.Tensor:
        nonlocal cursor
        loc = _local(t).detach()
        nbytes = loc.numel() * loc.element_size()
        # Each staged tensor gets its own storage over the pool's bytes: DCP may pickle the staged
        # state dict (PROCESS mode moves storages to shared memory), which must never touch the pool.
        dst = torch.frombuffer(slot.view[cursor : cursor + nbytes], dtype=torch.uint8).view(loc.dtype).view(
            loc.shape) if nbytes else torch.empty(loc.shape, dtype=loc.dtype)
        cursor += -(-nbytes // _ALIGN) * _ALIGN
        if nbytes:
            if copier is not None and loc.device.type == "cuda":
                copier.copy(dst, loc)
            else:
                dst.copy_(loc)
        if _is_dtensor(t):
            return type(t).__new__(type(t), dst, t._spec, requires_grad=False)  # type: ignore[attr-defined]
        return dst

    try:
        staged = _walk(state_dict, stage)
    except RuntimeError as e:
        pool.release(slot)
        raise StagingError(f"dcp.async_save door: copying the state dict into host memory failed: {e}") from e
    snap = PoolSnapshot(pool, slot, staged)
    if copier is None:
        snap.ready.set_result(staged)
    else:
        event = copier.record()

        def wait() -> None:
            try:
                event.synchronize()
            except BaseException as e:
                snap.ready.set_exception(e)
                return
            snap.ready.set_result(staged)

        shared_executor(1, "cpuckpt-snapshot").submit(wait)
    return snap
