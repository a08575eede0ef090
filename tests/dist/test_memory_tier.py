"""The memory tier on 2 real gloo ranks: memory commits, a writer process per rank, restart from memory.

What is proven, with real files, real processes and no mocks:

- every step is committed in memory (a complete, ordinary checkpoint directory in the RAM root that
  stock ``FileSystemReader`` loads), every 4th step is persisted to the durable root by the writer
  processes, and the trainers keep nothing of the persist on their path;
- trainers SIGKILLed right after a memory commit: their writers (own sessions) still finish the
  persist they owe and exit; a relaunch finds the newest memory checkpoint (newer than the newest
  durable one) and loads it bit-exact; the ring continues after it;
- trainers SIGKILLed in the middle of a save (after staging, before the memory commit): the torn
  slot is never chosen, the previous memory checkpoint is;
- ``close()``: the newest checkpoint is made durable, the writers exit, the RAM root is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import _helpers as H
import pytest
import torch

pytestmark = pytest.mark.timeout(240)


def _cfg(ram: Path, *, persist_every: int = 4, slots: int = 2) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"},
            "memory": {"root": str(ram), "persist_every": persist_every, "slots": slots, "headroom_bytes": 0},
            "timeout_s": 30}


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"r{rank}": {"w": torch.randn(300, 257, generator=g), "b": torch.randint(0, 9, (33,), generator=g)},
            "step": step}


def _targets(rank: int) -> dict:
    return {f"r{rank}": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)}, "step": -1}


def _train(durable: str, ram: str, steps: list[int], kill_after: int | None, kill_mid: bool = False) -> dict:
    """Rank body: memory save at every step of ``steps``; SIGKILL itself after ``kill_after``'s commit."""
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram)))
    out = {}
    for step in steps:
        h = tier.save(_state(step, rank), step)
        if kill_mid and step == kill_after:
            h.staged.wait()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # staged, maybe not committed: a torn memory save
        h.wait()
        if step == kill_after:
            dist.barrier()  # both committed in memory
            os.kill(os.getpid(), signal.SIGKILL)
    cpuckpt.wait_all()
    tier.close()
    out["removed"] = not Path(ram).exists() if rank == 0 else None
    return out


def _resume(durable: str, ram: str) -> dict:
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram)))
    latest = tier.find_latest()
    assert latest is not None, "nothing to resume from"
    state = _targets(rank)
    cpuckpt.load(state, latest)
    step = state["step"]
    H.assert_bitexact(state[f"r{rank}"]["w"], _state(step, rank)[f"r{rank}"]["w"], f"w of step {step}")
    H.assert_bitexact(state[f"r{rank}"]["b"], _state(step, rank)[f"r{rank}"]["b"], f"b of step {step}")
    in_memory = Path(ram) in latest.parents
    # the ring goes on after the checkpoint just loaded: the next save must not overwrite it
    h = tier.save(_state(step + 1, rank), step + 1)
    h.wait()
    assert (latest / ".metadata").exists(), "the loaded checkpoint was overwritten by the next save"
    tier.close()
    return {"step": step, "in_memory": in_memory, "path": str(latest)}


def _wait_writers_gone(ram: Path, timeout_s: float = 30.0) -> None:
    from cpuckpt.tier.persister import lock_held

    deadline = time.monotonic() + timeout_s
    while any(lock_held(p) for p in ram.glob(".writer-*.lock")):
        assert time.monotonic() < deadline, "writer processes still running after their trainers died"
        time.sleep(0.05)


def _close_idle(tier, **kw) -> None:
    """``close(persist_newest=False)`` of a tier that was never asked to persist: it never started a writer
    process (the writer starts at the first persist or replica request). A writer stopping gracefully at
    ``close()`` is proven by the tests that persist (persist every 4th, restart, SIGTERM)."""
    assert tier.writer_pid() is None, "a writer process started although no persist was requested"
    tier.close(persist_newest=False, **kw)


def _durable_steps(durable: Path) -> list[int]:
    import cpuckpt

    return [c.step for c in cpuckpt.list_checkpoints(durable) if c.complete]


def test_memory_commit_every_step_persist_every_fourth_and_clean_exit(run_ranks, tmp_path):
    import cpuckpt

    durable, ram = tmp_path / "durable", tmp_path / "ram"
    res = run_ranks(2, _train, str(durable), str(ram), list(range(1, 10)), None)
    assert res[0]["removed"] is True, "close() did not remove the RAM root"
    # persisted: 4 and 8 by the ring, 9 (the newest) by close()
    assert _durable_steps(durable) == [4, 8, 9]
    for step in (4, 8, 9):
        path = durable / f"step_{step}"
        H.assert_committed_layout(path, 2)
        state = {"r0": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)},
                 "r1": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)}, "step": -1}
        cpuckpt.load(state, path)
        assert state["step"] == step
        for r in (0, 1):
            H.assert_bitexact(state[f"r{r}"]["w"], _state(step, r)[f"r{r}"]["w"], f"durable step {step} rank {r}")


def test_trainers_killed_after_a_memory_commit_writers_finish_and_restart_loads_memory(run_ranks, tmp_path):
    durable, ram = tmp_path / "durable", tmp_path / "ram"
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(2, _train, str(durable), str(ram), list(range(1, 10)), 7)
    _wait_writers_gone(ram)
    # step 4 was owed (persist_every 4) and finished by the orphaned writers; nothing newer is durable
    assert _durable_steps(durable) == [4]
    # the memory checkpoint of step 7 is an ordinary checkpoint: stock DCP reads it
    import torch.distributed.checkpoint as dcp

    from cpuckpt.backend.committed import check_complete

    # the newest by the step its manifest records (two commits' .metadata mtimes can tie on a coarse clock)
    slots = {p: check_complete(p) for p in ram.glob("slot-*")}
    newest = max((p for p, c in slots.items() if c.complete), key=lambda p: slots[p].step)
    stock = {"r0": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)}, "step": -1}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(newest)))
    assert stock["step"] == 7
    H.assert_bitexact(stock["r0"]["w"], _state(7, 0)["r0"]["w"], "stock read of the memory checkpoint")

    res = run_ranks(2, _resume, str(durable), str(ram))
    assert [r["step"] for r in res] == [7, 7] and all(r["in_memory"] for r in res), res
    # close() after the resume persisted its newest save (step 8)
    assert _durable_steps(durable) == [4, 8]


