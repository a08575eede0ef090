"""The memory tier across nodes, launched as users launch it: two torchrun launches stand in for two nodes.

Each launch is ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:<port>`` with its own RAM root (``memory.root``) and one shared durable root;
ranks come from the rendezvous (``--local-addr`` 127.0.0.1 / 127.0.0.2 keeps launch *i* rank *i*, so
that "node 1" is known). A small linear model is trained by hand (plain tensors, momentum), saved to
memory every step and persisted every 4th; a replicated part (the same keys and values on every rank,
which DCP writes into one rank's file) is written once per node, so each node's slot holds it. Real
processes, real files, real writer processes, real
sockets between them; nothing is mocked. Proven:

1. ``memory.replicas: 1`` (each node's slot copied to the other node's RAM root by the writers over TCP,
   each writer listening on its own loopback address): after step 10 both launches are SIGKILLed
   (trainers, agents), node 1's writer is SIGKILLed by pid and node 1's RAM root deleted. The relaunch
   restores node 1's slot from node 0's replica and resumes from the newest *memory* checkpoint (step 10),
   bit-exact, and every byte it loads comes from the RAM roots (the tier's read statistics name only
   slots: zero bytes from the durable root);
2. trained on to step 14 (durable 12), then the same loss again, relaunched with ``memory.replicas: 0``:
   node 0 still holds step 14 in memory (and a replica of node 1's), but without replicas not every node
   does, so the relaunch resumes from the newest *durable* checkpoint (step 12), an older step, bit-exact;
   it trains on and ``close`` makes step 16 durable.
3. (issue 27 B) lagging replicas: memory saves of steps 1-6 (3 slots), the writers send no replica from
   step 5 on (fault point ``replicate:step5``, armed in the writers only), the whole job SIGKILLed (trainers,
   agents, writers by pid) with both RAM roots intact; the relaunch loads step 6 from memory on both ranks,
   bit-exact, and both RAM roots still hold a complete slot of step 6 (before: step 4 loaded, step 6 lost).

The worker is this file run as a script (``__main__``); it checks bit-exactness itself against a replay
of the same deterministic training, and reports in JSON files the test reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _launches as L
import pytest

pytestmark = pytest.mark.timeout(150)

THIS = Path(__file__).resolve()
TIMEOUT_S = 20  # the tier's own bound (collectives, writers)
PHASE_S = 60  # the test's bound on one launch phase


# ---------------------------------------------------------------------------------------- the worker


def _init_state(rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(rank + 1)
    return {f"r{rank}": {"w": torch.randn(8, 16, generator=g), "b": torch.zeros(8), "m": torch.zeros(8, 16),
                         "step": 0},
            # Replicated on every rank (same keys, same values): DCP writes it once per job, the tier once per node.
            "shared": {"scale": torch.ones(4), "n": 0}}


def _train_step(state: dict, rank: int, step: int) -> None:
    """One SGD-with-momentum step of a linear regression on data drawn from (rank, step)."""
    import torch

    s = state[f"r{rank}"]
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, t = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    e = x @ s["w"].T + s["b"] - t
    s["m"].mul_(0.9).add_(2 * e.T @ x / 32)
    s["w"].sub_(0.01 * s["m"])
    s["b"].sub_(0.01 * 2 * e.mean(0))
    s["step"] = step
    state["shared"]["scale"].mul_(0.5).add_(step)
    state["shared"]["n"] = step


def _replay(rank: int, step: int) -> dict:
    state = _init_state(rank)
    for k in range(1, step + 1):
        _train_step(state, rank, k)
    return state


def _bitexact(a: dict, b: dict) -> list[str]:
    import torch

    bad = []
    for key in a:
        x, y = a[key], b[key]
        same = (torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if isinstance(x, torch.Tensor) else x == y)
        if not same:
            bad.append(key)
    return bad


def _same_as_replay(state: dict, rank: int, step: int) -> list[str]:
    """Keys of this rank's and the replicated part that differ from a replay to ``step``."""
    replay = _replay(rank, step)
    return _bitexact(state[f"r{rank}"], replay[f"r{rank}"]) + _bitexact(state["shared"], replay["shared"])


