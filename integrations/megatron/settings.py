"""Settings of the Megatron adapter: its own ``megatron:`` block beside the core sections. Pure: reads YAML only.

``configs/megatron.yaml`` holds the cpuckpt core sections (``io``, ``staging``, ``timeout_s``, ...)
and, optionally, a ``megatron:`` block with the adapter's own keys (:class:`MegatronOptions`). Both
halves are built by cpuckpt's config machinery (:func:`cpuckpt.config.build_options`): strict keys,
checked values, a :class:`~cpuckpt.errors.ConfigError` naming the source and the dotted key.
Environment variables win over the file: ``CPUCKPT_<SECTION>_<KEY>`` for core keys (as for every
cpuckpt config) and ``CPUCKPT_MEGATRON_<KEY>`` for the adapter's own (``CPUCKPT_MEGATRON_ON_FAILURE=continue``).

Every entry point that takes a ``config`` (``save_strategy``, ``load_strategy``, ``watch_async_queue``,
``install``, ``--cpuckpt-config``) accepts the same file, a mapping of the same shape, a
:class:`cpuckpt.Config` (the adapter's keys then come from their defaults and the environment) or None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cpuckpt.config import Config, build_options, load_yaml_mapping, overlap_window, warn_unknown_scoped_env
from cpuckpt.errors import ConfigError

__all__ = ["BLOCK", "ENV_PREFIX", "MegatronOptions", "resolve_core", "resolve_options", "split_config"]

BLOCK = "megatron"
ENV_PREFIX = "CPUCKPT_MEGATRON_"


@dataclass(frozen=True)
class MegatronOptions:
    """The Megatron adapter's own keys (the ``megatron:`` block of ``configs/megatron.yaml``).

    Attributes:
        on_failure: what a failed async save does at finalize (a dead checkpoint worker, a write
            error, a worker that raised). ``raise``: every rank raises the same error (the job
            stops; the last complete checkpoint is the restart point). ``continue``: every rank logs
            the error and training goes on; the failed checkpoint never gets ``metadata.json`` (nor
            Megatron-LM's tracker file), so a restart still resumes from the last good one; a dead
            persistent worker is replaced, so the next save runs on a fresh one. Only errors every
            rank agrees on are continued; anything else is raised.
        heartbeat_timeout_s: a checkpoint worker that took a save beats every ~1 s while it waits
            for the save's outcome; one whose beat is older than this is treated as dead (stopped,
            hung, or gone without its exit being seen).
        reuse_plan: reuse the previous save's DCP plan when the state's structure is unchanged
            (checked on every save; see :class:`.strategy.CpuckptSaveStrategy`). False plans every
            save with DCP unless Megatron-LM's ``--ckpt-assume-constant-structure`` is given.
        memory_tier: Megatron-LM's async saves go through cpuckpt's memory tier (the core config's
            ``memory:`` section): non-persistent global saves become memory checkpoints in a RAM
            root, persistent saves memory checkpoints persisted to ``--save`` by a writer process
            (see :mod:`.memory`). Needs ``--async-save``; sync saves write to disk as before.
        ordering: when an async save lets training go on. ``host`` (default): the strategy returns
            once every byte is in host memory (the trainer waits for the device-to-host copy).
            ``optimizer``: it returns once the copies are enqueued; the next forward and backward
            overlap them, and the next optimizer step (every ``megatron.core.optimizer`` class's
            ``step``, wrapped by the hook) makes its stream wait for them on the GPU. Tensors that
            change before that step (MoE ``expert_bias``, updated in ``finalize_model_grads``) are
            copied on the GPU at save time instead. Memory-tier saves order the same way. Saves to
            the durable root start after Megatron-LM's ``save-checkpoint`` timer (its synchronize
            would wait for the copies), at the watched async queue's next finalize (:mod:`.deferred`).
            The copies are paced from the trainer's module calls in 64 MiB pieces, one in flight
            (``staging.d2h_window_bytes``, when left 0: :mod:`cpuckpt.transfer.pacing`), so the
            iteration's ``.item()`` calls do not wait behind the whole save on the copy engine.
        start_at: where a save recorded inside Megatron-LM's ``save_checkpoint`` starts: ``finalize``, the watched
            queue's next finalize at the top of the next iteration, the only start point. Kept so that configs naming
            it still load; the model's forward as the start point was measured slower and removed.
        prepare_pool: after the first optimizer step, reserve (allocate, touch, pin) the host pool
            on a background thread, sized from the model and optimizer state (:mod:`.prepare`), so
            the first async save costs what later ones cost. Not used with ``memory_tier`` (saves go
            into the tier's images, which are prepared after the first save).
        fallback_on_corrupt: a restart whose newest checkpoint fails cpuckpt's checks on load (a chunk's
            crc32c, a short or missing file, on any rank) loads the next newest complete iteration
            instead, on every rank together, with a WARNING naming the damaged directory and why
            (:mod:`.fallback`: Megatron-LM's ``load_checkpoint`` through the hook, megatron-core
            through :func:`~cpuckpt.integrations.megatron.load_latest`). Nothing on disk changes.
            False: the load raises ``CheckpointCorrupt``.
        freeze_gc: once Megatron-LM's ``setup_model_and_optimizer`` returned (before the first iteration), collect
            and then ``gc.freeze()`` every object alive, so that the interpreter's full collections while training
            look only at what was made since: a full collection took ~400 ms on the H100 (the largest gap of a run
            saving every iteration, one per run of 60-120 saves); on the CPU box, right after the imports, ~200 ms
            against ~3 ms frozen (in training what was made since setup is still looked at: not measured on a GPU
            yet). What is frozen is never collected: cycles among setup's objects that become garbage later stay
            (``--manual-gc`` differs: no automatic collection at all).
        reuse_state_dict: under ``--ckpt-assume-constant-structure``, a save whose model and optimizer still hold
            the same tensors as at the last full build skips Megatron-LM's per-save state-dict build: the captured
            tensors and their places are reused, the small non-tensor state (iteration, RNG, scheduler, rerun
            state, the optimizer's learning rates and steps) is taken fresh (:mod:`.replay` says how it is checked).
            The files are those Megatron-LM's build writes. False: every save builds (as Megatron-LM alone does).
    """

    on_failure: str = field(default="raise", metadata={"choices": ("raise", "continue")})
    heartbeat_timeout_s: float = field(default=60.0, metadata={"min": 2.0})
    reuse_plan: bool = True
    memory_tier: bool = False
    ordering: str = field(default="host", metadata={"choices": ("host", "optimizer")})
    start_at: str = field(default="finalize", metadata={"choices": ("finalize",)})
    prepare_pool: bool = True
    fallback_on_corrupt: bool = True
    freeze_gc: bool = False
    reuse_state_dict: bool = True


def _mapping(config: Config | Mapping[str, Any] | str | os.PathLike | None) -> tuple[dict[str, Any] | None, str]:
    if config is None or isinstance(config, Config):
        return None, "<defaults>"
    if isinstance(config, Mapping):
        return dict(config), "<dict>"
    return load_yaml_mapping(config), str(config)


def split_config(config: Config | Mapping[str, Any] | str | os.PathLike | None) -> tuple[Config, MegatronOptions]:
    """The core :class:`~cpuckpt.Config` and the adapter's :class:`MegatronOptions` of one config source.

    ``config``: a :class:`cpuckpt.Config`, a mapping, a YAML path, or None (defaults; both halves
    take their environment overrides).

    Raises:
        ConfigError: an unknown key, a wrong type or an unreadable file (naming the source and the key).
    """
    if isinstance(config, MegatronOptions):
        raise ConfigError("MegatronOptions holds only the adapter's keys; pass the whole config (a path, a mapping)")
    data, source = _mapping(config)
    block: Any = None
    if data is not None:
        block = data.pop(BLOCK, None)
        if block is not None and not isinstance(block, Mapping):
            raise ConfigError(f"{source}: {BLOCK} must be a mapping, got {block!r}")
    options = _build_options(block, source)
    if isinstance(config, Config):
        return _windowed(config, options), options
    try:
        core = Config.from_dict(data, source=source)
    except ConfigError as e:
        raise ConfigError(f"{e} (the Megatron adapter's own keys go in a '{BLOCK}:' block)") from e
    return _windowed(core, options), options


def _windowed(core: Config, options: MegatronOptions) -> Config:
    """``ordering: optimizer`` overlaps the copies with an iteration whose ``.item()`` calls would otherwise
    wait behind the whole save on the copy engine (:func:`cpuckpt.config.overlap_window`)."""
    return overlap_window(core) if options.ordering == "optimizer" else core


@dataclass(frozen=True)
class _File:
    """The file's shape as far as the adapter is concerned: its block, as a section (dotted keys
    ``megatron.<key>`` in errors, ``CPUCKPT_MEGATRON_<KEY>`` from the environment)."""

    megatron: MegatronOptions = field(default_factory=MegatronOptions)


def _build_options(block: Mapping[str, Any] | None, source: str) -> MegatronOptions:
    warn_unknown_scoped_env(_File, "CPUCKPT_", ENV_PREFIX)  # a misspelt CPUCKPT_MEGATRON_* was ignored silently
    return build_options(_File, {BLOCK: dict(block or {})}, source=source, env_prefix="CPUCKPT_").megatron


def resolve_core(config: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
    """The core half of :func:`split_config` (what the strategies use)."""
    return split_config(config)[0]


def resolve_options(config: MegatronOptions | Config | Mapping[str, Any] | str | os.PathLike | None) -> MegatronOptions:
    """The adapter half of :func:`split_config`; a :class:`MegatronOptions` is returned as it is."""
    if isinstance(config, MegatronOptions):
        return config
    return split_config(config)[1]
