"""A watchdog for megatron-core's ``AsyncCallsQueue``: a dead persistent worker becomes an error on every rank.

megatron-core's ``PersistentAsyncCaller`` (0.16 to 0.19, and nvidia-resiliency-ext 0.7's) waits for its
worker's completion message without checking that the worker still lives. A worker killed from
outside (the OOM killer, a segfault in a library) leaves ``maybe_finalize_async_calls(blocking=True)``
spinning forever and the non-blocking form answering "not done" forever; cpuckpt's finalize function
never runs. (cpuckpt's own worker function never raises, and a dead *temporal* caller is already an
error at finalize.)

:func:`watch_async_queue` wraps one queue's ``maybe_finalize_async_calls``: while calls are pending,
every rank checks its persistent worker's process and the ranks agree (one all-reduce on cpuckpt's
gloo group), so all of them raise :class:`WorkerDiedError` together. A blocking wait is also bounded
by ``timeout_s``. Queues of other shapes are left unwatched (with a warning).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from cpuckpt.backend.collectives import checkpoint_group
from cpuckpt.errors import CheckpointTimeoutError, CpuckptError

__all__ = ["WorkerDiedError", "watch_async_queue"]

logger = logging.getLogger(__name__)

POLL_S = 0.05


class WorkerDiedError(CpuckptError):
    """A rank's persistent checkpoint worker exited while async saves were pending."""


def _pending_callers(queue: Any) -> list[Any]:
    return [getattr(call, "async_caller", None) for call in getattr(queue, "async_calls", ())]


def _dead_worker(queue: Any) -> str | None:
    """This rank: the exit code of a persistent worker that ended with calls still pending."""
    for caller in _pending_callers(queue):
        if caller is None or not hasattr(caller, "comp_q"):  # temporal callers: finalize reports them
            continue
        process = getattr(caller, "process", None)
        code = getattr(process, "exitcode", None)
        if process is not None and code is not None:
            return f"pid {process.pid} exit code {code}"
    return None


def watch_async_queue(queue: Any, timeout_s: float = 600.0) -> Any:
    """Wrap ``queue.maybe_finalize_async_calls`` (in place) with the dead-worker check; returns ``queue``.

    Every rank must wrap its queue (the check is collective unless ``no_dist=True`` is passed).
    """
    if not hasattr(queue, "async_calls") or not hasattr(queue, "maybe_finalize_async_calls"):
        logger.warning("cpuckpt: %s is not a megatron-core AsyncCallsQueue; not watched", type(queue).__name__)
        return queue
    original = queue.maybe_finalize_async_calls
    group = checkpoint_group(None, timeout_s)

    def check(no_dist: bool, waited_s: float) -> None:
        mine = _dead_worker(queue)
        late = waited_s > timeout_s
        flags = torch.tensor([1 if mine else 0, 1 if late else 0], dtype=torch.int32)
        if group is not None and not no_dist:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if int(flags[0]):
            where = f"rank {rank}'s ({mine})" if mine else "another rank's"
            raise WorkerDiedError(f"{where} persistent checkpoint worker died with {len(queue.async_calls)} "
                                  "async save(s) pending; those checkpoints are incomplete")
        if int(flags[1]):
            raise CheckpointTimeoutError(f"rank {rank}: async saves not finalized after {timeout_s:.0f} s")

    def maybe_finalize_async_calls(blocking: bool = False, no_dist: bool = False) -> list[int]:
        done: list[int] = []
        t0 = time.monotonic()
        while True:
            if queue.async_calls:  # the same on every rank: scheduling and finalizing are collective
                check(no_dist, time.monotonic() - t0 if blocking else 0.0)
            done += original(blocking=False, no_dist=no_dist)
            if not blocking or not queue.async_calls:
                return done
            time.sleep(POLL_S)

    queue.maybe_finalize_async_calls = maybe_finalize_async_calls
    return queue
