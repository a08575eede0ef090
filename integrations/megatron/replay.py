"""Repeated saves of a constant structure without Megatron's per-save state-dict build (``megatron.reuse_state_dict``).

Every save, Megatron-LM's ``generate_state_dict`` builds the model's and the optimizer's sharded state dicts (a
``ShardedTensor`` per parameter and per optimizer state: ~1,200 objects for a 24-layer GPT), and megatron-core's
``save_preprocess`` walks them again: ~36 ms of the trainer's thread per save on the 2-core box, paid in full at every
save because the device is idle then. Under ``--ckpt-assume-constant-structure`` those objects are the same save after
save: views of the same parameters and optimizer states at the same places. :class:`StateDictReuse` keeps them:

- A **full build** (Megatron-LM's own) happens at the first save, after any change of structure, and every
  ``verify_every`` saves. It is captured: the model's and optimizer's parts without their tensors (the *skeleton*:
  ``ShardedObject``s, plain values, containers), and, once megatron-core has preprocessed it, the ``ShardedTensor``s
  under those parts as the strategy receives them (:func:`take`).
- A **replayed** save builds only what changes: Megatron-LM's small parts (``generate_state_dict`` called with no
  model and no optimizer: iteration, RNG, scheduler, rerun state, args), the optimizer's plain values and objects
  refreshed by path from its ``state_dict()`` (learning rates, steps, loss scale), the model's objects as captured;
  the captured tensors stand behind one marker (:class:`ReplayedTensors`) that the strategy expands. The values are
  those of a full build (the same stock torch_dist checkpoint); a captured build is laid out as a replay (its
  tensors after its other leaves), so both share one plan.

The structure check, every save (one walk of the modules, a tuple per tensor; the whole replay took ~5 ms per save
on an H100's host, against ~13 ms of Megatron-LM's save timer it saved there): the identity, address, shape, stride
and dtype of every parameter, buffer, optimizer parameter and optimizer state tensor; the ``get_extra_state()`` of
every module that has one (Transformer Engine's FP8 metadata; ``None`` for megatron-core's local layers) equal to
what it was at the capture; the same build arguments. A change makes that save a full build (and a new capture);
eight in a row turn reuse off (it cannot help). A capture whose tensors are not views of those tensors (a state dict
that gathers or copies, as ``fully_reshardable`` does) turns it off too; a distributed optimizer's bucket padding
(``torch.empty`` per build beside ``padding: True``, its values never read) is replayed as captured. The
refresh by path and the captured tensors are checked against a full build at the second save, after each change and
every ``verify_every`` saves; a difference turns reuse off for the run, with a warning naming the value. A save never
fails because of reuse: an error in it is a build, and reuse off.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from cpuckpt.backend.collectives import checkpoint_group, peers

from .compat import replace_function
from .flatstate import ATOMIC, CapturedTensors, leaves

__all__ = ["MARKER_KEY", "ReplayedTensors", "StateDictReuse", "install", "take"]

logger = logging.getLogger(__name__)

MARKER_KEY = "__cpuckpt_replayed_tensors__"
_CHANGES_IN_A_ROW = 8  # saves whose structure changed since the last one, in a row: reuse goes off (it cannot help)
_PART = re.compile(r"optimizer|model\d*")  # generate_state_dict's keys of the model's chunks and the optimizer


class _Drop:
    """A tensor leaf of a captured part: it comes back through the marker, not the skeleton."""


_DROPPED = _Drop()


@dataclass
class _Capture:
    """One full build: its structure key, skeleton and (once the strategy saw it) tensors."""

    key: tuple
    extra: list[tuple[Any, Any]]  # (module, its get_extra_state()) at the build
    parts: tuple[str, ...]  # the top-level keys of the model's and optimizer's parts
    skeleton: dict[str, Any]
    live: set[int]  # storages of the model's and optimizer's tensors at the build
    tensor_keys: frozenset[str]  # the keys of the build's tensors (a factory's are known once it is built)
    padding: frozenset[int]  # ids of the build's padding tensors (a distributed optimizer's, made per build)
    order: tuple[str, ...]  # the build's top-level keys, in order
    tensors: list[tuple[ShardedTensor, Any]] | None = None  # (leaf, its data as captured)
    padding_at: frozenset[int] = frozenset()  # the padding tensors' places among them
    refused: str | None = None  # why its tensors cannot be replayed
    verifies: _Capture | None = None  # the capture this build checks (its tensors against the build's)

    def record(self, sharded_state_dict: dict[str, Any]) -> None:
        """Keep the preprocessed ``ShardedTensor``s under the captured parts, if they are the build's and all are
        views of the model's or optimizer's tensors; the state dict then holds them as a replay will (after its
        other leaves, under :data:`MARKER_KEY`), so that a build and a replay write the same files and the
        strategy's plan fits both. It never raises: a failure leaves the state dict as it was and the capture
        refused (reuse goes off at the next save, on every rank)."""
        verifies, self.verifies = self.verifies, None
        try:
            found = [sh for k in self.parts for sh in _tensors(sharded_state_dict.get(k))]
            tensors = [(sh, sh.data) for sh in found]
            padding_at = frozenset(i for i, sh in enumerate(found) if id(sh) in self.padding)  # by place: a replay
            self.refused = self._check(tensors, padding_at, verifies)  # may put a copy of a tensor in its place
            if self.refused is None:
                rest = {k: _compact(_skeleton(sharded_state_dict[k])) for k in self.parts if k in sharded_state_dict}
        except Exception as e:  # the save goes on as the plain build it is
            self.refused = f"capturing the build's tensors failed: {type(e).__name__}: {e}"
        if self.refused is not None:
            return
        self.tensors, self.padding_at = tensors, padding_at
        for k, v in rest.items():
            if v is _DROPPED:
                del sharded_state_dict[k]
            else:
                sharded_state_dict[k] = v
        sharded_state_dict[MARKER_KEY] = found

    def _check(self, built: list[tuple[ShardedTensor, Any]], padding_at: frozenset[int],
               verifies: _Capture | None) -> str | None:
        """Why the build's tensors the strategy received (``built``: each with its data) cannot be replayed (None:
        they can)."""
        if not self.tensor_keys <= {sh.key for sh, _ in built}:
            return "the tensors the strategy received are not those of the build"
        for i, (sh, data) in enumerate(built):
            if i in padding_at:
                continue
            if not isinstance(data, torch.Tensor) or data.untyped_storage().data_ptr() not in self.live:
                return f"{sh.key} is not a view of the model's or optimizer's tensors (the build made it: a copy)"
        if verifies is not None:
            diff = _tensor_difference(verifies.tensors or [], verifies.padding_at, built, padding_at)
            if diff is not None:
                return f"a replayed save's tensors would have differed from Megatron's build at {diff}"
        return None

    def replayed(self) -> list[ShardedTensor]:
        """The captured tensors for one more save. Where a save replaced a tensor's data (the strategy's eager clone
        of one that changes before the optimizer step), the capture takes a copy of the tensor with its own data
        back: the replaced one stays with that save, which may not have started yet (a deferred start)."""
        out = []
        tensors = self.tensors or []
        for i, (sh, data) in enumerate(tensors):
            if sh.data is not data:
                sh = copy.copy(sh)
                sh.data = data
                tensors[i] = (sh, data)
            out.append(sh)
        return out


@dataclass
class ReplayedTensors(ShardedBase):
    """Stands, in a replayed state dict, for the model's and optimizer's tensors of a capture. megatron-core's
    preprocessing passes it through as one sharded leaf; the first cpuckpt strategy to see the state dict puts the
    tensors in its place (:func:`take`). A replayed save is never validated by megatron-core (a replay needs
    Megatron-LM's checkpointing context holding its save strategy: then it validates no save under
    ``--ckpt-assume-constant-structure``; :func:`install`)."""

    key: str
    data: Any  # the _Capture
    replica_id: Any = 0

    def validate_metadata_integrity(self) -> None:
        """Nothing to check: it is never written."""

    def without_data(self) -> ReplayedTensors:
        return replace(self, data=None)


def take(sharded_state_dict: dict[str, Any], reuse: StateDictReuse | None = None) -> None:
    """What a cpuckpt strategy does first with a state dict: a replayed save gets its tensors back (a list under
    :data:`MARKER_KEY`); with ``reuse`` (the strategy that writes), the tensors of a full build that ``reuse`` waits
    for are captured."""
    marker = sharded_state_dict.get(MARKER_KEY)
    if isinstance(marker, ReplayedTensors):
        del sharded_state_dict[MARKER_KEY]  # last, as a build's (after the common state megatron-core added)
        # with the capture: the strategy flattens them once per capture, and the item cache skips their check
        sharded_state_dict[MARKER_KEY] = CapturedTensors(marker.data.replayed(), marker.data)
    elif reuse is not None and reuse.pending is not None:
        capture, reuse.pending = reuse.pending, None
        capture.record(sharded_state_dict)


def _tensor_signature(sh: ShardedTensor, data: torch.Tensor, padding: bool) -> tuple:
    """What a save of ``sh`` writes from where: its place in the checkpoint and the memory its data is read from (not
    for padding, new memory at every build)."""
    return (sh.key, sh.global_shape, sh.global_offset, sh.local_shape, sh.axis_fragmentations, sh.replica_id,
            sh.prepend_axis_num, getattr(sh, "flattened_range", None), getattr(sh, "allow_shape_mismatch", None),
            sh.dtype, None if padding else data.data_ptr(), data.shape, data.stride(), data.dtype)


def _tensor_difference(replayed: list[tuple[ShardedTensor, Any]], replayed_padding: frozenset[int],
                       built: list[tuple[ShardedTensor, Any]], built_padding: frozenset[int]) -> str | None:
    """The key of the first tensor a replay would have written otherwise than the build does (None: the same);
    ``*_padding``: the places of padding tensors."""
    if len(replayed) != len(built):
        return f"the number of tensors ({len(replayed)} against {len(built)})"
    for i, ((a, da), (b, db)) in enumerate(zip(replayed, built, strict=True)):
        if _tensor_signature(a, da, i in replayed_padding) != _tensor_signature(b, db, i in built_padding):
            return b.key
    return None


def _padding(tree: Any) -> frozenset[int]:
    """The ids of the padding tensors in a build (a distributed optimizer's ``dp_reshardable`` state: a dict of
    ``torch.empty`` tensors beside ``padding: LocalNonpersistentObject(True)``)."""
    found: set[int] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            flag = node.get("padding")
            if isinstance(flag, LocalNonpersistentObject) and flag.obj is True:
                found.update(id(v) for v in node.values() if isinstance(v, ShardedTensor))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(found)


def _tensors(tree: Any) -> list[ShardedTensor]:
    """The ``ShardedTensor``s of a part of a state dict (nested dicts and lists), in order."""
    if isinstance(tree, ShardedTensor):
        return [tree]
    return [v for v in leaves(tree) if isinstance(v, ShardedTensor)] if isinstance(tree, dict | list) else []


def _skeleton(tree: Any) -> Any:
    """``tree`` without its tensor leaves; a container left empty by that goes too (as megatron-core's extraction of
    the common state drops it), one empty from the start stays. A list keeps a placeholder where a tensor was, so that
    its other values keep the index they have in the optimizer's ``state_dict()`` (:func:`_compact` drops them)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            s = _skeleton(v)
            if s is not _DROPPED:
                out[k] = s
        return out if out or not tree else _DROPPED
    if isinstance(tree, list):
        kept = [_skeleton(v) for v in tree]
        return kept if not tree or any(v is not _DROPPED for v in kept) else _DROPPED
    if isinstance(tree, ShardedTensor | ShardedTensorFactory):
        return _DROPPED
    return tree


