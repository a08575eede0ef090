"""Memory-tier restarts across nodes with lagging replicas, and close() when one rank's persist fails (issue 27).

Two gloo ranks, each with a RAM root of its own (``memory.root``: two nodes on one machine, as two
launches with their own RAM roots are), real writer processes sending real replicas over loopback TCP,
real files; nothing mocked. Proven:

1. Replicas lag (the writers hold the replicas of step 5 and later at their start: the fault point
   ``replicate:step5``, armed only in the writers), memory saves of steps 1-6, the whole job SIGKILLed
   (trainers, then writers by pid) with both RAM roots intact: the relaunch loads step 6 (the newest save
   every rank holds) on both ranks bit-exact, and steps 5 and 6 are still in both RAM roots afterwards.
   Before: the restore of step 4 from the lagging replica was planned into step 6's slot and run by the
   load, which returned step 4 and destroyed step 6 on every node. The earlier trainer's owed replicas
   then reach the relaunched writers (``replicated`` says so), not their dead ports.
2. ``find_latest`` and ``candidates`` on every rank mid-run, with those lagging replicas, change no byte of
   any slot or replica (a query), and name step 6.
3. That job SIGKILLed again and node 1's RAM root deleted: the relaunch restores step 6 from node 0's
   replica (``load_latest``); the restore planned for step 5 into slot-0 is dropped once step 7 is saved
   there: a later ``load`` of slot-0 reads step 7 on both ranks (before: the stale restore fired there).
4. One rank's persist fails (``io.backend: fault:ENOSPC@0`` in its writer): ``close()`` raises
   ``PersistError`` on both ranks within seconds although ``timeout_s`` is 120 (before: the other rank's
   coordinator writer waited the whole timeout for the missing part, and the ranks raised different errors).
5. URL roots other than ``s3://`` are refused (``ConfigError``) before anything is created.
6. A relaunch of the same two ranks on one node (node 0's RAM root) after a run across two nodes: node 0's slots
   hold rank 0's files only, so they are not listed (before: they were, and a load of one failed midway); the
   durable checkpoint loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import _helpers as H
import pytest
import torch

from cpuckpt.testing import faults

faults.install()  # io.backend "fault:...": in this process and every rank (they load this module)

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 20  # the tier's own bound (collectives, writers, replica connections)


def _cfg(ram: str | Path, **memory) -> dict:
    return {"io": {"threads": 1, "backend": "buffered", "chunk_bytes": 64 * 1024}, "timeout_s": TIMEOUT_S,
            "memory": {"root": str(ram), "persist_every": 4, "slots": 2, "headroom_bytes": 0, "replicas": 1,
                       "replica_host": "127.0.0.1", "prepare_slots": False, **memory}}


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {f"r{rank}": {"w": torch.randn(64, 33, generator=g), "i": torch.randint(0, 99, (17,), generator=g)},
            "step": step}


def _targets(rank: int) -> dict:
    return {f"r{rank}": {"w": torch.full((64, 33), float("nan")), "i": torch.full((17,), -1, dtype=torch.int64)},
            "step": -1}


def _bad_keys(state: dict, step: int, rank: int) -> list[str]:
    """Keys of ``state`` that are not bit-exact those of ``_state(step, rank)``."""
    want = _state(step, rank)
    bad = [k for k in ("w", "i") if not torch.equal(state[f"r{rank}"][k].view(torch.uint8),
                                                    want[f"r{rank}"][k].view(torch.uint8))]
    return bad + (["step"] if state["step"] != step else [])


def _log() -> None:
    """The tier's log, timed, in the rank's log file (read when a test fails)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """(size, mtime_ns, sha256) of every file of the slots and replicas of a RAM root."""
    out = {}
    for d in sorted(list(root.glob("slot-*")) + list(root.glob("replica-*"))):
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            st = f.stat()
            out[str(f.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
    return out


def _slot_steps(tier) -> list[int | None]:
    from cpuckpt.backend.committed import check_complete

    return [check_complete(s).step for s in tier.slots]


def _die(report: dict, out: Path, name: str) -> None:
    """Write ``report``, then SIGKILL this trainer (the job is killed; its writers are the test's to kill)."""
    import torch.distributed as dist

    (out / f"{name}-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_writers(reports: list[dict], *, kill: bool = True) -> None:
    """SIGKILL the writers by pid (``kill``) and wait until their writer locks are free (they are gone)."""
    from cpuckpt.tier.ramroot import lock_holder

    for r in reports if kill else []:
        try:
            os.kill(r["writer_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for r in reports:
        while lock_holder(r["writer_lock"]) is not None:
            assert time.monotonic() < deadline, f"writer {r['writer_pid']} still holds {r['writer_lock']}"
            time.sleep(0.02)


def _killed(runner, fn, *args, tmp_path: Path) -> None:
    """Run ``fn`` on two ranks that end by SIGKILL (after their report)."""
    with pytest.raises(AssertionError, match="rank") as ei:
        runner(2, fn, *args, tmp_path=tmp_path, timeout_s=60)
    results = getattr(ei.value, "results", None)
    assert results is not None and all(results[r]["message"] == f"no result (exit code {-signal.SIGKILL})"
                                       for r in (0, 1)), ei.value


def _reports(out: Path, name: str, *, missing_ok: bool = False) -> list[dict]:
    files = [out / f"{name}-{r}.json" for r in (0, 1)]
    return [json.loads(f.read_text()) for f in files if not missing_ok or f.exists()]


# ------------------------------------------------------------------------- 1, 2: lagging replicas


def _lagging(durable: str, base: str, site: str) -> None:
    """Rank body: steps 1-4 replicated and step 4 persisted; the writers then hold every replica from step 5
    on; steps 5 and 6 committed in memory; find_latest and candidates mid-run; then the job is SIGKILLed."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    _log()

    rank = dist.get_rank()
    os.environ.update(faults.child_env(site, f"replicate:step5=wait:{site}/never"))  # the writers started now
    tier = MemoryTier(durable, _cfg(f"{base}/ram{rank}"))
    for step in range(1, 5):
        tier.save(_state(step, rank), step).wait()
    tier.wait_persisted()  # every replica of steps 1-4 and the persist of step 4 are done
    dist.barrier()
    replicated = {step: tier.replicated(step) for step in (3, 4)}
    for step in (5, 6):
        tier.save(_state(step, rank), step).wait()
    before = _snapshot(tier.root.path)
    latest = tier.find_latest()
    found = tier.candidates()
    dist.barrier()  # both ranks' queries are over: any restore one ran into the other's root is done
    after = _snapshot(tier.root.path)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    report = {"latest": str(latest), "latest_step": tier.step_of(latest), "slots": [str(s) for s in tier.slots],
              "found_steps": [tier.step_of(p) for p in found], "changed": changed, "slot_steps": _slot_steps(tier),
              "replicated": replicated, "replicated_5": tier.replicated(5), "writer_pid": tier.writer_pid(),
              "writer_lock": str(tier.root.writer_lock_path(rank))}
    maps = Path(f"/proc/{report['writer_pid']}/maps").read_text()  # it sent replicas of steps 1-4 and persisted 4
    report["writer_torch"] = "libtorch" in maps or "libc10" in maps
    _die(report, Path(base) / "out", "lag")


@pytest.fixture(scope="module")
def lagging_run(rank_runner, tmp_path_factory) -> tuple[list[dict], Path, Path]:
    """The run of :func:`_lagging`, SIGKILLed with its writers: (reports by rank, durable root, base)."""
    base = tmp_path_factory.mktemp("lagging")
    durable, out = base / "durable", base / "out"
    out.mkdir()
    try:
        _killed(rank_runner, _lagging, str(durable), str(base), str(base / "site"), tmp_path=base)
    finally:
        reports = _reports(out, "lag", missing_ok=True)
        _kill_writers(reports)
    return reports, durable, base


@pytest.mark.xdist_group("tier_restore_lagging")  # one lagging run (module fixture) for the three, not one per worker
def test_find_latest_mid_run_with_lagging_replicas_writes_nothing(lagging_run) -> None:
    reports, _, _ = lagging_run
    for rank, r in enumerate(reports):
        assert r["slot_steps"] == [5, 6], r
        assert r["replicated"] == {"3": True, "4": True} and r["replicated_5"] is False, r
        assert not r["changed"], f"rank {rank}: find_latest/candidates changed {r['changed'][:5]}"
        assert r["latest"] == r["slots"][1] and r["latest_step"] == 6, r
        assert r["found_steps"][:2] == [6, 5], r
        assert not r["writer_torch"], f"rank {rank}: the writer process that sent replicas loaded torch"


def _relaunch_newest(durable: str, base: str) -> None:
    """Rank body: the relaunch of :func:`_lagging` (writers clean); then the replicas owed since step 5 are
    sent to the new writers, and the job is SIGKILLed again."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    _log()
    os.environ.pop(faults.TEST_HOOK_ENV, None)  # the new writers run clean
    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(f"{base}/ram{rank}"))
    state = _targets(rank)
    path = tier.load_latest(state)
    report = {"path": str(path), "slots": [str(s) for s in tier.slots], "step": tier.step_of(path),
              "bad": _bad_keys(state, 6, rank), "slot_steps": _slot_steps(tier),
              "loads": [(str(p), st.nbytes) for p, st in tier.loads]}
    tier.wait_persisted()  # the earlier trainer's owed replicas of steps 5 and 6, re-requested for today's writers
    dist.barrier()
    report |= {"replicated": [tier.replicated(5), tier.replicated(6)], "writer_pid": tier.writer_pid(),
               "writer_lock": str(tier.root.writer_lock_path(rank))}
    _die(report, Path(base) / "out", "relaunch")


@pytest.fixture(scope="module")
def relaunched(rank_runner, lagging_run) -> tuple[list[dict], Path, Path]:
    """The relaunch of the lagging run, SIGKILLed again with its writers: (reports, durable root, base)."""
    _, durable, base = lagging_run
    try:
        _killed(rank_runner, _relaunch_newest, str(durable), str(base), tmp_path=base)
    finally:
        reports = _reports(base / "out", "relaunch", missing_ok=True)
        _kill_writers(reports)
    return reports, durable, base


@pytest.mark.xdist_group("tier_restore_lagging")  # one lagging run (module fixture) for the three, not one per worker
def test_relaunch_with_lagging_replicas_loads_the_newest_step_and_keeps_it(relaunched) -> None:
    reports, _, base = relaunched
    for rank, r in enumerate(reports):
        assert r["path"] == r["slots"][1] and r["step"] == 6, f"rank {rank} loaded {r['path']} (step {r['step']})"
        assert not r["bad"], f"rank {rank}: {r['bad']} differ from step 6"
        assert r["slot_steps"] == [5, 6], f"rank {rank}: the RAM root holds steps {r['slot_steps']} after the load"
        assert r["loads"] and all(p.startswith(str(base / f"ram{rank}")) for p, _ in r["loads"]), r["loads"]
        # the earlier trainer's owed replicas went to the relaunched writers (not to their old, dead ports)
        assert r["replicated"] == [True, True], f"rank {rank}: {r}"


# ---------------------------------------------------------------- 3: a stale restore after node loss


def _after_node_loss(durable: str, base: str) -> dict:
    """Rank body: node 1 lost its RAM root; step 6 comes back from node 0's replica (step 5 could too);
    step 7 is saved into slot-0, where the restore of step 5 was planned; slot-0 is loaded."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    _log()
    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(f"{base}/ram{rank}"))
    state = _targets(rank)
    path = tier.load_latest(state)
    out = {"path": str(path), "slots": [str(s) for s in tier.slots], "step": tier.step_of(path),
           "bad_first": _bad_keys(state, 6, rank), "loads": [str(p) for p, _ in tier.loads]}
    tier.save(_state(7, rank), 7).wait()
    again = _targets(rank)
    tier.load(again, tier.slots[0])
    out |= {"bad_second": _bad_keys(again, 7, rank), "second_step": tier.step_of(tier.slots[0])}
    tier.close(persist_newest=False)
    return out


@pytest.mark.xdist_group("tier_restore_lagging")  # one lagging run (module fixture) for the three, not one per worker
def test_a_planned_restore_is_dropped_once_its_slot_is_saved_into(rank_runner, relaunched, tmp_path) -> None:
    _, durable, base = relaunched
    shutil.rmtree(base / "ram1")  # node 1 lost its RAM (its writer is gone)
    res = rank_runner(2, _after_node_loss, str(durable), str(base), tmp_path=tmp_path, timeout_s=60)
    for rank, r in enumerate(res):
        assert r["path"] == r["slots"][1] and r["step"] == 6 and not r["bad_first"], r
        assert all(p.startswith(str(base / f"ram{rank}")) for p in r["loads"]), r["loads"]  # no durable reads
        assert r["second_step"] == 7 and not r["bad_second"], f"rank {rank}: loading slot-0 after step 7: {r}"


# ----------------------------------------------------------------------- 4: one rank's persist fails


def _persist_fails_on_rank1(durable: str, base: str, site: str) -> dict:
    import torch.distributed as dist

    from cpuckpt.errors import CpuckptError
    from cpuckpt.tier.memory import MemoryTier

    _log()

    rank = dist.get_rank()
    os.environ.update(faults.child_env(site, "unused=sleep:0"))  # the writers register the fault backends
    cfg = _cfg(f"{base}/ram", persist_every=1, replicas=0) | {"timeout_s": 120}
    if rank == 1:
        cfg["io"] = {**cfg["io"], "backend": "fault:ENOSPC@0"}  # rank 1's writer: every durable write fails
    tier = MemoryTier(durable, cfg)
    tier.save(_state(1, rank), 1).wait()  # its persist request starts this rank's writer
    # The writers' interpreter start is not close()'s to wait out: each rank waits until its writer has handled
    # the persist (rank 1's failed, rank 0's part written; the coordinator's writer then waits for rank 1's).
    deadline = time.monotonic() + 60
    done = (lambda: tier.queue.finished()) if rank == 1 else (
        lambda: (Path(durable) / "step_1" / "__0_.cpuckpt-part.json").exists())
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done(), f"rank {rank}: its writer did not handle the persist within 60 s"
    t0 = time.monotonic()
    error = None
    try:
        tier.close()
    except CpuckptError as e:
        error = (type(e).__name__, str(e))
    return {"error": error, "seconds": time.monotonic() - t0}


def test_close_raises_one_error_class_on_every_rank_promptly_when_one_persist_fails(run_ranks, tmp_path) -> None:
    res = run_ranks(2, _persist_fails_on_rank1, str(tmp_path / "durable"), str(tmp_path), str(tmp_path / "site"),
                    timeout_s=60)
    for rank, r in enumerate(res):
        assert r["error"] is not None and r["error"][0] == "PersistError", f"rank {rank}: {r}"
        assert r["seconds"] < 10, f"rank {rank}: close() took {r['seconds']:.1f} s (timeout_s 120)"
    assert "ENOSPC" in res[1]["error"][1] or "No space" in res[1]["error"][1], res[1]


def _writer_cannot_start_at_construction(durable: str, base: str) -> dict:
    """Rank body: two nodes with replicas (every rank's writer starts in the constructor); rank 1 cannot fork."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    if rank == 1:
        H.refuse_forks()  # this rank's process only
    t0 = time.monotonic()
    try:
        MemoryTier(durable, _cfg(f"{base}/ram{rank}"))
        error = None
    except Exception as e:  # reported to the test
        error = (type(e).__name__, str(e))
    return {"error": error, "seconds": time.monotonic() - t0}


def test_a_writer_that_cannot_start_at_construction_fails_it_on_every_rank_promptly(run_ranks, tmp_path) -> None:
    """With replicas across nodes the constructor starts every rank's writer; one that cannot start fails the
    constructor on every rank with WriterDiedError naming that rank, within seconds (before: that rank raised at once,
    the others waited in the replicas' set-up until the group's timeout, then raised another error), and rank 0's
    writer, started meanwhile, is stopped (the session's leak check)."""
    res = run_ranks(2, _writer_cannot_start_at_construction, str(tmp_path / "durable"), str(tmp_path), timeout_s=60)
    for rank, r in enumerate(res):
        assert r["error"] is not None and r["error"][0] == "WriterDiedError", f"rank {rank}: {r}"
        assert r["seconds"] < TIMEOUT_S / 2, f"rank {rank}: the constructor took {r['seconds']:.1f} s"
    assert "planted: cannot fork" in res[1]["error"][1], res[1]
    assert "rank 1's writer process could not be started" in res[0]["error"][1], res[0]


# ------------------------------------------------------------------------------------ 5: URL roots


def test_url_roots_are_refused(tmp_path: Path) -> None:
    from cpuckpt.errors import ConfigError
    from cpuckpt.tier.memory import MemoryTier

    with pytest.raises(ConfigError, match="memory tier durable root 'gs://bucket/run'"):  # s3:// is supported
        MemoryTier("gs://bucket/run", _cfg(tmp_path / "ram", replicas=0))
    with pytest.raises(ConfigError, match=r"memory\.root"):
        MemoryTier(tmp_path / "durable", _cfg("gs://bucket/ram", replicas=0))
    assert not (tmp_path / "ram").exists() and not (tmp_path / "durable").exists()


def _save_across_nodes(durable: str, tmp: str) -> None:
    """Rank body: each rank its own RAM root (two nodes), memory saves of steps 1-3, step 2 also saved durable;
    the RAM roots are kept at close, as a job that ends abruptly leaves them."""
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(tmp) / f"ram-{rank}", persist_every=0, replicas=0, slots=3))
    try:
        for step in (1, 2, 3):
            tier.save(_state(step, rank), step).wait()
            if step == 2:
                cpuckpt.save(_state(step, rank), Path(durable) / "step_2", step=2)
    finally:
        tier.close(persist_newest=False, remove_root=False)


def _relaunch_on_one_node(durable: str, tmp: str) -> dict:
    """Rank body: both ranks on node 0's RAM root now (the same world size, one node)."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(tmp) / "ram-0", persist_every=0, replicas=0, slots=3))
    try:
        listed = [str(p) for p in tier.candidates()]
        state = _targets(rank)
        loaded = tier.load_latest(state)
        return {"listed": listed, "loaded": str(loaded), "bad": _bad_keys(state, 2, rank)}
    finally:
        tier.close(persist_newest=False)


def test_a_relaunch_on_one_node_ignores_slots_saved_across_nodes(rank_runner, tmp_path: Path) -> None:
    """Node 0's slots of a run across two nodes hold rank 0's files only (``.metadata`` names rank 1's too): a
    relaunch of the same ranks on node 0 alone must not list them (its load would fail midway: a file missing),
    and loads the durable checkpoint instead."""
    durable = tmp_path / "durable"
    rank_runner(2, _save_across_nodes, str(durable), str(tmp_path), tmp_path=tmp_path, timeout_s=90)
    assert sorted(p.name for p in (tmp_path / "ram-0").rglob("__*_0.distcp")), "node 0 kept no slot"
    res = rank_runner(2, _relaunch_on_one_node, str(durable), str(tmp_path), tmp_path=tmp_path, timeout_s=90)
    for r in res:
        assert r["listed"] == [str(durable / "step_2")], r
        assert r["loaded"] == str(durable / "step_2") and not r["bad"], r


def _save_step_1_per_node(durable: str, base: str) -> None:
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(f"{base}/ram{rank}", persist_every=0, replicas=0))
    tier.save(_state(1, rank), 1).wait()
    tier.close(persist_newest=False, remove_root=False)


def _relaunch_with_ranks_swapped(durable: str, base: str) -> list:
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(f"{base}/ram{1 - rank}", persist_every=0, replicas=0))
    try:
        return [tier.load_latest(_targets(rank)), tier.find_latest()]
    finally:
        tier.close(persist_newest=False, remove_root=False)


def test_a_relaunch_that_moved_ranks_between_nodes_starts_from_scratch_every_time(run_ranks, tmp_path) -> None:
    """With no durable checkpoint, the memory checkpoint of a job whose ranks changed nodes is gone: each node's
    leader removes the images of ranks now elsewhere. Counted as a committed checkpoint damaged since, it made
    every relaunch raise CheckpointCorrupt (a crash loop); the slot's commit now goes with the images."""
    durable, base = str(tmp_path / "durable"), str(tmp_path)
    run_ranks(2, _save_step_1_per_node, durable, base, timeout_s=90)
    for _ in range(2):
        assert run_ranks(2, _relaunch_with_ranks_swapped, durable, base, timeout_s=90) == [[None, None]] * 2


# ----------------------------------------------------------------- 7: replicas of a node that left


def _with_a_departed_node(durable: str, base: str) -> dict:
    """Rank body: each RAM root holds a complete replica (step 5) of a node that is no longer in the job (planted
    before the tier opens: a node replaced after a crash). The first save (one of the two slots) keeps it: the
    other slot may still hold this node's part of a checkpoint it belongs to; the second removes it; today's
    partner's replica stays."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier
    from cpuckpt.tier.replica import replica_slots

    _log()
    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(f"{base}/ram{rank}", persist_every=0))
    departed = Path(f"{base}/ram{rank}") / "replica-departed"
    try:
        out = {"before": [source for source, _ in replica_slots(tier.root.path)]}
        tier.save(_state(1, rank), 1).wait()
        out["kept_after_one"] = departed.exists()
        tier.save(_state(2, rank), 2).wait()
        out["gone"] = not departed.exists()
        tier.wait_persisted()  # the replicas of steps 1 and 2 to the partner
        dist.barrier()
        out["after"] = [source for source, _ in replica_slots(tier.root.path)]
        return out
    finally:
        tier.close(persist_newest=False)


def test_replicas_of_a_node_that_left_are_removed_once_every_slot_was_saved_into(run_ranks, tmp_path) -> None:
    """A replica directory is kept per source node; one of a node that left the job (a new boot or RAM root is a
    new node key) received nothing more and was never removed: RAM beyond the bound for good. It goes once every
    own slot was saved into by this run (no checkpoint it belongs to can be assembled any more: this node's part
    is gone), not before; the current partner's replica stays."""
    import cpuckpt

    durable, base = str(tmp_path / "durable"), tmp_path
    for rank in (0, 1):
        departed = base / f"ram{rank}" / "replica-departed"
        cpuckpt.save({"w": torch.ones(8)}, departed / "slot-0", step=5)
        (departed / "source.json").write_text(json.dumps({"source": "gone-host:old-boot:/ram9"}))
        os.chmod(base / f"ram{rank}", 0o700)
    res = run_ranks(2, _with_a_departed_node, durable, str(base), timeout_s=90)
    for rank, r in enumerate(res):
        assert r["before"] == ["gone-host:old-boot:/ram9"] and r["kept_after_one"], (rank, r)
        assert r["gone"] and len(set(r["after"])) == 1 and r["after"][0] != "gone-host:old-boot:/ram9", (rank, r)
