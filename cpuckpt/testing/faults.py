"""Fault injection for cpuckpt's own test-suite: failing and killing file backends, and stage actions.

Nothing here is active in a process until :func:`install` runs in it: the product never imports this
module, and no setting a user can make (YAML ``io.backend``, ``CPUCKPT_*`` environment variables)
reaches it otherwise. :func:`install` plugs into two public seams:

- the file-backend registry (:func:`cpuckpt.transfer.files.register_backend`): it registers the
  ``fault`` prefix, so that ``io.backend`` may then name

  - ``fault:<errno>@<bytes>``: every write fails with ``<errno>`` (a name such as ``ENOSPC`` or a
    number) once ``<bytes>`` bytes were written through the backend;
  - ``fault:<errno>@fsync``: a data file's final fsync fails with ``<errno>``;
  - ``fault:KILL@<bytes>``: SIGKILL of this process once exactly ``<bytes>`` bytes reached the files
    (the write that crosses the limit is written up to it): deterministic crash points;
  - ``fault:KILL@fsync``: SIGKILL just before a data file's final fsync;

- the fault points of the commit path (:mod:`cpuckpt.faultpoint`): it installs a
  :class:`StageActions` handler built from a spec ``"<stage>=<action>[;<stage>=<action>...]"`` where
  ``<action>`` is ``kill`` (SIGKILL this process), ``sleep:<seconds>``, ``wait:<path>`` (until that
  file exists: another process orders this one; ``RuntimeError`` after 120 s) or ``raise``
  (``RuntimeError``). The spec is :func:`install`'s argument or, when it is None,
  ``$CPUCKPT_TEST_HOOK`` as it is when :func:`install` runs. Stages are those
  :func:`cpuckpt.faultpoint.hit` names (``before-rename:<file>``, ``after-rename:<file>``,
  ``clear-commit:done``, ``commit:parts-deleted``, ``retention:metadata-removed``,
  ``megatron-worker:rank<r>``, ``persist-chunk:<file>:<chunk>``, ``s3-part:<file>:<chunk>``: before a chunk's
  part is uploaded to object storage).

The handler is picklable, so code that starts a worker process (the Megatron adapter) hands
:func:`cpuckpt.faultpoint.get_handler` to it; processes forked after :func:`install` inherit both
seams. Test modules call :func:`install` at import time, which also covers the rank processes of the
multi-process harness (they load the test module by path). A fresh interpreter that the code under
test starts itself (the memory tier's writer, ``python -m cpuckpt.tier.persister``) inherits neither:
:func:`child_env` gives the environment that makes it call :func:`install` at startup.
"""

from __future__ import annotations

import errno as errno_mod
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpuckpt import faultpoint
from cpuckpt.errors import ConfigError
from cpuckpt.transfer import files
from cpuckpt.transfer.files import BufferedFileBackend, _io_error

__all__ = [
    "PREFIX",
    "TEST_HOOK_ENV",
    "FaultInjectingBackend",
    "KillingBackend",
    "StageActions",
    "child_env",
    "flip_byte",
    "install",
    "make_backend",
    "uninstall",
]

logger = logging.getLogger(__name__)

PREFIX = "fault"
TEST_HOOK_ENV = "CPUCKPT_TEST_HOOK"


class FaultInjectingBackend(BufferedFileBackend):
    """Fails writes with ``err`` once ``fail_after_bytes`` bytes were written through it, or fails
    the final fsync (``fail_fsync``). A real backend (real files), not a mock."""

    name = "fault"

    def __init__(self, err: int, fail_after_bytes: int, *, fail_fsync: bool = False) -> None:
        self.err = err
        self.fail_after_bytes = fail_after_bytes
        self.fail_fsync = fail_fsync
        self._written = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None:
        with self._lock:
            self._written += len(buf)
            fail = self._written > self.fail_after_bytes
        if fail:
            e = OSError(self.err, os.strerror(self.err))
            raise _io_error("pwrite", e, path, offset, len(buf)) from e
        super().pwrite(fd, buf, offset, path)

    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None:
        if self.fail_fsync:
            self.close(fd)
            e = OSError(self.err, os.strerror(self.err))
            raise _io_error("fsync", e, path) from e
        super().finish_write(fd, nbytes, path, fsync)


