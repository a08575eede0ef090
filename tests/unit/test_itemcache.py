"""Saves that repeat the previous one reuse its resolved items; every change that would make them wrong is caught.

One process, no process group: ``async_save`` to files (the pool path) and into memory images (the
memory tier's path). Each case saves a state dict twice, changes one thing in between, and checks
both which path the second save took (``stats.resolved``) and that every checkpoint loads bit-exact
with the values of its own save: a wrong reuse would load the old tensor's bytes or fail to load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import cpuckpt
from cpuckpt.backend.itemcache import FlatState, walk_state
from cpuckpt.background import async_save
from cpuckpt.tier.images import ImageSet

CFG = {"io": {"chunk_bytes": "8KiB", "threads": 2, "backend": "buffered", "fsync": False},
       "layout": {"align_bytes": 512, "align_data_min_bytes": "4KiB"}, "timeout_s": 60}


class _Model:
    """Tensors that persist across steps; ``state_dict()`` returns fresh ``detach()`` aliases, as nn.Module does."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(n)
        self.params: dict[str, torch.Tensor] = OrderedDict(
            (f"layer{i}.w", torch.randn(3 + i % 4, 5 + i % 3, generator=g).to(
                torch.bfloat16 if i % 5 == 0 else torch.float32)) for i in range(n))
        self.params["big"] = torch.randn(3000, generator=g)  # several chunks, aligned
        self.params["empty"] = torch.empty(0)
        self.params["ints"] = torch.arange(11, dtype=torch.int64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return OrderedDict((k, v.detach()) for k, v in self.params.items())

    def step(self) -> None:
        with torch.no_grad():
            for v in self.params.values():
                if v.is_floating_point():
                    v.add_(1.0)
                else:
                    v.add_(3)


def _state(model: _Model, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "extra": {"step": step, "lr": 0.5 / (step + 1), "tags": ["a", "b"]}}


def _save(state: dict[str, Any], path: Path, images: ImageSet | None = None, **kw: Any) -> cpuckpt.AsyncSaveHandle:
    h = async_save(state, path, CFG, sink=images, **kw)
    h.wait()
    return h


def _like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, 7) if value.numel() else torch.empty_like(value)
    if isinstance(value, dict):
        return type(value)((k, _like(v)) for k, v in value.items())
    return None


def _assert_loads(path: Path, want: dict[str, Any]) -> None:
    out = _like(want)
    cpuckpt.load(out, path, CFG)
    _assert_equal(out, want, "")


