"""Ctrl-C during a save or a load is a ``KeyboardInterrupt``, never an ordinary exception (issue 27.1).

A real Python process saves (or loads) a 384 MiB state dict and gets a real SIGINT mid-way. Its
script wraps the work in ``try/except Exception`` (prints ``SWALLOWED`` if that catches anything, as a
training loop that retries failed saves would); the interrupt must get past it as ``KeyboardInterrupt``,
promptly, and the process must exit without waiting for the rest of the save (no writer or committer
thread left running). Afterwards the last committed checkpoint loads bit-exact and ``find_latest``
returns it, never the torn one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cpuckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

BIG = 96 << 20  # int32 elements: 384 MiB
SMALL = 1 << 16
# One writer thread; small chunks and few reader threads: what is in flight when Ctrl-C comes ends soon.
CFG = {"io": {"threads": 1, "read_threads": 2, "chunk_bytes": "8MiB"}, "timeout_s": 120}
# The interrupted work goes through a slow disk: each 8 MiB chunk's pwrite waits CHUNK_DELAY_S (one writer
# thread: 48 chunks, >= 12 s a save) and each pread twice that (two reader threads: >= 12 s a load). Through
# the page cache a save takes a fraction of a second, too short for the bounds below to tell a prompt
# interrupt from one that waits for the rest of the save; with this one the signal lands mid-save (mid-load),
# and an exit that waited for it would take seconds more than the bounds, however loaded the machine.
CHUNK_DELAY_S = 0.25
HANDLER_BOUND_S = 5.0  # signal -> the script's except clause
EXIT_BOUND_S = 8.0  # signal -> atexit (past every thread join)

# The child: commits a small step 1, then works on 384 MiB until interrupted. It reports each
# committed step ("committed <dir>") and, on the way out, when it caught what and when its exit got
# past the thread joins (atexit runs after them), on CLOCK_MONOTONIC (the same clock as the parent's).
CHILD = r'''
import atexit, signal, sys, time
# First, before any thread starts: SIGINT delivered, as Python's KeyboardInterrupt, whatever this process inherited
# (a child inherits an ignored or blocked SIGINT, and Python then installs no handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
import torch
import cpuckpt
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

mode, root, cfg = sys.argv[1], sys.argv[2], eval(sys.argv[3])
big, small, delay = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])

from cpuckpt.transfer import files

class SlowDisk:  # the backend 'auto' picks (writes) and reads with, each chunk delayed: a slow disk
    name = "slow"

    def __init__(self):
        self._w = files.get_backend("auto", root)
        self._r = files.BufferedFileBackend()  # what an 'auto' load reads with
        self.aligned = self._w.aligned

    def open_write(self, path):
        return self._w.open_write(path)

    def pwrite(self, fd, buf, offset, path):
        time.sleep(delay)
        self._w.pwrite(fd, buf, offset, path)

    def finish_write(self, fd, nbytes, path, fsync):
        self._w.finish_write(fd, nbytes, path, fsync)

    def open_read(self, path):
        return self._r.open_read(path)

    def pread_into(self, fd, buf, offset, path):
        time.sleep(2 * delay)
        return self._r.pread_into(fd, buf, offset, path)

    def close(self, fd):
        self._r.close(fd)

files.register_backend("slow", SlowDisk)
slow = {**cfg, "io": {**cfg["io"], "backend": "slow"}}  # the work the signal interrupts
atexit.register(lambda: print(f"atexit {time.monotonic()}", flush=True))

def state(n, k):
    return {"w": torch.arange(n, dtype=torch.int32) + k, "step": k}

class Planner(DefaultLoadPlanner):  # not DCP's own class: the load goes through DCP's planning path
    pass

cpuckpt.save(state(small, 1), f"{root}/step_1", cfg, step=1)
print(f"committed step_1", flush=True)
try:
    if mode == "load":
        cpuckpt.save(state(big, 2), f"{root}/step_2", cfg, step=2)
        print(f"committed step_2", flush=True)
        dest = state(big, 0)
        print("working", flush=True)
        for _ in range(30):
            cpuckpt.load(dest, f"{root}/step_2", slow, planner=Planner())
    else:
        sd = state(big, 2)
        print("working", flush=True)
        for k in range(2, 14):  # bounded: a signal that never arrives must not fill the disk (384 MiB a step)
            sd["w"][0] = k  # every step's state differs (bit-exact checks know which one loaded)
            sd["step"] = k
            if mode == "sync":
                cpuckpt.save(sd, f"{root}/step_{k}", slow, step=k)
            else:
                cpuckpt.async_save(sd, f"{root}/step_{k}", slow, step=k).wait()
            print(f"committed step_{k}", flush=True)
    print("FINISHED", flush=True)
except Exception as e:
    print(f"SWALLOWED {type(e).__name__}: {e}", flush=True)
except BaseException as e:
    print(f"caught {type(e).__name__} {time.monotonic()}", flush=True)
    raise
'''


def _expected(name: str) -> dict:
    k = int(name.split("_")[1])
    if k == 1:
        return {"w": torch.arange(SMALL, dtype=torch.int32) + 1, "step": 1}
    w = torch.arange(BIG, dtype=torch.int32) + 2
    w[0] = k
    return {"w": w, "step": k}


def _interrupt(tmp_path: Path, mode: str) -> tuple[float, list[str], int, float]:
    """Run the child until it works, SIGINT it; (signal time, its output lines, exit code, exit time)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    proc = subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / "root"), repr(CFG), str(BIG),
                             str(SMALL), str(CHUNK_DELAY_S)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("working"):
                break
        else:
            raise AssertionError(f"the child ended before working: {lines}")
        time.sleep(0.5)  # into the save (or load): >= 12 s on the slow disk
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return sent, lines + out.splitlines(), proc.returncode, exited


