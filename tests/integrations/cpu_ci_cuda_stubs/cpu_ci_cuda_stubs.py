"""torch.cuda stubs that exist ONLY because CI has no GPU (test fixture, never shipped).

megatron-core's async save machinery calls four torch.cuda functions even on a gloo/CPU job:
``synchronize`` (before forking the temporal caller), ``current_device`` (the device of the tensor it
all-reduces to check completion), ``set_device`` and ``device_count`` (at the start of the spawned
persistent worker). Without a GPU these raise. The stubs make them CPU no-ops; with a GPU nothing is
patched, so the same tests run unstubbed on the device.
"""

from __future__ import annotations


def install() -> bool:
    """Patch torch.cuda when no GPU is present; returns whether it patched."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
    return True