def _assert_equal(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _assert_equal(got[k], want[k], f"{where}/{k}")
    else:
        assert got == want, (where, got, want)


def _snapshot(state: Any) -> Any:
    """The values saved, kept apart from the live tensors the trainer goes on changing."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    return state


@pytest.fixture(params=["pool", "images"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[int], tuple[Path, ImageSet | None]]:
    """Where save ``k`` goes: a new directory per save, or one memory-image directory reused by every save."""
    images = ImageSet(tmp_path / "slot", pin=False) if request.param == "images" else None

    def where(k: int) -> tuple[Path, ImageSet | None]:
        return (tmp_path / "slot", images) if images is not None else (tmp_path / f"s{k}", None)

    yield where
    if images is not None:
        images.close()


def _run(target: Callable[[int], tuple[Path, ImageSet | None]], states: list[Callable[[], dict]]) -> list[str]:
    """Save each state in turn (built just before its save), check each checkpoint, return how each was resolved."""
    resolved = []
    for k, make in enumerate(states):
        state = make()
        want = _snapshot(state)
        path, images = target(k)
        h = _save(state, path, images)
        resolved.append(h.stats.resolved)
        _assert_loads(path, want)
    return resolved


def test_repeated_saves_reuse_items_and_stay_bit_exact(target):
    model = _Model()

    def make(step: int) -> Callable[[], dict]:
        def build() -> dict:
            model.step()
            return _state(model, step)
        return build

    assert _run(target, [make(s) for s in range(4)]) == ["planner", "cached", "cached", "cached"]


@pytest.mark.parametrize("change", [
    "shape", "dtype", "replaced", "data_assigned", "offset", "strides", "requires_grad", "new_key",
    "key_removed", "leaf_becomes_tensor", "int_key_type",
])
def test_a_change_is_never_reused(target, change):
    """Every change that makes the cached items wrong falls back to the planner; the next save reuses again."""
    model = _Model(12)
    base = torch.randn(6, 6)
    square = torch.randn(5, 5)
    o0, o1 = torch.ones(3), torch.zeros(2)

    def first() -> dict:
        sd = _state(model, 0)
        sd["view"] = base[1:].reshape(-1)[:6]
        sd["square"] = square.detach()
        sd["optim"] = {0: o0.detach(), 1: o1.detach()}
        return sd

    def changed() -> dict:
        p = model.params
        if change == "shape":
            p["layer1.w"] = torch.randn(4, 4)  # new storage and a new shape
        elif change == "dtype":
            p["layer2.w"].data = p["layer2.w"].data.to(torch.float64)
        elif change == "replaced":
            p["layer3.w"] = p["layer3.w"].clone() + 5  # same shape, dtype, strides: another storage
        elif change == "data_assigned":
            p["layer4.w"].data = torch.randn_like(p["layer4.w"])  # the same object, another storage
        sd = first()
        if change == "offset":
            sd["view"] = base[2:].reshape(-1)[:6]  # the same storage, shape and strides: another offset
        elif change == "strides":
            sd["square"] = square.t()  # the same storage, offset and shape: other strides
        elif change == "requires_grad":
            sd["model"]["layer5.w"] = p["layer5.w"].detach().requires_grad_(True)
        elif change == "new_key":
            sd["model"]["added"] = torch.ones(2)
        elif change == "key_removed":
            del sd["extra"]["lr"]
        elif change == "leaf_becomes_tensor":
            sd["extra"]["step"] = torch.tensor(1)
        elif change == "int_key_type":
            sd["optim"] = {0: o0.detach(), True: o1.detach()}  # 1 == True, but DCP names it "True"
        return sd

    saved: dict[str, Any] = {}

    def second() -> dict:
        model.step()
        saved["sd"] = changed()
        return saved["sd"]

    def third() -> dict:  # the same structure and storages as the second save, through new aliases
        model.step()
        return _fresh_aliases(saved["sd"])

    assert _run(target, [first, first, second, third]) == ["planner", "cached", "planner", "cached"]


def test_another_storage_at_the_same_address_is_never_reused(tmp_path):
    """A cached item is tied to its storage, not to its address: a storage resized in place keeps its identity but
    moves, and another tensor may then take its old address with the same shape and dtype; the cached view would
    read the moved storage. Here the other storage is made at that address directly (an alias of the same bytes)."""
    import ctypes

    first = torch.full((1000,), 1.0)
    for k in range(2):
        assert _save({"w": first.detach()}, tmp_path / f"s{k}").stats.resolved == ["planner", "cached"][k]
    block = (ctypes.c_char * first.nbytes).from_address(first.data_ptr())
    block.owner = first  # the aliased memory lives as long as the alias (the item cache may keep it past the test)
    other = torch.frombuffer(block, dtype=torch.float32)  # same address, shape, strides, dtype: another storage
    assert other.data_ptr() == first.data_ptr() and other.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert _save({"w": other}, tmp_path / "s2").stats.resolved == "planner"
    _assert_loads(tmp_path / "s2", {"w": torch.full((1000,), 1.0)})


def _fresh_aliases(state: Any) -> Any:
    """The same tensors through new wrapper objects (what ``state_dict()`` returns on the next step)."""
    if isinstance(state, torch.Tensor):
        return state.detach().requires_grad_(state.requires_grad) if state.requires_grad else state.detach()
    if isinstance(state, dict):
        return type(state)((k, _fresh_aliases(v)) for k, v in state.items())
    return state


def test_non_contiguous_and_conjugated_tensors_are_copied_afresh(target):
    """A non-contiguous or conjugated tensor is copied every save (its bytes are not a view of its storage)."""
    base = torch.randn(8, 6)
    z = torch.randn(5, dtype=torch.complex64)
    many = {f"t{i}": torch.randn(4) for i in range(20)}

    def make(conj: bool) -> Callable[[], dict]:
        def build() -> dict:
            base.add_(1)
            z.mul_(2)
            return {"nc": base.t(), "z": z.conj() if conj else z, "many": dict(many)}
        return build

    # a viewed complex tensor becomes a conjugate view of the same storage: its view would read the wrong
    # values, so it is a change; a conjugate view is copied every save, so it may become plain again
    assert _run(target, [make(False), make(False), make(True), make(True), make(False)]) == \
        ["planner", "cached", "planner", "cached", "cached"]


def test_non_tensor_values_change_freely(target):
    """Pickled values are made every save; a change of their length plans the layout again, still from the cache."""
    ts = {f"t{i}": torch.randn(3, 3) for i in range(30)}
    values = [{"step": 1, "s": "x"}, {"step": 2, "s": "y"}, {"step": 10 ** 30, "s": "longer" * 50},
              {"step": 3, "s": "z"}, {"step": 4, "s": "w"}]

    tail = torch.zeros(5)

    def make(v: dict) -> Callable[[], dict]:
        def build() -> dict:
            tail.fill_(float(v["step"] % 7))
            return {"ts": dict(ts), "meta": dict(v), "tail": tail.detach()}
        return build

    assert _run(target, [make(v) for v in values]) == ["planner", "cached", "cached", "cached", "cached"]


def test_tied_tensors(target):
    """One tensor under two keys, then untied: positions are checked one by one."""
    w = torch.randn(4, 4)

    other = torch.randn(3)
    copy = torch.empty(4, 4)

    def tied() -> dict:
        w.add_(1)
        return {"a": w.detach(), "b": w.detach(), "c": other.detach()}

    def untied() -> dict:
        w.add_(1)
        copy.copy_(w + 1)
        return {"a": w.detach(), "b": copy.detach(), "c": other.detach()}

    assert _run(target, [tied, tied, untied, untied, tied]) == ["planner", "cached", "planner", "cached", "planner"]


def test_a_planner_with_its_own_resolve_data_never_uses_the_cache(tmp_path):
    class Scaled(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return data * 2 if isinstance(data, torch.Tensor) else data

    t = {"a": torch.ones(3), "b": torch.arange(4.0)}
    got = [_save(dict(t), tmp_path / f"s{k}", planner=Scaled(), plan_key="x2").stats for k in range(3)]
    assert [(s.planned, s.resolved) for s in got] == [("dcp", "planner"), ("reused", "planner"), ("reused", "planner")]
    out = {"a": torch.zeros(3), "b": torch.zeros(4)}
    cpuckpt.load(out, tmp_path / "s2", CFG)
    assert torch.equal(out["a"], torch.full((3,), 2.0)) and torch.equal(out["b"], torch.arange(4.0) * 2)


def test_walk_follows_dcp_traversal():
    """Leaves and their DCP paths: lists of tensors or mappings are walked, other lists and tuples are values."""
    t = torch.ones(1)
    state = {"a": {"b": t, 3: [t, {"c": 1}], "plain": [1, [2, 3]], "tup": (t, t)}, "d": [[1], [t]]}
    leaves: list[Any] = []
    skeleton: list[Any] = []
    paths: list[tuple] = []
    assert walk_state(state, leaves, skeleton, paths)
    assert paths == [("a", "b"), ("a", "3", 0), ("a", "3", 1, "c"), ("a", "plain"), ("a", "tup"), ("d", 0),
                     ("d", 1, 0)]
    _, mappings = flatten_state_dict(state)
    assert paths == [tuple(p) for p in mappings.values()]  # DCP's own traversal, in the same order
    assert leaves[3] == [1, [2, 3]] and leaves[5] == [1]
    assert not walk_state({1.5: t}, [], [], [])  # float keys: equal keys may name different paths


def test_a_value_that_stops_pickling_fails_the_save_and_the_next_save_recovers(tmp_path):
    """A value that no longer pickles (a tuple stays a tuple): the save raises, naming it; the next one works."""
    import threading

    t = {f"t{i}": torch.randn(2) for i in range(10)}
    assert _save({"t": dict(t), "v": (1,)}, tmp_path / "a").stats.resolved == "planner"
    assert _save({"t": dict(t), "v": (2,)}, tmp_path / "b").stats.resolved == "cached"
    with pytest.raises(cpuckpt.CpuckptError, match="cannot pickle"):  # agreed like any planning error
        async_save({"t": dict(t), "v": (threading.Lock(),)}, tmp_path / "c", CFG)
    h = _save({"t": dict(t), "v": (3,)}, tmp_path / "d")
    assert h.stats.resolved in ("planner", "cached")
    _assert_loads(tmp_path / "d", _snapshot({"t": dict(t), "v": (3,)}))


# ------------------------------------------------------------------ FlatState: a state dict its caller flattened
def _flat(state: dict[str, Any], key: Any = "v1", built: list | None = None,
          rename: dict[str, str] | None = None) -> FlatState:
    """``state`` as a FlatState for DCP's default planner (flattened names; a tensor's chunk offsets are zeros)."""
    flat, _ = flatten_state_dict(state)
    names = [((rename or {}).get(fqn, fqn), (0,) * v.dim() if isinstance(v, torch.Tensor) else None)
             for fqn, v in flat.items()]

    def build() -> dict[str, Any]:
        if built is not None:
            built.append(1)
        return state

    return FlatState(key=key, names=names, leaves=list(flat.values()), build=build)


def test_a_flat_state_that_repeats_the_last_save_is_never_built(target):
    model = _Model()
    built: list[int] = []
    resolved = []
    for k in range(4):
        model.step()
        state = _state(model, k)
        want = _snapshot(state)
        path, images = target(k)
        h = _save(_flat(state, built=built), path, images)  # type: ignore[arg-type]
        resolved.append(h.stats.resolved)
        _assert_loads(path, want)
    assert resolved == ["planner", "cached", "cached", "cached"] and len(built) == 1


@pytest.mark.parametrize("change", ["key", "replaced", "shape", "name_unknown", "leaf_count"])
def test_a_flat_state_that_changed_is_built_and_planned(target, change):
    model = _Model()
    states = []
    for k in range(2):
        model.step()
        state = _state(model, k)
        flat = _flat(state)
        if k == 1:
            if change == "key":  # the caller's structure changed where the leaves do not show it
                flat = _flat(state, key="v2")
            elif change == "replaced":  # another tensor of the same shape: the cached view would read stale bytes
                state["model"]["layer3.w"] = state["model"]["layer3.w"].clone() + 100
                flat = _flat(state)
            elif change == "shape":
                state["model"]["layer3.w"] = torch.ones(2, 2)
                flat = _flat(state)
            elif change == "leaf_count":
                state["model"]["new"] = torch.ones(3)
                flat = _flat(state)
        if k == 0 and change == "name_unknown":  # a leaf named unlike its write item: no cache is built from it
            flat = _flat(state, rename={"model.big": "model.other"})
        want = _snapshot(state)
        path, images = target(k)
        h = _save(flat, path, images)  # type: ignore[arg-type]
        states.append(h.stats.resolved)
        _assert_loads(path, want)
    assert states == ["planner", "planner"], states


def test_a_flat_state_with_a_planner_that_passes_bytes_through(tmp_path):
    """Megatron's planner writes its objects as the BytesIO they already are (``transform_object`` returns them)."""
    import io

    class PassBytes(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return object

    t = torch.arange(6.0)
    for k in range(3):
        buf = io.BytesIO()
        torch.save({"step": k}, buf)
        state = {"t": t, "obj": buf}
        flat = FlatState(key="x", names=[("t", (0,)), ("obj", None)], leaves=[t, buf], build=lambda s=state: s)
        h = _save(flat, tmp_path / f"s{k}", planner=PassBytes(flatten_state_dict=False), plan_key="pass")  # type: ignore[arg-type]
        assert h.stats.resolved == ("planner" if k == 0 else "cached")
        out = {"t": torch.zeros(6), "obj": {}}
        cpuckpt.load(out, tmp_path / f"s{k}", CFG)
        assert torch.equal(out["t"], t) and out["obj"] == {"step": k}
        t.add_(1)


def test_a_negative_view_of_the_cached_tensor_is_not_reused(target):
    base = torch.arange(1.0, 7.0)
    states = [lambda: {"negated": base.detach()}, lambda: {"negated": torch._neg_view(base)}]
    _run(target, states)  # loads each bit-exact: -1..-6 the second time (a cached view would read 1..6)


def test_the_cache_keeps_no_copy_the_translation_made(tmp_path):
    """A flat leaf that is not contiguous is written from the copy ``build()`` made; once a later save no longer
    needs it, the cache must not keep that copy (nor the state dict holding it) alive: on a GPU it is device memory."""
    import gc
    import weakref

    base = torch.arange(64.0).reshape(8, 8)
    refs = []

    def build() -> dict[str, Any]:
        copy = base.t().contiguous()
        refs.append(weakref.ref(copy))
        return {"w": copy}

    resolved = []
    for k in range(2):  # the second save repeats the first: cached, nothing built
        h = _save(FlatState(key="k", names=[("w", (0, 0))], leaves=[base.t()], build=build), tmp_path / f"s{k}")
        resolved.append(h.stats.resolved)
        out = {"w": torch.zeros(8, 8)}
        cpuckpt.load(out, tmp_path / f"s{k}", CFG)
        assert torch.equal(out["w"], base.t())
        base.add_(1)
    del h
    gc.collect()
    assert resolved == ["planner", "cached"] and len(refs) == 1 and refs[0]() is None


def test_vouched_tensors_are_not_checked_again_until_the_token_or_a_tensor_changes(target, monkeypatch):
    """A FlatState whose caller vouches for its tensors (the same objects, checked by the caller) skips the per-tensor
    check while the token and the objects stay, and still catches ``requires_grad`` and a replaced tensor."""
    import dataclasses

    from cpuckpt.backend.itemcache import CachedItems

    model = _Model()
    checks: list[int] = []
    real = CachedItems._keys
    monkeypatch.setattr(CachedItems, "_keys", lambda self, leaves: (checks.append(1), real(self, leaves))[1])
    token, other = object(), object()
    seen = []
    for k, change in enumerate([None, None, None, None, "token", None, "requires_grad", "replaced", None, "set_"]):
        model.step()
        if change == "requires_grad":
            model.params["layer3.w"].requires_grad_(True)
        if change == "replaced":
            model.params["layer3.w"] = model.params["layer3.w"].detach().clone()
        if change == "set_":  # the same object, new memory (after the caller checked it: a deferred start)
            w = model.params["layer4.w"]
            w.set_(w.clone() + 1000)
        state = {"extra": {"step": k}, "model": dict(model.params)}  # the same tensor objects every save
        flat = _flat(state)
        start = next(i for i, v in enumerate(flat.leaves) if isinstance(v, torch.Tensor))
        flat = dataclasses.replace(flat, vouched=other if change == "token" else token, vouched_from=start)
        want = _snapshot(state)
        path, images = target(k)
        before = len(checks)
        h = _save(flat, path, images)  # type: ignore[arg-type]
        seen.append((h.stats.resolved, len(checks) - before))
        _assert_loads(path, want)
    # built (checked by the build, which keeps the vouch), not checked again while the token holds, a new token and
    # the old one back: checked each, requires_grad and a replaced tensor: checked, and planned again
    assert seen[1:6] == [("cached", 0), ("cached", 0), ("cached", 0), ("cached", 1), ("cached", 1)], seen
    assert [r for r, _ in seen[6:8]] == ["planner", "planner"] and all(n >= 1 for _, n in seen[6:8]), seen
    assert seen[8] == ("cached", 0) and seen[9][0] == "planner", seen  # each save also loaded what it saved


def test_tensors_before_the_vouched_ones_are_always_checked(target, monkeypatch):
    """A vouch covers the tensors from ``vouched_from`` on only: with a tensor before them, every save checks all."""
    import dataclasses

    from cpuckpt.backend.itemcache import CachedItems

    model = _Model()
    checks: list[int] = []
    real = CachedItems._keys
    monkeypatch.setattr(CachedItems, "_keys", lambda self, leaves: (checks.append(1), real(self, leaves))[1])
    token, per_save = object(), []
    for k in range(4):
        model.step()
        state = {"extra": {"step": k}, "model": dict(model.params)}
        flat = _flat(state)
        first = next(i for i, v in enumerate(flat.leaves) if isinstance(v, torch.Tensor))
        flat = dataclasses.replace(flat, vouched=token, vouched_from=first + 1)
        path, images = target(k)
        before = len(checks)
        _save(flat, path, images)  # type: ignore[arg-type]
        per_save.append(len(checks) - before)
    assert all(n >= 1 for n in per_save), per_save
