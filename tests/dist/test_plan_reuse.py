"""``async_save`` reuses the previous save's DCP plan when every rank's structure is unchanged.

Three saves of the same structure (DTensor shards, a replicated tensor DCP deduplicates, a non-tensor
value whose pickle grows every step, so the layout must still be recomputed): the first is planned
by DCP, the next two reuse the plan. Every checkpoint loads bit-exact with stock DCP. When one rank's
structure changes (a new key on that rank only), every rank falls back to DCP planning, and the save
after that reuses the new plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import _helpers as H
import pytest
import torch

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60}


def _state(mesh, step: int, extra_key: bool) -> dict:
    from torch.distributed.tensor import Shard

    big = H.make_full("big", (300, 257), torch.float32, seed=step)
    sd = {
        "big": H.make_dtensor(big, mesh, [Shard(0)]),
        "rep": H.make_full("rep", (33, 5), torch.bfloat16, seed=step),
        "meta": {"step": 10 ** (3 * step), "name": "x" * step},
    }
    if extra_key:
        sd["rank_only"] = torch.arange(7) + step
    return sd


def rank_reuse(root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import cpuckpt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    planned = []
    for step in range(5):
        extra = step >= 3 and rank == 1  # rank 1's structure changes at step 3
        sd = _state(mesh, step, extra)
        h = cpuckpt.async_save(sd, f"{root}/s{step}", CFG, step=step)
        h.staged.wait()
        h.wait()
        planned.append(h.stats.planned)
        # every checkpoint: stock DCP reader, bit-exact
        want = _state(mesh, step, extra)
        out = {"big": H.make_dtensor(want["big"].full_tensor(), mesh, [Shard(0)], poisoned=True),
               "rep": H.poison(want["rep"]), "meta": {"step": None, "name": None}}
        dcp.load(out, storage_reader=dcp.FileSystemReader(f"{root}/s{step}"))
        H.assert_dtensor(out["big"], want["big"].full_tensor(), mesh, [Shard(0)], f"big@{step}")
        H.assert_bitexact(out["rep"], want["rep"], f"rep@{step}")
        assert out["meta"] == want["meta"], (out["meta"], want["meta"])
    return planned


def test_plan_is_reused_while_structure_is_unchanged(run_ranks, tmp_path):
    results = run_ranks(2, rank_reuse, str(tmp_path / "ck"), timeout_s=120)
    for planned in results:
        assert planned == ["dcp", "reused", "reused", "dcp", "reused"], planned


class _Box(Mapping):
    """A Mapping that is not a dict: DCP traverses it, so its tensors are part of the plan."""

    def __init__(self, **items: Any) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _torch_sharded(name: str, split: int, step: int, *, poisoned: bool = False) -> tuple[Any, torch.Tensor]:
    """A torch ShardedTensor of a (9, 7) tensor: rank 0 holds rows [0, split), rank 1 the rest."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()
    lo, hi = (0, split) if rank == 0 else (split, 9)
    want = H.make_full(name, (9, 7), torch.float32, seed=step)[lo:hi].clone()
    local = H.poison(want) if poisoned else want.clone()
    return init_from_local_shards([Shard.from_tensor_and_offsets(local, [lo, 0], rank)], 9, 7), want


# (what changes, the torch ShardedTensor's split row, the box tensor's rows, requires_grad, planner, plan_key, planned)
_CASES = [
    ("first save", 5, 3, False, None, None, "dcp"),
    ("values only", 5, 3, False, None, None, "reused"),
    ("ShardedTensor shards: offsets and sizes (same global size)", 6, 3, False, None, None, "dcp"),
    ("values only", 6, 3, False, None, None, "reused"),
    ("requires_grad", 6, 3, True, None, None, "dcp"),
    ("a tensor's shape inside a non-dict Mapping", 6, 4, True, None, None, "dcp"),
    ("values only", 6, 4, True, None, None, "reused"),
    ("custom planner, no plan_key", 6, 4, True, "custom", None, "dcp"),
    ("custom planner, no plan_key", 6, 4, True, "custom", None, "dcp"),
    ("custom planner with plan_key (another planner than the cached plan's)", 6, 4, True, "custom", "a", "dcp"),
    ("values only", 6, 4, True, "custom", "a", "reused"),
    ("another plan_key", 6, 4, True, "custom", "b", "dcp"),
    ("the default planner again (the cache holds plan_key b's plan)", 6, 4, True, None, None, "dcp"),
]