def test_a_torn_memory_save_is_never_chosen(run_ranks, tmp_path):
    durable, ram = tmp_path / "durable", tmp_path / "ram"
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(2, _train, str(durable), str(ram), [1, 2, 3], 3, True)
    _wait_writers_gone(ram)
    res = run_ranks(2, _resume, str(durable), str(ram))
    # step 3 may or may not have committed before the kill; a torn one is never loaded (the load is bit-exact)
    assert {r["step"] for r in res} <= {2, 3} and len({r["step"] for r in res}) == 1, res


# ------------------------------------------------------------------ one process (no process group)


def _one(tmp_path: Path, **memory) -> tuple:
    from cpuckpt.tier.memory import MemoryTier

    cfg = _cfg(tmp_path / "ram")
    cfg["memory"].update(memory)
    return MemoryTier(tmp_path / "durable", cfg), cfg


def _writer_children() -> list[int]:
    """Pids of this test process's children that are memory-tier writer processes."""
    psutil = pytest.importorskip("psutil")
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "cpuckpt.tier.persister" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
    return found


def test_no_writer_process_starts_until_the_first_persist_request(tmp_path):
    """``MemoryTier()`` starts no process: with ``persist_every: 0`` and no replicas, saves never start a writer;
    the first persist request does (counted as alive from then on), and ``close()`` ends it."""
    tier, _ = _one(tmp_path, persist_every=0)
    assert _writer_children() == [] and tier.writer_pid() is None
    for step in (1, 2, 3):
        tier.save(_state(step, 0), step).wait()
    assert _writer_children() == [] and tier.writer_pid() is None, "a save that persists nothing started a writer"
    tier.save(_state(4, 0), 4, persist=True).wait()
    deadline = time.monotonic() + 10  # its /proc entry is read while it starts: look again for a moment
    while len(children := _writer_children()) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) == 1 and tier.writer_pid() == children[0], (children, tier.writer_pid())
    tier.wait_persisted()
    assert _durable_steps(tmp_path / "durable") == [4]
    # the writer copied and committed without torch: no libtorch mapped; the durable .metadata names its own
    # directory (the slot's pickle renamed by format.metapickle.with_checkpoint_id, not unpickled)
    maps = Path(f"/proc/{children[0]}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps, "the writer process loaded torch"
    import cpuckpt
    from cpuckpt.backend.committed import load_metadata

    [durable] = [c.path for c in cpuckpt.list_checkpoints(tmp_path / "durable") if c.complete]
    assert load_metadata(Path(durable)).storage_meta.checkpoint_id == str(durable)
    tier.close(persist_newest=False)
    assert _writer_children() == [], "close() left the writer process running"


class _MarkedFiles:
    """A file-set format (what the DeepSpeed adapter's tags are, in small): any files plus ``done.json``, a marker
    with the save id and the step; the durable root holds one such directory per checkpoint."""

    def committed(self, directory: Path):
        from cpuckpt.tier.formats import Committed, read_marker_json

        data = read_marker_json(directory / "done.json")
        return Committed(data.get("global_step"), data["save_id"]) if data and "save_id" in data else None

    def durable(self, root: Path) -> list:
        from cpuckpt.tier.formats import Durable

        return [Durable(c.step, d, c.step) for d in (sorted(root.iterdir()) if root.is_dir() else [])
                if d.is_dir() and (c := self.committed(d)) is not None and c.step is not None]


def _file_set(tier, step: int, payload: bytes, *, latest: Path) -> tuple:
    """One file-set checkpoint of ``step``: claimed, filled, committed in memory (marker last), then handed over."""
    import json

    from cpuckpt.format.manifest import FileEntry

    slot, save_id = tier.claim_slot(step)
    (slot / "done.json").unlink(missing_ok=True)
    (slot / "w.bin").write_bytes(payload)
    (slot / "done.json").write_text(json.dumps({"save_id": save_id, "global_step": step}))
    entry = FileEntry(name="w.bin", nbytes=len(payload), chunk_bytes=64 << 10, checksum="none")
    return tier.commit_files(slot, save_id, step, tier.durable_root / f"t{step}", files={"w.bin": entry},
                             marker="done.json", saving=".saving", pointer=(latest, f"t{step}")), slot


def test_a_file_set_is_persisted_marker_last_and_never_moves_the_pointer_back(tmp_path):
    """``claim_slot``/``commit_files`` (an adapter's own files): due steps are persisted by the writer, files first,
    then the marker, then the pointer; odd steps stay in memory; a pointer naming a newer step is left alone;
    ``close()`` persists the newest; ``candidates`` orders both tiers by step through the format."""
    import json

    from cpuckpt.tier.memory import MemoryTier

    durable = tmp_path / "durable"
    cfg = _cfg(tmp_path / "ram", persist_every=2)
    tier = MemoryTier(durable, cfg, slot_format=_MarkedFiles())
    latest = durable / "latest"
    req, _ = _file_set(tier, 2, b"two" * 1000, latest=latest)
    assert req is not None and tier.writer_pid() is not None
    assert _file_set(tier, 3, b"three" * 1000, latest=latest)[0] is None  # not due: memory only
    tier.wait_persisted()
    assert sorted(p.name for p in (durable / "t2").iterdir()) == ["done.json", "w.bin"]  # no .saving, no parts
    assert (durable / "t2" / "w.bin").read_bytes() == b"two" * 1000 and latest.read_text() == "t2"
    assert tier.persisted(2) and not tier.persisted(3) and not (durable / "t3").exists()
    assert [p.name for p in tier.candidates()] == ["slot-1", "slot-0", "t2"]  # by step; memory first on a tie
    (durable / "t9").mkdir()
    (durable / "t9" / "done.json").write_text(json.dumps({"save_id": "elsewhere", "global_step": 9}))
    latest.write_text("t9")  # a newer checkpoint, committed durably by someone else
    _file_set(tier, 4, b"four" * 1000, latest=latest)
    _file_set(tier, 5, b"five" * 1000, latest=latest)
    tier.close()  # persists the newest (5)
    assert (durable / "t4" / "w.bin").read_bytes() == b"four" * 1000
    assert (durable / "t5" / "w.bin").read_bytes() == b"five" * 1000 and (durable / "t5" / "done.json").exists()
    assert latest.read_text() == "t9", "a persist moved the pointer back to an older step"


def test_a_ram_root_too_small_is_a_clear_error_and_loses_nothing(tmp_path):
    import cpuckpt
    from cpuckpt.tier.ramroot import RamRootError

    tier, _ = _one(tmp_path)
    tier.save(_state(1, 0), 1).wait()
    free = os.statvfs(tier.root.path).f_bavail * os.statvfs(tier.root.path).f_frsize
    tier.root.headroom_bytes = free - 100_000  # the next, larger image cannot keep the headroom
    big = {"r0": {"w": torch.randn(600, 257), "b": torch.arange(33)}, "step": 2}
    with pytest.raises(RamRootError, match="headroom"):
        tier.save(big, 2).wait()
    latest = tier.find_latest()
    assert tier.step_of(latest) == 1
    out = _targets(0)
    cpuckpt.load(out, latest)
    H.assert_bitexact(out["r0"]["w"], _state(1, 0)["r0"]["w"], "step 1 after the refused save")
    tier.root.headroom_bytes = 0
    tier.close()


def test_a_dead_writer_owing_persists_raises_or_is_respawned(tmp_path):
    import cpuckpt
    from cpuckpt.tier.memory import WriterDiedError

    # both tiers first: their writers' interpreters start at the same time
    tiers = {mode: _one(tmp_path / mode, persist_every=1, on_writer_failure=mode)[0] for mode in ("raise", "respawn")}
    for mode, tier in tiers.items():
        base = tmp_path / mode
        tier.save(_state(1, 0), 1).wait()
        tier.wait_persisted()
        pid = tier.writer_pid()
        os.kill(pid, signal.SIGSTOP)  # it cannot take the next request...
        tier.save(_state(2, 0), 2).wait()
        assert tier.queue.owed(), "the persist of step 2 should be owed"
        os.kill(pid, signal.SIGKILL)  # ...and dies owing it
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while tier.root.writer_alive(0) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        if mode == "raise":
            with pytest.raises(WriterDiedError, match="died owing persists"):
                tier.save(_state(3, 0), 3)
            assert not cpuckpt.find_latest(base / "durable").name.endswith("_2")
            tier.root.close()
            continue
        tier.save(_state(3, 0), 3).wait()  # a new writer redoes step 2, then takes step 3
        tier.wait_persisted()
        assert _durable_steps(base / "durable") == [1, 2, 3]
        tier.close()


def test_the_ram_root_of_another_job_is_refused(tmp_path):
    from cpuckpt.tier.ramroot import RamRoot, RamRootError

    other = RamRoot.open(tmp_path / "ram", "someone-elses-job", 0, headroom_bytes=0)
    other.close()
    with pytest.raises(RamRootError, match="someone-elses-job"):
        _one(tmp_path, job="my-job")


def test_a_ram_root_of_another_durable_root_is_refused_for_the_same_job_name(tmp_path):
    """Two experiments given one ``memory.job`` (from ``$SLURM_JOB_NAME``, say), each its own durable root: the
    second is refused with an error naming both roots, never resumed from the first's memory checkpoint (before: it
    loaded the other experiment's step and adopted its owed persists); its own durable root reopens it."""
    from cpuckpt.tier.memory import MemoryTier
    from cpuckpt.tier.ramroot import RamRootError

    cfg = _cfg(tmp_path / "ram")
    cfg["memory"].update(job="train", persist_every=0)
    a = MemoryTier(tmp_path / "experiment-A", cfg)
    a.save(_state(5, 0), 5).wait()
    a.abandon()  # experiment A dies; its RAM root stays
    with pytest.raises(RamRootError, match=rf"{tmp_path / 'experiment-A'}.*not of {tmp_path / 'experiment-B'}"):
        MemoryTier(tmp_path / "experiment-B", cfg)
    (tmp_path / "link-to-A").symlink_to(tmp_path / "experiment-A")
    again = MemoryTier(tmp_path / "link-to-A", cfg)  # the same directory by another path: the same job
    target = _targets(0)
    assert again.step_of(again.load_latest(target)) == 5
    again.abandon()

    # a record an earlier version wrote (no durable root in it) is accepted, and names the root from then on
    record = tmp_path / "ram" / ".owner.json"
    fields = json.loads(record.read_text())
    del fields["durable"]
    record.write_text(json.dumps(fields))
    again = MemoryTier(tmp_path / "experiment-A", cfg)
    again.abandon()
    assert json.loads(record.read_text())["durable"] == str((tmp_path / "experiment-A").resolve())
    with pytest.raises(RamRootError, match=r"two jobs were given one memory\.job"):
        MemoryTier(tmp_path / "experiment-B", cfg)
    again = MemoryTier(tmp_path / "experiment-A", cfg)
    _close_idle(again)


def test_memory_use_stays_flat_over_200_saves(tmp_path):
    """Trainer + writer RSS and the RAM root's bytes after 200 saves vs after 50 (persist every 4th).

    The baseline is taken once the queue keeps its bounded history (the newest 8 finished requests)."""
    psutil = pytest.importorskip("psutil")
    tier, _ = _one(tmp_path, persist_every=4)
    me = psutil.Process()

    def usage() -> tuple[int, int]:
        writer = psutil.Process(tier.writer_pid())  # started by the first persist (step 4)
        import ctypes
        import gc

        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap handed back: RSS then measures what is held
        rss = me.memory_info().rss + writer.memory_info().rss
        ram = sum(f.stat().st_blocks * 512 for f in tier.root.path.rglob("*") if f.is_file())
        return rss, ram

    samples = {}
    for step in range(1, 201):
        tier.save(_state(step % 7, 0) | {"step": step}, step).wait()
        if step in (50, 200):
            tier.wait_persisted()
            samples[step] = usage()
    (rss50, ram50), (rss200, ram200) = samples[50], samples[200]
    assert abs(rss200 - rss50) <= 0.02 * rss50, f"RSS {rss50} -> {rss200}"
    assert abs(ram200 - ram50) <= 0.02 * ram50, f"RAM root {ram50} -> {ram200}"
    assert _durable_steps(tmp_path / "durable") == list(range(4, 201, 4))
    tier.close()


def test_restart_falls_back_past_a_checkpoint_that_does_not_verify(tmp_path, caplog):
    import cpuckpt

    tier, _ = _one(tmp_path, persist_every=1)
    for step in (1, 2, 3):
        tier.save(_state(step, 0), step).wait()
    tier.close()  # RAM root removed: only the durable copies remain
    newest = tmp_path / "durable" / "step_3" / "__0_0.distcp"
    with open(newest, "r+b") as f:  # one flipped byte inside the tensor data
        f.seek(newest.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    tier, _ = _one(tmp_path, persist_every=1)
    out = _targets(0)
    with caplog.at_level("WARNING", logger="cpuckpt.tier.memory"):
        path = tier.load_latest(out)
    assert path == tmp_path / "durable" / "step_2" and out["step"] == 2
    H.assert_bitexact(out["r0"]["w"], _state(2, 0)["r0"]["w"], "fallback load")
    assert "step_3" in caplog.text and "checksum" in caplog.text
    _close_idle(tier)  # this tier's writer was never needed
    assert cpuckpt.find_latest(tmp_path / "durable").name == "step_3"  # damaged data is not a commit marker


def _rewound(step: int) -> dict:
    """What a job that rewound (a loss spike: it reloaded an older checkpoint) saves at ``step``: not ``_state``."""
    return {"r0": _state(step, 7)["r7"], "step": step}


def test_a_restart_after_a_rewind_loads_the_newer_save_of_the_same_step(tmp_path):
    """Steps 4, 5, 6 in slots 0-2; the job rewinds to the durable step 4 and saves 5 and 6 again (slots 0, 1): the
    restart loads the later save of step 6 (slot-1), not the abandoned one left in slot-2 (before: ordered by the
    slot's name, slot-2 won and the restart trained on from the abandoned trajectory)."""
    tier, _ = _one(tmp_path, persist_every=4, slots=3)
    for step in (4, 5, 6):
        tier.save(_state(step, 0), step).wait()
    tier.wait_persisted()
    rewind = tmp_path / "durable" / "step_4"
    tier.load(_targets(0), rewind)
    tier.resume_after(rewind)
    for step in (5, 6):
        tier.save(_rewound(step), step).wait()
    assert [tier.step_of(s) for s in tier.slots] == [5, 6, 6]
    tier.close(persist_newest=False, remove_root=False)  # the job dies here; its RAM root stays

    tier, _ = _one(tmp_path, persist_every=4, slots=3)
    out = _targets(0)
    path = tier.load_latest(out)
    assert path == tier.slots[1] and out["step"] == 6, path
    H.assert_bitexact(out["r0"]["w"], _rewound(6)["r0"]["w"], "the newer save of step 6")
    assert tier.candidates()[:2] == [tier.slots[1], tier.slots[2]]  # the same step: the later commit first
    _close_idle(tier)


def _durable_commit_between_scans(durable: str, ram: str) -> dict:
    """Rank body: durable steps 4 and 8, step 8's commit (``.metadata``, written last) landing after rank 0 listed
    the durable root and before rank 1 did (an adopted writer of the killed trainer finishing its persist)."""
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank, d = dist.get_rank(), Path(durable)
    for step in (4, 8):
        cpuckpt.save(_state(step, rank), d / f"step_{step}", step=step)
    dist.barrier()
    if rank == 0:  # step 8 is being persisted: every file there but its commit
        os.rename(d / "step_8" / ".metadata", d / ".metadata-of-step-8")
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=0))  # a relaunch: nothing in memory
    dist.barrier()
    listed = d / ".rank-0-listed"
    if rank == 0:  # rank 0 lists before step 8's commit lands, rank 1 after
        own = tier._listing
        tier._listing = lambda *a, **k: (own(*a, **k), listed.touch())[0]  # type: ignore[method-assign]
    else:
        deadline = time.monotonic() + 60
        while not listed.exists():
            assert time.monotonic() < deadline, "rank 0 never listed"
            time.sleep(0.01)
        os.rename(d / ".metadata-of-step-8", d / "step_8" / ".metadata")
    out = _targets(rank)
    path = tier.load_latest(out)
    _close_idle(tier)
    return {"path": str(path), "step": out["step"]}


