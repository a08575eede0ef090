"""Megatron adapter: megatron-core ``dist_checkpointing`` strategies on the cpuckpt pipeline.

With megatron-core directly::

    from megatron.core import dist_checkpointing
    import cpuckpt.integrations.megatron as ckpt_mg

    strategy = ckpt_mg.save_strategy("configs/megatron.yaml")
    request = dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=strategy,
                                      async_sharded_save=True, async_strategy="mcore")  # (0.17+: "mcore")
    # a dead checkpoint worker raises on every rank (megatron: {on_failure: continue}: logged, replaced)
    async_queue = ckpt_mg.watch_async_queue(AsyncCallsQueue(persistent=True), config="configs/megatron.yaml")
    async_queue.schedule_async_request(request)        # temporal or persistent caller
    ...
    state = dist_checkpointing.load(sharded_sd, ckpt_dir, sharded_strategy=ckpt_mg.load_strategy())
    # restart: the newest complete iter_* of a root; a damaged one (crc32c) falls back to the next newest
    loaded = ckpt_mg.load_latest(sharded_sd, root, "configs/megatron.yaml")  # None: nothing saved yet

With Megatron-LM's training scripts, ``--ckpt-format cpuckpt [--cpuckpt-config PATH.yaml]`` after
either ``python -m cpuckpt.integrations.megatron.launch pretrain_gpt.py ...`` or one line at the top
of the script: ``import cpuckpt.integrations.megatron as m; m.install()`` (see :mod:`.hook`).

Checkpoints are torch_dist checkpoints (``metadata.json`` names backend ``torch_dist``): stock
megatron-core loads them without cpuckpt, and :func:`load_strategy` reads stock ones.

Importing this package does not import megatron-core; the strategies load on first use.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CpuckptLoadStrategy", "CpuckptSaveStrategy", "MegatronOptions", "WorkerDiedError", "install",
           "load_latest", "load_strategy", "save_strategy", "watch_async_queue"]


def save_strategy(config: Any = None, *, fully_parallel: bool = False, parallelization_group: Any = None,
                  keep_only_main_replica: bool = True) -> Any:
    """A cpuckpt save strategy; ``fully_parallel`` wraps it in megatron-core's
    ``FullyParallelSaveStrategyWrapper`` (the save work spread over ``parallelization_group``)."""
    from .strategy import CpuckptSaveStrategy

    strategy = CpuckptSaveStrategy(config, keep_only_main_replica=keep_only_main_replica)
    if not fully_parallel:
        return strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(strategy, parallelization_group)


def load_strategy(config: Any = None) -> Any:
    """A cpuckpt load strategy (reads cpuckpt and stock torch_dist checkpoints)."""
    from .strategy import CpuckptLoadStrategy

    return CpuckptLoadStrategy(config)


def load_latest(sharded_state_dict: Any, root: str | os.PathLike, config: Any = None, **kwargs: Any) -> Any:
    """``dist_checkpointing.load`` of the newest complete ``iter_*`` under ``root``, falling back past
    damage on every rank together; returns a :class:`.fallback.LatestLoad` or None
    (:func:`.fallback.load_latest`)."""
    from .fallback import load_latest as _load_latest

    return _load_latest(sharded_state_dict, root, config, **kwargs)


def install(config: str | os.PathLike | None = None) -> None:
    """Make ``--ckpt-format cpuckpt`` work in Megatron-LM's training scripts (see :mod:`.hook`)."""
    from .hook import install as _install

    _install(config)


def __getattr__(name: str) -> Any:
    if name in ("CpuckptSaveStrategy", "CpuckptLoadStrategy"):
        from . import strategy

        return getattr(strategy, name)
    if name in ("watch_async_queue", "WorkerDiedError"):
        from . import guard

        return getattr(guard, name)
    if name == "MegatronOptions":
        from .settings import MegatronOptions

        return MegatronOptions
    raise AttributeError(name)
