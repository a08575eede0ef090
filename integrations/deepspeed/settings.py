"""Settings of the DeepSpeed adapter: its own keys plus a cpuckpt ``Config``. Pure: reads YAML only.

The same mapping is accepted from ``install(config=...)`` (a dict, a YAML path or a ``Settings``)
and from a ``"cpuckpt": {...}`` block inside the DeepSpeed config; the block's keys win over the
ones given to ``install``. See ``configs/deepspeed.yaml``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cpuckpt.config import Config
from cpuckpt.errors import ConfigError

__all__ = ["Settings", "resolve_settings"]

_OWN_KEYS = ("enabled", "async", "background_commit", "storage_alignment", "config_file")
_ADAPTER_CORE_DEFAULTS: dict[str, Any] = {"integrity": {"checksum": "none"}}


@dataclass(frozen=True)
class Settings:
    """What the adapter does.

    Attributes:
        enabled: use cpuckpt's engine (False: DeepSpeed's own choice of engine).
        async_save: ``save()`` returns once the tensors are copied into the host pool; the files
            become durable in the background and the checkpoint is committed (``latest`` written) at
            the next ``engine.step()``, ``engine.destroy()`` or :func:`commit_pending`. False:
            ``save()`` returns once its file is durable (the commit still happens at those points).
        background_commit: with ``async_save``, the commit DeepSpeed asks for at the next
            ``engine.step()`` runs in a background thread instead of blocking that step: the
            tensors are already in host memory, so the optimizer update cannot change the
            checkpoint; ``latest`` is written once every rank's files are durable. A failure is
            raised (on every rank) at the next save, ``commit_pending`` or ``engine.destroy()``.
            False: that step waits until the checkpoint is durable (DeepSpeed's own decoupled timing).
        storage_alignment: alignment of each storage's data inside the torch.save archive.
        core: the cpuckpt ``Config`` (``io``, ``staging``, ``integrity``, ``timeout_s``, ...).
    """

    enabled: bool = True
    async_save: bool = True
    background_commit: bool = True
    storage_alignment: int = 4096
    core: Config = field(default_factory=lambda: Config.from_dict(_ADAPTER_CORE_DEFAULTS))


def _as_mapping(config: Settings | Mapping[str, Any] | str | os.PathLike | None, source: str = "") -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the cpuckpt DeepSpeed settings: {e}") from e
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def resolve_settings(installed: Settings | Mapping[str, Any] | str | os.PathLike | None,
                     block: Mapping[str, Any] | None = None) -> Settings:
    """Combine ``install()``'s settings with the ds_config ``"cpuckpt"`` block (the block wins).

    Raises:
        ConfigError: an unknown key, a wrong type, or an unreadable file (naming the key).
    """
    if isinstance(installed, Settings) and not block:
        return installed
    data = {} if isinstance(installed, Settings) else _as_mapping(installed, "install()")
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f'ds_config: "cpuckpt" must be a mapping, got {type(block).__name__}')
    data = _merge(data, block or {})
    core_file = data.pop("config_file", None)
    own = {k: data.pop(k) for k in _OWN_KEYS if k in data}
    core_data = _merge(_as_mapping(core_file, "config_file"), data) if core_file else data
    # DeepSpeed's files carry no manifest to keep chunk checksums in: do not compute them by default.
    core_data = _merge(_ADAPTER_CORE_DEFAULTS, core_data)
    base = installed if isinstance(installed, Settings) else Settings()
    enabled = own.get("enabled", base.enabled)
    async_save = own.get("async", base.async_save)
    background = own.get("background_commit", base.background_commit)
    align = own.get("storage_alignment", base.storage_alignment)
    if not isinstance(enabled, bool):
        raise ConfigError(f"cpuckpt deepspeed settings: enabled must be a bool, got {enabled!r}")
    if not isinstance(async_save, bool):
        raise ConfigError(f"cpuckpt deepspeed settings: async must be a bool, got {async_save!r}")
    if not isinstance(background, bool):
        raise ConfigError(f"cpuckpt deepspeed settings: background_commit must be a bool, got {background!r}")
    if not isinstance(align, int) or isinstance(align, bool) or align < 64 or align & (align - 1):
        raise ConfigError(f"cpuckpt deepspeed settings: storage_alignment must be a power of two >= 64, got {align!r}")
    keep_core = isinstance(installed, Settings) and not data and not core_file
    try:
        core = base.core if keep_core else Config.from_dict(core_data, source="cpuckpt deepspeed settings")
    except ConfigError as e:
        raise ConfigError(f"{e} (the adapter's own keys: {', '.join(_OWN_KEYS)})") from e
    return Settings(enabled=enabled, async_save=async_save, background_commit=background, storage_alignment=align,
                    core=core)
