"""The test server itself: a ``weed`` whose owning process is SIGKILLed dies with it (no orphaned servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")

_OWNER = """
import sys, time
from cpuckpt.testing.seaweed import SeaweedServer
server = SeaweedServer(sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_server_dies_with_its_sigkilled_owner(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "seaweed")], stdout=subprocess.PIPE,
                             text=True)
    weed = 0
    try:
        line = owner.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"the owner did not start a server: {line!r}"
        weed = int(line)
        assert _alive(weed)
        owner.kill()  # SIGKILL: no finalizer of the owner runs
        owner.wait(30)
        deadline = time.monotonic() + 20
        while _alive(weed) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(weed), f"weed (pid {weed}) outlived its SIGKILLed owner"
    finally:
        owner.kill()
        owner.wait(30)
        if weed and _alive(weed):
            os.killpg(weed, signal.SIGKILL)
