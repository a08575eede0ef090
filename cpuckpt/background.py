"""Background saves: ``async_save``, its handle, the in-flight bound and the commit protocol.

``async_save`` runs DCP's planning on the caller's thread (on a gloo group), so every file's layout
is known; the writer then starts staging chunks into the host pool and writing them while the call
returns. A save is committed by its stream's background thread (the committer of a
:class:`Checkpointer`), which runs the saves' commit collectives in order on a second, dedicated gloo
group: no two threads ever share a group. Each rank reports whether its files are durable; only
when all are does the coordinator write the manifest and ``.metadata``, and the outcome is broadcast
so that every rank's ``wait()`` raises the same error. Every wait is bounded by ``timeout_s`` (gloo
groups get the same timeout).

A :class:`Checkpointer` is one stream of saves: it owns the in-flight bound, the plan, item and layout
caches, the device snapshot buffers and the committer. Two models saving to two roots use two
checkpointers and share none of it; :func:`async_save` is the stream of the function API, one per
process group.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from cpuckpt.backend import inflight
from cpuckpt.backend.collectives import (
    agree_or_raise,
    checkpoint_group,
    dcp_save,
    gather_failures,
    new_gloo_group,
    one_contract,
    peers,
    raise_if_failed,
    resolve_stateful,
    run_dcp,
)
from cpuckpt.backend.itemcache import CachedItems, FlatState
from cpuckpt.backend.telemetry import record_save
from cpuckpt.backend.writer import StorageWriter
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import ConfigError, CpuckptError, FailureReport, is_interrupt, rank_error
from cpuckpt.format.layout import LayoutCache
from cpuckpt.format.plancache import CachedPlan, structure_signature
from cpuckpt.paths import checkpoint_path
from cpuckpt.roots import after_commit
from cpuckpt.transfer.device_snapshot import DeviceSnapshots
from cpuckpt.transfer.sinks import SinkFactory
from cpuckpt.transfer.threads import new_executor, stop_after_interrupt, wait_future

__all__ = ["ORDERINGS", "AsyncSaveHandle", "Checkpointer", "CommitHook", "async_save", "cancel_all", "wait_all"]

ORDERINGS = ("host", "stream")  # async_save(ordering=...): see its docstring

logger = logging.getLogger(__name__)


class CommitHook(Protocol):
    """The seam a save's commit goes through when the coordinator alone cannot commit it (the memory tier
    across nodes: each node's leader commits its own slot). Called on every rank's committer thread once
    every rank's files are in and no rank failed; runs its own collectives on ``commit_group`` and returns
    the outcome every rank agrees on: None when committed, else the reports that fail the save. Raises
    only when a collective fails. ``gathered_results`` (every rank's write results of a reused plan) is given
    on the coordinator only (None elsewhere, and on the coordinator when the plan was not reused or a rank's
    results are unknown to it)."""

    def __call__(self, writer: StorageWriter, gathered_results: list[Any] | None, commit_group: Any,
                 coordinator: int) -> list[FailureReport | None] | None: ...


@dataclass
class SaveStats:
    """What one background save cost this rank."""

    call_s: float = 0.0  # wall time of the async_save call itself (planning + enqueue)
    staged_s: float = 0.0  # from the call to "all bytes in host memory"
    durable_s: float = 0.0  # from the call to "this rank's files fsynced"
    committed_s: float = 0.0  # from the call to "committed on every rank"
    nbytes: int = 0
    mode: str = ""
    planned: str = "dcp"  # "reused" when the previous save's plan was reused
    resolved: str = "planner"  # "cached" when the previous save's resolved items were reused (backend.itemcache)
    layout: str = "planned"  # "cached" when the file layout came from the stream's earlier saves (no plan_files)


class _Staged:
    def __init__(self, handle: AsyncSaveHandle) -> None:
        self._h = handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until every tensor of this rank is in host memory; then tensors may change."""
        job = self._h._writer.job
        if job is None:
            return
        try:
            job.wait_staged(timeout)
        except BaseException as e:
            if is_interrupt(e):  # Ctrl-C: the save stops (its threads end); the interrupt propagates as itself
                stop_after_interrupt(self._h._writer.cancel, e, f"the save to {self._h.path}")
            raise
        if not self._h.stats.staged_s:  # when staging finished, not when the caller came to wait
            self._h.stats.staged_s = job.started_at + job.stats.stage_s - self._h._t0

    def done(self) -> bool:
        job = self._h._writer.job
        return job is None or job.staged.done()


class AsyncSaveHandle:
    """Returned by :func:`async_save`. ``staged.wait()`` then train on; ``wait()`` before relying on it."""

    def __init__(self, writer: StorageWriter, path: str, t0: float) -> None:
        self._writer = writer
        self.path = path
        self._t0 = t0
        self.staged = _Staged(self)
        self._committed: cf.Future[None] = cf.Future()
        self._reported = False
        self.stats = SaveStats()
        self.commit_hook: CommitHook | None = None  # see async_save

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is durable and committed on every rank.

        Raises:
            CpuckptError: this or another rank failed: the same class and message on every rank,
                built by :func:`cpuckpt.errors.rank_error` (``StorageIOError``, an ``OSError`` with
                ``errno``/``path``, when the lowest failing rank's error was one; ``rank``, ``failures``).
            CheckpointTimeoutError: not committed within ``timeout`` (default: ``timeout_s``).
            KeyboardInterrupt: Ctrl-C while waiting, as itself; the save is cancelled (never committed).
        """
        try:
            wait_future(self._committed, self._writer.config.timeout_s if timeout is None else timeout,
                        f"committing checkpoint {self.path}", on_interrupt=self.cancel)
        except BaseException:
            self._reported = self._committed.done()  # the caller has seen this failure
            raise

    def done(self) -> bool:
        return self._committed.done()

    def ended_within(self, timeout: float) -> bool:
        """Whether the save ends (committed or failed) within ``timeout`` seconds; waits at most that long and raises
        nothing: a poll that returns as soon as the save ends, not at the end of a fixed sleep."""
        return bool(cf.wait([self._committed], timeout).done)

    def wait_ended(self, timeout: float | None = None) -> None:
        """Block until the save has ended, committed or failed, without raising its failure (:meth:`wait` and the
        in-flight bound of a later save report that, alike on every rank).

        Raises:
            CheckpointTimeoutError: still running after ``timeout`` (default: ``timeout_s``).
            KeyboardInterrupt: Ctrl-C while waiting, as itself; the save is cancelled.
        """
        fut = self._committed
        if fut.done():
            return
        try:
            wait_future(fut, self._writer.config.timeout_s if timeout is None else timeout,
                        f"ending the save to {self.path}", on_interrupt=self.cancel)
        except Exception:
            if not fut.done():
                raise

    def cancel(self, reason: BaseException | None = None) -> None:
        """Stop this save (Ctrl-C, exit): writes not yet done are skipped and it is never committed;
        ``wait()`` then raises the failure (on every rank, once the committer agreed with the peers)."""
        self._writer.cancel(reason if reason is not None else KeyboardInterrupt())

    def wait_stream(self, stream: Any = None) -> None:
        """Order GPU work after this rank's device-to-host copies, without blocking the host.

        ``stream`` (a ``torch.cuda.Stream``; default: the current stream of the device the save copies
        from) waits on a CUDA event recorded after the save's last copy, so kernels enqueued on it
        afterwards may write any saved tensor. Call it before the first kernel that writes a saved
        tensor, on every stream that writes one. Without GPU sources it does nothing (CPU tensors
        are copied by ``staged``, or before ``async_save(ordering="stream")`` returns). Errors of the
        copies are reported by ``staged.wait()`` and ``wait()``, never here.
        """
        job = self._writer.job
        fence = getattr(job, "fence", None)
        if fence is not None:
            fence.order(stream)

    @property
    def copies_on_device(self) -> bool:
        """Whether this save copies from a GPU (then ``wait_stream`` orders work after those copies)."""
        return getattr(self._writer.job, "fence", None) is not None

    @property
    def save_id(self) -> str:
        """The save's id (recorded by the committed checkpoint when ``async_save`` got one for every rank)."""
        return self._writer.save_id

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(None)`` once committed on every rank, or ``fn(error)`` once failed.

        It runs on the committer thread (or at once if the save has already ended), so it must be quick.
        """
        self._committed.add_done_callback(lambda f: fn(f.exception()))


class _ResultsRelay:
    """Each rank's write results of reused plans, sent to the coordinator once per layout (the committer's own).

    A reused layout reports the very list it reported before (``SaveLayout.results``, frozen): a rank whose
    results are the list it last sent sends :data:`UNCHANGED` instead, and the coordinator uses the copy it kept.
    Sent whole, ~1,000 items cost the committer ~9 ms of the trainer's interpreter per save on the H200 (pickled,
    and unpickled on every rank: an all-gather), a memory save every iteration included. After a save that did
    not commit a rank sends its results whole again (:meth:`forget`); the coordinator keeps what it received, so
    a rank that saw a commit its coordinator did not (a collective that failed on one side) still resolves. A
    marker the coordinator cannot resolve fails that save on every rank (the commit finds no results), never
    commits stale ones.
    """

    UNCHANGED = "cpuckpt: unchanged write results"

    def __init__(self) -> None:
        self.sent: list | None = None
        self.kept: dict[int, list] = {}

    def outgoing(self, results: list | None) -> list | str | None:
        return self.UNCHANGED if results is not None and results is self.sent else results

    def incoming(self, gathered: list[Any], results: list | None, coordinator: bool) -> list[Any] | None:
        """Every rank's results (the coordinator, for a reused plan; None if one is unknown), after the gather of
        ``results``."""
        self.sent = results
        if not coordinator or results is None:
            return None  # only the coordinator commits from them; none travel when the plan was not reused
        for rank, got in enumerate(gathered):  # every whole list kept first, resolved or not
            if got != self.UNCHANGED:
                self.kept[rank] = got
        out = [self.kept.get(rank) for rank in range(len(gathered))]
        return None if any(got is None for got in out) else out

    def forget(self) -> None:
        """After a save that failed: this rank's next results travel whole."""
        self.sent = None

    def clear(self) -> None:
        self.sent = None
        self.kept.clear()


