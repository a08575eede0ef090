"""What grows with the number of ranks: collectives per save, bytes they move, files and metadata per checkpoint.

Run from the repository root: ``python -m benchmarks.bench_scale [--worlds 1,2,4,8] [--tensors 50] [--kib 64]
[--reps 3] [--ranks-per-node 2] [--tier-first] [--dir DIR] [--out OUT]``; ``--smoke`` runs world sizes 1 and 2
at the same time with a tiny state (and ``--tier-first``). For each world size, that many ranks are started as
processes (gloo over loopback, a ``FileStore``); each rank holds its own shard (``--tensors`` CPU float32
tensors of ``--kib`` KiB under keys of its own, so ``.metadata`` has ranks x tensors entries) and runs, one
after the other, every save waited for before the next:

1. ``cpuckpt.async_save`` ``--reps`` + 1 times (the first plans with DCP, the others reuse the plan), each to
   its own directory; 2. ``cpuckpt.save`` ``--reps`` times; 3. ``cpuckpt.MemoryTier`` saves ``--reps`` + 1
   times (``persist_every: 0``, nothing persisted; RAM roots in ``/dev/shm`` when it exists, one per
   ``--ranks-per-node`` ranks, so 8 ranks are 4 "nodes" and the per-node commit runs); 4. loads of the
   last async checkpoint: ``cpuckpt.load`` (the fast path) and ``dcp.load`` with cpuckpt's reader (DCP's
   load planning).

Every rank wraps torch.distributed's collectives (``all_gather_object``, ``all_reduce``, ``broadcast_object_list``,
``gather_object``, ``scatter_object_list``, ``barrier``, ``all_gather``, ``broadcast`` and a few more) before
anything runs, so DCP's own collectives are counted with cpuckpt's, from every thread (the committer's
too). Only the outermost call counts (an object collective's inner tensor collectives do not). For each
call the wrapper records the bytes this rank *sends*: the pickled object of an object collective (the
source's list for broadcast/scatter), the tensor bytes of a tensor collective. ``coord in`` is what the
coordinator receives in gathers (every rank's sent bytes of ``gather_object``/``all_gather_object``/``all_gather``).

Times are medians over the warm saves (wall time from the call to committed, ``wait()`` returned). With more
ranks than cores (8 ranks on a 2-core box) times are only indicative; counts, bytes and sizes are exact.
The table is printed last; raw JSON goes to ``--out``/bench_scale.json. Scratch directories are removed.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import logging
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench_scale")
REPO = Path(__file__).resolve().parents[1]

COLLECTIVES = ("all_gather_object", "all_reduce", "broadcast_object_list", "gather_object", "scatter_object_list",
               "barrier", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
               "scatter", "reduce", "monitored_barrier")
GATHERS = ("gather_object", "all_gather_object", "all_gather", "all_gather_into_tensor", "gather")


# ------------------------------------------------------------------------------------ counting (in a rank)
class CollectiveLog:
    """Wraps ``torch.distributed``'s collective functions; records (name, bytes sent) of outermost calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []
        self.local = threading.local()

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is not None:
                setattr(dist, name, self._wrap(name, orig))

    def _wrap(self, name: str, orig: Any) -> Any:
        sig = inspect.signature(orig)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "depth", 0):
                return orig(*args, **kwargs)
            nbytes = _sent_bytes(name, sig, args, kwargs)
            with self.lock:
                self.calls.append((name, nbytes))
            self.local.depth = 1
            try:
                return orig(*args, **kwargs)
            finally:
                self.local.depth = 0

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        return wrapper

    def mark(self) -> int:
        with self.lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, int]]:
        with self.lock:
            return list(self.calls[mark:])


