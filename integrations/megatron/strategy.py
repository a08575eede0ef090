"""megatron-core ``dist_checkpointing`` strategies that save and load through cpuckpt.

They subclass megatron-core's torch_dist strategies (megatron-core 0.19's ``save()`` replaces any
strategy that is not one), reuse its translation of Megatron ``ShardedTensor``s into PyTorch
``ShardedTensor``s (``mcore_to_pyt_state_dict``) and its DCP planners, and swap only the storage
layer: :func:`cpuckpt.save` / :func:`cpuckpt.async_save` / :class:`cpuckpt.StorageReader`. The
files are ordinary torch_dist (DCP) files and ``metadata.json`` names backend ``torch_dist``, so
stock megatron-core loads them without cpuckpt.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
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
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CpuckptError

from . import compat
from .worker import OK, new_channel, wait_for_commit

__all__ = ["CpuckptLoadStrategy", "CpuckptSaveStrategy"]

logger = logging.getLogger(__name__)


class CpuckptSaveStrategy(TorchDistSaveShardedStrategy):
    """Save strategy: Megatron sharded state dict -> DCP plan -> cpuckpt pipeline.

    ``async_save`` returns once this rank's tensors are in cpuckpt's host pool (the stall is the
    planning plus the device-to-host copy); cpuckpt's threads write and commit in the background,
    and the returned ``AsyncRequest``'s worker function only waits for that commit (see
    :mod:`.worker`). Its finalize function raises the save's error, if any, on every rank.

    Args:
        config: cpuckpt settings (a :class:`cpuckpt.Config`, a YAML path, a dict or None).
        keep_only_main_replica: as for megatron-core's ``TorchDistSaveShardedStrategy``.
    """

    def __init__(self, config: Config | str | os.PathLike | dict | None = None, *,
                 keep_only_main_replica: bool = True) -> None:
        super().__init__(backend="torch_dist", version=1, keep_only_main_replica=keep_only_main_replica)
        self.config = resolve_config(config)

    def _to_pyt(self, sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        return mcore_to_pyt_state_dict(sharded, False)

    def _planner(self) -> MCoreSavePlanner:
        return MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False,
                                flatten_sharded_tensors=False)

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        """Synchronous save: streams through a bounded pool; durable and committed on return."""
        cpuckpt.save(self._to_pyt(sharded_state_dict), checkpoint_dir, self.config, planner=self._planner())

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path,
                   async_strategy: str = "mcore") -> Any:
        """Plan, stage into the host pool, start writing; return Megatron's ``AsyncRequest``."""
        handle = cpuckpt.async_save(self._to_pyt(sharded_state_dict), checkpoint_dir, self.config,
                                    planner=self._planner())
        rank = dist.get_rank() if dist.is_initialized() else 0
        channel = new_channel(rank)
        handle.add_done_callback(lambda error: channel.post_status(None if error is None else str(error)))
        try:
            handle.staged.wait()  # after this the trainer may change any saved tensor
        except BaseException:
            channel.remove()  # the save fails on (handle.wait raises it at the next async_save/wait_all)
            raise
        timeout_s = self.config.timeout_s
        group = checkpoint_group(None, timeout_s)

        def finalize_fn() -> None:
            try:
                # The channel only says whether this rank's worker process did its part.
                report = channel.take_report()
                worker_error = None if report == OK else CpuckptError(
                    report or f"the checkpoint worker process of rank {rank} ended without reporting (killed?)")
                reports = gather_failures(worker_error, rank, group)
                # The save's own outcome: the error its committer built from every rank's
                # FailureReport (same class and message on every rank; StorageIOError with
                # errno/path/rank for an OSError), chained to this rank's original.
                handle.wait(timeout_s)
                raise_if_failed(reports, f"async save of {checkpoint_dir}", worker_error)
            finally:
                channel.remove()

        try:
            return compat.make_async_request(async_strategy, wait_for_commit,
                                             (channel.base, rank, 2 * timeout_s + 60, os.getpid(),
                                              faultpoint.get_handler()), [finalize_fn])
        except BaseException:
            # e.g. async_strategy "nvrx" without nvidia-resiliency-ext: the save goes on in cpuckpt's
            # threads (its outcome reaches cpuckpt.wait_all / the next async_save), but no caller will
            # ever read the channel.
            channel.remove()
            raise


class CpuckptLoadStrategy(TorchDistLoadShardedStrategy):
    """Load strategy: reads torch_dist checkpoints (ours or stock) with :class:`cpuckpt.StorageReader`.

    Resharding works as in megatron-core: DCP plans the reads from the requested shards. The load is
    collective (every rank of the default group calls it, as Megatron-LM does); megatron-core 0.19's
    own torch_dist load reads with ``no_dist=True`` instead.
    """

    def __init__(self, config: Config | str | os.PathLike | dict | None = None) -> None:
        super().__init__()
        self.config = resolve_config(config)

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path, *args: Any,
             **kwargs: Any) -> dict[str, Any]:
        flexible = [t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, True)
        planner = MCoreLoadPlanner(**compat.load_planner_kwargs(self, flexible, mismatch))
        cpuckpt.load(pyt_state_dict, checkpoint_dir, self.config, planner=planner)
        if getattr(self, "cache_metadata", True):  # megatron-core <= 0.16 always caches it
            self.cached_global_metadata = cpuckpt.StorageReader(checkpoint_dir, self.config).read_metadata()
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return state

