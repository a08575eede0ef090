"""The memory tier under damage and crashes: checksums of memory checkpoints, a writer killed inside a copy.

What is proven, with real files, real writer processes, real gloo ranks and no mocks:

- a memory checkpoint records crc32c per chunk (``memory.checksum``); a byte flipped in its image
  afterwards fails its load with ``IntegrityError`` (from the mapped images and from the files), and
  ``MemoryTier.load_latest`` falls back to the older checkpoint, bit-exact;
- a byte flipped between the memory commit and the persist: the writer's persist fails with
  ``CheckpointCorrupt`` (an ``IntegrityError``), the durable destination is never committed, and the
  next save raises ``PersistError``;
- ``memory.checksum: false``: no checksums recorded, loads and persists still work;
- writers SIGKILLed inside a persist's copy, each at a seeded chunk (the fault point
  ``persist-chunk:<file>:<k>``, armed only in the writer processes through
  :func:`cpuckpt.testing.faults.child_env`): the durable destination is never listed complete; with
  ``on_writer_failure: respawn`` the respawned writer redoes the persist and the durable checkpoint is
  bit-exact; with ``raise`` the next save raises ``WriterDiedError`` on every rank, and after the
  trainers are SIGKILLed too, a relaunch loads the newest memory checkpoint bit-exact and its new
  writers complete the owed persist (bit-exact), never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import _helpers as H
import pytest
import torch

from cpuckpt.testing.faults import flip_byte

pytestmark = pytest.mark.timeout(180)

SEED = 14  # picks the chunk each writer is killed in (printed in every failure message)
CHUNK = 64 * 1024
NCHUNKS = 5  # __<r>_0.distcp of _state: ~309 KB, five chunks of 64 KiB


def _kill_chunk(rank: int) -> int:
    return random.Random(SEED * 100 + rank).randrange(NCHUNKS)


def _cfg(ram: Path, **memory) -> dict:
    return {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"},
            "memory": {"root": str(ram), "persist_every": 1, "slots": 2, "headroom_bytes": 0, **memory},
            "timeout_s": 30}


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"r{rank}": {"w": torch.randn(300, 257, generator=g), "b": torch.randint(0, 9, (33,), generator=g)},
            "step": step}


def _targets(*ranks: int) -> dict:
    out: dict = {f"r{r}": {"w": torch.empty(300, 257), "b": torch.empty(33, dtype=torch.int64)} for r in ranks}
    return out | {"step": -1}


def _assert_state(out: dict, step: int, ranks: tuple[int, ...], what: str) -> None:
    assert out["step"] == step, f"{what}: step {out['step']}, expected {step}"
    for r in ranks:
        for key in ("w", "b"):
            H.assert_bitexact(out[f"r{r}"][key], _state(step, r)[f"r{r}"][key], f"{what}: rank {r} {key}")


def _durable_steps(durable: Path) -> list[int]:
    import cpuckpt

    return [c.step for c in cpuckpt.list_checkpoints(durable) if c.complete]


def _wait(what: str, cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _one(tmp_path: Path, **memory):
    from cpuckpt.tier.memory import MemoryTier

    return MemoryTier(tmp_path / "durable", _cfg(tmp_path / "ram", **memory))


# ---------------------------------------------------------------------------------- checksums (one process)


@contextlib.contextmanager
def _persist_of_step_2_held(tmp_path: Path) -> Iterator[tuple]:
    """A tier with step 1 persisted and step 2 committed in memory only: its writer is stopped (the persist of step
    2 waits) until the block ends. Yields the tier and step 2's owed request."""
    tier = _one(tmp_path, persist_every=1)
    tier.save(_state(1, 0), 1).wait()
    tier.wait_persisted()
    writer = tier.writer_pid()
    os.kill(writer, signal.SIGSTOP)
    try:
        tier.save(_state(2, 0), 2).wait()
        (owed,) = tier.queue.owed()
        yield tier, owed
    finally:
        os.kill(writer, signal.SIGCONT)


def _failed_persist(tier, owed) -> str:
    """The error of ``owed``'s persist, once the writer reported it (it must fail)."""
    _wait("the writer failed the persist", lambda: not tier.queue.owed())
    outcome = tier.queue.outcome(owed.seq)
    assert outcome is not None and not outcome.ok, outcome
    return outcome.error


