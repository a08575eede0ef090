"""Megatron's memory tier across nodes, launched as users launch it: two torchrun launches stand in for two nodes.

Each launch is ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1`` (c10d rendezvous on loopback,
``--local-addr`` 127.0.0.1 / 127.0.0.2 keeps launch *i* rank *i*) with its own RAM root (``memory.root``) and its
own, node-local, non-persistent directory ``D`` (``np<i>``, what ``--non-persistent-global-ckpt-dir`` names on each
node), and one shared ``--save``. Each rank drives real megatron-core the way Megatron-LM's ``save_checkpoint``
does (as tests/integrations/test_megatron_memory.py does: rank 0 prunes ``D`` and creates ``iter_<N>``,
``dist_checkpointing.save`` with cpuckpt's async strategy, a finalize that writes rank 0's tracker, megatron-core's
``AsyncCallsQueue``) on a sharded state (a tensor split across the ranks, a replicated one, a sharded
object, a common value), a memory save every iteration, a persistent one every 4th, ``memory.replicas: 1``. Real
writer processes, real sockets, real files; nothing is mocked. Proven:

1. after iteration 11 (durable: 4 and 8; memory: 10 and 11 on both nodes, replicated) both launches are SIGKILLed
   before Megatron finalized iteration 11 (committed in both RAM roots, but no ``metadata.json`` on any node, and
   each ``D``'s tracker names 10), node 1's writer SIGKILLed by pid, node 1's RAM root and ``D`` deleted (a replaced
   node), and ``--save`` renamed away (any read of it fails). The relaunch runs ``MegatronMemory.prepare_restart``
   (what the Megatron-LM hook runs before ``load_checkpoint``): it must not name 11 (Megatron-LM fails on it: "not a
   distributed checkpoint"); node 1's slot of 10 comes back from node 0's replica, Megatron's files
   (``common.pt``, ``metadata.json``) are copied to it, both ``D`` name iteration 10; Megatron-LM's way of
   choosing (the newer of the two trackers) then loads iteration 10 from each node's own RAM root, bit-exact on
   both ranks (newer than the durable 8); it saves on (11, 12 persisted, 13);
2. node 1's RAM root and ``D`` deleted, one launch of 2 ranks (1 node x 2 ranks) on node 0's: its ``D`` names
   iteration 13, whose slot holds node 0's files only, so its names go (a warning, never an error mid-load) and
   ``--save``'s 12 is loaded, resharded (the tensor split along the other dimension), bit-exact;
3. both RAM roots and both ``D`` deleted, one launch of 2 ranks: ``--save``'s 12 again, resharded, bit-exact.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _launches as L
import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(600)  # a hang guard: on a loaded 2-core box the phases take minutes (CI: 282 s)

THIS = Path(__file__).resolve()
INTEGRATIONS = THIS.parent.parent / "integrations"
STUBS = INTEGRATIONS / "cpu_ci_cuda_stubs"
TIMEOUT_S = 30  # the tier's own bound (collectives, writers)
PHASE_S = 180  # the test's bound on one launch phase
TRACKER = "latest_checkpointed_iteration.txt"


# ---------------------------------------------------------------------------------------- the worker


def _read_tracker(d: Path) -> int | None:
    try:
        return int((d / TRACKER).read_text())
    except FileNotFoundError:
        return None


def _durable(save: Path) -> list[int]:
    from cpuckpt.backend.committed import check_complete

    return sorted(int(p.name[5:]) for p in save.glob("iter_*")
                  if (p / "metadata.json").is_file() and check_complete(p).complete)


def worker(argv: list[str]) -> int:
    """One trainer rank: Megatron-LM's restart (trackers, load), then a save every iteration to ``--until``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--npdir", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--split", type=int, default=0, help="the split dimension the load expects (1: resharded)")
    ap.add_argument("--skip-last-finalize", action="store_true")
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    sys.path.insert(0, str(INTEGRATIONS))
    from cpuckpt.integrations.megatron import load_strategy
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from test_megatron import _check, _setup, _template
    from test_megatron_memory import _megatron_save

    from cpuckpt.config import Config

    rank, _, device = _setup()
    cfg = {"io": {"chunk_bytes": "64KiB", "threads": 1, "backend": "buffered"}, "timeout_s": TIMEOUT_S,
           "memory": {"root": args.ram, "slots": 2, "headroom_bytes": 0, "replicas": 1, "replica_host": args.host}}
    save, np_dir, out = Path(args.save), Path(args.npdir), Path(args.out)
    report: dict = {"rank": rank, "pid": os.getpid(), "ram_existed": Path(args.ram).exists(),
                    "save_existed": save.exists()}
    router = MegatronMemory(save, np_dir, Config.from_dict(cfg))
    report["memory_iteration"] = router.prepare_restart()  # the Megatron-LM hook runs it before load_checkpoint
    np_it, save_it = _read_tracker(np_dir) or -1, _read_tracker(save) or -1  # Megatron-LM: the newer tracker
    d, it = (np_dir, np_it) if np_it >= save_it else (save, save_it)
    report["iteration"] = max(it, 0)
    if it > 0:
        path = d / f"iter_{it:07d}"
        report["loaded"] = os.path.realpath(path)
        loaded = dist_checkpointing.load(_template(device, split_dim=args.split), str(path),
                                         sharded_strategy=load_strategy(cfg))
        try:
            _check(loaded, it, device, split_dim=args.split)
            report["bitexact"] = True
        except AssertionError as e:
            report["bitexact"] = str(e)
    tier = router.tier
    report["tier_root"] = str(tier.root.path)
    strategy = CpuckptSaveStrategy(cfg, memory=router)
    # the temporal caller (a worker forked per save): nothing here is about megatron-core's persistent worker
    # (test_megatron*.py), which every launch would spawn anew, seconds of imports each
    queue = AsyncCallsQueue(persistent=False)
    for k in range(max(it, 0) + 1, args.until + 1):
        _megatron_save(strategy, queue, router, save if k % 4 == 0 else np_dir, k, device)
        if not (args.skip_last_finalize and k == args.until):  # a kill before Megatron finalized the last save
            queue.maybe_finalize_async_calls(blocking=True)  # memory commit (durable too, every 4th), then finalize
    if args.hold:
        tier.wait_persisted()
        dist.barrier()
        report["writer_pid"] = tier.writer_pid()
        report["durable"] = _durable(save)
        report["replicated"] = {k: tier.replicated(k) for k in (args.until - 1, args.until)}
        report["np_tracker"] = _read_tracker(np_dir)
        L.write_report(out, args.phase, rank, report)
        time.sleep(300)
        return 3
    queue.close()
    router.close()
    dist.barrier()
    report["durable"] = _durable(save)
    report["ram_left"] = Path(report["tier_root"]).exists()
    L.write_report(out, args.phase, rank, report)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ the test


