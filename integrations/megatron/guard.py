"""A watchdog for megatron-core's ``AsyncCallsQueue``: a dead checkpoint worker becomes an error on every rank.

megatron-core's ``PersistentAsyncCaller`` (0.16 to 0.20-dev, and nvidia-resiliency-ext 0.7's) waits for
its worker's completion message without checking that the worker still lives. A worker killed from
outside (the OOM killer, a segfault in a library) leaves ``maybe_finalize_async_calls(blocking=True)``
spinning forever and the non-blocking form answering "not done" forever; cpuckpt's finalize function
never runs. (cpuckpt's own worker function never raises, and a dead *temporal* caller is already an
error at finalize.)

:func:`watch_async_queue` wraps one queue's ``maybe_finalize_async_calls``. While calls are pending,
every rank looks at its workers in two ways:

- cpuckpt's channel (:mod:`.worker`): a worker that took a cpuckpt save wrote its pid and beats
  about every second; a pid that no longer runs, or a beat older than ``heartbeat_timeout_s``, with
  no report, is a dead worker. This reads only files cpuckpt owns, on every megatron-core version.
- the queue (:class:`.compat.AsyncQueueShape`): a persistent worker process that has exited. This
  is the only way to see a worker that died *before* it took its request (it never wrote to the
  channel); it reads megatron-core's private attributes, per version, and warns about shapes it
  does not know.

The ranks agree (one all-reduce on cpuckpt's gloo group per check), so all of them act together.
A blocking wait is also bounded by ``timeout_s``. Then, on every rank: the calls that completed are
finalized; the others are dropped (their finalize functions, Megatron's ``metadata.json`` and
Megatron-LM's tracker file among them, never run, so no such checkpoint looks complete; cpuckpt's
own finalize step still runs to end its save and remove its channel files); every rank's workers
are stopped and forgotten, so the queue's next save spawns new ones. With ``on_failure: raise`` (the
default) every rank then raises :class:`WorkerDiedError` (``CheckpointTimeoutError`` for the bound);
with ``continue`` every rank logs it and training goes on. ``continue`` also covers a failed save
that megatron-core finalizes itself (a write error, a worker that raised): every rank raises the same
cpuckpt error there, which is logged instead; and a failure of Megatron's own finalize functions of a cpuckpt
save (``metadata.json``, the tracker: rank 0 only), which every rank raises alike too (:class:`_MegatronFinalize`).

The queue's ``close()`` is wrapped too: a persistent worker that died while idle (no save pending)
is forgotten first, since megatron-core's ``close`` would wait forever for it to acknowledge its stop.

**Calls the trainer completes.** A memory-tier save (:mod:`.memory`) needs no worker: the strategy schedules
it with no ``async_fn`` and a done probe on its finalize function (:data:`DONE_MARK`: whether this rank's save
has ended, committed or failed; :data:`PROBE_FAILED` when it failed on this rank alone and the others need not be
waited for, e.g. a persist). Megatron's callers never hear of such a call (no ``async_fn``: nothing is
sent to a worker, none is spawned for it), so megatron-core's own finalize cannot tell when it is done; the
watchdog does, in queue order: a cpuckpt call at the head is finalized (its finalize functions, Megatron's
too, run in order) once its probe says ended on every rank (one all-reduce on cpuckpt's gloo group, no device
synchronization); runs of Megatron's own calls go to megatron-core's finalize, shown only that run. So a
save every iteration costs no process round trip, no pickled request and no device-synchronizing poll.
A probe marked :data:`URGENT_MARK` (the memory tier's ``max_uncommitted: 1``) is finalized before the next
iteration is logged, and one marked :data:`MEMORY_MARK` (every memory-only save) before the next log line that
Megatron-LM prints (with a log interval above one), waiting for its commit like a blocking finalize (with the agreed
timeout), so Megatron-LM's tracker names it by then: at the look the hook makes before Megatron-LM's ``training_log``
(:func:`finalize_before_log`), where the save's copies have had the whole next iteration to run; a queue that no log
has looked at (megatron-core driven by its own loop) waits at its next look instead (the top of the next iteration).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cpuckpt.backend.collectives import agree_or_raise, checkpoint_group, peers
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, ConfigError, CpuckptError
from cpuckpt.transfer.pacing import PACER

from . import deferred
from .compat import AsyncQueueShape
from .settings import MegatronOptions, resolve_options
from .worker import Channel, wait_for_commit

__all__ = ["DIR_MARK", "DONE_MARK", "FINALIZE_MARK", "MEMORY_MARK", "PROBE_FAILED", "URGENT_MARK", "WAIT_MARK",
           "WorkerDiedError", "finalize_before_log", "finalize_saves_under", "is_watched", "watch_async_queue"]

logger = logging.getLogger(__name__)

# A blocking finalize looks again this often: the memory tier waits here for the save whose slot it reuses,
# so a coarse poll adds up to its period to every such save (each look: one check and Megatron's finalize).
POLL_S = 0.01
_WATCHED = "_cpuckpt_watchdog"
FINALIZE_MARK = "cpuckpt_finalize"  # on cpuckpt's finalize function: called (abandoned=True) for a dropped call too
DONE_MARK = "cpuckpt_done"  # on the finalize function of a call the trainer completes: its done probe (see above)
WAIT_MARK = "cpuckpt_wait"  # on a done probe: ``wait(timeout) -> bool``, until its save ended, at most ``timeout``
URGENT_MARK = "cpuckpt_urgent"  # on such a function: finalize it before the next log line, waiting for its commit
MEMORY_MARK = "cpuckpt_memory"  # on such a function: a memory-only save, waited for before a printed log line
_LOG_LOOKS = [False]  # a log looked in this process (finalize_before_log): urgent saves wait there, not at a top
PROBE_FAILED = 2  # a probe's answer (truthy): ended here in failure; the call is finalized (and raises) everywhere


class WorkerDiedError(CpuckptError):
    """A rank's checkpoint worker exited (or went silent) while async saves were pending."""