_MISSING = object()


def _child(fresh: Any, key: Any) -> Any:
    """``fresh[key]`` of a dict or a list (:data:`_MISSING` where there is none)."""
    if isinstance(fresh, dict):
        return fresh.get(key, _MISSING)
    if isinstance(fresh, list) and isinstance(key, int) and 0 <= key < len(fresh):
        return fresh[key]
    return _MISSING


def _common_step(state_dict: Any) -> Any:
    """megatron-core's ``common_step``: the one step every parameter's state holds (``MegatronOptimizer``'s
    ``_extract_common_per_param_step``, whose error it raises too)."""
    step = first = None
    for param_state in (state_dict.get("state") or {}).values():
        s = param_state.get("step") if isinstance(param_state, dict) else None
        if s is None or s is step:
            continue
        if step is None:
            step, first = s, _value(s)
        elif first is not None and (v := _value(s)) is not None and v != first:
            raise ValueError("The optimizer step differs per parameter. Mcore only supports optimizers whose step is "
                             "shared across all parameters.")
    return step


def _value(step: Any) -> Any:
    """A step as a number to compare (a CPU tensor's item: ~10 times faster than comparing tensors, one per
    parameter); None for one on a device (reading it would wait for the device: not compared)."""
    if isinstance(step, torch.Tensor):
        return step.item() if step.device.type == "cpu" and step.numel() == 1 else None
    return step


