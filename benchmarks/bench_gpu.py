"""GPU benchmark of cpuckpt against its floors and peers, all in one run (see shared BENCHMARKING.md).

Run on the device machine (one H200), from the repository root:  ``python -m benchmarks.bench_gpu --gib 4 --out $OUT``.
Measures, on the same GPU state dict and in the same process:

* floors: pinned D2H and H2D of the same tensors; raw O_DIRECT / buffered pwrite and pread of the
  same number of bytes (best of several thread counts);
* peers: DCP FileSystemWriter (thread_count 1 and 8), DCP ``async_save`` with
  ``DefaultStager(StagingOptions(True, True, True, True))`` (one repetition: a second one raised
  KeyError on torch 2.11), ``torch.save``;
* cpuckpt: sync save, ``async_save`` snapshot (pool prepared at start-up; first and warm saves),
  ``async_save`` streaming (pool smaller than the shard; peak extra RSS), the ``dcp.async_save``
  door; cold loads into GPU tensors (cpuckpt verify on/off, DCP FileSystemReader);
* a training-like loop (bf16 matmuls): iteration time alone and while a save persists.

Stall = wall time the training thread is blocked (GPU synchronised before and after).
Persist = from the call to durable commit. Prints one table last; raw JSON goes to ``--out``.
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
import torch.distributed.checkpoint as dcp

import cpuckpt
from benchmarks.common import (
    GB,
    GiB,
    ResultLog,
    RssSampler,
    build_state_dict,
    clone_empty,
    copy_floors,
    device_sync,
    drop_caches,
    format_table,
    fresh,
    fsync_dir,
    matmul_loop,
    named_tensors,
    pread_floor,
    pwrite_floor,
    release_memory,
    same_state_dict,
    state_dict_nbytes,
    summarize,
)
from cpuckpt.transfer.staging import release_pool

logger = logging.getLogger("bench_gpu")
RESULTS = ResultLog(logger)
record = RESULTS.record


# ------------------------------------------------------------------------------------------ floors
def floor_copies(sd: dict[str, Any], reps: int) -> None:
    nbytes, floors = copy_floors(sd, reps)
    for direction, s in floors.items():
        record(f"floor_{direction}_pinned", s=s, GBps=nbytes / s["median"] / GB)


def floor_storage(target: Path, nbytes: int) -> tuple[float, float]:
    best_w = best_r = 0.0
    for direct in (True, False):
        for threads in (1, 4, 8, 16):
            f = target / "floor.bin"
            w = pwrite_floor(f, nbytes, threads, direct)
            record("floor_pwrite", direct=direct, threads=threads, GBps=w.gbps, error=w.error)
            if direct and w.supported:
                best_w = max(best_w, w.gbps)
            if not direct:
                best_w = max(best_w, w.gbps)
            drop_caches()
            r = pread_floor(f, nbytes, threads, direct)
            record("floor_pread", direct=direct, threads=threads, GBps=r.gbps, cold=True, error=r.error)
            best_r = max(best_r, r.gbps if r.supported else 0.0)
            f.unlink(missing_ok=True)
    return best_w, best_r


# ------------------------------------------------------------------------------------------- peers
def dcp_fs_save(sd: dict[str, Any], path: Path, threads: int) -> float:
    device_sync()
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads))
    fsync_dir(path)
    return time.perf_counter() - t0


def dcp_async_default_stager(sd: dict[str, Any], path: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(True, True, True, True))
    device_sync()
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(path)), async_stager=stager)
    if hasattr(resp, "staging_completion"):
        resp.staging_completion.result()
        stall = time.perf_counter() - t0
        resp.upload_completion.result()
    else:
        stall = time.perf_counter() - t0
        resp.result()
    fsync_dir(path)
    total = time.perf_counter() - t0
    stager.close()
    return stall, total


def torch_save(sd: dict[str, Any], path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    device_sync()
    t0 = time.perf_counter()
    with open(path / "model.pt", "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- cpuckpt
def ck_async(sd: dict[str, Any], path: Path, cfg: dict[str, Any]) -> tuple[float, float, Any]:
    device_sync()
    t0 = time.perf_counter()
    h = cpuckpt.async_save(sd, path, cfg)
    h.staged.wait()
    device_sync()
    stall = time.perf_counter() - t0
    h.wait()
    return stall, time.perf_counter() - t0, h.stats


def ck_door(sd: dict[str, Any], path: Path, cfg: dict[str, Any]) -> tuple[float, float]:
    w = cpuckpt.StorageWriter(path, cfg)
    device_sync()
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=w)
    resp.staging_completion.result()
    stall = time.perf_counter() - t0
    resp.upload_completion.result()
    total = time.perf_counter() - t0
    w.close()
    return stall, total


def cold_load(path: Path, sd: dict[str, Any], reader: Any) -> tuple[float, bool]:
    out = clone_empty(sd)
    drop_caches()
    device_sync()
    t0 = time.perf_counter()
    dcp.load(out, storage_reader=reader)
    device_sync()
    dt = time.perf_counter() - t0
    ok = same_state_dict(out, sd) is None
    del out
    return dt, ok


# ------------------------------------------------------------------------------------ train loop
def training_interference(sd: dict[str, Any], path: Path, cfg: dict[str, Any]) -> None:
    matmul_loop(5)
    alone = summarize(matmul_loop(40))
    device_sync()
    t0 = time.perf_counter()
    h = cpuckpt.async_save(sd, fresh(path), cfg)
    h.staged.wait()
    during: list[float] = []
    while not h.done():
        during += matmul_loop(1)
    h.wait()
    persist = time.perf_counter() - t0
    s = summarize(during)
    record("train_loop_interference", alone_ms=alone["median"] * 1e3, during_ms=s["median"] * 1e3,
           during_n=s["n"], slowdown=s["median"] / alone["median"] if s["n"] else None, persist_s=persist)


# -------------------------------------------------------------------------------------------- main
def run_target(sd: dict[str, Any], nbytes: int, name: str, target: Path, reps: int, quick: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    best_w, best_r = floor_storage(target, nbytes) if not quick else (float("nan"), float("nan"))
    record("floor_storage_best", target=name, write_GBps=best_w, read_GBps=best_r)
    ck = target / "ck"
    base = {"io": {"threads": 8}, "staging": {"pool_bytes": 0}}  # snapshot

    for tc in (1, 8) if not quick else (8,):
        s = dcp_fs_save(sd, fresh(ck), tc)
        record("dcp_fs_save", target=name, thread_count=tc, s=s, GBps=nbytes / s / GB)
    try:
        stall, total = dcp_async_default_stager(sd, fresh(ck))
        record("dcp_async_pinned_stager", target=name, stall_s=stall, persist_s=total, GBps=nbytes / total / GB)
    except Exception as e:  # torch 2.11 raised KeyError on a second save in one process
        record("dcp_async_pinned_stager", target=name, error=repr(e))
    if not quick:
        s = torch_save(sd, fresh(ck))
        record("torch_save", target=name, s=s, GBps=nbytes / s / GB)
    fresh(ck)

    # cpuckpt sync save
    for threads in (4, 8):
        cfg = {"io": {"threads": threads}}
        device_sync()
        t0 = time.perf_counter()
        cpuckpt.save(sd, fresh(ck), cfg)
        s = time.perf_counter() - t0
        record("cpuckpt_save_sync", target=name, threads=threads, s=s, GBps=nbytes / s / GB)

    # async snapshot, pool prepared at start-up
    release_pool()
    t0 = time.perf_counter()
    cpuckpt.prepare_pool(nbytes, base)
    record("cpuckpt_prepare_pool", target=name, s=time.perf_counter() - t0)
    stalls, persists = [], []
    for rep in range(reps + 1):
        stall, total, stats = ck_async(sd, fresh(ck), base)
        record("cpuckpt_async_snapshot", target=name, rep=rep, stall_s=stall, persist_s=total,
               GBps=nbytes / total / GB, call_s=stats.call_s, mode=stats.mode)
        (stalls if rep else []).append(stall)
        if rep:
            persists.append(total)
    record("cpuckpt_async_snapshot_summary", target=name, stall=summarize(stalls), persist=summarize(persists))

    # cold loads into GPU tensors
    for label, cfg in (("verify", {"io": {"threads": 8}}), ("noverify", {"io": {"threads": 8},
                                                                            "integrity": {"verify": "off"}})):
        dt, ok = cold_load(ck, sd, cpuckpt.StorageReader(ck, cfg))
        record("cpuckpt_load_gpu", target=name, variant=label, s=dt, GBps=nbytes / dt / GB, bitexact=ok)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(fresh(ck)), thread_count=8))
    dt, ok = cold_load(ck, sd, dcp.FileSystemReader(str(ck)))
    record("dcp_fs_load_gpu", target=name, s=dt, GBps=nbytes / dt / GB, bitexact=ok)

    # streaming: pool of 1 GiB, or half a smaller shard (a pool smaller than the shard streams); peak extra RSS
    # includes creating the pool
    release_pool()
    release_memory()
    pool_bytes = min(1 * GiB, nbytes // 2)
    stream_cfg = {"io": {"threads": 8}, "staging": {"pool_bytes": pool_bytes}}
    for rep in range(2):
        with RssSampler() as rss:
            stall, total, stats = ck_async(sd, fresh(ck), stream_cfg)
        record("cpuckpt_async_streaming", target=name, rep=rep, stall_s=stall, persist_s=total,
               GBps=nbytes / total / GB, peak_extra_rss=rss.extra, pool_bytes=pool_bytes,
               rss_over_pool=rss.extra / pool_bytes, mode=stats.mode)
    release_pool()

    # the dcp.async_save door (snapshot; one more memcpy)
    for rep in range(2):
        stall, total = ck_door(sd, fresh(ck), {"io": {"threads": 8}})
        record("cpuckpt_dcp_door", target=name, rep=rep, stall_s=stall, persist_s=total, GBps=nbytes / total / GB)
    release_pool()
    shutil.rmtree(ck, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--targets", default="disk,shm")
    ap.add_argument("--disk-dir", default="/root/cpuckpt-bench")
    ap.add_argument("--shm-dir", default="/dev/shm/cpuckpt-bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer variants (smoke run)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.WARNING)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    record("machine", gpu=torch.cuda.get_device_name(), torch=torch.__version__, cpus=os.cpu_count())
    sd = build_state_dict(int(args.gib * GiB), device="cuda")
    nbytes = state_dict_nbytes(sd)
    record("state", GiB=nbytes / GiB, tensors=len(named_tensors(sd)))
    floor_copies(sd, args.reps)
    targets = {"disk": Path(args.disk_dir), "shm": Path(args.shm_dir)}
    for t in args.targets.split(","):
        run_target(sd, nbytes, t, targets[t], args.reps, args.quick)
    training_interference(sd, targets[args.targets.split(",")[0]] / "ti", {"io": {"threads": 8}})
    for t in targets.values():
        shutil.rmtree(t, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(summary_table(nbytes))


def summary_table(nbytes: int) -> str:
    def get(name: str, **kw: Any) -> list[dict[str, Any]]:
        return [r for r in RESULTS if r["name"] == name and all(r.get(k) == v for k, v in kw.items())]

    rows: list[Any] = []
    d2h = get("floor_d2h_pinned")[0]["s"]["median"]
    tnames = sorted({r["target"] for r in RESULTS if "target" in r})
    for tn in tnames:
        floor = get("floor_storage_best", target=tn)
        fw = floor[0]["write_GBps"] if floor else float("nan")
        fr = floor[0]["read_GBps"] if floor else float("nan")
        rows.append(None)
        rows.append([f"[{tn}] floor D2H / O_DIRECT write / read", f"{d2h:.3f}", "-", f"{fw:.2f} / {fr:.2f}", "-"])
        for r in get("dcp_fs_save", target=tn):
            rows.append([f"DCP FileSystemWriter tc={r['thread_count']}", f"{r['s']:.2f}", f"{r['s']:.2f}",
                         f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        for r in get("dcp_async_pinned_stager", target=tn):
            if "error" in r:
                rows.append(["DCP async_save + DefaultStager(pinned)", "error", "-", r["error"][:30], "-"])
            else:
                rows.append(["DCP async_save + DefaultStager(pinned)", f"{r['stall_s']:.3f}", f"{r['persist_s']:.2f}",
                             f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        for r in get("torch_save", target=tn):
            rows.append(["torch.save", f"{r['s']:.2f}", f"{r['s']:.2f}", f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        for r in get("cpuckpt_save_sync", target=tn):
            rows.append([f"cpuckpt save (sync) threads={r['threads']}", f"{r['s']:.2f}", f"{r['s']:.2f}",
                         f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        snaps = get("cpuckpt_async_snapshot", target=tn)
        if snaps:
            first = snaps[0]
            rows.append(["cpuckpt async snapshot, first save (pool prepared)", f"{first['stall_s']:.3f}",
                         f"{first['persist_s']:.2f}", f"{first['GBps']:.2f}", f"{first['GBps'] / fw:.2f}"])
            summ = get("cpuckpt_async_snapshot_summary", target=tn)[0]
            st, pe = summ["stall"], summ["persist"]
            gb = nbytes / pe["median"] / GB
            rows.append([f"cpuckpt async snapshot, warm (median of {st['n']})",
                         f"{st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f})",
                         f"{pe['median']:.2f} ({pe['min']:.2f}-{pe['max']:.2f})", f"{gb:.2f}", f"{gb / fw:.2f}"])
            rows.append(["  stall / D2H floor", f"{st['median'] / d2h:.2f}x", "-", "-", "-"])
        for r in get("cpuckpt_async_streaming", target=tn):
            rows.append([f"cpuckpt async streaming rep{r['rep']} (pool 1 GiB, RSS {r['rss_over_pool']:.2f}x pool)",
                         f"{r['stall_s']:.3f}", f"{r['persist_s']:.2f}", f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        for r in get("cpuckpt_dcp_door", target=tn):
            rows.append([f"cpuckpt via dcp.async_save rep{r['rep']}", f"{r['stall_s']:.3f}", f"{r['persist_s']:.2f}",
                         f"{r['GBps']:.2f}", f"{r['GBps'] / fw:.2f}"])
        for r in get("cpuckpt_load_gpu", target=tn):
            rows.append([f"cpuckpt cold load -> GPU ({r['variant']}, bitexact={r['bitexact']})", "-",
                         f"{r['s']:.2f}", f"{r['GBps']:.2f}", f"{r['GBps'] / fr:.2f} of read"])
        for r in get("dcp_fs_load_gpu", target=tn):
            rows.append([f"DCP FileSystemReader cold load -> GPU (bitexact={r['bitexact']})", "-", f"{r['s']:.2f}",
                         f"{r['GBps']:.2f}", f"{r['GBps'] / fr:.2f} of read"])
    ti = get("train_loop_interference")
    foot = []
    if ti:
        t = ti[0]
        foot.append(f"training loop (4x bf16 8192^3 matmul/iter): alone {t['alone_ms']:.1f} ms, during persist "
                    f"{t['during_ms']:.1f} ms (x{t['slowdown']:.3f}, n={t['during_n']})")
    return format_table(["variant", "stall s", "persist s", "GB/s", "x floor"], rows,
                        right=[False, True, True, True, True],
                        title=f"cpuckpt GPU benchmark: {nbytes / GiB:.2f} GiB state, D2H floor {d2h:.3f} s",
                        footnotes=foot)


if __name__ == "__main__":
    main()
