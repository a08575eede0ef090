"""Export a DCP checkpoint to consolidated safetensors or torch.save files (``cpuckpt convert``).

Streaming, so host memory stays bounded: the output files' layout is fixed first (a safetensors
header, or a ``torch.save`` archive written under ``torch.serialization.skip_data`` from fake
tensors, which reserves every storage's bytes without touching them). Then tensors are loaded in
batches of at most ``memory_budget_bytes`` through :func:`cpuckpt.load` (resharded to full tensors,
checksums verified) into a state dict that holds only that batch, and each tensor's bytes are
``pwrite``-n to their place. Peak memory is about one batch (or the largest tensor, if larger) plus
the reader's pool (``io.read_threads`` x ``io.chunk_bytes``).

Atomic: each output file is written in a hidden directory beside it (``.cpuckpt-convert-*/<name>``), fsynced, and
renamed to its name only once complete; sharded, the shards are renamed once every one is complete, and the
index is written last. A failed or interrupted convert thus leaves no output (and no temporary file), and an
existing output is replaced only by a complete one. A killed one (SIGKILL, the OOM killer) leaves its
``.cpuckpt-convert-*`` directories, and nothing else, for the user to remove.

Non-tensor items are read from their records as :func:`cpuckpt.load` reads them (``weights_only`` semantics plus
the values it also allows, numpy's among them: ``format.unpickle.load_value``; never arbitrary pickles). With
safetensors they go into the header's ``__metadata__`` as JSON; values that are not JSON-able, or that the
unpickler refuses, are skipped and listed in the report; an item named ``format``
is refused (it would replace the header's ``"format": "pt"``, which loaders such as transformers check).

Object storage: ``src`` may be an ``s3://`` checkpoint (read by ranged GETs, as :func:`cpuckpt.load` reads it),
and ``out`` an ``s3://`` object (or, sharded, a prefix). An object cannot be written at offsets, and a ``torch.save``
archive's storages do not lie in tensor order, so each output file is first written as above to a local
temporary file (in ``staging_dir``, default ``$TMPDIR``), then uploaded as one multipart upload and removed:
local disk holds one output file (one shard) at a time. The object appears only when its upload completes; a
failed upload is aborted, so a failed convert leaves no partial object (shards already uploaded stay).

Note that the zip CRC-32 fields of the tensor entries of a ``--to torch`` file are not those of the
data (as in cpuckpt's own records, docs/FORMAT.md 3.2): ``torch.load`` reads it, Python's ``zipfile``
CRC check does not.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from cpuckpt.api import load
from cpuckpt.backend import s3commit
from cpuckpt.backend.committed import load_metadata
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CpuckptError, StorageIOError
from cpuckpt.format.dtypes import tensor_nbytes
from cpuckpt.format.unpickle import load_value
from cpuckpt.format.zipheader import entry_data_offset
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.transfer.files import fsync_dir
from cpuckpt.transfer.objstore import ObjectStore, open_store, upload_file

__all__ = ["ExportReport", "export_checkpoint"]

logger = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")


@dataclass
class _Tensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class ExportReport:
    """What :func:`export_checkpoint` wrote and left out."""

    files: list[Path | S3Url] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # bytes of each of ``files``
    index: Path | S3Url | None = None
    tensors: int = 0
    nbytes: int = 0
    metadata: dict[str, str] = field(default_factory=dict)  # non-tensor items kept (name -> JSON or repr)
    skipped: dict[str, str] = field(default_factory=dict)  # non-tensor items left out (name -> why)


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike, *, fmt: str = "safetensors",
                      max_shard_bytes: int | None = None, memory_budget_bytes: int = 1 << 30,
                      config: Config | str | os.PathLike | dict | None = None,
                      progress: Callable[[int], None] | None = None, overwrite: bool = False,
                      staging_dir: str | os.PathLike | None = None) -> ExportReport:
    """Write the checkpoint at ``src`` as full (unsharded) tensors in ``fmt`` files.

    Args:
        src: a committed cpuckpt or stock DCP checkpoint directory, or an ``s3://`` checkpoint prefix.
        out: the output file (or ``s3://`` object); with ``max_shard_bytes``, a directory (or ``s3://`` prefix)
            that receives HF-style shards
            (``model-00001-of-0000N.safetensors`` or ``pytorch_model-...bin``) and an index JSON
            (just ``model.safetensors`` / ``pytorch_model.bin`` when everything fits in one shard).
        fmt: ``"safetensors"`` or ``"torch"``.
        max_shard_bytes: largest shard (tensor data bytes); a larger tensor gets a shard of its own.
        memory_budget_bytes: tensor bytes held in memory at once (a larger tensor is loaded alone).
        config: reader configuration for :func:`cpuckpt.load`.
        progress: called with each batch's tensor bytes once written.
        overwrite: replace an existing output file (sharded: write into a non-empty directory).
        staging_dir: where an ``s3://`` output's files are written before their upload (default ``$TMPDIR``).

    Returns:
        An :class:`ExportReport`.

    Raises:
        ValueError: unknown ``fmt``, a dtype the format cannot store, or (safetensors) a non-tensor item named
            ``format`` or a tensor named ``__metadata__``.
        IntegrityError / CheckpointCorrupt: the source is incomplete or damaged.
        FileExistsError: the output exists (a file, or a non-empty directory when sharded) and not ``overwrite``.
        IsADirectoryError / NotADirectoryError: the output is a directory where a file goes, or the reverse.
        FileNotFoundError: the output's parent directory does not exist (it is never created silently).
        ConfigError: ``src`` or ``out`` is a URL other than ``s3://``.
        StorageIOError: object storage refused a read or an upload (naming the object).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; choose one of {', '.join(FORMATS)}")
    src_where = checkpoint_path(src)
    out_where = checkpoint_path(out, "output path")
    store = open_store(resolve_config(config).s3, threads=4) \
        if isinstance(src_where, S3Url) or isinstance(out_where, S3Url) else None
    sharded = max_shard_bytes is not None
    if isinstance(out_where, S3Url):
        assert store is not None
        _check_output_s3(store, out_where, sharded=sharded, overwrite=overwrite)
        staging = Path(tempfile.mkdtemp(prefix="cpuckpt-convert-", dir=staging_dir))
        try:
            return _export(src_where, staging / (out_where.name if not sharded else "out"), fmt, max_shard_bytes,
                           memory_budget_bytes, config, progress, store, upload_to=out_where)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    out_path = Path(out_where)
    _check_output(out_path, sharded=sharded, overwrite=overwrite)
    return _export(src_where, out_path, fmt, max_shard_bytes, memory_budget_bytes, config, progress, store)


def _export(src: str | S3Url, out_path: Path, fmt: str, max_shard_bytes: int | None, memory_budget_bytes: int,
            config: Any, progress: Callable[[int], None] | None, store: ObjectStore | None, *,
            upload_to: S3Url | None = None) -> ExportReport:
    """The export proper, into ``out_path``; with ``upload_to``, each finished file is uploaded there (the
    file's name under the prefix when sharded) and removed before the next one is written."""
    src_path: Path | S3Url = src if isinstance(src, S3Url) else Path(src)
    if isinstance(src_path, S3Url):
        assert store is not None
        md = s3commit.load_metadata(store, src_path)
    else:
        md = load_metadata(src_path)
    tensors: list[_Tensor] = []
    extras: dict[str, Any] = {}
    report = ExportReport()
    for name, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shape = tuple(int(s) for s in item.size)
            tensors.append(_Tensor(name, item.properties.dtype, shape, tensor_nbytes(item.properties.dtype, shape)))
        elif isinstance(item, BytesStorageMetadata):
            _read_extra(src_path, md, name, fmt, extras, report, store)
    if fmt == "safetensors":
        _check_safetensors_names(tensors, report.metadata)
    shards = _shard(tensors, max_shard_bytes)
    created = False
    index: Path | None = None
    if max_shard_bytes is None:
        targets = [out_path]
    else:
        created = not out_path.exists()
        out_path.mkdir(exist_ok=True)
        stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
        n = len(shards)
        targets = [out_path / f"{stem}.{ext}"] if n == 1 else \
            [out_path / f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
        index = out_path / f"{stem}.{ext}.index.json"
    weight_map: dict[str, str] = {}
    done: list[tuple[Path, Path]] = []  # (temporary, final name) of complete local files, published at the end
    try:
        for k, (shard, target) in enumerate(zip(shards, targets)):
            shard_extras = extras if k == 0 or fmt == "safetensors" else {}
            tmp = _write_file(src_path, target, shard, fmt, shard_extras, report.metadata, memory_budget_bytes,
                              config, progress)
            size = tmp.stat().st_size
            if upload_to is not None:
                assert store is not None
                dest = upload_to / target.name if max_shard_bytes is not None else upload_to
                try:
                    _upload(store, tmp, dest, config)
                finally:
                    _discard(tmp)
                report.files.append(dest)
            else:
                done.append((tmp, target))
                report.files.append(target)
            report.sizes.append(size)
            for t in shard:
                weight_map[t.name] = target.name
        report.tensors = len(tensors)
        report.nbytes = sum(t.nbytes for t in tensors)
        text: str | None = None  # the index, only for several shards
        if len(targets) > 1:
            meta: dict[str, Any] = {"total_size": report.nbytes}
            if fmt == "safetensors" and report.metadata:
                meta["cpuckpt_extras"] = report.metadata
            text = json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        if upload_to is None:
            _publish(done, index, text)
            report.index = index if text is not None else None
        elif text is not None and index is not None:
            assert store is not None
            report.index = upload_to / index.name
            store.put(report.index, text.encode())
    except BaseException:  # Ctrl-C too: no partial file may stay behind
        for tmp, _ in done:
            _discard(tmp)
        if created:
            with suppress(OSError):  # not empty: a failure after some files were published
                out_path.rmdir()
        raise
    return report


def _temporary(target: Path) -> Path:
    """Where ``target`` is written until complete: its own name in a new hidden directory beside it (the same
    filesystem, so the rename is atomic; unique even among hosts sharing the directory; and ``torch.save`` names
    the archive inside by the file's name, so the published bytes are those of a direct save)."""
    return Path(tempfile.mkdtemp(prefix=".cpuckpt-convert-", dir=target.parent)) / target.name


def _discard(tmp: Path) -> None:
    """Remove a temporary file of :func:`_temporary` and its directory."""
    tmp.unlink(missing_ok=True)
    with suppress(OSError):
        tmp.parent.rmdir()


def _write_file(src: Path | S3Url, target: Path, shard: list[_Tensor], fmt: str, extras: dict[str, Any],
                metadata: dict[str, str], budget: int, config: Any, progress: Callable[[int], None] | None) -> Path:
    """Write one complete, fsynced output file under :func:`_temporary` ``(target)`` and return that path.

    Nothing is written at ``target`` itself: the header is written before the data, so a failure midway (a
    checksum mismatch, Ctrl-C, a full disk) would leave a loadable file of zeros there. The partial file is
    removed on any failure.
    """
    tmp = _temporary(target)
    try:
        if fmt == "safetensors":
            offsets = _write_safetensors_header(tmp, shard, metadata)
        else:
            offsets = _write_torch_skeleton(tmp, shard, extras)
        _fill(src, tmp, shard, offsets, budget, config, progress)
    except BaseException:
        _discard(tmp)
        raise
    return tmp


def _publish(done: list[tuple[Path, Path]], index: Path | None, index_text: str | None) -> None:
    """Rename every complete file to its name, then write the index (if any) the same way.

    Order matters: an index must never name a shard that is not complete, so a previous output's index goes
    first (it may name shards about to be replaced) and the new one comes after the shards' renames are durable.
    """
    if not done:
        return
    directory = done[0][1].parent
    if index is not None and index.exists():
        index.unlink()
        fsync_dir(directory)
    for tmp, target in done:
        os.replace(tmp, target)
        tmp.parent.rmdir()
    fsync_dir(directory)
    if index is not None and index_text is not None:
        tmp = _temporary(index)
        try:
            with open(tmp, "w") as f:
                f.write(index_text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, index)
            tmp.parent.rmdir()
        except BaseException:
            _discard(tmp)
            raise
        fsync_dir(directory)


def _upload(store: ObjectStore, path: Path, url: S3Url, config: Any) -> None:
    """One multipart upload of the finished local file ``path`` to ``url`` (aborted on failure)."""
    cfg = resolve_config(config)
    logger.info("uploading %s (%d bytes) to %s", path, path.stat().st_size, url)
    upload_file(store, path, url, part_bytes=cfg.io.chunk_bytes, threads=cfg.io.threads, timeout_s=cfg.timeout_s)


def _check_output_s3(store: ObjectStore, out: S3Url, *, sharded: bool, overwrite: bool) -> None:
    """``_check_output`` for an ``s3://`` output: the bucket usable, no object replaced without ``overwrite``."""
    store.check_bucket(out)
    if not out.key:
        raise StorageIOError(f"{out}: give an object key (or, sharded, a prefix) under the bucket", path=str(out))
    under = next(iter(store.list(S3Url(out.bucket, out.key + "/"))), None)
    if sharded:
        if store.head(out) is not None:
            raise StorageIOError(f"{out}: is an object (with a maximum shard size, the output is a prefix of "
                                 "shards)", path=str(out), errno_=errno.ENOTDIR)
        if under is not None and not overwrite:
            raise StorageIOError(f"{out}: objects exist under this prefix ({under.key}); pass --overwrite "
                                 "(overwrite=True) to write the shards into it", path=str(out), errno_=errno.EEXIST)
        return
    if under is not None:
        raise StorageIOError(f"{out}: objects exist under it as a prefix ({under.key}); give an object name (or a "
                             "maximum shard size to write shards under a prefix)", path=str(out), errno_=errno.EISDIR)
    if store.head(out) is not None and not overwrite:
        raise StorageIOError(f"{out}: exists; pass --overwrite (overwrite=True) to replace it", path=str(out),
                             errno_=errno.EEXIST)


def _check_output(out: Path, *, sharded: bool, overwrite: bool) -> None:
    """Refuse, before anything is read or written, an output path that cannot or must not be written."""
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out}: its parent directory {out.parent} does not exist (create it first)")
    if sharded:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out}: exists and is not a directory (with a maximum shard size, the "
                                     "output is a directory of shards)")
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out}: directory is not empty; pass --overwrite (overwrite=True) to write "
                                  "the shards into it")
        return
    if out.is_dir():
        raise IsADirectoryError(f"{out}: is a directory; give a file name (or a maximum shard size to write "
                                "shards into a directory)")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: exists; pass --overwrite (overwrite=True) to replace it")