def watch_async_queue(queue: Any, timeout_s: float = 600.0, *,
                      config: MegatronOptions | Config | Mapping[str, Any] | str | os.PathLike | None = None,
                      on_failure: str | None = None) -> Any:
    """Wrap ``queue.maybe_finalize_async_calls`` and ``queue.close`` (in place) with the dead-worker
    check; returns ``queue``.

    Every rank must wrap its queue (the check is collective unless ``no_dist=True`` is passed, which
    keeps it local: a dead worker then raises on that rank only and nothing is replaced). Wrapping a
    queue twice is a no-op.

    Args:
        queue: megatron-core's or nvidia-resiliency-ext's ``AsyncCallsQueue``.
        timeout_s: bound of one blocking ``maybe_finalize_async_calls(blocking=True)``.
        config: where the adapter's options come from (the ``megatron:`` block of
            ``configs/megatron.yaml``, a mapping of that file's shape, a :class:`.MegatronOptions`,
            or None: defaults and ``CPUCKPT_MEGATRON_*``).
        on_failure: ``raise`` or ``continue``; overrides ``config``'s.

    Raises:
        ConfigError: a bad ``config`` or ``on_failure``.
    """
    current = getattr(queue, "maybe_finalize_async_calls", None)
    if getattr(current, _WATCHED, False):
        return queue
    options = resolve_options(config)
    if on_failure is not None:
        if on_failure not in ("raise", "continue"):
            raise ConfigError(f"on_failure must be one of raise, continue, got {on_failure!r}")
        options = dataclasses.replace(options, on_failure=on_failure)
    if not hasattr(queue, "async_calls") or current is None:
        logger.warning("cpuckpt: %s is not a megatron-core AsyncCallsQueue; not watched: a dead checkpoint "
                       "worker may leave its saves pending forever", type(queue).__name__)
        return queue
    dog = _Watchdog(queue, current, timeout_s, options)
    deferred.enable()  # this finalize is a start point for saves recorded by the strategy (deferred.py)

    def maybe_finalize_async_calls(blocking: bool = False, no_dist: bool = False) -> list[int]:
        deferred.start_all()  # after Megatron-LM's save-checkpoint timer, before the next train_step
        if blocking:
            PACER.drain()  # the trainer waits now, making no ticks: the copies of pending saves go at once
            return dog.finalize(True, no_dist)
        return dog.look(no_dist, urgent=not _LOG_LOOKS[0])  # urgent saves wait for the log's look where one comes

    setattr(maybe_finalize_async_calls, _WATCHED, True)
    queue.maybe_finalize_async_calls = maybe_finalize_async_calls
    queue._cpuckpt_dog = dog
    original_close = getattr(queue, "close", None)
    if callable(original_close):

        def close(abort: bool = False, *args: Any, **kwargs: Any) -> Any:
            return dog.close(original_close, abort, *args, **kwargs)

        queue.close = close
    return queue


