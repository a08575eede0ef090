"""A rank's resolved save, reused when the next state dict repeats it: one check per item, no DCP.

Plan reuse (``format.plancache``) skips DCP's planning, but a reused plan still resolves every item
through the planner (set-up traversal, ``resolve_data``), builds a flat byte view per tensor, a
record skeleton per item, a layout key and the write results: ~30 us per item on the trainer's
thread. Training saves the same tensors again and again, usually through new wrapper objects
(``module.state_dict()`` returns fresh ``detach()`` aliases of the same storages), so
``CachedItems`` keeps, per write item, where its value sits in the state dict (a position in DCP's
traversal order) and what it resolved to (the tensor's flat byte view), together with the layout,
records, write results and the prepared batched fills (``transfer.fillplan``). A later save uses
them after one walk of the state dict and one comparison per leaf:

- the containers: each mapping's class, keys and key types, each traversed list's class and length,
  and every leaf's class (DCP's traversal: mappings and lists holding tensors or mappings are
  walked, other values are leaves written as pickled bytes);
- a tensor this rank writes from a cached view: its storage (the same ``StorageImpl``, which the
  cached view keeps alive, so no other tensor can own those addresses), storage offset, shape,
  strides, dtype, ``requires_grad`` and pinning, plus the conjugate and negative bits of complex
  tensors; the same storage at the same offset, shape and strides means the cached view reads
  exactly the tensor's bytes;
- any other tensor (written by another rank after deduplication, or copied anew every save because
  it is not contiguous): shape, strides, dtype, device, ``requires_grad``, pinning.

Non-tensor leaves are pickled afresh every save (``torch.save``, as DCP's planner does); when their
lengths change the layout is planned again. Only plain tensors and DCP's ``DefaultSavePlanner``
(methods not overridden) qualify; anything else (DTensors, sharded tensors, a planner with its own
``resolve_data``) keeps the plan-reuse path. A caller that translates its own sharded state into DCP's
objects every save (Megatron's ``ShardedTensor``s) offers a :class:`FlatState` instead: its leaves already
flattened, named by their write items' DCP index, with a key of the rest of its structure, so that a
repeated save needs neither the translation nor DCP (the state dict is built only on a miss). The cache
holds views of the last save's tensors, as that save's handle does, until a save of another structure
replaces it. Pure: no I/O, no collectives.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from cpuckpt.format.layout import FileLayout, LayoutItem, Placement
from cpuckpt.format.plancache import CachedPlan
from cpuckpt.transfer.fillplan import bind_programs, build_offload_programs, build_programs
from cpuckpt.transfer.staging import flat_bytes

__all__ = ["CachedItems", "FlatState", "ItemsHit", "SaveLayout", "WrittenItems", "walk_state"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, type(None), tuple})
_KEY_TYPES = frozenset({str, int, bool})  # equal keys of equal types have equal DCP names (str(key))
_PLANNER_METHODS = ("set_up_planner", "resolve_data", "lookup_object", "transform_object")


@dataclass(frozen=True)
class FlatState:
    """A state dict its caller has flattened, offered for a save that may repeat the previous one.

    ``leaves[i]`` is the value the planner resolves for the write item with DCP index ``names[i]`` (fully
    qualified name, chunk offsets; offsets None for a value written as bytes), before the planner's
    ``transform_object``: one leaf per write item. ``key`` is everything else of the structure that the
    leaves do not show (global shapes, offsets, the planner's view of it): the caller vouches that equal keys
    mean equal plans. ``build()`` returns the state dict itself, for DCP to plan when the cache does not fit.
    """

    key: Hashable
    names: Sequence[tuple[str, tuple[int, ...] | None]]
    leaves: Sequence[Any]
    build: Callable[[], dict[str, Any]]
    # The caller vouches that the tensor leaves from ``vouched_from`` on are the objects they were at the last save
    # offered with the same ``vouched`` token, with the same storage, offset, shape, strides and dtype (it checked what
    # they are views of): their per-tensor check is skipped (their address, shape, ``requires_grad`` and a CPU
    # tensor's pinning are still compared: :class:`_Vouch`). None: nothing vouched for.
    vouched: Any = None
    vouched_from: int = 0


@dataclass(frozen=True)
class SaveLayout:
    """One rank's planned files of a save: what the writer needs to stage them and report them."""

    names: list[str]
    files: list[FileLayout]
    placements: list[Placement]
    records: dict[str, list[list[int]]]  # file name -> [record offset, data offset in record] per tensor
    results: list[WriteResult]


@dataclass(frozen=True)
class WrittenItems:
    """What the writer resolved for a save's plan: per item, the resolved object, its source, its layout item."""

    plan: SavePlan
    objects: list[Any]  # planner.resolve_data(item), before any conversion
    sources: list[torch.Tensor | None]  # flat uint8 bytes of tensor items, None for byte items
    layout_items: list[LayoutItem]
    layout: SaveLayout


@dataclass(frozen=True)
class ItemsHit:
    """A save that repeats the cached one: this save's sources and non-tensor payloads."""

    sources: list[torch.Tensor | None]
    payloads: dict[int, memoryview]  # item -> its value's bytes (the planner's transform_object: torch.save)
    payload_nbytes: tuple[int, ...]


def walk_state(state: Mapping[Any, Any], leaves: list[Any], skeleton: list[Any],
               paths: list[tuple] | None = None) -> bool:
    """Collect the leaves and the container skeleton of ``state`` in DCP's traversal order.

    ``paths`` (when given) receives each leaf's DCP object path (``str`` of mapping keys, list
    indexes). Returns False when a mapping has keys of a type other than ``str``, ``int``, ``bool`` (two such
    keys may be equal yet name different paths) and ``paths`` is given.
    """
    return _walk(state, (), leaves, skeleton, paths)


def _walk(obj: Any, path: tuple, leaves: list[Any], skeleton: list[Any], paths: list[tuple] | None) -> bool:
    if isinstance(obj, list):
        skeleton.append((type(obj), len(obj)))
        entries: Any = enumerate(obj)
        is_list = True
    else:
        keys = tuple(obj)
        types = tuple(map(type, keys))
        skeleton.append((type(obj), keys, types))
        if paths is not None and not _KEY_TYPES.issuperset(types):
            return False
        entries = obj.items()
        is_list = False
    for k, v in entries:
        t = type(v)
        if t not in _LEAF_TYPES and (isinstance(v, Mapping) or (isinstance(v, list) and not _terminal_list(v))):
            sub = (*path, k if is_list else str(k)) if paths is not None else path
            if not _walk(v, sub, leaves, skeleton, paths):
                return False
            continue
        skeleton.append(t)
        leaves.append(v)
        if paths is not None:
            paths.append((*path, k if is_list else str(k)))
    return True


def _terminal_list(values: list) -> bool:
    """DCP writes a list as one pickled value unless it holds a tensor, a mapping or such a list."""
    for v in values:
        if isinstance(v, torch.Tensor | Mapping):
            return False
        if isinstance(v, list) and not _terminal_list(v):
            return False
    return True


def _payload(obj: Any) -> memoryview:
    """The bytes of a planner's ``transform_object`` result (a ``BytesIO``, or bytes)."""
    return obj.getbuffer() if isinstance(obj, io.BytesIO) else memoryview(obj)


def _transform_of(planner: Any) -> Callable[[Any, Any], Any]:
    """``planner.transform_object``, without the state dict the planner was set up on (the cache must not keep it,
    nor any copy a translation made for it, alive)."""
    detached = copy.copy(planner)
    if hasattr(detached, "state_dict"):
        detached.state_dict = None
    return detached.transform_object


def _flat_skeleton(flat: FlatState, leaves: list[Any]) -> list[Any]:
    """What a cached flat save must repeat besides its tensors: the caller's key, the leaves' count and classes."""
    return [("flat", flat.key, len(leaves), tuple(map(type, leaves)))]


def default_planner_like(planner: Any) -> bool:
    """The planner resolves items exactly as DCP's ``DefaultSavePlanner`` does."""
    cls = type(planner)
    return isinstance(planner, DefaultSavePlanner) and all(
        getattr(cls, m) is getattr(DefaultSavePlanner, m) for m in _PLANNER_METHODS)


class _Vouch:
    """The vouched tensors of the last save whose tensors were all checked (:attr:`FlatState.vouched`): a later save
    with the same token and the same tensor objects at the same places repeats their check."""

    def __init__(self, token: Any, start: int, tensors: list[torch.Tensor]) -> None:
        self.token = token
        self.start = start
        self.tensors = tensors
        self.places = self._places(tensors)
        self.cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
        self.pinned = [tensors[i].is_pinned() for i in self.cpu]

    @staticmethod
    def _places(tensors: list[torch.Tensor]) -> tuple[list[int], list[Any], list[bool]]:
        """What may change in place between the caller's check and this one (a deferred start comes after the
        optimizer step): the address (``set_``, ``.data =``, a resize), the shape, ``requires_grad``."""
        return [t.data_ptr() for t in tensors], [t.shape for t in tensors], [t.requires_grad for t in tensors]

    def holds(self, flat: FlatState, leaves: list[Any]) -> bool:
        tail = leaves[self.start:]
        tensors = self.tensors
        return (flat.vouched is self.token and flat.vouched_from == self.start and len(tail) == len(tensors)
                and all(map(operator.is_, tail, tensors)) and self._places(tail) == self.places
                and [tail[i].is_pinned() for i in self.cpu] == self.pinned)


class CachedItems:
    """The resolved items, layout and fills of one rank's save; build with :meth:`build`."""

    def __init__(self, who: Hashable, cached: CachedPlan, skeleton: list[Any], written: WrittenItems,
                 static: list[tuple[int, int]], dynamic: list[tuple[int, int]], byte_items: list[tuple[int, int]],
                 other_tensors: list[int], complex_items: list[int], transform: Callable[[Any, Any], Any]) -> None:
        self.who = who
        self.cached = cached
        self.skeleton = skeleton
        self.plan = written.plan
        self._static_pos = [p for _, p in static]
        self._dynamic = dynamic  # (item, position): copied afresh every save (not contiguous)
        self._byte_items = byte_items  # (item, position): pickled every save
        self._light_pos = [p for _, p in dynamic] + other_tensors
        self._complex_pos = complex_items
        self._transform = transform  # the planner's transform_object: a non-tensor value's bytes (_transform_of)
        self._sources: list[torch.Tensor | None] = [None] * len(written.plan.items)
        for item, _ in static:
            self._sources[item] = written.sources[item]
        byte_set = {item for item, _ in byte_items}
        self._tensor_layout_items = [None if i in byte_set else li for i, li in enumerate(written.layout_items)]
        self.hits = 0
        self._static_keys: list[tuple] = []
        self._light_keys: list[tuple] = []
        self._complex_keys: list[tuple] = []
        self._layout: SaveLayout | None = None
        self._payload_nbytes: tuple[int, ...] = ()
        self._where: list[tuple[int, int, int]] = []
        self._vouch: _Vouch | None = None  # the last checked save's vouched tensors (FlatState.vouched)

    @classmethod
    def build(cls, who: Hashable, cached: CachedPlan, state: Mapping[str, Any], planner: Any,
              written: WrittenItems) -> CachedItems | None:
        """The cache of a save just started from ``state`` with ``planner`` (set up), or None if it does not qualify.

        Args:
            who: the planner's identity and settings (``async_save``'s plan key).
            cached: the save's plan, as kept for plan reuse.
            state: the state dict saved (Stateful objects resolved).
            planner: the planner DCP (or the plan-reuse path) set up on ``state``.
            written: what the writer resolved and planned for it.
        """
        if isinstance(state, FlatState):
            return cls._build_flat(who, cached, state, planner, written)
        if not default_planner_like(planner):
            return None
        leaves: list[Any] = []
        skeleton: list[Any] = []
        paths: list[tuple] = []
        if not walk_state(state, leaves, skeleton, paths):
            return None
        where = {p: i for i, p in enumerate(paths)}
        if len(where) != len(paths):
            return None  # two leaves with one DCP path: DCP itself refuses such a state dict
        mappings = getattr(planner, "mappings", None) if getattr(planner, "flatten_state_dict", False) else None
        static: list[tuple[int, int]] = []
        dynamic: list[tuple[int, int]] = []
        byte_items: list[tuple[int, int]] = []
        written_pos: set[int] = set()
        for i, wi in enumerate(written.plan.items):
            path = mappings.get(wi.index.fqn) if mappings is not None else (wi.index.fqn,)
            pos = where.get(tuple(path)) if path is not None else None
            if pos is None:
                return None
            leaf = leaves[pos]
            if wi.type == WriteItemType.BYTE_IO:
                if isinstance(leaf, torch.Tensor) or wi.index.offset is not None:
                    return None
                byte_items.append((i, pos))
                continue
            if wi.type != WriteItemType.TENSOR or type(leaf) not in _PLAIN or written.objects[i] is not leaf:
                return None
            src = written.sources[i]
            if src is None:
                return None
            aliased = (leaf.is_contiguous() and not leaf.is_conj() and not leaf.is_neg()
                       and (src.numel() == 0 or src.untyped_storage()._cdata == leaf.untyped_storage()._cdata))
            (static if aliased else dynamic).append((i, pos))
            written_pos.add(pos)
        other_tensors = []
        for pos, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if type(leaf) not in _PLAIN:
                    return None  # DTensor and other subclasses: the plan-reuse path
                if pos not in written_pos:
                    other_tensors.append(pos)
        complex_items = [p for _, p in static if leaves[p].is_complex()]
        items = cls(who, cached, skeleton, written, static, dynamic, byte_items, other_tensors, complex_items,
                    _transform_of(planner))
        items._static_keys, items._light_keys, items._complex_keys = items._keys(leaves)
        items.adopt(written.layout, written.sources)
        return items

    @classmethod
    def _build_flat(cls, who: Hashable, cached: CachedPlan, flat: FlatState, planner: Any,
                    written: WrittenItems) -> CachedItems | None:
        """As :meth:`build` for a :class:`FlatState`: each write item found by its DCP index among ``flat.names``;
        a tensor item's source must be exactly its leaf's bytes (same storage, address and size) to be kept."""
        leaves = list(flat.leaves)
        where = {name: i for i, name in enumerate(flat.names)}
        if len(where) != len(leaves) or len(flat.names) != len(leaves):
            return None
        static: list[tuple[int, int]] = []
        dynamic: list[tuple[int, int]] = []
        byte_items: list[tuple[int, int]] = []
        written_pos: set[int] = set()
        for i, wi in enumerate(written.plan.items):
            offsets = None if wi.index.offset is None else tuple(wi.index.offset)
            pos = where.get((wi.index.fqn, offsets))
            if pos is None or pos in written_pos:
                return None
            written_pos.add(pos)
            leaf = leaves[pos]
            if wi.type == WriteItemType.BYTE_IO:
                if isinstance(leaf, torch.Tensor):
                    return None
                byte_items.append((i, pos))
                continue
            src = written.sources[i]
            if type(leaf) not in _PLAIN or src is None or leaf.is_complex():
                return None
            aliased = (leaf.is_contiguous() and src.numel() == leaf.nbytes
                       and (src.numel() == 0 or (src.untyped_storage()._cdata == leaf.untyped_storage()._cdata
                                                 and src.data_ptr() == leaf.data_ptr())))
            (static if aliased else dynamic).append((i, pos))
        other_tensors = []
        for pos, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and pos not in written_pos:
                if type(leaf) not in _PLAIN:
                    return None
                other_tensors.append(pos)
        items = cls(who, cached, _flat_skeleton(flat, leaves), written, static, dynamic, byte_items, other_tensors,
                    [], _transform_of(planner))
        items._static_keys, items._light_keys, items._complex_keys = items._keys(leaves)
        items._vouch = items._vouch_of(flat, leaves)
        items.adopt(written.layout, written.sources)
        return items

    def _vouch_of(self, flat: FlatState, leaves: list[Any]) -> _Vouch | None:
        """What a later save of ``flat``'s vouch may skip the per-tensor check by: only where every tensor checked is
        among the vouched leaves (checked just now, with ``leaves``)."""
        start = flat.vouched_from
        if flat.vouched is None or any(p < start for p in (*self._static_pos, *self._light_pos, *self._complex_pos)):
            return None
        tail = leaves[start:]
        if not all(isinstance(t, torch.Tensor) for t in tail):
            return None
        return _Vouch(flat.vouched, start, tail)

    def _keys(self, leaves: list[Any]) -> tuple[list[tuple], list[tuple], list[tuple]]:
        """What is checked of the tensors: written from a cached view; otherwise; complex ones' lazy bits.

        One comprehension each, no call per tensor: this is most of a cached save's call path. A written-from-view
        tensor is checked by its storage and offset, not its address: a storage resized in place keeps its identity
        but moves, and another tensor may then take its old address (the cached view reads the storage's new place).
        """
        get = leaves.__getitem__
        static = [(t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t.requires_grad,
                   t.is_pinned(), t.is_neg()) for t in map(get, self._static_pos)]
        light = [(t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_pinned())
                 for t in map(get, self._light_pos)]
        lazy = [(t.is_conj(), t.is_neg()) for t in map(get, self._complex_pos)]
        return static, light, lazy

    def match(self, state: Mapping[str, Any], who: Hashable) -> ItemsHit | None:
        """This save's sources and payloads if ``state`` repeats the cached save, else None."""
        if who != self.who:
            return None
        leaves: list[Any] = []
        skeleton: list[Any] = []
        vouched = False
        if isinstance(state, FlatState):
            leaves = list(state.leaves)
            if _flat_skeleton(state, leaves) != self.skeleton:
                return None
            vouched = self._vouch is not None and self._vouch.holds(state, leaves)
        else:
            walk_state(state, leaves, skeleton)
            if skeleton != self.skeleton:
                return None
        try:
            if not vouched:
                if self._keys(leaves) != (self._static_keys, self._light_keys, self._complex_keys):
                    return None
                if isinstance(state, FlatState):
                    self._vouch = self._vouch_of(state, leaves)
        except (RuntimeError, AttributeError):  # a tensor without storage, a flat leaf not a tensor: DCP's path
            return None
        sources = list(self._sources)
        try:
            for item, pos in self._dynamic:
                sources[item] = flat_bytes(leaves[pos])
            items = self.plan.items
            payloads = {item: _payload(self._transform(items[item], leaves[pos])) for item, pos in self._byte_items}
        except Exception:  # e.g. a value that no longer pickles: the planner's path reports it (raising here,
            return None  # before the ranks agree, would leave the other ranks waiting in the collective)
        self.hits += 1
        return ItemsHit(sources, payloads, tuple(len(payloads[item]) for item, _ in self._byte_items))

    def layout_for(self, hit: ItemsHit) -> SaveLayout | None:
        """The cached layout with ``hit``'s payloads bound, or None if their lengths changed."""
        layout = self._layout
        if layout is None or hit.payload_nbytes != self._payload_nbytes:
            return None
        return self._bind(layout, hit)

    def layout_items(self, hit: ItemsHit) -> list[LayoutItem]:
        """The items to plan a new layout for ``hit`` (its payloads changed length)."""
        items = list(self._tensor_layout_items)
        for item, payload in hit.payloads.items():
            items[item] = LayoutItem(data_nbytes=len(payload), payload=payload)
        return items  # type: ignore[return-value]

    def adopt(self, layout: SaveLayout, sources: Sequence[torch.Tensor | None]) -> None:
        """Keep ``layout`` (planned for ``sources``) for later saves, with its fills prepared."""
        byte_items = {item for item, _ in self._byte_items}
        files = [dataclasses.replace(f, segments=[dataclasses.replace(s, payload=b"") if s.item in byte_items else s
                                                  for s in f.segments], fill_programs=None, offload_program=None)
                 for f in layout.files]
        self._where = [(s.item, f.index, k) for f in files for k, s in enumerate(f.segments) if s.item in byte_items]
        build_programs(files, sources, dynamic={item for item, _ in self._dynamic}, payload_items=byte_items)
        if any(s is not None and s.is_cuda for s in sources):  # a device snapshot's copies may go to another process
            build_offload_programs(files, sources, payload_items=byte_items)
        self._layout = dataclasses.replace(layout, files=files)
        self._payload_nbytes = tuple(self._payload_len(layout, item) for item, _ in self._byte_items)

    def adopt_for(self, layout: SaveLayout, hit: ItemsHit) -> SaveLayout:
        """Keep ``layout`` (planned for ``hit``) for later saves; returns it bound to ``hit``."""
        self.adopt(layout, hit.sources)
        return self._bind(self._layout, hit)  # type: ignore[arg-type]

    @staticmethod
    def _payload_len(layout: SaveLayout, item: int) -> int:
        return layout.placements[item].data_nbytes

    def _bind(self, layout: SaveLayout, hit: ItemsHit) -> SaveLayout:
        files = list(layout.files)
        if self._where:
            segments = {f: list(files[f].segments) for _, f, _ in self._where}
            for item, f, k in self._where:
                segments[f][k] = dataclasses.replace(segments[f][k], payload=hit.payloads[item])
            for f, segs in segments.items():
                files[f] = dataclasses.replace(files[f], segments=segs)
        payloads = {item: torch.frombuffer(p, dtype=torch.uint8) if len(p) else torch.empty(0, dtype=torch.uint8)
                    for item, p in hit.payloads.items()}
        return dataclasses.replace(layout, files=bind_programs(files, hit.sources, payloads))
