"""Host-to-host byte copies for the pipeline's worker threads: one ``memmove`` each, no intra-op team.

``torch``'s CPU ``copy_`` splits a large copy over its OpenMP intra-op threads, and every Python thread
that calls it becomes the master of a team of its own: 16 read threads copying at once run 16 teams
of (cores - 1) spinning workers on the same cores. The pipeline already copies on many threads, so
each of its copies runs as one ``memmove`` (``ctypes`` releases the GIL for it) instead.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["copy_host_bytes"]


def copy_host_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors of the same dtype and size, on the calling thread only.

    Contiguous tensors of one shape and dtype are copied by one ``memmove``; anything else (strided views,
    other dtypes, shapes or devices, lazily conjugated or negated views) falls back to ``copy_``.
    """
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and not src.is_conj() and not src.is_neg()):
        nbytes = dst.numel() * dst.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    dst.copy_(src)