DIR_MARK = "cpuckpt_dir"  # on cpuckpt's finalize function: the checkpoint directory of its save


def is_watched(queue: Any) -> bool:
    """Whether ``queue`` is watched (:func:`watch_async_queue`): only then may a call carry no ``async_fn``
    (:data:`DONE_MARK`): an unwatched persistent caller would wait forever for its worker to report it."""
    return getattr(getattr(queue, "maybe_finalize_async_calls", None), _WATCHED, False)


def finalize_before_log(queue: Any, printed: bool = False) -> list[int]:
    """The look before an iteration's log line (Megatron-LM's ``training_log``, wrapped by the hook), collective:
    finalize every save that has ended, then wait for the commits of the urgent ones at the head of the queue
    (:data:`URGENT_MARK`; where the line is ``printed``, every memory-only save there too, :data:`MEMORY_MARK`) and
    finalize them; returns the finalized call ids. The save of N started after the log of N, so by the log of N + 1
    its commit had the whole iteration N + 1 to end (at the top of N + 1 it had just begun): Megatron-LM's tracker
    names N before N + 1 is logged, at the cost of what the commit has left then. Once a log has looked in this
    process (a queue or not), the tops of iterations no longer wait for urgent saves (they still finalize what has
    ended). A queue that is not watched is left alone. ``printed``: the same on every rank."""
    _LOG_LOOKS[0] = True  # for the process: also where no queue exists yet (Megatron-LM makes it at the first save)
    dog = getattr(queue, "_cpuckpt_dog", None)
    if dog is None or not queue.async_calls:
        return []
    return dog.look(False, urgent=True, printed=printed)


def _done_probe(call: Any) -> Callable[[], bool] | None:
    """The done probe of a call the trainer completes: any call without an ``async_fn`` (no worker ever took it, so
    megatron-core's finalize, which reads its worker's next completion, must never see it): its :data:`DONE_MARK`
    finalize function's probe, else done at once (e.g. Megatron-LM's logits saver moved cpuckpt's finalize functions
    onto its own request, which has a worker). None: a call with a worker."""
    request = getattr(call, "async_request", None)
    if request is None or getattr(request, "async_fn", None) is not None:
        return None
    for fn in getattr(request, "finalize_fns", None) or ():
        probe = getattr(fn, DONE_MARK, None)
        if probe is not None:
            return probe
    return _nothing_to_wait_for


def _nothing_to_wait_for() -> bool:
    return True