def test_ranks_load_the_same_checkpoint_when_a_durable_commit_lands_between_their_scans(run_ranks, tmp_path):
    """load_latest takes rank 0's list of candidates on every rank (before: each rank listed the durable root on its
    own, and rank 1 loaded step 8 while rank 0 loaded step 4)."""
    res = run_ranks(2, _durable_commit_between_scans, str(tmp_path / "durable"), str(tmp_path / "ram"), timeout_s=90)
    assert res[0] == res[1] == {"path": str(tmp_path / "durable" / "step_4"), "step": 4}, res


def test_a_memory_checkpoint_of_this_process_loads_from_its_images_without_reading(tmp_path, monkeypatch):
    from cpuckpt.transfer import files

    tier, _ = _one(tmp_path)
    tier.save(_state(5, 0), 5).wait()
    path = tier.find_latest()

    def no_reads(*args, **kwargs):
        raise AssertionError("a file was read")

    monkeypatch.setattr(files.BufferedFileBackend, "pread_into", no_reads)
    out = _targets(0)
    tier.load(out, path)  # copies from the mapped image: no pread
    assert out["step"] == 5
    H.assert_bitexact(out["r0"]["w"], _state(5, 0)["r0"]["w"], "load from the image")
    H.assert_bitexact(out["r0"]["b"], _state(5, 0)["r0"]["b"], "load from the image")
    import cpuckpt

    with pytest.raises(Exception, match="a file was read"):  # the ordinary reader does read the files
        cpuckpt.load(_targets(0), path)
    monkeypatch.undo()
    tier.close()


