"""DeepSpeed ``CheckpointEngine`` over cpuckpt's pipeline. Wires torchfile -> SaveJob -> commit.

DeepSpeed calls, per ``save_checkpoint`` (every rank): ``create(info)``, then ``save(state_dict,
path)`` once per file this rank writes, and, because this engine is *decoupled*, ``commit`` later:
from ``engine.step()`` before the next optimizer update, or from ``engine.destroy()`` through
``cleanup()``. ``get_commit_info()`` hands DeepSpeed the tag with ``save_latest=False``, so
DeepSpeed never writes ``latest`` itself (it would write it in place, not atomically). Committing
means: wait until this rank's files and directory are fsynced, agree with every rank (one gloo
all-gather of failure reports and written files), then rank 0 writes the tag's completion marker
and ``latest`` via tmp + fsync + rename.

With ``background_commit`` (the default for async saves) the commit DeepSpeed requests from
``engine.step()`` runs on a background thread with its own gloo group, so the step does not wait
for storage: the tensors already sit in the host pool. The next ``create()`` (the next save),
``cleanup()`` (``engine.destroy()``) and :meth:`CpuckptCheckpointEngine.wait` wait for it and raise
its failure, which every rank learns from the same all-gather (the same error on every rank); with the
memory tier so does the end of the ``step()`` that requested it where saves come every iteration (from this
engine's second save on) or always with ``memory.max_uncommitted: 1``, so that a kill after the trainer's log line
then loses one iteration at most
(:meth:`CpuckptCheckpointEngine.after_boundary_step`: a memory or a disk checkpoint alike; DeepSpeed's pipeline
engine calls no ``step()``, so there it waits only at the next save). Commits that DeepSpeed makes right after
``create`` with the same info object (``save_16bit_model``), and the one in ``cleanup``, block: their callers expect
durable files on return.

Completion marker (:mod:`.marker`): before a rank writes its first byte into ``<save_dir>/<tag>``,
it removes the tag's ``.cpuckpt-complete.json`` and creates ``.cpuckpt-saving`` (directory
fsynced). The commit's all-gather carries each rank's files (sizes, per-chunk crc32c) and the
global step; rank 0 then writes the marker atomically, then ``latest``, and a second all-gather
tells every rank the outcome. ``load`` refuses a file of a torn tag. With ``memory_tier`` (:mod:`.memory`), a
checkpoint's tag files go into a slot of the core memory tier's RAM root instead (the same names, straight into
its reused images), rank 0 (each node's leader) commits the slot, and each rank queues the persist of its files
to ``save_dir/<tag>`` for its writer process when the global step is due (``memory.persist_every``); the
durable marker and ``latest`` are then the writer's (rank 0's, once every rank's files are durable).

With ``ordering: optimizer`` an async ``save()`` returns once the state is frozen (:mod:`.freeze`); a
stager thread lays the file out and enqueues its device-to-host copies after the call. The copies are
fenced, and the next optimizer step of the DeepSpeed engine orders its stream after every fence not yet
ordered (:mod:`.zero_stall`, and the contract in :mod:`cpuckpt.integrations.deepspeed`). ``commit``
orders them too before a background commit takes the files; ``load`` and
:meth:`CpuckptCheckpointEngine.wait` wait on the host until the copies are done. With ``prepare_pool``
the host pool is prepared after the first optimizer step.

Every file has exactly the name and the bytes layout DeepSpeed's ``torch.save`` would give it, so
``zero_to_fp32``, ``ds_to_universal`` and a stock ``TorchCheckpointEngine`` read it (the two hidden
files are never opened by them).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from cpuckpt.api import PoolPreparation, prepare_pool_in_background
from cpuckpt.backend.collectives import checkpoint_group, gather_failures, new_gloo_group, peers, raise_if_failed
from cpuckpt.config import Config
from cpuckpt.errors import ConfigError, CpuckptError, FailureReport, StagingError
from cpuckpt.format.manifest import FileEntry
from cpuckpt.format.unpickle import with_safe_globals
from cpuckpt.paths import local_path
from cpuckpt.tier.tagmarker import (
    MARKER_NAME,
    SAVING_NAME,
    TagFile,
    check_tag,
    new_marker,
    open_tag,
    refusal,
    write_marker,
)
from cpuckpt.transfer.device_snapshot import DeviceSnapshots
from cpuckpt.transfer.files import write_atomic
from cpuckpt.transfer.save_job import SaveJob
from cpuckpt.transfer.staging import get_pool, pool_state
from cpuckpt.transfer.threads import new_executor, wait_future

from .freeze import Frozen, NotFreezable, freeze
from .memory import Claim, DeepSpeedMemory, TagListings
from .settings import Settings, resolve_settings
from .torchfile import chunk_count, layout_torch_file
from .zero_stall import (
    bind_at_save,
    buffer_pointers,
    estimate_checkpoint_bytes,
    estimate_file_bytes,
    order_engine_steps,
    snapshot_buffers,
)

__all__ = ["ENGINE_NAME", "CpuckptCheckpointEngine", "safe_globals_for_deepspeed"]

logger = logging.getLogger(__name__)

ENGINE_NAME = "CpuckptCheckpointEngine"


def safe_globals_for_deepspeed() -> list[Any]:
    """The non-tensor globals DeepSpeed 0.19 puts in its checkpoint files, for ``weights_only`` loads.

    Found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on real ZeRO-1/2/3 fp32
    files (the test-suite checks every file against this list): ``ZeroStageEnum`` (``zero_stage``
    in optimizer files), ``LossScaler`` (``loss_scaler``; ``DynamicLossScaler`` with fp16 dynamic
    scaling), ``fragment_address`` (``param_slice_mappings`` of ZeRO-1/2), and
    ``argparse.Namespace`` (``args`` of the model states when ``initialize`` was given ``args``).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, LossScalerBase
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScalerBase, LossScaler, DynamicLossScaler, fragment_address, argparse.Namespace]