def finalize_saves_under(queue: Any, parents: str | os.PathLike | Sequence[str | os.PathLike],
                         keep: int) -> list[int]:
    """Finalize ``queue``'s calls in order until no pending cpuckpt save into ``<parent>/<dir>`` (of any of
    ``parents``) is left but the newest ``keep`` (collective, like a blocking finalize); returns the finalized
    call ids.

    Called with ``keep=0`` before Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` removes all but the
    newest directories of ``parent`` (so its tracker names the newest one, which it keeps), or, with the memory
    tier, before the ring reuses the slot of the save ``slots`` saves back: megatron-core writes a save's
    ``metadata.json`` (and Megatron-LM its tracker) only when it finalizes the call, which the persistent worker
    (started by the first save, ~5 s) or a slow persist can delay past the removal. Every rank holds the same
    calls in the same order, so every rank waits for the same ones.
    """
    calls = list(getattr(queue, "async_calls", ()) or ())
    if not calls:
        return []
    wanted = {os.path.abspath(parents)} if isinstance(parents, str | os.PathLike) else \
        {os.path.abspath(p) for p in parents}
    under = [i for i, call in enumerate(calls) if _save_dir_parent(call) in wanted]
    doomed = under[: max(0, len(under) - keep)]
    if not doomed:
        return []
    deferred.start_all()  # a recorded save's call cannot complete before it starts
    PACER.drain()  # nor before its copies are enqueued (the trainer makes no ticks while it waits)
    until = len(calls) - (doomed[-1] + 1)
    dog = getattr(queue, "_cpuckpt_dog", None)
    if dog is None:
        return queue.maybe_finalize_async_calls(blocking=True)
    return dog.finalize(blocking=True, no_dist=False, until=until)


def _save_dir_parent(call: Any) -> str | None:
    for fn in getattr(getattr(call, "async_request", None), "finalize_fns", ()) or ():
        directory = getattr(fn, DIR_MARK, None)
        if directory is not None:
            return os.path.dirname(os.path.abspath(directory))
    return None


