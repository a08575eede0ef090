"""The one seam between megatron-core versions (0.16 on Python 3.11, 0.19 on Python 3.12).

0.16 has ``AsyncRequest`` in ``strategies.async_utils`` and calls ``async_save(sd, dir)``; 0.19 picks the
request class by ``async_strategy`` ("mcore" or "nvrx", via ``get_async_strategy``), calls
``async_save(sd, dir, async_strategy)``, and its ``MCoreLoadPlanner`` takes streaming-dequant and
flattening arguments that 0.16's does not.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["load_planner_kwargs", "make_async_request", "mcore_async_kwargs", "megatron_core_version"]


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


def make_async_request(async_strategy: str, fn: Callable[..., None], args: tuple,
                       finalize_fns: list[Callable[[], None]]) -> Any:
    """An ``AsyncRequest`` of the class the caller's ``AsyncCallsQueue`` expects."""
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