def test_a_flipped_byte_in_a_memory_image_fails_its_load_and_its_persist(tmp_path, caplog):
    """One RAM page damaged after the memory commit of step 2 (its persist held back by a frozen writer):
    loading step 2 fails, a restart falls back to step 1, and the persist of step 2 fails and is never
    committed; the next save reports it."""
    import cpuckpt
    from cpuckpt.backend.committed import check_complete, read_manifest
    from cpuckpt.errors import IntegrityError
    from cpuckpt.tier.memory import PersistError

    with _persist_of_step_2_held(tmp_path) as (tier, owed):  # step 2 committed in memory, with checksums
        newest = Path(owed.slot)
        entry = read_manifest(newest).files["__0_0.distcp"]
        assert entry.checksum == "crc32c" and len(entry.chunk_checksums) == NCHUNKS, entry
        flip_byte(newest / "__0_0.distcp", 3 * CHUNK + 17)  # inside w's data; the mapping shares the page
        with pytest.raises(IntegrityError, match=r"checksum mismatch .*\(chunk 3\)"):
            tier.load(_targets(0), newest)  # from this process's mapped images
        with pytest.raises(IntegrityError, match=r"checksum mismatch .*\(chunk 3\)"):
            cpuckpt.load(_targets(0), newest)  # read from the files
        out = _targets(0)
        with caplog.at_level("WARNING", logger="cpuckpt.tier.memory"):
            older = tier.load_latest(out)
        assert older is not None and older.parent == tier.root.path and tier.step_of(older) == 1, older
        assert str(newest) in caplog.text and "checksum" in caplog.text
        _assert_state(out, 1, (0,), "fallback past the damaged memory checkpoint")
    error = _failed_persist(tier, owed)
    assert "CheckpointCorrupt" in error and "(chunk 3)" in error, error
    dest = tmp_path / "durable" / "step_2"
    assert not check_complete(dest).complete and not (dest / ".metadata").exists()
    assert _durable_steps(tmp_path / "durable") == [1]
    with pytest.raises(PersistError, match="checksum mismatch"):
        tier.save(_state(3, 0), 3)
    tier.close(persist_newest=False)
    assert _durable_steps(tmp_path / "durable") == [1]


def test_a_metadata_changed_in_ram_is_never_listed_loaded_nor_persisted(tmp_path):
    """The slot's ``.metadata`` of step 2 changed after its memory commit so that it still unpickles (a key renamed):
    the crc32c its manifest records refuses it; a restart falls back to step 1 and the persist of step 2 fails."""
    from cpuckpt.backend.committed import check_complete
    from cpuckpt.tier.memory import PersistError

    with _persist_of_step_2_held(tmp_path) as (tier, owed):
        newest = Path(owed.slot)
        md = (newest / ".metadata").read_bytes()
        changed = md.replace(b"\x8c\x04r0.w\x94", b"\x8c\x04r0.v\x94")
        assert changed != md
        (newest / ".metadata").write_bytes(changed)
        assert "not the one committed with the manifest" in check_complete(newest).reason
        out = _targets(0)
        older = tier.load_latest(out)
        assert older is not None and tier.step_of(older) == 1, older
        _assert_state(out, 1, (0,), "fallback past the changed .metadata")
    error = _failed_persist(tier, owed)
    assert "CheckpointCorrupt" in error and ".metadata is not the one committed" in error, error
    assert not list((tmp_path / "durable").glob("step_2/*.distcp"))  # refused before a byte was copied
    with pytest.raises(PersistError, match=r"\.metadata is not the one committed"):
        tier.save(_state(3, 0), 3)
    tier.close(persist_newest=False)
    assert _durable_steps(tmp_path / "durable") == [1]