class _Groups:
    """A checkpointer's collectives: its gloo groups and its committer thread (made at its first save)."""

    def __init__(self, process_group: Any, timeout_s: float) -> None:
        self.dist = dist.is_available() and dist.is_initialized()
        self.plan_group = None
        self.commit_group = None
        self.coordinator = 0
        if self.dist:
            self.plan_group = checkpoint_group(process_group, timeout_s)  # the caller's thread only
            self.commit_group = new_gloo_group(process_group, timeout_s)  # the committer only
            self.coordinator = dist.get_global_rank(self.commit_group, 0)
        # whether agreements travel (both groups hold the same ranks): a rank alone agrees with itself
        self.shared = peers(self.commit_group) is not None
        self.committer = new_executor(1, "cpuckpt-commit")  # one thread: commit collectives stay ordered
        self.results = _ResultsRelay()  # the committer's


class Checkpointer:
    """One stream of background saves, and everything that belongs to it.

    It owns the in-flight saves and their bound (``async.max_in_flight``), the caches that let a save
    of an unchanged structure skip planning (the plan, the resolved items, the file layouts), the
    device buffers of ``staging.device_snapshot``, and the committer thread with its gloo group. Two
    checkpointers (two models saving to two roots) share none of these: one's saves never wait for,
    evict or reorder the other's, and :meth:`close` of one leaves the other running. What they do
    share is per process: the pinned host pool (sized by the save that asks for it: two streams saving at
    once share its slots, so one's pool save may wait for the other's writes; a ``staging.pool_bytes``
    that holds both avoids it), the stage/io threads, the pacer of device-to-host copies, and the gloo
    mirror of the trainer's group that planning uses on the caller's thread.

    :func:`cpuckpt.async_save` saves through one checkpointer per process group (made on first use).

    Every rank makes its checkpointers in the same order and calls their saves in the same order (the
    first save of each makes its gloo group: collective). Saves of checkpointers over one process group
    are called from one thread (the trainer's), like every planning collective.

    Args:
        process_group: the trainer's group; cpuckpt uses gloo groups over the same ranks.

    Example:
        >>> policy, value = cpuckpt.Checkpointer(), cpuckpt.Checkpointer()
        >>> h1 = policy.async_save(policy_model.state_dict(), f"/ckpt/policy/{step}")
        >>> h2 = value.async_save(value_model.state_dict(), f"/ckpt/value/{step}")
        >>> ...
        >>> policy.close(); value.close()  # waits for each one's saves
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._in_flight: collections.deque[AsyncSaveHandle] = collections.deque()
        self._plan_cache: CachedPlan | None = None
        self._items: CachedItems | None = None  # the last save's resolved items (the cached plan's save)
        self._unfit: tuple | None = None  # a plan signature whose saves do not qualify for ``items``
        self._layouts = LayoutCache()  # file layouts of this stream's recent saves
        self.snapshots = DeviceSnapshots()  # staging.device_snapshot: this stream's device buffers
        self._groups: _Groups | None = None
        self._closed = False

    @property
    def _dist(self) -> bool:
        return self._require_groups().dist

    def _require_groups(self) -> _Groups:
        if self._groups is None:
            raise RuntimeError("Checkpointer: no save started yet")
        return self._groups

    def _start_stream(self, timeout_s: float) -> _Groups:
        """Caller's thread, at a save: the groups and committer, made at the first one (collective)."""
        if self._closed:
            raise CpuckptError("Checkpointer: async_save after close()")
        if self._groups is None:
            self._groups = _Groups(self.process_group, timeout_s)
            _hook_exit()
        inflight.register(self)
        return self._groups

    def async_save(self, state_dict: dict[str, Any], path: str | os.PathLike,
                   config: Config | str | os.PathLike | dict | None = None, *, step: int | None = None,
                   planner: Any = None, plan_key: Hashable | None = None, sink: SinkFactory | None = None,
                   save_id: str | None = None,
                   commit_hook: CommitHook | None = None,
                   ordering: str = "host") -> AsyncSaveHandle:
        """Save in the background through this stream: :func:`cpuckpt.async_save`'s arguments (less
        ``process_group``: the checkpointer's), contract, errors and plan reuse (from this stream's
        previous saves only)."""
        path = checkpoint_path(path, "async_save: checkpoint path")  # another URL: refused before anything
        if ordering not in ORDERINGS:
            raise ConfigError(f"async_save: ordering must be one of {', '.join(ORDERINGS)}, got {ordering!r}")
        group = self.process_group
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        with one_contract(f"async save of {path}", rank):
            return _async_save(self, state_dict, path, resolve_config(config), step=step, planner=planner,
                               plan_key=plan_key, sink=sink, save_id=save_id, commit_hook=commit_hook,
                               ordering=ordering)

    def pending(self) -> list[AsyncSaveHandle]:
        """This stream's saves that have not ended (committed or failed), oldest first."""
        return [h for h in list(self._in_flight) if not h.done()]

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every save of this stream; raises the first failure not yet raised.

        Ctrl-C while waiting cancels this stream's saves still in flight and propagates as itself.
        """
        first: BaseException | None = None
        while self._in_flight:
            try:
                self._in_flight.popleft().wait(timeout)
            except BaseException as e:
                if is_interrupt(e):
                    self.cancel_all(e)
                    raise
                first = first or e
        if first is not None:
            raise first

    def cancel_all(self, reason: BaseException | None = None) -> None:
        """Cancel this stream's saves in flight (Ctrl-C): none is committed, their threads end."""
        for handle in list(self._in_flight):
            stop_after_interrupt(handle.cancel, reason or KeyboardInterrupt(), f"the save to {handle.path}")

    def close(self, timeout: float | None = None) -> None:
        """Wait for this stream's saves (raising the first failure), then end its committer thread and
        free its caches and device buffers. Other checkpointers are not affected; a closed one saves no
        more. Idempotent."""
        try:
            self.wait_all(timeout)
        finally:
            self._closed = True
            inflight.unregister(self)
            if self._groups is not None:  # no task is left (a cancelled one ends on its own)
                self._groups.committer.shutdown(wait=False)
                self._groups.results.clear()
            self._plan_cache = self._items = self._unfit = None
            self._layouts = LayoutCache()
            self.snapshots.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _agree_to_reuse(self, cached: CachedPlan | None, writer: StorageWriter) -> bool:
        """Caller's thread: reuse the cached plan only if every rank has one for this structure.

        The coordinator first makes any earlier checkpoint in the directory incomplete, so no rank
        writes next to a stale ``.metadata`` (DCP's path does the same in prepare_global_plan).
        """
        if cached is not None:
            coordinator = cached.is_coordinator
        else:
            coordinator = not self._dist or dist.get_rank(self._require_groups().plan_group) == 0
        error: BaseException | None = None
        try:
            writer.prepare_target()
            if coordinator:
                writer.target.clear()
        except BaseException as e:  # shared with the peers below, so that no rank waits for this one
            error = e
        what = f"async save of {writer.path}"
        if not self._require_groups().shared:
            agree_or_raise(error, 0, None, what)
            return cached is not None
        # One all-reduce answers both: does every rank have the plan, and is every rank's directory usable?
        flags = torch.tensor([1 if cached is not None else 0, 1 if error is None else 0])
        plan_group = self._require_groups().plan_group
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=plan_group)
        if not flags[1].item():
            reports = gather_failures(error, dist.get_rank(plan_group), plan_group)
            if is_interrupt(error):
                raise error  # type: ignore[misc]
            raise_if_failed(reports, what, error)  # the same error on every rank
        return bool(flags[0].item())

    def _commit(self, handle: AsyncSaveHandle) -> None:
        """Committer thread: local durability -> agree -> coordinator commits -> share the outcome.

        Every rank's :class:`~cpuckpt.errors.FailureReport` (``None`` = its files are durable) travels
        in one all-gather, with the write results of a reused plan; the coordinator commits only if
        no rank failed, and broadcasts the reports that decide the outcome (its own commit failure
        included). Every rank then sets the same :func:`~cpuckpt.errors.rank_error` on the handle,
        chained to this rank's own original error, if it has one.
        """
        w = handle._writer
        local: BaseException | None = None  # this rank's own original error
        try:
            if w.job is None:
                raise RuntimeError("the writer never started a save job (DCP did not call write_data)")
            entries = w.job.wait_done()
            handle.stats.durable_s = time.perf_counter() - handle._t0
            w.write_part(entries)
        except BaseException as e:
            local = e
        mine = None if local is None else FailureReport.of(local, w.rank)
        outcome: list[FailureReport | None] | None = None  # the reports that fail the save; None: committed
        groups = self._require_groups()
        shared = groups.shared
        try:
            # results travel only when the plan was reused, and only once per layout (_ResultsRelay)
            sent = (mine, groups.results.outgoing(w.last_results))
            gathered: list[Any] = [sent]
            if shared:
                gathered = [None] * dist.get_world_size(groups.commit_group)
                dist.all_gather_object(gathered, sent, group=groups.commit_group)
            reports = [g[0] for g in gathered]
            results = groups.results.incoming([g[1] for g in gathered], w.last_results, w.is_coordinator)
            agreed = False  # the outcome is already every rank's (the commit hook agrees on it itself)
            if any(r is not None for r in reports):
                outcome = reports
            elif handle.commit_hook is not None and self._dist:
                outcome = handle.commit_hook(w, results, groups.commit_group, groups.coordinator)
                agreed = True
            elif w.is_coordinator:
                try:
                    w.commit_deferred(results)
                except BaseException as e:
                    local = e
                    failed = FailureReport.of(e, w.rank)
                    outcome = [dataclasses.replace(failed, message=f"commit failed (coordinator): {failed.message}")]
                else:
                    after_commit(w.path, w.config)  # `latest`, cleaning, retention: only when configured
            if shared and not agreed:
                box = [outcome]
                dist.broadcast_object_list(box, src=groups.coordinator, group=groups.commit_group)
                outcome = box[0]
        except BaseException as e:
            if outcome is None:  # the peers' outcome is unknown: this rank's own failure, else the collective's
                if mine is None:
                    local = e
                    failed = FailureReport.of(e, w.rank)
                    mine = dataclasses.replace(failed, message=f"commit collective failed: {failed.message}")
                outcome = [mine]
        error = rank_error(outcome or [], f"async save of {handle.path}")
        if error is not None:
            groups.results.forget()  # on every rank: the outcome is agreed
            if local is not None:  # as `raise error from local`
                error.__cause__, error.__suppress_context__ = local, True
            handle._committed.set_exception(error)
        else:
            handle.stats.committed_s = time.perf_counter() - handle._t0
            record_save(w.config, path=handle.path, rank=w.rank, step=w.step, event="async_save",
                        stall_s=handle.stats.staged_s or handle.stats.call_s, persist_s=handle.stats.durable_s,
                        committed_s=handle.stats.committed_s, nbytes=handle.stats.nbytes, mode=handle.stats.mode,
                        files=len(w.job.names) if w.job is not None else 0, call_s=handle.stats.call_s)
            handle._committed.set_result(None)


