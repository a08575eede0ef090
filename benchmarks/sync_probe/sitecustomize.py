"""A host synchronization at one point of a memory-tier save's iteration, for bench_goodput's ``+sync<at>`` variants
(an instrument: it changes what it measures, on purpose).

With Megatron-LM's level-1 timers (a ``torch.cuda.synchronize()`` at each start and stop of the forward-backward
and the optimizer) a save every iteration cost 39 ms instead of ~80 (BENCHMARKS.md, session 30): the step no longer
ran longer while the copy process copied. This says which synchronization does it. Put on PYTHONPATH with
``CPUCKPT_SYNC_AT`` set, it wraps, once cpuckpt's Megatron adapter is imported:

- ``start``: ``deferred.start_all`` (the saves' starts at the top of an iteration, before the forward): the device is
  synchronized after a call that started a save, so the forward is enqueued only after the device snapshot ran;
- ``step``: ``strategy.order_pending_saves`` (the first thing of every optimizer step): the device is synchronized
  before the step's kernels are enqueued, after the forward and backward ran.

Another ``sitecustomize`` further down ``sys.path`` (an image's own) still runs after this one.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGETS = {"start": ("cpuckpt.integrations.megatron.deferred", "start_all"),
            "step": ("cpuckpt.integrations.megatron.strategy", "order_pending_saves")}


def _synchronizing(fn: Any, only_if_started: bool) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not only_if_started:
            _synchronize()
        out = fn(*args, **kwargs)
        if only_if_started and out:
            _synchronize()
        return out

    return wrapper


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps ``name``'s function once the module is executed (a finder first on ``sys.meta_path``)."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.module, self.function = _TARGETS[at]
        self._inner: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        setattr(module, self.function, _synchronizing(getattr(module, self.function), self.at == "start"))
        sys.meta_path.remove(self)
        print(f"sync_probe: {self.module}.{self.function} synchronizes the device (pid {os.getpid()})",
              file=sys.stderr, flush=True)


def _install() -> None:
    at = os.environ.get("CPUCKPT_SYNC_AT", "")
    if at in _TARGETS:
        sys.meta_path.insert(0, _Patch(at))


def _chain_original() -> None:
    """The next ``sitecustomize.py`` on ``sys.path`` (``benchmarks/sitechain.py``)."""
    spec = importlib.util.spec_from_file_location("_cpuckpt_sitechain", os.path.join(os.path.dirname(_HERE),
                                                                                       "sitechain.py"))
    if spec is not None and spec.loader is not None:
        chain = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(chain)
        chain.run_next(_HERE)


_install()
_chain_original()