def test_checksums_off_record_nothing_and_loads_and_persists_still_work(tmp_path):
    """``memory.checksum: false`` through the memory save path (``async_save`` into images; no writer needed)."""
    import cpuckpt
    from cpuckpt.backend.committed import read_manifest
    from cpuckpt.backend.reader import StorageReader
    from cpuckpt.config import Config
    from cpuckpt.tier.imagecopy import persist_image
    from cpuckpt.tier.images import ImageSet

    cfg = Config.from_dict(_cfg(tmp_path / "ram", checksum=False), env=False)
    slot = tmp_path / "ram" / "slot-0"
    images = ImageSet(slot, pin=False)
    try:
        cpuckpt.async_save(_state(1, 0), slot, cfg, step=1, sink=images).wait()
        entries = read_manifest(slot).files
        assert entries and all((e.checksum, e.chunk_checksums) == ("none", []) for e in entries.values()), entries
        mapped = {n: img for n in images.names if (img := images.get(n)) is not None}
        for reader in (StorageReader(slot, cfg, mapped=mapped), None):  # from the images, from the files
            out = _targets(0)
            cpuckpt.load(out, slot, cfg, storage_reader=reader)
            _assert_state(out, 1, (0,), "memory checkpoint without checksums")
        (tmp_path / "durable").mkdir()
        out_entry = persist_image(slot / "__0_0.distcp", tmp_path / "durable" / "__0_0.distcp", cfg,
                                  expect=entries["__0_0.distcp"])
        assert out_entry.checksum == "crc32c" and len(out_entry.chunk_checksums) == NCHUNKS  # the disk copy has them
        assert (tmp_path / "durable" / "__0_0.distcp").read_bytes() == (slot / "__0_0.distcp").read_bytes()
    finally:
        images.close()


# ---------------------------------------------------------------------------------- a writer killed in a copy


def _writer_killed_in_a_copy(durable: str, ram: str, site: str) -> None:
    """Rank body: rank 1's writer is SIGKILLed inside step 1's persist, at its seeded chunk; respawned."""
    import torch.distributed as dist

    from cpuckpt.backend.committed import check_complete
    from cpuckpt.format.manifest import part_name
    from cpuckpt.testing import faults
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    stage = f"persist-chunk:__1_0.distcp:{_kill_chunk(1)}"
    os.environ.update(faults.child_env(site, f"{stage}=kill"))  # the writers started from now on
    tier = MemoryTier(durable, _cfg(Path(ram), on_writer_failure="respawn"))
    tier.save(_state(1, rank), 1).wait()
    if rank == 1:
        _wait("rank 1's writer died", lambda: not tier._writer_running())
        log = (tier.root.path / "writer-1.log").read_text()
        assert f"SIGKILL at {stage}" in log, f"seed {SEED}: the writer was not killed at {stage}:\n{log}"
    dist.barrier()
    dest = Path(durable) / "step_1"
    assert not check_complete(dest).complete and 1 not in _durable_steps(Path(durable)), f"seed {SEED}: {stage}"
    assert not (dest / part_name("__1_")).exists(), "a writer killed in its copy wrote its done marker"
    os.environ.pop(faults.TEST_HOOK_ENV)  # the respawned writer runs clean
    tier.save(_state(2, rank), 2).wait()  # rank 1's new writer redoes step 1, then takes step 2
    tier.wait_persisted()
    dist.barrier()
    tier.close(persist_newest=False)


def test_a_writer_killed_inside_a_persist_copy_is_respawned_and_redoes_it(run_ranks, tmp_path):
    import cpuckpt

    durable, ram = tmp_path / "durable", tmp_path / "ram"
    run_ranks(2, _writer_killed_in_a_copy, str(durable), str(ram), str(tmp_path / "site"))
    assert _durable_steps(durable) == [1, 2]
    for step in (1, 2):
        H.assert_committed_layout(durable / f"step_{step}", 2)
        out = _targets(0, 1)
        cpuckpt.load(out, durable / f"step_{step}")
        _assert_state(out, step, (0, 1), f"seed {SEED}: durable step {step} after the respawn")


def _all_killed_in_a_copy(durable: str, ram: str, site: str) -> None:
    """Rank body: steps 1-3 (persist every 2nd); both writers are SIGKILLed inside step 2's copy (held at its
    start until step 3 is committed in memory); the next save raises on every rank; the trainers die too."""
    import torch.distributed as dist

    from cpuckpt.testing import faults
    from cpuckpt.tier.memory import MemoryTier, WriterDiedError

    rank = dist.get_rank()
    go = Path(site) / "go"
    spec = ";".join([f"clear-commit:done=wait:{go}"] +  # the writer's first step of a persist
                    [f"persist-chunk:__{r}_0.distcp:{_kill_chunk(r)}=kill" for r in (0, 1)])
    os.environ.update(faults.child_env(site, spec))
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=2))  # on_writer_failure: raise
    for step in (1, 2, 3):
        tier.save(_state(step, rank), step).wait()
    dist.barrier()  # step 3 committed in memory on every rank
    if rank == 0:
        go.touch()
    _wait(f"rank {rank}'s writer died", lambda: not tier._writer_running())
    dist.barrier()
    assert _durable_steps(Path(durable)) == [], f"seed {SEED}: a torn persist is listed"
    with pytest.raises(WriterDiedError, match="died owing persists"):
        tier.save(_state(4, rank), 4)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _relaunch(durable: str, ram: str) -> dict:
    import torch.distributed as dist

    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    tier = MemoryTier(durable, _cfg(Path(ram), persist_every=2))  # new writers; the persist of step 2 is owed
    latest = tier.find_latest()
    out = _targets(rank)
    tier.load(out, latest)
    _assert_state(out, 3, (rank,), f"seed {SEED}: newest memory checkpoint after the relaunch")
    tier.wait_persisted()
    in_memory = latest.parent == tier.root.path
    tier.close(persist_newest=False)
    return {"in_memory": in_memory}