# The function API's streams: ``cpuckpt.async_save`` has no object to hold its caches and in-flight saves,
# so each process group gets one checkpointer, made on first use. Any other stream is a Checkpointer of
# its own; this must never be the only way to save (two models through it would share one stream).
_DEFAULTS: dict[Any, Checkpointer] = {}
_LOCK = threading.Lock()
_EXIT_HOOKED = False  # per process: the interpreter's exit hook is registered once


def _default_checkpointer(process_group: Any) -> Checkpointer:
    """``async_save``'s checkpointer of ``process_group`` (a new one after it was closed)."""
    with _LOCK:
        ckpt = _DEFAULTS.get(process_group)
        if ckpt is None or ckpt._closed:
            ckpt = _DEFAULTS[process_group] = Checkpointer(process_group)
        return ckpt


def _hook_exit() -> None:
    """Once per process: cancel interrupted saves at exit (:func:`_cancel_after_interrupt`)."""
    global _EXIT_HOOKED
    with _LOCK:
        if _EXIT_HOOKED:
            return
        # Registered after concurrent.futures' own hook (its executors exist now), so it runs first:
        # threading runs these hooks in reverse order, before the interpreter joins the pools' threads.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            with contextlib.suppress(RuntimeError):  # already shutting down
                register(_cancel_after_interrupt)
        _EXIT_HOOKED = True


