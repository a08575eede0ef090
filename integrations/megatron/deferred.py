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

With :func:`start_at_forward` (the Megatron-LM hook installs it on the model chunks where the pipeline has one
stage) the start point is instead the end of the model's next forward, on the trainer's thread: the GPU then
still has that forward's kernels queued, so the start's Python (~13 ms per save of a 24-layer GPT on an H100)
overlaps them, where at the top of the iteration the GPU waited for it, idle. The queue's finalize then starts
nothing unless it must wait for a save (a blocking or urgent finalize).

Every rank passes the same start points in the same order (the saves are collective). Between the
call and its start nothing may change a saved tensor: in Megatron-LM the next writer of parameters
and optimizer state is the optimizer step; ``expert_bias`` and ``qb_beta`` (written earlier, in
``finalize_model_grads``) are cloned at the call, and so are the objects held in host memory (RNG
generators advanced by dropout with CUDA graphs, the rerun state machine's counters).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ForwardStart", "defer", "enable", "enabled", "forward_will_start", "start_all", "start_at_forward"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
# Per process: start points are (Megatron-LM's one async queue's finalize, any wrapped optimizer step,
# both process-wide functions), and a save cannot tell which queue its request will be scheduled on.
# Starting another model's recorded save early only loses overlap. Must not be started off the
# trainer's thread, nor in a different order on different ranks (the starts are collective).
_STARTS: list[Callable[[], None]] = []
_ENABLED = False  # a watched queue exists in this process (guard.watch_async_queue)
_FORWARD_STARTS: list[ForwardStart] = []  # start_at_forward's hooks (saves start at the model's forward)


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


def start_at_forward(modules: Sequence[torch.nn.Module]) -> ForwardStart:
    """Make the end of each of ``modules``' forward (on the calling thread, the trainer's) the start point of the
    saves recorded before it, until the returned object's ``remove()``. Only where every rank runs those forwards
    at the same point of its iteration (one pipeline stage: a stage waiting in a start for a rank whose forward waits
    for that stage's activations would never end). Forwards on another thread, under ``torch.inference_mode`` (a
    rollout: tensors a start makes there could never be written in place again) or captured into a CUDA graph start
    nothing; the queue's finalize still starts what is recorded when no such forward ran since the previous finalize
    (:func:`forward_will_start`), and the next optimizer step whatever is left."""
    start = ForwardStart(modules, threading.get_ident())
    with _LOCK:
        _FORWARD_STARTS.append(start)
    return start


class ForwardStart:
    """The forward hooks of :func:`start_at_forward`; ``fired``: a forward that could start saves ran since the
    queue's previous finalize."""

    def __init__(self, modules: Sequence[torch.nn.Module], owner: int) -> None:
        self._owner = owner
        self.fired = False
        self._handles = [m.register_forward_hook(self._after_forward) for m in modules]

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._owner or torch.is_inference_mode_enabled():
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.fired = True
        if _STARTS:
            start_all()

    def remove(self) -> None:
        """The queue's finalize is the start point again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        with _LOCK:
            if self in _FORWARD_STARTS:
                _FORWARD_STARTS.remove(self)


def forward_will_start() -> bool:
    """At the queue's non-blocking finalize (every rank alike): whether the model's next forward will start what is
    recorded, i.e. a forward start point exists and its forward ran since the previous finalize. A run whose forward
    never reaches the hooked module (a full-iteration CUDA graph, MoE's overlapped 1F1B schedule) keeps the finalize
    as its start point. Each call begins a new observation."""
    with _LOCK:
        fired = any(f.fired for f in _FORWARD_STARTS)
        for f in _FORWARD_STARTS:
            f.fired = False
    return fired