def _refresh(tree: Any, fresh: Any, common: Any = _MISSING) -> Any:
    """A copy of an optimizer skeleton with its values from ``fresh`` (the optimizer's ``state_dict()``, walked beside
    it): plain values taken, ``ShardedObject``s given the fresh data (copies: the strategy may replace it), a
    ``state``'s ``common_step`` recomputed from the fresh per-parameter states (``common``, found by the dict holding
    that ``state``); what ``fresh`` lacks (constants of the sharded form) and non-persistent objects stay as
    captured."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if k == "common_step" and common is not _MISSING and not isinstance(
                    v, dict | list | ShardedBase | LocalNonpersistentObject):
                out[k] = common
                continue
            step = _MISSING
            if k == "state" and isinstance(v, dict) and "common_step" in v and isinstance(fresh, dict):
                step = _common_step(fresh)
            out[k] = _refresh(v, _child(fresh, k), step)
        return out
    if isinstance(tree, list):
        return [_refresh(v, _child(fresh, i)) for i, v in enumerate(tree) if v is not _DROPPED]
    if isinstance(tree, LocalNonpersistentObject):
        return tree
    if isinstance(tree, ShardedObject):
        return replace(tree, data=fresh) if fresh is not _MISSING else copy.copy(tree)
    if isinstance(tree, ShardedBase):
        return copy.copy(tree)
    return tree if fresh is _MISSING else fresh


def _copy_objects(tree: Any) -> Any:
    """A model skeleton for one save: containers and ``ShardedObject``s of non-plain data copied, list placeholders
    dropped, the rest shared."""
    if isinstance(tree, dict):
        return {k: _copy_objects(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_objects(v) for v in tree if v is not _DROPPED]
    if isinstance(tree, ShardedObject) and type(tree.data) not in ATOMIC:
        return copy.copy(tree)  # the strategy may replace its data (a deferred save's private copy); not a plain one's
    return tree


_compact = _copy_objects  # a skeleton as a build's state dict holds it: without the placeholders


def _same(a: Any, b: Any) -> bool:
    """Equal values for a save: identical, equal plain values, equal CPU tensors; anything else is not known equal."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.device.type == "cpu" and b.device.type == "cpu" and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, ShardedObject):
        return (a.key, a.global_shape, a.global_offset, a.replica_id) == (
            b.key, b.global_shape, b.global_offset, b.replica_id) and _same(a.data, b.data)
    if isinstance(a, LocalNonpersistentObject):
        return True  # never written
    if isinstance(a, ATOMIC):
        try:
            return bool(a == b)
        except Exception:  # an uncomparable value is not known equal
            return False
    return False