def _cancel_after_interrupt() -> None:
    """At interpreter exit after an uncaught ``KeyboardInterrupt``: cancel the saves still in flight.

    Otherwise the exit joins their writer and committer threads, i.e. waits for whole saves that the
    user interrupted. An ordinary exit (or ``sys.exit``) still lets them finish.
    """
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(last, KeyboardInterrupt):
        return
    if inflight.pending():
        logger.warning("cpuckpt: interrupted: cancelling the background saves still in flight")
        cancel_all(last)


def async_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    step: int | None = None,
    process_group: Any = None,
    planner: Any = None,
    plan_key: Hashable | None = None,
    sink: SinkFactory | None = None,
    save_id: str | None = None,
    commit_hook: CommitHook | None = None,
    ordering: str = "host",
) -> AsyncSaveHandle:
    """Save in the background: returns once the layout is planned and staging has begun.

    The layout of every file is planned first, then chunks are copied into the host pool
    (device-to-host on a side stream for GPU tensors) and written as each becomes ready, so copies
    overlap writes. Call ``handle.staged.wait()`` before changing any saved tensor, and
    ``handle.wait()`` before relying on the checkpoint. At most ``async.max_in_flight`` saves are
    in flight; a further call first waits for the oldest (and raises its error, if it failed).

    Args:
        state_dict: as for ``dcp.save``.
        path: checkpoint directory.
        config: a :class:`Config`, a YAML path, a dict, or None.
        step: training step, recorded in the manifest.
        process_group: the trainer's group; cpuckpt uses gloo groups over the same ranks.
        planner: a DCP ``SavePlanner`` (default: DCP's ``DefaultSavePlanner``).
        plan_key: lets a save with ``planner`` reuse the previous save's plan. By passing it the
            caller declares that ``planner`` plans deterministically from the state dict's structure,
            and that equal keys (with the same planner class) mean the same planner settings; a
            reused plan only calls the planner's ``set_up_planner`` and ``resolve_data``. Without a
            ``planner`` the plan is always reusable; with one and no ``plan_key``, DCP plans every save.
        sink: where each rank's staged chunks go (``StorageWriter(sink=...)``; default: files through
            the pinned pool). :class:`cpuckpt.tier.MemoryTier` passes its image files for ``path``:
            staging copies straight into them and nothing is written.
        save_id: the id the committed checkpoint records (the same on every rank; default: a new one).
        commit_hook: a :class:`CommitHook` that replaces the coordinator's commit and the outcome's
            broadcast once every rank's files are in (the memory tier across nodes:
            ``cpuckpt.tier.nodes.node_commit``).
        ordering: what the caller must do before changing a saved tensor (the contract below).

    **Ordering contract.** ``"host"`` (the default): the call returns once planning is done and
    staging has begun; no saved tensor (CPU or GPU) may change before ``handle.staged.wait()``
    returned. ``"stream"`` (zero-stall, like DCP's ``DefaultStager`` with async staging, but ordered by
    the trainer rather than by a host wait): the call returns once every CPU tensor's bytes and every
    non-tensor value are in host memory (CPU tensors and objects may change at once) and every
    device-to-host copy is *enqueued* on a side stream that waits for the caller's current stream.
    GPU tensors may then be read freely, and written only by work ordered after
    ``handle.wait_stream(stream)`` on each stream that writes them (a host-side ``staged.wait()``
    also orders everything). Kernels that merely read saved tensors (a forward) overlap the copies.
    The caching allocator cannot reuse a source's memory before the copies ran (``record_stream``),
    and host-pool slots or image bytes are reused only once their copies completed (``staged`` and
    ``wait`` keep their meaning). Saves that *stream* (a ``staging.pool_bytes`` smaller
    than the shard) still block inside the call until the last chunk has a slot; the contract holds
    for them too. The ``dcp.async_save`` door cannot express a GPU-side wait: DCP completes its
    staging future only after a host wait, which is its (correct) contract.

    A plan is reused when every rank finds its (planner class, ``plan_key``, structure signature)
    unchanged since its previous ``async_save`` on this process group (``format.plancache``: paths,
    shapes, dtypes, shards' offsets and sizes, ...; never values), else DCP plans it.
    ``handle.stats.planned`` says which: ``"reused"`` or ``"dcp"``. A reused plan whose tensors are
    the previous save's (same storages, offsets, shapes, strides, dtypes; ``backend.itemcache``) also
    skips the planner: one check per leaf, then the cached layout and batched fills
    (``handle.stats.resolved == "cached"``); with DCP's default planner only.

    Raises:
        CpuckptError: planning failed, or an earlier save that had to be waited for failed; a directory
            that cannot be created is ``StorageIOError`` (errno, path), the same on every rank.
        ConfigError: ``path`` is a URL (nothing is created).
        KeyboardInterrupt: Ctrl-C, as itself; the save is cancelled (here, in ``staged.wait()``,
            ``wait()`` or ``wait_all()``), never committed, and its threads end.

    Example:
        >>> h = cpuckpt.async_save({"model": model.state_dict()}, f"/ckpt/{step}", step=step)
        >>> h.staged.wait()          # trainer may now update parameters
        >>> ...
        >>> h.wait()                 # durable and committed on every rank
    """
    return _default_checkpointer(process_group).async_save(
        state_dict, path, config, step=step, planner=planner, plan_key=plan_key, sink=sink, save_id=save_id,
        commit_hook=commit_hook, ordering=ordering)