def worker(argv: list[str]) -> int:
    """One trainer rank: resume (or start), train to ``--until``, then hold (killed) or close."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--durable", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--replicas", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1", help="this node's address (its replica receiver listens there)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--lag-from", type=int, default=0,
                    help="the writers hold every replica from this step on (fault point replicate:step<N>)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.backend.committed import check_complete

    torch.set_num_threads(1)
    if args.lag_from:  # armed in the writers only (started by the tier from now on), not in this trainer
        from cpuckpt.testing import faults

        site = Path(args.out) / f"site-{args.host}"
        os.environ.update(faults.child_env(site, f"replicate:step{args.lag_from}=wait:{site}/never"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = {"io": {"threads": 1, "backend": "buffered", "chunk_bytes": 64 * 1024}, "timeout_s": TIMEOUT_S,
           "memory": {"root": args.ram, "persist_every": 4, "slots": args.slots, "headroom_bytes": 0,
                                                                                   "replicas": args.replicas,
                                                                                   "replica_host": args.host}}
    tier = cpuckpt.MemoryTier(args.durable, cfg)
    out = Path(args.out)
    slot_steps = [check_complete(s).step for s in tier.slots]
    state = _init_state(rank)
    path = tier.load_latest(state)
    step = state[f"r{rank}"]["step"]
    report = {"rank": rank, "pid": os.getpid(), "ram": args.ram, "slot_steps_before": slot_steps,
              "loaded": str(path) if path else None, "in_memory": path in tier.slots, "step": step,
              "bitexact_bad": _same_as_replay(state, rank, step),
              "loads": [(str(p), st.nbytes) for p, st in tier.loads],
              "slots": [str(s) for s in tier.slots], "slot_steps_loaded": [check_complete(s).step for s in tier.slots]}
    for k in range(step + 1, args.until + 1):
        _train_step(state, rank, k)
        if k == args.lag_from:  # every replica before the held ones sent, and the persists owed so far done
            tier.wait_persisted()
            dist.barrier()
        h = tier.save(state, k)
        h.wait()  # committed in memory on every node (tensors may change after staged; wait() covers it)
    report["final_bad"] = _same_as_replay(state, rank, args.until)
    if args.hold:  # wait for the owed persists, then stand still until the test kills this node
        if not args.lag_from:  # (held replicas would be waited for in vain)
            tier.wait_persisted()
        dist.barrier()
        report["writer_pid"] = tier.writer_pid()
        report["writer_lock"] = str(tier.root.writer_lock_path(rank))
        report["slot_steps_held"] = [check_complete(s).step for s in tier.slots]
        if args.lag_from:
            report["replicated"] = {k: tier.replicated(k) for k in range(args.lag_from - 1, args.until + 1)}
        report["durable"] = sorted(c.step for c in cpuckpt.list_checkpoints(args.durable) if c.complete)
        L.write_report(out, args.phase, rank, report)
        time.sleep(300)
        return 3
    tier.close()
    report["durable"] = sorted(c.step for c in cpuckpt.list_checkpoints(args.durable) if c.complete)
    L.write_report(out, args.phase, rank, report)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ the test


def _launch(tmp: Path, node: int, phase: str, port: int, until: int, hold: bool, replicas: int,
            nproc: int = 1, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    args = ["--ram", str(tmp / f"ram{node}"), "--durable", str(tmp / "durable"), "--out", str(tmp / "out"),
            "--phase", phase, "--until", str(until), "--replicas", str(replicas), "--host", f"127.0.0.{node + 1}",
            *(["--hold"] if hold else []), *extra]
    return L.launch(tmp, node, phase, port, THIS, args, nproc=nproc, join_timeout_s=40)


def _run_phase(tmp: Path, phase: str, until: int, *, hold: bool, replicas: int, nproc: int = 1,
               extra: tuple[str, ...] = ()) -> tuple[list[dict], list[subprocess.Popen]]:
    """Launch both nodes; return each rank's report (by rank) once written, and the launches."""
    port = L.free_port()
    procs = [_launch(tmp, node, phase, port, until, hold, replicas, nproc, extra) for node in (0, 1)]
    return L.await_reports(tmp, phase, procs, 2 * nproc, hold=hold, phase_s=PHASE_S * nproc), procs


