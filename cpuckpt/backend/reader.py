"""The DCP ``StorageReader``: parallel reads of exact byte ranges, checksums, resharding.

Call sequence (DCP drives it): ``reset`` -> ``read_metadata`` (restricted unpickler, never runs
pickled code) -> ``set_up_storage_reader`` -> ``prepare_local_plan``/``prepare_global_plan``
(unchanged) -> ``read_data(plan, planner)``.

Checkpoints with a cpuckpt manifest are read by file chunk: each worker thread preads one chunk
(aligned, so O_DIRECT works) into a pool slot, verifies its crc32c, and scatters the bytes into the
destinations (``integrity.verify: sample`` checks a random share of the chunks on each load). With
``integrity.verify: off`` byte ranges are read straight into the destination
tensor. A destination that cannot take raw bytes (another dtype, a non-contiguous rectangle of a
resharded load, a GPU tensor) is filled through a bounce buffer and copied on the caller's thread.
Stock DCP checkpoints (no manifest) are read record by record: a plain tensor record is viewed in
place, anything else goes through ``torch.load(weights_only=True)``.
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
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from cpuckpt.backend.committed import load_metadata, read_manifest, same_save, size_mismatch
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CheckpointCorrupt, CpuckptError
from cpuckpt.format.manifest import FileEntry, Manifest
from cpuckpt.format.record import parse_record
from cpuckpt.transfer.files import BufferedFileBackend, FileBackend, get_backend
from cpuckpt.transfer.images import ImageFile
from cpuckpt.transfer.staging import DeviceCopier, Slot, flat_bytes, get_pool
from cpuckpt.transfer.threads import run_parallel
from cpuckpt.transfer.tracing import nvtx_range

__all__ = ["ReadStats", "StorageReader"]

logger = logging.getLogger(__name__)


@dataclass
class _Need:
    """One ReadItem's bytes: file range ``[lo, hi)`` and where they go."""

    ri: ReadItem
    lo: int
    hi: int
    dst: torch.Tensor | None = None  # raw-byte destination (CPU uint8 view of the target)
    bounce: torch.Tensor | None = None  # host staging when the target cannot take raw bytes
    target: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    src_shape: tuple[int, ...] = ()  # shape of the bytes in [lo, hi) (whole chunk or contiguous rectangle)
    narrowed: bool = False  # bounce holds the whole saved chunk and must be narrowed

    @property
    def buffer(self) -> torch.Tensor:
        return self.dst if self.dst is not None else self.bounce  # type: ignore[return-value]


@dataclass
class ReadStats:
    """Where one ``read_data`` went: telemetry and the benchmarks split a load's read time with it."""

    plan_s: float = 0.0  # matching read items to file ranges and destinations
    io_s: float = 0.0  # the parallel reads (checksums and host-to-device copies of chunks included)
    finish_s: float = 0.0  # bounce buffers copied into their targets on the caller's thread, commit_tensor
    nbytes: int = 0
    files: int = 0
    jobs: int = 0
    bounce_nbytes: int = 0  # bytes that went through a bounce buffer (dtype change, resharded rectangle)


@dataclass
class _FilePlan:
    path: str
    entry: FileEntry | None
    needs: list[_Need] = field(default_factory=list)


