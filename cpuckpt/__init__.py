"""cpuckpt: CPU-centric checkpointing for GPU training, as a torch.distributed.checkpoint backend."""

from __future__ import annotations

__version__ = "0.1.0"

from .api import load, prepare_pool, save
from .checkpointer import AsyncSaveHandle, async_save, wait_all
from .checkpoints import (
    apply_retention,
    clean_incomplete,
    find_latest,
    install_sigterm_handler,
    list_checkpoints,
    read_latest,
    update_latest,
)
from .config import Config
from .errors import (
    CheckpointCorrupt,
    CheckpointTimeoutError,
    ConfigError,
    CpuckptError,
    IntegrityError,
    StagingError,
    StorageIOError,
)
from .reader import StorageReader
from .writer import StorageWriter

__all__ = [
    "AsyncSaveHandle",
    "CheckpointCorrupt",
    "CheckpointTimeoutError",
    "Config",
    "ConfigError",
    "CpuckptError",
    "IntegrityError",
    "StagingError",
    "StorageIOError",
    "StorageReader",
    "StorageWriter",
    "__version__",
    "apply_retention",
    "async_save",
    "clean_incomplete",
    "find_latest",
    "install_sigterm_handler",
    "list_checkpoints",
    "load",
    "prepare_pool",
    "read_latest",
    "save",
    "update_latest",
    "wait_all",
]