def _kill_node(tmp: Path, launch: subprocess.Popen, reports: list[dict]) -> None:
    """SIGKILL a node's trainers (torchrun starts them in sessions of their own) and its agent's process group."""
    for report in reports:
        L.kill_pid(report["pid"])
    L.kill_launch(launch)


def _check_resume(reports: list[dict], phase: str, step: int, *, memory: bool) -> None:
    for r in reports:
        assert r["step"] == step, f"{phase} rank {r['rank']}: resumed at step {r['step']}, expected {step} ({r})"
        assert r["in_memory"] is memory, f"{phase} rank {r['rank']}: loaded {r['loaded']}, memory={memory} expected"
        assert not r["bitexact_bad"], f"{phase} rank {r['rank']}: {r['bitexact_bad']} differ from the replay"
        assert not r["final_bad"], f"{phase} rank {r['rank']}: trained state differs from the replay"


def _lose_node1(tmp: Path, procs: list[subprocess.Popen], reports: list[dict]) -> None:
    """Both launches SIGKILLed; node 1's writers SIGKILLed by pid and its RAM root deleted (a replaced node)."""
    by_node = [[r for r in reports if r["ram"] == str(tmp / f"ram{node}")] for node in (0, 1)]
    for launch, node_reports in zip(procs, by_node):
        _kill_node(tmp, launch, node_reports)
    for r in by_node[1]:
        L.kill_pid(r["writer_pid"])
    # gone before their RAM root is: a process SIGKILLed mid-write may still add a file while rmtree runs
    L.wait_gone([pid for r in by_node[1] for pid in (r["pid"], r["writer_pid"])])
    shutil.rmtree(by_node[1][0]["ram"])