def _log_failure(fut: cf.Future[None]) -> None:
    err = fut.exception()
    if err is not None:
        logger.error("background commit of a DeepSpeed checkpoint failed (raised at the next save, "
                     "commit_pending or destroy, or the step that waits for it): %s", err)


@dataclass
class _Uncommitted:
    """The checkpoint an engine created and has not committed yet (``where``: its tag directory; ``pid``: the process
    that created it), read by the engine's finalizer: an engine dropped, or a process exiting, with one says so (its
    tag stays torn)."""

    where: str | None = None
    pid: int = 0


def _warn_uncommitted(state: _Uncommitted) -> None:
    """At exit (or once the engine is gone): a checkpoint created and never committed is torn; nothing else said so.
    A forked child inherits the engine and its exit hooks, not its checkpoint: it says nothing."""
    if state.where is not None and state.pid == os.getpid():
        logger.warning("cpuckpt: the DeepSpeed checkpoint %s was never committed (no engine.step(), "
                       "commit_pending() or engine.destroy() after its save_checkpoint): it is torn, and the newest "
                       "complete tag stays the restart point", state.where)


@dataclass
class _Checkpoint:
    """One ``save_checkpoint`` (or ``save_16bit_model``) of this rank, from ``create`` to its commit."""

    info: CheckpointCommitInfo
    claim: Claim | None = None  # memory_tier: the slot its tag's files go into (None: save_dir/tag)
    jobs: list[SaveJob] = field(default_factory=list)  # async saves still being written
    written: list[tuple[Path, FileEntry]] = field(default_factory=list)  # sync saves, durable
    opened: set[Path] = field(default_factory=set)  # tag directories made incomplete by this rank
    global_step: int | None = None  # from the model states file, when this rank wrote one
    ds_step: int | None = None  # DeepSpeed's global step at create() (the same on every rank), when bound
    error: BaseException | None = None  # a deferred save's staging failed (raised by the commit)

    @property
    def tag_dir(self) -> Path:
        """The tag's directory as DeepSpeed names it, ``save_dir/tag``."""
        return Path(os.path.abspath(self.info.save_dir)) / self.info.tag

    @property
    def memory(self) -> bool:
        return self.claim is not None

    @property
    def files_dir(self) -> Path:
        """Where the tag's files and marker go: ``save_dir/tag``, or the memory slot."""
        return self.claim.slot if self.claim is not None else self.tag_dir


