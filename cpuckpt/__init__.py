"""cpuckpt: CPU-centric checkpointing for GPU training, as a torch.distributed.checkpoint backend."""

from __future__ import annotations

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
from cpuckpt.version import __version__

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