def _async_save(ckpt: Checkpointer, state_dict: dict[str, Any], path: str, cfg: Config, *, step: int | None,
                planner: Any, plan_key: Hashable | None, sink: SinkFactory | None, save_id: str | None,
                commit_hook: CommitHook | None, ordering: str
                ) -> AsyncSaveHandle:
    """:meth:`Checkpointer.async_save` inside the error contract (its arguments checked)."""
    groups = ckpt._start_stream(cfg.timeout_s)
    while ckpt._in_flight and ckpt._in_flight[0]._reported:
        ckpt._in_flight.popleft()  # failed, and the caller already got the error from wait()
    while len(ckpt._in_flight) >= cfg.async_.max_in_flight:
        ckpt._in_flight.popleft().wait()  # raises a failure nobody has waited for yet
    while ckpt._in_flight and ckpt._in_flight[0].done() and ckpt._in_flight[0]._committed.exception() is None:
        ckpt._in_flight.popleft()
    t0 = time.perf_counter()
    writer = StorageWriter(path, cfg, step=step, sink=sink, save_id=save_id, layouts=ckpt._layouts,
                           snapshots=ckpt.snapshots)
    writer.defer_commit(in_flight=cfg.async_.max_in_flight)
    handle = AsyncSaveHandle(writer, str(path), t0)
    handle.commit_hook = commit_hook
    try:
        with gc_paused():
            state = state_dict if isinstance(state_dict, FlatState) else resolve_stateful(state_dict)
            _plan(ckpt, writer, handle, state, planner, plan_key)
    except BaseException as e:
        writer.cancel(e)  # no thread stages or writes on for a save that failed or was interrupted
        raise
    handle.stats.call_s = time.perf_counter() - t0
    if writer.job is not None:
        handle.stats.nbytes = writer.job.stats.nbytes
        handle.stats.mode = writer.job.mode
    handle.stats.layout = writer.last_layout or handle.stats.layout
    ckpt._in_flight.append(handle)
    groups.committer.submit(ckpt._commit, handle)
    if ordering == "stream" and writer.job is not None and writer.job.fence is None:
        # No device copies: host threads copy the CPU tensors, and the contract lets them change once
        # the call returned. (With device copies every host byte was copied on this thread while the
        # copies were enqueued.) A failure is raised here and, agreed by every rank, by wait().
        handle.staged.wait()
    return handle


