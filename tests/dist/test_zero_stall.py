"""Zero-stall saves (``async_save(ordering="stream")``) on 2 real gloo ranks: the CPU half of the contract.

The contract (``cpuckpt.async_save``'s docstring): with ``ordering="stream"`` the call returns once
every CPU tensor's bytes and every non-tensor value are in host memory, so the caller may change
them at once, without ``handle.staged.wait()``. What is proven, with real files and no mocks:

- every saved tensor (DTensor shards, plain tensors of several dtypes, a 0-d tensor) and the
  non-tensor values are overwritten in place right after the call returns; the committed
  checkpoint still holds the values of the save's step, bit-exact, through stock
  ``FileSystemReader`` and ``cpuckpt.load``. The same holds for the second save of the same
  structure (the reused plan) and for a save into memory-tier images (``ImageJob``);
- ``handle.wait_stream()`` without GPU sources does nothing and says so (``copies_on_device``);
- an unknown ``ordering`` is refused with a ``ConfigError`` naming the value.

The GPU half (kernels that write saved tensors after ``wait_stream``) is tests/gpu/test_zero_stall_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import _helpers as H
import pytest
import torch

CHUNK_BYTES = 64 * 1024
DTENSORS = [
    ("dt_big_f32", (600, 257), torch.float32, 0),  # ~5 chunks per rank
    ("dt_s1_bf16", (64, 1030), torch.bfloat16, 1),  # strided shards
    ("dt_rep_f16", (10, 11), torch.float16, None),
]
PLAIN = [
    ("plain_big_f32", (300, 301), torch.float32),
    ("plain_i64", (3,), torch.int64),
    ("plain_bool", (4, 3), torch.bool),
    ("running_mean", (64,), torch.float32),  # a buffer a forward would write
    ("zerodim_f64", (), torch.float64),
]
OBJECTS = {"step": 5, "meta": {"name": "run", "lr": 0.25}}


def _cfg() -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"},
            "staging": {"pool_bytes": 0},  # snapshot
            "async": {"max_in_flight": 1}, "timeout_s": 20}


def _placements(dim):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if dim is None else [Shard(dim)]


def _state_dict(mesh, seed: int, *, poisoned: bool = False) -> dict:
    sd: dict = {}
    for name, shape, dtype, dim in DTENSORS:
        sd[name] = H.make_dtensor(H.make_full(name, shape, dtype, seed), mesh, _placements(dim), poisoned=poisoned)
    for name, shape, dtype in PLAIN:
        full = H.make_full(name, shape, dtype, seed)
        sd[name] = H.poison(full) if poisoned else full.clone()
    sd["step"] = -99 if poisoned else OBJECTS["step"]
    sd["meta"] = {"name": "destination", "lr": -1.0} if poisoned else dict(OBJECTS["meta"])
    return sd


def _mutate(sd: dict) -> None:
    """Overwrite every byte of every saved tensor in place, and the non-tensor values (in place too)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                loc = v._local_tensor if isinstance(v, DTensor) else v
                loc.copy_(H.poison(loc))
    sd["step"] = -1
    sd["meta"]["name"] = "mutated"


def _check(sd: dict, mesh, seed: int, what: str) -> None:
    for name, shape, dtype, dim in DTENSORS:
        H.assert_dtensor(sd[name], H.make_full(name, shape, dtype, seed), mesh, _placements(dim), f"{what}: {name}")
    for name, shape, dtype in PLAIN:
        H.assert_bitexact(sd[name], H.make_full(name, shape, dtype, seed), f"{what}: {name}")
    assert sd["step"] == OBJECTS["step"] and sd["meta"] == OBJECTS["meta"], (what, sd["step"], sd["meta"])


def _load_both(path: Path, mesh, seed: int, what: str) -> None:
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    dest = _state_dict(mesh, seed, poisoned=True)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    _check(dest, mesh, seed, f"{what}, stock FileSystemReader")
    dest = _state_dict(mesh, seed, poisoned=True)
    cpuckpt.load(dest, path)
    _check(dest, mesh, seed, f"{what}, cpuckpt.load")


def rank_mutate_right_after_return(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt
    from cpuckpt.tier.images import ImageSet

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict = {"planned": [], "copies_on_device": []}
    first: dict = {}
    images = ImageSet(Path(root) / "ram", pin=False)  # both ranks' images in one slot directory
    # 1: DCP plans; 2: same structure and storages (the reused plan); 3: memory-tier images.
    for seed, name, imgs in ((1, "first", None), (2, "second", None), (3, "images", images)):
        sd = _state_dict(mesh, seed)
        if seed == 2:  # same storages as save 1, new values
            sd = first
            for name_, shape, dtype, dim in DTENSORS:
                sd[name_]._local_tensor.copy_(H.local_slice(H.make_full(name_, shape, dtype, 2), mesh,
                                                            _placements(dim)))
            for name_, shape, dtype in PLAIN:
                sd[name_].copy_(H.make_full(name_, shape, dtype, 2))
            sd["step"], sd["meta"] = OBJECTS["step"], dict(OBJECTS["meta"])
        path = Path(root) / name
        h = cpuckpt.async_save(sd, path if imgs is None else Path(root) / "ram", _cfg(), step=seed,
                               ordering="stream", sink=imgs)
        _mutate(sd)  # no staged.wait(): the contract says CPU bytes are already in host memory
        h.wait_stream()  # no GPU sources: nothing to order
        h.wait()
        out["planned"].append(h.stats.planned)
        out["copies_on_device"].append(h.copies_on_device)
        dist.barrier()
        _load_both(path if imgs is None else Path(root) / "ram", mesh, seed, f"ordering=stream save {name}")
        dist.barrier()
        if seed == 1:
            first = sd
    return out


@pytest.mark.timeout(90)
def test_cpu_tensors_mutated_right_after_return_are_not_saved(run_ranks, tmp_path):
    results = run_ranks(2, rank_mutate_right_after_return, str(tmp_path / "ckpts"), timeout_s=60)
    for rank, out in enumerate(results):
        assert out["copies_on_device"] == [False, False, False], (rank, out)
        assert out["planned"][1] == "reused", (rank, out)  # the second save skipped DCP's planning


def test_unknown_ordering_is_refused(tmp_path):
    import cpuckpt
    from cpuckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="ordering must be one of host, stream, got 'gpu'"):
        cpuckpt.async_save({"t": torch.zeros(3)}, tmp_path / "c", ordering="gpu")
    assert not (tmp_path / "c").exists()
