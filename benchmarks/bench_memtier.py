"""The memory tier (``cpuckpt.tier.MemoryTier``) against its floors and today's path, in one run (see BENCHMARKING.md).

Run on the device machine (one H200) from the repository root: ``python -m benchmarks.bench_memtier --gib 4
--reps 5 --out $OUT [--durable-dir /root/cpuckpt-memtier] [--ram-dir /dev/shm/cpuckpt-memtier]``; ``--smoke``
runs every part small (CPU tensors without CUDA) in under a minute. One process, one state dict
(``build_state_dict``, seed 0, on CUDA when present), one table printed last, raw JSON in ``$OUT/bench_memtier.json``
(rewritten after every part; a failing part is recorded and the next runs); both roots are always removed.

1. floors: pinned D2H and H2D of the same tensors; pwrite of the same bytes to the durable disk (8 threads,
   best of O_DIRECT and buffered);
2. memory saves (slots 2, headroom 0, io.threads 8): the first save of slot 0 and of slot 1 (they reserve,
   map and pin the images), then ``--reps`` warm ones. Stall = call (GPU synchronised) to ``staged.wait()``
   (+ synchronise); committed = to ``wait()`` (in memory). Peer: ``cpuckpt.async_save`` snapshot to tmpfs,
   pool prepared (today's path);
3. persist by the writer process: call to ``wait_persisted()`` with the durable checkpoint complete, 3 times;
4. interference: a bf16 matmul loop alone and while the writer process persists (until the queue owes
   nothing); the before: the same while ``cpuckpt.async_save`` persists to the same disk (trainer threads);
5. loads into GPU tensors, bit-exact, in the saving process: from the mapped images (``MemoryTier.load``),
   through the reader (``cpuckpt.load``: the fast path; GPU targets read through pinned slots), and through
   DCP's planner (``dcp.load`` with the same reader: the fast path's before), reps interleaved; and in a
   fresh process (``--child-load``: the restart case; it rebuilds the deterministic state to compare and
   records each load's ``ReadStats``).

One tier serves parts 2-5 (one writer, images reserved once): ``memory.persist_every`` is ``PERSIST_EVERY``;
part 2 uses steps that are not multiples of it (nothing persists), parts 3-4 steps that are. Durable copies
are deleted once measured (small disk), so the tier is closed with ``persist_newest=False``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from benchmarks.common import (
    GB,
    GiB,
    ResultLog,
    build_state_dict,
    clone_empty,
    copy_floors,
    device_sync,
    format_table,
    fresh,
    matmul_loop,
    named_tensors,
    pwrite_floor,
    same_state_dict,
    state_dict_nbytes,
    summarize,
    timed_call,
)
from cpuckpt.tier.memory import MemoryTier
from cpuckpt.transfer.staging import release_pool

logger = logging.getLogger("bench_memtier")
RESULTS = ResultLog(logger)
record = RESULTS.record
REPO = Path(__file__).resolve().parents[1]
PERSIST_EVERY = 1000  # steps 1..reps+2 are memory-only saves; 1000, 2000, ... are persisted
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ floors
def floor_copies(sd: dict[str, Any], reps: int) -> None:
    nbytes, floors = copy_floors(sd, reps)
    for d, s in floors.items():
        record(f"floor_{d}_pinned", s=s, GBps=nbytes / s["median"] / GB, pinned=CUDA)


def floor_pwrite(root: Path, nbytes: int) -> None:
    best = 0.0
    for direct in (True, False):
        r = pwrite_floor(root / "floor.bin", nbytes, 8, direct)
        record("floor_pwrite", direct=direct, threads=8, s=r.wall_s, GBps=r.gbps, error=r.error)
        best = max(best, r.gbps if r.supported else 0.0)
        (root / "floor.bin").unlink(missing_ok=True)
    record("floor_pwrite_best", GBps=best)


# ------------------------------------------------------------------------------------------- saves
def timed_save(save: Any) -> tuple[float, float, float, Any]:
    """(t0, stall, committed, handle) of one background save started by ``save()`` at ``t0``."""
    device_sync()
    t0 = time.perf_counter()
    h = save()
    h.staged.wait()
    device_sync()
    stall = time.perf_counter() - t0
    h.wait()
    return t0, stall, time.perf_counter() - t0, h


def memtier_saves(tier: MemoryTier, sd: dict[str, Any], reps: int) -> None:
    for step in range(1, reps + 3):
        _, stall, committed, h = timed_save(lambda step=step: tier.save(sd, step))
        kind = "first_slot0" if step == 1 else "first_slot1" if step == 2 else "warm"
        record("memtier_save", kind=kind, step=step, stall_s=stall, committed_s=committed, path=h.path)
        if step == 1:  # memory.prepare_slots: the other slots' images are made in the background meanwhile
            t0 = time.perf_counter()
            tier.wait_prepared()
            record("memtier_prepare", waited_s=time.perf_counter() - t0)
    if tier.queue.owed():
        raise RuntimeError("a memory-only save queued a persist")


def peer_async_saves(sd: dict[str, Any], nbytes: int, ck: Path, cfg: dict[str, Any], reps: int) -> None:
    t0 = time.perf_counter()
    cpuckpt.prepare_pool(nbytes, cfg)
    record("peer_prepare_pool", s=time.perf_counter() - t0)
    for rep in range(reps + 1):
        fresh(ck)  # deleting the previous checkpoint is not part of the save
        _, stall, committed, _ = timed_save(lambda: cpuckpt.async_save(sd, ck, cfg))
        record("peer_async_save_tmpfs", kind="first" if rep == 0 else "warm", stall_s=stall, committed_s=committed)
    fresh(ck)


def persists(tier: MemoryTier, sd: dict[str, Any], durable: Path, n: int) -> None:
    for k in range(1, n + 1):
        step = k * PERSIST_EVERY
        t0, stall, committed, _ = timed_save(lambda step=step: tier.save(sd, step))
        tier.wait_persisted()
        persist = time.perf_counter() - t0
        ok = tier.persisted(step)
        record("memtier_persist", step=step, stall_s=stall, committed_s=committed, persist_s=persist,
               writer_s=persist - committed, complete=ok)
        if not ok:
            raise RuntimeError(f"step {step}: wait_persisted returned without a complete durable checkpoint")
        shutil.rmtree(durable / f"step_{step}")  # the disk is small


# ------------------------------------------------------------------------------------ interference
def interference(label: str, start: Any, busy: Any, n: int, iters: int) -> None:
    """Matmul iteration time alone, then while ``busy()`` after ``start()`` returned a staged handle."""
    matmul_loop(3, n)
    alone = summarize(matmul_loop(iters, n))
    device_sync()
    t0 = time.perf_counter()
    h = start()
    h.staged.wait()
    during: list[float] = []
    while busy(h) or not during:
        during += matmul_loop(1, n)
    h.wait()
    s = summarize(during)
    record("interference", variant=label, alone=alone, during=s, ratio=s["median"] / alone["median"],
           busy_s=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------- loads
def timed_loads(sd: dict[str, Any], path: Path, reps: int, loader: Any = None) -> tuple[list[float], bool]:
    """``reps`` loads of ``path`` into GPU targets by ``loader(targets, path)`` (default ``cpuckpt.load``)."""
    loader = loader or cpuckpt.load
    targets = clone_empty(sd)
    times = []
    for _ in range(reps):
        for t in named_tensors(targets).values():
            t.zero_()
        times.append(timed_call(lambda: loader(targets, path)))
    return times, same_state_dict(targets, sd) is None


def reader_load(stats: list[dict[str, Any]] | None = None) -> Any:
    """A loader: ``cpuckpt.load`` through a ``StorageReader``; appends each load's read statistics."""
    def load(targets: dict[str, Any], path: Path) -> None:
        reader = cpuckpt.StorageReader(path)
        cpuckpt.load(targets, path, storage_reader=reader)
        if stats is not None:
            stats.append(dataclasses.asdict(reader.last_stats))
    return load