def _train_then_die_owing(durable: str, ram: str, pids_file: str) -> None:
    """Rank body: steps 1-4 (1 persisted), the writer frozen before step 4's persist; the trainer dies owing it."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram)))
    tier.save(_state(1, rank), 1, persist=True).wait()  # the first persist request starts the writer
    tier.wait_persisted()
    for step in (2, 3):
        tier.save(_state(step, rank), step).wait()
    writer = tier.writer_pid()
    os.kill(writer, signal.SIGSTOP)
    tier.save(_state(4, rank), 4).wait()  # committed in memory; its persist is owed to a frozen writer
    assert tier.queue.owed(), "step 4's persist should be owed"
    with open(f"{pids_file}.{rank}", "w") as f:
        f.write(str(writer))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_trainer_killed_while_its_persist_is_owed_the_writer_finishes_it(run_ranks, tmp_path):
    durable, ram, pids = tmp_path / "durable", tmp_path / "ram", tmp_path / "writer.pid"
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(2, _train_then_die_owing, str(durable), str(ram), str(pids))
    assert _durable_steps(durable) == [1]  # nothing more persisted yet: both writers are frozen
    for r in (0, 1):
        os.kill(int(Path(f"{pids}.{r}").read_text()), signal.SIGCONT)
    _wait_writers_gone(ram)  # trainers gone: each writer finishes what it owed, then exits
    logs = {str(p.relative_to(ram)): p.read_text()[-3000:] for p in ram.rglob("*.log")} if ram.exists() else {}
    assert _durable_steps(durable) == [1, 4], logs  # (failed once in CI, 1 of ~12 runs: the writers' logs)
    import cpuckpt

    out = {"r0": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)},
           "r1": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)}, "step": -1}
    cpuckpt.load(out, durable / "step_4")
    for r in (0, 1):
        H.assert_bitexact(out[f"r{r}"]["w"], _state(4, r)[f"r{r}"]["w"], f"persisted after the trainer died, rank {r}")


def test_close_persists_the_newest_save_when_the_durable_step_is_another_saves(tmp_path):
    """Run 1 ends at step 6 (4 persisted, 6 by close); run 2 rewinds to step 4 and saves 5 and 6 again: its close
    persists its own step 6 (before: a durable step 6 of any save counted, run 2's final state was lost with the RAM
    root, and the next restart loaded run 1's step 6)."""
    import cpuckpt

    tier, _ = _one(tmp_path, persist_every=4)
    for step in range(1, 7):
        tier.save(_state(step, 0), step).wait()
    tier.close()
    assert _durable_steps(tmp_path / "durable") == [4, 6]

    tier, _ = _one(tmp_path, persist_every=4)
    tier.load(_targets(0), tmp_path / "durable" / "step_4")
    for step in (5, 6):
        tier.save(_rewound(step), step).wait()
    tier.close()
    out = _targets(0)
    assert cpuckpt.load_latest(out, tmp_path / "durable") == tmp_path / "durable" / "step_6"
    H.assert_bitexact(out["r0"]["w"], _rewound(6)["r0"]["w"], "run 2's step 6, persisted at close")


def test_sigterm_makes_the_newest_memory_checkpoint_durable_then_chains(tmp_path):
    tier, _ = _one(tmp_path, persist_every=4)
    chained = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    try:
        previous = tier.install_sigterm_handler(grace_s=20)
        assert callable(previous)
        for step in (1, 2, 3):
            tier.save(_state(step, 0), step).wait()
        assert _durable_steps(tmp_path / "durable") == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs on the main thread at the next bytecode
        assert chained == [signal.SIGTERM], "the trainer's own handler must still run"
        assert _durable_steps(tmp_path / "durable") == [3]  # persisted from memory within the grace period
    finally:
        signal.signal(signal.SIGTERM, before)
    tier.close()
    assert _durable_steps(tmp_path / "durable") == [3]  # close() does not persist it twice


# --------------------------------------------------------------- the writer's commit rules, directly


def _request(tier, slot: Path, step: int, *, world_size: int = 1, timeout_s: float = 30.0):
    import dataclasses

    from cpuckpt.backend.committed import read_manifest

    req = tier._persist_request(slot, read_manifest(slot).save_id, step, tier.durable_root / f"step_{step}")
    cfg = dict(req.config, timeout_s=timeout_s)
    return dataclasses.replace(req, world_size=world_size, config=cfg, seq=req.seq + 1000)


def test_the_coordinator_never_commits_a_part_left_by_another_save(tmp_path):
    import json

    from cpuckpt.tier.persister import persist_one

    tier, _ = _one(tmp_path, persist_every=0)
    tier.save(_state(6, 0), 6).wait()
    slot = tier.find_latest()
    dest = tmp_path / "durable" / "step_6"
    dest.mkdir(parents=True)
    stale = {"format": "cpuckpt", "save_id": "an-earlier-attempt", "files": {}}
    (dest / "__1_.cpuckpt-part.json").write_text(json.dumps(stale))  # rank 1's part of a failed earlier try
    out = persist_one(_request(tier, slot, 6, world_size=2, timeout_s=1.0))
    assert not out.ok and "never arrived" in out.error, out
    assert _durable_steps(tmp_path / "durable") == []
    _close_idle(tier)


def test_a_redone_persist_keeps_the_durable_commit(tmp_path):
    from cpuckpt.tier.persister import persist_one

    tier, _ = _one(tmp_path, persist_every=0)
    tier.save(_state(8, 0), 8).wait()
    req = _request(tier, tier.find_latest(), 8)
    assert persist_one(req).ok and _durable_steps(tmp_path / "durable") == [8]
    again = persist_one(req)  # a writer that died after committing, before its outcome file: redone
    assert again.ok and again.nbytes == 0, again
    assert _durable_steps(tmp_path / "durable") == [8]
    _close_idle(tier)


def test_a_failed_persist_is_reported_even_after_a_newer_cancelled_one(tmp_path):
    from cpuckpt.tier.queue import Outcome

    tier, _ = _one(tmp_path, persist_every=0)
    tier.queue.finish(Outcome(6, False, error="cancelled: the memory save failed"))
    assert tier._new_persist_failures() == []
    tier.queue.finish(Outcome(5, False, error="StorageIOError: no space left"))  # finished later, lower seq
    assert tier._new_persist_failures() == ["persist request 5 failed: StorageIOError: no space left"]
    _close_idle(tier)


def test_a_restart_withdraws_requests_whose_save_never_committed(tmp_path):
    from cpuckpt.tier.queue import PersistQueue, PersistRequest

    tier, cfg = _one(tmp_path, persist_every=0)
    tier.root.close()  # the trainer "died" (it never started a writer); a request for a save that never committed
    # stays owed
    q = PersistQueue(tmp_path / "ram" / "queue-0")
    q.put(PersistRequest(seq=1, slot=str(tmp_path / "ram" / "slot-0"), save_id="never-committed", step=1,
                         dest=str(tmp_path / "durable" / "step_1"), rank=0, world_size=1, coordinator=True,
                         config=cfg, trainer_pid=1, trainer_lock=str(tmp_path / "ram" / ".rank-0.lock")))
    assert [r.seq for r in q.owed()] == [1]
    tier, _ = _one(tmp_path, persist_every=0)
    assert q.owed() == [] and "never committed" in q.outcome(1).error
    _close_idle(tier)


def test_one_job_at_a_time_fills_a_set_of_images(tmp_path, monkeypatch):
    """A save into a slot waits for the previous save into that slot, even one still copying."""
    from cpuckpt.config import Config
    from cpuckpt.transfer import save_job as engine

    real = engine.fill_chunk
    gate = threading.Event()  # every fill waits for it: save 1 cannot finish before the test opens it

    def gated_fill(*args, **kwargs):
        if not gate.wait(60):
            raise RuntimeError("the test never opened the gate")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "fill_chunk", gated_fill)
    tier, _ = _one(tmp_path, slots=1, persist_every=0)
    # two saves may be in flight, and there is one slot: only the images' own rule keeps them apart
    tier.memory_config = Config.from_dict({**tier.memory_config.to_dict(), "async": {"max_in_flight": 2}})
    h1 = tier.save(_state(1, 0), 1)
    assert not h1._writer.job.done.done(), "save 1 finished although none of its chunks was filled"
    # Save 2 is started with save 1 still filling. The gate opens 0.5 s later, while save 2 waits for save 1: a
    # save 2 that did not wait returns before then, with save 1 still unfinished.
    opener = threading.Timer(0.5, gate.set)
    opener.start()
    try:
        h2 = tier.save(_state(2, 0), 2)
        first_done = h1._writer.job.done.done()
    finally:
        opener.cancel()
        gate.set()
    assert first_done, "save 2 started while save 1 was still filling the slot"
    h2.wait()
    out = _targets(0)
    tier.load(out, tier.find_latest())
    assert out["step"] == 2
    H.assert_bitexact(out["r0"]["w"], _state(2, 0)["r0"]["w"], "the slot after two overlapping saves")
    _close_idle(tier)


