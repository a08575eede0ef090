"""The DCP ``StorageReader``: parallel reads of exact byte ranges, checksums, resharding.

Call sequence (DCP drives it): ``reset`` -> ``read_metadata`` (restricted unpickler, never runs
pickled code) -> ``set_up_storage_reader`` -> ``prepare_local_plan``/``prepare_global_plan``
(unchanged) -> ``read_data(plan, planner)``.

Checkpoints with a cpuckpt manifest are read by file chunk: each worker thread preads one chunk
(aligned, so O_DIRECT works) into a slot, verifies its checksum (the manifest's kind: crc32c or blocksum32),
and scatters the bytes into the destinations (``integrity.verify: sample`` checks a random share of the chunks
on each load). With ``integrity.verify: off`` byte ranges are read straight into the destination tensor.
A destination that cannot take raw bytes (another dtype, a non-contiguous rectangle of a resharded load, a
GPU tensor) is filled through a bounce buffer and copied on the caller's thread.
Stock DCP checkpoints (no manifest) are read record by record: a plain tensor record is viewed in
place (its data entry's zip CRC-32 checked unless ``integrity.verify: off``: stock DCP's ``torch.load`` does
not check it), anything else goes through ``torch.load(weights_only=True)``. Non-tensor (bytes) items are
decoded with weights_only semantics too (``format.unpickle.load_value``) unless ``integrity.trusted``.

Files in a RAM filesystem (the memory tier's root) are mapped, not read (``backend.ramread``): chunks
are checksummed and copied straight from the mapping. For GPU targets they are read like disk files
(pread into a pinned slot, then host-to-device): on the H200 that beat pinning the mapping's chunks
while copying them and copying them through a small pinned ring (BENCHMARKS.md, memory tier, round four).

The slots are the process's pool when it has one with a slot per read thread (a trainer that saved
already, or ``cpuckpt.prepare_pool``), else a load's own :class:`~cpuckpt.transfer.read_slots.ReadSlots`,
each pinned at its first host-to-device copy while the others are read: a restarted process pins no
pool up front.

Two ways in: DCP's ``read_data(plan, planner)``, and :meth:`StorageReader.read_whole`, the load fast
path's (``backend.fastload``): whole saved tensors by name, no ``ReadItem`` and no planner.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import random
import threading
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from cpuckpt.backend import s3commit
from cpuckpt.backend.committed import (
    METADATA_NAME,
    NO_MANIFEST,
    expects_manifest,
    inside_checkpoint,
    metadata_damage,
    parse_metadata,
    read_manifest,
    read_metadata_bytes,
    same_save,
    size_mismatch,
)
from cpuckpt.backend.ramread import MappedFile, in_ram
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CheckpointCorrupt, CpuckptError, IntegrityError
from cpuckpt.format.checksums import chunk_checksum, verifiable
from cpuckpt.format.manifest import MANIFEST_NAME, FileEntry, Manifest
from cpuckpt.format.record import parse_record
from cpuckpt.format.unpickle import load_value, reencode
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.transfer.files import BufferedFileBackend, FileBackend, get_backend
from cpuckpt.transfer.hostcopy import copy_host_bytes
from cpuckpt.transfer.objstore import ObjectReads, open_store
from cpuckpt.transfer.read_slots import ReadSlots
from cpuckpt.transfer.sinks import MappedBytes
from cpuckpt.transfer.staging import DeviceCopier, existing_pool, flat_bytes
from cpuckpt.transfer.threads import Cancelled, run_parallel
from cpuckpt.transfer.tracing import nvtx_range

__all__ = ["ReadStats", "StorageReader"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Need:
    """One item's bytes: file range ``[lo, hi)`` and where they go (no ``target``: a bytes item)."""

    ri: ReadItem | None  # None on the fast path (``read_whole``)
    lo: int
    hi: int
    dst: torch.Tensor | None = None  # raw-byte destination (uint8 view of the target's memory)
    bounce: torch.Tensor | None = None  # host staging when the target cannot take raw bytes
    target: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    src_shape: tuple[int, ...] = ()  # shape of the bytes in [lo, hi) (whole chunk or contiguous rectangle)
    narrowed: bool = False  # bounce holds the whole saved chunk and must be narrowed
    name: str = ""  # the fast path's state-dict key

    @property
    def buffer(self) -> torch.Tensor:
        return self.dst if self.dst is not None else self.bounce  # type: ignore[return-value]


@dataclass
class ReadStats:
    """Where one read went: telemetry and the benchmarks split a load's read time with it."""

    plan_s: float = 0.0  # matching read items to file ranges and destinations
    io_s: float = 0.0  # the parallel reads (checksums and host-to-device copies of chunks included)
    finish_s: float = 0.0  # bounce buffers copied into their targets on the caller's thread, commit_tensor
    nbytes: int = 0
    files: int = 0
    jobs: int = 0
    bounce_nbytes: int = 0  # bytes that went through a bounce buffer (dtype change, resharded rectangle)
    items: int = 0
    fast_path: bool = False  # read by ``read_whole`` (no DCP planning)
    mapped_files: int = 0  # files copied from a mapping (RAM filesystem or this process's images), not read
    slots_pinned_nbytes: int = 0  # bytes of this load's own read slots pinned (a process without a pool)