def dcp_planner_load(targets: dict[str, Any], path: Path) -> None:
    """The before of the load fast path: stock ``dcp.load`` (DCP's planner) through cpuckpt's reader."""
    dcp.load(targets, storage_reader=cpuckpt.StorageReader(path))


def child_load(path: str, nbytes: int, device: str) -> None:
    """``--child-load``: a fresh process loads the RAM checkpoint (first and second load), prints one JSON line."""
    ref = build_state_dict(nbytes, device=device)
    stats: list[dict[str, Any]] = []
    times, exact = timed_loads(ref, Path(path), 2, reader_load(stats))
    print(json.dumps({"child_load": {"first_s": times[0], "second_s": times[1], "bitexact": exact,
                                     "nbytes": state_dict_nbytes(ref), "read_stats": stats}}), flush=True)


def spawn_child_load(path: Path, gib: float, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_memtier", "--child-load", str(path), "--gib", repr(gib)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"child load failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith('{"child_load"')][-1]
    return {**json.loads(line)["child_load"], "process_wall_s": wall}


# -------------------------------------------------------------------------------------------- main
def dump_json(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "bench_memtier.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def run(args: argparse.Namespace, sd: dict[str, Any], nbytes: int, durable: Path, ram: Path) -> None:
    """Every part in order; a part that fails is recorded (``failure``) and the next one runs anyway."""
    reps, mm = args.reps, ((256, 10) if not CUDA else (8192, 40))
    deadline = time.monotonic() + args.budget_s
    snap = {"io": {"threads": 8}, "staging": {"pool_bytes": 0}}  # snapshot
    tier: MemoryTier | None = None

    wanted = set(args.parts.split(",")) if args.parts else None

    def part(name: str, fn: Any, needs_tier: bool = True) -> None:
        if wanted is not None and name not in wanted and name != "memtier_init":
            record("skipped", part=name, why="not in --parts")
            return
        if (needs_tier and tier is None) or time.monotonic() > deadline:
            record("skipped", part=name, why="no tier" if needs_tier and tier is None else "over --budget-s")
            return
        try:
            fn()
        except Exception as e:
            logger.exception("part %s failed", name)
            record("failure", part=name, error=f"{type(e).__name__}: {e}")
        finally:
            dump_json(args.out)  # what is measured so far survives a run killed by the device's time limit

    def make_tier() -> None:
        nonlocal tier
        t0 = time.perf_counter()
        tier = MemoryTier(durable / "tier", {"io": {"threads": 8}, "timeout_s": 60, "memory": {
            "root": str(ram / "tier"), "persist_every": PERSIST_EVERY, "slots": 2, "headroom_bytes": 0}})
        record("memtier_init", s=time.perf_counter() - t0)  # RAM root, writer process started

    def tier_interference() -> None:
        assert tier is not None
        step = 10 * PERSIST_EVERY
        interference("memtier_writer_persist", lambda: tier.save(sd, step), lambda h: bool(tier.queue.owed()), *mm)
        if not tier.persisted(step):
            raise RuntimeError(f"step {step}: no complete durable checkpoint after the persist")
        shutil.rmtree(durable / "tier" / f"step_{step}")

    def async_interference() -> None:
        ck = durable / "async" / "ck"
        interference("async_save_disk", lambda: cpuckpt.async_save(sd, fresh(ck), snap), lambda h: not h.done(), *mm)
        shutil.rmtree(ck)
        release_pool()

    def loads() -> None:
        assert tier is not None
        latest = tier.find_latest()
        if latest is None or ram not in latest.parents:
            raise RuntimeError(f"the newest checkpoint {latest} is not in memory")
        # memory checkpoints carry no checksums (the writer computes them for the durable copy)
        # variants interleaved rep by rep (noisy machines); "DCP planner" is the load fast path's before
        variants = {"from its mapped images (MemoryTier.load)": tier.load,
                    "read from the RAM root (cpuckpt.load)": reader_load(),
                    "read from the RAM root, DCP planner (dcp.load + StorageReader)": dcp_planner_load}
        times: dict[str, list[float]] = {k: [] for k in variants}
        exact = dict.fromkeys(variants, True)
        for _ in range(reps):
            for label, loader in variants.items():
                t, ok = timed_loads(sd, latest, 1, loader)
                times[label] += t
                exact[label] = exact[label] and ok
        for label in variants:
            record("memtier_load", variant=label, s=summarize(times[label]), bitexact=exact[label], path=str(latest))
        child = spawn_child_load(latest, args.gib, max(30.0, deadline - time.monotonic()))
        record("memtier_load_child", **child, path=str(latest))

    part("floor_copies", lambda: floor_copies(sd, reps), False)
    part("memtier_init", make_tier, False)
    try:
        part("memtier_saves", lambda: memtier_saves(tier, sd, reps))
        part("peer_async_saves", lambda: peer_async_saves(sd, nbytes, ram / "peer" / "ck", snap, reps), False)
        part("floor_pwrite", lambda: floor_pwrite(durable, nbytes), False)
        part("memtier_persists", lambda: persists(tier, sd, durable / "tier", 3))
        part("interference_memtier", tier_interference)
        part("interference_async_save", async_interference, False)
        part("loads", loads)
    finally:
        if tier is not None:
            try:
                tier.close(persist_newest=False, remove_root=True)
            except Exception as e:
                logger.exception("tier.close failed")
                record("failure", part="tier.close", error=f"{type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--durable-dir", default="/root/cpuckpt-memtier")
    ap.add_argument("--ram-dir", default="/dev/shm/cpuckpt-memtier")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=280.0, help="start no part after this many seconds")
    ap.add_argument("--parts", default="", help="comma-separated parts to run (default all; the tier is always "
                    "made), e.g. floor_copies,memtier_saves,loads")
    ap.add_argument("--smoke", action="store_true", help="small sizes, CPU tensors without CUDA (< 1 min)")
    ap.add_argument("--child-load", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, single process
    if args.smoke:
        args.gib, args.reps = min(args.gib, 0.0625), min(args.reps, 3)
    if not CUDA and not (args.smoke or args.child_load):
        raise SystemExit("bench_memtier needs a CUDA device (or --smoke)")
    device = "cuda" if CUDA else "cpu"
    if args.child_load:
        return child_load(args.child_load, int(args.gib * GiB), device)
    record("machine", gpu=torch.cuda.get_device_name() if CUDA else None, torch=torch.__version__,
           cpus=os.cpu_count(), cpuckpt=cpuckpt.__version__, argv=sys.argv[1:])
    durable, ram = Path(args.durable_dir).absolute(), Path(args.ram_dir).absolute()
    sd = build_state_dict(int(args.gib * GiB), device=device)
    nbytes = state_dict_nbytes(sd)
    record("state", GiB=nbytes / GiB, tensors=len(named_tensors(sd)), device=device)
    try:
        for d in (durable, ram):
            fresh(d).mkdir(parents=True, mode=0o700)
        run(args, sd, nbytes, durable, ram)
    finally:
        release_pool()
        for d in (durable, ram):
            shutil.rmtree(d, ignore_errors=True)
        dump_json(args.out)
    print(summary_table(nbytes), flush=True)


def summary_table(nbytes: int) -> str:
    def get(name: str, **kw: Any) -> list[dict[str, Any]]:
        return [r for r in RESULTS if r["name"] == name and all(r.get(k) == v for k, v in kw.items())]

    def secs(v: list[float] | dict[str, float]) -> str:
        s = summarize(v) if isinstance(v, list) else v
        return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})" if s["n"] > 1 else f"{s['median']:.4f}"

    rows: list[Any] = []

    def row(variant: str, times: list[float] | dict[str, float], floor: float | None, target: str = "-",
            ok: Any = None, gbps: float | None = None) -> None:
        if not times:
            return  # that part failed or was skipped (footnotes)
        med = times["median"] if isinstance(times, dict) else summarize(times)["median"]
        gb = nbytes / med / GB if gbps is None else gbps
        ratio = gb / floor if floor else None
        met = None if ok is None else ("yes" if ok(gb, ratio) else "NO")
        rows.append([variant, secs(times), f"{gb:.2f}", f"{ratio:.2f}" if ratio is not None else None, target, met])

    nan = float("nan")
    d2h, h2d, fw = (r[0]["GBps"] if (r := get(n)) else nan
                    for n in ("floor_d2h_pinned", "floor_h2d_pinned", "floor_pwrite_best"))
    for d in ("d2h", "h2d"):
        for r in get(f"floor_{d}_pinned"):
            row(f"floor: {'pinned ' if r['pinned'] else ''}{d.upper()}", r["s"], None)
    for r in get("floor_pwrite"):
        row(f"floor: pwrite 8 threads {'O_DIRECT' if r['direct'] else 'buffered'}", [r["s"]], None, gbps=r["GBps"])
    rows.append(None)
    saves = get("memtier_save")
    for kind in ("first_slot0", "first_slot1", "warm"):
        rs = [r for r in saves if r["kind"] == kind]
        tgt = ("x D2H >= 0.80", lambda g, x: x >= 0.8) if kind == "warm" else ("-", None)
        row(f"memtier save {kind}: stall", [r["stall_s"] for r in rs], d2h, *tgt)
        row(f"memtier save {kind}: committed in memory", [r["committed_s"] for r in rs], d2h)
    peer = get("peer_async_save_tmpfs")
    for kind in ("first", "warm"):
        row(f"peer async_save snapshot tmpfs {kind}: stall", [r["stall_s"] for r in peer if r["kind"] == kind], d2h)
    rows.append(None)
    ps = get("memtier_persist")
    row("memtier persist (call -> durable commit)", [r["persist_s"] for r in ps], fw)
    row("  of which writer (memory commit -> durable)", [r["writer_s"] for r in ps], fw)
    rows.append(None)
    for r in get("interference"):
        rows.append([f"matmul iteration alone (before {r['variant']})", secs(r["alone"]), None, None, None, None])
        rows.append([f"matmul iteration during {r['variant']} (n={r['during']['n']})", secs(r["during"]), None,
                     f"{r['ratio']:.3f} x alone", "<= 1.03" if "memtier" in r["variant"] else "(before)",
                     ("yes" if r["ratio"] <= 1.03 else "NO") if "memtier" in r["variant"] else None])
    rows.append(None)
    for r in get("memtier_load"):
        row(f"memtier load -> {'GPU' if CUDA else 'CPU'}, same process, {r['variant']} "
            f"(bitexact={r['bitexact']})", r["s"], h2d, "x H2D >= 0.5",
            lambda g, x, e=r["bitexact"]: x >= 0.5 and e)
    for r in get("memtier_load_child"):
        for k in ("first", "second"):
            row(f"memtier load, fresh process, {k} (bitexact={r['bitexact']})", [r[f"{k}_s"]], h2d,
                ">= 10 GB/s" if k == "first" else "-", (lambda g, x, e=r["bitexact"]: g >= 10 and e)
                if k == "first" else None)
    foot = ["seconds: median (min-max) over the reps; ratio: GB/s over the floor's GB/s (interference: ms ratio).",
            "Loads come from tmpfs (the RAM root): no page cache to drop, a cold load is the same as a warm one.",
            "Fresh process: the time of cpuckpt.load only (after imports and CUDA init), first and second load."]
    foot += [f"FAILED {r['part']}: {r['error'][:200]}" for r in get("failure")]
    foot += [f"SKIPPED {r['part']}: {r['why']}" for r in get("skipped")]
    title = (f"cpuckpt memory tier: {nbytes / GiB:.3f} GiB state, {get('state')[0]['tensors']} tensors, "
             f"{get('machine')[0]['gpu'] or 'CPU (smoke)'}, D2H {d2h:.1f}, H2D {h2d:.1f}, pwrite {fw:.2f} GB/s")
    return format_table(["variant", "seconds", "GB/s", "ratio", "target", "met?"], rows,
                        right=[False, True, True, True, False, False], title=title, footnotes=foot)


if __name__ == "__main__":
    main()