def test_a_restart_removes_images_no_checkpoint_can_use(tmp_path):
    tier, _ = _one(tmp_path, persist_every=0)
    tier.save(_state(1, 0), 1).wait()
    slot = tier.find_latest()
    _close_idle(tier, remove_root=False)
    (slot / "__3_0.distcp").write_bytes(b"x" * 4096)  # a rank the job no longer has
    (slot / "__0_1.distcp").write_bytes(b"x" * 4096)  # a file of an older layout of this rank
    tier, _ = _one(tmp_path, persist_every=0)
    assert sorted(p.name for p in slot.glob("*.distcp")) == ["__0_0.distcp"]
    out = _targets(0)
    tier.load(out, tier.find_latest())  # the committed checkpoint is untouched
    H.assert_bitexact(out["r0"]["w"], _state(1, 0)["r0"]["w"], "after the clean-up")
    _close_idle(tier)


def _two_nodes(durable: str, ram_base: str) -> dict:
    """Rank body: each rank its own RAM root (two nodes on one host); step 1 durable, step 2 in memory only.

    ``shared`` is the same on both ranks: DCP would write it into one rank's file, the tier writes it once
    per node, so each node's slot holds it. A rank that loads the *other* rank's part needs a file only
    the other node holds: then the newest durable checkpoint is chosen.
    """
    import torch.distributed as dist

    from cpuckpt.backend.committed import read_manifest
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    ram = Path(ram_base) / f"node{rank}"
    tier = MemoryTier(durable, _cfg(ram, persist_every=0))

    def state(step: int, *, shared: bool) -> dict:
        own = {f"r{rank}": {**_state(step, rank)[f"r{rank}"], "step": step}}
        return own | ({"shared": torch.arange(1000.0) * step} if shared else {})

    def targets(*, shared: bool) -> dict:
        own = {f"r{rank}": {**_targets(rank)[f"r{rank}"], "step": -1}}
        return own | ({"shared": torch.empty(1000)} if shared else {})

    tier.save(state(1, shared=True), 1, persist=True).wait()
    tier.wait_persisted()
    tier.save(state(2, shared=True), 2).wait()
    out: dict = {"nodes": tier.nodes.nodes, "slot": str(tier.slots[1]),
                 "files": sorted(read_manifest(tier.slots[1]).files)}
    out["own_rule"] = [str(p) for p in tier.candidates()]
    other = 1 - rank
    with_shared = targets(shared=True)
    cross = targets(shared=False) | {f"r{other}": {**_targets(other)[f"r{other}"], "step": -1}}
    out["with_shared"] = str(tier.load_latest(with_shared))
    expect = state(2, shared=True)
    for key in ("w", "b"):
        H.assert_bitexact(with_shared[f"r{rank}"][key], expect[f"r{rank}"][key], f"rank {rank} memory {key}")
    H.assert_bitexact(with_shared["shared"], expect["shared"], f"rank {rank} memory shared (its node's copy)")
    out["cross"] = str(tier.load_latest(cross))
    for key in ("w", "b"):
        H.assert_bitexact(cross[f"r{other}"][key], _state(1, other)[f"r{other}"][key],
                          f"rank {rank} durable: rank {other}'s {key}")
    out["steps"] = (with_shared[f"r{rank}"]["step"], cross[f"r{rank}"]["step"])
    tier.close(persist_newest=False)
    out["removed"] = not ram.exists()
    return out