def test_writers_and_trainers_killed_inside_a_persist_copy(run_ranks, tmp_path):
    """Every rank's next save raises ``WriterDiedError``; a relaunch loads the newest memory checkpoint
    bit-exact and its new writers complete the owed persist (never a torn one)."""
    import cpuckpt

    durable, ram = tmp_path / "durable", tmp_path / "ram"
    with pytest.raises(AssertionError, match="rank") as ei:
        run_ranks(2, _all_killed_in_a_copy, str(durable), str(ram), str(tmp_path / "site"))
    results = getattr(ei.value, "results", None)  # the harness's RankError: every rank died by its SIGKILL
    assert results is not None and all(results[r]["message"] == f"no result (exit code {-signal.SIGKILL})"
                                       for r in (0, 1)), ei.value
    for r in (0, 1):
        log = (ram / f"writer-{r}.log").read_text()
        assert f"SIGKILL at persist-chunk:__{r}_0.distcp:{_kill_chunk(r)}" in log, f"seed {SEED}, rank {r}:\n{log}"
    assert _durable_steps(durable) == []  # the torn persist of step 2 is never listed
    res = run_ranks(2, _relaunch, str(durable), str(ram))
    assert all(r["in_memory"] for r in res), res
    assert _durable_steps(durable) == [2]  # the owed persist was redone by the new writers
    out = _targets(0, 1)
    cpuckpt.load(out, durable / "step_2")
    _assert_state(out, 2, (0, 1), f"seed {SEED}: durable step 2 redone after the crash")


def _failed_commit_then_reuse(durable: str, ram: str) -> dict:
    """Rank body: the coordinator's first memory commit fails (a fault point at its ``.metadata`` rename, after
    1.5 s), rank 1 learns of it later than rank 0 (its outcome broadcast slowed), and the save that reuses that
    slot, with a ``before_fill``, must go the same way on both ranks."""
    import torch.distributed as dist

    import cpuckpt.background as background
    from cpuckpt import faultpoint
    from cpuckpt.errors import CpuckptError
    from cpuckpt.tier.memory import MemoryTier
    from cpuckpt.tier.ramroot import RamRoot

    rank = dist.get_rank()
    cfg = _cfg(Path(ram), persist_every=0, job="faults")  # 2 slots, no writers
    # rank 1's RAM root held by a stale trainer of that rank: both ranks fail alike, rank 0 is not left waiting
    stale = RamRoot.open(ram, "faults", 1, headroom_bytes=0) if rank == 1 else None
    t0 = time.monotonic()
    try:
        MemoryTier(durable, cfg).close(persist_newest=False)
        refused = "made"
    except CpuckptError as e:
        refused = f"{type(e).__name__}: {e}"
    refused_s = time.monotonic() - t0
    if stale is not None:
        stale.close()
    # rank 1 interrupted while it opens its root: the interrupt there, the same failure named on rank 0 at once
    real_open = RamRoot.open.__func__

    def interrupted(cls, *args, **kwargs):
        if rank == 1:
            raise KeyboardInterrupt
        return real_open(cls, *args, **kwargs)

    RamRoot.open = classmethod(interrupted)
    t0 = time.monotonic()
    try:
        MemoryTier(durable, cfg).close(persist_newest=False)
        interrupt = "made"
    except BaseException as e:  # the interrupt is what is checked
        interrupt = f"{type(e).__name__}: {e}"
    finally:
        RamRoot.open = classmethod(real_open)
    interrupt_fast = time.monotonic() - t0 < 15
    tier = MemoryTier(durable, cfg)
    commits = []

    def fail_first_commit(stage: str) -> None:
        if rank == 0 and stage == "before-rename:.metadata":
            commits.append(stage)
            if len(commits) == 1:
                time.sleep(1.5)
                raise OSError(5, "injected commit failure")

    previous = faultpoint.set_handler(fail_first_commit)
    if rank == 1:  # the same outcome, known on rank 1 half a second after rank 0
        broadcast = background.dist.broadcast_object_list

        def late(*args, **kwargs):
            out = broadcast(*args, **kwargs)
            time.sleep(0.5)
            return out

        background.dist.broadcast_object_list = late
    try:
        first = tier.save(_state(1, rank), 1)
        tier.save(_state(2, rank), 2).staged.wait()
        if rank == 0:
            first.wait_ended()  # rank 0 knows the failure; rank 1 does not yet
        filled: list[str] = []
        try:
            tier.save(_state(3, rank), 3, before_fill=lambda slot: filled.append(slot.name))
            outcome = "saved"
        except CpuckptError as e:
            outcome = type(e).__name__
        dist.barrier()  # no rank is left inside a collective of that save
        return {"outcome": outcome, "filled": filled, "refused": refused, "refused_fast": refused_s < 15,
                "interrupt": interrupt, "interrupt_fast": interrupt_fast}
    finally:
        faultpoint.set_handler(previous)
        tier.close(persist_newest=False)


