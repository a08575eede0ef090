"""Megatron's sharded state dict offered to cpuckpt flat, so that a save repeating the last one skips the translation.

Every save, megatron-core's ``mcore_to_pyt_state_dict`` turns each ``ShardedTensor`` into one of PyTorch's
sharded tensors (a ``ShardedTensor`` with its shard metadata, or a ``CheckpointableShardedTensor``) and each
group of ``ShardedObject``s into pickled bytes; then DCP resolves every write item of them again. With ~1,200
tensors that is tens of milliseconds on the trainer's thread per save, for a structure that does not change
between saves. :func:`flat_state` instead lists the write items' values directly, named by their DCP index
(key, global offset), with a key of the structure (global shapes, offsets, dtypes, axis layout), as a
:class:`cpuckpt.backend.itemcache.FlatState`. cpuckpt's item cache checks the leaves against the previous save
(one comparison per tensor) and reuses its layout; only when that does not fit is the translation built
(``FlatState.build``), so the files are always those megatron-core's translation plans: a stock torch_dist
checkpoint.
"""

from __future__ import annotations

import io
import operator
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.torch import (
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from cpuckpt.backend.itemcache import FlatState

__all__ = ["ATOMIC", "CapturedTensors", "RepeatedTensors", "flat_state", "grouped", "leaves", "to_pyt"]

# Plain immutable values: what a save may keep by reference (the strategy's copies of host objects and the replay's
# copies of the captured ones leave the same values alone)
ATOMIC = (type(None), bool, int, float, complex, str, bytes)


def leaves(tree: Any, out: list[Any] | None = None) -> list[Any]:
    """The values of nested dicts and lists, in order (megatron-core's ``nested_values`` without a generator per
    level: the strategy and :mod:`.replay` walk ~1,200 values several times per save on the trainer's thread)."""
    out = [] if out is None else out
    for v in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(v, dict | list):
            leaves(v, out)
        else:
            out.append(v)
    return out


def to_pyt(sharded_state_dict: dict[str, Any], keep_only_main_replica: bool) -> dict[str, Any]:
    """megatron-core's own translation of a sharded state dict into PyTorch's (what DCP plans)."""
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica)
    return mcore_to_pyt_state_dict(sharded, False)


# Values pickled once per stream (their bytes reused): immutable, compared by type and value. Every module without
# Transformer Engine has an ``_extra_state`` of None, one ShardedObject each: 96 in a 24-layer GPT, 3-6 ms of
# torch.save per save for the same bytes.
_PLAIN = (type(None), bool, int, str, bytes)  # not float: -0.0 == 0.0, and NaN equals nothing
_PACKED_MAX = 1024  # distinct plain groups kept per stream (cleared when full: a value that changes every save)
_PACKED_MAX_BYTES = 4096  # larger values are pickled every save (a key would hold them twice)


def _pack(values: list[Any], packed: dict[tuple, bytes] | None) -> io.BytesIO:
    """``values`` as megatron-core's translation packs a key's objects (``torch.save`` of the list); with ``packed``
    (a stream's cache), a list of plain values is pickled once and its bytes reused."""
    if packed is None or not all(type(v) in _PLAIN and (not isinstance(v, str | bytes) or len(v) <= _PACKED_MAX_BYTES)
                                 for v in values):
        buf = io.BytesIO()
        torch.save(values, buf)
        return buf
    key = tuple((type(v), v) for v in values)  # the type too: 1 and True are equal
    raw = packed.get(key)
    if raw is None:
        buf = io.BytesIO()
        torch.save(values, buf)
        raw = buf.getvalue()
        if len(packed) >= _PACKED_MAX:
            packed.clear()
        packed[key] = raw
    return io.BytesIO(raw)


class CapturedTensors(list):
    """A replayed save's tensors (:mod:`.replay` puts them last in the state dict, under its marker key), with the
    capture they come from: while that capture lasts they are the same ``ShardedTensor`` objects, each a view of a
    model's or optimizer's tensor whose identity, address, shape, strides and dtype the replay checked at this save's
    build (:func:`.replay.take`)."""

    __slots__ = ("capture",)

    def __init__(self, tensors: list[Any], capture: Any) -> None:
        super().__init__(tensors)
        self.capture = capture