def _plan(ckpt: Checkpointer, writer: StorageWriter, handle: AsyncSaveHandle, state: dict[str, Any] | FlatState,
          planner: Any, plan_key: Hashable | None) -> None:
    """Caller's thread: start the save from the cached items, the cached plan, or DCP's planning.

    Every rank must agree before DCP planning is skipped (one all-reduce). The cheapest cache that
    still fits is used: the resolved items (one check per leaf), else the plan (set-up and
    ``resolve_data`` per item); a save through either of the slower paths refreshes the caches. A
    :class:`FlatState` is built into its state dict only when the resolved items do not fit.
    """
    who = _planner_identity(planner, plan_key)
    hit = ckpt._items.match(state, who) if who is not None and ckpt._items is not None else None
    flat = state if isinstance(state, FlatState) else None
    if flat is not None and hit is None:
        state = resolve_stateful(flat.build())
    signature = None
    if hit is not None:
        cached: CachedPlan | None = ckpt._items.cached  # type: ignore[union-attr]
    else:
        signature = _plan_signature(state, who)
        cached = ckpt._plan_cache if signature is not None and ckpt._plan_cache is not None \
            and ckpt._plan_cache.signature == signature else None
    own = DefaultSavePlanner() if planner is None else planner
    if ckpt._agree_to_reuse(cached, writer):
        handle.stats.planned = "reused"
        if hit is not None:
            handle.stats.resolved = "cached"
            writer.write_items(ckpt._items, hit)  # type: ignore[arg-type]
            return
        writer.write_cached(state, cached, own)  # type: ignore[arg-type]
    else:
        if state is flat:  # the items fit here but not on every rank: DCP plans from the state dict
            state = resolve_stateful(flat.build())
        plan_group = ckpt._require_groups().plan_group
        run_dcp(lambda: dcp_save(state, writer, planner=own, process_group=plan_group), "async save",
                writer.path, rank=dist.get_rank(plan_group) if ckpt._dist else 0)
        if signature is None and hit is not None:  # this rank's items fit, another rank's did not
            signature = _plan_signature(state, who)
        if signature is None or writer.last_plan is None:  # nothing cached fits the global plan just made
            ckpt._items = ckpt._plan_cache = None
            return
        md = writer.pending_metadata if writer.is_coordinator else None
        ckpt._plan_cache = CachedPlan(signature, writer.last_plan, md, writer.is_coordinator, writer.rank)
    ckpt._items = None
    if writer.last_written is not None and ckpt._plan_cache is not None and ckpt._unfit != ckpt._plan_cache.signature:
        ckpt._items = CachedItems.build(who, ckpt._plan_cache, flat or state, own, writer.last_written)
        if ckpt._items is None:
            ckpt._unfit = ckpt._plan_cache.signature  # the same structure will not fit either: do not try again


