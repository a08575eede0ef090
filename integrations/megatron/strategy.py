"""megatron-core ``dist_checkpointing`` strategies that save and load through cpuckpt.

They subclass megatron-core's torch_dist strategies (megatron-core 0.19's ``save()`` replaces any
strategy that is not one), reuse its translation of Megatron ``ShardedTensor``s into PyTorch
``ShardedTensor``s (``mcore_to_pyt_state_dict``) and its DCP planners, and swap only the storage
layer: :func:`cpuckpt.save` / :func:`cpuckpt.async_save` / :class:`cpuckpt.StorageReader`. The
files are ordinary torch_dist (DCP) files and ``metadata.json`` names backend ``torch_dist``, so
stock megatron-core loads them without cpuckpt.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)

import cpuckpt
from cpuckpt import faultpoint
from cpuckpt.backend.collectives import checkpoint_group, gather_failures, raise_if_failed
from cpuckpt.backend.itemcache import FlatState
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, ConfigError, CpuckptError

from . import compat, deferred, prepare, replay
from .flatstate import ATOMIC, RepeatedTensors, flat_state, leaves, to_pyt
from .guard import DIR_MARK, DONE_MARK, FINALIZE_MARK, MEMORY_MARK, PROBE_FAILED, URGENT_MARK, WAIT_MARK
from .memory import MegatronMemory
from .settings import resolve_core
from .worker import OK, PersistWait, PersistWatch, new_channel, wait_for_commit

__all__ = ["EAGER_SUFFIXES", "CpuckptLoadStrategy", "CpuckptSaveStrategy", "order_pending_saves"]

logger = logging.getLogger(__name__)

_PERSIST_POLL_S = 0.01  # a persistent save's finalize that must wait for its persist looks again this often

# ordering="optimizer": saved tensors Megatron writes *before* the optimizer step, copied on the GPU at
# save time (small). MoE routers' ``expert_bias`` and quantile balancing's ``qb_beta`` are updated in
# ``finalize_model_grads``.
EAGER_SUFFIXES = ("expert_bias", "qb_beta")

# Per process, like the optimizer classes whose wrapped steps read them: a step cannot tell which model a
# save is of, so it orders itself after every pending save (a GPU-side wait; a superset is still correct).
# Must not be drained anywhere but at an optimizer step or a save's own start.
_PENDING: list[Any] = []  # handles of saves whose device copies no optimizer step was ordered after yet
_STEPS_ORDERED = False  # set by hook.order_optimizer_steps: every optimizer step calls order_pending_saves


def order_pending_saves() -> int:
    """Make the current stream wait (on the GPU) for the copies of every save not yet ordered; returns how many.

    Called at the start of each optimizer step (ordering ``optimizer``), before the first kernel that
    writes a saved tensor after the save returned (see :class:`CpuckptSaveStrategy`).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # a captured step (--optimizer-cuda-graph) runs this once, at capture: its replays would order nothing
        raise ConfigError("megatron.ordering optimizer: the optimizer step is captured into a CUDA graph "
                          "(--optimizer-cuda-graph), so no replay of it waits for the saves' copies; use "
                          "megatron.ordering host")
    deferred.start_all()  # saves no start point started yet (deferred.py): enqueued now, without overlap
    pending, _PENDING[:] = list(_PENDING), []
    for handle in pending:
        handle.wait_stream()
    return len(pending)