class RepeatedTensors:
    """A strategy's flattening of the last :class:`CapturedTensors` it saw, reused while the next save's are the same
    objects with the same data and replica ids (one identity check per tensor instead of a name, key and grouping per
    tensor: ~2 ms of ~1,200 tensors' Python on the trainer's thread per save on the 2-core box)."""

    def __init__(self) -> None:
        self._seen: tuple[Any, bool, list[Any], list[Any], list[Any]] | None = None  # capture, keep, tensors, ...
        self._flat: tuple[list[tuple[str, tuple[int, ...] | None]], list[Any], list[tuple], set[str]] | None = None

    def forget(self) -> None:
        self._seen = self._flat = None

    def flatten(self, tensors: CapturedTensors, keep_only_main_replica: bool
                ) -> tuple[list[tuple[str, tuple[int, ...] | None]], list[Any], list[tuple], set[str]] | None:
        """(names, leaves, key entries, fqns) of ``tensors`` as :func:`flat_state` lists them; None where that
        cannot be (a tensor without data, an older flattened range: the translation's own layout)."""
        datas = [sh.data for sh in tensors]
        rids = [sh.replica_id for sh in tensors]
        seen = self._seen
        if (seen is not None and self._flat is not None and seen[0] is tensors.capture
                and seen[1] == keep_only_main_replica and len(seen[2]) == len(tensors)
                and all(map(operator.is_, seen[2], tensors)) and all(map(operator.is_, seen[3], datas))
                and seen[4] == rids):
            return self._flat
        self._seen = self._flat = None
        flat = _flatten_tensors(grouped({"tensors": tensors}, keep_only_main_replica))
        if flat is not None:
            self._seen = (tensors.capture, keep_only_main_replica, list(tensors), datas, rids)
            self._flat = flat
        return flat


def _flatten_tensors(sharded: dict[str, list[Any]]
                     ) -> tuple[list[tuple[str, tuple[int, ...] | None]], list[Any], list[tuple], set[str]] | None:
    """The names, leaves and key entries of groups of ``ShardedTensor``s (None: one :func:`flat_state` cannot list)."""
    names: list[tuple[str, tuple[int, ...] | None]] = []
    out: list[Any] = []
    key: list[tuple] = []
    if not all(_add_tensors(fqn, group, names, out, key) for fqn, group in sharded.items()):
        return None
    return names, out, key, set(sharded)


def _add_tensors(fqn: str, group: list[Any], names: list[tuple[str, tuple[int, ...] | None]], out: list[Any],
                 key: list[tuple]) -> bool:
    """Append the name, leaf and key entry of every ``ShardedTensor`` of ``fqn``'s group; False (stopping) at one
    :func:`flat_state` cannot list: without data, or megatron-core's older flattened range (its layout is the
    translation's own)."""
    for sh in group:
        if not isinstance(sh, ShardedTensor) or sh.data is None or sh.flattened_range is not None:
            return False
        names.append((fqn, tuple(sh.global_offset)))
        out.append(sh.data)
        key.append((fqn, sh.global_shape, sh.global_offset, sh.local_shape, sh.dtype, sh.prepend_axis_num,
                    sh.axis_fragmentations, sh.allow_shape_mismatch))
    return True


class _Unusual(Exception):
    """A value :func:`grouped` does not know: megatron-core's own grouping decides (and raises as it does)."""


def grouped(sharded_state_dict: dict[str, Any], keep_only_main_replica: bool) -> dict[str, list[Any]]:
    """megatron-core's grouping of a sharded state dict by key (``_replace_state_dict_keys_with_sharded_keys``'s
    first result: every ``ShardedTensor`` under its key, every ``ShardedObject`` under its unique key, in the
    traversal's order, main replicas only if asked), without the flattened names it builds for the way back: one
    walk over dicts and lists, no path per leaf (megatron-core's took 6 of the ~26 ms of a repeated save's start and
    finalize on the 2-core box, 1,152 tensors). Anything else in the dict (another leaf type, an empty list, a tuple)
    is left to megatron-core's function. Unlike it, two paths that flatten to one name (``{"a.b": x, "a": {"b": y}}``)
    are not refused here: :func:`flat_state`'s build, which the first save of every structure runs, groups through
    megatron-core and refuses them."""
    groups: dict[str, list[Any]] = {}

    def visit(value: Any) -> None:
        kind = type(value)
        if kind is ShardedTensor or kind is ShardedObject:
            if keep_only_main_replica:
                rid = value.replica_id
                if not (rid == 0 if type(rid) is int else is_main_replica(rid)):
                    return
            key = value.key if kind is ShardedTensor else value.unique_key
            group = groups.get(key)
            if group is None:
                groups[key] = [value]
            else:
                group.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif (kind is list or kind is CapturedTensors) and value:
            for v in value:
                visit(v)
        else:
            raise _Unusual

    try:
        for v in sharded_state_dict.values():
            visit(v)
    except _Unusual:
        return _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica)[0]
    return groups


