"""DeepSpeed's memory tier across nodes, launched as users launch it: two torchrun launches stand in for two nodes.

Each launch is ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1`` (c10d rendezvous on loopback,
``--local-addr`` 127.0.0.1 / 127.0.0.2 keeps launch *i* rank *i*) with its own RAM root (``memory.root``) and one
shared ``save_dir``. A real DeepSpeed ZeRO-2 engine (CPU, gloo) trains, ``save_checkpoint`` every step into the
memory tier (``memory_tier: true``, 2 slots, ``persist_every: 4``, ``replicas: 1``). Real writer processes, real
sockets between them, real files; nothing is mocked. Proven:

1. after step 10 (durable: 4 and 8; memory: 9 and 10 on both nodes, each replicated to the other node) both
   launches are SIGKILLed, node 1's writer is SIGKILLed by pid and node 1's RAM root deleted, and ``save_dir`` is
   renamed away (so any read of it fails: zero durable reads is observable). In CI, node 0's replica of node 1's
   step 10 is damaged too (one flipped byte): the restore of 10 fails alike on every rank (the receiver's crc32c
   check) and the newest restorable step is 9 (``-m slow`` runs the undamaged case: step 10). The relaunch of both
   nodes restores node 1's slot from node 0's replica and ``load_latest`` loads that step from each node's own RAM
   root on both ranks, bit-exact (model parameters, this rank's ZeRO-2 partition of the fp32 master and Adam
   moments): never a mix of steps, never the durable step 8 while a newer checkpoint is loadable; it trains on to
   step 12 (persisted) bit-identically to the first, uninterrupted run (which trained 11 and 12 without saving
   them);
2. node 1's RAM root deleted, one launch of 2 ranks (1 node x 2 ranks) on node 0's RAM root, which still holds
   its part of steps 11 and 12: the topology changed, so those are ignored (a log line, never an error mid-load)
   and ``load_latest`` loads the durable step 12, bit-exact;
3. both RAM roots deleted, one launch of 2 ranks: ``load_latest`` loads the durable step 12, bit-exact, trains on,
   and ``engine.destroy()`` persists the newest and removes the RAM root.

The reference states are the trainers' own live states, saved (``torch.save``) beside the test as they trained;
the worker is this file run as a script (``__main__``) and reports in JSON files the test reads.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _launches as L
import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(480)  # a hang guard: on a loaded 2-core box the phases take minutes (CI: 188 s)

THIS = Path(__file__).resolve()
HELPERS = THIS.parent.parent / "integrations" / "test_deepspeed.py"
TIMEOUT_S = 30  # the tier's own bound (collectives, writers)
PHASE_S = 120  # the test's bound on one launch phase (DeepSpeed's imports take a while on a busy 2-core box)


# ---------------------------------------------------------------------------------------- the worker


def _helpers():
    """The engines, steps and state comparison of tests/integrations/test_deepspeed.py, loaded by path."""
    import importlib.util

    name = "_cpuckpt_test_deepspeed_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HELPERS)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def worker(argv: list[str]) -> int:
    """One trainer rank: resume (or start), train to ``--until`` saving every step, then hold (killed) or destroy."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--save-until", type=int, default=10**9, help="the last step saved (later ones only trained)")
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--host", default="127.0.0.1", help="this node's address (its replica receiver listens there)")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    args = ap.parse_args(argv)
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.INFO)  # restores, replicas, persists: in the launch's log
    ram_existed = Path(args.ram).exists()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of an inference-only op
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    h = _helpers()
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.tier.tagmarker import complete_tags

    out = Path(args.out)
    ckpt_ds.install({"memory_tier": True, "timeout_s": TIMEOUT_S,
                     "io": {"backend": "buffered", "chunk_bytes": 64 * 1024, "threads": 1},
                     "memory": {"root": args.ram, "slots": 2, "persist_every": 4, "headroom_bytes": 0,
                                "replicas": 1, "replica_host": args.host}})
    engine = h._engine(args.stage, seed=100 + rank)  # not the saved values: what is loaded must come from the ckpt
    save_dir = Path(args.save)
    durable_there = save_dir.exists()
    path, _ = ckpt_ds.load_latest(engine, save_dir)
    tier = engine.checkpoint_engine.memory_tier
    step = engine.global_steps
    report: dict = {"rank": rank, "pid": os.getpid(), "ram": args.ram, "loaded": path, "step": step,
                    "durable_there": durable_there, "tier_root": str(tier.root.path), "ram_existed": ram_existed,
                    "slot_steps": sorted(c.step for s in tier.slots if (c := tier.format.committed(s)) is not None)}
    if step:
        ref = torch.load(out / f"state_{step}_rank{rank}.pt", weights_only=False)
        try:
            h._assert_same(h._state(engine), ref, f"rank {rank}: step {step} loaded from {path}: ")
            report["bitexact"] = True
        except AssertionError as e:
            report["bitexact"] = str(e)
    for k in range(step + 1, args.until + 1):
        h._step(engine, k)
        ref = out / f"state_{k}_rank{rank}.pt"  # the first run's state after step k: resumed runs must match it
        if ref.exists():
            h._assert_same(h._state(engine), torch.load(ref, weights_only=False),
                           f"rank {rank}: step {k}, trained on after resuming at step {step}: ")
        else:
            torch.save(h._state(engine), ref)
        if k <= args.save_until:
            engine.save_checkpoint(str(save_dir))
    ckpt_ds.commit_pending(engine)
    if args.hold:  # every persist and replica owed done, then stand still until the test kills this node
        tier.wait_persisted()
        dist.barrier()
        report["writer_pid"] = tier.writer_pid()
        report["durable"] = sorted(t.global_step for t in complete_tags(save_dir))
        last = min(args.until, args.save_until)
        report["replicated"] = {k: tier.replicated(k) for k in (last - 1, last)}
        L.write_report(out, args.phase, rank, report)
        time.sleep(300)
        return 3
    engine.destroy()  # the newest made durable, writers stopped, RAM root removed
    dist.barrier()
    report["durable"] = sorted(t.global_step for t in complete_tags(save_dir))
    report["ram_left"] = Path(report["tier_root"]).exists()
    L.write_report(out, args.phase, rank, report)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ the test