@dataclass
class _FilePlan:
    path: str
    entry: FileEntry | None
    needs: list[_Need] = field(default_factory=list)


class _Files:
    """The files of one read: each relative path checked once, each manifest's records indexed once."""

    def __init__(self, root: Path | S3Url, manifest: Manifest | None) -> None:
        self.root = root
        self.manifest = manifest
        self.plans: dict[str, _FilePlan] = {}
        self._seen: dict[str, tuple[_FilePlan, dict[int, int] | None]] = {}

    def get(self, relative_path: str) -> tuple[_FilePlan, dict[int, int] | None]:
        """The plan of a ``.metadata`` data path and its records (record offset -> data offset), None: stock."""
        hit = self._seen.get(relative_path)
        if hit is None:
            rel = _safe_relpath(self.root, relative_path)
            entry = self.manifest.files.get(rel) if self.manifest else None
            fp = self.plans.get(rel)
            if fp is None:
                fp = self.plans[rel] = _FilePlan(str(self.root / rel), entry)
            hit = self._seen[relative_path] = (fp, dict(map(tuple, entry.records)) if entry is not None else None)
        return hit


class StorageReader(_DcpStorageReader):
    """Reads cpuckpt and stock DCP checkpoints with parallel preads and checksum verification.

    Args:
        path: checkpoint directory, or ``s3://bucket/prefix`` (ranged GETs through the ``s3`` config section).
        config: a :class:`Config`, a YAML path, a dict, or None for defaults.
        mapped: files of this checkpoint already mapped in this process (by file name; the memory
            tier's images of the save it holds): their bytes are copied to the targets straight from
            the (pinned) mapping, with no read and no pool.
    """

    def __init__(self, path: str | os.PathLike, config: Config | str | os.PathLike | dict | None = None,
                 *, mapped: Mapping[str, MappedBytes] | None = None) -> None:
        super().__init__()
        self.mapped = dict(mapped or {})  # file name -> this process's live, mapped (pinned) bytes of it
        self.config = resolve_config(config)
        self._set_path(path, "StorageReader: checkpoint path")
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.metadata: Metadata | None = None
        self.manifest: Manifest | None = None
        self.last_read_s = 0.0
        self.last_read_nbytes = 0
        self.last_stats = ReadStats()
        self._preloaded: Metadata | None = None
        # the metadata read last, the manifest read with it, its bytes' crc32c (:meth:`_check_metadata`)
        self._metadata_read: tuple[Metadata, Manifest | None, int] | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._preloaded = self._metadata_read = None  # another load (of another checkpoint, maybe) reads its own
        if checkpoint_id:
            self._set_path(checkpoint_id, "StorageReader: checkpoint_id")
        self.load_id = uuid.uuid4().hex

    def _set_path(self, path: str | os.PathLike, what: str) -> None:
        """A directory, or a prefix in object storage (then ``store`` reads it; None for a directory)."""
        where = checkpoint_path(path, what)  # another URL scheme is refused: it is not a directory name
        self.path: Path | S3Url
        self.store: Any = None
        if isinstance(where, S3Url):
            self.path = where
            self.store = open_store(self.config.s3, threads=self.config.io.read_threads)
        else:
            self.path = Path(where)

    def load_metadata(self) -> Metadata:
        """This checkpoint's ``.metadata``, unpickled safely (``committed.parse_metadata``) and, where a manifest of
        the same save records its crc32c, checked against it before anything uses it (a ``.metadata`` changed after
        its commit that still unpickles: two keys swapped, an offset changed, would load wrong values).

        Raises:
            IntegrityError: not committed. StorageIOError: unreadable. CheckpointCorrupt: refused.
        """
        md = self._read_metadata()
        self._check_metadata(md)
        return md

    def _read_metadata(self) -> Metadata:
        """``.metadata`` unpickled, the manifest read with it (kept, with the bytes' crc32c, in ``_metadata_read``)."""
        if isinstance(self.path, S3Url):
            data = s3commit.read_metadata_bytes(self.store, self.path)
        else:
            data = read_metadata_bytes(self.path)
        md = parse_metadata(data, self.path / METADATA_NAME)
        self._metadata_read = (md, self._read_manifest(), crc32c.crc32c(data))
        return md

    def _check_metadata(self, md: Metadata) -> None:
        """Raise ``CheckpointCorrupt`` when ``md`` was read here and a manifest of the same save records another
        crc32c for it (a ``.metadata`` changed after its commit that still unpickles)."""
        if self._metadata_read is None or self._metadata_read[0] is not md:
            return
        _, manifest, crc = self._metadata_read
        if manifest is not None and same_save(manifest, md):
            damage = metadata_damage(manifest, crc)
            if damage:
                raise CheckpointCorrupt(f"{self.path}: {damage}")

    def _read_manifest(self) -> Manifest | None:
        if isinstance(self.path, S3Url):
            return s3commit.read_manifest(self.store, self.path)
        return read_manifest(self.path)

    def use_metadata(self, metadata: Metadata) -> None:
        """Serve ``metadata`` (already read from this checkpoint) to the next ``read_metadata``.

        ``cpuckpt.load`` reads ``.metadata`` itself first (to report an uncommitted checkpoint on every
        rank); this spares DCP a second read and unpickling of it (megabytes for large models).
        """
        self._preloaded = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's retry after this rank's read failed: a rank that answered it would load without collectives
            # while the others wait in one (a hang until the group's timeout). Failing it again fails the load on
            # every rank at once, with the first error.
            raise IntegrityError(f"{self.path}: no rank-local metadata (cpuckpt writes one global {METADATA_NAME})")
        md, self._preloaded = self._preloaded, None
        if md is None:  # checked in set_up_storage_reader: DCP reports an error from there alike on every rank (from
            md = self._read_metadata()  # here it would retry with rank-local metadata and report that instead)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.path}/.metadata has no storage_data")
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        read = self._metadata_read
        self.manifest = read[1] if read is not None and read[0] is metadata else self._read_manifest()
        other_save = self.manifest is not None and not same_save(self.manifest, metadata)
        if other_save:
            # Another writer (e.g. stock DCP) committed here after us: the manifest describes old files.
            logger.warning("%s: manifest belongs to an earlier save (%s, .metadata says %s); reading as stock DCP",
                           self.path, self.manifest.save_id, metadata.storage_meta.save_id)
            self.manifest = None
        if (self.manifest is None and expects_manifest(metadata) and self.config.integrity.verify != "off"
                and (other_save or not self._manifest_exists())):  # (a too-new writer's is read as stock, warned)
            raise CheckpointCorrupt(f"{self.path}: {NO_MANIFEST}; integrity.verify: off loads it unchecked")
        self._check_metadata(metadata)

    def _manifest_exists(self) -> bool:
        if isinstance(self.path, S3Url):
            return self.store.head(self.path / MANIFEST_NAME) is not None
        return (self.path / MANIFEST_NAME).exists()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        text = str(checkpoint_id)
        return isinstance(checkpoint_id, (str, os.PathLike)) and ("://" not in text or text.startswith("s3://"))

    # -- reading --------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with nvtx_range("cpuckpt.load"):
            t0 = time.perf_counter()
            plans = self._plan_files(plan, planner)
            stats = self._read(plans, t0, len(plan.items))
            t2 = time.perf_counter()
            for fp in plans.values():
                for need in fp.needs:
                    stats.bounce_nbytes += _finish_need(need, planner, trusted=self.config.integrity.trusted,
                                                        where=str(self.path))
            self._account(stats, t0, t2)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def read_whole(self, tensors: Sequence[tuple[str, torch.Tensor]], blobs: Sequence[str]) -> dict[str, bytes]:
        """Fill whole saved tensors into their targets and return the bytes of bytes items: the load fast path.

        ``backend.fastload`` calls it instead of DCP's planning and ``read_data``, after
        ``set_up_storage_reader``, having checked against ``.metadata`` that every name in ``tensors``
        (state-dict key, target) was saved as one chunk at offset zero of the target's shape, and that
        every name in ``blobs`` is a bytes item. Reads, checks and copies are ``read_data``'s.

        Returns:
            name -> the saved bytes of each of ``blobs`` (for ``torch.load``).

        Raises:
            CheckpointCorrupt: ``.metadata`` has no single storage entry for a name, or a file is
                missing, truncated or fails its checksum.
        """
        with nvtx_range("cpuckpt.load"):
            t0 = time.perf_counter()
            plans = self._plan_whole(tensors, blobs)
            stats = self._read(plans, t0, len(tensors) + len(blobs))
            stats.fast_path = True
            t2 = time.perf_counter()
            out: dict[str, bytes] = {}
            for fp in plans.values():
                for need in fp.needs:
                    if need.target is None:
                        out[need.name] = need.bounce.numpy().tobytes()  # type: ignore[union-attr]
                    else:
                        stats.bounce_nbytes += _copy_bounce(need)
            self._account(stats, t0, t2)
        return out

    def _read(self, plans: dict[str, _FilePlan], t0: float, items: int) -> ReadStats:
        stats = ReadStats(files=len(plans), plan_s=time.perf_counter() - t0, items=items)
        t1 = time.perf_counter()
        cfg = self.config
        opened = contextlib.ExitStack()
        handed = False  # from then on run_parallel closes `opened`
        try:
            # Every file's reads go to one set of threads: no drain at file boundaries, and small
            # files (optimizer shards, rank files of a resharded load) read side by side.
            jobs, sources, pool = _read_jobs(plans, cfg, opened, self.mapped, self.store)
            # The files, mappings and slots are closed once no job runs any more: after a timeout or Ctrl-C, a
            # job still in a read must not find its descriptor closed (and another file opened under its number).
            handed = True
            nbytes = run_parallel(_run_job, jobs, threads=cfg.io.read_threads, timeout_s=cfg.timeout_s,
                                  name="cpuckpt-read", release=opened.close)
        except BaseException:
            if not handed:
                opened.close()
            raise
        stats.nbytes = sum(nbytes)
        stats.jobs = len(jobs)
        stats.mapped_files = len(sources)
        stats.slots_pinned_nbytes = getattr(pool, "pinned_nbytes", 0)
        stats.io_s = time.perf_counter() - t1
        return stats

    def _account(self, stats: ReadStats, t0: float, t2: float) -> None:
        stats.finish_s = time.perf_counter() - t2
        self.last_stats = stats
        self.last_read_s = time.perf_counter() - t0
        self.last_read_nbytes = stats.nbytes
        logger.info("cpuckpt load %s: %d items%s, %d bytes in %.3f s (%.2f GB/s; plan %.3f s, reads %.3f s, "
                    "copies into targets %.3f s for %d bytes)", self.load_id[:8], stats.items,
                    " (fast path)" if stats.fast_path else "", stats.nbytes, self.last_read_s,
                    stats.nbytes / max(self.last_read_s, 1e-9) / 1e9, stats.plan_s, stats.io_s, stats.finish_s,
                    stats.bounce_nbytes)

    def _plan_files(self, plan: LoadPlan, planner: LoadPlanner) -> dict[str, _FilePlan]:
        if self.metadata is None:
            raise RuntimeError("read_data() before set_up_storage_reader(): not called through DCP")
        chunk_shapes = _chunk_shapes(self.metadata)
        files = _Files(self.path, self.manifest)
        storage_data = self.storage_data
        for ri in plan.items:
            sinfo = storage_data.get(ri.storage_index)
            if sinfo is None:
                raise CheckpointCorrupt(f"{self.path}: .metadata has no storage entry for {ri.storage_index}")
            _check_plain(self.path, sinfo)
            fp, records = files.get(sinfo.relative_path)
            lo = int(sinfo.offset)
            hi = lo + int(sinfo.length)
            if ri.type == LoadItemType.BYTE_IO:
                fp.needs.append(_Need(ri, lo, hi, bounce=torch.empty(hi - lo, dtype=torch.uint8)))
                continue
            dtype, shape = chunk_shapes[(ri.storage_index.fqn, tuple(ri.storage_index.offset or ()))]
            target = planner.resolve_tensor(ri).detach()
            if tuple(target.shape) != tuple(ri.lengths):  # as FileSystemReader: no reshape, no broadcast
                raise ValueError(
                    f"{self.path}: the planner's destination of {ri.dest_index.fqn!r} at {tuple(ri.dest_offsets)} has "
                    f"shape {tuple(target.shape)}, the read of its saved chunk {tuple(ri.lengths)} (mismatch sizes)")
            if records is None:
                fp.needs.append(_Need(ri, lo, hi, target=target, dtype=dtype, src_shape=shape))
                continue
            data_rel = records.get(lo)
            if data_rel is None:
                raise CheckpointCorrupt(f"{fp.path}: manifest lists no tensor record at offset {lo}")
            fp.needs.append(_tensor_need(ri, lo + data_rel, dtype, shape, target, fp.path, hi))
        return files.plans

    def _plan_whole(self, tensors: Sequence[tuple[str, torch.Tensor]], blobs: Sequence[str]) -> dict[str, _FilePlan]:
        if self.metadata is None:
            raise RuntimeError("read_whole() before set_up_storage_reader()")
        # name -> its one storage entry (None: more than one, or not at offset zero)
        entries: dict[str, Any] = {}
        for index, sinfo in self.storage_data.items():
            whole = not index.offset or not any(index.offset)
            entries[index.fqn] = sinfo if whole and index.fqn not in entries else None
        md = self.metadata.state_dict_metadata
        files = _Files(self.path, self.manifest)
        for name, target in tensors:
            sinfo = entries.get(name)
            if sinfo is None:
                raise CheckpointCorrupt(f"{self.path}: .metadata has no single whole-tensor storage entry for {name!r}")
            _check_plain(self.path, sinfo)
            fp, records = files.get(sinfo.relative_path)
            lo = int(sinfo.offset)
            hi = lo + int(sinfo.length)
            tmd = md[name]
            dtype, shape = tmd.properties.dtype, tuple(tmd.size)
            if records is None:
                target = target.detach()
                fp.needs.append(_Need(None, lo, hi, target=target, dtype=dtype, src_shape=shape, name=name))
                continue
            data_rel = records.get(lo)
            if data_rel is None:
                raise CheckpointCorrupt(f"{fp.path}: manifest lists no tensor record at offset {lo}")
            fp.needs.append(_tensor_need(None, lo + data_rel, dtype, shape, target, fp.path, hi, name))
        for name in blobs:
            sinfo = entries.get(name)
            if sinfo is None:
                raise CheckpointCorrupt(f"{self.path}: .metadata has no storage entry for {name!r}")
            _check_plain(self.path, sinfo)
            fp, _ = files.get(sinfo.relative_path)
            lo = int(sinfo.offset)
            hi = lo + int(sinfo.length)
            fp.needs.append(_Need(None, lo, hi, bounce=torch.empty(hi - lo, dtype=torch.uint8), name=name))
        return files.plans