def flat_state(sharded_state_dict: dict[str, Any], keep_only_main_replica: bool,
               packed: dict[tuple, bytes] | None = None,
               repeated: RepeatedTensors | None = None) -> FlatState | dict[str, Any]:
    """The save's values as a :class:`FlatState`, or the translated state dict where that cannot be (a tensor
    without data, or megatron-core's older flattened-range tensors: their layout is the translation's own).
    ``packed``: the stream's cache of pickled plain objects (:func:`_pack`). ``repeated``: the stream's flattening
    of a replay's tensors (the state dict's last value, a :class:`CapturedTensors`), reused save after save; the
    FlatState then vouches for them (``vouched``: the replay checked them at this save's build)."""
    if repeated is not None:
        last = next(reversed(sharded_state_dict), None)
        tail = sharded_state_dict[last] if last is not None else None
        if type(tail) is CapturedTensors:
            fast = _flat_with_captured(sharded_state_dict, last, tail, keep_only_main_replica, packed, repeated)
            if fast is not None:
                return fast
        repeated.forget()  # a full build, or reuse went off: hold none of the model's or optimizer's tensors
    return _flat(sharded_state_dict, keep_only_main_replica, packed)


def _flat_with_captured(sharded_state_dict: dict[str, Any], last: str, tail: CapturedTensors,
                        keep_only_main_replica: bool, packed: dict[tuple, bytes] | None,
                        repeated: RepeatedTensors) -> FlatState | None:
    """:func:`flat_state` of a replayed save: the values before its captured tensors flattened as ever, the tensors'
    part from ``repeated``; None where the two parts cannot simply follow each other (a key in both)."""
    head = _flat({k: v for k, v in sharded_state_dict.items() if k != last}, keep_only_main_replica, packed,
                 build_from=sharded_state_dict)
    flat = repeated.flatten(tail, keep_only_main_replica)
    if not isinstance(head, FlatState) or flat is None:
        return None
    names, leaves, key, fqns = flat
    if fqns & {name for name, _ in head.names}:
        return None
    return FlatState(key=("megatron", head.key[1] + tuple(key)), names=[*head.names, *names],
                     leaves=[*head.leaves, *leaves], build=head.build, vouched=tail.capture,
                     vouched_from=len(head.names))


def _flat(sharded_state_dict: dict[str, Any], keep_only_main_replica: bool, packed: dict[tuple, bytes] | None,
          build_from: dict[str, Any] | None = None) -> FlatState | dict[str, Any]:
    """:func:`flat_state` of every value; ``build_from``: the whole state dict its ``build()`` translates (the
    values flattened here are a part of it)."""
    sharded = grouped(sharded_state_dict, keep_only_main_replica)
    whole = sharded_state_dict if build_from is None else build_from
    names: list[tuple[str, tuple[int, ...] | None]] = []
    leaves: list[Any] = []
    key: list[tuple] = []
    objects: dict[str, io.BytesIO] = {}
    for fqn, group in sharded.items():
        if isinstance(group[0], ShardedTensor):
            if not _add_tensors(fqn, group, names, leaves, key):
                return to_pyt(sharded_state_dict, keep_only_main_replica)
        else:
            if not all(isinstance(sh, ShardedObject) for sh in group):
                return to_pyt(sharded_state_dict, keep_only_main_replica)
            buf = _pack([sh.data for sh in group], packed)
            objects[fqn] = buf
            names.append((fqn, None))
            leaves.append(buf)
            key.append((fqn, len(group)))

    def build() -> dict[str, Any]:  # megatron-core's translation, in its order, with the objects packed above
        # Built only when the item cache has no layout for this structure (its first save, or a change): megatron-core
        # groups it itself then, with its own checks (a flattened path twice is its ValueError), which grouped() skips.
        checked, _, _ = _replace_state_dict_keys_with_sharded_keys(whole, keep_only_main_replica)
        tensors = mcore_to_pyt_state_dict({fqn: group for fqn, group in checked.items() if fqn not in objects}, False)
        return {fqn: objects[fqn] if fqn in objects else tensors[fqn] for fqn in checked}

    return FlatState(key=("megatron", tuple(key)), names=names, leaves=leaves, build=build)
