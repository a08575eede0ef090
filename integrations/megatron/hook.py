"""Megatron-LM hook: ``--ckpt-format cpuckpt [--cpuckpt-config PATH.yaml]`` in unmodified training scripts.

Megatron-LM declares ``ckpt_format`` as a ``Literal`` (argparse rejects other values) and compares
it with ``'torch_dist'`` in dozens of places: only that value builds sharded state dicts and routes
saves into ``dist_checkpointing``. So cpuckpt is not a new format to Megatron-LM but the torch_dist
format with other storage. :func:`install`:

1. rewrites the command line before Megatron parses it: ``--ckpt-format cpuckpt`` (or the
   deprecated ``--dist-ckpt-format cpuckpt``) becomes ``--ckpt-format torch_dist``, and
   ``--cpuckpt-config PATH`` is taken out;
2. replaces the two strategy classes that ``megatron.training.checkpointing`` constructs
   (``TorchDistSaveShardedStrategy(cpu_shm_mode=...)`` and
   ``TorchDistLoadShardedStrategy(cache_metadata=...)``) with cpuckpt's subclasses;
3. installs the dead-worker watchdog (:func:`.guard.watch_async_queue`) on Megatron-LM's async save
   queue: ``megatron.training.async_utils`` builds that queue (megatron-core's or, with the default
   ``--async-strategy nvrx``, nvidia-resiliency-ext's) in ``_get_async_calls_queue`` (every
   scheduled save goes through it) and in ``init_persistent_async_worker`` (``--use-persistent-ckpt-worker``),
   so both are wrapped to watch the queue they leave in ``_async_calls_queue``; a module that imported
   ``init_persistent_async_worker`` by name already (``megatron.training.initialize``) gets the wrapped
   one too. A missing function is a warning (that path is then not watched). The ``megatron:`` block of
   ``--cpuckpt-config`` (``on_failure``, ``heartbeat_timeout_s``) configures the watchdog.

4. wraps Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` so that every rank first finalizes
   every pending save into that directory (Megatron-LM removes all but the newest without asking: a save
   finalized after its directory went fails, and a tracker naming a removed one is left behind:
   :func:`.guard.finalize_saves_under`) and the directory the tracker names is never removed; with
   ``megatron: {memory_tier: true}``, routes async saves through the memory tier
   (:mod:`.memory`): Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` leaves the
   non-persistent directory to the ring (before every save into it, of either kind, only the saves
   older than the newest ``slots - 1`` are finalized, so saves every iteration overlap, each in its own slot),
   ``maybe_finalize_async_save(terminate=True)`` (the end of training) closes the tier (after Megatron-LM's
   final save when one follows: :meth:`Training.end_of_training`), and the tier is
   made when ``setup_model_and_optimizer`` returns, every free slot's image reserved, mapped and pinned
   then for the shard the optimizer will save (no first save pays it while the job trains), and
   ``training_log`` first finalizes the memory saves that have committed (:func:`finalize_before_log`; before a
   line Megatron-LM prints, with a log interval above one, it waits for their commits), so that Megatron-LM's tracker
   names the previous iteration before an iteration is logged.

5. with ``megatron: {ordering: optimizer}``, wraps the ``step`` of every ``megatron.core.optimizer``
   class (:func:`order_optimizer_steps`): async saves return once their device-to-host copies are
   enqueued, the next forward and backward overlap them, and the next optimizer step first makes its
   stream wait for them (a GPU-side wait; pieces of the copies not yet enqueued by the forward and
   backward's ticks go first: :mod:`cpuckpt.transfer.pacing`). What Megatron-LM writes into saved tensors before that
   step: MoE ``expert_bias`` (``finalize_model_grads``), cloned at save time by the strategy; with
   ``--overlap-param-gather`` the next forward re-gathers parameters that ``force_param_sync`` already
   made whole before the save (the same bytes: no step ran in between). Megatron-LM's ``--async-save``
   uses the persistent caller, which does not synchronize the device; megatron-core's temporal caller
   does (``torch.cuda.synchronize()`` before its fork), which removes the overlap but stays correct.

6. with ``megatron: {prepare_pool: true}`` (the default), reserves the host pool in the background
   after the first optimizer step (:mod:`.prepare`), so the first save is as fast as later ones.

7. with ``megatron: {fallback_on_corrupt: true}`` (the default), wraps ``load_checkpoint`` (also where
   ``megatron.training.training`` imported it by name): a newest checkpoint that fails cpuckpt's
   checks on load makes every rank load the next newest complete iteration, through Megatron-LM's own
   ``load_checkpoint`` again with ``read_metadata`` answering that iteration (:func:`.fallback.fall_back_on_corrupt`
   says why no data of the damaged one remains). Nothing runs before a load: no cost when nothing is damaged.

8. replaces the ``FullyParallelSaveStrategyWrapper`` it constructs by a subclass that, under
   ``--ckpt-assume-constant-structure``, validates the sharding once also where the data-parallel group has
   one rank (:func:`validate_structure_once`: Megatron-LM validated every save there).

9. with ``megatron: {freeze_gc: true}``, freezes Python's collector's objects once setup returned
   (:func:`freeze_collector_after_setup`).

Without ``--ckpt-format cpuckpt`` on the command line it changes nothing. Use it through the
launcher (``python -m cpuckpt.integrations.megatron.launch pretrain_gpt.py ...``) or add one line
at the top of the script: ``import cpuckpt.integrations.megatron as m; m.install()``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpuckpt.config import Config
from cpuckpt.errors import ConfigError

from .compat import replace_function
from .settings import MegatronOptions, split_config

if TYPE_CHECKING:
    from .memory import MegatronMemory

__all__ = ["FORMAT", "Selection", "Training", "finalize_before_log", "install", "order_optimizer_steps", "rewrite_argv",
           "watch_megatron_lm_queue"]

logger = logging.getLogger(__name__)

FORMAT = "cpuckpt"
CONFIG_FLAG = "--cpuckpt-config"
_FORMAT_FLAGS = ("--ckpt-format", "--dist-ckpt-format")


@dataclass
class Selection:
    """What the command line asked for, and the arguments Megatron-LM should see instead."""

    enabled: bool = False
    config: str | None = None
    argv: list[str] = field(default_factory=list)


def rewrite_argv(argv: list[str]) -> Selection:
    """Map ``--ckpt-format cpuckpt`` onto torch_dist and take out ``--cpuckpt-config``.

    Raises:
        ConfigError: ``--cpuckpt-config`` without a value, or without ``--ckpt-format cpuckpt``.
    """
    sel = Selection()
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in _FORMAT_FLAGS or name == CONFIG_FLAG:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                if name == CONFIG_FLAG:
                    raise ConfigError(f"{CONFIG_FLAG} needs a path")
                sel.argv.append(arg)  # let Megatron's parser report the missing value
                i += 1
                continue
            if name == CONFIG_FLAG:
                sel.config = value
            elif value == FORMAT:
                sel.enabled = True
                sel.argv += ["--ckpt-format", "torch_dist"]
            else:
                sel.argv += [name, value]
            continue
        sel.argv.append(arg)
        i += 1
    if sel.config is not None and not sel.enabled:
        raise ConfigError(f"{CONFIG_FLAG} {sel.config} given, but --ckpt-format is not {FORMAT}")
    return sel


def install(config: Config | str | os.PathLike | dict | None = None, *, argv: list[str] | None = None) -> bool:
    """Rewrite ``sys.argv`` (or ``argv``, in place) and swap Megatron-LM's strategies if cpuckpt is selected.

    ``--cpuckpt-config`` on the command line wins over ``config``. Returns whether cpuckpt was selected.

    Raises:
        ConfigError: a bad flag or configuration (checked before training starts).
    """
    args = sys.argv if argv is None else argv
    sel = rewrite_argv(args[1:])
    if not sel.enabled:
        return False
    cfg, options = split_config(sel.config if sel.config is not None else config)
    args[1:] = sel.argv
    patch_training(cfg, options=options)
    watch_megatron_lm_queue(2 * cfg.timeout_s + 60, options)  # the callers' own bound on a save
    logger.info("cpuckpt: --ckpt-format cpuckpt -> torch_dist files written and read by cpuckpt (%s)",
                sel.config or "default settings")
    return True


class Training:
    """What one :func:`patch_training` owns (one training run): the save stream its strategies share,
    and its memory tier. Megatron-LM builds a new strategy for every save, so these live here, not in
    the strategy; a second run patched into the same process gets its own.
    """

    def __init__(self, cfg: Config) -> None:
        from cpuckpt.background import Checkpointer

        self.cfg = cfg
        self.checkpointer = Checkpointer()  # plan, item and layout caches of this run's async saves
        self.reuse: Any = None  # the run's replay.StateDictReuse (megatron.reuse_state_dict)
        self._memory: Any = None  # the run's MegatronMemory (memory_tier: true), made at its first save
        self._terminated = False  # train()'s terminate came: the next is pretrain()'s, after its final save

    def memory(self) -> Any:
        """The run's :class:`.memory.MegatronMemory`, from Megatron-LM's ``--save`` and non-persistent dir."""
        if self._memory is None:
            from megatron.training import get_args

            from .memory import MegatronMemory

            args = get_args()
            if not args.save:
                raise ConfigError("megatron.memory_tier needs --save (the durable root)")
            np_dir = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(args.save, "non_persistent")
            self._memory = MegatronMemory(args.save, np_dir, self.cfg, queue_of=_megatron_lm_queue)
        return self._memory

    def close(self) -> None:
        """The end of training: the memory tier closes (writers stop, RAM root goes)."""
        atexit.unregister(self._close_at_exit)
        self._terminated = False
        if self._memory is not None:
            self._memory.close()

    def end_of_training(self, args: Any) -> None:
        """Megatron-LM's ``maybe_finalize_async_save(terminate=True)``, called at the end of ``train()`` and again at
        the end of ``pretrain()``. When Megatron-LM's final save follows the first (:func:`final_save_follows`), the
        tier stays open for it: a tier made anew for that save maps a fresh slot and starts a writer (11.7-13.9 s of
        a 4.7 GB run on the H200). It closes at the next terminate (``pretrain()``'s), else at exit
        (:meth:`_close_at_exit`). Only the first terminate defers: at the second the final save is done, also where
        that save made the tier."""
        first, self._terminated = not self._terminated, True
        if self._memory is None:
            return
        if first and final_save_follows(args):
            atexit.register(self._close_at_exit)
            logger.info("cpuckpt: the memory tier stays open for Megatron-LM's final save")
            return
        self.close()

    def _close_at_exit(self) -> None:
        """At exit, where ``pretrain()``'s terminate never came: the close is collective, so only where the process
        ends without an uncaught exception and its process group is alive (then every rank is here). Otherwise the
        RAM root stays for a relaunch to use, or ``cpuckpt clean --ram``: a rank that died of an exception must not
        wait ``timeout_s`` for ranks that are not coming."""
        import torch.distributed as dist

        failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if failed is not None or not (dist.is_available() and dist.is_initialized()):
            logger.warning("cpuckpt: the memory tier is left open at exit (%s); its RAM root stays for a relaunch or "
                           "`cpuckpt clean --ram`", "an uncaught exception" if failed is not None else
                           "no process group")
            return
        self.close()


def final_save_follows(args: Any) -> bool:
    """Whether Megatron-LM's ``pretrain()`` saves once more after ``train()`` returns (its own condition): it trains
    (``do_train``, no ``--skip-train``) with ``--save``, and the last iteration (``--train-iters``) is not a multiple
    of ``--save-interval``. False where ``train()`` may end the process itself (``--exit-interval``,
    ``--exit-duration-in-mins``, ``--exit-signal-handler``, ``--phase-transition-iterations``): the tier then closes
    at ``train()``'s terminate, as it would without a final save, not at exit."""
    iters, interval = getattr(args, "train_iters", None), getattr(args, "save_interval", None)
    trains = getattr(args, "do_train", True) and not getattr(args, "skip_train", False)
    exits = any(getattr(args, name, None) for name in ("exit_interval", "exit_duration_in_mins", "exit_signal_handler",
                                                "phase_transition_iterations"))
    return (bool(trains) and not exits and bool(getattr(args, "save", None)) and bool(iters) and bool(interval)
            and iters % interval != 0)


def patch_training(cfg: Config, module: Any = None, options: MegatronOptions | None = None) -> Training:
    """Replace the strategy classes ``megatron.training.checkpointing`` constructs by cpuckpt's; returns
    the run they save through."""
    if module is None:
        try:
            import megatron.training.checkpointing as module
        except ImportError as e:
            raise ImportError(
                "--ckpt-format cpuckpt needs Megatron-LM's megatron.training on the path (Megatron-LM is not on "
                f"PyPI: put its checkout first on PYTHONPATH): {e}"
            ) from e
    options = options or MegatronOptions()
    run = Training(cfg)
    if options.reuse_state_dict:
        from .replay import StateDictReuse

        run.reuse = StateDictReuse(timeout_s=cfg.timeout_s)
    classes = _training_classes(cfg, options, run)
    module.TorchDistSaveShardedStrategy, module.TorchDistLoadShardedStrategy = classes
    if options.memory_tier:
        _route_to_memory_tier(run, module)
        _reserve_slots_after_setup(run)
        finalize_before_log()
    _finalize_before_cleanup(module, memory_of=run.memory if options.memory_tier else None)
    validate_structure_once(module)
    if options.reuse_state_dict:
        from . import replay

        replay.install(module, run.reuse)
    if options.ordering == "optimizer":
        order_optimizer_steps()
    if options.prepare_pool and not options.memory_tier:
        from .prepare import PoolPreparer, prepare_after_first_step

        prepare_after_first_step(PoolPreparer(cfg))
    if options.fallback_on_corrupt:
        from .fallback import fall_back_on_corrupt

        fall_back_on_corrupt(module)  # a missing function is a warning: the load then raises as before
    if options.freeze_gc:
        freeze_collector_after_setup()  # after the slots' reservation: its objects live as long
    return run


def freeze_collector_after_setup(module: Any = None) -> bool:
    """When Megatron-LM's ``setup_model_and_optimizer`` returns, collect, then ``gc.freeze()`` what is alive
    (``megatron: {freeze_gc: true}``; :class:`.settings.MegatronOptions` says why); returns whether it wrapped it.
    ``module``: ``megatron.training.training``."""
    import gc
    import time

    found = _megatron_setup(module, "megatron.freeze_gc does nothing")
    if found is None:
        return False
    module, original = found
    if _wrapper_with(original, "_cpuckpt_freezes") is not None:
        return True

    @functools.wraps(original, updated=())
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        logger.info("cpuckpt: %d objects frozen after setup (megatron.freeze_gc; collected first in %.0f ms): full "
                    "collections while training look only at newer ones", gc.get_freeze_count(),
                    1000 * (time.perf_counter() - t0))
        return result

    setup_model_and_optimizer._cpuckpt_freezes = True  # type: ignore[attr-defined]
    module.setup_model_and_optimizer = setup_model_and_optimizer
    return True


def validate_structure_once(module: Any) -> type | None:
    """Make the ``FullyParallelSaveStrategyWrapper`` that ``module`` (``megatron.training.checkpointing``) builds
    validate a constant structure once, as Megatron-LM means it to; returns the class put in its place.

    With ``--ckpt-assume-constant-structure`` the wrapper caches its save distribution and validates the sharding
    only while nothing is cached; but for a trivial parallelization group (one data-parallel rank: a job of tensor
    or pipeline parallelism only, or one GPU) the distribution is ``None``, never cached, so every save ran
    ``validate_sharding_integrity`` again (its ``determine_global_metadata`` all-gather included: ~23 ms of the
    trainer's thread per save of the 24 x 1024 GPT on the H200). For such a group the method does nothing else
    (no distribution to apply), so after its first call it is skipped. Nothing changes without the promise.
    """
    base = getattr(module, "FullyParallelSaveStrategyWrapper", None)
    if base is None or getattr(base, "_cpuckpt_validates_once", False):
        return None
    from . import replay

    class FullyParallelValidatedOnce(base):  # type: ignore[misc, valid-type]
        _cpuckpt_validates_once = True

        def apply_saving_parallelization(self, sharded_state_dict: Any) -> Any:
            if (getattr(self, "_cpuckpt_applied", False) and self.do_cache_distribution
                    and self.cached_distribution is None and _trivial(self.parallelization_group)):
                return None
            out = super().apply_saving_parallelization(sharded_state_dict)
            self._cpuckpt_applied = True
            return out

        @property
        def takes_replays(self) -> bool:  # resolves a replayed state dict's marker first (replay.take) for cpuckpt's
            return bool(getattr(self.base_strategy, "takes_replays", False))

        def save(self, sharded_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            replay.take(sharded_state_dict)  # before the parallelization, which walks the tensors
            return super().save(sharded_state_dict, *args, **kwargs)

        def async_save(self, sharded_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            replay.take(sharded_state_dict)
            return super().async_save(sharded_state_dict, *args, **kwargs)

    module.FullyParallelSaveStrategyWrapper = FullyParallelValidatedOnce
    return FullyParallelValidatedOnce


def _trivial(group: Any) -> bool:
    """One rank in ``group``, as megatron-core decides that nothing is distributed (its own size of a group)."""
    from megatron.core.utils import get_pg_size

    return get_pg_size(group=group) <= 1


def order_optimizer_steps(base: type | None = None) -> list[str]:
    """Wrap ``step`` of ``base`` (default: megatron-core's ``MegatronOptimizer``) and of every subclass
    defining one, so each step first calls :func:`.strategy.order_pending_saves`; returns the classes' names.

    A step that calls another wrapped step (``ChainedOptimizer``) orders once: the pending list is
    emptied by the first. Classes defined after this call are covered through a wrapped base's
    ``step`` only if they do not define their own.
    """

    from . import strategy
    from .prepare import wrap_optimizer_steps

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            strategy.order_pending_saves()  # a GPU-side wait: the host does not block
            return original(self, *args, **kwargs)

        return step

    names = wrap_optimizer_steps("_cpuckpt_ordered", make, base)
    strategy._STEPS_ORDERED = True
    logger.info("cpuckpt: optimizer steps wait for pending checkpoint copies: %s", ", ".join(sorted(names)))
    return names


def _route_to_memory_tier(run: Training, module: Any) -> None:
    """Non-persistent pruning becomes the ring's (:meth:`.memory.MegatronMemory.cleanup`), and the end of
    training (``maybe_finalize_async_save(terminate=True)``) closes the tier (writers stop, RAM root goes)."""
    original_cleanup = module.cleanup_old_non_persistent_checkpoint

    def cleanup_old_non_persistent_checkpoint(save_dir: Any, leave_ckpt_num: int = 1, do_async: bool = False) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if not run.memory().cleanup(save_dir):
            original_cleanup(save_dir, leave_ckpt_num=leave_ckpt_num, do_async=do_async)

    module.cleanup_old_non_persistent_checkpoint = cleanup_old_non_persistent_checkpoint
    from .memory import restart_before_load

    restart_before_load(module, run.memory)  # across nodes, the trackers every rank reads agree first

    import megatron.training.async_utils as async_utils

    original_finalize = async_utils.maybe_finalize_async_save
    if getattr(original_finalize, "_cpuckpt_memory", None) is not None:
        original_finalize._cpuckpt_memory = run  # type: ignore[attr-defined]  # a later run's tier closes
        return

    @functools.wraps(original_finalize)
    def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
        original_finalize(blocking=blocking, terminate=terminate)
        if terminate:
            maybe_finalize_async_save._cpuckpt_memory.end_of_training(_megatron_lm_args())  # type: ignore[attr-defined]

    maybe_finalize_async_save._cpuckpt_memory = run  # type: ignore[attr-defined]
    replace_function(async_utils, "maybe_finalize_async_save", original_finalize, maybe_finalize_async_save)


def _megatron_lm_args() -> Any:
    from megatron.training import get_args

    return get_args()


def _reserve_slots_after_setup(run: Training, module: Any = None, args_of: Callable[[], Any] = _megatron_lm_args
                               ) -> None:
    """When Megatron-LM's ``setup_model_and_optimizer`` returns (every rank, before the first iteration), make the
    tier and reserve, map and pin each free slot's image for the shard the optimizer's state makes
    (:meth:`cpuckpt.MemoryTier.reserve`, sized by :func:`.prepare.shard_nbytes_estimate`): otherwise the first
    saves pay it while the job trains (~1-1.8 s per 5 GB slot on the H200, on the trainer's thread). With
    persistent saves coming (``--save-interval``) the rank's writer process starts then too. Only for a run that
    saves asynchronously (sync saves do not use the tier); ``module``: ``megatron.training.training``."""

    found = _megatron_setup(module, "the memory tier's slots are made by the first saves")
    if found is None:
        return
    module, original = found
    installed = _wrapper_with(original, "_cpuckpt_run")
    if installed is not None:
        installed._cpuckpt_run = run  # a later install's run reserves
        return

    @functools.wraps(original, updated=())
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        margs = args_of()  # the same on every rank: every rank makes the tier below, or none does
        np_global = bool(getattr(margs, "non_persistent_save_interval", None)) and \
            getattr(margs, "non_persistent_ckpt_type", "global") == "global"
        routed = getattr(margs, "async_save", False) and getattr(margs, "save", None) and \
            (getattr(margs, "save_interval", None) or np_global)
        if not routed or result[1] is None:  # no save reaches the tier (sync saves, local ones, --skip-train)
            return result
        from .prepare import shard_nbytes_estimate

        try:
            nbytes = shard_nbytes_estimate(result[1], _replicated_share(margs))
        except Exception:  # an optimizer this does not understand: the first saves make the images
            logger.warning("cpuckpt: could not size the memory tier's slots from the optimizer", exc_info=True)
            nbytes = 0
        tier = setup_model_and_optimizer._cpuckpt_run.memory().tier  # type: ignore[attr-defined]  # collective
        if getattr(margs, "save_interval", None):  # persistent saves come: the writer starts now (its interpreter
            try:  # beside the reservation's pins), not in the first persist
                tier.start_writer()
            except Exception:  # the first persist starts it (and every rank agrees on a failure there)
                logger.warning("cpuckpt memory tier: starting the writer before training failed", exc_info=True)
        try:  # this rank's own files only: a failure here is a warning (the saves make the images then)
            made = tier.reserve(nbytes)
        except Exception:
            logger.warning("cpuckpt memory tier: reserving the slots before training failed", exc_info=True)
            made = 0
        logger.info("cpuckpt memory tier: %d slot image(s) of %d bytes reserved before training", made, nbytes)
        return result

    setup_model_and_optimizer._cpuckpt_run = run  # type: ignore[attr-defined]
    module.setup_model_and_optimizer = setup_model_and_optimizer


def _megatron_setup(module: Any, otherwise: str) -> tuple[Any, Any] | None:
    """``module`` (default ``megatron.training.training``) and its ``setup_model_and_optimizer``, for a wrapper of it;
    None, with a warning ending in ``otherwise``, where there is none."""
    if module is None:
        try:
            import megatron.training.training as module
        except ImportError as e:
            logger.warning("cpuckpt: megatron.training.training not importable (%s): %s", e, otherwise)
            return None
    original = getattr(module, "setup_model_and_optimizer", None)
    if original is None:
        logger.warning("cpuckpt: Megatron-LM has no setup_model_and_optimizer: %s", otherwise)
        return None
    return module, original


def _wrapper_with(fn: Any, attr: str) -> Any:
    """The function in ``fn``'s chain of wrappers (``__wrapped__``) that carries ``attr``: each of the hook's wrappers
    of one Megatron-LM function is found, and installed, once."""
    seen = 0
    while fn is not None and seen < 32:
        if attr in getattr(fn, "__dict__", {}):
            return fn
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def _replicated_share(margs: Any) -> float:
    """The part of the state replicated across data-parallel ranks that this rank saves: ``1 / DP`` with a fully
    parallel save (``--ckpt-fully-parallel-save``), else all of it on the first data-parallel rank (the main
    replica, ``keep_only_main_replica``) and none on the others; 1 where Megatron's groups are not set up."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1.0
    if getattr(margs, "ckpt_fully_parallel_save", False):
        return 1.0 / max(1, parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return 1.0 if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0 else 0.0


def _megatron_lm_queue() -> Any:
    """Megatron-LM's async save queue (``megatron.training.async_utils._async_calls_queue``), or None."""
    try:
        from megatron.training import async_utils
    except ImportError:
        return None
    return getattr(async_utils, "_async_calls_queue", None)


def _finalize_before_cleanup(module: Any, queue_of: Any = _megatron_lm_queue,
                             memory_of: Callable[[], MegatronMemory] | None = None) -> None:
    """Before ``cleanup_old_non_persistent_checkpoint`` removes older non-persistent directories, every rank
    finalizes every pending save into that directory (:func:`.guard.finalize_saves_under` with ``keep=0``; one
    blocking finalize per non-persistent save, mostly of a save that ended long before), and the cleanup then keeps
    at least the directory the tracker names (:func:`_leave_tracked`). Megatron-LM removes all but the newest
    ``leave_ckpt_num`` directories on disk without asking (its own TODO there): a save finalized after its directory
    went fails with ``metadata.json`` not found, and the directory the tracker names (the newest *finalized* save) is
    not the newest one on disk while a save is pending, so a crash after the removal left a tracker naming a missing
    checkpoint. Finalizing every pending save moves the tracker to the newest directory, the one Megatron-LM keeps;
    where it cannot (a save failed with ``on_failure: continue``, a newer directory left by a crash), the tracker's
    directory and every newer one stay until the tracker moves on. A directory the memory tier's ring prunes
    (``memory_of``) is left alone here: the ring reuses slots, not directories, and the strategy finalizes before
    every save into it only what that save refills (:meth:`.memory.MegatronMemory.finalize_before_reuse`), so saves
    every iteration overlap each other, each in its own slot, instead of each waiting for the one before."""

    original = getattr(module, "cleanup_old_non_persistent_checkpoint", None)
    if original is None or getattr(original, "_cpuckpt_finalizing", False):
        return

    @functools.wraps(original)
    def cleanup_old_non_persistent_checkpoint(save_dir: Any, leave_ckpt_num: int = 1, do_async: bool = False) -> None:
        from .guard import finalize_saves_under

        memory = memory_of() if memory_of is not None else None
        if memory is None or not memory.prunes(save_dir):
            finalize_saves_under(queue_of(), save_dir, 0)  # the tracker moves to the newest directory
            leave_ckpt_num = _leave_tracked(save_dir, leave_ckpt_num)
        original(save_dir, leave_ckpt_num=leave_ckpt_num, do_async=do_async)

    cleanup_old_non_persistent_checkpoint._cpuckpt_finalizing = True  # type: ignore[attr-defined]
    module.cleanup_old_non_persistent_checkpoint = cleanup_old_non_persistent_checkpoint


def _leave_tracked(save_dir: Any, leave_ckpt_num: int) -> int:
    """``leave_ckpt_num``, raised so that Megatron-LM's cleanup of ``save_dir`` (which sorts its ``iter_*`` entries,
    found recursively, by iteration and removes all but the last ``leave_ckpt_num``) keeps the directory that
    ``save_dir``'s tracker names: the count of entries no older than it. Unchanged on ranks other than 0 (Megatron-LM
    removes on rank 0 only), where there is no tracker, it names no iteration, or an entry is not ``iter_<int>``."""
    import torch.distributed as dist

    from .fallback import TRACKER

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return leave_ckpt_num  # Megatron-LM removes on rank 0 only
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            tracked = int(f.read().strip())
        found = [int(p.name[len("iter_"):]) for p in Path(save_dir).rglob("iter_*")]
    except (OSError, ValueError):
        return leave_ckpt_num
    newer = sum(1 for iteration in found if iteration >= tracked)
    if newer > leave_ckpt_num:
        logger.warning("cpuckpt: %s's tracker names iteration %d, not its newest directory: Megatron-LM's cleanup "
                       "keeps the newest %d there instead of %d (a crash must find what the tracker names)",
                       save_dir, tracked, newer, leave_ckpt_num)
    return max(leave_ckpt_num, newer)


def _megatron_lm_log_interval() -> int | None:
    """Megatron-LM's ``--log-interval``, or None (no Megatron-LM arguments parsed)."""
    try:
        from megatron.training.global_vars import get_args

        return getattr(get_args(), "log_interval", None)
    except (ImportError, AssertionError):  # no such module; not set up (get_args asserts)
        return None


def finalize_before_log(module: Any = None, queue_of: Callable[[], Any] = _megatron_lm_queue,
                        log_interval_of: Callable[[], int | None] = _megatron_lm_log_interval) -> bool:
    """Make Megatron-LM's ``training_log`` (``module``: ``megatron.training.training``) first finalize the memory
    saves that have ended and wait for the urgent ones (:func:`.guard.finalize_before_log`), so that the tracker names
    iteration N before N + 1 is logged (with ``memory.max_uncommitted: 1``: always; with a log interval above one,
    before every line Megatron-LM prints, ``iteration % log_interval == 0``; otherwise where the commit of N ended by
    then); returns whether it wrapped it. So a job killed after a printed line restarts from at most one iteration
    before it, at the cost of one commit's rest per printed line (with ``--log-interval 1`` that is every iteration:
    ``max_uncommitted: 1`` asks for it there). Every rank calls ``training_log`` once per iteration, after the step
    and before that iteration's regular save (a collective point: the look all-reduces on cpuckpt's gloo group).
    Before, the tops of iterations were the only looks: the save of N was finalized at the top of N + 2, or, urgent,
    the top of N + 1 waited for its whole commit (with ``ordering: optimizer``, for all of its copies)."""
    import inspect

    from .guard import finalize_before_log as look

    if module is None:
        try:
            import megatron.training.training as module
        except ImportError:
            return False
    original = getattr(module, "training_log", None)
    if original is None:
        logger.warning("cpuckpt: %s has no training_log(): memory saves are finalized at the tops of iterations only "
                       "(one iteration later)", getattr(module, "__name__", module))
        return False
    if getattr(original, "_cpuckpt_looks", False):
        return True

    try:
        at = list(inspect.signature(original).parameters).index("iteration")
    except (TypeError, ValueError):
        at = None  # no iteration argument to read: no line counts as printed
        logger.warning("cpuckpt: %s's training_log() has no iteration parameter: the look before a printed log line "
                       "does not wait for the memory saves' commits (max_uncommitted: 1 still does)",
                       getattr(module, "__name__", module))

    def printed(args: tuple, kwargs: dict[str, Any]) -> bool:  # the same on every rank: one iteration, one interval
        iteration = kwargs.get("iteration", args[at] if at is not None and at < len(args) else None)
        interval = log_interval_of()
        return type(iteration) is int and type(interval) is int and interval > 1 and iteration % interval == 0

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        queue = queue_of()
        if queue is not None:
            look(queue, printed=printed(args, kwargs))
        return original(*args, **kwargs)

    training_log._cpuckpt_looks = True  # type: ignore[attr-defined]
    replace_function(module, "training_log", original, training_log)
    return True


_QUEUE_BUILDERS = ("_get_async_calls_queue", "init_persistent_async_worker")


def watch_megatron_lm_queue(timeout_s: float, options: MegatronOptions, module: Any = None,
                            importers: list[Any] | None = None) -> list[str]:
    """Wrap the functions of ``megatron.training.async_utils`` that build its async save queue so
    that every queue they build is watched (:func:`.guard.watch_async_queue`); returns their names.

    ``module`` stands for ``megatron.training.async_utils``; ``importers`` are the modules that may
    hold the original functions under the same name (default: every loaded ``megatron.*``).
    """
    if module is None:
        try:
            import megatron.training.async_utils as module
        except ImportError as e:
            logger.warning("cpuckpt: megatron.training.async_utils not importable (%s): Megatron-LM's async "
                           "save queue is not watched; a dead checkpoint worker may hang the job", e)
            return []
    wrapped: list[str] = []
    for name in _QUEUE_BUILDERS:
        fn = getattr(module, name, None)
        if fn is None:
            logger.warning("cpuckpt: %s has no %s(): queues it would build are not watched (a dead checkpoint "
                           "worker may hang the job); this Megatron-LM is newer or older than cpuckpt knows",
                           getattr(module, "__name__", module), name)
            continue
        if not getattr(fn, "_cpuckpt_watching", False):
            replace_function(module, name, fn, _watching(fn, module, timeout_s, options), importers)
        wrapped.append(name)
    return wrapped


def _watching(fn: Any, module: Any, timeout_s: float, options: MegatronOptions) -> Any:

    from .guard import watch_async_queue

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        queue = result if hasattr(result, "maybe_finalize_async_calls") else getattr(module, "_async_calls_queue", None)
        if queue is not None:
            watch_async_queue(queue, timeout_s, config=options)  # a no-op for a queue already watched
        return result

    wrapper._cpuckpt_watching = True  # type: ignore[attr-defined]
    return wrapper


def _training_classes(cfg: Config, options: MegatronOptions, run: Training | None = None) -> tuple[type, type]:
    run = run if run is not None else Training(cfg)
    from .strategy import CpuckptLoadStrategy, CpuckptSaveStrategy

    class MegatronLMSaveStrategy(CpuckptSaveStrategy):
        """Built by Megatron-LM as ``TorchDistSaveShardedStrategy(cpu_shm_mode=...)``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # cpu_shm_mode (NVRx's worker-side staging) has no meaning here: staging is ours.
            super().__init__(cfg, reuse_plan=options.reuse_plan, memory=run.memory() if options.memory_tier else None,
                             ordering=options.ordering, checkpointer=run.checkpointer, reuse=run.reuse)

    class MegatronLMLoadStrategy(CpuckptLoadStrategy):
        """Built by Megatron-LM as ``TorchDistLoadShardedStrategy(cache_metadata=..., ...)``."""

        def __init__(self, *args: Any, cache_metadata: bool = False, stream_ckpt_dequant: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(cfg)
            self.cache_metadata = cache_metadata
            self.stream_ckpt_dequant = stream_ckpt_dequant

        def load(self, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
            from .fallback import _LOADING

            _LOADING[0] = str(checkpoint_dir)  # the directory a fallback (fallback.py) moves away from
            return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    return MegatronLMSaveStrategy, MegatronLMLoadStrategy