def test_ranks_in_separate_ram_roots_commit_per_node_and_restart_where_every_node_holds_what_it_needs(
        run_ranks, tmp_path):
    """Two RAM roots are two nodes: each node's slot is committed with only its ranks' files, and a memory
    checkpoint is chosen only when every rank's node holds the files that rank's load plan reads."""
    durable, ram = tmp_path / "durable", tmp_path / "ram"
    res = run_ranks(2, _two_nodes, str(durable), str(ram))
    for rank, r in enumerate(res):
        assert r["nodes"] == 2, r
        assert r["files"] and all(f.startswith(f"__{rank}_") for f in r["files"]), f"rank {rank}: {r['files']}"
        assert r["own_rule"][0] == r["slot"], f"rank {rank}: own files are in memory: {r['own_rule']}"
        assert r["with_shared"] == r["slot"], f"rank {rank}: {r['with_shared']}"
        assert r["cross"] == str(durable / "step_1"), f"rank {rank}: {r['cross']}"
        assert r["steps"] == (2, 1), r
        assert r["removed"], f"rank {rank}: its node's RAM root was not removed at close"


def test_restart_where_no_checkpoint_verifies_raises_instead_of_starting_from_scratch(tmp_path):
    tier, _ = _one(tmp_path, persist_every=1)
    for step in (1, 2):
        tier.save(_state(step, 0), step).wait()
    tier.close()  # RAM root removed: only the durable copies remain
    for step in (1, 2):
        data = tmp_path / "durable" / f"step_{step}" / "__0_0.distcp"
        with open(data, "r+b") as f:  # one flipped byte inside each checkpoint's tensor data
            f.seek(data.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    from cpuckpt.errors import CheckpointCorrupt

    tier, _ = _one(tmp_path, persist_every=1)
    with pytest.raises(CheckpointCorrupt, match=r"step_2.*step_1|loads cleanly"):
        tier.load_latest(_targets(0))
    _close_idle(tier)


@pytest.mark.parametrize("where", ["durable", "memory"])
def test_restart_over_a_committed_checkpoint_damaged_since_raises_instead_of_starting_from_scratch(tmp_path, where):
    """Step 1's data file loses its tail after the commit (a truncated copy), in the durable root (the RAM root gone)
    or in its slot (nothing durable): the checkpoint is no longer complete, so no candidate is left, and load_latest
    raises CheckpointCorrupt naming it, as cpuckpt.load_latest does (before: it returned None, a silent start)."""
    from cpuckpt.errors import CheckpointCorrupt

    tier, _ = _one(tmp_path, persist_every=1 if where == "durable" else 0)
    tier.save(_state(1, 0), 1).wait()
    if where == "durable":
        tier.close()  # step 1 persisted, RAM root removed
        damaged = tmp_path / "durable" / "step_1"
    else:
        damaged = tier.find_latest()
        tier.close(persist_newest=False, remove_root=False)  # the job dies; its RAM root stays
    data = damaged / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)

    tier, _ = _one(tmp_path, persist_every=0)
    assert tier.candidates() == []
    with pytest.raises(CheckpointCorrupt, match=rf"{damaged}: committed, but incomplete now"):
        tier.load_latest(_targets(0))
    _close_idle(tier)