def _first_difference(a: Any, b: Any, path: tuple = ()) -> str | None:
    """The path of the first value where two skeletons differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return ".".join(map(str, path)) + f" (keys {sorted(map(str, a.keys() ^ b.keys()))})"
        for k in a:
            d = _first_difference(a[k], b[k], (*path, k))
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(x, y, (*path, i))
            if d is not None:
                return d
        return None
    return None if _same(a, b) else ".".join(map(str, path)) or "(top)"


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers under a megatron-core optimizer (a chained one's, each)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _inner_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _walk(model: list[torch.nn.Module]) -> tuple[list[torch.Tensor], list[tuple[Any, Any]]]:
    """The model's parameters and buffers, and the ``get_extra_state()`` of every module that has one with the module
    (what its ``_extra_state`` objects hold), in one walk of its modules (``parameters()`` walks them per call and
    names every module on the way: ~4 times as long here)."""
    found: list[Any] = []
    extra: list[tuple[Any, Any]] = []
    base = torch.nn.Module.get_extra_state
    seen: set[int] = set()
    stack = list(reversed(model))
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        found.extend(mod._parameters.values())
        found.extend(mod._buffers.values())
        if type(mod).get_extra_state is not base:
            extra.append((mod, mod.get_extra_state()))
        stack.extend(reversed(mod._modules.values()))
    return [t for t in found if t is not None], extra


def live_tensors(model: list[torch.nn.Module], optimizer: Any) -> tuple[list[torch.Tensor], list[tuple[Any, Any]]]:
    """Every tensor a constant structure saves from: the model's parameters and buffers, the optimizer's
    parameters (the main parameters of a mixed-precision one) and state tensors; and the model's extra states."""
    out, extra = _walk(model)
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            out.extend(group["params"])
        for state in inner.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out, extra