def _chunk_shapes(md: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, TensorStorageMetadata):
            for ch in tmd.chunks:
                out[(fqn, tuple(ch.offsets))] = (tmd.properties.dtype, tuple(ch.sizes))
    return out


def _check_plain(root: Path, sinfo: Any) -> None:
    if getattr(sinfo, "transform_descriptors", None):
        raise CpuckptError(
            f"{root}: {sinfo.relative_path} uses stream transforms {sinfo.transform_descriptors}; "
            "cpuckpt does not read those, load it with torch's FileSystemReader"
        )


def _safe_relpath(root: Path, rel: str) -> str:
    if not inside_checkpoint(rel):
        raise CheckpointCorrupt(f"{root}/.metadata: refusing data path {rel!r} outside the checkpoint directory")
    return str(PurePosixPath(rel))


def _tensor_need(ri: ReadItem | None, data_lo: int, dtype: torch.dtype, shape: tuple[int, ...],
                 target: torch.Tensor, path: str, record_hi: int, name: str = "") -> _Need:
    """The bytes of a tensor record's data that ``ri`` asks for (None: all of them) and where they go."""
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    if data_lo + numel * itemsize > record_hi:
        raise CheckpointCorrupt(f"{path}: tensor record at {data_lo} overruns its DCP length")
    if ri is None:
        full, lengths = True, shape
    else:
        offsets, lengths = tuple(ri.storage_offsets), tuple(ri.lengths)
        full = lengths == shape and not any(offsets)
    if full:
        elem_off, contiguous = 0, True
    else:
        view = torch.empty(shape, dtype=dtype, device="meta")
        for d, (o, n) in enumerate(zip(offsets, lengths)):
            view = view.narrow(d, o, n)
        elem_off, contiguous = view.storage_offset(), view.is_contiguous()
    if contiguous:
        n_el = math.prod(lengths)
        lo, hi = data_lo + elem_off * itemsize, data_lo + (elem_off + n_el) * itemsize
        # A lazily conjugated/negated target would get its bytes written into a materialised copy.
        if ((target.is_cuda or target.is_cpu) and target.dtype == dtype and target.is_contiguous()
                and not target.is_conj() and not target.is_neg()):
            return _Need(ri, lo, hi, dst=flat_bytes(target), target=target, dtype=dtype, src_shape=lengths,
                         name=name)
        return _Need(ri, lo, hi, bounce=torch.empty(hi - lo, dtype=torch.uint8), target=target.detach(),
                     dtype=dtype, src_shape=lengths, name=name)
    hi = data_lo + numel * itemsize
    return _Need(ri, data_lo, hi, target=target.detach(), dtype=dtype, src_shape=shape, narrowed=True,
                 bounce=torch.empty(hi - data_lo, dtype=torch.uint8), name=name)


