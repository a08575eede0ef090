"""Launches standing in for nodes: the process plumbing the multi-node tests share (test_multinode*.py).

Each launch is ``python -m torch.distributed.run`` with a c10d rendezvous on 127.0.0.1 and ``--local-addr``
127.0.0.<node + 1> (launch *i* gets rank *i*), in a session of its own, its output in ``<tmp>/<phase>-node<i>.log``.
Each rank of a launch writes ``<tmp>/out/<phase>-<rank>.json`` when it is done (or holding, ``--hold``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cpuckpt.testing.seaweed import free_ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the kernel's ephemeral range: torchrun binds it seconds later,
    and a port from ``bind(0)`` could meanwhile be taken by any other process's outgoing connection."""
    return free_ports(1)[0]


def launch(tmp: Path, node: int, phase: str, port: int, script: Path, args: Sequence[str], *, nnodes: int = 2,
           nproc: int = 1, join_timeout_s: int = 90, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start node ``node``'s launch of ``script`` (its ``args`` after torchrun's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{phase}-{port}",
           "--rdzv-conf", f"join_timeout={join_timeout_s},read_timeout={join_timeout_s}",
           "--local-addr", f"127.0.0.{node + 1}", "--max-restarts", "0", "--monitor-interval", "0.5", str(script),
           *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log = open(tmp / f"{phase}-node{node}.log", "ab")  # handed to the child, closed here after Popen
    try:
        return subprocess.Popen(cmd, cwd=tmp, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def logs(tmp: Path, phase: str, tail: int = 4000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                     for p in sorted(tmp.glob(f"{phase}-node*.log")))


def kill_pid(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_launch(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def write_report(out: Path, phase: str, rank: int, report: dict) -> None:
    """Write ``rank``'s report whole: by rename, so ``await_reports`` never reads one half-written."""
    final = out / f"{phase}-{rank}.json"
    part = final.with_suffix(".part")
    part.write_text(json.dumps(report))
    os.replace(part, final)


def await_reports(tmp: Path, phase: str, procs: list[subprocess.Popen], ranks: int, *, hold: bool,
                  phase_s: float) -> list[dict]:
    """Every rank's report (by rank) once written (and, unless ``hold``, every launch ended), within ``phase_s``;
    a launch that failed or the bound passed kills the launches and raises with their logs."""
    deadline = time.monotonic() + phase_s
    files = [tmp / "out" / f"{phase}-{r}.json" for r in range(ranks)]
    try:
        while not all(f.exists() for f in files) or (not hold and any(p.poll() is None for p in procs)):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = "a launch failed" if failed else f"not done within {phase_s:.0f} s"
                raise AssertionError(f"phase {phase}: {why}\n{logs(tmp, phase)}")
            time.sleep(0.2)
    except BaseException:
        for p in procs:
            kill_launch(p)
        raise
    return [json.loads(f.read_text()) for f in files]


def kill_all(procs: list[subprocess.Popen], reports: list[dict], *, writers: Sequence[int | None]) -> None:
    """SIGKILL every trainer (torchrun starts them in sessions of their own), the launches, and ``writers``."""
    for r in reports:
        kill_pid(r["pid"])
    for p in procs:
        kill_launch(p)
    for pid in writers:
        kill_pid(pid)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[1].split()[0] != "Z"


def wait_gone(pids: Sequence[int | None], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while pid is not None and alive(pid):
            assert time.monotonic() < deadline, f"process {pid} still runs"
            time.sleep(0.05)


def flip_middle_byte(path: Path) -> None:
    """Damage the file at ``path``: one flipped byte in its middle."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
