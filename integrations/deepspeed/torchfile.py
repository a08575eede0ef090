"""torch.save-compatible files written by cpuckpt's pipeline. Plans the image; SaveJob does the I/O.

``torch.save`` builds the archive *skeleton* (pickle, zip headers and directory) under
``torch.serialization.skip_data()``, into a sink that keeps what was written and leaves each
storage's data region unwritten. The file image is then the skeleton bytes with every tensor's raw
bytes dropped into its region; :func:`layout_torch_file` plans it as one file of a
:class:`cpuckpt.transfer.save_job.SaveJob`, so the bytes are staged once into the host pool and ``pwrite`` by
worker threads.

Every plain tensor is pickled as a fresh, compact, contiguous CPU tensor of the same dtype, shape and
``requires_grad`` (a *proxy*; ``torch.empty`` only reserves address space and ``skip_data`` never
reads it), and its bytes come from the caller's tensor. So a view saves only its own bytes, never
its whole base storage (the clone DeepSpeed does for ``torch.save``, without the copy), non-leaf
views that require grad are detached, and the file loads as CPU tensors (``location`` "cpu"), like
``torch.save(t.cpu())``. Two distinct tensor objects viewing the same memory are written twice.

The skeleton has two builders. ``torch.save`` itself pays ~30 ms for DeepSpeed's model-states file (its
Python ``persistent_id`` per storage, a proxy tensor per tensor, a scan of the zip headers); at every save
that is interpreter time beside the trainer's. The fast builder pickles with the same C pickler, a stand-in
per storage and the persistent id ``torch.save`` would give it, and writes the records in ``torch.save``'s
order with torch's own zip writer (19 against 32 ms for a file of 216 tensors, on a 2-core box). It is
used once it has written, in this process, byte for byte what ``torch.save`` writes for a probe of every
kind of object it takes; anything else (tensor subclasses, dtypes saved as untyped storages, bare
storages) goes to ``torch.save``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import logging
import pickle
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.serialization import config as _ser_config

from cpuckpt.config import Config
from cpuckpt.format.layout import FileLayout, LayoutItem, plan_files
from cpuckpt.format.record import SparseSink
from cpuckpt.format.zipheader import written_entries
from cpuckpt.transfer.staging import flat_bytes

__all__ = ["TorchFileImage", "layout_torch_file", "plan_torch_file"]

logger = logging.getLogger(__name__)

_ALIGNMENT_LOCK = threading.Lock()  # torch's storage_alignment is a process-wide setting
# Exact types torch.save's persistent_id returns None for (it names only TypedStorage and storages).
# Classes and functions (a reduce's callable, an enum's class) are never storages either.
_NEVER_STORAGES = frozenset({int, float, bool, str, bytes, type(None), tuple, list, dict, collections.OrderedDict,
                             torch.Size, torch.dtype, torch.device, type, types.FunctionType,
                             types.BuiltinFunctionType})


@dataclass
class TorchFileImage:
    """One torch.save-compatible file: layout items (skeleton runs + tensor data) and their sources."""

    items: list[LayoutItem]
    sources: list[torch.Tensor | None]
    data_offsets: list[int]  # expected file offset of each tensor item's data (sanity check)
    nbytes: int


class _Recorder:
    """State shared by the pickler of one save: storage key -> the bytes that belong there."""

    def __init__(self) -> None:
        self.by_cdata: dict[int, torch.Tensor] = {}  # proxy storage -> caller's tensor (flat bytes)
        self.keys: dict[str, torch.Tensor] = {}  # storage key in the archive -> flat uint8 source
        self.keep: list[torch.Tensor] = []  # proxies stay alive so no storage address is reused


def _pickle_module(rec: _Recorder) -> Any:
    """A ``pickle_module`` for ``torch.save`` whose Pickler swaps tensors for proxies and records keys."""

    class Pickler(pickle.Pickler):
        def __init__(self, file: Any, protocol: int = 2, **kwargs: Any) -> None:
            self._protocol = protocol
            # torch's subclass defines persistent_id; wrap it (the C pickler reads it at __init__)
            # to learn which storage got which archive key.
            inner = self.persistent_id

            def persistent_id(obj: Any) -> Any:  # called for every object pickled: None for all but storages
                if type(obj) in _NEVER_STORAGES:
                    return None  # most objects: torch's two Python calls skipped
                pid = inner(obj)
                return pid if pid is None else _record_key(rec, obj, pid)

            self.persistent_id = persistent_id  # type: ignore[method-assign]
            super().__init__(file, protocol, **kwargs)

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized \
                    or obj.device.type == "meta":
                return NotImplemented  # Parameters reduce to their .data (a plain tensor) and come back here
            grad = obj.requires_grad and (obj.is_floating_point() or obj.is_complex())
            proxy = torch.empty(tuple(obj.shape), dtype=obj.dtype, requires_grad=grad, device="cpu")
            rec.keep.append(proxy)
            rec.by_cdata[proxy.untyped_storage()._cdata] = obj
            return _reduce_proxy(proxy, self._protocol)

    class Module:
        pass

    mod = Module()
    mod.Pickler = Pickler  # type: ignore[attr-defined]
    mod.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    mod.__name__ = "pickle"  # type: ignore[attr-defined]
    return mod


def _plain_reduce(proxy: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """What ``Tensor.__reduce_ex__`` returns for a fresh dense CPU tensor of a dtype with a typed storage,
    without its Python checks (~10 µs a tensor, a few ms for DeepSpeed's files on the save's call path)."""
    storage = torch.storage.TypedStorage(wrap_storage=proxy.untyped_storage(), dtype=proxy.dtype, _internal=True)
    return torch._utils._rebuild_tensor_v2, (storage, 0, tuple(proxy.shape), proxy.stride(), proxy.requires_grad,
                                             collections.OrderedDict())


@functools.cache
def _plain_reduce_agrees() -> bool:
    """This torch reduces a fresh tensor as :func:`_plain_reduce` does (checked once per process)."""
    probe = torch.empty((2, 3), requires_grad=True, device="cpu")  # the proxies are CPU tensors
    try:
        want, ours = probe.__reduce_ex__(2), _plain_reduce(probe)
    except Exception:
        return False
    (wf, wa), (of, oa) = want, ours
    return (wf is of and len(wa) == len(oa) and wa[1:] == oa[1:] and type(wa[0]) is type(oa[0])
            and wa[0].dtype == oa[0].dtype and wa[0]._untyped_storage._cdata == oa[0]._untyped_storage._cdata)


_NEW_DTYPES: frozenset = frozenset(getattr(torch.storage, "_new_dtypes", lambda: ())())  # reduced to v3 records


def _reduce_proxy(proxy: torch.Tensor, protocol: int) -> Any:
    if proxy.dtype not in _NEW_DTYPES and _plain_reduce_agrees():
        return _plain_reduce(proxy)
    return proxy.__reduce_ex__(protocol)


def _record_key(rec: _Recorder, obj: Any, pid: Any) -> Any:
    if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
        key = str(pid[2])
        if key not in rec.keys:
            storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
            src = rec.by_cdata.get(storage._cdata)
            if src is not None:
                rec.keys[key] = flat_bytes(src)
            else:  # a storage pickled as is (tensor subclass, bare storage): its bytes, whole
                rec.keys[key] = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
                    storage, 0, (storage.nbytes(),), (1,))
    return pid


def plan_torch_file(obj: Any, *, storage_alignment: int = 4096) -> TorchFileImage:
    """Build the image of ``torch.save(obj)``: its skeleton (the fast builder where it holds, else
    ``torch.save`` under ``skip_data``) and, per storage, where its bytes go.

    Args:
        obj: what ``torch.save`` would be given (nested dicts, lists, tensors, other objects).
        storage_alignment: alignment of every storage's data in the archive (torch's
            ``serialization.config.save.storage_alignment``); 4096 makes them O_DIRECT-aligned.

    Returns:
        The image's layout items (in file order) and, per item, the flat bytes to place (or None).
    """
    with _ALIGNMENT_LOCK, _storage_alignment(storage_alignment):
        skeleton = _fast_skeleton(obj) if _fast_matches_torch() else None
        if skeleton is None:
            skeleton = _torch_skeleton(obj)
    sink, regions = skeleton
    pieces = sorted(sink.pieces)
    items: list[LayoutItem] = []
    sources: list[torch.Tensor | None] = []
    offsets: list[int] = []
    cursor = 0
    k = 0
    for data_offset, nbytes, src in regions:
        head, k = _bytes_between(pieces, k, cursor, data_offset)
        items.append(LayoutItem(data_nbytes=nbytes, head=head))
        sources.append(src)
        offsets.append(data_offset)
        cursor = data_offset + nbytes
    tail, _ = _bytes_between(pieces, k, cursor, sink.end)
    items.append(LayoutItem(data_nbytes=len(tail), payload=tail))
    sources.append(None)
    return TorchFileImage(items=items, sources=sources, data_offsets=offsets, nbytes=sink.end)


@contextlib.contextmanager
def _storage_alignment(alignment: int) -> Iterator[None]:
    """torch's save-time storage alignment set to ``alignment`` (callers hold ``_ALIGNMENT_LOCK``)."""
    old = _ser_config.save.storage_alignment
    _ser_config.save.storage_alignment = alignment
    try:
        yield
    finally:
        _ser_config.save.storage_alignment = old