def _check_size(fp: _FilePlan, store: Any = None) -> None:
    expected = fp.entry.nbytes if fp.entry is not None else None
    if store is not None:  # an object: its size from a HEAD
        info = store.head(S3Url.parse(fp.path, "data object"))
        if info is None or (expected is not None and info.nbytes != expected):
            what = "data object is missing" if info is None else \
                f"{info.nbytes} bytes in the store, the manifest says {expected} (truncated or overwritten)"
            raise CheckpointCorrupt(f"{fp.path}: {what}")
        return
    problem = size_mismatch(fp.path, expected)
    if problem is not None:
        raise CheckpointCorrupt(str(problem))


ReadJob = Callable[[threading.Event], int]
_Source = MappedBytes | MappedFile  # a file's bytes already in (mapped) memory: copied from, never read


def _run_job(job: ReadJob, cancel: threading.Event) -> int:
    return job(cancel)


def _check(cancel: threading.Event) -> None:
    """Stop a read job of a load that already failed (another job's error, a timeout, Ctrl-C): nothing more is
    read into, or copied to, the caller's tensors after the load has raised."""
    if cancel.is_set():
        raise Cancelled("cpuckpt-read: cancelled after an earlier failure")


def _read_jobs(plans: dict[str, _FilePlan], cfg: Config, opened: contextlib.ExitStack,
               given: Mapping[str, MappedBytes], store: Any = None) -> tuple[list[ReadJob], list[_Source], Any]:
    """The read jobs of every file (opened into ``opened``; each job returns the bytes it read), the
    mapped sources they copy from instead of reading, and the slots they read into (None: no slots).
    ``store``: the files are objects of that :class:`~cpuckpt.transfer.objstore.ObjectStore`, read by
    ranged GETs (:class:`~cpuckpt.transfer.objstore.ObjectReads`) wherever a file would be ``pread``."""
    chunked = {}
    mapped: dict[str, _Source] = {}
    reads: FileBackend | None = None
    if store is not None:
        reads = ObjectReads(store)  # type: ignore[assignment]
    for rel, fp in plans.items():
        _check_size(fp, store)
        if fp.entry is None or not fp.needs:
            continue
        to_gpu = any(n.dst is not None and n.dst.is_cuda for n in fp.needs)
        mine = given.get(rel)
        if mine is not None and mine.nbytes == fp.entry.nbytes:
            mapped[fp.path] = mine
        # GPU targets: read through pinned slots (see the module docstring)
        elif reads is None and in_ram(fp.path) and not to_gpu:
            # Checked its size just above: the mapping never reaches past the file's end.
            mapped[fp.path] = opened.enter_context(MappedFile(fp.path, fp.entry.nbytes))
        mode = cfg.integrity.verify if verifiable(fp.entry) else "off"
        if mode != "off" or fp.path in mapped or to_gpu:
            chunked[fp.path] = _verify_fraction(cfg, mode)
    pool = copiers = None
    if chunked:
        copiers = _Copiers()
    if set(chunked) - set(mapped):
        slot_bytes = max(fp.entry.chunk_bytes for fp in plans.values()  # type: ignore[union-attr]
                         if fp.path in chunked and fp.path not in mapped)
        # The process's pool when it has one (a trainer that saved); else slots for this load, each pinned
        # while the others are read (read_slots: no pool pinned up front on a restart's first load).
        pool = existing_pool(slot_bytes, cfg.io.read_threads)
        if pool is None:
            slots = ReadSlots(slot_bytes, cfg.io.read_threads, pin=cfg.staging.pin)
            opened.callback(slots.close_later)
            pool = slots
    jobs: list[ReadJob] = []
    for fp in plans.values():
        if fp.entry is None:
            jobs += _stock_jobs(fp, opened, reads, verify_fraction=_verify_fraction(cfg, cfg.integrity.verify))
        elif fp.path in chunked:
            source = mapped.get(fp.path)
            jobs += _chunk_jobs(fp, fp.entry, cfg, opened, pool, copiers, verify_fraction=chunked[fp.path],
                                source=source, reads=reads)
        else:
            jobs += _range_jobs(fp, cfg, opened, reads)
    return jobs, list(mapped.values()), pool