def _launch(tmp: Path, node: int, phase: str, port: int, until: int, *, hold: bool, nnodes: int = 2,
            nproc: int = 1, save_until: int = 10**9, stage: int = 2) -> subprocess.Popen:
    args = ["--ram", str(tmp / f"ram{node}"), "--save", str(tmp / "save"), "--out", str(tmp / "out"), "--phase", phase,
            "--until", str(until), "--save-until", str(save_until), "--host", f"127.0.0.{node + 1}",
            "--stage", str(stage), *(["--hold"] if hold else [])]
    return L.launch(tmp, node, phase, port, THIS, args, nnodes=nnodes, nproc=nproc)


def _run_phase(tmp: Path, phase: str, until: int, *, hold: bool, nodes: int = 2, save_until: int = 10**9,
               stage: int = 2) -> tuple[list[dict], list]:
    """Launch (two nodes of 1 rank, or one node of 2 ranks); each rank's report once written, and the launches."""
    port = L.free_port()
    procs = ([_launch(tmp, n, phase, port, until, hold=hold, save_until=save_until, stage=stage) for n in range(2)]
             if nodes == 2 else [_launch(tmp, 0, phase, port, until, hold=hold, nnodes=1, nproc=2, stage=stage)])
    return L.await_reports(tmp, phase, procs, 2, hold=hold, phase_s=PHASE_S), procs


