"""The load fast path on 2 gloo ranks: every rank takes the same path, and fails alike.

One test, three loads of one checkpoint (kept to one rank launch for CI time):

1. both ranks can take the fast path: they do, bit-exact;
2. rank 1 passes a planner subclass (so only rank 0 could): both take DCP's path (one all-reduce
   agrees first; a rank alone on the fast path would leave the other waiting in DCP's collectives);
3. one rank's data file is damaged (each rank reads only its own here: its own key set): both ranks
   raise the same ``CheckpointCorrupt`` naming rank 1.
"""

from __future__ import annotations

SEED = 5


def rank_fast_path(root: str) -> dict:
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import cpuckpt

    rank = dist.get_rank()
    cfg = {"io": {"chunk_bytes": "64KiB"}}
    g = torch.Generator().manual_seed(SEED)
    sd = {"w": torch.randn(200, 30, generator=g), "b": torch.arange(40), "meta": {"step": 9, "name": "x"}}
    path = Path(root) / "c"
    cpuckpt.save(sd, path, cfg)

    def targets() -> dict:
        return {"w": torch.zeros(200, 30), "b": torch.zeros(40, dtype=torch.int64), "meta": {"step": 0, "name": ""}}

    seen = {}
    out = targets()
    reader = cpuckpt.StorageReader(path, cfg)
    cpuckpt.load(out, path, cfg, storage_reader=reader)
    seen["fast"] = reader.last_stats.fast_path
    seen["exact"] = torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["meta"] == sd["meta"]

    class Mine(DefaultLoadPlanner):
        pass

    out = targets()
    reader = cpuckpt.StorageReader(path, cfg)
    cpuckpt.load(out, path, cfg, storage_reader=reader, planner=Mine() if rank == 1 else None)
    seen["mixed_fast"] = reader.last_stats.fast_path
    seen["mixed_exact"] = torch.equal(out["w"], sd["w"]) and out["meta"] == sd["meta"]

    dist.barrier()
    if rank == 1:  # rank 1 damages its own view of the data: another copy of the checkpoint
        damaged = Path(root) / "d1"
        damaged.mkdir()
        for f in path.iterdir():
            data = bytearray(f.read_bytes())
            if f.suffix == ".distcp":
                data[len(data) // 2] ^= 0x10
            (damaged / f.name).write_bytes(bytes(data))
    dist.barrier()
    mine = Path(root) / "d1" if rank == 1 else path
    try:
        cpuckpt.load(targets(), mine, cfg)
        seen["error"] = None
    except cpuckpt.CpuckptError as e:
        seen["error"] = (type(e).__name__, str(e).replace(str(mine), "<path>"), e.rank)
    return seen


def test_ranks_agree_on_the_path_and_on_failures(run_ranks, tmp_path):
    results = run_ranks(2, rank_fast_path, str(tmp_path), timeout_s=120)
    for r in results:
        assert r["fast"] and r["exact"], r
        assert not r["mixed_fast"] and r["mixed_exact"], r
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0][0] == "CheckpointCorrupt" and errors[0][2] == 1, errors
    assert errors[0][0] == errors[1][0] and errors[0][2] == errors[1][2], errors
    assert "checksum mismatch" in errors[0][1], errors
