"""The DCP ``StorageWriter``: wires layout -> staging -> pipeline -> commit. No syscalls of its own.

Call sequence (DCP drives it; "all" means every rank, "coord" the coordinator):

1. all: ``reset(checkpoint_id)`` then ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)``.
2. all: ``prepare_local_plan(plan)`` creates the directory.
3. coord: ``prepare_global_plan(plans)`` makes an existing checkpoint there incomplete (removes its
   ``.metadata``) and gives every rank its file prefix ``__<rank>_``.
4. all: ``write_data(plan, planner)``: resolve every item, plan the whole file image, then fill
   chunks of it in the host pool and ``pwrite`` them from worker threads; truncate, fsync every file
   and the directory; write this rank's manifest part. Returns a completed ``torch.futures.Future``.
   Tensors may be changed by the caller once it returns.
5. coord: ``finish(metadata, results)`` merges the parts into the manifest and writes ``.metadata``.

Records are torch.save-compatible and ``storage_data`` is DCP's own ``_StorageInfo``, so stock
``FileSystemReader`` loads the checkpoint without cpuckpt installed.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import inspect
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from cpuckpt.backend import inflight
from cpuckpt.backend.commit import CommitTarget, LocalTarget
from cpuckpt.backend.dcp_stager import PoolSnapshot, snapshot_state_dict
from cpuckpt.backend.itemcache import CachedItems, ItemsHit, SaveLayout, WrittenItems
from cpuckpt.backend.s3commit import S3Target
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import ConfigError, CpuckptError, is_interrupt
from cpuckpt.format.layout import LayoutCache, LayoutItem
from cpuckpt.format.manifest import WRITER_MARK, FileEntry, Manifest
from cpuckpt.format.plancache import CachedPlan, reused_metadata
from cpuckpt.format.record import record_template
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.transfer.device_snapshot import DeviceSnapshots
from cpuckpt.transfer.objstore import open_store
from cpuckpt.transfer.save_job import SaveJob, choose_mode
from cpuckpt.transfer.sinks import SinkFactory
from cpuckpt.transfer.staging import flat_bytes
from cpuckpt.transfer.threads import wait_future
from cpuckpt.version import __version__

__all__ = ["StorageWriter"]

logger = logging.getLogger(__name__)

try:  # the version string stock FileSystemWriter stamps into .metadata
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as _DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    _DCP_VERSION = "1.0.0"


@dataclass(frozen=True)
class _FilePrefix:
    """Plan-level storage data: the prefix of this rank's file names."""

    prefix: str


@dataclass
class _ResolvedItems:
    layout_items: list[LayoutItem]
    sources: list[torch.Tensor | None]
    objects: list[Any]


