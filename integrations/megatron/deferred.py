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
- a blocking finalize (and one that waits for an urgent save) starts what is still recorded first, so the
  last save of a run never waits for a start that will not come.

A save copied from a device snapshot by the copy process (``at_step``) starts at the optimizer step, not at the
finalize: the step waits only for the device-to-device snapshot (milliseconds), and the save's start, tens of
milliseconds of Python (its state flattened, its plan matched, its ops described), runs while the device
still executes that iteration's forward and backward. At the finalize the device is idle — the timer's
``synchronize`` drained it — so the same work there is paid on the job's wall clock in full.

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
_STARTS: list[tuple[Callable[[], None], bool]] = []  # (start, waits for the optimizer step)
_ENABLED = False  # a watched queue exists in this process (guard.watch_async_queue)


def enable() -> None:
    """A watched queue exists: its finalize is a start point, so saves may wait for it."""
    global _ENABLED
    _ENABLED = True


def enabled() -> bool:
    return _ENABLED


def defer(start: Callable[[], None], *, at_step: bool = False) -> None:
    """Record a save's start for the next start point (``at_step``: the next optimizer step, or a finalize that
    waits; not a finalize that does not)."""
    with _LOCK:
        _STARTS.append((start, at_step))


def start_all(*, finalize: bool = False) -> int:
    """Start the recorded saves, in order (collective: every rank calls it at the same point); returns how many.
    ``finalize``: a start point that does not wait (the queue's non-blocking finalize), which stops before the
    first save recorded for the optimizer step (saves start in the order they were recorded)."""
    with _LOCK:
        n = len(_STARTS)
        if finalize:
            n = next((i for i, (_, at_step) in enumerate(_STARTS) if at_step), n)
        records = _STARTS[:n]
        del _STARTS[:n]
    for i, (start, _) in enumerate(records):
        try:
            start()
        except BaseException:
            with _LOCK:  # the saves after it still start at the next start point, in order
                _STARTS[:0] = records[i + 1 :]
            raise
    return len(records)
