"""Multi-rank GPU benchmark: one rank per GPU of one host, all variants in one run.

Launch on the device machine, from the repository root, with
``torchrun --nproc_per_node N -m benchmarks.bench_gpu_ranks --gib 4``.
Training collectives would use NCCL; cpuckpt's checkpoint collectives use its own gloo groups.
Each rank holds ``--gib`` of GPU tensors. Measured per rank and in aggregate, in the same run:
the storage floor (every rank pwrites its bytes with O_DIRECT at once), DCP FileSystemWriter (sync),
DCP async_save with a pinned DefaultStager (one repetition), cpuckpt sync save, cpuckpt async
snapshot (pool prepared at start-up), cold loads into GPU tensors. Rank 0 prints a table; raw JSON
goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import cpuckpt
from benchmarks.bench_gpu import dcp_async_default_stager
from benchmarks.common import (
    GB,
    GiB,
    build_state_dict,
    clone_empty,
    drop_caches,
    format_table,
    named_tensors,
    pwrite_floor,
    same_state_dict,
    state_dict_nbytes,
)

logger = logging.getLogger("bench_gpu_ranks")


def barrier() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def timed(fn: Any) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def bitexact(out: Any, sd: Any) -> bool:
    return same_state_dict(out, sd) is None


def fresh(path: Path) -> Path:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/root/cpuckpt-bench-ranks")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.WARNING)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Each rank owns distinct tensors (as with tensor/pipeline parallel shards): no DCP dedup.
    sd = {f"rank{rank}": build_state_dict(int(args.gib * GiB), device="cuda", seed=rank)}
    nbytes = state_dict_nbytes(sd)
    total = nbytes * world
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}

    # floor: every rank writes its bytes at once with O_DIRECT (best of two thread counts)
    best = 0.0
    for threads in (4, 16):
        f = root / f"floor_{rank}.bin"
        barrier()
        t0 = time.perf_counter()
        pwrite_floor(f, nbytes, threads, True)
        barrier()
        best = max(best, total / (time.perf_counter() - t0) / GB)
        f.unlink(missing_ok=True)
    rows["floor_write_GBps"] = best

    ck = root / "ck"
    cfg = {"io": {"threads": 8}, "staging": {"pool_bytes": 0}}  # snapshot
    s = timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(fresh(ck)), thread_count=8)))
    rows["dcp_fs_sync"] = {"s": s, "GBps": total / s / GB}
    try:
        stall, persist = dcp_async_default_stager(sd, fresh(ck))
        rows["dcp_async_pinned"] = {"stall": gather(stall), "persist_s": max(gather(persist))}
    except Exception as e:  # torch 2.11 raised KeyError on a second save in one process
        rows["dcp_async_pinned"] = {"error": repr(e)}
    s = timed(lambda: cpuckpt.save(sd, fresh(ck), {"io": {"threads": 4}}))
    rows["cpuckpt_sync"] = {"s": s, "GBps": total / s / GB}

    t0 = time.perf_counter()
    cpuckpt.prepare_pool(nbytes, cfg)
    rows["prepare_pool_s"] = gather(time.perf_counter() - t0)
    snaps = []
    for rep in range(args.reps + 1):
        path = fresh(ck)
        barrier()
        t0 = time.perf_counter()
        h = cpuckpt.async_save(sd, path, cfg)
        h.staged.wait()
        torch.cuda.synchronize()
        stall = time.perf_counter() - t0
        h.wait()
        persist = time.perf_counter() - t0
        snaps.append({"rep": rep, "stall": gather(stall), "persist_s": max(gather(persist))})
    rows["cpuckpt_async_snapshot"] = snaps

    out = clone_empty(sd)
    drop_caches()
    s = timed(lambda: cpuckpt.load(out, ck))
    rows["cpuckpt_load_gpu"] = {"s": s, "GBps": total / s / GB, "bitexact": all(gather(bitexact(out, sd)))}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(fresh(ck)), thread_count=8))
    out = clone_empty(sd)
    drop_caches()
    s = timed(lambda: dcp.load(out, storage_reader=dcp.FileSystemReader(str(ck))))
    rows["dcp_fs_load_gpu"] = {"s": s, "GBps": total / s / GB, "bitexact": all(gather(bitexact(out, sd)))}
    fresh(ck)

    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"world": world, "GiB_per_rank": nbytes / GiB, "tensors_per_rank": len(named_tensors(sd)),
                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        (Path(args.out) / "bench_gpu_ranks.json").write_text(json.dumps({**meta, **rows}, indent=1, default=str))
        print(table(meta, rows, total))
    dist.destroy_process_group()


def table(meta: dict[str, Any], rows: dict[str, Any], total: int) -> str:
    fw = rows["floor_write_GBps"]
    out: list[Any] = [["floor: all ranks O_DIRECT pwrite at once", "-", f"{total / fw / GB:.2f}", f"{fw:.2f}", "1.00"]]
    r = rows["dcp_fs_sync"]
    out.append(["DCP FileSystemWriter tc=8 (sync)", f"{r['s']:.2f}", f"{r['s']:.2f}", f"{r['GBps']:.2f}",
                f"{r['GBps'] / fw:.2f}"])
    r = rows["dcp_async_pinned"]
    if "error" in r:
        out.append(["DCP async_save + DefaultStager(pinned)", "error", "-", r["error"][:30], "-"])
    else:
        out.append(["DCP async_save + DefaultStager(pinned)", "/".join(f"{x:.3f}" for x in r["stall"]),
                    f"{r['persist_s']:.2f}", f"{total / r['persist_s'] / GB:.2f}",
                    f"{total / r['persist_s'] / GB / fw:.2f}"])
    r = rows["cpuckpt_sync"]
    out.append(["cpuckpt save (sync)", f"{r['s']:.2f}", f"{r['s']:.2f}", f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
    for s in rows["cpuckpt_async_snapshot"]:
        gb = total / s["persist_s"] / GB
        label = "first (pool prepared)" if s["rep"] == 0 else f"warm rep{s['rep']}"
        out.append([f"cpuckpt async snapshot, {label}", "/".join(f"{x:.3f}" for x in s["stall"]),
                    f"{s['persist_s']:.2f}", f"{gb:.2f}", f"{gb / fw:.2f}"])
    for key, label in (("cpuckpt_load_gpu", "cpuckpt cold load -> GPU"), ("dcp_fs_load_gpu", "DCP cold load -> GPU")):
        r = rows[key]
        out.append([f"{label} (bitexact={r['bitexact']})", "-", f"{r['s']:.2f}", f"{r['GBps']:.2f}", "-"])
    return format_table(["variant", "stall s (per rank)", "persist s", "aggregate GB/s", "x floor"], out,
                        right=[False, True, True, True, True],
                        title=f"{meta['world']} ranks x {meta['GiB_per_rank']:.2f} GiB ({meta['tensors_per_rank']} "
                              f"tensors/rank) on {meta['gpu']}, torch {meta['torch']}")


if __name__ == "__main__":
    main()
