"""2-rank saves with cpuckpt, loaded by *stock* torch.distributed.checkpoint.FileSystemReader, bit-exact.

Real gloo process groups (tests/conftest.py), real files in tmp_path, no mocks. The state dict mixes
DTensors over a 1-D CPU mesh (Shard(0), Shard(1), Replicate; uneven shards), a ShardedTensor,
replicated plain tensors of every dtype cpuckpt claims (float8 included), 0-dim and empty tensors,
non-contiguous views, and non-tensor items. Chunks are 64 KiB and several tensors span many chunks,
so the chunk split across writer threads (and the >=1 MiB data alignment) is exercised. Both
``io.backend: buffered`` and ``auto`` (O_DIRECT where the filesystem of tmp_path accepts it) run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import _helpers as H
import pytest
import torch

CHUNK = "64KiB"
CHUNK_BYTES = 64 * 1024

# (name, shape, dtype, placements-spec) for DTensors; placements-spec is "s0", "s1" or "r".
DTENSORS = [
    ("dt_s0_f32", (300, 257), torch.float32, "s0"),  # 308 KB: several chunks per rank
    ("dt_s1_bf16", (64, 1030), torch.bfloat16, "s1"),  # 132 KB; each shard is strided in the full tensor
    ("dt_s1_f32_uneven", (40, 33), torch.float32, "s1"),  # 17 + 16 columns
    ("dt_r_f16", (40, 50), torch.float16, "r"),
    ("dt_s0_f8e4m3", (129, 33), torch.float8_e4m3fn, "s0"),  # 65 + 64 rows
    ("dt_s1_f8e5m2", (10, 9), torch.float8_e5m2, "s1"),
    ("dt_s1_i64", (7, 11), torch.int64, "s1"),
    ("dt_s0_bool", (9, 5), torch.bool, "s0"),
    ("dt_s0_f64_3d", (6, 5, 4), torch.float64, "s0"),
    ("dt_s0_empty_shard", (1, 6), torch.float32, "s0"),  # rank 1's shard has 0 rows
]
SHARDED = ("st_f64", (100, 70), torch.float64)
PLAIN = [(f"plain_{str(dt).split('.')[-1]}", (17, 23), dt) for dt in H.ALL_DTYPES] + [
    ("plain_big_f32", (513, 520), torch.float32),  # 1.07 MB: data aligned, 17 chunks
    ("plain_odd_bf16", (3, 7, 11), torch.bfloat16),
]
SCALARS = [(f"zerodim_{str(dt).split('.')[-1]}", (), dt) for dt in (torch.float32, torch.int64, torch.bfloat16,
                                                                        torch.bool, torch.float8_e5m2)]
EMPTIES = [("empty_f32", (0, 5), torch.float32), ("empty_i32", (0,), torch.int32), ("empty_bf16", (4, 0, 3),
                                                                                      torch.bfloat16)]


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"s0": [Shard(0)], "s1": [Shard(1)], "r": [Replicate()]}[spec]


def _views() -> dict[str, torch.Tensor]:
    """Non-contiguous views (the saved value is the logical tensor)."""
    base = H.make_full("view_base", (50, 64), torch.float32)
    base16 = H.make_full("view_base16", (40, 60), torch.float16)
    out = {
        "view_transposed": base16.t(),
        "view_sliced": base[::2, 3:40],
        "view_column": base[:, 5],
        "view_permuted_3d": H.make_full("view_base3", (4, 6, 8), torch.int32).permute(2, 0, 1),
        "view_expanded": H.make_full("view_base_row", (1, 9), torch.int64).expand(5, 9),  # stride 0
    }
    for k, v in out.items():
        assert not v.is_contiguous(), k
    # contiguous, but not at the start of its storage
    out["view_rows_offset"] = base[10:20]
    assert out["view_rows_offset"].is_contiguous() and out["view_rows_offset"].storage_offset() == 640
    return out


def _objects() -> dict:
    return {
        "step": 1234567,
        "name": "run-\u03b1/\u2603",
        "lr_list": [1, "two", 3.5, [4, {"five": 5}]],
        "nested": {"a": {"b": 1, "c": "x", "d": [True, None]}, "e": 2.5},
    }


def build_state_dict(rank: int, world: int, mesh, *, poisoned: bool = False, full_dest: bool = False) -> dict:
    """The state dict every rank saves (or a destination to load it into).

    ``poisoned``: every tensor byte differs from the expected byte (so a byte that is not loaded fails).
    ``full_dest``: DTensor and ShardedTensor entries become plain full-size tensors (stock DCP reads
    every saved shard into them).
    """
    sd: dict = {}
    for name, shape, dtype, spec in DTENSORS:
        full = H.make_full(name, shape, dtype)
        if full_dest:
            sd[name] = H.poison(full) if poisoned else full.clone()
        else:
            sd[name] = H.make_dtensor(full, mesh, _placements(spec), poisoned=poisoned)
    name, shape, dtype = SHARDED
    full = H.make_full(name, shape, dtype)
    if full_dest:
        sd[name] = H.poison(full) if poisoned else full.clone()
    else:
        sd[name] = H.make_sharded_tensor(full, rank, world, poisoned=poisoned)
    for name, shape, dtype in PLAIN + SCALARS + EMPTIES:
        full = H.make_full(name, shape, dtype)
        sd[name] = H.poison(full) if poisoned else full
    for name, view in _views().items():
        sd[name] = H.poison(view) if poisoned else view
    param = H.make_full("parameter", (8, 3), torch.float32)
    sd["parameter"] = torch.nn.Parameter(H.poison(param) if poisoned else param.clone())
    nested_t = H.make_full("nested_tensor", (33, 3), torch.int32)
    objs = _objects()
    if poisoned:
        # same structure (DCP flattens nested containers into keys), other values
        objs = {"step": -1, "name": "", "lr_list": [0, "", 0.0, [0, {"five": 0}]],
                "nested": {"a": {"b": 0, "c": "", "d": [False, 0]}, "e": 0.0}}
    sd.update(objs)
    sd["nested"]["t"] = H.poison(nested_t) if poisoned else nested_t
    return sd


def check_state_dict(sd: dict, rank: int, world: int, mesh, *, full_dest: bool, what: str) -> int:
    """Assert every entry of a loaded ``sd`` is bit-exact; returns the number of tensors checked."""
    n = 0
    for name, shape, dtype, spec in DTENSORS:
        full = H.make_full(name, shape, dtype)
        if full_dest:
            H.assert_bitexact(sd[name], full, f"{what}: {name}")
        else:
            H.assert_dtensor(sd[name], full, mesh, _placements(spec), f"{what}: {name}")
        n += 1
    name, shape, dtype = SHARDED
    full = H.make_full(name, shape, dtype)
    if full_dest:
        H.assert_bitexact(sd[name], full, f"{what}: {name}")
    else:
        H.assert_sharded_tensor(sd[name], full, rank, world, f"{what}: {name}")
    n += 1
    for name, shape, dtype in PLAIN + SCALARS + EMPTIES:
        H.assert_bitexact(sd[name], H.make_full(name, shape, dtype), f"{what}: {name}")
        n += 1
    for name, view in _views().items():
        H.assert_bitexact(sd[name], view, f"{what}: {name}")
        n += 1
    H.assert_bitexact(sd["nested"]["t"], H.make_full("nested_tensor", (33, 3), torch.int32), f"{what}: nested.t")
    H.assert_bitexact(sd["parameter"].detach(), H.make_full("parameter", (8, 3), torch.float32), f"{what}: parameter")
    assert isinstance(sd["parameter"], torch.nn.Parameter), f"{what}: parameter was replaced"
    n += 2
    got = {k: sd[k] for k in ("step", "name", "lr_list")}
    got["nested"] = {k: v for k, v in sd["nested"].items() if k != "t"}
    assert got == _objects(), f"{what}: non-tensor items differ: {got!r}"
    return n


def rank_save_then_stock_load(root: str, backend: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt
    from cpuckpt.transfer.files import get_backend

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    root_p = Path(root)
    cfg = {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": backend}}
    cfg_three_threads = {"io": {"chunk_bytes": CHUNK, "threads": 3, "backend": backend}}

    sd = build_state_dict(rank, world, mesh)
    via_api, via_dcp = root_p / "via_api", root_p / "via_dcp"
    cpuckpt.save(sd, via_api, cfg, step=11)
    with H.files_per_rank(2):  # as written before io.files_per_rank was removed
        dcp.save(sd, storage_writer=cpuckpt.StorageWriter(via_dcp, cfg_three_threads, step=12))
    dist.barrier()
    # Saving neither changed nor consumed the sources.
    check_state_dict(sd, rank, world, mesh, full_dest=False, what="source after save")

    checked = 0
    for ckpt in (via_api, via_dcp):
        # 1. stock reader, same sharding as saved
        dest = build_state_dict(rank, world, mesh, poisoned=True)
        dcp.load(dest, storage_reader=dcp.FileSystemReader(ckpt))
        checked += check_state_dict(dest, rank, world, mesh, full_dest=False, what=f"stock load of {ckpt.name}")
        # 2. stock reader, every sharded entry into a full plain tensor (reads every rank's shards)
        dest = build_state_dict(rank, world, mesh, poisoned=True, full_dest=True)
        dcp.load(dest, storage_reader=dcp.FileSystemReader(ckpt))
        checked += check_state_dict(dest, rank, world, mesh, full_dest=True, what=f"stock full load of {ckpt.name}")
        # 3. cpuckpt's own reader (checksums verified) on the same checkpoint
        dest = build_state_dict(rank, world, mesh, poisoned=True)
        cpuckpt.load(dest, ckpt, cfg)
        checked += check_state_dict(dest, rank, world, mesh, full_dest=False, what=f"cpuckpt load of {ckpt.name}")
    dist.barrier()
    return {"checked": checked, "backend": get_backend(backend, root_p).name}


@pytest.mark.parametrize("backend", ["buffered", "auto"])
def test_two_rank_save_loads_bit_exact_with_stock_reader(run_ranks, tmp_path, backend):
    root = tmp_path / "ckpt"
    results = run_ranks(2, rank_save_then_stock_load, str(root), backend, timeout_s=120)
    assert all(r["checked"] > 50 for r in results), results
    if backend == "auto":
        from cpuckpt.transfer.files import _direct_supported

        # auto resolves per filesystem; on this machine's disk that is O_DIRECT (tmpfs would say buffered).
        expected = "direct" if _direct_supported(tmp_path, 4096) else "buffered"
        assert {r["backend"] for r in results} == {expected}, results

    via_api, via_dcp = root / "via_api", root / "via_dcp"
    H.assert_committed_layout(via_api, world=2)
    H.assert_committed_layout(via_dcp, world=2, files_per_rank=2)
    manifest = json.loads((via_api / ".cpuckpt.json").read_text())
    assert manifest["step"] == 11 and manifest["world_size"] == 2
    assert json.loads((via_dcp / ".cpuckpt.json").read_text())["step"] == 12
    for name, entry in manifest["files"].items():
        assert entry["chunk_bytes"] == CHUNK_BYTES
        assert (via_api / name).stat().st_size == entry["nbytes"]
        # The data was cut into many chunks, each with its checksum: the multi-thread split ran.
        assert len(entry["chunk_checksums"]) == math.ceil(entry["nbytes"] / CHUNK_BYTES) >= 4, (name, entry)
    # The >= 1 MiB tensor's data starts on a 4096-byte boundary (layout.align_data_min_bytes), and the
    # record the stock reader found there is the one cpuckpt planned.
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(via_api).read_metadata()
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "plain_big_f32"]
    data_rel = dict(map(tuple, manifest["files"][info.relative_path]["records"]))[info.offset]
    assert (info.offset + data_rel) % 4096 == 0 and info.length - data_rel >= 513 * 520 * 4, (info, data_rel)


def test_single_process_records_are_torch_load_compatible(tmp_path):
    """Each tensor record, cut out of a data file at the offsets in ``.metadata``, is a torch.save file.

    Runs without a process group (DCP's single-process mode), through cpuckpt.save.
    """
    import io

    import torch.distributed.checkpoint as dcp

    import cpuckpt

    sd = {name: H.make_full(name, shape, dtype) for name, shape, dtype in PLAIN + SCALARS + EMPTIES}
    sd.update(_views())
    ckpt = tmp_path / "single"
    cpuckpt.save(sd, ckpt, {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}})
    md = dcp.FileSystemReader(ckpt).read_metadata()
    for index, info in md.storage_data.items():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        t = torch.load(io.BytesIO(record), weights_only=True)
        expected = sd[index.fqn]
        H.assert_bitexact(t, expected.contiguous(), f"record of {index.fqn}")


def rank_save_with_idle_rank(root: str) -> list[str]:
    """3 ranks, only replicated items: DCP gives each to one rank, so some rank writes nothing."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    ckpt = Path(root) / "idle"
    full = H.make_full("only", (16, 4), torch.float16)
    cpuckpt.save({"only": full, "tag": "x"}, ckpt, {"io": {"chunk_bytes": CHUNK, "threads": 2}})
    for reader in (dcp.FileSystemReader(ckpt), cpuckpt.StorageReader(ckpt)):
        dest = {"only": H.poison(full), "tag": ""}
        dcp.load(dest, storage_reader=reader)
        H.assert_bitexact(dest["only"], full, f"{type(reader).__name__} load")
        assert dest["tag"] == "x"
    dist.barrier()
    return H.checkpoint_listing(ckpt)


def test_three_rank_save_where_a_rank_writes_nothing(run_ranks, tmp_path):
    listings = run_ranks(3, rank_save_with_idle_rank, str(tmp_path), timeout_s=120)
    H.assert_committed_layout(tmp_path / "idle", world=3)
    sizes = sorted((tmp_path / "idle" / f"__{r}_0.distcp").stat().st_size for r in range(3))
    assert sizes[0] == 0 and sizes[-1] > 0, sizes  # the idle rank's file is empty, the others are not
    assert all(listing == listings[0] for listing in listings)


def rank_save_to_its_own_path(root: str) -> str:
    import torch.distributed as dist

    import cpuckpt

    try:
        cpuckpt.save({"w": torch.ones(4)}, f"{root}/rank{dist.get_rank()}")
    except cpuckpt.CpuckptError as e:
        return str(e)
    return "saved"


def test_ranks_saving_to_different_paths_are_told_so_on_every_rank(run_ranks, tmp_path: Path) -> None:
    """A rank given another directory (or node-local disks) wrote its part elsewhere: every rank's error says what
    to fix instead of "manifest part of a rank is missing or unreadable", which reads as corruption."""
    for message in run_ranks(2, rank_save_to_its_own_path, str(tmp_path), timeout_s=120):
        assert "every rank must save to this same directory" in message, message
