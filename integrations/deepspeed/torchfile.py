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
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import pickle
import threading
import types
from dataclasses import dataclass
from typing import Any

import torch

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
            proxy = torch.empty(tuple(obj.shape), dtype=obj.dtype, requires_grad=grad)
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
    probe = torch.empty((2, 3), requires_grad=True)
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
    """Build the image of ``torch.save(obj)``: skeleton from ``torch.save`` under ``skip_data``.

    Args:
        obj: what ``torch.save`` would be given (nested dicts, lists, tensors, other objects).
        storage_alignment: alignment of every storage's data in the archive (torch's
            ``serialization.config.save.storage_alignment``); 4096 makes them O_DIRECT-aligned.

    Returns:
        The image's layout items (in file order) and, per item, the flat bytes to place (or None).
    """
    rec = _Recorder()
    sink = SparseSink()
    try:
        from torch.utils.serialization import config as _ser_config
        save_cfg: Any = _ser_config.save
    except ImportError:  # torch < 2.6 has no storage_alignment: storages are 64-byte aligned
        save_cfg = None
    with _ALIGNMENT_LOCK:
        old = getattr(save_cfg, "storage_alignment", None)
        if old is not None:
            save_cfg.storage_alignment = storage_alignment
        try:
            with torch.serialization.skip_data():
                torch.save(obj, sink, pickle_module=_pickle_module(rec))
        finally:
            if old is not None:
                save_cfg.storage_alignment = old
    regions = _data_regions(sink, rec)
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
    del rec.keep  # the proxies were only needed while pickling
    return TorchFileImage(items=items, sources=sources, data_offsets=offsets, nbytes=sink.end)


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