def test_a_newer_checkpoint_damaged_since_its_commit_is_named_when_an_older_one_loads(tmp_path, caplog):
    """Memory step 2 loses a data file's tail after its commit: load_latest loads step 1 (the fallback the tier
    promises), and a warning names the skipped step 2 and why (before: step 1 loaded without a word)."""
    import logging

    tier, _ = _one(tmp_path, persist_every=0)
    tier.save(_state(1, 0), 1).wait()
    tier.save(_state(2, 0), 2).wait()
    damaged = tier.find_latest()
    tier.close(persist_newest=False, remove_root=False)  # the job dies; its RAM root stays
    data = damaged / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)

    tier, _ = _one(tmp_path, persist_every=0)
    target = _targets(0)
    with caplog.at_level(logging.WARNING, logger="cpuckpt"):
        loaded = tier.load_latest(target)
    assert loaded is not None and loaded != damaged and tier.step_of(loaded) == 1
    assert f"skipped {damaged} (step 2): committed, but incomplete now (" in caplog.text, caplog.text
    _close_idle(tier)


def test_an_older_checkpoint_damaged_since_its_commit_is_not_named_when_a_newer_one_loads(tmp_path, caplog):
    """Step 1 of three slots damaged, steps 2 and 3 intact: step 3 loads and no checkpoint is said to be skipped."""
    import logging

    tier, _ = _one(tmp_path, persist_every=0, slots=3)
    for step in (1, 2, 3):
        tier.save(_state(step, 0), step).wait()
    damaged = next(slot for slot in tier.slots if tier.step_of(slot) == 1)
    tier.close(persist_newest=False, remove_root=False)
    data = damaged / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)

    tier, _ = _one(tmp_path, persist_every=0, slots=3)
    with caplog.at_level(logging.WARNING, logger="cpuckpt"):
        assert tier.step_of(tier.load_latest(_targets(0))) == 3
    assert "committed, but incomplete now" not in caplog.text, caplog.text
    _close_idle(tier)