class _Started:
    """A save's handle, made when its start ran (at once, or at a start point: see :mod:`.deferred`).

    Once it ran, the start (and with it Megatron's sharded state dict: thousands of objects for a 24-layer GPT) is
    dropped: the request lives until the save is finalized, iterations later, and what it held would outlive the
    young generations of the trainer's garbage collector, bringing its full collections (hundreds of ms) sooner."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start: Callable[[], Any] | None = start
        self._handle: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._start is None:
                return
            start, self._start = self._start, None
            try:
                self._handle = start()
            except BaseException as e:
                self._error = e
                raise

    def ended(self) -> bool:
        """Whether the save has ended on this rank (committed or failed; a failed start too); never starts it."""
        return self._error is not None or (self._handle is not None and self._handle.done())

    def ended_within(self, timeout: float) -> bool:
        """:meth:`ended`, waiting at most ``timeout`` seconds for it (a save not started yet cannot end: it sleeps)."""
        handle = self._handle
        if self._error is not None or handle is None:
            if self._error is None:
                time.sleep(timeout)
            return self._error is not None
        return handle.ended_within(timeout)

    def handle(self) -> Any:
        """The handle, starting the save first if no start point did (every rank comes here alike)."""
        if self._handle is None and self._error is None:
            deferred.start_all()  # this save and any recorded before it, in order
            self.start()
        if self._error is not None:
            raise CpuckptError(f"the deferred save failed to start: {self._error}") from self._error
        return self._handle


def _snapshot_eager(values: list[Any]) -> int:
    """Replace the data of saved tensors written before the optimizer step by GPU copies (stream-ordered);
    ``values``: the state dict's leaves (:func:`.flatstate.leaves`)."""
    n = 0
    for sh in values:
        if isinstance(sh, ShardedTensor) and sh.key.endswith(EAGER_SUFFIXES) and sh.data is not None:
            sh.data = sh.data.detach().clone()  # on the trainer's stream: the save's copies wait for it
            n += 1
    return n


def _freeze_objects(values: list[Any]) -> int:
    """For a save started later (:mod:`.deferred`): replace the host objects by copies, so that it does not see
    what the next iteration changes in them before an optimizer step starts it (the RNG tracker's generators with
    CUDA graphs, which dropout advances; the rerun state machine's counters, updated during the backward). Plain
    immutable values are kept as they are, and so are objects holding device tensors (a distributed optimizer's
    per-bucket state: only its step writes them, and a copy would double them in device memory). ``values``: the
    state dict's leaves."""
    n = 0
    for sh in values:
        if isinstance(sh, ShardedObject) and not isinstance(sh.data, ATOMIC) and not _on_device(sh.data):
            try:
                sh.data = _private_copy(sh.data, {})
            except _NotPlain:
                sh.data = copy.deepcopy(sh.data)
            n += 1
    return n


_ATOMIC = frozenset(ATOMIC)  # membership of a type: a set lookup


class _NotPlain(Exception):
    """An object :func:`_private_copy` leaves to ``copy.deepcopy`` as a whole."""


def _private_copy(obj: Any, memo: dict[Any, Any]) -> Any:
    """What ``copy.deepcopy(obj)`` makes of the trainer's host objects (the RNG states, the rerun state machine's),
    the same for ``torch.save``, without deepcopy's Python per value: plain values and tuples of them are immutable
    and kept (Python's RNG state holds 625 ints, which deepcopy visits one by one), dicts (plain keys) and lists are
    rebuilt, numeric arrays copied, plain CPU tensors that are the whole of their own storage cloned (deepcopy of one
    takes ~20 times as long); shared objects stay shared (``memo``). Anything else in ``obj`` (another type, a view,
    a storage two tensors share) makes the whole of it ``copy.deepcopy``'s: the two are never mixed in one object,
    whose shared storages only deepcopy's own memo knows. With deepcopy, Megatron-LM's objects took ~2 ms per save on
    the trainer's thread (H100).

    Raises:
        _NotPlain: ``obj`` holds something else (the caller deep-copies it instead).
    """
    kind = type(obj)
    if kind in _ATOMIC:
        return obj
    done = memo.get(id(obj))
    if done is not None:
        return done
    if kind is torch.Tensor:
        if not _whole_plain(obj):
            raise _NotPlain
        storage = ("storage", obj.untyped_storage().data_ptr())
        if storage in memo:
            raise _NotPlain
        memo[storage] = True
        out: Any = obj.clone()
    elif kind is tuple:
        if all(type(v) in _ATOMIC for v in obj):
            return obj
        values = [_private_copy(v, memo) for v in obj]
        done = memo.get(id(obj))  # reached again through its own values (a list holding it): that copy
        if done is not None:
            return done
        if all(a is b for a, b in zip(values, obj)):
            return obj
        out = tuple(values)
    elif kind is dict:
        out = memo[id(obj)] = {}
        for k, v in obj.items():
            if type(k) not in _ATOMIC:
                raise _NotPlain  # deepcopy copies keys too
            out[k] = _private_copy(v, memo)
    elif kind is list:
        out = memo[id(obj)] = []
        out.extend(_private_copy(v, memo) for v in obj)
    elif _is_numeric_array(obj):
        out = obj.copy(order="K")
    else:
        raise _NotPlain
    memo[id(obj)] = out
    _keep_alive(obj, memo)
    return out


