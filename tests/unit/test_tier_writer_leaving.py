"""A trainer never adopts a writer process that marked itself leaving (its trainer was gone and it owed nothing: it no
longer serves its queue, nor listens for replicas, and may still drain a replica transfer for a while): it waits for
that process to end and starts its own.

Single process, real RAM-root files, a real writer process; the leaving writer is a stand-in process that holds the
writer lock and wrote its pid beside it, as a writer does when it leaves, then ends 1.5 s later.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from cpuckpt.tier.memory import MemoryTier
from cpuckpt.tier.ramroot import leaving_marker

_LEAVING = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, str(os.getpid()).encode())
open(sys.argv[2], "w").write(str(os.getpid()))
print("leaving", flush=True)
time.sleep(1.5)
"""


def test_a_leaving_writer_is_waited_for_not_adopted(tmp_path: Path) -> None:
    cfg = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
           "memory": {"root": str(tmp_path / "ram"), "persist_every": 1, "slots": 2, "headroom_bytes": 0}}
    tier = MemoryTier(tmp_path / "durable", cfg)
    lock = tier.root.writer_lock_path(0)
    stand_in = subprocess.Popen([sys.executable, "-c", _LEAVING, str(lock), str(leaving_marker(lock))],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stand_in.stdout is not None and stand_in.stdout.readline().strip() == "leaving"
        t0 = time.monotonic()
        tier.save({"w": torch.arange(1000.0)}, 1).wait()  # a persist is due: its writer is started after the other
        tier.wait_persisted()
        assert time.monotonic() - t0 >= 1.0 and stand_in.poll() is not None
        assert tier.writer_pid() not in (None, stand_in.pid) and tier.persisted(1)
    finally:
        stand_in.kill()
        stand_in.wait()
        tier.close(persist_newest=False)


def test_a_leaving_mark_of_an_ended_writer_is_removed_when_a_new_writer_starts(tmp_path: Path) -> None:
    """The mark stays in a RAM root kept after a crash; a later writer given the same pid (a new pid namespace)
    would be taken for a leaving one at every save (60 s, then WriterDiedError). Starting a writer removes it."""
    cfg = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
           "memory": {"root": str(tmp_path / "ram"), "persist_every": 1, "slots": 2, "headroom_bytes": 0}}
    tier = MemoryTier(tmp_path / "durable", cfg)
    lock = tier.root.writer_lock_path(0)
    leaving_marker(lock).write_text("4242")
    try:
        tier.save({"w": torch.arange(1000.0)}, 1).wait()  # starts the writer
        assert not leaving_marker(lock).exists()
        tier.wait_persisted()
    finally:
        tier.close(persist_newest=False)


def test_an_adopting_trainer_clears_its_predecessors_stop_once_not_its_own(tmp_path: Path) -> None:
    """A trainer adopting an earlier trainer's writer clears the stop that trainer asked for (killed while closing);
    a stop it asks for itself later (its own close, a SIGTERM's persist on the way) stands, or close() waited
    timeout_s for a writer told to go on."""
    cfg = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
           "memory": {"root": str(tmp_path / "ram"), "persist_every": 1, "slots": 2, "headroom_bytes": 0}}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        tier.save({"w": torch.arange(1000.0)}, 1).wait()  # starts its writer
        tier.wait_persisted()
        started, tier._writer = tier._writer, None  # as if an earlier trainer had started it: this one adopts it
        tier.queue.request_stop()  # the earlier trainer's stop
        assert tier._ensure_writer() == started.pid and not tier.queue.stop_requested()
        tier.queue.request_stop()  # this trainer's own
        tier._ensure_writer()
        assert tier.queue.stop_requested()
        tier._writer = started
    finally:
        tier.close(persist_newest=False)