def test_checkpoints_of_the_durable_root_that_record_no_step_are_restarted_from(tmp_path):
    """A job moving onto the tier: its durable root holds a stock ``dcp.save`` and a ``cpuckpt.save`` given no step.
    The tier restarts from the newer of them, as ``cpuckpt.load_latest`` does (before: none was listed, and the job
    started from scratch over them); a memory save of any step then ranks above them, and ``persisted`` still answers
    for recorded steps only."""
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    durable = tmp_path / "durable"
    cpuckpt.save(_state(1, 0), durable / "run1_final")
    dcp.save(_state(2, 0), checkpoint_id=str(durable / "run2_final"))
    tier, _ = _one(tmp_path, persist_every=0)
    target = _targets(0)
    assert tier.load_latest(target) == durable / "run2_final" and target["step"] == 2
    assert torch.equal(target["r0"]["w"], _state(2, 0)["r0"]["w"])
    assert not tier.persisted(-1) and not tier.persisted(2)
    tier.save(_state(0, 0), 0).wait()
    assert tier.find_latest() in tier.slots, "a memory step ranks above checkpoints that record none"
    _close_idle(tier)


def _writer_cannot_start_on_rank_1(durable: str, ram: str) -> dict:
    """Rank body: memory saves at steps 1-3, persist every 2nd; rank 1 cannot start a process (Popen fails)."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier, WriterDiedError

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=2))
    tier.save(_state(1, rank), 1).wait()  # memory only: no writer is needed yet
    if rank == 1:
        H.refuse_forks()  # this rank's process only
    t0 = time.monotonic()
    try:
        tier.save(_state(2, rank), 2).wait()
        outcome = "saved"
    except WriterDiedError as e:
        outcome = f"WriterDiedError: {e}"
    took = time.monotonic() - t0
    try:
        tier.close(persist_newest=False)
        closed = "clean"
    except Exception as e:  # reported to the test
        closed = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "took": took, "closed": closed}


def test_a_writer_that_cannot_start_fails_that_save_on_every_rank_promptly(run_ranks, tmp_path):
    """The writer starts at the first persist request (step 2 here); if it cannot start on one rank, that save
    fails on every rank with WriterDiedError before a byte moves, and no rank is left in a collective."""
    res = run_ranks(2, _writer_cannot_start_on_rank_1, str(tmp_path / "durable"), str(tmp_path / "ram"),
                    timeout_s=90)
    for rank, r in enumerate(res):
        assert r["outcome"].startswith("WriterDiedError"), (rank, r)
        assert r["took"] < 10, (rank, r)  # agreed at once, not after a collective's timeout (timeout_s 30)
        assert r["closed"] == "clean", (rank, r)
    assert "planted: cannot fork" in res[1]["outcome"], res
    assert "on another rank" in res[0]["outcome"], res


def _saves_of_one_name(durable: str, ram: str) -> dict:
    """Rank body: every save persisted to the same destination (a fixed name, as a DeepSpeed tag saved again)."""
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=1))
    error = ""
    try:
        for step in range(1, 6):
            tier.save(_state(step, rank), step, dest=Path(durable) / "last").wait()
        tier.wait_persisted()
    except Exception as e:  # reported, then asserted on
        error = f"{type(e).__name__}: {e}"
    dist.barrier()
    out = _targets(rank)
    if not error:
        import cpuckpt

        cpuckpt.load(out, Path(durable) / "last")
    tier.close(persist_newest=False)
    return {"error": error, "step": out["step"],
            "exact": not error and torch.equal(out[f"r{rank}"]["w"], _state(5, rank)[f"r{rank}"]["w"])}


def test_persists_of_one_destination_in_a_row_all_commit(run_ranks, tmp_path):
    """A rank's writer went on to the next persist of the same destination as soon as its own part was written:
    it removed that part and rewrote its files while the coordinator still waited for the part (the persist
    failed, every save after it waited for its slot until timeout_s; DeepSpeed with a fixed tag). Each writer now
    waits for the commit of its previous part there first."""
    res = run_ranks(2, _saves_of_one_name, str(tmp_path / "durable"), str(tmp_path / "ram"), timeout_s=120)
    for rank, r in enumerate(res):
        assert not r["error"] and r["step"] == 5 and r["exact"], (rank, r)


def _saves_counted(durable: str, ram: str) -> dict:
    """Rank body: 4 memory saves (every 2nd persisted), a restart's listing and a close, counting the agreements
    (all-reduces, all-gathers and broadcasts) made after the first save (which plans with DCP, whose own collectives
    stay)."""
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=2))
    tier.save(_state(1, rank), 1).wait()
    with H.counting_collectives() as made:
        for step in range(2, 5):
            tier.save(_state(step, rank), step).wait()
        newest = tier.find_latest()  # the listing every rank agrees on
        tier.close()
    return {"made": made, "durable": [c.step for c in cpuckpt.list_checkpoints(durable) if c.complete],
            "newest": newest is not None and Path(newest).name}


def test_a_tier_of_one_rank_agrees_with_itself_without_collectives(run_ranks, tmp_path):
    """On one rank the repeated saves' and the close's agreements (the claim, the fill, the plan's reuse, the commit,
    the close's waits) and a restart's listing make no collective; the same on two ranks make them. Both persist
    every 2nd step durably and list the newest memory checkpoint alike."""
    (alone,) = run_ranks(1, _saves_counted, str(tmp_path / "d1"), str(tmp_path / "ram1"), timeout_s=120)
    two = run_ranks(2, _saves_counted, str(tmp_path / "d2"), str(tmp_path / "ram2"), timeout_s=120)
    assert alone["made"] == dict.fromkeys(H.AGREEMENTS, 0) and alone["durable"] == [2, 4], alone
    assert alone["newest"] and [r["newest"] for r in two] == [alone["newest"]] * 2, (alone, two)
    for r in two:
        made = r["made"]
        assert r["durable"] == [2, 4] and made["all_reduce"] > 6, r
        assert made["all_gather_object"] >= 3 and made["broadcast_object_list"] >= 4, r  # commits, the listing
