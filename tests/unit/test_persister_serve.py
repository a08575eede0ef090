"""The writer's loop (:func:`cpuckpt.tier.persister.serve`) never exits owing what its trainer queued before it died.

Deterministic: the trainer's last request and its death are placed exactly between the writer's listing of the queue
and its probe of the trainer's lock (in CI the writer was SIGSTOPped there: tests/dist/test_memory_tier.py's
``test_a_trainer_killed_while_its_persist_is_owed_the_writer_finishes_it``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from cpuckpt.tier import persister
from cpuckpt.tier.queue import Outcome, PersistQueue, PersistRequest
from cpuckpt.tier.ramroot import acquire_lock


def test_a_request_queued_just_before_the_trainer_died_is_served(tmp_path, monkeypatch):
    queue = PersistQueue(tmp_path / "queue-0").create()
    trainer_lock = tmp_path / ".rank-0.lock"
    fd = acquire_lock(trainer_lock)
    req = PersistRequest(seq=1, slot=str(tmp_path / "slot-0"), save_id="s", step=4, dest=str(tmp_path / "step_4"),
                         rank=0, world_size=1, coordinator=True, config={}, trainer_pid=os.getpid(),
                         trainer_lock=str(trainer_lock))
    real_lock_held = persister.lock_held
    died = []

    def lock_held(path):  # the writer listed an empty queue; before it probes, the trainer queues and dies
        if not died:
            queue.put(req)
            os.close(fd)
            died.append(True)
        return real_lock_held(path)

    served = []
    monkeypatch.setattr(persister, "lock_held", lock_held)
    monkeypatch.setattr(persister, "persist_one", lambda r, q=None: served.append(r.seq) or Outcome(r.seq, True))
    assert persister.serve(queue, trainer_lock) == 0
    assert served == [1] and queue.owed() == [] and queue.outcome(1).ok


def test_the_writer_process_starts_without_torch():
    """``python -m cpuckpt.tier.persister`` imports no torch (it does so only to read a checkpoint's metadata: the
    coordinator's durable commit, a completeness check): a writer (one per rank, respawned after a failure) starts
    in a fraction of a second and holds ~25 MB, instead of torch's seconds and ~280 MB."""
    code = "import sys, cpuckpt.tier.persister; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_writer_leaving_marks_itself_and_serves_on_for_a_trainer_that_came_meanwhile(tmp_path, monkeypatch):
    """A writer whose trainer is gone and owes nothing marks itself leaving (its pid beside its lock), so that a new
    trainer waits for it to end instead of adopting a writer that no longer serves its queue or listens. A trainer
    that took the lock just as it marked itself (and may have adopted it, not seeing the mark) keeps it serving: the
    mark is withdrawn and its request served."""
    from cpuckpt.tier.ramroot import leaving_marker, leaving_pid

    queue = PersistQueue(tmp_path / "queue-0").create()
    trainer_lock, writer_lock = tmp_path / ".rank-0.lock", tmp_path / ".writer-0.lock"
    assert persister.serve(queue, trainer_lock, writer_lock) == 0  # no trainer, nothing owed: leaves
    assert leaving_pid(writer_lock) == os.getpid()
    leaving_marker(writer_lock).unlink()

    real_mark = persister.mark_leaving
    arrived: list[int] = []
    req = PersistRequest(seq=1, slot=str(tmp_path / "slot-0"), save_id="s", step=4, dest=str(tmp_path / "step_4"),
                         rank=0, world_size=1, coordinator=True, config={}, trainer_pid=os.getpid(),
                         trainer_lock=str(trainer_lock))

    def mark_then_a_trainer_arrives(path):
        real_mark(path)
        if not arrived:  # the new trainer takes its lock and queues, having adopted this writer
            arrived.append(acquire_lock(trainer_lock))
            queue.put(req)

    served = []

    def persist(r, q=None):
        served.append(r.seq)
        assert leaving_pid(writer_lock) is None  # withdrawn before serving on
        os.close(arrived[0])  # that trainer ends too
        return Outcome(r.seq, True)

    monkeypatch.setattr(persister, "mark_leaving", mark_then_a_trainer_arrives)
    monkeypatch.setattr(persister, "persist_one", persist)
    assert persister.serve(queue, trainer_lock, writer_lock) == 0
    assert served == [1] and queue.outcome(1).ok and leaving_pid(writer_lock) == os.getpid()


def test_the_parts_a_writer_remembers_stay_bounded(tmp_path):
    """A long run persists to a new destination each time (iter_N): the writer remembers the newest 256 parts only,
    the latest write of one destination included."""
    from pathlib import Path

    persister._MY_LAST_PART.clear()
    for k in range(300):
        persister._remember_part(Path(f"/d/iter_{k}/__1_.cpuckpt-part.json"), f"s{k}")
    persister._remember_part(Path("/d/iter_0/__1_.cpuckpt-part.json"), "again")
    assert len(persister._MY_LAST_PART) == 256
    assert persister._MY_LAST_PART[Path("/d/iter_0/__1_.cpuckpt-part.json")] == "again"
    assert Path("/d/iter_44/__1_.cpuckpt-part.json") not in persister._MY_LAST_PART  # the oldest went
    persister._MY_LAST_PART.clear()


def test_a_coordinator_redone_after_its_commit_removes_the_parts_the_others_wait_for(tmp_path):
    """The coordinator's writer died between its commit and the removal of the parts; redone, it found the save
    committed and returned at once, leaving them: the other ranks' next persist of that name waited timeout_s for
    them to go. The redone coordinator now removes its save's parts (and only those)."""
    import time

    import torch

    import cpuckpt
    from cpuckpt.backend.committed import read_manifest
    from cpuckpt.format.manifest import Manifest, part_name

    dest = tmp_path / "last"
    cpuckpt.save({"w": torch.ones(8)}, dest)
    save_id = read_manifest(dest).save_id
    parts = [dest / part_name(f"__{r}_") for r in range(3)]
    for part in parts[:2]:
        part.write_text(Manifest(save_id=save_id).to_json())
    parts[2].write_text(Manifest(save_id="another").to_json())
    req = PersistRequest(seq=1, slot=str(tmp_path / "slot-0"), save_id=save_id, step=4, dest=str(dest), rank=0,
                         world_size=3, coordinator=True, config={}, trainer_pid=os.getpid(),
                         trainer_lock=str(tmp_path / "t.lock"))
    assert persister.persist_one(req).ok
    assert [p.exists() for p in parts] == [False, False, True]
    # and a rank waiting on its part there goes on at once
    persister._MY_LAST_PART.clear()
    persister._remember_part(parts[1], save_id)
    nxt = PersistRequest(seq=2, slot=str(tmp_path / "slot-1"), save_id="B", step=5, dest=str(dest), rank=1,
                         world_size=3, coordinator=False, config={}, trainer_pid=os.getpid(),
                         trainer_lock=str(tmp_path / "t.lock"))
    t0 = time.monotonic()
    persister._after_the_commit_of_my_last_part(nxt, parts[1], dest, time.monotonic() + 30, None)
    assert time.monotonic() - t0 < 1.0
    persister._MY_LAST_PART.clear()


def test_a_writer_redoing_a_persist_whose_part_is_there_remembers_it(tmp_path):
    """A rank's writer respawned after writing its part (before its outcome) redoes the request and finds the part
    there: it must still remember it, or its next persist of that name did not wait for the commit."""
    import torch

    import cpuckpt
    from cpuckpt.backend.committed import read_manifest
    from cpuckpt.format.manifest import Manifest, part_name

    slot = tmp_path / "slot-0"
    cpuckpt.save({"w": torch.ones(8)}, slot)
    save_id = read_manifest(slot).save_id
    dest = tmp_path / "last"
    dest.mkdir()
    part = dest / part_name("__1_")
    part.write_text(Manifest(save_id=save_id).to_json())  # written by the writer that died
    req = PersistRequest(seq=1, slot=str(slot), save_id=save_id, step=4, dest=str(dest), rank=1, world_size=2,
                         coordinator=False, config={"timeout_s": 5}, trainer_pid=os.getpid(),
                         trainer_lock=str(tmp_path / "t.lock"))
    persister._MY_LAST_PART.clear()
    assert persister.persist_one(req).ok
    assert persister._MY_LAST_PART.get(part) == save_id
    persister._MY_LAST_PART.clear()


def test_a_writer_persisting_a_tag_names_its_save_in_the_saving_file(tmp_path, monkeypatch):
    """While a writer copies a file set into ``dest`` (before its part), ``<saving>`` holds the save id: a tag a
    persist owes is told from a dead save of the engine (empty), which ``cpuckpt clean --deepspeed-tags`` may
    remove once a later tag committed, however stalled the copy."""
    import dataclasses
    import json

    from cpuckpt.format.manifest import FileEntry
    from cpuckpt.tier.tagmarker import SAVING_NAME, clean_torn_tags, new_marker, write_marker

    slot, dest = tmp_path / "slot-0", tmp_path / "save_dir" / "global_step3"
    slot.mkdir()
    (slot / "w.bin").write_bytes(b"w" * 100)
    (slot / "done.json").write_text(json.dumps({"save_id": "S1", "global_step": 3}))
    entry = FileEntry(name="w.bin", nbytes=100, chunk_bytes=100, checksum="none")
    req = PersistRequest(seq=1, slot=str(slot), save_id="S1", step=3, dest=str(dest), rank=1, world_size=2,
                         coordinator=False, config={"timeout_s": 5}, trainer_pid=os.getpid(),
                         trainer_lock=str(tmp_path / "t.lock"), kind="files",
                         files=(("w.bin", dataclasses.asdict(entry)),), marker="done.json", saving=SAVING_NAME)
    copy, seen = persister.persist_image, []

    def stalled(src, dst, *args, **kwargs):  # the copy stalls past --min-age while a later tag commits
        seen.append((dest / SAVING_NAME).read_text())
        for p in [*dest.rglob("*"), dest]:
            os.utime(p, (os.path.getmtime(p) - 4000, os.path.getmtime(p) - 4000))
        seen.append([str(p) for p in clean_torn_tags(dest.parent, min_age_s=60)])
        return copy(src, dst, *args, **kwargs)

    later = tmp_path / "save_dir" / "global_step2"
    later.mkdir(parents=True)
    write_marker(later, new_marker("global_step2", 1, {}, 2), fsync=False)
    monkeypatch.setattr(persister, "persist_image", stalled)
    persister._MY_LAST_PART.clear()
    assert persister.persist_one(req).ok
    persister._MY_LAST_PART.clear()
    assert seen == ["S1\n", []] and (dest / "w.bin").read_bytes() == b"w" * 100