def _variant_state(step: int, split: int, rows: int, grad: bool) -> tuple[dict, dict]:
    st, st_want = _torch_sharded("st", split, step)
    plain = H.make_full("plain", (4, 3), torch.float32, seed=step).requires_grad_(grad)
    boxed = H.make_full("boxed", (rows, 2), torch.bfloat16, seed=step)
    want = {"st": st_want, "plain": plain.detach().clone(), "boxed": boxed.clone()}
    return {"st": st, "plain": plain, "box": _Box(t=boxed), "n": step}, want


def rank_reuse_variants(root: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import cpuckpt

    planned = []
    for step, (_, split, rows, grad, planner, key, _) in enumerate(_CASES):
        sd, want = _variant_state(step, split, rows, grad)
        h = cpuckpt.async_save(sd, f"{root}/v{step}", CFG, step=step,
                               planner=DefaultSavePlanner() if planner else None, plan_key=key)
        h.staged.wait()
        for t in (sd["st"].local_shards()[0].tensor, sd["plain"].detach(), sd["box"]["t"]):
            t.fill_(-7)  # the trainer moves on
        h.wait()
        planned.append(h.stats.planned)
        st, _ = _torch_sharded("st", split, step, poisoned=True)
        out = {"st": st, "plain": H.poison(want["plain"]), "box": {"t": H.poison(want["boxed"])}, "n": None}
        dcp.load(out, storage_reader=dcp.FileSystemReader(f"{root}/v{step}"))
        H.assert_bitexact(out["st"].local_shards()[0].tensor, want["st"], f"st@{step}")
        H.assert_bitexact(out["plain"], want["plain"], f"plain@{step}")
        H.assert_bitexact(out["box"]["t"], want["boxed"], f"box@{step}")
        assert out["n"] == step, out["n"]
    return planned


def test_plan_reuse_covers_sharded_tensors_and_planners(run_ranks, tmp_path):
    results = run_ranks(2, rank_reuse_variants, str(tmp_path / "ck"), timeout_s=180)
    expected = [case[-1] for case in _CASES]
    for planned in results:
        assert planned == expected, list(zip([c[0] for c in _CASES], planned, expected))


# ------------------------------------------------------------------ cached items (backend.itemcache)

# step -> what rank 1 changes before that save, and how each rank's save is then resolved: rank 0 and rank 1
_ITEM_STEPS = [
    ("first save", "dcp", "dcp"),
    ("values only (new detach() aliases of the same tensors)", "cached", "cached"),
    ("values only, a pickled value grows", "cached", "cached"),
    ("rank 1 replaces one of its tensors (same shape): its own items are resolved again, the plan holds",
     "cached", "plan"),
    ("values only", "cached", "cached"),
    ("rank 1 changes a tensor's shape: every rank plans with DCP", "dcp", "dcp"),
    ("values only", "cached", "cached"),
    ("rank 1 replaces the replicated tensor (DCP deduplicates it: one rank writes it)", "cached", "rep"),
    ("values only", "cached", "cached"),
]
_STATS = {"dcp": ("dcp", "planner"), "plan": ("reused", "planner"), "cached": ("reused", "cached")}


def rank_cached_items(root: str, images: bool) -> tuple[list[tuple[str, str]], bool, list[bool]]:
    """Rank-local tensors, a replicated tensor (DCP deduplicates it: one rank writes it) and non-tensor values."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import cpuckpt
    from cpuckpt.background import _ResultsRelay
    from cpuckpt.tier.images import ImageSet

    unchanged = []  # per save: did this rank send the marker instead of its write results (and still load right)
    sends = _ResultsRelay.outgoing

    def counted(self, results):
        out = sends(self, results)
        unchanged.append(out == _ResultsRelay.UNCHANGED)
        return out

    _ResultsRelay.outgoing = counted
    rank = dist.get_rank()
    own = {f"w{i}@{rank}": H.make_full(f"w{i}", (3 + i % 3, 4), torch.float32, seed=rank) for i in range(12)}
    rep = H.make_full("rep", (5, 2), torch.bfloat16)
    image_set = ImageSet(f"{root}/slot", pin=False) if images else None
    seen = []
    writes_rep = False
    for step in range(len(_ITEM_STEPS)):
        if step == 3 and rank == 1:
            own["w5@1"] = own["w5@1"].clone()
        if step == 5 and rank == 1:
            own["w6@1"] = torch.zeros(7)
        if step == 7 and rank == 1:
            rep = rep.clone()
        for t in [*own.values(), rep]:
            t.add_(1)  # both ranks' replicated copies stay equal
        sd = {"own": {k: v.detach() for k, v in own.items()}, "rep": rep.detach(),
              "meta": {"step": step, "name": "n" * (1 + step // 2)}}
        want = {"own": {k: v.clone() for k, v in own.items()}, "rep": rep.clone()}
        path = f"{root}/slot" if images else f"{root}/s{step}"
        h = cpuckpt.async_save(sd, path, CFG, step=step, sink=image_set)
        h.staged.wait()
        for t in [*own.values(), rep]:
            t.add_(100)  # the trainer moves on once staged
        h.wait()
        seen.append((h.stats.planned, h.stats.resolved))
        out = {"own": {k: H.poison(v) for k, v in want["own"].items()}, "rep": H.poison(want["rep"]),
               "meta": {"step": None, "name": None}}
        dcp.load(out, storage_reader=dcp.FileSystemReader(path))
        for k in own:
            H.assert_bitexact(out["own"][k], want["own"][k], f"own.{k}@{step}")
        H.assert_bitexact(out["rep"], want["rep"], f"rep@{step}")
        assert out["meta"] == {"step": step, "name": "n" * (1 + step // 2)}, out["meta"]
        if step == 7:
            where = dcp.FileSystemReader(path).read_metadata().storage_data
            writes_rep = any(k.fqn == "rep" and v.relative_path.startswith(f"__{rank}_") for k, v in where.items())
        dist.barrier()  # nobody saves into the slot again before every rank has read it
    if image_set is not None:
        image_set.close()
    return seen, writes_rep, unchanged


@pytest.mark.parametrize("images", [False, True], ids=["pool", "images"])
def test_cached_items_on_two_ranks(run_ranks, tmp_path, images):
    results = run_ranks(2, rank_cached_items, str(tmp_path / "ck"), images, timeout_s=180)
    for rank, (seen, writes_rep, unchanged) in enumerate(results):
        # a layout reused as it was sends a marker; every save still loaded bit-exact (checked in the rank)
        assert len(unchanged) == len(_ITEM_STEPS) and not unchanged[0] and any(unchanged), (rank, unchanged)
        # the rank that does not write the replicated tensor only checks its shape: its items still hold
        want = [w if w != "rep" else ("plan" if writes_rep else "cached") for w in (s[1 + rank] for s in _ITEM_STEPS)]
        expected = [_STATS[w] for w in want]
        assert seen == expected, (rank, list(zip([s[0] for s in _ITEM_STEPS], seen, expected)))


class _Tagged(torch.Tensor):
    """A tensor subclass: no structure signature can be taken of a state holding one (DCP plans every such save)."""


def rank_unsigned_save_in_between(root: str) -> list[str]:
    """Rank 1 saves {a, b}, then {a, b2} with b2 a tensor subclass (its structure cannot be signed), then {a, b}
    again. The plan rank 1 cached at save 1 is not the global plan of save 2: save 3 must not reuse it while rank
    0 reuses save 2's (the .metadata would name b2 over b's files)."""
    import torch.distributed as dist

    import cpuckpt

    rank = dist.get_rank()
    planned = []
    t = torch.arange(12.0) + rank
    for step, name in enumerate(["b", "b2", "b"]):
        value = t.as_subclass(_Tagged) if name == "b2" and rank == 1 else t
        sd = {"a": torch.full((5,), float(step)), name: value} if rank == 1 else {"a": torch.full((5,), float(step))}
        h = cpuckpt.async_save(sd, f"{root}/s{step}", CFG, step=step)
        h.wait()
        planned.append(h.stats.planned)
        out = {"a": torch.zeros(5)}
        if rank == 1:
            out[name] = torch.zeros(12)
        cpuckpt.load(out, f"{root}/s{step}", CFG)
        assert torch.equal(out["a"], torch.full((5,), float(step))), (step, out)
        if rank == 1:
            assert torch.equal(out[name], t), (step, name)
    return planned


def test_a_save_that_cannot_be_signed_drops_the_cached_plan(run_ranks, tmp_path):
    results = run_ranks(2, rank_unsigned_save_in_between, str(tmp_path / "ck"), timeout_s=120)
    assert results[1] == ["dcp", "dcp", "dcp"], results