def test_two_nodes_resume_from_a_partner_replica_then_reshard_from_disk(tmp_path: Path) -> None:
    """Also the damaged replica: node 0's replica of node 1's step 10 has one flipped byte, so the restore of 10
    fails alike on every rank and both ranks load step 9 from memory instead (its replica is intact), bit-exact
    (one launch sequence for both cases: the relaunches dominate this test's time)."""
    _two_nodes(tmp_path, stage=2, damaged=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_zero3(tmp_path: Path) -> None:
    """The same with ZeRO-3 (every rank writes and reads its own model-states file), undamaged: ``-m slow``."""
    _two_nodes(tmp_path, stage=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_zero1(tmp_path: Path) -> None:
    """The same with ZeRO-1 (optimizer states partitioned, gradients not), undamaged: ``-m slow``."""
    _two_nodes(tmp_path, stage=1)


def _damage_node1s_replica(tmp_path: Path, step: int) -> None:
    """One flipped byte in rank 1's optimizer file of node 0's replica of node 1's slot of ``step``."""
    from cpuckpt.tier.nodefiles import read_node_files

    damaged = [s for s in (tmp_path / "ram0").glob("replica-*/slot-*")
               if (listing := read_node_files(s)) is not None and listing.step == step]
    assert len(damaged) == 1, damaged
    L.flip_middle_byte(damaged[0] / "zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _two_nodes(tmp_path: Path, *, stage: int, damaged: bool = False) -> None:
    (tmp_path / "out").mkdir()
    save = tmp_path / "save"

    # Steps 1-12, saved through 10 (durable 4 and 8; memory 9 and 10, replicated): 11 and 12 only record the
    # uninterrupted run's states, which the resumed runs must reproduce.
    reports, procs = _run_phase(tmp_path, "train", 12, hold=True, save_until=10, stage=stage)
    try:
        for r in reports:
            assert r["loaded"] is None and r["step"] == 0, r
            assert r["durable"] == [4, 8], f"rank {r['rank']}: durable steps {r['durable']}"
            assert r["replicated"] == {"9": True, "10": True}, f"rank {r['rank']}: {r['replicated']}"
    finally:  # node 0's writer lives on (the relaunch adopts it); node 1 is lost: trainer, writer, RAM root
        L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports if r["rank"] == 1])
    kept = [r["writer_pid"] for r in reports if r["rank"] == 0]
    # node 1's processes gone before its RAM root is: one SIGKILLed mid-write may still add a file while rmtree runs
    L.wait_gone([pid for r in reports if r["rank"] == 1 for pid in (r["pid"], r["writer_pid"])])
    shutil.rmtree(tmp_path / "ram1")
    away = tmp_path / "save.away"
    save.rename(away)  # the relaunch cannot read a byte of the durable root
    try:
        if damaged:
            _damage_node1s_replica(tmp_path, 10)
    except BaseException:
        for pid in kept:
            L.kill_pid(pid)
        raise
    resumed = 9 if damaged else 10  # the newest step every node can restore

    # 1. Node 1 restored from node 0's replica; both ranks resume from memory (step 10, or 9 when 10's replica is
    # damaged), bit-exact; train to 12.
    reports, procs = _run_phase(tmp_path, "replica", 12, hold=True, stage=stage)
    try:
        for r in reports:
            assert not r["durable_there"], r
            assert r["step"] == resumed, f"rank {r['rank']}: resumed at {r['step']} from {r['loaded']} ({r})"
            assert r["loaded"].startswith(r["tier_root"]), f"rank {r['rank']}: not from its own RAM root: {r}"
            assert r["bitexact"] is True, r["bitexact"]
            assert r["durable"] == [12], f"rank {r['rank']}: durable steps {r['durable']}"
            assert r["ram_existed"] is (r["rank"] == 0) and resumed in r["slot_steps"], \
                f"rank {r['rank']}: its node's slot of step {resumed} (node 1's restored from node 0's replica): {r}"
    finally:
        L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports])
    assert sorted(p.name for p in away.iterdir() if p.is_dir()) == ["global_step4", "global_step8"]
    if damaged:
        assert "does not verify" in L.logs(tmp_path, "replica") or "cannot be restored" in L.logs(tmp_path, "replica")

    # 2. Another topology, one node of 2 ranks on node 0's RAM root (node 1's lost): node 0's slots hold steps 11 and
    # 12 for rank 0 only, so they are ignored (never an error mid-load): the durable step 12, bit-exact.
    L.wait_gone([pid for r in reports for pid in (r["pid"], r["writer_pid"])])
    shutil.rmtree(tmp_path / "ram1")
    reports, procs = _run_phase(tmp_path, "topology", 12, hold=True, nodes=1, stage=stage)
    L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports])
    for r in reports:
        assert r["step"] == 12 and r["loaded"].startswith(str(save / "global_step12")), f"rank {r['rank']}: {r}"
        assert r["bitexact"] is True, r["bitexact"]
        assert r["slot_steps"] == [11, 12], f"node 0's RAM root should still hold its part of 11 and 12: {r}"

    # 3. Both RAM roots lost; one node of 2 ranks: the durable step 12, bit-exact, then on to 14.
    L.wait_gone([pid for r in reports for pid in (r["pid"], r["writer_pid"])])
    shutil.rmtree(tmp_path / "ram0")
    reports, _ = _run_phase(tmp_path, "disk", 14, hold=False, nodes=1, stage=stage)
    for r in reports:
        assert r["step"] == 12 and r["loaded"].startswith(str(save / "global_step12")), f"rank {r['rank']}: {r}"
        assert r["bitexact"] is True, r["bitexact"]
        assert r["durable"] == [12, 14], f"rank {r['rank']}: durable steps {r['durable']}"
        assert not r["ram_left"], r


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1:]))
