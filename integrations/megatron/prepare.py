"""First save = warm save: the host pool is reserved in the background once the optimizer state exists
(the memory tier's slots, before the first iteration: :func:`shard_nbytes_estimate`).

A fresh process's first async save would otherwise allocate, touch and pin a pool as large as the
rank's shard inside the save (4.8 s for 13 GB on the H200). Megatron builds its sharded state dict
only when it saves, but what that dict holds is already known after the first optimizer step:
the model's parameters and buffers, the optimizer's main (fp32) parameters and its state (Adam's
moments exist only after that step). :class:`PoolPreparer` sums those tensors' bytes once, after
the first step of any wrapped ``megatron.core.optimizer`` class (:func:`prepare_after_first_step`),
and calls :func:`cpuckpt.prepare_pool_in_background`. A save that arrives while the pool is being
made waits for the rest of it (:func:`wait_prepared`), not for a second pool.

The sum over-estimates on purpose (model parameters replicated over data-parallel ranks are
counted on every rank, though Megatron saves each once; records and alignment add a little): a
pool that is too small is replaced by a new one at the first save, which costs the whole
allocation again. Only snapshot-mode saves (the default, ``staging.pool_bytes: 0``) use such a
pool; with ``staging.pool_bytes`` set the pool is that size and is prepared as such.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cpuckpt.api import PoolPreparation, prepare_pool_in_background
from cpuckpt.config import Config
from cpuckpt.transfer.save_job import choose_mode

__all__ = ["PoolPreparer", "pool_nbytes", "prepare_after_first_step", "shard_nbytes_estimate", "state_nbytes",
           "stop_preparing", "wait_prepared", "wrap_optimizer_steps"]

logger = logging.getLogger(__name__)

SLACK = 1.02  # on top of the tensors' bytes: records, alignment, small objects


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Tensors directly in ``obj`` or one level of dict/list/tuple inside it (optimizer state values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                yield v
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, torch.Tensor):
                yield v


def _state_parts(optimizer: Any) -> tuple[int, int, int]:
    """(model bytes, optimizer bytes, missing Adam moments' bytes) of a megatron-core optimizer, each storage
    range once (model first): see :func:`state_nbytes` and :func:`shard_nbytes_estimate`."""
    seen: set[tuple[int, int]] = set()
    parts = [0, 0, 0]

    def add(t: Any, part: int) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in seen:
            seen.add(key)
            parts[part] += key[1]

    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        chunks = getattr(opt, "model_chunks", None) or []
        for chunk in chunks:
            for p in chunk.parameters():
                add(p, 0)
            for b in chunk.buffers():
                add(b, 0)
        if not chunks:
            for groups in (getattr(opt, "float16_groups", None), getattr(opt, "fp32_from_fp32_groups", None)):
                for group in groups or []:
                    for p in group:
                        add(p, 0)
        inner = getattr(opt, "optimizer", None)
        if inner is not None and hasattr(inner, "param_groups"):
            state = getattr(inner, "state", {})
            adam = "adam" in type(inner).__name__.lower()
            for group in inner.param_groups:
                for p in group["params"]:
                    add(p, 1)
                    if adam and isinstance(p, torch.Tensor) and not state.get(p):
                        parts[2] += 2 * p.numel() * p.element_size()
            for st in state.values():
                for t in _tensors(st):
                    add(t, 1)
    return parts[0], parts[1], parts[2]


def state_nbytes(optimizer: Any) -> int:
    """Bytes of what a Megatron checkpoint of this rank holds, from a megatron-core optimizer.

    Counts each storage range once: the model chunks' parameters and buffers (``model_chunks``, or
    the float16/fp32 parameter groups of optimizers without them), and per inner torch optimizer
    its parameter groups (the main parameters) and its state tensors.
    """
    model, optim, _ = _state_parts(optimizer)
    return model + optim


def shard_nbytes_estimate(optimizer: Any, replicated_share: float = 1.0) -> int:
    """What a checkpoint of this rank will hold, already before the first optimizer step: :func:`state_nbytes`
    plus, for each parameter of an Adam-type inner optimizer (its class name says Adam) that has no state yet,
    the two moments its first step makes in the parameter's dtype; times :data:`SLACK`. Other optimizers'
    missing state is not guessed (an under-estimate costs the first save into the first slot a second mapping,
    and the preparation after it sizes the others). ``replicated_share``: the part of what is replicated across
    data-parallel ranks that this rank writes (``1 / DP`` with a fully parallel save): the model's tensors, and
    the optimizer's too unless a distributed optimizer shards them."""
    model, optim, moments = _state_parts(optimizer)
    sharded = any("Distributed" in type(opt).__name__
                  for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer])
    optim_share = 1.0 if sharded else replicated_share
    return int((model * replicated_share + (optim + moments) * optim_share) * SLACK)