class StorageReader(_DcpStorageReader):
    """Reads cpuckpt and stock DCP checkpoints with parallel preads and checksum verification.

    Args:
        path: checkpoint directory.
        config: a :class:`Config`, a YAML path, a dict, or None for defaults.
        images: the memory tier's mapped images of this checkpoint's files (by file name), when this
            process holds them: their bytes are copied to the targets straight from the (pinned)
            mapping, with no read and no pool.
    """

    def __init__(self, path: str | os.PathLike, config: Config | str | os.PathLike | dict | None = None,
                 *, images: Mapping[str, ImageFile] | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.images = dict(images or {})  # file name -> this process's live, mapped (pinned) image of it
        self.config = resolve_config(config)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.metadata: Metadata | None = None
        self.manifest: Manifest | None = None
        self.last_read_s = 0.0
        self.last_read_nbytes = 0
        self.last_stats = ReadStats()
        self._preloaded: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def use_metadata(self, metadata: Metadata) -> None:
        """Serve ``metadata`` (already read from this checkpoint) to the next ``read_metadata``.

        ``cpuckpt.load`` reads ``.metadata`` itself first (to report an uncommitted checkpoint on every
        rank); this spares DCP a second read and unpickling of it (megabytes for large models).
        """
        self._preloaded = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md, self._preloaded = self._preloaded, None
        if md is None:
            md = load_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.path}/.metadata has no storage_data")
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self.manifest = read_manifest(self.path)
        if self.manifest is not None and not same_save(self.manifest, metadata):
            # Another writer (e.g. stock DCP) committed here after us: the manifest describes old files.
            logger.warning("%s: manifest belongs to an earlier save (%s, .metadata says %s); reading as stock DCP",
                           self.path, self.manifest.save_id, metadata.storage_meta.save_id)
            self.manifest = None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in str(checkpoint_id)

    # -- reading --------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with nvtx_range("cpuckpt.load"):
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        cfg = self.config
        plans = self._plan_files(plan, planner)
        stats = ReadStats(files=len(plans), plan_s=time.perf_counter() - t0)
        t1 = time.perf_counter()
        with contextlib.ExitStack() as opened:
            # Every file's reads go to one set of threads: no drain at file boundaries, and small
            # files (optimizer shards, rank files of a resharded load) read side by side.
            jobs = _read_jobs(plans, planner, cfg, opened, self.images)
            stats.jobs = len(jobs)
            stats.nbytes = sum(run_parallel(_run_job, jobs, threads=cfg.io.read_threads, timeout_s=cfg.timeout_s,
                                            name="cpuckpt-read"))
        t2 = time.perf_counter()
        stats.io_s = t2 - t1
        for fp in plans.values():
            for need in fp.needs:
                stats.bounce_nbytes += _finish_need(need, planner)
        stats.finish_s = time.perf_counter() - t2
        self.last_stats = stats
        self.last_read_s = time.perf_counter() - t0
        self.last_read_nbytes = stats.nbytes
        logger.info("cpuckpt load %s: %d items, %d bytes in %.3f s (%.2f GB/s; plan %.3f s, reads %.3f s, "
                    "copies into targets %.3f s for %d bytes)", self.load_id[:8], len(plan.items), stats.nbytes,
                    self.last_read_s, stats.nbytes / max(self.last_read_s, 1e-9) / 1e9, stats.plan_s,
                    stats.io_s, stats.finish_s, stats.bounce_nbytes)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_files(self, plan: LoadPlan, planner: LoadPlanner) -> dict[str, _FilePlan]:
        if self.metadata is None:
            raise RuntimeError("read_data() before set_up_storage_reader(): not called through DCP")
        chunk_shapes = _chunk_shapes(self.metadata)
        records = {n: dict(map(tuple, e.records)) for n, e in (self.manifest.files if self.manifest else {}).items()}
        plans: dict[str, _FilePlan] = {}
        for ri in plan.items:
            sinfo = self.storage_data.get(ri.storage_index)
            if sinfo is None:
                raise CheckpointCorrupt(f"{self.path}: .metadata has no storage entry for {ri.storage_index}")
            if getattr(sinfo, "transform_descriptors", None):
                raise CpuckptError(
                    f"{self.path}: {sinfo.relative_path} uses stream transforms {sinfo.transform_descriptors}; "
                    "cpuckpt does not read those, load it with torch's FileSystemReader"
                )
            rel = _safe_relpath(self.path, sinfo.relative_path)
            entry = self.manifest.files.get(rel) if self.manifest else None
            fp = plans.setdefault(rel, _FilePlan(str(self.path / rel), entry))
            lo, hi = int(sinfo.offset), int(sinfo.offset) + int(sinfo.length)
            if ri.type == LoadItemType.BYTE_IO:
                fp.needs.append(_Need(ri, lo, hi, bounce=torch.empty(hi - lo, dtype=torch.uint8)))
                continue
            dtype, shape = chunk_shapes[(ri.storage_index.fqn, tuple(ri.storage_index.offset or ()))]
            target = planner.resolve_tensor(ri).detach()
            if entry is None:
                fp.needs.append(_Need(ri, lo, hi, target=target, dtype=dtype, src_shape=shape))
                continue
            data_rel = records[rel].get(lo)
            if data_rel is None:
                raise CheckpointCorrupt(f"{fp.path}: manifest lists no tensor record at offset {lo}")
            fp.needs.append(_tensor_need(ri, lo + data_rel, dtype, shape, target, fp.path, hi))
        return plans


def _chunk_shapes(md: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, TensorStorageMetadata):
            for ch in tmd.chunks:
                out[(fqn, tuple(ch.offsets))] = (tmd.properties.dtype, tuple(ch.sizes))
    return out


def _safe_relpath(root: Path, rel: str) -> str:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise CheckpointCorrupt(f"{root}/.metadata: refusing data path {rel!r} outside the checkpoint directory")
    return str(p)