class KillingBackend(BufferedFileBackend):
    """SIGKILLs this process once ``kill_after_bytes`` bytes were written through it (the write that
    crosses the limit is written only up to it), or before a file's final fsync (``kill_fsync``).
    What is on disk afterwards is exactly what a crash at that byte leaves (minus the page cache loss
    of a power failure)."""

    name = "kill"

    def __init__(self, kill_after_bytes: int, *, kill_fsync: bool = False) -> None:
        self.kill_after_bytes = kill_after_bytes
        self.kill_fsync = kill_fsync
        self._written = 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, buf: memoryview, offset: int, path: str) -> None:
        view = memoryview(buf).cast("B")
        with self._lock:  # held across the write: the byte count at the kill is exact
            room = self.kill_after_bytes - self._written
            if room >= len(view):
                self._written += len(view)
                super().pwrite(fd, view, offset, path)
                return
            if room > 0:
                super().pwrite(fd, view[:room], offset, path)
            logger.warning("fault backend: SIGKILL after %d bytes (in %s at offset %d)",
                           self.kill_after_bytes, path, offset + max(room, 0))
            os.kill(os.getpid(), signal.SIGKILL)

    def finish_write(self, fd: int, nbytes: int, path: str, fsync: bool) -> None:
        if self.kill_fsync:
            os.kill(os.getpid(), signal.SIGKILL)
        super().finish_write(fd, nbytes, path, fsync)


def make_backend(spec: str = PREFIX) -> FaultInjectingBackend | KillingBackend:
    """The backend for ``io.backend: fault:<errno|KILL>@<bytes|fsync>`` (registered by :func:`install`).

    Raises:
        ConfigError: ``spec`` is not of that form.
    """
    try:
        if not spec.startswith(PREFIX + ":"):
            raise ValueError(spec)
        err_name, after = spec[len(PREFIX) + 1 :].split("@")
        if err_name.upper() == "KILL":
            return KillingBackend(1 << 62, kill_fsync=True) if after == "fsync" else KillingBackend(int(after))
        err = getattr(errno_mod, err_name.upper()) if not err_name.isdigit() else int(err_name)
        if not isinstance(err, int):
            raise ValueError(err_name)
        if after == "fsync":
            return FaultInjectingBackend(err, 1 << 62, fail_fsync=True)
        return FaultInjectingBackend(err, int(after))
    except (ValueError, AttributeError):
        raise ConfigError(f"io.backend: bad fault spec {spec!r}; expected e.g. 'fault:ENOSPC@1048576', "
                          "'fault:EIO@fsync' or 'fault:KILL@65536'") from None


WAIT_LIMIT_S = 120.0  # a ``wait:<path>`` action gives up after this long