def _is_numeric_array(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")  # loaded wherever one exists: never imported for this
    return numpy is not None and type(obj) is numpy.ndarray and not obj.dtype.hasobject


def _whole_plain(t: torch.Tensor) -> bool:
    """A CPU tensor ``clone()`` copies as ``torch.save`` writes it: dense, not empty, the whole of its storage, no
    autograd state, no Python attributes."""
    return (not t.is_nested and t.layout == torch.strided and t.device.type == "cpu" and not t.requires_grad
            and t.numel() > 0 and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and not t.is_conj() and not t.is_neg() and not getattr(t, "__dict__", None))


def _keep_alive(obj: Any, memo: dict[Any, Any]) -> None:
    """As ``copy.deepcopy`` does: the originals stay referenced by the memo, so no id in it is reused meanwhile."""
    memo.setdefault(id(memo), []).append(obj)


def _on_device(obj: Any, seen: set[int] | None = None) -> bool:
    """Whether ``obj`` (nested dicts, lists, tuples; each container looked into once) holds a tensor on a device."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if not isinstance(obj, dict | list | tuple):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    return any(_on_device(v, seen) for v in (obj.values() if isinstance(obj, dict) else obj))


class CpuckptSaveStrategy(TorchDistSaveShardedStrategy):
    """Save strategy: Megatron sharded state dict -> DCP plan -> cpuckpt pipeline.

    ``async_save`` returns once this rank's tensors are in cpuckpt's host pool (the stall is the
    planning plus the device-to-host copy); cpuckpt's threads write and commit in the background,
    and the returned ``AsyncRequest``'s worker function only waits for that commit (see
    :mod:`.worker`); a memory-tier save on a queue cpuckpt watches has none (the watchdog finalizes it:
    :data:`.guard.DONE_MARK`). Its finalize function raises the save's error, if any, on every rank.

    Plan reuse: ``async_save`` reuses the previous save's DCP plan when every rank's translated state
    dict has the same structure (:func:`cpuckpt.async_save` with ``plan_key``; the signature covers
    every shard's key, global shape, offsets, sizes, dtype and device type, never values), so only the
    first save after a structure change pays DCP's planning. Megatron-LM's ``use_cached_ckpt_structure``
    (``--ckpt-assume-constant-structure``) turns it on even when ``reuse_plan`` is False; the structure
    is checked either way, so a change the flag promised would not happen is planned by DCP instead of
    written with a stale plan. The synchronous ``save`` plans with DCP every time.
    ``last_save_stats.planned`` says which way the last ``async_save`` went.

    Args:
        config: cpuckpt settings (a :class:`cpuckpt.Config`, a YAML path, a dict or None).
        keep_only_main_replica: as for megatron-core's ``TorchDistSaveShardedStrategy``.
        reuse_plan: reuse plans as above (default); False plans every save with DCP unless
            ``use_cached_ckpt_structure`` is set.
        reuse: the run's :class:`.replay.StateDictReuse`: a full build it waits for has its tensors captured here,
            after megatron-core's preprocessing (the hook passes its run's; a replayed save's tensors come back
            without it).
        checkpointer: the :class:`cpuckpt.Checkpointer` (save stream) its async saves go through: its
            plan, item and layout caches and in-flight bound. Default: :func:`cpuckpt.async_save`'s of the
            default group. Two models of one process pass one each; strategies made per save (as
            Megatron-LM makes them) pass the same one (the hook passes its run's).
        ordering: ``host`` (default): ``async_save`` returns once every byte is in host memory.
            ``optimizer``: it returns once the device-to-host copies are enqueued
            (:func:`cpuckpt.async_save` with ``ordering="stream"``: CPU tensors and objects are copied
            before the return); the caller's next optimizer step must call :func:`order_pending_saves`
            first (Megatron-LM: the hook wraps every ``megatron.core.optimizer`` step; others call
            ``hook.order_optimizer_steps()``, checked here). Saved tensors that change before that
            step (:data:`EAGER_SUFFIXES`: MoE ``expert_bias``) are cloned on the GPU at save time.
            Memory-tier saves too. megatron-core's temporal caller runs
            ``torch.cuda.synchronize()`` before it forks for a worker's call, which waits for the copies
            anyway (correct, no overlap); the persistent caller (``--use-persistent-ckpt-worker``) does not,
            and a memory save on a watched queue forks nothing. With a
            queue watched by cpuckpt (Megatron-LM: the hook), a save to the durable root is only
            recorded here and started at the queue's next finalize, after Megatron-LM's timer has
            synchronized the device (:mod:`.deferred`).
    """

    takes_replays = True  # resolves a replayed state dict's marker first (replay.take)

    def __init__(self, config: Config | str | os.PathLike | dict | None = None, *,
                 keep_only_main_replica: bool = True, reuse_plan: bool = True,
                 memory: MegatronMemory | None = None, ordering: str = "host",
                 checkpointer: cpuckpt.Checkpointer | None = None, reuse: replay.StateDictReuse | None = None) -> None:
        super().__init__(backend="torch_dist", version=1, keep_only_main_replica=keep_only_main_replica)
        self.reuse = reuse  # captures the tensors of the state dicts it builds (megatron.reuse_state_dict)
        self.config = resolve_core(config)  # a megatron: block (the adapter's own keys) is allowed
        self.reuse_plan = reuse_plan
        self.memory = memory  # routes async saves of Megatron-LM's iter_<N> directories into the memory tier
        if ordering not in ("host", "optimizer"):
            raise ConfigError(f"CpuckptSaveStrategy: ordering must be host or optimizer, got {ordering!r}")
        self.ordering = ordering
        self.checkpointer = checkpointer
        self.last_save_stats: Any = None  # cpuckpt.background.SaveStats of the last async_save
        self._packed: dict[tuple, bytes] = {}  # plain objects' pickles, reused save after save (flatstate._pack)
        self._repeated = RepeatedTensors()  # a replay's tensors flattened once per capture (flatstate)

    def _to_pyt(self, sharded_state_dict: dict[str, Any], keep_replicas: bool = False) -> dict[str, Any]:
        return to_pyt(sharded_state_dict, self.keep_only_main_replica and not keep_replicas)

    def _state(self, sharded_state_dict: dict[str, Any], plan_key: tuple | None,
               keep_replicas: bool = False) -> FlatState | dict[str, Any]:
        """What an async save hands cpuckpt: with plan reuse, the values flat (:mod:`.flatstate`: a save that
        repeats the last one skips the translation and DCP); without, the translated state dict."""
        if plan_key is None:
            return self._to_pyt(sharded_state_dict, keep_replicas)
        return flat_state(sharded_state_dict, self.keep_only_main_replica and not keep_replicas, self._packed,
                          self._repeated)

    def _planner(self, keep_replicas: bool = False) -> MCoreSavePlanner:
        if keep_replicas:  # DCP's central global plan deduplicates the replicas (and the tier adds node copies)
            return MCoreSavePlanner(can_run_decentralized_global_plan=False, flatten_state_dict=False,
                                    flatten_sharded_tensors=False)
        return MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False,
                                flatten_sharded_tensors=False)

    def _plan_key(self, planner: MCoreSavePlanner) -> tuple | None:
        """``planner``'s settings: MCoreSavePlanner plans from the structure alone. None: no plan reuse."""
        if not (self.reuse_plan or getattr(self, "use_cached_ckpt_structure", False)):
            return None
        return ("mcore", self.keep_only_main_replica, planner.flatten_state_dict, planner.flatten_sharded_tensors,
                getattr(planner, "dedup_save_to_lowest_rank", None),
                getattr(planner, "can_run_decentralized_global_plan", None))

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        """Synchronous save: streams through a bounded pool; durable and committed on return."""
        replay.take(sharded_state_dict, self.reuse)
        prepare.wait_prepared(self.config.timeout_s)
        cpuckpt.save(self._to_pyt(sharded_state_dict), checkpoint_dir, self.config, planner=self._planner())

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path,
                   async_strategy: str = "mcore") -> Any:
        """Plan, stage into the host pool, start writing; return Megatron's ``AsyncRequest``.

        With :attr:`memory` set, a save of Megatron-LM's ``iter_<N>`` is a memory-tier save instead (see
        :mod:`.memory`); for a persistent one the worker also waits for the writer process's persist.
        """
        replay.take(sharded_state_dict, self.reuse)  # megatron.reuse_state_dict: a replay's tensors, a build's capture
        planner = self._planner()
        route = self.memory.route(checkpoint_dir) if self.memory is not None else None
        overlap = self.ordering == "optimizer"
        values: list[Any] = []
        if overlap:
            if not _STEPS_ORDERED:
                raise ConfigError("megatron.ordering optimizer: no optimizer step waits for the save's copies; "
                                  "call cpuckpt.integrations.megatron.hook.order_optimizer_steps() first "
                                  "(hook.install() does), or use ordering host")
            values = leaves(sharded_state_dict)  # one walk for both passes (they change leaves, not containers)
            _snapshot_eager(values)
        finalized = None
        if route is not None:  # the save about to be refilled is finalized first (either kind of save)
            self.memory.finalize_before_reuse()
            finalized = self.memory.track()
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A memory-tier save needs no worker: the watchdog of the queue it goes to finalizes it (guard.py, DONE_MARK),
        # a persistent one once the writer process reported its persist (PersistWatch)
        in_trainer = route is not None and self.memory.queue_watched()
        channel = None if in_trainer else new_channel(rank)
        persist = None
        requests: list[Any] = []

        def start() -> Any:
            # across nodes every replica takes part, so that each node's slot gets its own copy (tier.nodecopies)
            keep = route is not None and self.memory.keeps_replicas
            own_planner = self._planner(keep_replicas=True) if keep else planner
            plan_key = self._plan_key(own_planner)
            state = self._state(sharded_state_dict, plan_key, keep_replicas=keep)
            if route is None:
                prepare.wait_prepared(self.config.timeout_s)  # never take a pool the preparation replaces
                save = self.checkpointer.async_save if self.checkpointer is not None else cpuckpt.async_save
                h = save(state, checkpoint_dir, self.config, planner=own_planner, plan_key=plan_key,
                         ordering="stream" if overlap else "host")
            else:
                h, request = self.memory.save(state, route, planner=own_planner, plan_key=plan_key,
                                              ordering="stream" if overlap else "host")
                requests.append(request)
            self.last_save_stats = h.stats
            if channel is not None:
                h.add_done_callback(lambda error: channel.post_status(None if error is None else str(error)))
            if overlap:
                _PENDING.append(h)  # the next optimizer step orders itself after the copies
            return h

        started = _Started(start)
        # After Megatron-LM's timer, whose synchronize would wait for the copies (deferred.py). A persistent
        # memory-tier save starts at once: its persist request is part of the request handed to Megatron.
        if overlap and deferred.enabled() and (route is None or route.kind == "memory"):
            _freeze_objects(values)
            deferred.defer(self._deferred_start(started, channel))
        else:
            deferred.start_all()  # saves start in the order they were made: one recorded earlier goes first
            try:
                started.start()
                if not overlap:
                    started.handle().staged.wait()  # after this the trainer may change any saved tensor
            except BaseException:
                if channel is not None:
                    channel.remove()  # the save fails on (handle.wait raises it at the next async_save/wait_all)
                if finalized is not None:
                    finalized[0] = True  # no call of it reaches Megatron's queue
                raise
            if requests and requests[0] is not None:
                tier = self.memory.tier
                persist = PersistWait(str(tier.queue.path), requests[0].seq,
                                      str(tier.root.writer_lock_path(tier.rank)))
        timeout_s = self.config.timeout_s
        if channel is None:
            watch = PersistWatch(persist) if persist is not None else None
            return self._in_trainer_request(async_strategy, started, route, finalized, checkpoint_dir, watch)
        group = checkpoint_group(None, timeout_s)

        def finalize_fn(abandoned: bool = False) -> None:
            try:
                # The channel only says whether this rank's worker process did its part (not asked when
                # the watchdog, guard.py, abandoned the call: it stopped the workers itself).
                report = channel.take_report()
                worker_error = None if report == OK or abandoned else CpuckptError(
                    report or f"the checkpoint worker process of rank {rank} ended without reporting (killed?)")
                reports = gather_failures(worker_error, rank, group)
                # The save's own outcome: the error its committer built from every rank's
                # FailureReport (same class and message on every rank; StorageIOError with
                # errno/path/rank for an OSError), chained to this rank's original.
                started.handle().wait(timeout_s)
                raise_if_failed(reports, f"async save of {checkpoint_dir}", worker_error)
                if route is not None and not abandoned:
                    self.memory.finalized(route)  # across nodes: metadata.json and D's tracker on every node
            finally:
                channel.remove()
                if finalized is not None:
                    finalized[0] = True

        setattr(finalize_fn, FINALIZE_MARK, True)  # the watchdog runs it for a dropped call too
        setattr(finalize_fn, DIR_MARK, str(checkpoint_dir))  # guard.finalize_saves_under
        try:
            return compat.make_async_request(async_strategy, wait_for_commit,
                                             (channel.base, rank, 2 * timeout_s + 60, os.getpid(),
                                              faultpoint.get_handler(), persist), [finalize_fn])
        except BaseException:
            # e.g. async_strategy "nvrx" without nvidia-resiliency-ext: the save goes on in cpuckpt's
            # threads (its outcome reaches cpuckpt.wait_all / the next async_save), but no caller will
            # ever read the channel.
            channel.remove()
            if finalized is not None:
                finalized[0] = True
            raise


    def _in_trainer_request(self, async_strategy: str, started: _Started, route: Any, finalized: list[bool],
                            checkpoint_dir: str | Path, watch: PersistWatch | None) -> Any:
        """The ``AsyncRequest`` of a memory-tier save: no ``async_fn`` (no worker takes part); its finalize function
        carries the done probe the queue's watchdog finalizes it by (:data:`.guard.DONE_MARK`: the memory commit
        ended, and with ``watch``, a persistent save's, the writer's persist too; a memory save's is urgent with
        :attr:`.MegatronMemory.finalize_before_next_log`), and raises the save's error, the same on every rank (the
        committer agreed it; every rank's persist outcome is gathered), before Megatron's finalize functions after
        it run (``metadata.json``, the tracker: a persistent save's only once every rank's files are durable)."""
        timeout_s = self.config.timeout_s

        def finalize_fn(abandoned: bool = False) -> None:
            try:
                if not abandoned:  # dropped by the watchdog: its save goes on in cpuckpt's threads, never finalized
                    started.handle().wait(timeout_s)
                    if watch is not None:
                        _agree_persisted(watch, self.memory.tier.queue, f"persist of {checkpoint_dir}", timeout_s)
                    self.memory.finalized(route)  # across nodes: metadata.json and D's tracker on every node
            finally:
                finalized[0] = True

        def ended() -> bool | int:
            if not started.ended():
                return False
            if watch is None:
                return True
            done, error = watch.poll()  # a failed persist here: finalized (and raised) without waiting for the others
            return PROBE_FAILED if error is not None else done

        setattr(finalize_fn, FINALIZE_MARK, True)
        setattr(finalize_fn, DIR_MARK, str(checkpoint_dir))
        probe = functools.partial(ended)  # its own object: it may carry URGENT_MARK
        if watch is None:  # a blocking finalize waits for this save's end between its looks, not a fixed sleep
            setattr(probe, WAIT_MARK, started.ended_within)
        if route.kind == "memory":  # waited for before the next printed log line (guard.finalize_before_log)
            setattr(probe, MEMORY_MARK, True)
            if self.memory.finalize_before_next_log:  # and before the next one, printed or not
                setattr(probe, URGENT_MARK, True)
        setattr(finalize_fn, DONE_MARK, probe)
        try:
            return compat.make_async_request(async_strategy, None, (), [finalize_fn])
        except BaseException:
            finalized[0] = True
            raise

    @staticmethod
    def _deferred_start(started: _Started, channel: Any) -> Any:
        def start() -> None:
            try:
                started.start()
            except BaseException as e:  # the worker waiting on the channel learns it too
                if channel is not None:
                    channel.post_status(f"the save failed to start: {e}")
                raise
        return start