def _verify_fraction(cfg: Config, mode: str) -> float:
    """The share of chunks (or stock records) ``integrity.verify`` mode ``mode`` checks."""
    return {"always": 1.0, "sample": cfg.integrity.sample_fraction, "off": 0.0}[mode]


class _Copiers:
    """One host-to-device copier per device, shared by every file of a load."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, DeviceCopier] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> DeviceCopier:
        with self._lock:
            if device not in self._by_device:
                self._by_device[device] = DeviceCopier(device)
            return self._by_device[device]


def _open(backend: FileBackend, path: str, opened: contextlib.ExitStack) -> int:
    fd = backend.open_read(path)
    opened.callback(backend.close, fd)
    return fd


def _scatter(needs: list[_Need], lo: int, hi: int, src: torch.Tensor, copiers: _Copiers,
             used: list[DeviceCopier]) -> None:
    """Copy the bytes ``[lo, hi)`` of a file, held in ``src``, into every need overlapping them.

    Appends each copier to ``used`` as it gets host-to-device copies (the caller waits for them before
    ``src`` is reused, also when this raises).
    """
    to_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for need in needs:
        buf = need.buffer
        if need.lo >= lo and need.hi <= hi:  # the common case: the whole item is in this chunk
            dst, part = buf, src[need.lo - lo : need.hi - lo]
        else:
            a, b = max(need.lo, lo), min(need.hi, hi)
            dst, part = buf[a - need.lo : b - need.lo], src[a - lo : b - lo]
        if dst.is_cuda:
            dsts, srcs = to_device.setdefault(dst.device, ([], []))
            dsts.append(dst)
            srcs.append(part)
        else:
            copy_host_bytes(dst, part)
    for device, (dsts, srcs) in to_device.items():  # one enqueue per device and chunk
        h2d = copiers.get(device)
        used.append(h2d)  # before the enqueue: a failed enqueue may have queued some copies
        h2d.copy_many(dsts, srcs)


def _chunk_jobs(fp: _FilePlan, entry: FileEntry, cfg: Config, opened: contextlib.ExitStack, pool: Any,
                copiers: Any, *, verify_fraction: float, source: _Source | None = None,
                reads: FileBackend | None = None) -> list[ReadJob]:
    """Whole chunks read into pool slots (aligned: O_DIRECT works), verified, scattered to destinations.

    GPU destinations get their bytes by host-to-device copies from the (pinned) slot on a side
    stream; the slot is released once those copies completed. A file held in memory (``source``: this
    process's image, or a mapped file of a RAM filesystem) is not read at all: each chunk's "slot" is
    its bytes of the mapping (an image is pinned; a mapped file of a RAM filesystem has no GPU destinations).
    """
    cb = entry.chunk_bytes
    by_chunk: dict[int, list[_Need]] = defaultdict(list)
    for need in fp.needs:
        if need.hi > need.lo:
            for c in range(need.lo // cb, (need.hi - 1) // cb + 1):
                by_chunk[c].append(need)
    if not by_chunk:
        return []
    # "auto" reads through the page cache: cold buffered preads (kernel readahead) beat O_DIRECT on
    # both machines we measured (BENCHMARKS.md); "direct" still forces O_DIRECT.
    if reads is not None:
        backend = reads
    else:
        backend = BufferedFileBackend() if cfg.io.backend == "auto" else \
            get_backend(cfg.io.backend, Path(fp.path).parent, cfg.layout.align_bytes)
    align = cfg.layout.align_bytes
    if backend.aligned and cb % align:
        backend = BufferedFileBackend()
    fd = _open(backend, fp.path, opened) if source is None else -1

    def read_chunk(c: int, cancel: threading.Event) -> int:
        lo, hi = c * cb, min((c + 1) * cb, entry.nbytes)
        needs = by_chunk[c]
        slot = None
        copying: list[DeviceCopier] = []
        if source is None:
            want = -(-(hi - lo) // align) * align if backend.aligned else hi - lo
            slot = pool.lease(cfg.timeout_s)
            src, view = slot.tensor, slot.view
        else:
            src, view = source.tensor()[lo:hi], source.view()[lo:hi]
        try:
            _check(cancel)
            if slot is not None:
                got = backend.pread_into(fd, view[:want], lo, fp.path)
                if got < hi - lo:
                    raise CheckpointCorrupt(f"{fp.path}: file ends at {lo + got}, expected {entry.nbytes} bytes")
            # "sample" draws anew on every load, so repeated loads cover different chunks.
            draw = random.random()  # noqa: S311 - sampling, not security
            verify = verify_fraction >= 1.0 or draw < verify_fraction
            crc = chunk_checksum(entry.checksum, view[: hi - lo]) if verify else None
            if verify and (c >= len(entry.chunk_checksums) or crc != entry.chunk_checksums[c]):
                stored = entry.chunk_checksums[c] if c < len(entry.chunk_checksums) else None
                raise CheckpointCorrupt(
                    f"{fp.path}: checksum mismatch in bytes [{lo}, {hi}) (chunk {c}): "
                    f"stored {entry.checksum} {stored}, read {crc}; the file is damaged"
                )
            gpu = next((n.dst.device for n in needs if n.dst is not None and n.dst.is_cuda), None)
            if gpu is not None and slot is not None:
                pool.pin(slot, gpu)  # once per slot of a load's own ReadSlots; the process pool is pinned already
            _check(cancel)  # the load has failed or timed out: its targets are the caller's again
            _scatter(needs, lo, hi, src, copiers, copying)
            for copier in copying:
                copier.record().synchronize()  # the slot may be reused only after the copies ran
            return hi - lo
        except BaseException:
            _drain(copying)  # no copy may still read the slot released below
            raise
        finally:
            if slot is not None:
                pool.release(slot)

    return [functools.partial(read_chunk, c) for c in sorted(by_chunk)]


def _drain(copying: list[DeviceCopier]) -> None:
    """After a failure: wait, best effort, for every copy queued from a chunk's memory."""
    for copier in copying:
        try:
            copier.record().synchronize()
        except Exception:  # the failure being raised says more
            logger.debug("waiting for a failed chunk's copies", exc_info=True)


def _range_jobs(fp: _FilePlan, cfg: Config, opened: contextlib.ExitStack,
                reads: FileBackend | None = None) -> list[ReadJob]:
    """Without verification: pread (or GET) each needed range straight into its destination.

    Ranges are batched into jobs of about ``io.chunk_bytes``: one thread-pool task per small item
    would cost more than its read.
    """
    backend: FileBackend = reads or BufferedFileBackend()
    step = cfg.io.chunk_bytes
    batches: list[list[tuple[_Need, int, int]]] = []
    batch: list[tuple[_Need, int, int]] = []
    batch_nbytes = 0
    for need in fp.needs:
        for a in range(need.lo, need.hi, step):
            b = min(a + step, need.hi)
            batch.append((need, a, b))
            batch_nbytes += b - a
            if batch_nbytes >= step:
                batches.append(batch)
                batch, batch_nbytes = [], 0
    if batch:
        batches.append(batch)
    if not batches:
        return []
    fd = _open(backend, fp.path, opened)

    def read_pieces(pieces: list[tuple[_Need, int, int]], cancel: threading.Event) -> int:
        total = 0
        for need, a, b in pieces:
            # These reads land in the targets themselves: none starts once the load has failed, but one already
            # blocked in its pread when the load timed out completes into its target (the checkpoint's own bytes,
            # through the descriptor kept open for it) after the load has raised.
            _check(cancel)
            view = memoryview(need.buffer[a - need.lo : b - need.lo].numpy())
            got = backend.pread_into(fd, view, a, fp.path)
            if got < b - a:
                raise CheckpointCorrupt(f"{fp.path}: file ends at {a + got}, record needs bytes up to {b}")
            total += got
        return total

    return [functools.partial(read_pieces, batch) for batch in batches]


def _stock_jobs(fp: _FilePlan, opened: contextlib.ExitStack, reads: FileBackend | None = None, *,
                verify_fraction: float = 1.0) -> list[ReadJob]:
    """A stock DCP file: one record per item, viewed in place when it is a plain tensor record. With no manifest
    there are no crc32c checksums, but a stock record's data entry has its zip CRC-32: checked (on that share of
    the records), as ``cpuckpt verify`` checks it (``torch.load``, stock DCP's reader, does not)."""
    if not fp.needs:
        return []
    backend = reads or BufferedFileBackend()
    fd = _open(backend, fp.path, opened)

    def read_record(need: _Need, cancel: threading.Event) -> int:
        _check(cancel)
        buf = bytearray(need.hi - need.lo)
        got = backend.pread_into(fd, memoryview(buf), need.lo, fp.path)
        if got < len(buf):
            raise CheckpointCorrupt(f"{fp.path}: file ends at {need.lo + got}, record needs up to {need.hi}")
        if need.target is None:
            need.bounce = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            return got
        check = verify_fraction >= 1.0 or random.random() < verify_fraction  # noqa: S311 - sampling, not security
        src = _tensor_from_record(buf, fp.path, need.lo, check_crc=check)
        if need.ri is not None:
            src = _narrow(src, need.ri.storage_offsets, need.ri.lengths)
        _check(cancel)
        need.target.copy_(src)
        return got

    return [functools.partial(read_record, need) for need in fp.needs]


def _tensor_from_record(buf: bytearray, path: str, offset: int, *, check_crc: bool = False) -> torch.Tensor:
    info = parse_record(buf)
    if info is not None:
        if info.storage_nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        # a CRC of 0: a record of cpuckpt's own format read as stock (FORMAT.md 3.2), nothing to compare
        if check_crc and info.data_crc32 and zlib.crc32(
                memoryview(buf)[info.data_offset:info.data_offset + info.storage_nbytes]) != info.data_crc32:
            raise CheckpointCorrupt(f"{path}: the tensor bytes of the record at offset {offset} fail its zip "
                                    f"CRC-32 (damaged since it was saved; `cpuckpt verify` names every such record)")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=info.storage_nbytes, offset=info.data_offset)
        return raw.view(info.dtype).as_strided(info.shape, info.stride, info.storage_offset)
    try:
        out = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointCorrupt(f"{path}: record at offset {offset} is not a loadable tensor: {e}") from e
    if not isinstance(out, torch.Tensor):
        raise CheckpointCorrupt(f"{path}: record at offset {offset} holds a {type(out).__name__}, not a tensor")
    return out


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


