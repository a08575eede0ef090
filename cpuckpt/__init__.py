"""cpuckpt: CPU-centric checkpointing for GPU training, as a torch.distributed.checkpoint backend."""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointCorrupt,
    CheckpointTimeoutError,
    ConfigError,
    CpuckptError,
    IntegrityError,
    StagingError,
    StorageIOError,
)
from .reader import StorageReader  # noqa: E402
from .writer import StorageWriter  # noqa: E402
from .api import load, save  # noqa: E402

__all__ = [
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
    "load",
    "save",
]
