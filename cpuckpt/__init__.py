"""cpuckpt: CPU-centric checkpointing for GPU training, as a torch.distributed.checkpoint backend.

The names below load on first use (PEP 562): ``python -m cpuckpt.tier.persister`` (the memory tier's writer
process) and the CLI's catalogue commands then start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cpuckpt.version import __version__

if TYPE_CHECKING:
    from cpuckpt.api import load, prepare_pool, prepare_pool_in_background, save, tick
    from cpuckpt.backend.reader import StorageReader
    from cpuckpt.backend.writer import StorageWriter
    from cpuckpt.background import AsyncSaveHandle, Checkpointer, async_save, wait_all
    from cpuckpt.config import Config
    from cpuckpt.errors import (
        CheckpointCorrupt,
        CheckpointTimeoutError,
        ConfigError,
        CpuckptError,
        IntegrityError,
        RamRootError,
        StagingError,
        StorageIOError,
        UnsafeCheckpointError,
    )
    from cpuckpt.restart import load_latest
    from cpuckpt.roots import (
        apply_retention,
        clean_incomplete,
        find_latest,
        install_sigterm_handler,
        list_checkpoints,
        read_latest,
        update_latest,
    )
    from cpuckpt.tier.memory import MemoryTier, PersistError, WriterDiedError
    from cpuckpt.transfer.staging import release_pool

_HOMES = {  # public name -> the module that defines it
    **dict.fromkeys(("load", "prepare_pool", "prepare_pool_in_background", "save", "tick"), "cpuckpt.api"),
    "StorageReader": "cpuckpt.backend.reader",
    "StorageWriter": "cpuckpt.backend.writer",
    **dict.fromkeys(("AsyncSaveHandle", "Checkpointer", "async_save", "wait_all"), "cpuckpt.background"),
    "Config": "cpuckpt.config",
    **dict.fromkeys(("CheckpointCorrupt", "CheckpointTimeoutError", "ConfigError", "CpuckptError", "IntegrityError",
                     "RamRootError", "StagingError", "StorageIOError", "UnsafeCheckpointError"), "cpuckpt.errors"),
    "load_latest": "cpuckpt.restart",
    **dict.fromkeys(("apply_retention", "clean_incomplete", "find_latest", "install_sigterm_handler",
                     "list_checkpoints", "read_latest", "update_latest"), "cpuckpt.roots"),
    **dict.fromkeys(("MemoryTier", "PersistError", "WriterDiedError"), "cpuckpt.tier.memory"),
    "release_pool": "cpuckpt.transfer.staging",
}

__all__ = [
    "AsyncSaveHandle",
    "CheckpointCorrupt",
    "CheckpointTimeoutError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "CpuckptError",
    "IntegrityError",
    "MemoryTier",
    "PersistError",
    "RamRootError",
    "StagingError",
    "StorageIOError",
    "StorageReader",
    "StorageWriter",
    "UnsafeCheckpointError",
    "WriterDiedError",
    "__version__",
    "apply_retention",
    "async_save",
    "clean_incomplete",
    "find_latest",
    "install_sigterm_handler",
    "list_checkpoints",
    "load",
    "load_latest",
    "prepare_pool",
    "prepare_pool_in_background",
    "read_latest",
    "release_pool",
    "save",
    "tick",
    "update_latest",
    "wait_all",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cpuckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