def _copy_bounce(need: _Need) -> int:
    """Caller's thread: copy a tensor need's bounce buffer into its target; returns the bytes copied."""
    if need.bounce is None or need.dtype is None or need.target is None:
        return 0
    src = need.bounce.view(need.dtype).reshape(need.src_shape)
    if need.narrowed and need.ri is not None:
        src = _narrow(src, need.ri.storage_offsets, need.ri.lengths)
    need.target.copy_(src.reshape(need.target.shape))
    return need.bounce.numel()


def _load_bytes(planner: LoadPlanner, ri: ReadItem, value: Any) -> None:
    """Give the planner a bytes item's safely decoded ``value``.

    A planner whose ``load_bytes`` is DCP's own gets ``value`` placed as that method places what it
    unpickles (no second decode: a ShardedObject can hold a whole optimizer state). Any other
    ``load_bytes`` gets ``torch.save(value)``: it unpickles with full pickle, so it must never see
    the checkpoint's bytes, only bytes naming the globals the safe load allowed.
    """
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        # DefaultLoadPlanner.load_bytes (torch 2.0-2.13) with the unpickling already done
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[ri.dest_index.fqn], value)
        else:
            planner.state_dict[ri.dest_index.fqn] = value
        return
    planner.load_bytes(ri, reencode(value))


