"""One-release aliases of the module names of cpuckpt 0.1.0 (``cpuckpt.writer``, ``cpuckpt.commit``, ...).

The package was split into layers (docs/ARCHITECTURE.md, section 1). Importing an old name still
works and warns once (``DeprecationWarning``); each alias resolves attributes lazily from the new
modules that now hold them, and ``python -m cpuckpt.<old>`` runs the new module. Remove after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install"]

# old module -> the modules that now hold its names (the first is the main successor)
MOVED: dict[str, tuple[str, ...]] = {
    "cpuckpt.layout": ("cpuckpt.format.layout",),
    "cpuckpt.record": ("cpuckpt.format.record",),
    "cpuckpt.manifest": ("cpuckpt.format.manifest",),
    "cpuckpt.plancache": ("cpuckpt.format.plancache",),
    "cpuckpt.fileio": ("cpuckpt.transfer.files",),
    "cpuckpt.staging": ("cpuckpt.transfer.staging",),
    "cpuckpt.pipeline": ("cpuckpt.transfer.threads",),
    "cpuckpt.engine": ("cpuckpt.transfer.save_job",),
    "cpuckpt.telemetry": ("cpuckpt.backend.telemetry", "cpuckpt.transfer.tracing"),
    "cpuckpt.snapshot": ("cpuckpt.backend.dcp_stager",),
    "cpuckpt.commit": ("cpuckpt.backend.commit", "cpuckpt.backend.committed", "cpuckpt.transfer.files"),
    "cpuckpt.writer": ("cpuckpt.backend.writer", "cpuckpt.config"),
    "cpuckpt.reader": ("cpuckpt.backend.reader",),
    "cpuckpt.checkpoints": ("cpuckpt.roots",),
    "cpuckpt.checkpointer": ("cpuckpt.background",),
    "cpuckpt.catalog": ("cpuckpt.tools.catalog",),
    "cpuckpt.verification": ("cpuckpt.tools.verification",),
    "cpuckpt.export": ("cpuckpt.tools.export",),
    "cpuckpt.configdoc": ("cpuckpt.tools.configdoc",),
    "cpuckpt.cli": ("cpuckpt.tools.cli",),
}


class _AliasModule(types.ModuleType):
    """A module whose attributes come from the modules that replaced it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for target in MOVED[self.__name__]:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {MOVED[self.__name__][0]!r}) has no attribute "
                             f"{name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in MOVED[self.__name__]:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AliasModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} moved to {MOVED[module.__name__][0]}; the old name goes after "
                      "cpuckpt 0.2", DeprecationWarning, stacklevel=2)

    def get_code(self, fullname: str) -> types.CodeType:
        # ``python -m cpuckpt.<old>``: run the successor as __main__.
        source = f"import runpy\nrunpy.run_module({MOVED[fullname][0]!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<cpuckpt alias {fullname}>", "exec")


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