def _planner_identity(planner: Any, plan_key: Hashable | None) -> tuple | None:
    """The planner's identity and settings; None when its plans may not be reused."""
    if planner is None:
        return ("DefaultSavePlanner",)
    if plan_key is None:
        return None  # an undeclared planner may plan from anything: DCP plans every save
    return (type(planner).__module__, type(planner).__qualname__, plan_key)


def _plan_signature(state: dict[str, Any], who: tuple | None) -> tuple | None:
    """The plan cache's key: the planner's identity and settings, and the state dict's structure."""
    if who is None:
        return None
    structure = structure_signature(state)
    return None if structure is None else (who, structure)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cyclic GC out of the stall window (saves) and out of a load.

    Planning allocates thousands of small objects; a full collection they trigger costs ~0.1-0.3 s
    with torch loaded (measured), several times the copy time. The collection still happens, later,
    when the trainer allocates.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def wait_all(timeout: float | None = None) -> None:
    """Wait for every in-flight save of this process, every checkpointer's (e.g. before exit); raises the
    first failure.

    Ctrl-C while waiting cancels every save still in flight and propagates as itself.
    """
    first: BaseException | None = None
    for stream in inflight.streams():
        try:
            stream.wait_all(timeout)
        except BaseException as e:
            if is_interrupt(e):
                cancel_all(e)
                raise
            first = first or e
    if first is not None:
        raise first


def cancel_all(reason: BaseException | None = None) -> None:
    """Cancel every in-flight save of this process (Ctrl-C): none is committed, their threads end."""
    for stream in inflight.streams():
        stream.cancel_all(reason)