class StorageWriter(_DcpStorageWriter):
    """Writes DCP checkpoints as stock-compatible files through a parallel single-copy pipeline.

    Args:
        path: checkpoint directory (created if missing), or ``s3://bucket/prefix`` (objects under that
            prefix, through the ``s3`` config section; see ``backend.s3commit``).
        config: a :class:`Config`, a YAML path, a dict, or None for defaults.
        step: training step, recorded in the manifest.
        sink: where this rank's staged chunks go (:class:`cpuckpt.transfer.sinks.SinkFactory`; default
            files through the pinned pool). The memory tier passes its image files of this directory,
            filled in place (device-to-host straight into the mapped pages), with no pool and no writes.
        save_id: the save's id (default: a new one per save); every rank must pass the same one. The
            coordinator's is what the manifest and ``.metadata`` record.
        layouts: the file layouts of recent saves (a save of an unchanged structure takes its layout from
            here instead of planning it again); default: this writer's own, so saves through one
            writer reuse them. A :class:`cpuckpt.Checkpointer` passes its stream's.
        snapshots: the device buffers of ``staging.device_snapshot`` (a checkpointer passes its stream's;
            default: this writer's own, reused by its saves).

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save(state_dict, storage_writer=cpuckpt.StorageWriter("/ckpt/step_100"))
    """

    def __init__(self, path: str | os.PathLike, config: Config | str | os.PathLike | dict | None = None,
                 *, step: int | None = None, sink: SinkFactory | None = None, save_id: str | None = None,
                 layouts: LayoutCache | None = None, snapshots: DeviceSnapshots | None = None) -> None:
        super().__init__()
        self.layouts = layouts if layouts is not None else LayoutCache()
        self.snapshots = snapshots if snapshots is not None else DeviceSnapshots()  # none given: this writer's own
        self._given_save_id = save_id
        self._given_sink = sink
        self.config = resolve_config(config)
        self._set_path(path, "StorageWriter: checkpoint path")  # refuses other URLs, before any mkdir
        self.step = step
        self.save_id = save_id or uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.last_write_s = 0.0
        self.last_write_nbytes = 0
        self.job: SaveJob | None = None
        self._deferred = False
        self._in_flight = 1
        self._prefix = "__0_"
        self._records: dict[str, list[list[int]]] = {}
        self._pending: tuple[Metadata, list[list[WriteResult]]] | None = None
        self._snapshot: PoolSnapshot | None = None
        self.last_plan: SavePlan | None = None  # the final local plan of the last write_data
        self.last_results: list[WriteResult] | None = None  # set when a cached plan was used
        self.last_written: WrittenItems | None = None  # what the last write_data resolved and planned
        self.last_layout = ""  # how the last write_data got its file layout: "planned", or "cached" (layouts)

    # -- DCP AsyncStager protocol: the dcp.async_save door ------------------------------------------
    _synchronize_after_execute: bool = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> cf.Future[dict[str, Any]]:
        """Copy the state dict into the host pool; the future completes when the copies have.

        DCP plans only after staging, so this door is snapshot-only and costs one host memcpy more
        than :func:`cpuckpt.async_save`.

        Raises:
            ConfigError: ``staging.pool_bytes`` is smaller than the state dict (streaming).
        """
        self.close()
        self._snapshot = snapshot_state_dict(state_dict, self.config, extra_slots=2 * self.config.io.threads)
        return self._snapshot.ready

    def synchronize_staging(self) -> None:
        if self._snapshot is not None:
            wait_future(self._snapshot.ready, self.config.timeout_s, "staging for dcp.async_save")

    def close(self) -> None:
        """Return the snapshot's pool memory (DCP calls this; also done after each write)."""
        if self._snapshot is not None:
            self._snapshot.release()
            self._snapshot = None

    def __getstate__(self) -> dict[str, Any]:
        raise CpuckptError(
            "cpuckpt.StorageWriter cannot be sent to another process (DCP's PROCESS async mode): its host pool "
            "lives in this process. Use AsyncCheckpointerType.THREAD or cpuckpt.async_save."
        )

    def defer_commit(self, *, in_flight: int = 1) -> None:
        """Background mode (used by ``async_save``): ``write_data`` returns once staging has begun and
        ``finish`` only records the metadata; the committer calls ``write_part``/``commit_deferred``."""
        self._deferred = True
        self._in_flight = in_flight

    # -- DCP contract ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._set_path(checkpoint_id, "StorageWriter: checkpoint_id")
        self.save_id = self._given_save_id or uuid.uuid4().hex

    def _set_path(self, path: str | os.PathLike, what: str) -> None:
        """The checkpoint's location and its commit target (a directory, or a prefix in object storage)."""
        where = checkpoint_path(path, what)
        self.path: Path | S3Url
        self.target: CommitTarget
        if isinstance(where, S3Url):
            self.path = where
            self.target = S3Target(open_store(self.config.s3, threads=self.config.io.threads), where,
                                   self.config.timeout_s)
        else:
            self.path = Path(where)
            self.target = LocalTarget(self.path, fsync=self.config.io.fsync)
        self.sink: SinkFactory = self._given_sink or self.target.sink

    def cancel(self, reason: BaseException) -> None:
        """Stop this writer's save job, if one runs (Ctrl-C): chunks not yet written are skipped, its
        threads end, and ``.metadata`` is never written. ``reason`` is what its waits then report."""
        job = self.job
        if job is not None and not job.done.done():
            job.cancel(reason)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else 0
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError("cpuckpt.StorageWriter needs use_collectives=True (one .metadata per checkpoint)")

    def storage_meta(self) -> StorageMeta | None:
        meta = StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)
        meta.modules = [WRITER_MARK]  # a manifest belongs beside this .metadata (format.manifest)
        return meta

    def prepare_target(self) -> None:
        """Every rank, before planning ends: the earlier saves of this process into the same path end first
        (:func:`~cpuckpt.backend.inflight.wait_for_writers_of`), then the target is made ready."""
        inflight.wait_for_writers_of(str(self.path), self.config.timeout_s)
        self.target.prepare()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.prepare_target()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.target.clear()
        return [dataclasses.replace(p, storage_data=_FilePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        self.last_plan = plan
        self._prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _FilePrefix) else f"__{self.rank}_"
        resolved = _resolve_items(plan, planner)
        layout = self._plan_layout(plan, resolved.layout_items)
        self.last_written = WrittenItems(plan, resolved.objects, resolved.sources, resolved.layout_items, layout)
        self._start(layout, resolved.sources, len(plan.items), t0)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(layout.results)
        return fut

    def _plan_layout(self, plan: SavePlan, layout_items: list[LayoutItem]) -> SaveLayout:
        """This rank's files for ``layout_items`` (one per plan item): layout, records, write results."""
        cfg = self.config
        files, placements, cached = self.layouts.plan(
            layout_items,
            num_files=1,
            chunk_bytes=cfg.io.chunk_bytes,
            align_bytes=cfg.layout.align_bytes,
            align_data_min_bytes=cfg.layout.align_data_min_bytes,
        )
        self.last_layout = "cached" if cached else "planned"
        names = [f"{self._prefix}{k}.distcp" for k in range(len(files))]
        records: dict[str, list[list[int]]] = {name: [] for name in names}
        for p in placements:
            if layout_items[p.item].payload is None:
                records[names[p.file]].append([p.record_offset, p.data_offset - p.record_offset])
        results = [
            WriteResult(
                index=wi.index,
                size_in_bytes=p.record_nbytes,
                storage_data=_StorageInfo(names[p.file], p.record_offset, p.record_nbytes),
            )
            for wi, p in zip(plan.items, placements)
        ]
        return SaveLayout(names, files, placements, records, results)

    def _start(self, layout: SaveLayout, sources: list[torch.Tensor | None], nitems: int, t0: float) -> None:
        """Start staging (and writing) ``layout``; in the synchronous mode, wait until written."""
        cfg = self.config
        names, files = layout.names, layout.files
        self._records = layout.records
        image_nbytes = sum(f.nbytes for f in files)
        mode = choose_mode(cfg, image_nbytes, in_flight=self._in_flight) if self._deferred else "streaming"
        if self._deferred and self.rank == 0:
            logger.info("cpuckpt async save: %s mode (%d bytes on rank 0)", mode, image_nbytes)
        sink = self.sink(self.path, names, files, cfg, rank=self.rank)
        self.job = SaveJob(self.path, names, files, sources, cfg, rank=self.rank, mode=mode,
                           in_flight=self._in_flight, sink=sink, snapshots=self.snapshots)
        try:
            self.job.start()
            if not self._deferred:
                self.write_part(self.job.wait_done())
        except BaseException as e:
            if not self._deferred or is_interrupt(e):
                self.cancel(e)  # no thread writes on after this save failed or Ctrl-C ended it
            raise
        finally:
            if not self._deferred:
                self.close()  # a dcp.async_save snapshot is no longer needed once written
        if not self._deferred:
            self.last_write_s = time.perf_counter() - t0
            self.last_write_nbytes = image_nbytes
            logger.info(
                "cpuckpt save %s rank %d: %d items, %d bytes in %.3f s (%.2f GB/s), %d file(s)",
                self.save_id[:8], self.rank, nitems, image_nbytes, self.last_write_s,
                image_nbytes / max(self.last_write_s, 1e-9) / 1e9, len(files),
            )

    def write_part(self, entries: list[FileEntry]) -> None:
        """Write this rank's manifest part (its files' sizes, checksums, record offsets); durable."""
        for entry in entries:
            entry.records = self._records.get(entry.name, [])
        part = Manifest(files={e.name: e for e in entries})
        self.target.write_part(self._prefix, part.to_json().encode())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = _DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        if self._deferred:
            self._pending = (metadata, results)
            return
        self._commit(metadata, results)

    @property
    def pending_metadata(self) -> Metadata | None:
        """Background mode: the ``.metadata`` ``finish`` prepared and :meth:`commit_deferred` will write."""
        return self._pending[0] if self._pending else None

    def commit_deferred(self, gathered: list[list[WriteResult]] | None = None) -> None:
        """Coordinator, background mode: commit once every rank's files are durable.

        ``gathered`` are every rank's results when the save reused a cached plan (DCP did not gather
        them); they replace the cached metadata's ``storage_data``.
        """
        self._commit(*self.pending_commit(gathered))

    def pending_commit(self, gathered: list[list[WriteResult]] | None = None
                       ) -> tuple[Metadata, list[list[WriteResult]]]:
        """Coordinator, background mode: the global ``.metadata`` and every rank's results, not written.

        ``commit_deferred`` writes them here; the memory tier across nodes sends them to every node, whose
        leader commits its own RAM copy (``cpuckpt.tier.nodecommit``).
        """
        if self._pending is None:
            raise RuntimeError("commit_deferred() before finish(): DCP did not finish planning")
        metadata, results = self._pending
        if results is None:
            if gathered is None:
                raise RuntimeError("a save from a cached plan needs every rank's results to commit (a rank's were not "
                                   "received, or it sent the marker of results this coordinator does not hold)")
            results = gathered
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
            metadata.storage_meta = self.storage_meta()
        return metadata, results

    def write_cached(self, state_dict: dict[str, Any], cached: CachedPlan, planner: SavePlanner | None = None) -> None:
        """Background mode: start a save from a previous save's plan, without DCP planning.

        ``planner`` (default: a ``DefaultSavePlanner``) is the save's own planner: it is only set up on
        ``state_dict`` and asked to resolve each cached item (``resolve_data``), as DCP's ``write_data``
        would. The coordinator must already have made ``path`` incomplete (``clear_commit``).
        """
        self._adopt(cached)
        if planner is None:
            planner = DefaultSavePlanner()
        if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
            planner.set_up_planner(state_dict=state_dict, storage_meta=self.storage_meta(),
                                   is_coordinator=cached.is_coordinator)
        else:  # planners written before torch 2.4 (DCP calls them the same way)
            planner.set_up_planner(state_dict, cached.is_coordinator)  # type: ignore[call-arg]
        self.last_results = self.write_data(cached.plan, planner).value()

    def write_items(self, items: CachedItems, hit: ItemsHit) -> None:
        """Background mode: start a save whose items a previous save resolved (``backend.itemcache``).

        No planner runs: ``hit`` holds this save's sources and non-tensor payloads, and the cached
        layout is used as it is unless those payloads changed length. The coordinator must already have
        made ``path`` incomplete (``clear_commit``).
        """
        t0 = time.perf_counter()
        cached = items.cached
        self._adopt(cached)
        self.last_plan = cached.plan
        storage = cached.plan.storage_data
        self._prefix = storage.prefix if isinstance(storage, _FilePrefix) else f"__{self.rank}_"
        layout = items.layout_for(hit)
        self.last_layout = "cached"  # the items' own layout (or the stream's layout cache, below)
        if layout is None:  # a non-tensor value's pickle changed length: plan the files again
            layout = items.adopt_for(self._plan_layout(cached.plan, items.layout_items(hit)), hit)
        self._start(layout, hit.sources, len(cached.plan.items), t0)
        self.last_results = layout.results

    def _adopt(self, cached: CachedPlan) -> None:
        """Take rank, role and (coordinator) metadata from a cached plan, as DCP's set-up would."""
        self.rank, self.is_coordinator = cached.rank, cached.is_coordinator
        if cached.is_coordinator:
            self._pending = (reused_metadata(cached), None)

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.target.commit(metadata, [f"__{i}_" for i in range(len(results))], self.manifest_header(len(results)))

    def manifest_header(self, world_size: int) -> Manifest:
        """The committed manifest of this save, without its files (the commit adds every rank's part)."""
        return Manifest(
            cpuckpt_version=__version__,
            torch_version=torch.__version__,
            save_id=self.save_id,
            step=self.step,
            created_unix=time.time(),
            world_size=world_size,
            config=self.config.to_dict(),
            timings={"coordinator_write_s": self.last_write_s},
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        text = str(checkpoint_id)
        return isinstance(checkpoint_id, (str, os.PathLike)) and ("://" not in text or text.startswith("s3://"))


def _resolve_items(plan: SavePlan, planner: SavePlanner) -> _ResolvedItems:
    layout_items: list[LayoutItem] = []
    sources: list[torch.Tensor | None] = []
    objects: list[Any] = []
    for wi in plan.items:
        data = planner.resolve_data(wi)
        objects.append(data)
        if wi.type == WriteItemType.BYTE_IO:
            buf = data.getbuffer()
            layout_items.append(LayoutItem(data_nbytes=len(buf), payload=buf))
            sources.append(None)
            continue
        t = data.detach()
        tpl = record_template(t.dtype, tuple(t.shape))
        layout_items.append(LayoutItem(tpl.data_nbytes, tpl.head, tpl.tail))
        sources.append(flat_bytes(t))
    return _ResolvedItems(layout_items, sources, objects)
