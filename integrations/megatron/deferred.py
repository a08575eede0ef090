"""Saves whose start waits for the next start point (``megatron: {ordering: optimizer}``).

Megatron-LM's ``save-checkpoint`` timer calls ``torch.cuda.synchronize()`` when it stops
(megatron/core/timers.py), which waits for every stream, the save's side stream included: device-to-host
copies enqueued inside ``save_checkpoint`` block the trainer until they are done (on the H200, 13 GB:
the timer read 0.34 s of which the strategy's call was 0.04 s). So, when the async queue is watched
by cpuckpt (:func:`.guard.watch_async_queue`, which the Megatron-LM hook installs), the strategy only
records the save (to the durable root, or a non-persistent memory-tier save; a persistent memory-tier
save starts at once, its persist request being part of the call); it is planned and its copies
enqueued at the next *start point*, after the timer:

- the next ``maybe_finalize_async_calls`` of the watched queue (Megatron-LM calls it at the top of every
  iteration, before ``train_step``): the copies then overlap that iteration's forward and backward;
- else the next optimizer step (wrapped by the hook), before its body: correct, without overlap of copies
  made by the trainer (the step waits for them);
- a blocking finalize starts what is still recorded first, so the last save of a run never waits for
  a start that will not come.

Every rank passes the same start points in the same order (the saves are collective). Between the
call and its start nothing may change a saved tensor: in Megatron-LM the next writer of parameters
and optimizer state is the optimizer step; ``expert_bias`` and ``qb_beta`` (written earlier, in
``finalize_model_grads``) are cloned at the call, and so are the objects held in host memory (RNG
generators advanced by dropout with CUDA graphs, the rerun state machine's counters).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["defer", "enable", "enabled", "start_all"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
# Per process: start points are (Megatron-LM's one async queue's finalize, any wrapped optimizer step,
# both process-wide functions), and a save cannot tell which queue its request will be scheduled on.
# Starting another model's recorded save early only loses overlap. Must not be started off the
# trainer's thread, nor in a different order on different ranks (the starts are collective).
_STARTS: list[Callable[[], None]] = []
_ENABLED = False  # a watched queue exists in this process (guard.watch_async_queue)


def enable() -> None:
    """A watched queue exists: its finalize is a start point, so saves may wait for it."""
    global _ENABLED
    _ENABLED = True


def enabled() -> bool:
    return _ENABLED


def defer(start: Callable[[], None]) -> None:
    """Record a save's start for the next start point."""
    with _LOCK:
        _STARTS.append(start)


def start_all() -> int:
    """Start every recorded save, in order (collective: every rank calls it at the same point); returns how many.
    A start that raises leaves the saves recorded after it for the next start point, in order."""
    with _LOCK:
        starts, _STARTS[:] = list(_STARTS), []
    for i, start in enumerate(starts):
        try:
            start()
        except BaseException:
            with _LOCK:
                _STARTS[:0] = starts[i + 1 :]
            raise
    return len(starts)