def pool_nbytes(cfg: Config, shard_nbytes: int) -> int:
    """The pool async saves of a ``shard_nbytes`` shard use: the shard per save in flight (snapshot
    mode), or the configured bounded pool (streaming)."""
    in_flight = cfg.async_.max_in_flight
    if choose_mode(cfg, shard_nbytes, in_flight=in_flight) == "snapshot":
        return shard_nbytes * in_flight
    return max(cfg.staging.pool_bytes, 2 * cfg.io.threads * cfg.io.chunk_bytes)


def _async_saves() -> bool:
    """Whether Megatron-LM runs with ``--async-save`` (True where its arguments are not known)."""
    try:
        from megatron.training.global_vars import get_args

        return bool(getattr(get_args(), "async_save", True))
    except Exception:  # megatron-core alone, or arguments not parsed: assume async saves
        return True


class PoolPreparer:
    """Reserves the host pool once, in the background, sized by :func:`state_nbytes` (see the module).

    ``preparation`` is the running or finished :class:`cpuckpt.api.PoolPreparation` (None: none started).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.nbytes = 0
        self.preparation: PoolPreparation | None = None
        self._started = False
        self._lock = threading.Lock()

    def after_step(self, optimizer: Any) -> None:
        """Start the reservation after the first optimizer step (later calls do nothing)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        if not _async_saves():
            return  # sync saves stream through a bounded pool: a shard-sized one would only hold memory
        try:
            self.nbytes = pool_nbytes(self.cfg, int(state_nbytes(optimizer) * SLACK))
        except Exception:  # an optimizer this does not understand: the first save makes the pool itself
            logger.warning("cpuckpt: could not size the host pool from the optimizer; the first save makes it",
                           exc_info=True)
            return
        if self.nbytes:
            self.preparation = prepare_pool_in_background(self.nbytes, self.cfg)


_DEPTH = threading.local()  # wrapped steps in progress on this thread (ChainedOptimizer nests them)
# Per process, as the pool it prepares is (cpuckpt.transfer.staging's one pinned pool) and as the wrapped
# optimizer classes are: the last install's preparer is the one their steps call. Must not prepare a
# pool a save then holds (saves call wait_prepared first).
_PREPARER: PoolPreparer | None = None


def wrap_optimizer_steps(marker: str, make: Callable[[Any], Any], base: type | None = None) -> list[str]:
    """Replace ``step`` of ``base`` (default: megatron-core's ``MegatronOptimizer``) and of every subclass
    defining one by ``make(step)``, once per class (a step carrying ``marker`` is left as it is); returns
    the classes' names. Classes defined later are covered through a wrapped base only if they do not
    define their own ``step``."""
    if base is None:
        import megatron.core.optimizer  # noqa: F401  # defines the subclasses (distributed, fp16, chained)
        from megatron.core.optimizer.optimizer import MegatronOptimizer as base

    classes: list[type] = []
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.append(cls)
            todo.extend(cls.__subclasses__())
    names: list[str] = []
    for cls in classes:
        fn = cls.__dict__.get("step")
        if fn is None:
            continue
        names.append(cls.__qualname__)
        if not getattr(fn, marker, False):
            wrapped = make(fn)
            setattr(wrapped, marker, True)
            cls.step = wrapped  # type: ignore[attr-defined]
    return names


def wait_prepared(timeout: float | None = None) -> None:
    """Let a preparation in progress finish before a save takes the pool (a save must never hold a pool
    that the preparation then replaces). A no-op when nothing is being prepared."""
    preparation = _PREPARER.preparation if _PREPARER is not None else None
    if preparation is not None and not preparation.done:
        logger.info("cpuckpt: save waited %.3f s for the host pool's preparation", preparation.join(timeout))


def stop_preparing() -> None:
    """The wrapped steps call no preparer any more (a run ended; a later one installs its own)."""
    global _PREPARER
    _PREPARER = None


def prepare_after_first_step(preparer: PoolPreparer, base: type | None = None) -> list[str]:
    """Wrap the optimizer classes' ``step`` (:func:`wrap_optimizer_steps`) so the outermost step, once
    done, calls ``preparer.after_step(optimizer)``; a later call only replaces the preparer."""
    global _PREPARER
    _PREPARER = preparer

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth = getattr(_DEPTH, "n", 0)
            _DEPTH.n = depth + 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                _DEPTH.n = depth
            if depth == 0 and _PREPARER is not None:
                _PREPARER.after_step(self)
            return result

        return step

    names = wrap_optimizer_steps("_cpuckpt_prepares", make, base)
    logger.info("cpuckpt: the host pool is prepared after the first optimizer step (%s)", ", ".join(sorted(names)))
    return names
