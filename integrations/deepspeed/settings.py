"""Settings of the DeepSpeed adapter: its own keys plus a cpuckpt ``Config``. Pure: reads YAML only.

One flat mapping holds both (see ``configs/deepspeed.yaml``): the adapter's own keys
(:class:`AdapterOptions`: ``enabled``, ``async``, ``background_commit``, ``ordering``, ``prepare_pool``,
``storage_alignment``, ``memory_tier``, ``memory_save_dir``, ``fallback_on_corrupt``, and ``config_file``) beside
the core sections (``io``, ``staging``, ``integrity``, ``memory``, ``timeout_s``, ...). Both halves are built by
cpuckpt's config machinery (:func:`cpuckpt.config.build_options`): strict keys, checked values, a
:class:`~cpuckpt.errors.ConfigError` naming the source and the dotted key.

Sources, later ones winning key by key: cpuckpt's defaults (``integrity.checksum: crc32c``: each
tag's completion marker keeps the chunk checksums), the core keys of ``config_file``, what
``install``/``attach`` were given (a dict, a YAML path or a ``Settings``), the ds_config's
``"cpuckpt"`` block (for ``install``; ``attach`` lets its own settings win), and environment
variables: ``CPUCKPT_<SECTION>_<KEY>`` for core keys (as for every cpuckpt config) and
``CPUCKPT_DEEPSPEED_<KEY>`` for the adapter's own (``CPUCKPT_DEEPSPEED_ASYNC=false``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cpuckpt.config import Config, build_options, load_yaml_mapping, overlap_window, warn_unknown_scoped_env
from cpuckpt.errors import ConfigError

__all__ = ["REMOVED_KEYS", "AdapterOptions", "Settings", "resolve_settings"]

ENV_PREFIX = "CPUCKPT_DEEPSPEED_"
_CONFIG_FILE = "config_file"
# Core keys whose adapter default differs from cpuckpt's (none since the tag marker keeps chunk checksums).
_ADAPTER_CORE_DEFAULTS: dict[str, Any] = {}


@dataclass(frozen=True)
class AdapterOptions:
    """The adapter's own keys (top level of ``configs/deepspeed.yaml``, beside the core sections).

    Attributes:
        enabled: use cpuckpt's engine (False: DeepSpeed's own choice of engine).
        async_save: (key ``async``) ``save()`` returns once the tensors are copied into the host
            pool; the files become durable in the background and the checkpoint is committed
            (``latest`` written) at the next ``engine.step()``, ``engine.destroy()`` or
            :func:`commit_pending`. False: ``save()`` returns once its file is durable (the commit
            still happens at those points).
        background_commit: with ``async_save``, the commit DeepSpeed asks for at the next
            ``engine.step()`` runs in a background thread instead of blocking that step: the
            tensors are already in host memory, so the optimizer update cannot change the
            checkpoint; ``latest`` is written once every rank's files are durable. A failure is
            raised (on every rank) at the next save, ``commit_pending`` or ``engine.destroy()``, or by the
            ``step()`` that waits for the commit (memory tier: saves every iteration, or
            ``memory.max_uncommitted: 1``).
            False: that step waits until the checkpoint is durable (DeepSpeed's own decoupled timing).
        ordering: with ``async_save``, when ``save()`` returns. ``host`` (default): once every byte is
            in the host pool (the trainer then stalls for the whole device-to-host copy).
            ``optimizer`` (zero-stall): once the state is frozen (containers copied, CPU tensors
            cloned; a stager thread then lays the file out and enqueues the device-to-host copies);
            the module's saved buffers are cloned on the GPU at save time, and the next optimizer
            step of the DeepSpeed engine first makes its current CUDA stream wait for the copies (a
            GPU-side wait: forward and backward overlap them). The copies are paced from the trainer's
            module calls in 64 MiB pieces, one in flight (``staging.d2h_window_bytes`` left 0), so the
            step's ``.item()`` waits behind no more. See :mod:`cpuckpt.integrations.deepspeed` for the contract.
        prepare_pool: with ``async_save``, size this rank's checkpoint after the engine's first
            optimizer step and create (pre-touch, pin) the host pool for it in a background thread,
            so that the first save is as fast as later ones. False: the first save allocates it.
        storage_alignment: alignment of each storage's data inside the torch.save archive (a power
            of two >= 64; 4096 lets readers use O_DIRECT / mmap on the data).
        memory_tier: checkpoints go through cpuckpt's memory tier (:class:`cpuckpt.MemoryTier`, configured
            by the core ``memory`` section, durable root ``save_dir``): each tag's files go into a slot of
            the node's RAM root and are committed there; every ``memory.persist_every``-th one (by global
            step; 1: all, 0: none) is also persisted to ``save_dir/<tag>`` by a writer process per rank,
            with its marker and ``latest``. :func:`~cpuckpt.integrations.deepspeed.load_latest` restarts
            from the newest complete tag of either. Across nodes each node's RAM root holds its ranks' files.
        memory_save_dir: with ``memory_tier``, the ``save_dir`` this job passes to ``save_checkpoint``: the tier is
            then made inside ``deepspeed.initialize`` and every slot's images of this rank's files (named by
            DeepSpeed, sized from the engine's tensors, Adam's state assumed) are reserved, mapped and pinned there,
            before training, so that no save pays for it while the job trains (13.6 GB: 4.7-5.9 s per slot on the
            H200). Empty: the first save into each slot makes them. Checkpoints into another directory (an export)
            go to disk as without it. One node only (across nodes the first saves make the images), for the first
            engine with an optimizer per directory in a process; ignored with a warning when ``memory_tier`` is off.
        fallback_on_corrupt: :func:`~cpuckpt.integrations.deepspeed.load_latest` loads the next newest
            complete tag when the newest fails its crc32c check on any rank, or was committed and is damaged
            since (all ranks together, with a WARNING naming the tag and the damage). False: it raises
            ``CheckpointCorrupt`` instead. Committed tags of which none loads raise it either way.
    """

    enabled: bool = True
    async_save: bool = field(default=True, metadata={"key": "async"})
    background_commit: bool = True
    ordering: str = field(default="host", metadata={"choices": ("host", "optimizer")})
    prepare_pool: bool = True
    storage_alignment: int = field(default=4096, metadata={"size": True, "min": 64, "pow2": True})
    memory_tier: bool = False
    memory_save_dir: str = ""
    fallback_on_corrupt: bool = True


def _default_core() -> Config:
    return Config.from_dict(_ADAPTER_CORE_DEFAULTS)


@dataclass(frozen=True)
class Settings(AdapterOptions):
    """What the adapter does: :class:`AdapterOptions` plus ``core``, the cpuckpt ``Config``
    (``io``, ``staging``, ``integrity``, ``timeout_s``, ...)."""

    core: Config = field(default_factory=_default_core)


_OWN_FIELDS = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(AdapterOptions)}
_OWN_KEYS = (*_OWN_FIELDS, _CONFIG_FILE)
# The adapter's own memory copy gave way to the core memory tier (one memory tier, issue 28.4): what to use instead.
REMOVED_KEYS: dict[str, str] = {
    "memory_dir": "DeepSpeed's memory copies are the core memory tier's now: set memory_tier: true, and memory.root "
                  "for a RAM root other than /dev/shm/cpuckpt-<uid>/<job>",
    "persist_every": "use memory.persist_every with memory_tier: true; its meaning changed: every K-th memory "
                     "checkpoint by global step is *also* persisted to save_dir by a writer process (1: all, 0: none), "
                     "where persist_every: K sent every K-th checkpoint to save_dir instead of memory",
    "memory_keep": "use memory.slots with memory_tier: true (the memory checkpoints kept in RAM, a ring)",
}


def _refuse_removed(data: Mapping[str, Any], source: str) -> None:
    """A removed key, in the settings or as ``CPUCKPT_DEEPSPEED_<KEY>``: a ConfigError saying what to use instead."""
    for key, instead in REMOVED_KEYS.items():
        env = f"{ENV_PREFIX}{key.upper()}"
        if key in data or env in os.environ:
            where = f"environment variable {env}" if key not in data else source
            raise ConfigError(f"{where}: {key} was removed ({instead}); delete the key")


def _as_mapping(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    return load_yaml_mapping(config)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _source(installed: Any, block: Mapping[str, Any] | None, config_file: Any, block_wins: bool) -> str:
    """Where the merged settings came from, for error messages (lowest precedence first)."""
    given = str(installed) if isinstance(installed, (str, os.PathLike)) else \
        "Settings" if isinstance(installed, Settings) else "install()/attach() settings" if installed else ""
    from_block = 'ds_config "cpuckpt" block' if block else ""
    layers = [f"config_file {config_file}" if config_file else "",
              *((given, from_block) if block_wins else (from_block, given))]
    layers = [x for x in layers if x]
    return "cpuckpt deepspeed settings" + (f" ({' < '.join(layers)})" if layers else "")


def resolve_settings(installed: Settings | Mapping[str, Any] | str | os.PathLike | None,
                     block: Mapping[str, Any] | None = None, *, block_wins: bool = True) -> Settings:
    """Combine ``install()``/``attach()``'s settings with the ds_config ``"cpuckpt"`` block.

    Args:
        installed: a ``Settings``, a mapping, a YAML path, or None for the defaults.
        block: the ds_config's ``"cpuckpt"`` block, if any.
        block_wins: the block's keys win (``install``); False: ``installed``'s keys win and the
            block's ``enabled`` is ignored (``attach``, which is explicit).

    Raises:
        ConfigError: an unknown key, a wrong type, or an unreadable file (naming the source and the key).
    """
    if isinstance(installed, Settings) and not block:
        return installed
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f'ds_config: "cpuckpt" must be a mapping, got {type(block).__name__}')
    base = installed if isinstance(installed, Settings) else AdapterOptions()
    given = {} if isinstance(installed, Settings) else _as_mapping(installed)
    if block_wins:
        data = _merge(given, block or {})
    else:
        data = _merge({k: v for k, v in (block or {}).items() if k != "enabled"}, given)
    core_file = data.pop(_CONFIG_FILE, None)
    source = _source(installed, block, core_file, block_wins)
    _refuse_removed(data, source)
    if "megatron" in data or (core_file and "megatron" in load_yaml_mapping(core_file)):  # the core leaves that
        # block to the Megatron adapter: dropped here it would be silent
        raise ConfigError(f"{source}: a megatron: block is the Megatron adapter's (configs/megatron*.yaml); the "
                          f"DeepSpeed adapter's settings are its own keys ({', '.join(_OWN_KEYS)}) beside the core "
                          "sections (configs/deepspeed.yaml)")
    # ``async``: the adapter's flag when a bool, the core's ``async:`` section when a mapping (a core YAML's
    # ``async: {max_in_flight: 1}`` given to this adapter is the core's)
    own = {key: data.pop(key) for key in _OWN_FIELDS if key in data and not isinstance(data[key], Mapping)}
    base_own = {key: getattr(base, name) for key, name in _OWN_FIELDS.items()}
    warn_unknown_scoped_env(AdapterOptions, ENV_PREFIX, ENV_PREFIX)  # a misspelt one was ignored without a word
    options = build_options(AdapterOptions, {**base_own, **own}, source=source, env_prefix=ENV_PREFIX)
    if isinstance(installed, Settings) and not data and not core_file:
        core = installed.core
    else:
        core_data = _merge(load_yaml_mapping(core_file), data) if core_file else data
        if isinstance(installed, Settings):  # the block's core keys go over the given Settings' core
            core_data = _merge(installed.core.to_dict(), core_data)
        core_data = _merge(_ADAPTER_CORE_DEFAULTS, core_data)
        try:
            core = Config.from_dict(core_data, source=source)
        except ConfigError as e:
            raise ConfigError(f"{e} (the adapter's own keys: {', '.join(_OWN_KEYS)})") from e
    if options.ordering == "optimizer" and options.async_save:
        core = overlap_window(core)  # the step's .item() would wait behind the whole save's copies
    return Settings(**{name: getattr(options, name) for name in _OWN_FIELDS.values()}, core=core)