class _Watchdog:
    def __init__(self, queue: Any, original: Callable[..., list[int]], timeout_s: float,
                 options: MegatronOptions) -> None:
        self.queue = queue
        self.shape = AsyncQueueShape(queue)
        self.original = original
        self.timeout_s = timeout_s
        self.options = options
        self.no_dist = False  # the finalize in progress: local only (no collectives)

    def finalize(self, blocking: bool, no_dist: bool, until: int = 0) -> list[int]:
        """Megatron's finalize with the dead-worker check; blocking: until at most ``until`` calls are pending."""
        done: list[int] = []
        t0 = time.monotonic()
        while True:
            # the same on every rank (scheduling and finalizing are collective); calls the trainer completes need
            # no worker, and a non-blocking look at only those needs no bound
            if self.queue.async_calls and (blocking or any(_done_probe(c) is None for c in self.queue.async_calls)):
                verdict = self._check(no_dist, time.monotonic() - t0 if blocking else 0.0)
                if verdict is not None:
                    return done + self._fail(verdict, no_dist)
            done += self._finalize_done(no_dist, until=until if blocking else 0)
            if not blocking or len(self.queue.async_calls) <= until:
                return done
            self._pause()

    def _pause(self) -> None:
        """Between two looks of a blocking finalize: until the oldest pending call's save ends on this rank, at most
        :data:`POLL_S` (a fixed sleep made a wait for a commit cost ~POLL_S / 2 more, every urgent look)."""
        calls = self.queue.async_calls
        probe = _done_probe(calls[0]) if calls else None
        wait = getattr(probe, WAIT_MARK, None) if probe is not None else None
        if wait is None:
            time.sleep(POLL_S)
        else:
            wait(POLL_S)

    def look(self, no_dist: bool, urgent: bool, printed: bool = False) -> list[int]:
        """A non-blocking look: finalize what has ended; with ``urgent``, then wait for the commits of the urgent
        saves (:data:`URGENT_MARK`; with ``printed`` also the memory-only ones, :data:`MEMORY_MARK`) at the head of
        the queue and finalize them too."""
        done = self.finalize(False, no_dist)
        until = self.urgent_until(printed) if urgent else None
        if until is None:
            return done
        deferred.start_all()  # a recorded save's call cannot complete before it starts
        PACER.drain()  # nor before its copies are enqueued (the trainer makes no ticks while it waits)
        return done + self.finalize(True, no_dist, until)

    def urgent_until(self, printed: bool = False) -> int | None:
        """How many calls may stay pending once the urgent ones (:data:`URGENT_MARK`; ``printed``: also every
        memory-only save, :data:`MEMORY_MARK`) at the head of the queue are finalized; None: none there. Only the
        leading run of such calls counts: waiting past one of Megatron's own or a persistent save's (a persist,
        seconds) is not what an urgent save asks for. The same on every rank."""
        calls = self.queue.async_calls
        marks = (URGENT_MARK, MEMORY_MARK) if printed else (URGENT_MARK,)
        last = None
        for i, call in enumerate(calls):
            probe = _done_probe(call)
            if probe is None or not any(getattr(probe, mark, False) for mark in marks):
                break
            last = i
        return None if last is None else len(calls) - (last + 1)

    def close(self, original_close: Callable[..., Any], abort: bool, *args: Any, **kwargs: Any) -> Any:
        """``queue.close()``: finalize as it would, then forget a persistent worker that died while idle
        (megatron-core's ``close`` would wait forever for it to acknowledge its stop)."""
        if not abort:
            deferred.start_all()  # a recorded save's call cannot complete before it starts
            PACER.drain()
            self.finalize(blocking=True, no_dist=False)
            reason = self.shape.dead_persistent_worker(idle=True)
            if reason:
                logger.warning("cpuckpt: the persistent checkpoint worker died while idle (%s); closing the "
                               "queue without waiting for it", reason)
                self.shape.abandon([])
        return original_close(abort, *args, **kwargs)

    # -- one check, agreed by every rank ------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        """This rank: why a worker holding one of the pending calls is gone (None: none is). Calls the trainer
        completes need no worker: a dead one only counts while one of Megatron's own calls is pending."""
        pending = [call for call in self.shape.pending() if _done_probe(call) is None]
        for call in pending:
            request = getattr(call, "async_request", None)
            if request is None or getattr(request, "async_fn", None) is not wait_for_commit:
                continue
            reason = Channel(request.async_fn_args[0]).worker_gone(self.options.heartbeat_timeout_s)
            if reason:
                return f"checkpoint worker ({reason}) ended without reporting"
        reason = self.shape.dead_persistent_worker(pending) if pending else None
        return f"persistent checkpoint worker ended ({reason})" if reason else None

    def _check(self, no_dist: bool, waited_s: float) -> tuple[str, str | None] | None:
        mine = self._dead_worker()
        late = waited_s > self.timeout_s
        flags = torch.tensor([1 if mine else 0, 1 if late else 0], dtype=torch.int32)
        group = None if no_dist else peers(checkpoint_group(None, self.timeout_s))
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        if int(flags[0]):
            return "dead", mine
        if int(flags[1]):
            return "late", None
        return None

    # -- what every rank does then ------------------------------------------------------------------
    def _fail(self, verdict: tuple[str, str | None], no_dist: bool) -> list[int]:
        kind, mine = verdict
        rank = dist.get_rank() if dist.is_initialized() else 0
        group = None if no_dist else checkpoint_group(None, self.timeout_s)
        reasons: list[str | None] = [mine]
        if group is not None:
            reasons = [None] * dist.get_world_size(group)
            dist.all_gather_object(reasons, mine, group=group)
        n = len(self.queue.async_calls)
        err = _error(kind, reasons, n, self.timeout_s, local_rank=rank if group is None else None)
        if no_dist:  # a local check: no collectives, nothing replaced
            raise err
        first_error: CpuckptError | None = None
        done: list[int] = []
        try:
            done = self._finalize_done(no_dist, quiet=True)  # calls that completed everywhere before the death
        except CpuckptError as e:  # raised alike on every rank
            first_error = e
        except BaseException:  # megatron-core's own failure, maybe on this rank only: no more collectives
            self._drop(self.shape.pending())
            raise
        calls = self.shape.pending()
        self._drop(calls)
        for call in calls:
            for fn in getattr(getattr(call, "async_request", None), "finalize_fns", ()):
                if getattr(fn, FINALIZE_MARK, False):
                    try:
                        fn(abandoned=True)  # ends cpuckpt's own save (a worker's call: collective, removes the channel)
                    except CpuckptError as e:
                        first_error = first_error or e
        if self.options.on_failure == "raise":
            raise err from first_error
        _log_continue(rank, err, first_error, replaced=True)
        return done

    def _drop(self, calls: list[Any]) -> None:
        """Forget ``calls`` and stop every worker (a live one would wait on a removed channel)."""
        self.queue.async_calls.clear()
        self.shape.abandon(calls)

    def _finalize_done(self, no_dist: bool, quiet: bool = False, until: int = 0) -> list[int]:
        """Finalize the calls that are done, oldest first, until one is not or ``until`` are left: the trainer's
        own (:func:`_done_probe`) here, runs of Megatron's by megatron-core's own non-blocking finalize; with
        ``continue``, an error every rank agrees on is logged."""
        try:
            return self._finalize_in_order(no_dist, until)
        except CpuckptError as e:
            # rank_error's errors (``failures`` set) are raised alike on every rank: safe to go on from.
            if quiet or self.options.on_failure != "continue" or no_dist or not e.failures:
                raise
            _log_continue(dist.get_rank() if dist.is_initialized() else 0, e, None, replaced=False)
            return []

    def _finalize_in_order(self, no_dist: bool, until: int) -> list[int]:
        calls = self.queue.async_calls
        self.no_dist = no_dist  # for the agreement on Megatron's finalize functions (_MegatronFinalize)
        for call in calls:
            _MegatronFinalize.arm(call, self)
        done: list[int] = []
        while len(calls) > until:
            probe = _done_probe(calls[0])
            if probe is None:  # Megatron's own calls, up to the next of the trainer's
                run = next((i for i, call in enumerate(calls) if _done_probe(call) is not None), len(calls))
                finalized = self._original_on(run, no_dist)
                done += finalized
                if len(finalized) < run:
                    return done
                continue
            if not self._agreed(probe(), no_dist):
                return done
            call = calls.popleft()
            for fn in call.async_request.finalize_fns:
                fn()
            done.append(call[0])  # the call's index (megatron-core's and nvidia-resiliency-ext's _ActiveAsyncRequest)
        return done

    def _original_on(self, run: int, no_dist: bool) -> list[int]:
        """megatron-core's non-blocking finalize shown only the first ``run`` calls (the deque is shortened in place
        and restored: the queue keeps its one deque)."""
        calls = self.queue.async_calls
        rest = [calls.pop() for _ in range(len(calls) - run)][::-1]
        try:
            return self.original(blocking=False, no_dist=no_dist)
        finally:
            calls.extend(rest)

    def _agreed(self, mine: bool | int, no_dist: bool) -> bool:
        """Whether the call may be finalized: its probe said ended on every rank, or :data:`PROBE_FAILED` on one (one
        all-reduce on cpuckpt's gloo group; ``no_dist``: this rank's)."""
        group = None if no_dist else peers(checkpoint_group(None, self.timeout_s))
        if group is None:  # no_dist, no process group at all, or this rank alone
            return bool(mine)
        failed = mine == PROBE_FAILED
        flags = torch.tensor([1 if mine else 0, -1 if failed else 0], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)  # [ended everywhere, -(failed anywhere)]
        return bool(int(flags[0])) or bool(int(flags[1]))


