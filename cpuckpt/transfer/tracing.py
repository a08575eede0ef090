"""NVTX ranges around staging, writes and loads: named spans in Nsight traces, a no-op without CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["nvtx_range"]


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range named ``name`` around the block when CUDA is available (visible in Nsight
    Systems); otherwise does nothing and costs next to nothing.

    Example:
        >>> with nvtx_range("cpuckpt.stage"):
        ...     copy_chunks()
    """
    if not _cuda_available():
        yield
        return
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


_CUDA: bool | None = None  # per process: whether CUDA (NVTX) is there does not change


def _cuda_available() -> bool:
    # Cached: torch.cuda.is_available() costs microseconds per call, ranges may be per chunk.
    global _CUDA
    if _CUDA is None:
        try:
            import torch

            _CUDA = bool(torch.cuda.is_available())
        except ImportError:  # pragma: no cover - torch is a dependency
            _CUDA = False
    return _CUDA
