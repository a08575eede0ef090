"""DeepSpeed adapter: a ``CheckpointEngine`` that writes DeepSpeed's files through cpuckpt.

Activation, without patching DeepSpeed's sources (DeepSpeed has no config key for a third-party
engine; it calls ``deepspeed.runtime.engine.create_checkpoint_engine`` inside ``initialize``)::

    import cpuckpt.integrations.deepspeed as ckpt_ds
    ckpt_ds.install("configs/deepspeed.yaml")        # before deepspeed.initialize
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)
    engine.save_checkpoint(save_dir)                  # returns once tensors are in host memory
    ...
    engine.destroy()                                  # commits the last checkpoint, writes `latest`

or, for an engine that already exists, ``ckpt_ds.attach(engine, config)``. A ``"cpuckpt": {...}``
block in the ds_config overrides ``install``'s settings (``"enabled": false`` turns it off).

Files keep DeepSpeed's names and are torch.save-compatible, so ``zero_to_fp32``,
``ds_to_universal`` and a stock DeepSpeed load them. The checkpoint is committed (every rank's files
fsynced, then ``latest`` written atomically by rank 0) starting at the next ``engine.step()`` (in the
background by default, see ``background_commit``), or at ``engine.destroy()`` or
:func:`commit_pending`, which both wait for it. Call :func:`commit_pending` before reading the
checkpoint back in the same job (``load_checkpoint`` reads ``latest`` itself) and before tearing the
process group down without ``engine.destroy()``; a process that exits (or drops the engine) with a checkpoint
never committed logs a warning naming its tag (which stays torn).

Every tag the engine writes gets a hidden completion marker (``<tag>/.cpuckpt-complete.json``,
written after every rank's files are durable and before ``latest`` moves; see :mod:`.marker`).
:func:`check_tag` says whether a tag is complete, :func:`find_latest` names the newest complete
one, and :func:`check_before_load` (collective) refuses a torn tag on every rank, verifying every
chunk's crc32c with ``verify=True``. The engine's own ``load`` refuses files of a torn tag.

With ``memory_tier: true``, checkpoints go through cpuckpt's memory tier (:class:`cpuckpt.MemoryTier`, the
core ``memory:`` keys; see :mod:`.memory`): each tag's files are committed in a slot of the node's RAM root
(``save_checkpoint`` stalls for the copy into RAM only), and every ``memory.persist_every``-th one by global
step is also persisted into ``save_dir/<tag>`` by a writer process per rank, which writes the marker and
``latest`` once every rank's files are durable (``engine.destroy()`` makes the newest durable too). At
restart, :func:`load_latest` loads the newest complete tag of either tier, never an older one over a newer::

    ckpt_ds.load_latest(engine, save_dir)     # every rank; (None, None) when there is nothing to load

**Zero-stall saves** (``ordering: optimizer``, async only; the default ``host`` keeps
``save_checkpoint`` blocked until every byte is in host memory). The contract, what is ordered where:

- ``save_checkpoint`` returns once every file's state is *frozen* (:mod:`.freeze`: containers copied,
  CPU tensors up to 64 MiB cloned, other objects such as the loss scaler deep-copied, a CUDA event
  recorded on the current stream). A stager thread then lays each file out and enqueues its
  device-to-host copies on a side stream that waits for that event. A state that cannot be frozen
  (ZeRO-Offload's large CPU partitions, tensor subclasses) is laid out before the return, its CPU
  tensors and non-tensor values copied into host memory; such a file with no device tensors is waited
  for as with ``host``.
- The module's saved buffers (BatchNorm running statistics and the like, written in place by the
  forward) are cloned on the current stream at save time, so the next forward may run at once.
- The next ``engine.step()`` at a gradient-accumulation boundary (every ``step()`` with
  ``managed_gradient_accumulation: false``), and every ``_take_model_step`` (the pipeline engine's
  optimizer step), first waits until the stager has enqueued every pending save's copies (a host
  wait, usually already over), then makes the current CUDA stream wait for those copies
  (``CopyFence.order``: ``cudaStreamWaitEvent``, the host does not block). Everything DeepSpeed writes
  into saved tensors comes after that point on that stream: the optimizer update, ZeRO's copies from
  the fp32 master into the bf16/fp16 parameters, the loss scaler, the scheduler. Forward and backward
  in between overlap the copies. In DeepSpeed 0.19.8 the optimizer update and the parameter copies run
  on the current stream; its ZeRO side streams (reductions, overflow checks) write gradients only.
  Work on a stream that never waits on the current one is not ordered.
- ``commit`` (from ``step()``, :func:`commit_pending`, ``destroy()``) orders the pending copies the
  same way before a background commit takes the files, and a blocking commit waits for them; ``load``
  and the engine's ``wait()`` wait on the host until they are done (a load writes into tensors the
  copies may still read; a tag not yet committed is refused as torn anyway).
- The hooks wrap ``DeepSpeedEngine.step`` and ``_take_model_step`` at class level (see
  :mod:`.zero_stall`), installed by the engine itself: ``install()``/``attach()`` users change only
  the setting.

What this cannot order: tensors the caller hands DeepSpeed in ``client_state`` and changes before the
next optimizer step (clone them, or use ``host``), and GPU writes on streams that never wait on the
trainer's stream. DeepSpeed's ``CheckpointEngine`` door has no way to say "order your next writes
after my copies" (its ``save()`` is synchronous by contract), which is why the step is hooked; the
same holds for DCP's ``async_save`` door, which completes its staging only after a host wait.

**Warm first save** (``prepare_pool``, on by default for async saves): after the engine's first
optimizer step (or at :func:`attach` of an engine that has stepped), the rank's checkpoint bytes are
estimated from its live tensors (parameters and buffers, fp32 master partitions, optimizer state,
slightly over) and ``cpuckpt.prepare_pool`` creates, pre-touches and pins the host pool on a
background thread; a save that comes earlier waits for the remainder only.

Importing this module does not import DeepSpeed; the engine class is loaded on first use.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cpuckpt.tier.tagmarker import LatestTag, TagMarker, TagStatus, check_tag, find_latest, require_complete

from .settings import Settings, resolve_settings

__all__ = ["LatestTag", "Settings", "TagMarker", "TagStatus", "attach", "check_before_load", "check_tag",
           "commit_pending", "find_latest", "install", "installed", "load_latest", "make_engine",
           "require_complete", "select_tag", "uninstall"]

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}  # "original": DeepSpeed's factory, "config": install()'s settings


def _require_deepspeed() -> Any:
    try:
        import deepspeed.runtime.engine as ds_engine
    except ImportError as e:
        raise ImportError("cpuckpt.integrations.deepspeed needs DeepSpeed: pip install 'cpuckpt[deepspeed]'") from e
    return ds_engine


def make_engine(config: Settings | Mapping[str, Any] | str | os.PathLike | None = None,
                ds_config: Any = None, *, config_wins: bool = False) -> Any:
    """Build a :class:`~cpuckpt.integrations.deepspeed.engine.CpuckptCheckpointEngine`.

    Args:
        config: adapter settings (``Settings``, mapping, YAML path, or None for defaults).
        ds_config: DeepSpeed's config object or dict; its ``"cpuckpt"`` block, if any, wins over
            ``config`` unless ``config_wins``.

    Returns:
        The engine, or None when the settings say ``enabled: false``.
    """
    from .engine import CpuckptCheckpointEngine

    params = getattr(ds_config, "_param_dict", ds_config)
    block = params.get("cpuckpt") if isinstance(params, Mapping) else None
    if config_wins and isinstance(config, Settings):
        settings = config
    else:
        # attach(): the explicit settings win key by key; the block's "enabled: false" does not stop it
        settings = resolve_settings(config, block, block_wins=not config_wins)
    if not settings.enabled:
        return None
    return CpuckptCheckpointEngine(settings, ds_config if not isinstance(ds_config, Mapping) else None)


def install(config: Settings | Mapping[str, Any] | str | os.PathLike | None = None) -> None:
    """Make every later ``deepspeed.initialize`` use cpuckpt's checkpoint engine.

    Replaces ``deepspeed.runtime.engine.create_checkpoint_engine`` (the name DeepSpeed's engine
    calls) with a factory returning our engine; DeepSpeed's sources are not modified. Calling it
    again replaces the settings. Undo with :func:`uninstall`.

    Args:
        config: adapter settings: a ``Settings``, a mapping, a YAML path (``configs/deepspeed.yaml``)
            or None for defaults. A ``"cpuckpt"`` block in the ds_config overrides them.

    Raises:
        ImportError: DeepSpeed is not installed.
        ConfigError: the settings are invalid (checked now, not at ``initialize``).
    """
    ds_engine = _require_deepspeed()
    resolve_settings(config)  # validate early
    from .zero_stall import reserve_when_built

    reserve_when_built()  # initialize then hands the built engine to ours (memory_save_dir)
    with _LOCK:
        original = _STATE.get("original", ds_engine.create_checkpoint_engine)

        def create_checkpoint_engine(config_params: Any, groups: Any, zero_stage: int, has_moe_layers: bool,
                                     optimize_dp_state: bool) -> Any:
            engine = make_engine(_STATE.get("config"), config_params)
            if engine is None:
                return original(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state)
            return engine

        create_checkpoint_engine.__wrapped__ = original  # type: ignore[attr-defined]
        _STATE["original"] = original
        _STATE["config"] = config
        ds_engine.create_checkpoint_engine = create_checkpoint_engine


def uninstall() -> None:
    """Give DeepSpeed its own engine factory back (engines already built keep theirs)."""
    with _LOCK:
        original = _STATE.pop("original", None)
        _STATE.pop("config", None)
        if original is not None:
            _require_deepspeed().create_checkpoint_engine = original


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "original" in _STATE


def attach(engine: Any, config: Settings | Mapping[str, Any] | str | os.PathLike | None = None) -> Any:
    """Switch an already-built DeepSpeed engine to cpuckpt's checkpoint engine.

    Commits the old engine's pending checkpoint first (collective: call on every rank). Which ranks
    write the model states is recomputed the way ``initialize`` does it. ``config`` wins over the
    ds_config's ``"cpuckpt"`` block here (attaching is explicit). An engine that has already stepped
    gets its host pool prepared now (``prepare_pool``).

    Returns:
        The new checkpoint engine (the old one stays when the settings say ``enabled: false``).
    """
    old = engine.checkpoint_engine
    new = make_engine(config, getattr(engine, "_config", None), config_wins=True)
    if new is None:
        return old
    if old is not None and old.is_decoupled():
        if old.get_commit_info() is not None:
            engine._commit_decoupled_checkpoint()
        old.cleanup()
    engine.checkpoint_engine = new
    from deepspeed.utils import groups

    dp_rank = groups._get_sequence_data_parallel_rank()
    rank = engine.local_rank if engine.use_node_local_storage() else dp_rank
    engine.save_non_zero_checkpoint = new.is_data_parallel_writer(rank) or (
        engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group())
    new.engine_built(engine)  # binds it (memory_save_dir: the slots reserved now)
    if getattr(engine, "global_steps", 0) > 0:
        new.after_optimizer_step(engine)
    return new


def commit_pending(engine: Any) -> None:
    """Commit the engine's last checkpoint now and wait for it (every rank): durable files, then ``latest``.

    Also waits for a background commit started by ``engine.step()``, and raises its failure.
    """
    ckpt = engine.checkpoint_engine
    if ckpt is not None and ckpt.is_decoupled() and ckpt.get_commit_info() is not None:
        engine._commit_decoupled_checkpoint()
    if ckpt is not None and hasattr(ckpt, "wait"):
        ckpt.wait()  # a background commit: durable and `latest` written when this returns


def check_before_load(save_dir: str | os.PathLike, tag: str | None = None, *, verify: bool = True,
                      allow_unmarked: bool = False) -> TagMarker | None:
    """Refuse, on every rank, a tag that is not complete; call it on every rank before ``load_checkpoint``.

    Every rank checks the marker and every listed file's size; with ``verify``, each rank also
    reads its share of the files (those it wrote, when the world size is the saving one) and
    compares every chunk's checksum (crc32c; blocksum32 in a memory tag). One all-gather of the outcomes
    (when torch.distributed is initialised) makes every rank raise the same error.

    Args:
        save_dir: the directory to load from (``save_dir``, or a memory tag's ``<RAM root>/tags``).
        tag: the tag; None: the one ``save_dir/latest`` names.
        verify: compare the checksums the marker records (files saved with ``integrity.checksum: none``
            are checked by size only).
        allow_unmarked: accept a tag that stock DeepSpeed wrote (no cpuckpt files to check).

    Returns:
        The tag's marker (None for an accepted unmarked tag).

    Raises:
        IntegrityError: the tag is missing, torn, or unmarked (unless allowed); ``CheckpointCorrupt``
            when a chunk's checksum differs. The same class and message on every rank.
    """
    import torch.distributed as dist

    from cpuckpt.backend.collectives import checkpoint_group, gather_failures, raise_if_failed
    from cpuckpt.tier.tagmarker import owned_files, refusal, verify_files

    group = checkpoint_group()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    error: BaseException | None = None
    marker: TagMarker | None = None
    try:
        marker = require_complete(save_dir, tag, allow_unmarked=allow_unmarked)
        if verify and marker is not None:
            tag_dir = Path(save_dir) / marker.tag
            problems = verify_files(tag_dir, marker, owned_files(marker, rank, world, tag_dir))
            if problems:
                raise refusal(TagStatus(tag_dir, "torn", marker, tuple(problems)))
    except Exception as e:
        error = e
    raise_if_failed(gather_failures(error, rank, group), f"checking DeepSpeed checkpoint {save_dir} before loading",
                    error)
    return marker


def select_tag(save_dir: str | os.PathLike, *, fallback_on_corrupt: bool = True) -> LatestTag | None:
    """The newest complete tag of ``save_dir`` whose every listed file passes its checksums, on every rank.

    Collective (every rank calls it): rank 0's listing (:func:`cpuckpt.tier.tagmarker.scan_tags`: the complete tags,
    ``latest``'s first, and those committed but damaged since) is broadcast, then each candidate goes through
    :func:`check_before_load` with ``verify=True`` (each rank reads its share; one all-gather, the same outcome
    everywhere). A tag that fails with ``IntegrityError`` (``CheckpointCorrupt``: a chunk's crc32c) is logged as a
    WARNING and the next newest is tried, by every rank together (a bad file on one rank moves them all). A tag
    committed but incomplete now (a file truncated or missing, its marker garbled) is no torn save: passing over it
    to an older tag is a WARNING naming it and why.

    Returns:
        The tag to load, or None when ``save_dir`` has no complete tag and none committed.

    Raises:
        CheckpointCorrupt: tags were committed but none verifies (each one's reason in the message): never a fresh
            start over them; with ``fallback_on_corrupt=False``, the newest does not verify or is damaged.
        ConfigError: ``save_dir`` is a URL.
    """
    from cpuckpt.backend.collectives import checkpoint_group, from_rank
    from cpuckpt.paths import local_path
    from cpuckpt.tier.tagmarker import scan_tags

    root = Path(local_path(save_dir, "DeepSpeed save_dir"))
    candidates, damaged = from_rank(lambda: scan_tags(root), checkpoint_group(),
                                     f"listing the DeepSpeed tags of {root}")
    return _first_verified(candidates, damaged, str(root), fallback_on_corrupt=fallback_on_corrupt)


_STEP_NAME = re.compile(r"global_step(\d+)$")  # DeepSpeed's default tag names


def _step_of(damaged: TagStatus) -> int | None:
    """A damaged tag's step: its marker's, or for a garbled marker the one its name says (DeepSpeed's default)."""
    if damaged.marker is not None:
        return damaged.marker.global_step
    m = _STEP_NAME.search(damaged.path.name)
    return int(m.group(1)) if m else None


def _newer(damaged: TagStatus, found: LatestTag) -> bool | None:
    """Whether the damaged tag is newer than ``found`` (a later step); None: no step to tell by. A tag stock
    DeepSpeed wrote (no step) comes first only because ``latest`` names it: nothing is newer than it."""
    step = _step_of(damaged)
    if found.global_step is None and found.marker is None:
        return False
    if step is None or found.global_step is None:
        return None
    return step > found.global_step


def _damage(status: TagStatus) -> str:
    return f"{status.path}: committed, but incomplete now ({'; '.join(status.problems)})"


def _first_verified(candidates: list[LatestTag], damaged: list[TagStatus], where: str, *, fallback_on_corrupt: bool,
                    before_check: Any = None) -> LatestTag | None:
    """The first of ``candidates`` whose files pass :func:`check_before_load` (verify) on every rank, falling back
    past one that does not, or past a newer tag of ``damaged`` (committed, incomplete now), with a WARNING naming it,
    unless ``fallback_on_corrupt`` is false. Collective; ``damaged`` is the same on every rank."""
    import logging

    from cpuckpt.errors import CheckpointCorrupt, IntegrityError

    log = logging.getLogger(__name__)
    failures: list[str] = []
    pending = list(damaged)
    for found in candidates:
        for status in [s for s in pending if _newer(s, found)]:
            pending.remove(status)
            if not fallback_on_corrupt:
                raise CheckpointCorrupt(f"DeepSpeed tag {_damage(status)}; not loading an older tag "
                                        "(fallback_on_corrupt is off: repair or remove that tag, or turn it on)")
            failures.append(_damage(status))
            log.warning("cpuckpt: DeepSpeed tag %s; falling back to the next newest complete tag", _damage(status))
        try:  # a memory tag's restore from a partner's replica (before_check) fails alike on every rank
            if before_check is not None:
                before_check(found)
            marker = check_before_load(found.directory, found.tag, verify=True, allow_unmarked=found.marker is None)
        except IntegrityError as e:
            if not fallback_on_corrupt:
                raise
            failures.append(str(e))
            log.warning("cpuckpt: DeepSpeed tag %s does not verify (%s); falling back to the next newest complete "
                        "tag", found.directory / found.tag, e)
            continue
        for status in [s for s in pending if _newer(s, found) is None]:  # named, never raised over alone
            pending.remove(status)
            log.warning("cpuckpt: DeepSpeed tag %s; no step tells whether it is newer than %s, which is loaded",
                        _damage(status), found.directory / found.tag)
        return LatestTag(found.directory, found.tag, found.global_step, marker)  # type: ignore[arg-type]
    failures += [_damage(s) for s in pending]
    if failures:
        raise CheckpointCorrupt(f"no DeepSpeed tag in {where} loads: {'; '.join(failures)}; not starting from scratch "
                                "over tags that were committed (repair or remove them to start afresh)")
    return None


def load_latest(engine: Any, save_dir: str | os.PathLike, *, fallback_on_corrupt: bool | None = None,
                **load_kwargs: Any) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` of the newest tag that verifies (:func:`select_tag`), on every rank.

    DeepSpeed's own ``load_checkpoint(save_dir)`` loads whatever ``latest`` names, damaged or not; this
    checks every file's crc32c first (before DeepSpeed writes anything into the engine) and falls back
    to the next newest complete tag on every rank together. With ``memory_tier``, the candidates are the
    complete tags of both tiers, newest global step first (memory first on a tie): a memory tag newer
    than the durable ``latest`` wins, and an older one never wins over a newer durable one; the memory
    tier's next save then goes past the slot loaded. A tag of ``save_dir`` committed but damaged since is passed
    over with a WARNING, never taken for a torn save. ``fallback_on_corrupt``: default the engine's setting
    (``fallback_on_corrupt``, true), else true. ``load_kwargs`` go to ``load_checkpoint``.

    Returns:
        What ``load_checkpoint`` returns (``load_path``, ``client_state``); ``(None, None)`` when there is
        no complete tag and none was committed.

    Raises:
        CheckpointCorrupt: tags were committed but none loads (see :func:`select_tag`): never a fresh start.
    """
    ckpt = getattr(engine, "checkpoint_engine", None)
    if fallback_on_corrupt is None:
        fallback_on_corrupt = getattr(getattr(ckpt, "settings", None), "fallback_on_corrupt", True)
    memory = None
    if hasattr(ckpt, "memory_for"):
        from cpuckpt.backend.collectives import from_rank

        # save_dir listed once on rank 0 (a tier made now lists it at its start): the candidates, the damaged tags
        with ckpt.one_listing():
            memory = ckpt.memory_for(save_dir)
            if memory is not None:
                candidates = memory.agreed_candidates()
                # the damaged tags of save_dir (rank 0's look) and of every node's slots (its leader's)
                damaged = from_rank(memory.damaged_tags, memory.tier.group, f"listing the damaged DeepSpeed tags of "
                                    f"{save_dir}") + memory.agreed_damaged_slots()
    if memory is None:
        found = select_tag(save_dir, fallback_on_corrupt=bool(fallback_on_corrupt))
    else:
        found = _first_verified(candidates, damaged, f"{save_dir} and its memory tier",
                                fallback_on_corrupt=bool(fallback_on_corrupt), before_check=memory.before_load)
    if found is None:
        return None, None
    if memory is None:
        return engine.load_checkpoint(str(found.directory), tag=found.tag, **load_kwargs)
    from cpuckpt.backend.collectives import agree_or_raise

    out, error = (None, None), None
    try:
        out = engine.load_checkpoint(str(found.directory), tag=found.tag, **load_kwargs)
    except BaseException as e:  # one rank's failed load: raised on every rank, not left to the next collective
        error = e
    agree_or_raise(error, memory.tier.rank, memory.tier.group, f"loading DeepSpeed tag {found.tag} of "
                   f"{found.directory}")
    memory.loaded(found)
    return out