Regions = list[tuple[int, int, torch.Tensor]]  # (data offset, nbytes, flat uint8 source) per storage, in file order


def _torch_skeleton(obj: Any) -> tuple[SparseSink, Regions]:
    """The skeleton as ``torch.save`` writes it (proxies pickled, data skipped), and its storages' regions."""
    rec = _Recorder()
    sink = SparseSink()
    try:
        with torch.serialization.skip_data():
            torch.save(obj, sink, pickle_module=_pickle_module(rec))
        return sink, _data_regions(sink, rec)
    finally:  # the pickler's class holds ``rec`` in a reference cycle: free the proxies and sources now, not at a GC
        rec.keep.clear()
        rec.by_cdata.clear()
        rec.keys.clear()


class _Unsupported(Exception):
    """The fast builder met an object it does not write as ``torch.save`` would (``torch.save`` takes it)."""


class _StorageRef:
    """Stands for one storage in the fast builder's pickle: its persistent id is looked up by identity."""

    __slots__ = ()


@functools.cache
def _storage_class(dtype: torch.dtype) -> type:
    """The legacy storage class ``torch.save`` names in a ``dtype`` storage's persistent id."""
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    """A contiguous tensor's strides, as a list: each reduce needs a tuple of its own (the pickle memoizes
    tuples by identity, and ``torch.save`` pickles a fresh one per tensor)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _fast_skeleton(obj: Any) -> tuple[SparseSink, Regions] | None:
    """The skeleton ``torch.save`` writes under ``skip_data``, built without it; None where ``obj`` holds
    something only ``torch.save`` writes right (see :class:`_Unsupported`).

    Each plain dense tensor is reduced as :func:`_plain_reduce` reduces its proxy, with a
    :class:`_StorageRef` in the storage's place; storage keys are numbered in pickling order, as
    ``torch.save`` numbers its fresh proxies. The records follow ``torch.serialization._save``'s order.
    """
    pids: dict[int, tuple[Any, ...]] = {}
    refs: list[_StorageRef] = []  # alive while pickling, so no id is reused
    tensors: list[torch.Tensor] = []
    rebuild = torch._utils._rebuild_tensor_v2
    ordered = collections.OrderedDict

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:  # called for every object pickled
            kind = type(o)
            if kind in _NEVER_STORAGES:
                return None
            if kind is _StorageRef:
                return pids[id(o)]
            if isinstance(o, (torch.storage.TypedStorage, torch.UntypedStorage)):
                raise _Unsupported(f"a {type(o).__name__} pickled as is")
            return None

        def reducer_override(self, t: Any) -> Any:
            if type(t) is not torch.Tensor:
                return NotImplemented  # Parameters reduce to their .data (a plain tensor) and come back here
            if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.dtype in _NEW_DTYPES:
                raise _Unsupported(f"a {t.layout} {t.dtype} tensor on {t.device}")
            ref = _StorageRef()
            refs.append(ref)
            pids[id(ref)] = ("storage", _storage_class(t.dtype), str(len(tensors)), "cpu", t.numel())
            tensors.append(t)
            shape = tuple(t.shape)
            grad = t.requires_grad and (t.is_floating_point() or t.is_complex())
            return rebuild, (ref, 0, shape, tuple(_contiguous_strides(shape)), grad, ordered())

    buf = io.BytesIO()
    try:
        try:
            Pickler(buf, torch.serialization.DEFAULT_PROTOCOL).dump(obj)
        except _Unsupported as e:
            logger.debug("torch file skeleton: %s; torch.save writes it", e)
            return None
        data = buf.getvalue()
        sink = SparseSink()
        regions: Regions = []
        with torch.serialization._open_zipfile_writer(sink) as archive:
            alignment = str(_ser_config.save.storage_alignment)
            for name, value in (("data.pkl", data), (".format_version", "1"), (".storage_alignment", alignment),
                                ("byteorder", sys.byteorder)):
                archive.write_record(name, value, len(value))
            for key, t in enumerate(tensors):
                nbytes = t.numel() * t.element_size()
                archive.write_record_metadata(f"data/{key}", nbytes)
                regions.append((_data_start(sink, nbytes, key), nbytes, flat_bytes(t)))
        return sink, regions
    finally:  # the pickler's class holds these in a reference cycle: the caller's tensors go now, not at a GC
        tensors.clear()
        refs.clear()
        pids.clear()


def _data_start(sink: SparseSink, nbytes: int, key: int) -> int:
    """Where the data of the record just written begins: after its header, before its data descriptor
    (an empty record has none)."""
    at, last = sink.pieces[-1]
    if not nbytes:
        return at + len(last)
    head_at, head = sink.pieces[-2]
    if not last.startswith(b"PK\x07\x08") or head_at + len(head) + nbytes != at:
        raise RuntimeError(f"torch file skeleton: record data/{key} is not header, data, descriptor")
    return at - nbytes


@functools.cache
def _fast_matches_torch() -> bool:
    """The fast builder writes what ``torch.save`` writes, byte for byte, for a probe of every kind of
    object it takes (checked once per process, at the alignment set then)."""
    cpu = torch.device("cpu")  # whatever the default device; and no random draws (the job's RNG stays as it was)
    base = torch.arange(600, dtype=torch.float32, device=cpu)
    param = torch.nn.Parameter(torch.arange(12.0, device=cpu).view(4, 3))
    leaf = torch.ones(3, 3, device=cpu, requires_grad=True)
    probe = {"view": base[10:20], "base": base, "strided": base[::7], "param": param, "shared": [param, base],
             "bf16": base[:5].bfloat16(), "nonleaf": (leaf * 2)[1:], "empty": torch.empty(0, 3, device=cpu),
             "scalar": torch.tensor(2.5, device=cpu), "i64": torch.arange(4, device=cpu),
             "bool": torch.arange(3, device=cpu) > 1, "shape": torch.Size([2, 3]),
             "ordered": collections.OrderedDict(a=1, b=None), "text": "s", "n": 7,
             "f16": torch.ones(2, 2, dtype=torch.float16, device=cpu).t(), "i8": torch.zeros(3, dtype=torch.int8,
                                                                                             device=cpu)}
    if not _plain_reduce_agrees():
        return False
    fast, torch_made = _fast_skeleton(probe), _torch_skeleton(probe)
    if fast is None:
        return False
    (fast_sink, fast_regions), (sink, regions) = fast, torch_made
    same = (fast_sink.read_at(0, fast_sink.end) == sink.read_at(0, sink.end)
            and [r[:2] for r in fast_regions] == [r[:2] for r in regions]
            and all(torch.equal(a[2], b[2]) for a, b in zip(fast_regions, regions, strict=True)))
    if not same:
        logger.warning("torch file skeleton: this torch writes differently from cpuckpt's builder; "
                       "using torch.save (slower)")
    return same


def _data_regions(sink: SparseSink, rec: _Recorder) -> list[tuple[int, int, torch.Tensor]]:
    """(data offset, nbytes, source) of every storage entry ``<archive>/data/<key>``, in file order."""
    found: dict[str, int] = {}
    for name, data_start in written_entries(sink.pieces, sink.read_at):
        head, _, key = name.rpartition("/")
        if head.endswith("/data") and head.count("/") == 1 and key in rec.keys:
            found[key] = data_start
    if set(found) != set(rec.keys):
        missing = sorted(set(rec.keys) - set(found))
        raise RuntimeError(f"torch.save skeleton: no zip entry found for storages {missing[:5]}; "
                           "this torch writes archives cpuckpt does not understand")
    regions = sorted((found[k], rec.keys[k].numel(), rec.keys[k]) for k in found)
    for (a, n, _), (b, _, _) in itertools.pairwise(regions):
        if a + n > b:
            raise RuntimeError(f"torch.save skeleton: storage regions overlap at offset {b}")
    return regions


def _bytes_between(pieces: list[tuple[int, bytes]], k: int, start: int, stop: int) -> tuple[bytes, int]:
    """The skeleton bytes in ``[start, stop)`` from the sorted pieces, starting the scan at ``k``.

    A gap that no piece covers must not exist outside data regions: that would be a byte torch.save
    never wrote, so the image would differ from its file.
    """
    out = bytearray()
    cursor = start
    while k < len(pieces) and pieces[k][0] < stop:
        pos, data = pieces[k]
        if pos + len(data) <= cursor:
            k += 1
            continue
        if pos > cursor:
            raise RuntimeError(f"torch.save skeleton: bytes [{cursor}, {pos}) were never written")
        hi = min(pos + len(data), stop)
        out += data[cursor - pos : hi - pos]
        cursor = hi
        if hi < pos + len(data):
            break
        k += 1
    if cursor != stop:
        raise RuntimeError(f"torch.save skeleton: bytes [{cursor}, {stop}) were never written")
    return bytes(out), k


def layout_torch_file(obj: Any, cfg: Config, *, storage_alignment: int = 4096,
                      ) -> tuple[list[FileLayout], list[torch.Tensor | None]]:
    """Plan ``torch.save(obj)``'s file as one cpuckpt file image, ready for a :class:`SaveJob`.

    Returns the single file's layout and the per-item sources (flat uint8 tensors, or None for the
    skeleton's tail). The caller builds ``SaveJob(dir, [name], files, sources, cfg, ...)``.
    """
    image = plan_torch_file(obj, storage_alignment=storage_alignment)
    files, placements = plan_files(image.items, num_files=1, chunk_bytes=cfg.io.chunk_bytes,
                                   align_bytes=cfg.layout.align_bytes, align_data_min_bytes=0)
    tensor_places = [p for p in placements if image.sources[p.item] is not None]
    if [p.data_offset for p in tensor_places] != image.data_offsets or files[0].nbytes != image.nbytes:
        raise RuntimeError("planned image does not match the torch.save skeleton")
    return files, image.sources


def chunk_count(nbytes: int, cfg: Config) -> int:
    """Chunks (pool slots) a file image of ``nbytes`` needs."""
    return -(-nbytes // cfg.io.chunk_bytes)
