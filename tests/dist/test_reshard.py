"""Resharding: checkpoints saved by 2 (and 3) ranks, loaded through ``cpuckpt.StorageReader`` by 1, 2, 3 ranks.

Every DTensor changes sharding between save and load (Shard(0)->Shard(1) makes the rectangle read
out of each saved chunk non-contiguous; Shard(1)->Shard(0) makes the destination rectangle
non-contiguous; Replicate<->Shard; uneven splits over 3 ranks; a 3-D tensor resharded on its last
dim), plus loads into plain full tensors and into a non-contiguous plain destination. Each load runs
with ``integrity.verify: always`` (chunked, checksummed reads) and ``off`` (ranges read straight
into the destination), on both file backends. The expected values are recomputed from a seed in
every process and compared byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import _helpers as H
import pytest
import torch

SEED = 20240917
CFG_SAVE = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}}

# name -> (shape, dtype, placement when saved by 2 ranks)
TENSORS = {
    "s0_f32": ((37, 29), torch.float32, "s0"),
    "s1_f32": ((37, 29), torch.float32, "s1"),
    "s1_bf16_wide": ((40, 1100), torch.bfloat16, "s1"),  # 88 KB: spans 64 KiB chunks
    "s0_f32_big": ((300, 300), torch.float32, "s0"),  # 360 KB: many chunks per rank
    "s0_f8": ((31, 17), torch.float8_e4m3fn, "s0"),
    "s1_f8e5": ((6, 19), torch.float8_e5m2, "s1"),
    "s1_bool": ((13, 9), torch.bool, "s1"),
    "s0_i64": ((11, 7), torch.int64, "s0"),
    "s1_i32": ((5, 23), torch.int32, "s1"),
    "r_f16": ((9, 10), torch.float16, "r"),
    "s1_f64_3d": ((5, 8, 6), torch.float64, "s1"),
    "plain_f32": ((21, 13), torch.float32, "plain"),
    "s0_tiny_bf16": ((2, 5), torch.bfloat16, "s0"),  # over 3 ranks one shard is empty
}

# How each world size loads each tensor: s0/s1/s2 (DTensor Shard(d)), r (Replicate), plain (full plain
# tensor), plain_nc (full plain tensor that is a transposed, non-contiguous view).
LOAD = {
    1: {"s0_f32": "plain_nc", "s1_f32": "s0", "s1_bf16_wide": "plain", "s0_f32_big": "s1", "s0_f8": "plain",
        "s1_f8e5": "r", "s1_bool": "plain_nc", "s0_i64": "s1", "s1_i32": "plain", "r_f16": "s0",
        "s1_f64_3d": "s2", "plain_f32": "s1", "s0_tiny_bf16": "plain"},
    2: {"s0_f32": "s1", "s1_f32": "s0", "s1_bf16_wide": "s0", "s0_f32_big": "s1", "s0_f8": "s1",
        "s1_f8e5": "s0", "s1_bool": "s0", "s0_i64": "r", "s1_i32": "plain_nc", "r_f16": "s1",
        "s1_f64_3d": "s2", "plain_f32": "s0", "s0_tiny_bf16": "s1"},
    3: {"s0_f32": "s1", "s1_f32": "s0", "s1_bf16_wide": "s0", "s0_f32_big": "s1", "s0_f8": "s1",
        "s1_f8e5": "s0", "s1_bool": "s0", "s0_i64": "s0", "s1_i32": "s1", "r_f16": "s0",
        "s1_f64_3d": "s2", "plain_f32": "plain_nc", "s0_tiny_bf16": "s0"},
}

# (integrity.verify, io.backend) of the two loads each world size does.
READ_CONFIGS = {
    1: [("always", "auto"), ("off", "buffered")],
    2: [("always", "buffered"), ("off", "auto")],
    3: [("always", "buffered"), ("off", "auto")],
}


def _full(name: str) -> torch.Tensor:
    shape, dtype, _ = TENSORS[name]
    return H.make_full(name, shape, dtype, seed=SEED)


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if spec == "r" else [Shard(int(spec[1]))]


def _entry(name: str, spec: str, mesh, *, poisoned: bool):
    full = _full(name)
    if spec == "plain":
        return H.poison(full) if poisoned else full.clone()
    if spec == "plain_nc":
        t = full.transpose(0, -1).contiguous()
        t = (H.poison(t) if poisoned else t).transpose(0, -1)
        assert not t.is_contiguous()
        return t
    return H.make_dtensor(full, mesh, _placements(spec), poisoned=poisoned)


def _check(sd: dict, specs: dict, mesh, what: str) -> None:
    for name, spec in specs.items():
        full = _full(name)
        if spec.startswith("plain"):
            H.assert_bitexact(sd[name], full, f"{what}: {name} -> {spec}")
        else:
            H.assert_dtensor(sd[name], full, mesh, _placements(spec), f"{what}: {name} -> {spec}")


def rank_save(path: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {name: _entry(name, spec, mesh, poisoned=False) for name, (_, _, spec) in TENSORS.items()}
    sd["meta"] = {"saved_by": dist.get_world_size()}
    cpuckpt.save(sd, path, CFG_SAVE, step=7)
    return dist.get_rank()


def rank_load(path: str, saved_by: int) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    specs = LOAD[world]
    done = []
    for verify, backend in READ_CONFIGS[world]:
        cfg = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": backend}, "integrity": {"verify": verify}}
        what = f"saved by {saved_by}, loaded by {world}, verify={verify}, backend={backend}"
        sd = {name: _entry(name, spec, mesh, poisoned=True) for name, spec in specs.items()}
        sd["meta"] = {"saved_by": 0}
        dcp.load(sd, storage_reader=cpuckpt.StorageReader(path, cfg))
        _check(sd, specs, mesh, what)
        assert sd["meta"] == {"saved_by": saved_by}, what
        done.append(what)
        # the same through cpuckpt.load, with the two leading shardings swapped (s0 <-> s1)
        swapped = dict(specs)
        swapped["s0_f32"], swapped["s1_f32"] = specs["s1_f32"], specs["s0_f32"]
        sd = {name: _entry(name, spec, mesh, poisoned=True) for name, spec in swapped.items()}
        cpuckpt.load(sd, path, cfg)
        _check(sd, swapped, mesh, what + " (cpuckpt.load, swapped)")
        done.append(what + " swapped")
    dist.barrier()
    return done


@pytest.fixture(scope="module")
def saved(rank_runner, tmp_path_factory):
    """``saved(world)``: the path of the checkpoint saved by ``world`` ranks (saved once per module)."""
    cache: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in cache:
            root = tmp_path_factory.mktemp(f"saved_by_{world}")
            ckpt = root / "ckpt"
            rank_runner(world, rank_save, str(ckpt), tmp_path=root, timeout_s=120)
            H.assert_committed_layout(ckpt, world=world)
            cache[world] = ckpt
        return cache[world]

    return get


@pytest.mark.parametrize(("saved_by", "world"), [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2)])
def test_load_resharded_bit_exact(run_ranks, saved, saved_by, world):
    results = run_ranks(world, rank_load, str(saved(saved_by)), saved_by, timeout_s=120)
    assert len(results) == world and all(len(r) == 2 * len(READ_CONFIGS[world]) for r in results), results


def test_reshard_tables_really_change_sharding():
    """Guard the test's own premise: every tensor is loaded with a sharding other than its saved one."""
    for world, specs in LOAD.items():
        assert set(specs) == set(TENSORS)
        for name, spec in specs.items():
            saved = TENSORS[name][2]
            assert world != 2 or spec != saved, (world, name)
    assert LOAD[2]["s1_f32"] == "s0" and LOAD[3]["s1_f32"] == "s0"  # Shard(1) -> Shard(0)
    assert LOAD[2]["s0_f32"] == "s1" and LOAD[3]["s0_f32"] == "s1"  # Shard(0) -> Shard(1)