def _agree_persisted(watch: PersistWatch, queue: Any, what: str, timeout_s: float) -> None:
    """Every rank, in a persistent save's finalize: return once its persist ended well on every rank, else raise the
    same error on every rank, the persist withdrawn everywhere (a coordinator's writer stops waiting for a part that
    never comes). Its done probe has usually agreed on that already; where Megatron-LM's logits saver moved the
    finalize functions onto a request of its own, the probe is never asked, and this waits (bounded by ``timeout_s``).
    Every decision is taken from one all-reduce, so the ranks loop and raise alike."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = checkpoint_group(None, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        done, error = watch.poll()
        late = not done and time.monotonic() > deadline
        flags = torch.tensor([1 if done else 0, -1 if error else 0, -1 if late else 0], dtype=torch.int32)
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)  # [done everywhere, -failed, -late anywhere]
        if int(flags[1]) or int(flags[2]):
            queue.cancel(watch.persist.seq, "the persist failed or timed out on some rank")
            mine: CpuckptError | None = None
            if error is not None:
                mine = CpuckptError(f"rank {rank}: {error}")
            elif late:
                mine = CheckpointTimeoutError(f"rank {rank}: persist not done after {timeout_s:.0f} s")
            raise_if_failed(gather_failures(mine, rank, group), what, mine)
            raise CpuckptError(f"{what} failed on another rank")  # not reached: some rank reported it
        if int(flags[0]):
            return
        time.sleep(_PERSIST_POLL_S)


class CpuckptLoadStrategy(TorchDistLoadShardedStrategy):
    """Load strategy: reads torch_dist checkpoints (ours or stock) with :class:`cpuckpt.StorageReader`.

    Resharding works as in megatron-core: DCP plans the reads from the requested shards. The load is
    collective (every rank of the default group calls it, as Megatron-LM does); megatron-core 0.19's
    own torch_dist load reads with ``no_dist=True`` instead.
    """

    def __init__(self, config: Config | str | os.PathLike | dict | None = None) -> None:
        super().__init__()
        self.config = resolve_core(config)

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path, *args: Any,
             **kwargs: Any) -> dict[str, Any]:
        flexible = [t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        t0 = time.perf_counter()
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, True)
        planner = MCoreLoadPlanner(**compat.load_planner_kwargs(self, flexible, mismatch))
        t1 = time.perf_counter()
        reader = cpuckpt.StorageReader(checkpoint_dir, self.config)
        cpuckpt.load(pyt_state_dict, checkpoint_dir, self.config, planner=planner, storage_reader=reader)
        t2 = time.perf_counter()
        if getattr(self, "cache_metadata", True):  # megatron-core <= 0.16 always caches it
            self.cached_global_metadata = reader.metadata  # the load's own: no second read of .metadata
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        t3 = time.perf_counter()
        # cpuckpt's share of Megatron's load-checkpoint time, apart from megatron-core's own work here
        # (translating sharded tensors before, unwrapping after); the cpuckpt.telemetry line splits
        # cpuckpt.load further into metadata, DCP planning and reads.
        logger.info("cpuckpt megatron load %s: translate %.3f s, cpuckpt.load %.3f s, unwrap %.3f s, %d bytes",
                    checkpoint_dir, t1 - t0, t2 - t1, t3 - t2, reader.last_read_nbytes)
        return state