class _MegatronFinalize:
    """Megatron's finalize functions of one cpuckpt save, run so that a failure on one rank is every rank's.

    cpuckpt's own finalize function is collective and raises alike on every rank; Megatron's after it
    (megatron-core's ``metadata.json``, Megatron-LM's tracker) write on rank 0 only and may fail there alone
    (ENOSPC, EACCES): rank 0 raised a bare ``OSError`` while the others went on into the next collective. Each of
    Megatron's functions is wrapped (:meth:`arm`, in place, whoever then runs them: the watchdog or megatron-core's
    finalize) to keep its error, and one function appended after them agrees on it (an all-reduce of a flag on
    cpuckpt's gloo group, the reports gathered only after a failure): every rank raises the same error
    (``StorageIOError`` naming the rank and path for an ``OSError``), which ``on_failure: continue`` logs like any
    agreed failure. After a failed function the rest are skipped: no tracker names a checkpoint whose
    ``metadata.json`` could not be written."""

    def __init__(self, dog: _Watchdog, directory: str | None) -> None:
        self.dog = dog
        self.directory = directory
        self.error: Exception | None = None

    @classmethod
    def arm(cls, call: Any, dog: _Watchdog) -> None:
        """Wrap the Megatron finalize functions of ``call`` (a cpuckpt save's, not yet armed) in place."""
        fns = getattr(getattr(call, "async_request", None), "finalize_fns", None)
        if not isinstance(fns, list) or any(isinstance(fn, cls) for fn in fns):
            return
        ours = [fn for fn in fns if getattr(fn, FINALIZE_MARK, False)]
        if not ours:  # not a cpuckpt save: left as Megatron made it
            return
        agreement = cls(dog, getattr(ours[0], DIR_MARK, None))
        fns[:] = [fn if getattr(fn, FINALIZE_MARK, False) else agreement.guarded(fn) for fn in fns] + [agreement]

    def guarded(self, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            if self.error is not None:
                return
            try:
                fn()
            except Exception as e:
                self.error = e
                if isinstance(e, OSError) and _ends_in_barrier(fn) and not self.dog.no_dist and dist.is_initialized():
                    dist.barrier()  # the one this rank skipped, where the other ranks wait

        run.__wrapped__ = fn  # type: ignore[attr-defined]
        return run

    def __call__(self) -> None:
        error, self.error = self.error, None
        group = None if self.dog.no_dist else checkpoint_group(None, self.dog.timeout_s)
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = self.directory or "its checkpoint directory"
        agree_or_raise(error, rank, group, f"Megatron's finalize of the save into {where}")


def _ends_in_barrier(fn: Callable[..., Any]) -> bool:
    """megatron-core's ``metadata_finalize_fn`` (``dist_checkpointing.save``): ``save_config`` on rank 0, then a
    barrier of the default group; a rank whose ``save_config`` raised skipped that barrier."""
    return (getattr(fn, "__qualname__", "") == "save.<locals>.metadata_finalize_fn"
            and getattr(fn, "__module__", "").startswith("megatron.core."))


def _error(kind: str, reasons: list[str | None], n: int, timeout_s: float, local_rank: int | None) -> CpuckptError:
    if kind == "late":
        return CheckpointTimeoutError(f"async saves not finalized after {timeout_s:.0f} s ({n} pending); "
                                      "their checkpoints are incomplete")
    dead = {r if local_rank is None else local_rank: why for r, why in enumerate(reasons) if why}
    first = min(dead)
    message = f"rank {first}'s {dead[first]} with {n} async save(s) pending"
    others = "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()) if r != first)
    if others:
        message += f" (also {others})"
    err = WorkerDiedError(message + "; those checkpoints are incomplete (no metadata.json)")
    err.rank = first
    err.failures = dict(dead)
    return err


def _log_continue(rank: int, err: BaseException, cause: BaseException | None, *, replaced: bool) -> None:
    also = f" (and: {cause})" if cause is not None and str(cause) not in str(err) else ""
    logger.error("cpuckpt: rank %d: async save failed: %s%s; training continues (megatron on_failure: continue): "
                 "that checkpoint has no metadata.json, the last complete one stays the restart point%s",
                 rank, err, also, "; the next save spawns a new checkpoint worker" if replaced else "")
