"""torch.cuda stubs that exist ONLY because CI has no GPU (test fixture, never shipped).

megatron-core's async save machinery calls four torch.cuda functions even on a gloo/CPU job:
``synchronize`` (before forking the temporal caller), ``current_device`` (the device of the tensor it
all-reduces to check completion), ``set_device`` and ``device_count`` (at the start of the spawned
persistent worker). Without a GPU these raise. The stubs make them CPU no-ops; with a GPU nothing is
patched, so the same tests run unstubbed on the device.
"""

from __future__ import annotations

import sys


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


class _AfterTorch:
    """A meta-path finder that runs :func:`install` right after ``torch``'s module is executed (then leaves). A spec
    asked for without an import (``importlib.util.find_spec("torch")``) is never executed: the finder stays for the
    import that comes."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)  # the real spec, found by the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            run(module)
            install()

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def install_when_imported() -> None:
    """:func:`install` once ``torch`` is imported, in a process that ever imports it: a process that never does
    (a memory-tier writer, ``python -m cpuckpt.tier.persister``) does not pay ~1 CPU-s of torch for nothing, and
    the stubs are in place before any code can call what they patch (right after ``import torch``)."""
    if "torch" in sys.modules:
        install()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