def test_a_failed_commit_is_reported_alike_on_every_rank_when_its_slot_is_reused(run_ranks, tmp_path):
    res = run_ranks(2, _failed_commit_then_reuse, str(tmp_path / "durable"), str(tmp_path / "ram"), timeout_s=120)
    # a stale holder of rank 1's RAM root: the same error on both ranks at once (before: rank 0 waited in the
    # tier's next collective for timeout_s while rank 1 had raised)
    assert res[0]["refused"] == res[1]["refused"] and res[0]["refused_fast"] and res[1]["refused_fast"], res
    assert res[0]["refused"].startswith("RamRootError: opening the memory tier's RAM root failed on rank 1"), res
    assert res[1]["interrupt"].startswith("KeyboardInterrupt") and res[0]["interrupt_fast"], res
    assert res[0]["interrupt"].startswith("CpuckptError: opening the memory tier's RAM root failed on rank 1"), res
    # before: rank 1 raised before its before_fill while rank 0 ran it and went on into the tier's agreement
    assert [(r["outcome"], r["filled"]) for r in res] == [(res[0]["outcome"], res[0]["filled"])] * 2, res
    assert res[0]["outcome"] == "StorageIOError" and res[0]["filled"] == ["slot-0"], res


def rank_listing_fails_on_rank_1(base: str) -> str:
    """The durable root's listing fails on rank 1 only, once (a stale mount, object storage refusing): opening the
    tier raises there and on rank 0 alike; the tier is let go of on both, so a second open succeeds."""
    import torch.distributed as dist

    import cpuckpt.tier.formats as formats
    from cpuckpt.errors import StorageIOError
    from cpuckpt.tier.memory import MemoryTier

    rank = dist.get_rank()
    if rank == 1:
        real, calls = formats.list_checkpoints, []

        def failing_once(root):
            if not calls:
                calls.append(root)
                raise StorageIOError(f"listing {root}: refused (injected)", path=str(root))
            return real(root)

        formats.list_checkpoints = failing_once
    cfg = {"timeout_s": 20, "memory": {"root": f"{base}/ram", "slots": 2, "headroom_bytes": 0,
                                       "prepare_slots": False}}
    try:
        MemoryTier(f"{base}/durable", cfg)
    except StorageIOError as e:
        failed = f"{type(e).__name__}: {e}"
    else:
        failed = "opened"
    tier = MemoryTier(f"{base}/durable", cfg)  # the first one's lock and processes were let go of
    tier.close()
    return failed


def test_a_listing_that_fails_on_one_rank_fails_opening_the_tier_on_every_rank(run_ranks, tmp_path):
    """Not one rank raising while the other waits in the tier's next collective until the group's timeout."""
    res = run_ranks(2, rank_listing_fails_on_rank_1, str(tmp_path), timeout_s=90)
    for rank, failed in enumerate(res):
        assert failed.startswith("StorageIOError") and "refused (injected)" in failed, f"rank {rank}: {failed}"
