"""Byte sizes of tensors known by dtype and shape only (DCP metadata, record skeletons). Pure.

The element size itself is torch's ``dtype.itemsize`` (no tensor needs to be made for it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["tensor_nbytes"]


def tensor_nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    return math.prod(int(s) for s in shape) * dtype.itemsize