def _tensor_need(ri: ReadItem, data_lo: int, dtype: torch.dtype, shape: tuple[int, ...], target: torch.Tensor,
                 path: str, record_hi: int) -> _Need:
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    if data_lo + numel * itemsize > record_hi:
        raise CheckpointCorrupt(f"{path}: tensor record at {data_lo} overruns its DCP length")
    offsets, lengths = tuple(ri.storage_offsets), tuple(ri.lengths)
    full = all(o == 0 for o in offsets) and lengths == shape
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
        need = _Need(ri, lo, hi, target=target, dtype=dtype, src_shape=lengths)
        if target.device.type in ("cpu", "cuda") and target.dtype == dtype and target.is_contiguous():
            need.dst = flat_bytes(target)
        else:
            need.bounce = torch.empty(hi - lo, dtype=torch.uint8)
        return need
    hi = data_lo + numel * itemsize
    return _Need(ri, data_lo, hi, target=target, dtype=dtype, src_shape=shape, narrowed=True,
                 bounce=torch.empty(hi - data_lo, dtype=torch.uint8))


def _check_size(fp: _FilePlan) -> None:
    problem = size_mismatch(fp.path, fp.entry.nbytes if fp.entry is not None else None)
    if problem is not None:
        raise CheckpointCorrupt(str(problem))


ReadJob = Callable[[threading.Event], int]


def _run_job(job: ReadJob, cancel: threading.Event) -> int:
    return job(cancel)


def _read_jobs(plans: dict[str, _FilePlan], planner: LoadPlanner, cfg: Config, opened: contextlib.ExitStack,
               images: Mapping[str, ImageFile]) -> list[ReadJob]:
    """The read jobs of every file (opened into ``opened``); each job returns the bytes it read."""
    chunked = {}
    mapped: dict[str, ImageFile] = {}
    for rel, fp in plans.items():
        _check_size(fp)
        image = images.get(rel)
        if fp.entry is not None and image is not None and image.nbytes == fp.entry.nbytes:
            mapped[fp.path] = image
        if fp.entry is not None:
            mode = cfg.integrity.verify if fp.entry.checksum == "crc32c" and fp.entry.chunk_checksums else "off"
            if mode != "off" or fp.path in mapped or any(n.dst is not None and n.dst.is_cuda for n in fp.needs):
                chunked[fp.path] = {"always": 1.0, "sample": cfg.integrity.sample_fraction, "off": 0.0}[mode]
    pool = copiers = None
    if chunked:
        copiers = _Copiers()
    if set(chunked) - set(mapped):
        slot_bytes = max(fp.entry.chunk_bytes for fp in plans.values()  # type: ignore[union-attr]
                         if fp.path in chunked and fp.path not in mapped)
        pool = get_pool(slot_bytes, cfg.io.read_threads, pin=cfg.staging.pin, pretouch=cfg.staging.pretouch)
    jobs: list[ReadJob] = []
    for fp in plans.values():
        if fp.entry is None:
            jobs += _stock_jobs(fp, planner, cfg, opened)
        elif fp.path in chunked:
            jobs += _chunk_jobs(fp, fp.entry, cfg, opened, pool, copiers, verify_fraction=chunked[fp.path],
                                image=mapped.get(fp.path))
        else:
            jobs += _range_jobs(fp, cfg, opened)
    return jobs


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