def _finish_need(need: _Need, planner: LoadPlanner, *, trusted: bool = False, where: str = "") -> int:
    """Caller's thread: copy bounce buffers into targets, hand bytes and tensors back to DCP.

    A bytes item is decoded by :func:`~cpuckpt.format.unpickle.load_value` (weights_only semantics),
    never by the planner's ``load_bytes`` (full pickle) from the saved bytes: see :func:`_load_bytes`.
    ``trusted``: the saved bytes go to ``load_bytes`` as they are.

    Returns the bytes copied from a bounce buffer into a tensor target.

    Raises:
        UnsafeCheckpointError: a bytes item names a global that a safe load does not allow.
    """
    if need.ri is None:
        raise RuntimeError(f"read item {need.name!r} has no ReadItem to finish")
    if need.ri.type == LoadItemType.BYTE_IO:
        data = need.bounce.numpy().tobytes()  # type: ignore[union-attr]
        if trusted:
            planner.load_bytes(need.ri, io.BytesIO(data))
        else:
            _load_bytes(planner, need.ri, load_value(data, need.ri.dest_index.fqn, where=where))
        return 0
    if need.target is None:
        raise RuntimeError(f"tensor read item {need.ri.storage_index} has no destination")
    copied = _copy_bounce(need)
    planner.commit_tensor(need.ri, need.target)
    return copied
