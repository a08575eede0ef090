"""What replication adds to a memory save's blocked time: two nodes on loopback, replicas 1 against 0.

Used by :mod:`benchmarks.bench_replica` (:func:`run`); each rank is this module run as a script
(``python -m benchmarks.replica_stall --rank R ...``), as ``tests/dist/test_multinode.py`` sets nodes up:
two processes in a 2-rank gloo group, each with its own RAM root (two RAM roots are two nodes), the
replica receiver of node *i* listening on 127.0.0.(i+1). Every rank holds two memory tiers at once, one
with ``memory.replicas: 1`` and one with ``replicas: 0`` (own RAM roots and durable roots, ``persist_every:
0``: the writers do nothing but replicate), and saves the same state (``--nbytes`` per rank) into them in
alternating blocks. Per save, on every rank:

* ``stall``: the call to ``handle.staged.wait()`` returning (the training thread's blocked time);
* ``commit``: the call to ``handle.wait()`` returning (committed in memory on every node);
* ``replicated``: the call to the writer owing nothing (``wait_persisted``, polled every 10 ms): the copy
  landed on the partner (replicas 1) or nothing owed (replicas 0);
* ``returned``: the call to ``save`` returning;
* ``request``: the time inside the tier's ``_request_replica`` (the replica's bookkeeping on the call path:
  the request file and its cancel-on-failure callback), timed by wrapping that method on the instance.

Before each save the ranks meet at a barrier and sleep ``--gap-s`` (a training step's stand-in); the
replica of the previous save has landed by then, so no save waits for a held slot. Warm-up saves (the
images' first growth, the slots' preparation) are not counted. Each rank writes its rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import summarize, with_time_spent

TIMEOUT_S = 60
METRICS = ("request", "returned", "stall", "commit", "replicated")


def worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--init", required=True, help="tcp://host:port of the 2-rank gloo group")
    ap.add_argument("--work", required=True)
    ap.add_argument("--nbytes", type=int, required=True)
    ap.add_argument("--saves", type=int, required=True, help="measured saves per configuration")
    ap.add_argument("--block", type=int, required=True, help="saves per block (configurations alternate)")
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--gap-s", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--open-order", default="1,0",
                    help="the order the tiers are opened in (bench_replica --smoke: 0,1, so the replicas-0 writers "
                         "start while the replicas-1 tier waits for its writers to listen)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    import cpuckpt

    torch.set_num_threads(1)
    rank, work = args.rank, Path(args.work)
    dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank + 1)
    numel = args.nbytes // 4
    state = {f"r{rank}": {f"t{i}": torch.randn(numel // 8, generator=g) for i in range(8)}}
    tiers: dict[int, Any] = {}
    spent: dict[str, float] = {}
    for k in (int(x) for x in args.open_order.split(",")):
        cfg = {"io": {"threads": 1, "backend": "buffered"}, "timeout_s": TIMEOUT_S,
               "memory": {"root": str(work / f"ram-k{k}-node{rank}"), "persist_every": 0, "slots": 2,
                          "headroom_bytes": 0, "replicas": k, "replica_host": f"127.0.0.{rank + 1}"}}
        tiers[k] = cpuckpt.MemoryTier(work / f"durable-k{k}", cfg)
        _time_method(tiers[k], "_request_replica", spent)
    rows: list[dict[str, Any]] = []
    step = 0

    def one(k: int, measured: bool) -> None:
        nonlocal step
        step += 1
        state[f"r{rank}"]["t0"][0] = float(step)  # a change between saves, as training makes
        dist.barrier()
        time.sleep(args.gap_s)
        spent.clear()
        t0 = time.perf_counter()
        h = tiers[k].save(state, step)
        t1 = time.perf_counter()
        h.staged.wait()
        t2 = time.perf_counter()
        h.wait()
        t3 = time.perf_counter()
        tiers[k].wait_persisted()
        t4 = time.perf_counter()
        if measured:
            rows.append({"replicas": k, "step": step, "returned": t1 - t0, "stall": t2 - t0, "commit": t3 - t0,
                         "replicated": t4 - t0,
                         "request": spent.get("_request_replica", 0.0)})

    try:
        for k in (1, 0):
            for _ in range(args.warmup):
                one(k, False)
            tiers[k].wait_prepared()
        blocks = -(-args.saves // args.block)
        for b in range(blocks):
            for k in ((1, 0) if b % 2 == 0 else (0, 1)):
                for _ in range(min(args.block, args.saves - b * args.block)):
                    one(k, True)
        outcomes = [{"seconds": o.seconds, "nbytes": o.nbytes, "ok": o.ok} for o in tiers[1].queue.outcomes()]
    finally:
        for tier in tiers.values():
            tier.close(persist_newest=False)
        dist.destroy_process_group()
    Path(args.out).write_text(json.dumps({"rank": rank, "rows": rows, "replica_outcomes": outcomes}))
    return 0


def _time_method(obj: Any, name: str, spent: dict[str, float]) -> None:
    """Add the seconds spent in ``obj.name`` to ``spent[name]`` (the benchmark's own wrapper; obj is unchanged)."""
    setattr(obj, name, with_time_spent(getattr(obj, name), name, spent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(work: Path, *, nbytes: int, saves: int, block: int, warmup: int, gap_s: float,
        timeout_s: float = 600, open_order: str = "1,0") -> dict[str, Any]:
    """Launch both ranks; return every rank's rows and the summary (per save, the slower rank's time)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    init = f"tcp://127.0.0.1:{_free_port()}"
    outs = [work / f"stall-{r}.json" for r in (0, 1)]
    logs = [work / f"stall-{r}.log" for r in (0, 1)]
    procs = []
    for r in (0, 1):
        with open(logs[r], "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.replica_stall", "--rank", str(r), "--init", init, "--work",
                 str(work), "--nbytes", str(nbytes), "--saves", str(saves), "--block", str(block), "--warmup",
                 str(warmup), "--gap-s", str(gap_s), "--out", str(outs[r]), "--open-order", open_order],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in logs)
        raise RuntimeError(f"replica stall workers failed: {[p.returncode for p in procs]}\n{tails}")
    ranks = [json.loads(f.read_text()) for f in outs]
    summary: dict[str, Any] = {}
    for k in (0, 1):
        per_save = [[row for row in rk["rows"] if row["replicas"] == k] for rk in ranks]
        slowest = {m: [max(rows[i][m] for rows in per_save) for i in range(len(per_save[0]))] for m in METRICS}
        summary[f"replicas={k}"] = {m: summarize(v) for m, v in slowest.items()}
        summary[f"replicas={k}"]["per_rank_median"] = {
            m: [summarize([row[m] for row in rows])["median"] for rows in per_save] for m in METRICS}
    return {"nbytes_per_rank": nbytes, "saves": saves, "block": block, "warmup": warmup, "gap_s": gap_s,
            "ranks": ranks, "summary": summary}


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1:]))