def _nbytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _sent_bytes(name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> int:
    import torch.distributed as dist

    try:
        a = sig.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return 0
    rank = dist.get_rank()
    if name in ("all_gather_object", "gather_object"):
        return len(pickle.dumps(a.get("obj")))
    if name == "broadcast_object_list":
        src = a.get("src", a.get("group_src", 0))
        return len(pickle.dumps(a.get("object_list"))) if src in (None, rank) else 0
    if name == "scatter_object_list":
        lst = a.get("scatter_object_input_list")
        return sum(len(pickle.dumps(o)) for o in lst) if lst else 0
    if name in ("all_reduce", "broadcast", "reduce"):
        return _nbytes(a.get("tensor"))
    if name in ("all_gather", "gather"):
        return _nbytes(a.get("tensor"))
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return _nbytes(a.get("input_tensor", a.get("input")))
    if name == "scatter":
        return _nbytes(a.get("scatter_list"))
    return 0


def _summary(calls: list[tuple[str, int]]) -> dict[str, Any]:
    by_bytes: Counter[str] = Counter()
    for n, b in calls:
        by_bytes[n] += b
    return {"count": len(calls), "by_name": dict(Counter(n for n, _ in calls)), "bytes_by_name": dict(by_bytes),
            "sent_bytes": sum(b for _, b in calls), "gathered_bytes": sum(b for n, b in calls if n in GATHERS)}


def _dir_sizes(path: Path) -> dict[str, Any]:
    files = [p for p in path.iterdir() if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "metadata_bytes": (path / ".metadata").stat().st_size,
            "manifest_bytes": (path / ".cpuckpt.json").stat().st_size,
            "names": sorted(p.name for p in files) if len(files) <= 8 else None}


# ----------------------------------------------------------------------------------------- one rank
def rank_main(rank: int, world: int, store_path: str, args: argparse.Namespace, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    log = CollectiveLog()
    log.install()  # before anything imports or runs a collective
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    work = Path(args.work)
    numel = args.kib * 1024 // 4
    g = torch.Generator().manual_seed(rank)
    state = {f"r{rank}": {f"t{i}": torch.randn(numel, generator=g) for i in range(args.tensors)}}
    cfg = {"io": {"chunk_bytes": "1MiB", "threads": 2, "backend": "buffered"}, "timeout_s": args.timeout}
    out: dict[str, Any] = {"rank": rank, "world": world}

    def measured(fn: Any) -> tuple[Any, float, dict[str, Any]]:
        m = log.mark()
        t0 = time.perf_counter()
        value = fn()
        dt = time.perf_counter() - t0
        return value, dt, _summary(log.since(m))

    def open_tier() -> Any:
        node = rank // args.ranks_per_node  # a node is a RAM root: one root per group of ranks_per_node ranks
        mcfg = dict(cfg, memory={"root": f"{args.ram}/node{node}", "persist_every": 0, "slots": 2,
                                 "headroom_bytes": 0})
        tier, dt, coll = measured(lambda: MemoryTier(work / "durable", mcfg))
        out["tier_open"] = {"s": dt, **coll}
        return tier

    # --tier-first: the writer processes start (import torch) while the other saves run, so close need not
    # wait for them (the smoke mode's time; their imports then share the cores with the timed saves)
    tier = open_tier() if args.tier_first else None

    # 1. async_save: the first plans with DCP, the next ones reuse the plan
    rows = []
    for k in range(args.reps + 1):
        path = work / "async" / f"step_{k}"

        def one(path: Path = path, k: int = k) -> Any:
            t0 = time.perf_counter()
            h = cpuckpt.async_save(state, path, cfg, step=k)
            call_s = time.perf_counter() - t0
            h.wait()
            return h, call_s

        (h, call_s), dt, coll = measured(one)
        rows.append({"s": dt, "call_s": call_s, "planned": h.stats.planned, "resolved": h.stats.resolved, **coll})
    out["async"] = rows
    last_async = work / "async" / f"step_{args.reps}"

    # 2. cpuckpt.save (plans with DCP every time)
    rows = []
    for k in range(args.reps):
        path = work / "sync" / f"step_{k}"
        _, dt, coll = measured(lambda path=path, k=k: cpuckpt.save(state, path, cfg, step=k))
        rows.append({"s": dt, **coll})
    out["sync"] = rows

    # 3. the memory tier (no persists: the writers start but owe nothing)
    if tier is None:
        tier = open_tier()
    rows = []
    for k in range(1, args.reps + 2):
        _, dt, coll = measured(lambda k=k: tier.save(state, k).wait())
        rows.append({"s": dt, **coll})
    out["tier"] = rows
    committed = [s for s in tier.slots if (s / ".metadata").exists()]
    slot = max(committed, key=lambda s: (s / ".metadata").stat().st_mtime_ns) if committed else None
    if rank == 0 and slot is not None:
        out["tier_sizes"] = _dir_sizes(slot)
        out["tier_slot"] = str(slot)

    # 4. loads of the last async checkpoint
    target = {f"r{rank}": {f"t{i}": torch.empty(numel) for i in range(args.tensors)}}
    reader = cpuckpt.StorageReader(last_async)
    _, dt, coll = measured(lambda: cpuckpt.load(target, last_async, cfg, storage_reader=reader))
    fast = getattr(getattr(reader, "last_stats", None), "fast_path", None)
    assert all(torch.equal(target[f"r{rank}"][k], v) for k, v in state[f"r{rank}"].items()), "load differs"
    out["load"] = {"s": dt, "fast_path": fast, **coll}
    _, dt, coll = measured(lambda: dcp.load(target, storage_reader=cpuckpt.StorageReader(last_async)))
    out["load_dcp"] = {"s": dt, **coll}

    dist.barrier()  # uncounted from here on: the counts above are final
    _, dt, coll = measured(lambda: tier.close(persist_newest=False))
    out["tier_close"] = {"s": dt, **coll}
    out["rank_s"] = time.perf_counter() - started
    if rank == 0:
        out["async_sizes"] = _dir_sizes(last_async)
        out["sync_sizes"] = _dir_sizes(work / "sync" / f"step_{args.reps - 1}")
    Path(result_path).write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- the parent
def run_world(world: int, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """Start ``world`` rank processes; their results in rank order (raises if one fails or hangs)."""
    run = scratch / f"w{world}"
    run.mkdir()
    ram_parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else scratch
    ram = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-scale-ram-", dir=ram_parent))
    child_args = dict(vars(args), work=str(run / "ckpt"), ram=str(ram / "root"))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    procs = []
    try:
        for r in range(world):
            argv = [sys.executable, "-m", "benchmarks.bench_scale", "--rank-child",
                    json.dumps([r, world, str(run / "store"), child_args, str(run / f"r{r}.json")])]
            with open(run / f"r{r}.log", "wb") as logf:
                procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout + 60
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        bad = [r for r, p in enumerate(procs) if p.poll() != 0]
        if bad:
            logs = "\n".join(f"--- rank {r} (rc {procs[r].poll()}):\n" + (run / f"r{r}.log").read_text()[-3000:]
                             for r in bad)
            raise RuntimeError(f"world {world}: ranks {bad} failed or hung\n{logs}")
        return [json.loads((run / f"r{r}.json").read_text()) for r in range(world)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _received(world: int, name: str, sent: int) -> int:
    """Bytes all ranks together receive in ``name`` calls whose senders sent ``sent`` bytes in all."""
    if name in ("all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce"):
        return (world - 1) * sent  # everyone gets everyone else's (all_reduce: ring, about the same)
    if name in ("broadcast_object_list", "broadcast"):
        return (world - 1) * sent  # only the source sent
    if name in ("gather_object", "gather", "reduce", "scatter_object_list", "scatter", "reduce_scatter_tensor"):
        return sent * (world - 1) // max(world, 1)  # all but the coordinator's own share
    return 0


def aggregate(world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of save: collectives per save (rank 0; max over ranks), bytes sent by all ranks, gathered
    into the coordinator, median time; sizes from rank 0."""
    r0 = ranks[0]

    def kind(key: str, rows: list[int] | None = None) -> dict[str, Any]:
        # per rank, the chosen saves' records (one record for a single measured call)
        per_rank = [[r[key]] if rows is None else [r[key][i] for i in rows] for r in ranks]
        n = len(per_rank[0])
        sent = [sum(pr[i]["sent_bytes"] for pr in per_rank) for i in range(n)]
        gathered = [sum(pr[i]["gathered_bytes"] for pr in per_rank) for i in range(n)]
        recv = [sum(_received(world, name, sum(pr[i]["bytes_by_name"].get(name, 0) for pr in per_rank))
                    for name in COLLECTIVES) for i in range(n)]
        first = per_rank[0][0]
        return {"received_bytes": int(_med(recv)),
                "collectives": first["count"], "collectives_max_rank": max(x["count"] for pr in per_rank for x in pr),
                "collectives_min_rank": min(x["count"] for pr in per_rank for x in pr), "by_name": first["by_name"],
                "sent_bytes": int(_med(sent)), "coordinator_in_bytes": int(_med(gathered)),
                "s_rank0_median": _med([x["s"] for x in per_rank[0]]),
                "s_max_rank_median": max(_med([x["s"] for x in pr]) for pr in per_rank),
                "call_s_rank0_median": _med([x["call_s"] for x in per_rank[0] if "call_s" in x]),
                "extra": {k: v for k, v in first.items() if k in ("planned", "resolved", "fast_path")}}

    n_async = len(r0["async"])
    n_tier = len(r0["tier"])
    return {
        "world": world,
        "async_first": kind("async", [0]),
        "async_warm": kind("async", list(range(1, n_async))),
        "sync": kind("sync", list(range(len(r0["sync"])))),
        "tier_first": kind("tier", [0]),
        "tier_warm": kind("tier", list(range(1, n_tier))),
        "tier_open": kind("tier_open"),
        "load": kind("load"),
        "load_dcp": kind("load_dcp"),
        "tier_close_collectives": r0["tier_close"]["count"],
        "tier_close_s": r0["tier_close"]["s"],
        "rank0_s": r0["rank_s"],
        "async_planned": [x["planned"] for x in r0["async"]],
        "sizes": {"async": r0["async_sizes"], "sync": r0["sync_sizes"], "tier": r0.get("tier_sizes")},
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"cpuckpt scale: {args.tensors} tensors x {args.kib} KiB per rank (own keys), CPU, gloo on loopback, "
             f"{os.cpu_count()} cores; times medians (ms), only indicative with more ranks than cores",
             "collectives per save (rank 0) | KB sent by all ranks per save | KB gathered into the coordinator | "
             "KB received by all ranks together per save"]
    hdr = ("ranks", "async 1st", "async warm", "save", "tier 1st", "tier warm", "load", "dcp.load",
           "sent warm/save/tier", "coord in warm/save", "recv warm/save/tier", ".metadata", "manifest", "files",
           "ms async/save/tier/load")
    rows = []
    for r in results:
        s = r["sizes"]
        rows.append((
            str(r["world"]),
            *(str(r[k]["collectives"]) for k in ("async_first", "async_warm", "sync", "tier_first", "tier_warm",
                                                 "load", "load_dcp")),
            "/".join(f"{r[k]['sent_bytes'] / 1e3:.1f}" for k in ("async_warm", "sync", "tier_warm")),
            "/".join(f"{r[k]['coordinator_in_bytes'] / 1e3:.1f}" for k in ("async_warm", "sync")),
            "/".join(f"{r[k]['received_bytes'] / 1e3:.0f}" for k in ("async_warm", "sync", "tier_warm")),
            str(s["async"]["metadata_bytes"]), str(s["async"]["manifest_bytes"]),
            f"{s['async']['files']}/{s['tier']['files'] if s['tier'] else '-'}",
            "/".join(f"{r[k]['s_max_rank_median'] * 1e3:.0f}" for k in ("async_warm", "sync", "tier_warm", "load")),
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("files: durable checkpoint / memory slot; times: max over ranks of each rank's median")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks-per-node", type=int, default=2, help="memory tier: ranks sharing a RAM root (a node)")
    p.add_argument("--tier-first", action="store_true", help="open the memory tier before the other saves")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout and per-world bound, s")
    p.add_argument("--dir", default=None, help="scratch parent (default: the system temp dir)")
    p.add_argument("--out", default=None, help="directory for bench_scale.json")
    p.add_argument("--smoke", action="store_true",
                   help="world sizes 1,2 at the same time; 8 tensors of 16 KiB; 2 reps")
    p.add_argument("--rank-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_child is not None:
        r, world, store, child, result = json.loads(args.rank_child)
        logging.basicConfig(level=logging.WARNING)
        rank_main(r, world, store, argparse.Namespace(**child), result)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        args.worlds, args.tensors, args.kib, args.reps, args.timeout, args.tier_first = "1,2", 8, 16, 2, 60.0, True
    worlds = [int(w) for w in args.worlds.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-scale-", dir=args.dir))
    results = []

    def one_world(w: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = aggregate(w, run_world(w, args, scratch))
        logger.info("world %d done in %.1f s", w, time.perf_counter() - t0)
        return r

    def write_out() -> None:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_scale.json").write_text(json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "rank_child"}, "results": results},
                indent=1))

    try:
        if args.smoke:
            # the world sizes run at once: their processes' imports overlap (times mean nothing in a smoke run;
            # counts, bytes and sizes are per process group and unchanged)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(worlds)) as ex:
                futures = [ex.submit(one_world, w) for w in worlds]
                results.extend(f.result() for f in futures)
            write_out()
        else:
            for w in worlds:
                results.append(one_world(w))
                write_out()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