def _read_extra(src: Path | S3Url, md: Any, name: str, fmt: str, extras: dict[str, Any], report: ExportReport,
                store: ObjectStore | None) -> None:
    """Read one non-tensor item's record (as :func:`cpuckpt.load` does) and keep it where the format can hold it."""
    sinfo = next((s for idx, s in (md.storage_data or {}).items() if idx.fqn == name), None)
    if sinfo is None:
        report.skipped[name] = ".metadata has no record for it"
        return
    rel = PurePosixPath(sinfo.relative_path)
    if rel.is_absolute() or ".." in rel.parts:
        report.skipped[name] = f"record path {sinfo.relative_path!r} leaves the checkpoint directory"
        return
    if isinstance(src, S3Url):
        assert store is not None
        buf = bytearray(int(sinfo.length))
        got = store.get_into(src / str(rel), int(sinfo.offset), memoryview(buf))
        data = bytes(buf[:got])
    else:
        with open(src / rel, "rb") as f:
            f.seek(int(sinfo.offset))
            data = f.read(int(sinfo.length))
    try:
        value = load_value(data, name, where=str(src))
    except CpuckptError as e:
        report.skipped[name] = f"not loadable without running its pickle's code: {type(e).__name__}"
        return
    if _holds_tensor(value):
        report.skipped[name] = "a non-tensor item that holds tensors"
        return
    if fmt == "safetensors":
        try:
            report.metadata[name] = json.dumps(value, sort_keys=True)
        except (TypeError, ValueError):
            report.skipped[name] = f"a {type(value).__name__} is not JSON-able"
            return
    else:
        report.metadata[name] = repr(value)[:200]
    extras[name] = value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(v) for v in value)
    return False