def _launch(tmp: Path, node: int, phase: str, port: int, until: int, *, hold: bool, nnodes: int = 2, nproc: int = 1,
            split: int = 0, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    args = ["--ram", str(tmp / f"ram{node}"), "--npdir", str(tmp / f"np{node}"), "--save", str(tmp / "save"),
            "--out", str(tmp / "out"), "--phase", phase, "--until", str(until), "--split", str(split),
            "--host", f"127.0.0.{node + 1}", *extra, *(["--hold"] if hold else [])]
    env = {"PYTHONHASHSEED": "0", "CPU_CI_CUDA_STUBS": "1",
           "PYTHONPATH": os.pathsep.join([str(STUBS), os.environ.get("PYTHONPATH", "")])}
    return L.launch(tmp, node, phase, port, THIS, args, nnodes=nnodes, nproc=nproc, env=env)


def _run_phase(tmp: Path, phase: str, until: int, *, hold: bool, nodes: int = 2,
               split: int = 0, extra: tuple[str, ...] = ()) -> tuple[list[dict], list]:
    port = L.free_port()
    procs = ([_launch(tmp, n, phase, port, until, hold=hold, extra=extra) for n in range(2)] if nodes == 2 else
             [_launch(tmp, 0, phase, port, until, hold=hold, nnodes=1, nproc=2, split=split)])
    return L.await_reports(tmp, phase, procs, 2, hold=hold, phase_s=PHASE_S), procs


def test_two_nodes_resume_from_a_partner_replica_then_reshard_from_disk(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    save = tmp_path / "save"

    # Iterations 1-11, 11 never finalized (a kill before Megatron finalized it): memory saves of 10 and 11.
    reports, procs = _run_phase(tmp_path, "train", 11, hold=True, extra=("--skip-last-finalize",))
    try:
        for r in reports:
            assert r["iteration"] == 0, r
            assert r["durable"] == [4, 8], f"rank {r['rank']}: durable iterations {r['durable']}"
            assert r["replicated"] == {"10": True, "11": True}, f"rank {r['rank']}: {r['replicated']}"
            assert r["np_tracker"] == 10, f"rank {r['rank']}: its node's D names {r['np_tracker']}"
    finally:  # node 0's writer lives on (the relaunch adopts it); node 1 is lost: trainer, writer, RAM root, D
        L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports if r["rank"] == 1])
    shutil.rmtree(tmp_path / "ram1")
    shutil.rmtree(tmp_path / "np1")
    away = tmp_path / "save.away"
    save.rename(away)  # the relaunch cannot read a byte of the durable root

    # 1. Not the unfinalized 11: node 1's slot of 10 restored from node 0's replica; both ranks load iteration 10
    # from their own RAM root.
    reports, procs = _run_phase(tmp_path, "replica", 13, hold=True)
    try:
        for r in reports:
            assert not r["save_existed"], r
            assert r["memory_iteration"] == 10 and r["iteration"] == 10, f"rank {r['rank']}: {r}"
            assert r["loaded"].startswith(r["tier_root"]), f"rank {r['rank']}: not from its own RAM root: {r}"
            assert r["ram_existed"] is (r["rank"] == 0), r
            assert r["bitexact"] is True, r["bitexact"]
            assert r["durable"] == [12], f"rank {r['rank']}: durable iterations {r['durable']}"
            assert r["np_tracker"] == 13, f"rank {r['rank']}: its node's D names {r['np_tracker']}"
    finally:
        L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports])
    assert sorted(p.name for p in away.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000008"]

    # 2. Another topology, one node of 2 ranks on node 0's RAM root and D (node 1's lost): D names iteration 13,
    # whose slot holds node 0's files only; its names go (never an error mid-load): --save's 12, resharded.
    L.wait_gone([r["writer_pid"] for r in reports])
    shutil.rmtree(tmp_path / "ram1")
    shutil.rmtree(tmp_path / "np1")
    reports, procs = _run_phase(tmp_path, "topology", 12, hold=True, nodes=1, split=1)
    L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports])
    for r in reports:
        assert r["iteration"] == 12 and r["loaded"] == str(save / "iter_0000012"), f"rank {r['rank']}: {r}"
        assert r["bitexact"] is True, r["bitexact"]
        assert r["np_tracker"] is None, f"D still names a slot this topology cannot load: {r}"

    # 3. Both RAM roots and D lost; one node of 2 ranks: --save's iteration 12, resharded, bit-exact.
    L.wait_gone([r["writer_pid"] for r in reports])
    for d in ("ram0", "ram1", "np0", "np1"):
        shutil.rmtree(tmp_path / d, ignore_errors=True)
    reports, _ = _run_phase(tmp_path, "disk", 12, hold=False, nodes=1, split=1)
    for r in reports:
        assert r["iteration"] == 12 and r["loaded"] == str(save / "iter_0000012"), f"rank {r['rank']}: {r}"
        assert r["memory_iteration"] is None, r
        assert r["bitexact"] is True, r["bitexact"]
        assert not r["ram_left"], r


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1:]))