def _chunk_jobs(fp: _FilePlan, entry: FileEntry, cfg: Config, opened: contextlib.ExitStack, pool: Any,
                copiers: Any, *, verify_fraction: float, image: ImageFile | None = None) -> list[ReadJob]:
    """Whole chunks read into pool slots (aligned: O_DIRECT works), verified, scattered to destinations.

    GPU destinations get their bytes by host-to-device copies from the (pinned) slot on a side
    stream; the slot is released once those copies completed. A file this process holds as a mapped
    ``image`` is not read at all: each chunk's "slot" is its bytes of the mapping.
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
    backend = BufferedFileBackend() if cfg.io.backend == "auto" else \
        get_backend(cfg.io.backend, Path(fp.path).parent, cfg.layout.align_bytes)
    align = cfg.layout.align_bytes
    if backend.aligned and cb % align:
        backend = BufferedFileBackend()
    fd = _open(backend, fp.path, opened) if image is None else -1

    def read_chunk(c: int, cancel: threading.Event) -> int:
        lo, hi = c * cb, min((c + 1) * cb, entry.nbytes)
        want = -(-(hi - lo) // align) * align if backend.aligned else hi - lo
        slot = pool.lease(cfg.timeout_s) if image is None else \
            Slot(-1, 0, image.tensor()[lo:hi], image.view()[lo:hi])
        try:
            got = backend.pread_into(fd, slot.view[:want], lo, fp.path) if image is None else hi - lo
            if got < hi - lo:
                raise CheckpointCorrupt(f"{fp.path}: file ends at {lo + got}, expected {entry.nbytes} bytes")
            # "sample" draws anew on every load, so repeated loads cover different chunks.
            draw = random.random()  # noqa: S311 - sampling, not security
            verify = verify_fraction >= 1.0 or draw < verify_fraction
            crc = crc32c.crc32c(slot.view[: hi - lo]) if verify else None
            if verify and (c >= len(entry.chunk_checksums) or crc != entry.chunk_checksums[c]):
                stored = entry.chunk_checksums[c] if c < len(entry.chunk_checksums) else None
                raise CheckpointCorrupt(
                    f"{fp.path}: checksum mismatch in bytes [{lo}, {hi}) (chunk {c}): "
                    f"stored {stored}, read {crc}; the file is damaged"
                )
            h2d = None
            for need in by_chunk[c]:
                a, b = max(need.lo, lo), min(need.hi, hi)
                dst, src = need.buffer[a - need.lo : b - need.lo], slot.tensor[a - lo : b - lo]
                if dst.is_cuda:
                    h2d = copiers.get(dst.device)
                    h2d.copy(dst, src)
                else:
                    dst.copy_(src)
            if h2d is not None:
                h2d.record().synchronize()  # the slot may be reused only after the copies ran
            return hi - lo
        finally:
            if image is None:
                pool.release(slot)

    return [functools.partial(read_chunk, c) for c in sorted(by_chunk)]


def _range_jobs(fp: _FilePlan, cfg: Config, opened: contextlib.ExitStack) -> list[ReadJob]:
    """Without verification: pread each needed range straight into its destination."""
    backend: FileBackend = BufferedFileBackend()
    pieces = []
    step = cfg.io.chunk_bytes
    for need in fp.needs:
        for a in range(need.lo, need.hi, step):
            pieces.append((need, a, min(a + step, need.hi)))
    if not pieces:
        return []
    fd = _open(backend, fp.path, opened)

    def read_piece(need: _Need, a: int, b: int, cancel: threading.Event) -> int:
        view = memoryview(need.buffer[a - need.lo : b - need.lo].numpy())
        got = backend.pread_into(fd, view, a, fp.path)
        if got < b - a:
            raise CheckpointCorrupt(f"{fp.path}: file ends at {a + got}, record needs bytes up to {b}")
        return got

    return [functools.partial(read_piece, *piece) for piece in pieces]


def _stock_jobs(fp: _FilePlan, planner: LoadPlanner, cfg: Config, opened: contextlib.ExitStack) -> list[ReadJob]:
    """A stock DCP file: one record per item, viewed in place when it is a plain tensor record."""
    if not fp.needs:
        return []
    backend = BufferedFileBackend()
    fd = _open(backend, fp.path, opened)

    def read_record(need: _Need, cancel: threading.Event) -> int:
        buf = bytearray(need.hi - need.lo)
        got = backend.pread_into(fd, memoryview(buf), need.lo, fp.path)
        if got < len(buf):
            raise CheckpointCorrupt(f"{fp.path}: file ends at {need.lo + got}, record needs up to {need.hi}")
        if need.ri.type == LoadItemType.BYTE_IO:
            need.bounce = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            return got
        src = _tensor_from_record(buf, fp.path, need.lo)
        src = _narrow(src, need.ri.storage_offsets, need.ri.lengths)
        need.target.copy_(src)  # type: ignore[union-attr]
        return got

    return [functools.partial(read_record, need) for need in fp.needs]


def _tensor_from_record(buf: bytearray, path: str, offset: int) -> torch.Tensor:
    info = parse_record(buf)
    if info is not None:
        if info.storage_nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
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


def _finish_need(need: _Need, planner: LoadPlanner) -> int:
    """Caller's thread: copy bounce buffers into targets, hand bytes and tensors back to DCP.

    Returns the bytes copied from a bounce buffer into a tensor target.
    """
    if need.ri.type == LoadItemType.BYTE_IO:
        planner.load_bytes(need.ri, io.BytesIO(need.bounce.numpy().tobytes()))  # type: ignore[union-attr]
        return 0
    target = need.target
    if target is None:
        raise RuntimeError(f"tensor read item {need.ri.storage_index} has no destination")
    if need.bounce is not None and need.dtype is not None:
        src = need.bounce.view(need.dtype).reshape(need.src_shape)
        if need.narrowed:
            src = _narrow(src, need.ri.storage_offsets, need.ri.lengths)
        target.copy_(src.reshape(target.shape))
        planner.commit_tensor(need.ri, target)
        return need.bounce.numel()
    planner.commit_tensor(need.ri, target)
    return 0