def _pack(tensors: list[_Tensor], budget: int, align: int = 1) -> list[list[tuple[_Tensor, int]]]:
    """Split ``tensors`` in order into groups of at most ``budget`` bytes (a larger tensor goes alone):
    (tensor, offset in its group) pairs, each tensor's bytes rounded up to ``align``. No empty groups."""
    groups: list[list[tuple[_Tensor, int]]] = [[]]
    used = 0
    for t in tensors:
        if groups[-1] and used + t.nbytes > budget:
            groups.append([])
            used = 0
        groups[-1].append((t, used))
        used += -(-t.nbytes // align) * align
    return [g for g in groups if g]


def _shard(tensors: list[_Tensor], max_shard_bytes: int | None) -> list[list[_Tensor]]:
    if max_shard_bytes is None:
        return [tensors]
    return [[t for t, _ in group] for group in _pack(tensors, max_shard_bytes)] or [[]]


def _safetensors_dtypes() -> dict[torch.dtype, str]:
    try:  # safetensors' own table (0.4 onwards), so new dtypes follow the installed version
        from safetensors.torch import _TYPES

        return {dt: name for name, dt in _TYPES.items()}
    except ImportError:
        return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


def _check_safetensors_names(tensors: list[_Tensor], metadata: dict[str, str]) -> None:
    """Refuse names that would overwrite the header's own keys, before anything is written.

    The kept items are read back under their own names (``safe_open(...).metadata()[name]``), so a clash is
    refused rather than renamed.
    """
    if "format" in metadata:
        raise ValueError("non-tensor item 'format': it would replace the safetensors metadata's \"format\": \"pt\" "
                         "(which loaders such as transformers check); rename the item in the state dict, or use "
                         "--to torch")
    if any(t.name == "__metadata__" for t in tensors):
        raise ValueError("tensor '__metadata__': the name is the safetensors header's metadata key; rename it in "
                         "the state dict, or use --to torch")


def _write_safetensors_header(target: Path, shard: list[_Tensor], metadata: dict[str, str]) -> dict[str, int]:
    """Write the header, size the file; return each tensor's absolute data offset."""
    names = _safetensors_dtypes()
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {"format": "pt", **metadata}
    else:
        header["__metadata__"] = {"format": "pt"}
    pos = 0
    rel: dict[str, int] = {}
    for t in shard:
        if t.dtype not in names:
            raise ValueError(f"{t.name}: dtype {t.dtype} cannot be stored in safetensors; use --to torch")
        header[t.name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        rel[t.name] = pos
        pos += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + pos)
    base = 8 + len(blob)
    return {name: base + off for name, off in rel.items()}


def _write_torch_skeleton(target: Path, shard: list[_Tensor], extras: dict[str, Any]) -> dict[str, int]:
    """``torch.save`` the shard's dict with fake tensors and no storage bytes; find each storage's offset."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.serialization import skip_data

    with FakeTensorMode():
        fake = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in shard}
    # Tensors first, so storage keys 0..n-1 are the tensors in order (torch.save numbers storages in
    # pickling order; extras hold no tensors, checked by _holds_tensor).
    obj: dict[str, Any] = {**fake, **{k: v for k, v in extras.items() if k not in fake}}
    with skip_data(materialize_fake_tensors=True):
        torch.save(obj, target)
    offsets = _zip_data_offsets(target)
    out = {}
    for i, t in enumerate(shard):
        key = f"data/{i}"
        if key not in offsets:
            raise RuntimeError(f"{target}: torch.save wrote no storage {key} for {t.name}")
        out[t.name] = offsets[key]
    return out


def _zip_data_offsets(path: Path) -> dict[str, int]:
    """``"data/<key>"`` -> absolute offset of that entry's bytes in a torch.save archive."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for zi in z.infolist():
            parts = zi.filename.split("/", 1)
            if len(parts) != 2 or not parts[1].startswith("data/"):
                continue
            offset = entry_data_offset(zi, lambda start, stop: os.pread(f.fileno(), stop - start, start))
            if offset is None:
                raise RuntimeError(f"{path}: bad local header for {zi.filename}")
            out[parts[1]] = offset
    return out


def _batches(shard: list[_Tensor], budget: int) -> list[list[tuple[_Tensor, int]]]:
    """Split the shard into batches of at most ``budget`` bytes: (tensor, offset in the arena) pairs."""
    return _pack(shard, budget, _ALIGN)


_ALIGN = 64  # arena offsets: a multiple of every element size


def _fill(src: Path | S3Url, target: Path, shard: list[_Tensor], offsets: dict[str, int], budget: int,
          config: Any, progress: Callable[[int], None] | None) -> None:
    """Load the shard's tensors batch by batch into one reused arena; pwrite each tensor's bytes to its offset;
    fsync.

    One arena for every batch (not fresh tensors per batch) keeps the allocator from holding on to
    freed batches: peak memory is the arena, whatever malloc does with large blocks.
    """
    batches = _batches(shard, budget)
    arena_nbytes = max((off + -(-t.nbytes // _ALIGN) * _ALIGN for b in batches for t, off in b), default=0)
    arena = torch.empty(max(arena_nbytes, 1), dtype=torch.uint8)
    fd = os.open(target, os.O_WRONLY)
    try:
        for batch in batches:
            state = {t.name: arena[off : off + t.nbytes].view(t.dtype).reshape(t.shape) for t, off in batch}
            load(state, src, config)
            for t, off in batch:
                view = memoryview(arena[off : off + t.nbytes].numpy())
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offsets[t.name] + done)
            if progress is not None:
                progress(sum(t.nbytes for t, _ in batch))
        os.fsync(fd)  # durable before it is renamed to its name
    finally:
        os.close(fd)