def test_two_nodes_resume_from_a_partner_replica_then_from_disk_without_replicas(tmp_path: Path) -> None:
    _two_nodes(tmp_path, nproc=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_each(tmp_path: Path) -> None:
    """The same with 2 ranks per node (4 trainers, 4 writers): for a machine with cores to spare (``-m slow``)."""
    _two_nodes(tmp_path, nproc=2)


def _two_nodes(tmp_path: Path, *, nproc: int) -> None:
    (tmp_path / "out").mkdir()
    node1_ranks = set(range(nproc, 2 * nproc))
    # Train steps 1..10 with replicas: durable 4 and 8, memory slots 9 and 10 on both nodes, each replicated.
    reports, procs = _run_phase(tmp_path, "train", 10, hold=True, replicas=1, nproc=nproc)
    for r in reports:
        assert r["durable"] == [4, 8], f"rank {r['rank']}: durable steps {r['durable']}"
        assert r["loaded"] is None, r
    _lose_node1(tmp_path, procs, reports)

    # 1. Node 1 lost its RAM: restored from node 0's replica, resumed from memory (step 10), only RAM bytes read.
    reports, procs = _run_phase(tmp_path, "replica", 14, hold=True, replicas=1, nproc=nproc)
    _check_resume(reports, "replica", 10, memory=True)
    by_rank = {r["rank"]: r for r in reports}
    for rank in node1_ranks:
        assert not any(by_rank[rank]["slot_steps_before"]), f"node 1's RAM root was deleted: {by_rank[rank]}"
    for r in reports:
        assert r["loaded"] in r["slots"] and r["loaded"].startswith(r["ram"]), r
        assert r["loads"] and all(p.startswith(r["ram"]) for p, _ in r["loads"]), \
            f"rank {r['rank']}: reads outside its RAM root (the durable root?): {r['loads']}"
        assert sum(n for _, n in r["loads"]) > 0, r["loads"]
        assert r["durable"] == [4, 8, 12], f"rank {r['rank']}: durable steps {r['durable']}"
    _lose_node1(tmp_path, procs, reports)

    # 2. The same loss without replicas: node 0 alone holds step 14, so the job resumes from disk (step 12).
    reports, _ = _run_phase(tmp_path, "disk", 16, hold=False, replicas=0, nproc=nproc)
    _check_resume(reports, "disk", 12, memory=False)
    by_rank = {r["rank"]: r for r in reports}
    assert 14 in by_rank[0]["slot_steps_before"], f"node 0 should still hold step 14 in memory: {by_rank[0]}"
    for rank in node1_ranks:
        assert not any(by_rank[rank]["slot_steps_before"]), f"node 1's RAM root was deleted: {by_rank[rank]}"
    for r in reports:
        assert r["loaded"] == str(tmp_path / "durable" / "step_12"), r
        assert r["durable"] == [4, 8, 12, 16], f"rank {r['rank']}: durable steps {r['durable']}"



def _kill_job(procs: list[subprocess.Popen], reports: list[dict]) -> None:
    """Both launches SIGKILLed (trainers, agents), then every writer by pid; wait until their locks are free."""
    from cpuckpt.tier.ramroot import lock_holder

    for node, launch in enumerate(procs):
        _kill_node(Path(), launch, [r for r in reports if r["rank"] == node])
    for r in reports:
        L.kill_pid(r["writer_pid"])
    deadline = time.monotonic() + 15
    for r in reports:
        while lock_holder(r["writer_lock"]) is not None:
            assert time.monotonic() < deadline, f"writer {r['writer_pid']} still holds {r['writer_lock']}"
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_two_launches_with_lagging_replicas_relaunch_from_the_newest_step_and_keep_it(tmp_path: Path) -> None:
    """Issue 27 B: replicas lag (the writers send none from step 5 on), the job is SIGKILLed with both RAM roots
    intact holding steps 5 and 6; the relaunch loads step 6 on both ranks, bit-exact, and keeps it in RAM.
    (Before: the restore of step 4 from the lagging replica went into step 6's slot: step 4 loaded, 6 lost.)"""
    from cpuckpt.tier.nodes import committed_slot

    (tmp_path / "out").mkdir()
    lag = ("--slots", "3", "--lag-from", "5")
    reports, procs = _run_phase(tmp_path, "lag", 6, hold=True, replicas=1, extra=lag)
    try:
        for r in reports:
            assert r["loaded"] is None, r
            assert sorted(filter(None, r["slot_steps_held"])) == [4, 5, 6], f"rank {r['rank']}: {r}"
            assert r["replicated"] == {"4": True, "5": False, "6": False}, f"rank {r['rank']}: {r['replicated']}"
            assert r["durable"] == [4], f"rank {r['rank']}: durable steps {r['durable']}"
    finally:
        _kill_job(procs, reports)
    for node in (0, 1):
        steps = sorted(c[0] for s in (tmp_path / f"ram{node}").glob("slot-*") if (c := committed_slot(s, 2)))
        assert steps == [4, 5, 6], f"node {node}'s RAM root after the kill: steps {steps}"

    # The relaunch (writers clean): step 6 from memory on both ranks, bit-exact; steps 5 and 6 still in RAM.
    # Held, then killed like the first launch (close() would remove the RAM roots).
    reports, procs = _run_phase(tmp_path, "relaunch", 6, hold=True, replicas=1, extra=("--slots", "3"))
    _kill_job(procs, reports)
    _check_resume(reports, "relaunch", 6, memory=True)
    for r in reports:
        assert r["loaded"].startswith(r["ram"]), r
        assert r["loads"] and all(p.startswith(r["ram"]) for p, _ in r["loads"]), r["loads"]
        assert {5, 6} <= set(r["slot_steps_loaded"]), f"rank {r['rank']}: slots after the load {r}"
        assert {5, 6} <= set(r["slot_steps_held"]), f"rank {r['rank']}: slots after the relaunch {r}"
    for node in (0, 1):
        steps = sorted(c[0] for s in (tmp_path / f"ram{node}").glob("slot-*") if (c := committed_slot(s, 2)))
        assert 6 in steps, f"node {node}'s RAM root after the relaunch: steps {steps} (step 6 lost)"


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1:]))
