"""The chain of ``sitecustomize`` files the benchmarks' instruments (``stack_sampler``, ``probe``) put on
PYTHONPATH: each runs the next one on ``sys.path`` (another instrument's, then the image's own), each once per
process; two instruments on one path would otherwise run each other without end. Loaded by path (the
instruments run before anything else is importable)."""

from __future__ import annotations

import importlib.util
import os
import sys


def run_next(here: str) -> None:
    """Run the first ``sitecustomize.py`` on ``sys.path`` not run yet in this process (``here``: the caller's)."""
    ran = sys.__dict__.setdefault("_cpuckpt_sitecustomize_ran", set())
    ran.add(here)
    for entry in sys.path:
        if not entry or os.path.abspath(entry) in ran:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            ran.add(os.path.abspath(entry))
            spec = importlib.util.spec_from_file_location("_image_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return
