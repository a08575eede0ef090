"""The one seam between megatron-core versions (0.16 on Python 3.11, 0.19 on Python 3.12, 0.20-dev in Megatron-LM).

0.16 has ``AsyncRequest`` in ``strategies.async_utils`` and calls ``async_save(sd, dir)``; 0.19 picks the
request class by ``async_strategy`` ("mcore" or "nvrx", via ``get_async_strategy``), calls
``async_save(sd, dir, async_strategy)``, and its ``MCoreLoadPlanner`` takes streaming-dequant and
flattening arguments that 0.16's does not.

:class:`AsyncQueueShape` is what the watchdog (:mod:`.guard`) needs from an ``AsyncCallsQueue`` and
cannot get from a public API: the persistent worker's process, and how to make the queue spawn a new
one. The shapes (read from each package's source):

- megatron-core 0.16 and nvidia-resiliency-ext 0.7 (``nvidia_resiliency_ext.checkpointing.async_ckpt.core``,
  Megatron-LM's default ``async_strategy="nvrx"``): the queue holds its ``PersistentAsyncCaller`` in the
  instance attribute ``persistent_caller``; the caller holds ``process`` and its queues (``queue``,
  ``preload_q``, ``comp_q``) as instance attributes. nvidia-resiliency-ext also keeps a pre-started
  caller in the class attribute ``AsyncCallsQueue._warmup_persistent_caller`` until first use (and
  replaces it itself when its process is dead).
- megatron-core 0.17 to 0.20-dev: one worker per trainer process, in class attributes:
  ``AsyncCallsQueue._persistent_caller``, and ``PersistentAsyncCaller._persistent_process``,
  ``_persistent_queue``, ``_persistent_preload_q``, ``_persistent_comp_q`` (the caller's instance
  ``process`` points to the same process once it has scheduled a request).
- Temporal callers (all versions): a process forked per request, in the caller's ``process``.

A caller of any other shape is named in a warning, once per class, together with what is not watched.

Megatron-LM's modules import some functions by name (``megatron.training.training`` imports ``save_checkpoint`` and
``load_checkpoint`` from ``megatron.training.checkpointing``): :func:`replace_function` puts a wrapper in every place.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["AsyncQueueShape", "load_planner_kwargs", "make_async_request", "mcore_async_kwargs",
           "megatron_core_version", "replace_function"]

logger = logging.getLogger(__name__)

PERSISTENT, TEMPORAL, UNKNOWN = "persistent", "temporal", "unknown"
# megatron-core 0.17+: the persistent worker and its queues live on the caller class
_CLASS_WORKER_ATTRS = ("_persistent_process", "_persistent_queue", "_persistent_preload_q", "_persistent_comp_q")
_warned: set[str] = set()  # per process: each version difference is warned about once


def megatron_core_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def mcore_async_kwargs() -> dict[str, Any]:
    """``dist_checkpointing.save`` keyword arguments for megatron-core's own ``AsyncCallsQueue``.

    megatron-core >= 0.17 picks the request class by ``async_strategy`` and defaults to "nvrx"
    (nvidia-resiliency-ext's queue); with megatron-core's queue the request must be an "mcore" one.
    """
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


def make_async_request(async_strategy: str, fn: Callable[..., None] | None, args: tuple,
                       finalize_fns: list[Callable[[], None]]) -> Any:
    """An ``AsyncRequest`` of the class the caller's ``AsyncCallsQueue`` expects (``fn`` None: no worker takes part)."""
    try:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
    except ImportError:  # megatron-core <= 0.16: one AsyncRequest class
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        return AsyncRequest(fn, args, finalize_fns)
    _, modules = get_async_strategy(async_strategy or "mcore")
    return modules["AsyncRequest"](fn, args, finalize_fns, async_fn_kwargs={}, preload_fn=None)


def load_planner_kwargs(strategy: Any, flexible: list, mismatch: dict) -> dict[str, Any]:
    """``MCoreLoadPlanner`` arguments matching what the installed torch_dist load strategy passes."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    kwargs: dict[str, Any] = {
        "shapes_validation_sharded_tensors": flexible,
        "allow_shape_mismatch_sharded_tensors": mismatch,
    }
    params = inspect.signature(MCoreLoadPlanner.__init__).parameters
    if "stream_ckpt_dequant" in params:  # 0.19: what TorchDistLoadShardedStrategy.load passes
        kwargs.update(stream_ckpt_dequant=getattr(strategy, "stream_ckpt_dequant", True),
                      flatten_state_dict=False, flatten_sharded_tensors=False)
    return kwargs


class AsyncQueueShape:
    """A view of one ``AsyncCallsQueue`` (megatron-core 0.16-0.20, nvidia-resiliency-ext 0.7): its pending
    calls, their workers' processes, and how to drop a worker so that the next save spawns a new one.

    Only the queue's public ``async_calls`` (a deque of ``(idx, async_caller, async_request)``) and
    the attributes listed in this module's docstring are read.
    """

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    # -- reading -------------------------------------------------------------------------------
    def pending(self) -> list[Any]:
        """The pending calls, oldest first."""
        return list(getattr(self.queue, "async_calls", ()))

    @staticmethod
    def caller_kind(caller: Any) -> str:
        """``persistent``, ``temporal`` or ``unknown`` (warned about once per class)."""
        cls = type(caller)
        if hasattr(caller, "comp_q") or hasattr(cls, "_persistent_comp_q"):  # 0.16 / nvrx; 0.17+
            return PERSISTENT
        if cls.__name__ == "TemporalAsyncCaller" and hasattr(caller, "process"):
            return TEMPORAL
        _warn_once(cls, "its worker process is not watched: a worker that dies before it takes a save "
                        "is not detected and not replaced (one that dies while holding a cpuckpt save "
                        "still is seen, through cpuckpt's channel)")
        return UNKNOWN

    @staticmethod
    def processes(caller: Any) -> list[Any]:
        """The worker process(es) a caller holds (instance ``process``; on 0.17+ also the class's)."""
        found = [getattr(caller, "process", None), getattr(type(caller), "_persistent_process", None)]
        out: list[Any] = []
        for p in found:
            if p is not None and all(p is not q for q in out):
                out.append(p)
        return out

    def dead_persistent_worker(self, calls: Iterable[Any] | None = None, *, idle: bool = False) -> str | None:
        """This rank: a persistent worker that ended while calls are pending (e.g. killed before it
        took its request), as ``"pid N, exit code C"``; None if none did (or none can be seen).

        ``calls``: the pending calls to look at (default: all). ``idle``: look at the queue's own persistent
        callers instead (pending calls or not), e.g. before ``close()``, which would wait forever for a dead
        worker to acknowledge its stop.
        """
        pending = self.pending() if calls is None else calls
        callers = self._queue_callers() if idle else [getattr(call, "async_caller", None) for call in pending]
        for caller in callers:
            if caller is None or self.caller_kind(caller) != PERSISTENT:
                continue  # a temporal caller ends after each save; finalize and the channel judge it
            for process in self.processes(caller):
                code = _exitcode(process)
                if code is not None:
                    return f"pid {getattr(process, 'pid', '?')}, exit code {code}"
        return None

    def _queue_callers(self) -> list[Any]:
        """The persistent callers the queue holds: its own (0.16, nvrx), the class's (0.17+), and
        nvidia-resiliency-ext's pre-started one not used yet."""
        cls = type(self.queue)
        found = [vars(self.queue).get("persistent_caller"), getattr(cls, "_persistent_caller", None),
                 getattr(cls, "_warmup_persistent_caller", None)]
        return [c for c in found if c is not None]

    # -- replacing -------------------------------------------------------------------------------
    def abandon(self, calls: Iterable[Any], join_s: float = 10.0) -> None:
        """Stop the workers of ``calls`` (and the queue's persistent worker) and forget them.

        After this the queue's next ``schedule_async_request`` builds a new ``PersistentAsyncCaller``
        with new multiprocessing queues (nothing stale left in them) and spawns a new worker: on 0.16
        and nvidia-resiliency-ext by clearing ``queue.persistent_caller``; on 0.17+ by clearing the
        class attributes ``AsyncCallsQueue._persistent_caller`` and ``PersistentAsyncCaller._persistent_*``
        (``close(abort=True)`` clears the latter already when the caller had scheduled something);
        nvidia-resiliency-ext's unused pre-started caller (``_warmup_persistent_caller``) goes too.
        Each caller is closed with ``close(abort=True)`` first (megatron-core: SIGKILL; nvidia-resiliency-ext:
        SIGTERM, then SIGKILL), then any process still running is killed and reaped.
        """
        callers: list[Any] = []

        def add(caller: Any) -> None:
            if caller is not None and all(caller is not c for c in callers):
                callers.append(caller)

        for call in calls:
            add(getattr(call, "async_caller", None))
        queue_cls = type(self.queue)
        for caller in self._queue_callers():
            add(caller)
        processes = [p for c in callers for p in self.processes(c)]
        for caller in callers:
            for q in _mp_queues(caller):  # nothing may wait to flush into a pipe no process reads
                try:
                    q.cancel_join_thread()
                except Exception:  # noqa: S110 - best effort
                    pass
            try:
                caller.close(abort=True)
            except Exception as e:
                logger.warning("cpuckpt: closing %s failed: %r", type(caller).__name__, e)
            if self.caller_kind(caller) == PERSISTENT:
                for name in _CLASS_WORKER_ATTRS:
                    if getattr(type(caller), name, None) is not None:
                        setattr(type(caller), name, None)
        if "persistent_caller" in vars(self.queue):
            self.queue.persistent_caller = None
        for name in ("_persistent_caller", "_warmup_persistent_caller"):
            if getattr(queue_cls, name, None) is not None:
                setattr(queue_cls, name, None)
        for p in processes:
            try:
                if _exitcode(p) is None:
                    p.kill()
                p.join(join_s)
            except Exception as e:
                logger.warning("cpuckpt: could not stop checkpoint worker pid %s: %r", getattr(p, "pid", "?"), e)


def _exitcode(process: Any) -> int | None:
    """The process's exit code (reaping it), None while it runs or if that cannot be told."""
    try:
        return process.exitcode
    except (AttributeError, ValueError):  # not a multiprocessing.Process, or closed
        return None


def _mp_queues(caller: Any) -> list[Any]:
    found = [v for v in vars(caller).values() if hasattr(v, "cancel_join_thread")]
    found += [getattr(type(caller), n, None) for n in _CLASS_WORKER_ATTRS[1:]]
    return [q for q in found if q is not None and hasattr(q, "cancel_join_thread")]


def _warn_once(cls: type, what: str) -> None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in _warned:
        _warned.add(name)
        logger.warning("cpuckpt: %s is not an async caller of a shape cpuckpt knows (megatron-core 0.16-0.20, "
                       "nvidia-resiliency-ext 0.7): %s", name, what)


def replace_function(module: Any, name: str, original: Any, wrapper: Any,
                     importers: Iterable[Any] | None = None) -> None:
    """Put ``wrapper`` in place of ``module.<name>`` and of every ``importers``' own ``<name>`` that is ``original``
    (default importers: every loaded ``megatron.*`` module)."""
    setattr(module, name, wrapper)
    if importers is None:
        importers = [m for n, m in list(sys.modules.items()) if n.startswith("megatron") and m]
    for m in importers:
        if m is not module and getattr(m, name, None) is original:
            setattr(m, name, wrapper)