def _lose_node1_and_relaunch(tmp_path: Path, until: int, extra: tuple[str, ...],
                             damage: Callable[[Path], None] | None = None) -> list[dict]:
    """Train to ``until`` across two nodes, lose node 1 (trainer, writer, RAM root, ``D``), ``damage(tmp_path)``,
    relaunch both; the relaunch's reports."""
    (tmp_path / "out").mkdir()
    reports, procs = _run_phase(tmp_path, "train", until, hold=True, extra=extra)
    kept = [r["writer_pid"] for r in reports if r["rank"] == 0]  # adopted by the relaunch
    L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports if r["rank"] == 1])
    shutil.rmtree(tmp_path / "ram1")
    shutil.rmtree(tmp_path / "np1")
    try:
        if damage is not None:
            damage(tmp_path)
        reports, procs = _run_phase(tmp_path, "relaunch", until + 1, hold=True)
    except BaseException:
        for pid in kept:
            L.kill_pid(pid)
        raise
    L.kill_all(procs, reports, writers=[r["writer_pid"] for r in reports] + kept)
    return reports


@pytest.mark.slow
def test_a_persistent_newest_save_loads_from_the_durable_root(tmp_path: Path) -> None:
    """Iteration 12 is a persistent save (durable every 4): its slot holds no ``common.pt`` on any node, so the relaunch
    names no memory checkpoint and Megatron-LM loads ``--save``'s iteration 12, bit-exact (before: D named the slot on
    every node, and the load failed: "not a distributed checkpoint")."""
    for r in _lose_node1_and_relaunch(tmp_path, 12, ()):
        assert r["memory_iteration"] is None and r["iteration"] == 12, f"rank {r['rank']}: {r}"
        assert r["loaded"].startswith(str(tmp_path / "save")) and r["bitexact"] is True, r


def _flip_a_byte_of_node1s_replica(tmp_path: Path, step: int) -> None:
    """One flipped byte in rank 1's data file of node 0's replica of node 1's slot of ``step``."""
    from cpuckpt.backend.committed import read_manifest

    found = [s for s in (tmp_path / "ram0").glob("replica-*/slot-*")
             if (m := read_manifest(s)) is not None and m.step == step]
    assert len(found) == 1, found
    L.flip_middle_byte(found[0] / "__1_0.distcp")


@pytest.mark.slow
def test_a_damaged_replica_falls_back_to_the_next_newest_on_every_rank(tmp_path: Path) -> None:
    """Node 1 lost and node 0's replica of its iteration 10 damaged: the restore of 10 fails alike on every rank (the
    receiver's crc32c check), and both ranks load 9 from memory instead (its replica is intact), bit-exact: never a
    mix of iterations, never the durable 8 while a newer checkpoint is loadable."""
    for r in _lose_node1_and_relaunch(tmp_path, 10, (), lambda tmp: _flip_a_byte_of_node1s_replica(tmp, 10)):
        assert r["memory_iteration"] == 9 and r["iteration"] == 9, f"rank {r['rank']}: {r}"
        assert r["loaded"].startswith(r["tier_root"]) and r["bitexact"] is True, r
    assert "cannot be restored from a replica" in L.logs(tmp_path, "relaunch")