class CpuckptCheckpointEngine(CheckpointEngine):
    """Writes DeepSpeed's checkpoint files with cpuckpt: one copy into the host pool, parallel pwrite.

    Args:
        settings: adapter settings (a ``Settings``, a mapping, a YAML path or None for defaults).
        config_params: DeepSpeed's config object (unused; DeepSpeed's engines take it).
    """

    def __init__(self, settings: Settings | dict[str, Any] | str | None = None, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.settings = settings if isinstance(settings, Settings) else resolve_settings(settings)
        self._info: CheckpointCommitInfo | None = None
        self._ckpt: _Checkpoint | None = None
        self._jobs: list[SaveJob] = []
        self._staging: list[cf.Future[None]] = []  # deferred saves the stager thread lays out (.freeze)
        self._stager: cf.ThreadPoolExecutor | None = None
        self._background: cf.Future[None] | None = None
        self._committer: cf.ThreadPoolExecutor | None = None
        self._commit_group: Any = None
        self._memory: DeepSpeedMemory | None = None  # memory_tier: made at the first checkpoint (or load_latest)
        self._listings = TagListings()  # memory_tier: a restart's one listing of save_dir (load_latest holds it)
        self._snapshots = DeviceSnapshots()  # staging.device_snapshot: this engine's device buffers
        self.last_save_s = 0.0
        self.last_commit_s = 0.0
        # ordering optimizer: jobs whose device copies no GPU work has been ordered after yet
        self._unordered: list[SaveJob] = []
        self._ds_engine: Any = None  # weakref to the DeepSpeed engine, set by its save_checkpoint or step (or attach)
        self._model_states_writer: bool | None = None  # DeepSpeed's own choice (save_non_zero_checkpoint)
        self._preparer: PoolPreparation | None = None
        # memory_tier: a tag's files go into the tier's images, not through the pool
        self._prepare_decided = (not (self.settings.async_save and self.settings.prepare_pool)
                                 or self.settings.memory_tier)
        self._slots_reserved = False  # memory_save_dir: done once, when DeepSpeed's engine is built (engine_built)
        self._uncommitted = _Uncommitted()
        # DeepSpeed's global step at the last two saves whose commit went to the background (after_boundary_step)
        self._save_steps: tuple[int | None, int | None] = (None, None)
        weakref.finalize(self, _warn_uncommitted, self._uncommitted)  # at exit too, while the engine lives
        if self.settings.memory_save_dir and not self.settings.memory_tier:  # e.g. the tier turned off in ds_config
            logger.warning("cpuckpt: memory_save_dir %s is ignored: memory_tier is off", self.settings.memory_save_dir)
        if self.settings.async_save:
            order_engine_steps()  # the step hooks: ordering optimizer, and prepare_pool after the first step
        if self.settings.memory_tier:
            bind_at_save()  # across nodes, create() chooses who writes the model states

    # -- DeepSpeed's interface -------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """A new checkpoint begins (every rank). A previous one not yet committed is committed first,
        and a background commit still running is waited for (its failure raised here)."""
        local_path(info.save_dir, "DeepSpeed save_dir")  # a URL (s3://) is refused: not a local ./s3:/ directory
        if self._info is not None:
            self.commit(self._info)
        self._wait_background()
        self._join_prepare()
        # before this checkpoint is taken on: a refusal here (a failed persist, two nodes) leaves nothing to commit
        memory = self.memory_for(info.save_dir) if self.settings.memory_tier else None
        if memory is not None and memory.across_nodes:
            self._require_node_copies(memory)
        claim = memory.claim() if memory is not None else None
        self._write_model_states_per_node(claim is not None and memory is not None and memory.across_nodes
                                          and memory.names)
        self._info = info
        ds = self._bound_engine()
        self._ckpt = _Checkpoint(info, claim=claim, ds_step=getattr(ds, "global_steps", None))
        self._uncommitted.where, self._uncommitted.pid = str(self._ckpt.tag_dir), os.getpid()

    def _require_node_copies(self, memory: DeepSpeedMemory) -> None:
        """Across nodes every node's slot must hold every file its ranks load: refused (the same ``ConfigError`` on
        every rank, before the slot is claimed) where DeepSpeed's loads read other ranks' files that a node's
        leader cannot write itself."""
        ds = self._bound_engine()
        why = ("the DeepSpeed engine is not known (save through engine.save_checkpoint)" if ds is None else
               "MoE layers (their expert files are written by one data-parallel rank)" if ds.has_moe_layers else
               "zero_optimization.elastic_checkpoint (every rank reads every rank's optimizer file)"
               if ds.zero_elastic_checkpoint() else
               "pipeline or model parallelism (a node's leader writes only its own model-parallel rank's model "
               "states; the other ranks' files stay on the node of data-parallel rank 0)"
               if getattr(ds, "pipeline_parallelism", False) or getattr(ds, "mp_world_size", 1) > 1 else "")
        if why:
            raise ConfigError(f"memory_tier across nodes ({memory.tier.nodes.nodes} RAM roots) for {memory.save_dir}: "
                              f"{why}; run without memory_tier or on one node")

    def _write_model_states_per_node(self, leader: bool) -> None:
        """ZeRO-1/2 across nodes: this node's leader also writes the model-states file of a memory checkpoint into its
        node's slot (every rank loads it; its values are the same on every data-parallel rank). Set per checkpoint:
        a checkpoint that goes to disk keeps DeepSpeed's one writer per file."""
        ds = self._bound_engine()
        if ds is None:
            return
        if self._model_states_writer is None:
            self._model_states_writer = bool(ds.save_non_zero_checkpoint)
        extra = leader and not ds.zero_optimization_partition_weights()  # ZeRO-3: every rank writes its own
        ds.save_non_zero_checkpoint = self._model_states_writer or extra

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to exactly ``path`` as a torch.save-compatible file.

        A file of the checkpoint's tag directory goes into its memory slot instead (``memory_tier``). Before
        this rank's first byte into a tag directory (or slot), its completion marker is removed (see
        :mod:`.marker`).

        Async: returns once every tensor byte is copied into the host pool; the caller may then
        change its tensors. With ``ordering: optimizer``: once the state is frozen (:mod:`.freeze`:
        containers copied, CPU tensors cloned, the module's buffers cloned, a CUDA event recorded); the
        stager thread then lays the file out and enqueues its device-to-host copies, which wait for that
        event. GPU tensors may be written only by work the next optimizer step orders after the copies
        (that step first waits until the stager has enqueued them). A state that cannot be frozen is laid
        out here and returns once its copies are enqueued (a job without device copies is waited for as
        with ``host``). Otherwise returns once the file is durable. A failure raises here (or, async, at
        ``commit``: a deferred save's failure always does, on every rank).
        """
        t0 = time.perf_counter()
        st = self.settings
        ckpt = self._ckpt
        try:
            target, in_tag = self._route(path)
        except StagingError as e:
            if ckpt is None:
                raise
            ckpt.error = ckpt.error or e  # raised by the commit on every rank (this rank alone must not raise here)
            logger.error("rank %s: %s", dist.get_rank() if dist.is_initialized() else 0, e)
            return
        memory = self._memory if ckpt is not None and ckpt.memory and in_tag else None
        cfg = memory.tier.memory_config if memory is not None else st.core
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        overlap = st.async_save and st.ordering == "optimizer"
        self._join_prepare()
        try:
            if overlap and isinstance(state_dict, Mapping):
                state_dict = snapshot_buffers(state_dict, self._buffers())
            if ckpt is not None and isinstance(state_dict, Mapping) and isinstance(state_dict.get("global_steps"), int):
                ckpt.global_step = state_dict["global_steps"]
            if overlap and ckpt is not None and self._defer(state_dict, target, in_tag, cfg, rank, ckpt):
                self.last_save_s = time.perf_counter() - t0
                return
            self._collect_staging()  # files staged on this thread come after those deferred before them
            job = self._start_job(state_dict, target, in_tag, cfg, rank, ckpt)
            if st.async_save:
                self._jobs.append(job)
                if overlap and job.fence is not None:
                    self._unordered.append(job)  # host bytes are in; the next optimizer step orders after the rest
                else:
                    job.wait_staged()
            else:
                entries = job.wait_done()
                if ckpt is not None:
                    ckpt.written.append((target, entries[0]))
        except BaseException:
            self._abandon()
            raise
        self.last_save_s = time.perf_counter() - t0
        logger.debug("rank %d: %s staged in %.3f s (%d bytes)", rank, target, self.last_save_s, job.stats.nbytes)

    def _start_job(self, state: Any, target: Path, in_tag: bool, cfg: Config, rank: int, ckpt: _Checkpoint | None,
                   *, start_after: Any = None) -> SaveJob:
        """Lay ``state`` out as ``target``'s file and start its job (the tag opened first, the pool reserved)."""
        st = self.settings
        if ckpt is not None and in_tag and target.parent not in ckpt.opened:
            open_tag(target.parent, fsync=cfg.io.fsync)
            ckpt.opened.add(target.parent)
        files, sources = layout_torch_file(state, cfg, storage_alignment=st.storage_alignment)
        # Sync saves stream through the pool (staging.pool_bytes; 0: a small one, bounded host memory).
        mode = "snapshot" if st.async_save else "streaming"
        sink = None
        if ckpt is not None and ckpt.claim is not None and in_tag and self._memory is not None:
            sink = self._memory.sink(ckpt.claim, target.name, files, cfg, rank)  # straight into the slot's image
        elif st.async_save:
            self._reserve_pool(chunk_count(files[0].nbytes, cfg))
        job = SaveJob(target.parent, [target.name], files, sources, cfg, rank=rank, mode=mode, start_after=start_after,
                      sink=sink, snapshots=self._snapshots)
        job.start()
        return job

    def _defer(self, state: Mapping[str, Any], target: Path, in_tag: bool, cfg: Config, rank: int,
               ckpt: _Checkpoint) -> bool:
        """Freeze ``state`` (:mod:`.freeze`) and leave its layout and staging to the stager thread; False
        when it cannot be frozen (the caller then stages it on this thread)."""
        try:
            frozen = freeze(state)
        except NotFreezable as e:
            logger.debug("rank %d: %s is staged on the caller's thread: %s", rank, target, e)
            return False
        self._staging.append(self._stager_executor().submit(self._stage_frozen, frozen, target, in_tag, cfg,
                                                            rank, ckpt))
        return True

    def _stage_frozen(self, frozen: Frozen, target: Path, in_tag: bool, cfg: Config, rank: int,
                      ckpt: _Checkpoint) -> None:
        """On the stager thread: lay out and start a deferred save (its copies wait for ``frozen.event``).

        A failure is kept in ``ckpt`` (its commit raises it on every rank), not raised: the thread that
        collects this (:meth:`_collect_staging`) may be the optimizer step, where one rank raising alone
        would leave the others in the step's collectives.
        """
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(frozen.device) if frozen.device is not None else contextlib.nullcontext():
                job = self._start_job(frozen.state, target, in_tag, cfg, rank, ckpt, start_after=frozen.event)
        except BaseException as e:
            ckpt.error = ckpt.error or e
            logger.error("rank %d: staging %s failed (raised by the checkpoint's commit): %s", rank, target, e)
            return
        self._jobs.append(job)  # only this thread touches _jobs while a deferred save is being staged
        if job.fence is not None:
            self._unordered.append(job)
        logger.debug("rank %d: %s laid out and staged after the call in %.3f s", rank, target,
                     time.perf_counter() - t0)

    def _collect_staging(self) -> None:
        """Wait until the stager thread has started every deferred save (their copies are enqueued)."""
        futures, self._staging = self._staging, []
        for i, fut in enumerate(futures):
            try:
                wait_future(fut, self.settings.core.timeout_s,
                            "laying out and staging a DeepSpeed checkpoint file after its save() returned")
            except BaseException:
                self._staging = futures[i:] + self._staging  # still owed
                raise

    def _stager_executor(self) -> cf.ThreadPoolExecutor:
        if self._stager is None:
            self._stager = new_executor(1, "cpuckpt-ds-stage")
        return self._stager

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(weights_only=True)`` with DeepSpeed's few globals allowed; never unrestricted.

        A background commit still running is waited for first (its files may be the ones asked for),
        and so are the device-to-host copies of saves not yet committed (``ordering: optimizer``): the
        caller writes the loaded values into tensors those copies may still read.
        A file of a tag directory that cpuckpt's engine left torn (its save never committed, or a
        listed file missing or of another size) is refused, on every rank that loads from it; files
        of tags written by stock DeepSpeed (no cpuckpt files) load as they are.

        Raises:
            IntegrityError: the tag is torn (the message names it and what is wrong).
        """
        local_path(path, "DeepSpeed checkpoint file")
        self.wait()
        tag_dir = Path(path).parent
        if (tag_dir / MARKER_NAME).exists() or (tag_dir / SAVING_NAME).exists():
            status = check_tag(tag_dir.parent, tag_dir.name)
            if not status.complete and status.state != "unmarked":  # (unmarked: stock DeepSpeed saved it again)
                raise refusal(status)
        return with_safe_globals(lambda: torch.load(path, map_location=map_location, weights_only=True),
                                 safe_globals_for_deepspeed())

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Make the checkpoint durable on every rank, then (rank 0) write its marker and ``latest``.

        Collective: every rank calls it (DeepSpeed does, from ``step()``/``destroy()``). With
        ``background_commit`` the commit requested by ``step()`` continues in the background and
        this returns at once (see the module docstring).

        Raises:
            CpuckptError: this rank's write failed, or another rank's did: the same class and message
                on every rank (``StorageIOError`` with ``errno``/``path`` for an ``OSError``; ``rank``,
                ``failures``), chained to this rank's own error where it has one.
        """
        direct = info is self._info  # DeepSpeed's save_16bit_model commits the very object it created
        self._wait_background()  # commits stay ordered; an earlier failure is raised first
        self.order_pending()  # the caller's next kernels (the optimizer step) come after this checkpoint's copies
        ckpt = self._ckpt if self._ckpt is not None and self._info is not None else _Checkpoint(info)
        self._info = self._ckpt = None
        self._uncommitted.where = None  # a failed commit raises (or, in the background, logs) its own error
        ckpt.jobs, self._jobs = self._jobs, []
        if self.settings.async_save and self.settings.background_commit and not direct:
            self._save_steps = (self._save_steps[1], ckpt.ds_step)
            group = self._background_group()
            fut = self._background_executor().submit(self._finish, ckpt, group)
            fut.add_done_callback(_log_failure)  # told at once, even if nobody waits for it
            self._background = fut
            return True
        self._finish(ckpt, checkpoint_group())
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background commit (if any) and raise its failure; every rank calls it.

        Also waits (host side) until the device-to-host copies of saves not yet committed are done,
        so that the caller may then change any tensor (``ordering: optimizer``).
        """
        self._wait_background(timeout)
        self._settle(timeout)

    def _wait_background(self, timeout: float | None = None) -> None:
        """Wait for a background commit (if any) and raise its failure."""
        fut = self._background
        if fut is None:
            return
        try:
            wait_future(fut, self.settings.core.timeout_s if timeout is None else timeout,
                        "committing the DeepSpeed checkpoint in the background")
        finally:
            if fut.done():  # a timeout keeps it: its slots are still in use, its outcome still owed
                self._background = None

    def _finish(self, ckpt: _Checkpoint, group: Any) -> None:
        """Durable (or, memory tier, in-RAM) files on every rank -> one all-gather -> rank 0: marker, ``latest``
        (memory: the slot's marker and name; every rank queues its persist) -> one all-gather."""
        t0 = time.perf_counter()
        pending = ckpt.info
        error, written = self._wait_jobs(ckpt.jobs)
        error = ckpt.error or error
        rank = dist.get_rank() if group is not None else 0
        root = Path(os.path.abspath(pending.save_dir))
        files_dir = ckpt.files_dir
        mine: dict[str, TagFile] = {}
        entries: dict[str, FileEntry] = {}
        for path, entry in [*ckpt.written, *written]:
            if path.parent == files_dir or files_dir in path.parents:
                name = path.relative_to(files_dir).as_posix()
                mine[name] = TagFile.of(entry, rank)
                entries[name] = entry
        report = (None if error is None else FailureReport.of(error, rank), mine, ckpt.global_step)
        gathered = _all_gather(report, group)
        where = f"in memory ({files_dir})" if ckpt.memory else f"in {root}"
        # Every rank raises the same error (the lowest failing rank's class: StorageIOError with
        # errno/path for an OSError), chained to its own original where it has one.
        raise_if_failed([g[0] for g in gathered], f"checkpoint {pending.tag} {where} ('latest' not updated)", error)
        files: dict[str, TagFile] = {}
        for g in gathered:  # a file several nodes hold (their own model states) is the lowest rank's: it persists it
            for name, f in g[1].items():
                files.setdefault(name, f)
        entries = {name: e for name, e in entries.items() if files[name].rank == rank}
        steps = [g[2] for g in gathered if g[2] is not None]
        step = max(steps) if steps else None
        fsync = self.settings.core.io.fsync and not ckpt.memory
        memory = self._memory if ckpt.claim is not None and files else None
        if files or pending.save_latest:
            # Rank 0 writes; a second collective tells every rank the outcome, so that the marker and
            # ``latest`` are in place (or the failure raised) on every rank when the commit ends.
            final_error: BaseException | None = None
            request = replica = None
            try:
                if memory is not None and ckpt.claim is not None:
                    # queued before the memory commit: the writer waits for it, and a failure here is agreed below
                    request = memory.persist(ckpt.claim, pending.tag, step, entries, pending.save_latest)
                    replica = memory.tier.last_replica
                    if memory.names:  # each node's leader commits its node's slot (rank 0 on one node)
                        listing = memory.node_listing(ckpt.claim, len(gathered), [g[1] for g in gathered], step)
                        memory.commit(ckpt.claim, pending.tag, len(gathered), files, step, listing)
                elif rank == 0:
                    if files:
                        write_marker(files_dir, new_marker(pending.tag, len(gathered), files, step), fsync=fsync)
                    if pending.save_latest:
                        write_atomic(root / "latest", pending.tag.encode(), fsync=fsync)
            except BaseException as e:
                final_error = e
            try:
                raise_if_failed(gather_failures(final_error, rank, group),
                                f"checkpoint {pending.tag}: writing its marker and {root}/latest" if memory is None
                                else f"checkpoint {pending.tag}: committing it in memory ({files_dir})", final_error)
            except BaseException:
                if memory is not None and ckpt.claim is not None:
                    for req in (request, replica):
                        if req is not None:
                            memory.tier.queue.cancel(req.seq, "its memory commit failed")
                    if memory.names:  # a checkpoint failed on every rank is never listed: no marker, no name
                        memory.withdraw(ckpt.claim, pending.tag)
                raise
        self.last_commit_s = time.perf_counter() - t0
        logger.debug("rank %d: checkpoint %s committed %s (%d files)", rank, pending.tag, where, len(files))

    def _route(self, path: str) -> tuple[Path, bool]:
        """(where ``path`` is written, whether it lies in the checkpoint's tag directory)."""
        p = Path(os.path.abspath(path))
        ckpt = self._ckpt
        if ckpt is None:
            return p, False
        tag_dir = ckpt.tag_dir
        if p.parent != tag_dir and tag_dir not in p.parents:
            return p, False
        if ckpt.claim is not None:
            if p.parent != tag_dir:
                raise StagingError(f"memory_tier: {p} lies in a subdirectory of its tag {tag_dir}; a memory slot "
                                   "holds a tag's own files only (run without memory_tier)")
            return ckpt.claim.slot / p.name, True
        return p, True

    def _background_executor(self) -> cf.ThreadPoolExecutor:
        if self._committer is None:
            self._committer = new_executor(1, "cpuckpt-ds-commit")
        return self._committer

    def _background_group(self) -> Any:
        """A gloo group used only by the background committer (created collectively, once)."""
        if self._commit_group is None and dist.is_available() and dist.is_initialized():
            self._commit_group = new_gloo_group(None, self.settings.core.timeout_s)
        return self._commit_group

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        p = Path(os.path.abspath(path))
        ckpt = self._ckpt
        if ckpt is not None and ckpt.claim is not None and p == ckpt.tag_dir:
            return  # a memory checkpoint's tag directory is its slot, which exists
        p.mkdir(parents=True, exist_ok=exist_ok)

    def is_decoupled(self) -> bool:
        # Always: only then does DeepSpeed leave ``latest`` to us and call cleanup() at destroy().
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        if self._info is None:
            return None
        return dataclasses.replace(self._info, save_latest=False)

    def cleanup(self) -> None:
        """``engine.destroy()``: commit the last checkpoint (its ``latest`` included) and wait for it."""
        if self._info is not None:
            self.commit(self._info)
        self.wait()
        self._join_prepare()
        for name in ("_stager", "_committer"):  # idle now: their threads end (a later save starts new ones)
            executor = getattr(self, name)
            if executor is not None:
                executor.shutdown(wait=False)
                setattr(self, name, None)
        self._snapshots.clear()  # the jobs are done: their device buffers go back to the allocator
        memory, self._memory = self._memory, None
        if memory is not None:  # the newest memory checkpoint made durable, the writers stopped, the RAM root removed
            memory.close()

    # -- the memory tier (memory_tier) ----------------------------------------------------------------
    def memory_for(self, save_dir: str | os.PathLike) -> DeepSpeedMemory | None:
        """The memory tier of ``save_dir`` (made now, collectively, at the first call), or None when
        ``memory_tier`` is off or the tier serves another ``save_dir`` (checkpoints there go to disk)."""
        if not self.settings.memory_tier:
            return None
        local_path(save_dir, "DeepSpeed save_dir")
        if self._memory is None:
            self._memory = DeepSpeedMemory(save_dir, self.settings.core, self._listings)
        if self._memory.save_dir != Path(os.path.abspath(save_dir)):
            logger.warning("cpuckpt memory tier serves %s; the checkpoint in %s goes to disk directly",
                           self._memory.save_dir, save_dir)
            return None
        return self._memory

    def one_listing(self) -> contextlib.AbstractContextManager[None]:
        """Within (on this thread), a restart lists ``save_dir`` once: a memory tier made meanwhile starts from that
        listing, and every look of ``load_latest`` (candidates, damaged tags) reads it."""
        return self._listings.held()

    @property
    def memory_tier(self) -> Any:
        """The :class:`cpuckpt.MemoryTier` of this engine's checkpoints (``memory_tier``), or None (not made yet).
        Its ``wait_persisted()`` waits for this rank's owed persists; ``persisted(step)`` says what is durable."""
        return self._memory.tier if self._memory is not None else None

    def preserves_storage_sharing(self) -> bool:
        # Each tensor is written as its own compact storage (torchfile proxies), so DeepSpeed need
        # not clone views before handing them over.
        return False

    # -- zero-stall ordering and pool preparation (called by the DeepSpeedEngine hooks) -------------
    def _bound_engine(self) -> Any:
        """The DeepSpeed engine :meth:`bind` remembered, or None (none bound, or gone)."""
        return self._ds_engine() if self._ds_engine is not None else None

    def bind(self, ds_engine: Any) -> None:
        """Remember the DeepSpeed engine (weakly): its module's buffers are snapshotted at save time."""
        if self._ds_engine is None or self._ds_engine() is not ds_engine:
            self._ds_engine = weakref.ref(ds_engine)

    def before_optimizer_writes(self, ds_engine: Any = None) -> int:
        """The DeepSpeed engine is about to write saved tensors: order its stream after pending copies."""
        return self.order_pending()

    def order_pending(self, stream: Any = None) -> int:
        """Make ``stream`` (default: the current stream of each device copied from) wait, on the GPU, for
        the copies of every save not yet ordered; returns how many saves were ordered. Deferred saves
        still being laid out are waited for (on the host) until their copies are enqueued."""
        self._collect_staging()
        jobs, self._unordered = self._unordered, []
        for job in jobs:
            if job.fence is not None:
                job.fence.order(stream)
        return len(jobs)

    def after_boundary_step(self, ds_engine: Any) -> None:
        """The end of a ``step()`` that updated the model, whose start requested the commit of the save before it
        (DeepSpeed's decoupled commit, here in the background). With the memory tier the step waits for that commit
        (a checkpoint that went to disk too: ``when_full: disk``), so a job killed after the trainer logs iteration
        N + 1 restarts from N: with ``memory.max_uncommitted: 1`` always, otherwise where that save's commit went to
        the background exactly one global step after the one before it (saves every iteration). There the next save
        waits for the commit anyway (commits are serialized): the wait moves before the log line, and what it costs
        more is at most the work between ``step()`` and the next ``save_checkpoint``. Saves further apart are waited
        for at the next save only (a commit outlasting an iteration would cost each of them the difference), and so is
        the first save of this engine (a process's, after a restart too); a blocking commit (``save_16bit_model``)
        does not count. DeepSpeed's ``PipelineEngine`` commits from its next save only (it calls no ``step()``):
        there this does not hold."""
        if self.settings.memory_tier and self._wait_after_step():
            self._wait_background()

    def _wait_after_step(self) -> bool:
        """Whether the step after a save waits for its commit (:meth:`after_boundary_step`)."""
        before, last = self._save_steps
        return (self.settings.core.memory.max_uncommitted == 1
                or (before is not None and last is not None and last - before == 1))

    def after_optimizer_step(self, ds_engine: Any) -> None:
        """After the first optimizer step (``prepare_pool``): size this rank's checkpoint, prepare the pool."""
        if self._prepare_decided:
            return
        self._prepare_decided = True
        cfg = self.settings.core
        try:
            nbytes = estimate_checkpoint_bytes(ds_engine, chunk_bytes=cfg.io.chunk_bytes,
                                               storage_alignment=self.settings.storage_alignment)
        except Exception as e:  # an unfamiliar engine or optimizer: the first save sizes the pool itself
            logger.warning("cpuckpt: could not size the DeepSpeed checkpoint (the first save allocates the pool): %s",
                           e)
            return
        if pool_state()[0] >= nbytes:
            return
        self._preparer = prepare_pool_in_background(nbytes, cfg)

    def engine_built(self, ds_engine: Any) -> None:
        """DeepSpeed's engine has its optimizer and its checkpoint roles (the end of its ``_configure_checkpointing``,
        inside ``deepspeed.initialize``, on every rank). With ``memory_save_dir``, for an engine with an optimizer (one
        that trains) and the first such engine of the process for that directory (a reference model, or a second
        engine, would open the same RAM root): make the memory tier (collective) and reserve, map and pin every free
        slot's images of this rank's files now, before training. Measured on the H200 (13.6 GB per slot): a first save
        into a slot pays 4.7-5.9 s on the trainer's thread, and a reservation on a thread after the first step had
        not ended by the saves at iterations 8, 16 and 24 (the same 4.2x). A tier that cannot be made here is a
        warning: the first save makes it, and raises, as without ``memory_save_dir``."""
        self.bind(ds_engine)
        st = self.settings
        if self._slots_reserved or not (st.memory_tier and st.memory_save_dir):
            return
        self._slots_reserved = True
        where = os.path.realpath(st.memory_save_dir)
        if not _trains(ds_engine) or where in _RESERVED_DIRS:
            return
        _RESERVED_DIRS.add(where)
        try:
            memory = self.memory_for(st.memory_save_dir)
        except CpuckptError as e:
            logger.warning("cpuckpt memory tier: not made at initialize (the first save makes it, or says why): %s", e)
            return
        if memory is None:
            return
        try:
            sizes = estimate_file_bytes(ds_engine, st.memory_save_dir, chunk_bytes=st.core.io.chunk_bytes,
                                        storage_alignment=st.storage_alignment)
        except Exception as e:  # an unfamiliar engine: the first saves make the images
            logger.warning("cpuckpt memory tier: could not name and size this rank's files ahead: %s", e)
            return
        t0 = time.monotonic()
        made = memory.tier.reserve_files(sizes)
        logger.info("cpuckpt memory tier: %d image(s) reserved before training in %.1f s (%s)", made,
                    time.monotonic() - t0, ", ".join(f"{n} {b} bytes" for n, b in sorted(sizes.items())))

    @property
    def prepared_bytes(self) -> int | None:
        """The checkpoint size the pool was prepared for (None: not prepared)."""
        return None if self._preparer is None else self._preparer.nbytes

    def _join_prepare(self) -> None:
        preparer = self._preparer
        if preparer is not None and not preparer.done:
            waited = preparer.join(self.settings.core.timeout_s)
            logger.info("cpuckpt: save waited %.3f s for the host pool's preparation", waited)

    def _buffers(self) -> set[tuple[int, tuple[int, ...]]]:
        ds_engine = self._bound_engine()
        module = getattr(ds_engine, "module", None) if ds_engine is not None else None
        return buffer_pointers(module) if module is not None else set()

    def _settle(self, timeout: float | None = None) -> None:
        """Host wait until the copies of saves not yet committed are done (their errors are commit's)."""
        self.order_pending()  # GPU-side too, for enqueued copies of a job whose staging failed
        for job in self._jobs:
            try:
                job.wait_staged(timeout)
            except Exception:
                if not job.staged.done():  # timed out: its copies may still read the tensors
                    raise
                logger.debug("a pending save's staging failed (raised by its commit)", exc_info=True)

    # -- internals ------------------------------------------------------------------------------
    def _reserve_pool(self, nchunks: int) -> None:
        """Make sure the pool holds this file's chunks next to those of files still being written.

        The pool grows only when idle: if it is too small while earlier files of this checkpoint
        are in flight, wait for them once (the grown pool then serves later checkpoints).
        """
        cfg = self.settings.core
        busy = sum(len(j.files[0].chunks) for j in self._jobs if not j.done.done())
        try:
            get_pool(cfg.io.chunk_bytes, busy + nchunks, pin=cfg.staging.pin)
            return
        except StagingError:
            logger.info("host pool too small for this checkpoint's files in flight; waiting for them once")
        for job in self._jobs:
            try:
                job.wait_done()
            except BaseException:  # reported again by commit(); here we only need the slots back
                logger.debug("earlier file failed", exc_info=True)
        get_pool(cfg.io.chunk_bytes, busy + nchunks, pin=cfg.staging.pin)

    def _wait_jobs(self, jobs: list[SaveJob] | None = None
                   ) -> tuple[BaseException | None, list[tuple[Path, FileEntry]]]:
        """Wait for every job; (the first failure, the written files with their entries)."""
        if jobs is None:
            jobs, self._jobs = self._jobs, []
        first: BaseException | None = None
        written: list[tuple[Path, FileEntry]] = []
        for job in jobs:
            try:
                entries = job.wait_done()
                written += [(job.directory / n, e) for n, e in zip(job.names, entries)]
            except BaseException as e:
                first = first or e
        return first, written

    def _abandon(self) -> None:
        """A save failed: this checkpoint will never be committed; stop its other files."""
        self.order_pending()  # enqueued copies still read the tensors
        for job in self._jobs:
            job.cancel(CpuckptError("checkpoint abandoned: another file of it failed"))
        self._wait_jobs()
        self._info = self._ckpt = None
        self._uncommitted.where = None  # its save raised already


def _trains(ds_engine: Any) -> bool:
    """Whether DeepSpeed's engine has an optimizer of its user's (its config's or the caller's: ``basic_optimizer``).
    A model without one has ``optimizer`` set too, with bf16 or ZeRO: a stand-in (``DummyOptim``) in DeepSpeed's
    wrapper, as a reference model built with the trained one has."""
    return getattr(ds_engine, "basic_optimizer", None) is not None


# memory_save_dir: the directories (real paths) whose slots an engine of this process reserved at initialize
_RESERVED_DIRS: set[str] = set()  # a RAM root opens once per process: one engine reserves


def _all_gather(obj: Any, group: Any) -> list[Any]:
    if peers(group) is None:  # no group, or this rank alone
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