def _structure_key(tensors: list[torch.Tensor], build_key: tuple) -> tuple:
    """What the captured tensors depend on: each tensor's identity, address, shape, stride and dtype (a list per
    attribute: ~6 times faster than a tuple per tensor)."""
    return (build_key, [id(t) for t in tensors], [t.data_ptr() for t in tensors], [t.shape for t in tensors],
            [t.stride() for t in tensors], [t.dtype for t in tensors])


def _plain_key(kwargs: Any) -> Any:
    """The build arguments (``metadata`` dicts) as a comparable value: process groups by identity."""
    if isinstance(kwargs, dict):
        return tuple(sorted((str(k), _plain_key(v)) for k, v in kwargs.items()))
    if isinstance(kwargs, list | tuple):
        return tuple(_plain_key(v) for v in kwargs)
    if isinstance(kwargs, ATOMIC):
        return kwargs
    return ("id", id(kwargs))


class StateDictReuse:
    """Megatron-LM's ``generate_state_dict`` for the saves of one run, replayed while the structure holds (above).

    Every rank decides with the others (an all-reduce per save over cpuckpt's gloo group): a save is replayed only
    where every rank can replay it, and reuse goes off on every rank at once, since a build may hold collectives
    (a distributed optimizer's gathers) that all ranks must enter. What makes a rank unable to replay: a change of
    its structure, a verification due, no capture yet, a capture whose tensors are not views of live ones, a tensor
    subclass among them (FP8 parameters: no plain storage to compare), an error while replaying; the last three, and
    a failed verification, turn reuse off. Megatron-LM calls it from its training thread only.

    Args:
        verify_every: a full build, compared with what a replay would have given, every this many saves (and at the
            second save and after each change of structure); 0: only then.
        timeout_s: the bound of the group's collectives (cpuckpt's ``timeout_s``).
    """

    def __init__(self, verify_every: int = 64, timeout_s: float | None = None) -> None:
        self.verify_every = verify_every
        self.timeout_s = timeout_s
        self.off: str | None = None  # why reuse is off for the run (the same on every rank)
        self.saves = 0  # saves this built a state dict for
        self.replays = 0  # of them replayed
        self.pending: _Capture | None = None  # the full build of the save under way, until the strategy takes it
        self._capture: _Capture | None = None
        self._problem: str | None = None  # turns reuse off at the next save's agreement
        self._verified = False  # the refresh matched a full build since the last change of structure
        self._since_full = 0
        self._changes = 0  # builds in a row whose structure differed from the previous build's

    def state_dict(self, build: Callable[..., dict[str, Any]], model: list[torch.nn.Module], optimizer: Any,
                   build_key: Any) -> dict[str, Any]:
        """This save's state dict (collective). ``build(model, optimizer)`` is Megatron-LM's ``generate_state_dict``
        with the save's other arguments bound; ``build_key`` what else the build depends on (its metadata
        arguments)."""
        self.saves += 1
        if self.off is not None:
            return build(model, optimizer)
        replayed = key = extra = tensors = None
        holds = False
        cap = self._capture
        try:
            tensors, extra = live_tensors(model, optimizer)
            odd = next((t for t in tensors if type(t) not in (torch.Tensor, torch.nn.Parameter)), None)
            if odd is not None:
                self._problem = f"a {type(odd).__name__} (a tensor subclass) among the model's or optimizer's tensors"
            elif cap is not None and cap.refused is not None:
                self._problem = cap.refused
            key = _structure_key(tensors, _plain_key(build_key))
            holds = (cap is not None and cap.key == key and cap.tensors is not None and len(cap.extra) == len(extra)
                     and all(n is m and _same(a, b) for (n, a), (m, b) in zip(cap.extra, extra, strict=True)))
            verify_due = not self._verified or (self.verify_every > 0 and self._since_full + 1 >= self.verify_every)
            if self._problem is None and holds and not verify_due:
                replayed = self._replay(build, optimizer, cap)  # before the agreement: a failure is a build
        except Exception as e:  # any failure here means: build, as Megatron-LM alone would
            self._problem = self._problem or f"{type(e).__name__}: {e}"
            replayed = None
        go, stay = self._agree(replayed is not None, self._problem is None)
        if not stay:
            self._turn_off(self._problem or "reuse went off on another rank")
            return build(model, optimizer)
        if go:
            self._since_full += 1
            self._changes = 0
            self.replays += 1
            if self.replays == 1:
                logger.info("cpuckpt: Megatron's state dict is replayed from its last build (reuse_state_dict)")
            return replayed
        full = build(model, optimizer)
        try:
            self._capture_build(full, optimizer, cap, holds, key, extra, tensors)
        except Exception as e:  # this save is a plain build; reuse goes off at the next agreement
            self._problem = self._problem or f"{type(e).__name__}: {e}"
            self._capture = self.pending = None
        return full

    def _capture_build(self, full: dict[str, Any], optimizer: Any, cap: _Capture | None, holds: bool, key: Any,
                       extra: Any, tensors: list[torch.Tensor]) -> None:
        """Capture a full build (the strategy records its tensors); where the previous capture held (``holds``),
        first check that a replay would have given what the build did."""
        parts = tuple(k for k in full if isinstance(k, str) and _PART.fullmatch(k))
        skeleton = {k: s for k in parts if (s := _skeleton(full[k])) is not _DROPPED}
        holds = holds and cap is not None and cap.parts == parts
        if holds and self._problem is None:  # a verification: what a replay would have given
            diff = _first_difference(self._parts(optimizer, cap), {k: _compact(v) for k, v in skeleton.items()})
            if diff is not None:
                self._problem = f"a replayed save would have differed from Megatron's build at {diff}"
                self._capture = None
                return
        elif cap is not None and cap.tensors is not None:
            self._changes += 1
            logger.info("cpuckpt: the model's or optimizer's tensors, extra states or build arguments changed since "
                        "the last build: Megatron's state dict is built again")
            if self._changes >= _CHANGES_IN_A_ROW:
                self._problem = (f"the model's or optimizer's tensors or extra states changed at {self._changes} saves "
                                 "in a row (Transformer Engine's FP8 metadata changes every step)")
        if holds:
            self._changes = 0
        self._verified, self._since_full = holds, 0
        tensor_keys = frozenset(sh.key for k in parts for sh in _tensors(full[k]))
        self._capture = self.pending = _Capture(key, extra, parts, skeleton,
                                                {t.untyped_storage().data_ptr() for t in tensors}, tensor_keys,
                                                _padding({k: full[k] for k in parts}),
                                                tuple(k for k in full if isinstance(k, str)),
                                                verifies=cap if holds else None)

    def _agree(self, replay: bool, stay: bool) -> tuple[bool, bool]:
        """Whether every rank replays this save, and whether reuse stays on everywhere (an all-reduce of both)."""
        group = peers(checkpoint_group(None, self.timeout_s))
        if group is None:  # no process group, or this rank alone
            return replay, stay
        flags = torch.tensor([int(replay), int(stay)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        return bool(flags[0]), bool(flags[1])

    def _turn_off(self, why: str) -> None:
        self.off = why
        self._capture = self.pending = None  # no reference to the model's or optimizer's tensors stays
        logger.warning("cpuckpt: megatron.reuse_state_dict is off for this run (%s): every save builds Megatron's "
                       "state dict", why)

    @staticmethod
    def _parts(optimizer: Any, cap: _Capture) -> dict[str, Any]:
        """The captured parts for one save: the optimizer's refreshed from its ``state_dict()``, the model's copied."""
        fresh = optimizer.state_dict() if optimizer is not None and "optimizer" in cap.parts else None
        return {k: (_refresh(v, fresh) if k == "optimizer" else _copy_objects(v)) for k, v in cap.skeleton.items()}

    def _replay(self, build: Callable[..., dict[str, Any]], optimizer: Any, cap: _Capture) -> dict[str, Any]:
        """Megatron-LM's small parts (its build without model and optimizer) and the captured parts refreshed, in the
        build's order, then the captured tensors behind the marker."""
        small = build([], None)
        parts = self._parts(optimizer, cap)
        out = {k: parts[k] if k in parts else small[k] for k in cap.order if k in parts or k in small}
        out.update((k, v) for k, v in small.items() if k not in out)
        out[MARKER_KEY] = ReplayedTensors(MARKER_KEY, cap)
        return out


def install(module: Any, reuse: StateDictReuse, importers: list[Any] | None = None) -> bool:
    """Route the state dicts of ``module``'s saves (``megatron.training.checkpointing``) through ``reuse``; returns
    whether it did.

    Wraps ``generate_state_dict`` (which the module's ``save_checkpoint`` and ``load_checkpoint`` both call) and
    ``save_checkpoint`` (also where ``importers`` hold it by name; default: every loaded ``megatron.*`` module, as
    ``megatron.training.training`` imports it): only a build inside a save with
    ``--ckpt-assume-constant-structure``, ``--ckpt-format torch_dist`` (what cpuckpt's format is to Megatron-LM) and
    a checkpointing context that holds a save strategy already (Megatron-LM validates the sharding of a save only
    before that: a replay's marker would not pass megatron-core's validation) and one that resolves the marker first
    (``takes_replays``: cpuckpt's strategy, or the hook's fully parallel wrapper of it), not a local non-persistent one
    (nvidia-resiliency-ext's format), may be replayed; every rank's save decides the same (the context and the
    arguments are the same on every rank).
    Loads always build. The build the strategy did not take by the end of the save is dropped."""
    build, save = getattr(module, "generate_state_dict", None), getattr(module, "save_checkpoint", None)
    get_args = getattr(module, "get_args", None)
    if build is None or save is None or get_args is None:
        logger.warning("cpuckpt: %s lacks generate_state_dict, save_checkpoint or get_args: every save builds "
                       "Megatron's state dict (megatron.reuse_state_dict does nothing)",
                       getattr(module, "__name__", module))
        return False
    holder = getattr(build, "_cpuckpt_reuse", None)
    if holder is not None:  # installed before (another run in this process): its saves go to this one
        holder[0] = reuse
        return True
    build_sig, save_sig = inspect.signature(build), inspect.signature(save)
    if not {"model", "optimizer"} <= build_sig.parameters.keys():
        logger.warning("cpuckpt: generate_state_dict takes no model and optimizer arguments: every save builds "
                       "Megatron's state dict (megatron.reuse_state_dict does nothing)")
        return False
    replayable = [0]  # save_checkpoint calls under way whose state dicts may be replayed

    @functools.wraps(save)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        margs = get_args()
        given = save_sig.bind_partial(*args, **kwargs).arguments
        local = given.get("non_persistent_ckpt") and getattr(margs, "non_persistent_ckpt_type", None) == "local"
        context = given.get("checkpointing_context")
        ok = int(bool(getattr(margs, "ckpt_assume_constant_structure", False)) and not local
                 and getattr(margs, "ckpt_format", None) == "torch_dist"
                 and isinstance(context, dict) and getattr(context.get("save_strategy"), "takes_replays", False))
        replayable[0] += ok
        try:
            return save(*args, **kwargs)
        finally:
            replayable[0] -= ok
            holder[0].pending = None  # a build the strategy never took is not captured by a later save

    @functools.wraps(build)
    def generate_state_dict(*args: Any, **kwargs: Any) -> Any:
        if not replayable[0]:
            return build(*args, **kwargs)
        bound = build_sig.bind(*args, **kwargs)
        model, optimizer = bound.arguments["model"], bound.arguments["optimizer"]

        def rebuild(m: list[Any], o: Any) -> Any:
            bound.arguments["model"], bound.arguments["optimizer"] = m, o
            return build(*bound.args, **bound.kwargs)

        key = (bound.arguments.get("model_sd_kwargs"), bound.arguments.get("optim_sd_kwargs"))
        return holder[0].state_dict(rebuild, list(model), optimizer, key)

    holder = [reuse]
    generate_state_dict._cpuckpt_reuse = holder  # type: ignore[attr-defined]
    module.generate_state_dict = generate_state_dict
    replace_function(module, "save_checkpoint", save, save_checkpoint, importers)
    return True