class StageActions:
    """A :mod:`cpuckpt.faultpoint` handler: ``"<stage>=kill|sleep:<s>|wait:<path>|raise|eio"`` entries,
    ``;``-separated (``eio``: an ``OSError`` EIO, as a failing system call raises).

    Picklable (it holds only the spec), so it can be handed to a worker process.

    Raises:
        ConfigError: an entry without ``=`` or with an unknown action.
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._actions: dict[str, list[str]] = {}
        for entry in filter(None, (e.strip() for e in spec.split(";"))):
            stage, eq, action = entry.rpartition("=")
            ok = bool(eq and stage) and (action in ("kill", "raise", "eio") or action.startswith(("sleep:", "wait:")))
            if ok and action.startswith("sleep:"):
                try:
                    float(action[len("sleep:") :])
                except ValueError:
                    ok = False
            if not ok:
                raise ConfigError(f"{TEST_HOOK_ENV}: bad entry {entry!r}; expected '<stage>=kill', "
                                  "'<stage>=sleep:<seconds>', '<stage>=wait:<path>', '<stage>=raise' or '<stage>=eio'")
            self._actions.setdefault(stage, []).append(action)

    def __reduce__(self) -> tuple:
        return (StageActions, (self.spec,))

    def __repr__(self) -> str:
        return f"StageActions({self.spec!r})"

    def __call__(self, stage: str) -> None:
        for action in self._actions.get(stage, ()):
            if action == "kill":
                logger.warning("fault point: SIGKILL at %s", stage)
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "raise":
                raise RuntimeError(f"fault point: raise at {stage}")
            elif action == "eio":
                raise OSError(errno_mod.EIO, f"fault point: EIO at {stage}")
            elif action.startswith("wait:"):
                _wait_for_file(action[len("wait:") :], stage)
            else:
                time.sleep(float(action[len("sleep:") :]))


def _wait_for_file(path: str, stage: str) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault point {stage}: {path} did not appear within {WAIT_LIMIT_S:.0f} s")
        time.sleep(0.01)


def install(stage_spec: str | None = None) -> None:
    """Enable fault injection in this process: the ``fault:`` backends and the stage actions.

    ``stage_spec`` (else ``$CPUCKPT_TEST_HOOK`` now) sets the stage actions; when both are empty, no
    stage handler is installed (a previous one is removed). Idempotent; call it again to change the
    actions.
    """
    files.register_backend(PREFIX, make_backend)
    spec = stage_spec if stage_spec is not None else os.environ.get(TEST_HOOK_ENV, "")
    faultpoint.set_handler(StageActions(spec) if spec else None)


def uninstall() -> None:
    """Undo :func:`install`: no ``fault:`` backends, no stage handler."""
    factory = files.unregister_backend(PREFIX)
    if factory is not None and factory is not make_backend:  # someone else's "fault": keep it
        files.register_backend(PREFIX, factory)
    if isinstance(faultpoint.get_handler(), StageActions):
        faultpoint.set_handler(None)


_SITECUSTOMIZE = """\
# Written by cpuckpt.testing.faults.child_env for a test: fault injection in child interpreters.
import os

if os.environ.get({env!r}):
    from cpuckpt.testing import faults

    faults.install()
"""


def child_env(directory: str | os.PathLike, stage_spec: str) -> dict[str, str]:
    """Environment that makes Python interpreters started from now on call :func:`install` at startup.

    For processes the code under test starts itself, which inherit no handler (the memory tier's
    writer). Writes ``<directory>/sitecustomize.py`` (a test's own temporary directory) and returns
    ``PYTHONPATH`` with ``directory`` first and ``CPUCKPT_TEST_HOOK = stage_spec``: merge them into
    ``os.environ`` of the process that starts the children; remove ``CPUCKPT_TEST_HOOK`` again before
    a child that must run clean (a respawned writer) is started. A ``sitecustomize`` later on the
    path is shadowed.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(env=TEST_HOOK_ENV))
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), path) if p), TEST_HOOK_ENV: stage_spec}


def rewrite_manifest(path: str | os.PathLike, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest of the checkpoint in ``path`` as a writer would have written it (its own crc32c made
    anew): a test models a writer's mistake or a hostile checkpoint this way; damage is an edit without it."""
    from cpuckpt.format.manifest import MANIFEST_NAME, signed_json

    file = Path(path) / MANIFEST_NAME
    raw = json.loads(file.read_text())
    raw.pop("manifest_crc32c", None)
    edit(raw)
    file.write_text(signed_json(raw))


def flip_byte(path: str | os.PathLike, offset: int, mask: int = 0x10) -> None:
    """Damage one byte of ``path`` in place (XOR ``mask`` at ``offset``): a RAM page or a disk block changed after
    the commit, which checksums must report."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
