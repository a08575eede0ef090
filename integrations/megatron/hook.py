"""Megatron-LM hook: ``--ckpt-format cpuckpt [--cpuckpt-config PATH.yaml]`` in unmodified training scripts.

Megatron-LM declares ``ckpt_format`` as a ``Literal`` (argparse rejects other values) and compares
it with ``'torch_dist'`` in dozens of places: only that value builds sharded state dicts and routes
saves into ``dist_checkpointing``. So cpuckpt is not a new format to Megatron-LM but the torch_dist
format with other storage. :func:`install`:

1. rewrites the command line before Megatron parses it: ``--ckpt-format cpuckpt`` (or the
   deprecated ``--dist-ckpt-format cpuckpt``) becomes ``--ckpt-format torch_dist``, and
   ``--cpuckpt-config PATH`` is taken out;
2. replaces the two strategy classes that ``megatron.training.checkpointing`` constructs
   (``TorchDistSaveShardedStrategy(cpu_shm_mode=...)`` and
   ``TorchDistLoadShardedStrategy(cache_metadata=...)``) with cpuckpt's subclasses.

Without ``--ckpt-format cpuckpt`` on the command line it changes nothing. Use it through the
launcher (``python -m cpuckpt.integrations.megatron.launch pretrain_gpt.py ...``) or add one line
at the top of the script: ``import cpuckpt.integrations.megatron as m; m.install()``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import ConfigError

__all__ = ["FORMAT", "Selection", "install", "rewrite_argv"]

logger = logging.getLogger(__name__)

FORMAT = "cpuckpt"
CONFIG_FLAG = "--cpuckpt-config"
_FORMAT_FLAGS = ("--ckpt-format", "--dist-ckpt-format")


@dataclass
class Selection:
    """What the command line asked for, and the arguments Megatron-LM should see instead."""

    enabled: bool = False
    config: str | None = None
    argv: list[str] = field(default_factory=list)


def rewrite_argv(argv: list[str]) -> Selection:
    """Map ``--ckpt-format cpuckpt`` onto torch_dist and take out ``--cpuckpt-config``.

    Raises:
        ConfigError: ``--cpuckpt-config`` without a value, or without ``--ckpt-format cpuckpt``.
    """
    sel = Selection()
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in _FORMAT_FLAGS or name == CONFIG_FLAG:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                if name == CONFIG_FLAG:
                    raise ConfigError(f"{CONFIG_FLAG} needs a path")
                sel.argv.append(arg)  # let Megatron's parser report the missing value
                i += 1
                continue
            if name == CONFIG_FLAG:
                sel.config = value
            elif value == FORMAT:
                sel.enabled = True
                sel.argv += ["--ckpt-format", "torch_dist"]
            else:
                sel.argv += [name, value]
            continue
        sel.argv.append(arg)
        i += 1
    if sel.config is not None and not sel.enabled:
        raise ConfigError(f"{CONFIG_FLAG} {sel.config} given, but --ckpt-format is not {FORMAT}")
    return sel


def install(config: Config | str | os.PathLike | dict | None = None, *, argv: list[str] | None = None) -> bool:
    """Rewrite ``sys.argv`` (or ``argv``, in place) and swap Megatron-LM's strategies if cpuckpt is selected.

    ``--cpuckpt-config`` on the command line wins over ``config``. Returns whether cpuckpt was selected.

    Raises:
        ConfigError: a bad flag or configuration (checked before training starts).
    """
    args = sys.argv if argv is None else argv
    sel = rewrite_argv(args[1:])
    if not sel.enabled:
        return False
    cfg = resolve_config(sel.config if sel.config is not None else config)
    args[1:] = sel.argv
    patch_training(cfg)
    logger.info("cpuckpt: --ckpt-format cpuckpt -> torch_dist files written and read by cpuckpt (%s)",
                sel.config or "default settings")
    return True


def patch_training(cfg: Config, module: Any = None) -> None:
    """Replace the strategy classes ``megatron.training.checkpointing`` constructs by cpuckpt's."""
    if module is None:
        try:
            import megatron.training.checkpointing as module
        except ImportError as e:
            raise ImportError(
                "--ckpt-format cpuckpt needs Megatron-LM's megatron.training on the path (Megatron-LM is not on "
                f"PyPI: put its checkout first on PYTHONPATH): {e}"
            ) from e
    module.TorchDistSaveShardedStrategy, module.TorchDistLoadShardedStrategy = _training_classes(cfg)


def _training_classes(cfg: Config) -> tuple[type, type]:
    from .strategy import CpuckptLoadStrategy, CpuckptSaveStrategy

    class MegatronLMSaveStrategy(CpuckptSaveStrategy):
        """Built by Megatron-LM as ``TorchDistSaveShardedStrategy(cpu_shm_mode=...)``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # cpu_shm_mode (NVRx's worker-side staging) has no meaning here: staging is ours.
            super().__init__(cfg)

    class MegatronLMLoadStrategy(CpuckptLoadStrategy):
        """Built by Megatron-LM as ``TorchDistLoadShardedStrategy(cache_metadata=..., ...)``."""

        def __init__(self, *args: Any, cache_metadata: bool = False, stream_ckpt_dequant: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(cfg)
            self.cache_metadata = cache_metadata
            self.stream_ckpt_dequant = stream_ckpt_dequant

    return MegatronLMSaveStrategy, MegatronLMLoadStrategy