@pytest.mark.parametrize("mode", ["sync", "async", "load"])
def test_ctrl_c_is_a_keyboard_interrupt_and_leaves_the_last_checkpoint(tmp_path, mode):
    sent, lines, rc, exited = _interrupt(tmp_path, mode)
    text = "\n".join(lines[-40:])
    assert not any(line.startswith("SWALLOWED") for line in lines), f"except Exception caught Ctrl-C:\n{text}"
    assert "FINISHED" not in lines, f"the signal came too late, the child's work had ended:\n{text}"
    caught = [line.split() for line in lines if line.startswith("caught ")]
    assert caught and caught[0][1] == "KeyboardInterrupt", text
    assert rc == -signal.SIGINT, f"exit code {rc}: the interrupt did not end the process as itself\n{text}"
    assert "KeyboardInterrupt" in text
    # Promptly: the interrupt reached the script's handler, and the exit got past every thread's join.
    # Both bounds are well short of the >= 12 s the interrupted save (load) would still have taken.
    late = float(caught[0][2]) - sent
    assert late < HANDLER_BOUND_S, f"KeyboardInterrupt raised {late:.2f} s late"
    at_exit = [float(line.split()[1]) for line in lines if line.startswith("atexit ")]
    assert at_exit and at_exit[0] - sent < EXIT_BOUND_S, f"exit waited {at_exit[0] - sent:.2f} s for background threads"
    assert exited - sent < 20, "the process took too long to exit"

    # The last committed checkpoint is intact and the one find_latest returns; the torn one is not listed.
    # The interrupted save may have committed just before the signal came (its .metadata renamed, save()
    # not yet returned to the script): then it is the latest and must load whole, never torn.
    root = tmp_path / "root"
    committed = [line.split()[1] for line in lines if line.startswith("committed ")]
    reported = committed[-1]
    interrupted = f"step_{int(reported.split('_')[1]) + 1}" if mode != "load" else reported
    latest = cpuckpt.find_latest(root)
    assert latest is not None and latest.parent == root, (latest, committed)
    assert latest.name in (reported, interrupted), (latest, committed)
    last = latest.name
    torn = [c for c in cpuckpt.list_checkpoints(root) if c.path.name not in (*committed, last)]
    assert all(not c.complete for c in torn), torn
    want = _expected(last)
    got = {"w": torch.zeros_like(want["w"]), "step": None}
    cpuckpt.load(got, root / last, CFG)
    assert torch.equal(got["w"], want["w"]) and got["step"] == want["step"]
