"""``async_save`` reuses the previous save's DCP plan when every rank's structure is unchanged.

Three saves of the same structure (DTensor shards, a replicated tensor DCP deduplicates, a non-tensor
value whose pickle grows every step, so the layout must still be recomputed): the first is planned
by DCP, the next two reuse the plan. Every checkpoint loads bit-exact with stock DCP. When one rank's
structure changes (a new key on that rank only), every rank falls back to DCP planning, and the save
after that reuses the new plan.
"""

from __future__ import annotations

from pathlib import Path

import torch


import _helpers as H  # noqa: E402 - tests/dist is on sys.path (conftest and the rank bootstrap)
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
