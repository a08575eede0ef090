"""Test harness: run a function on N real OS processes joined in a gloo process group.

``run_ranks(world_size, fn, *args, tmp_path=..., timeout_s=120)`` starts ``world_size`` processes
with cwd ``tmp_path``. Each one initialises ``torch.distributed`` with backend gloo over a
``FileStore`` inside ``tmp_path`` (no rendezvous port, no fixed /tmp name), loads the module that
defines ``fn`` *by file path* (pytest runs with ``--import-mode=importlib``, so test modules are not
importable by name), calls ``fn(*args)``, reports its return value (pickled) or its exception (type,
message, traceback text) in a per-rank result file, and always calls ``dist.destroy_process_group()``.
Each rank's stdout/stderr goes to ``tmp_path/_ranks<n>/rank<r>.log``.

The parent enforces a hard deadline: when it passes, every rank still alive is killed and the test
fails naming the ranks that hung. Once one rank has failed, the others get a short grace period
(they may be blocked in a collective the failed rank will never join) and are then killed. The
earliest rank failure is re-raised as :class:`RankError` with the child's traceback text.

Start methods (environment variable ``RANKS_START``):

- ``forkserver`` (default): ranks are forked from a multiprocessing fork server that has imported
  torch (and DTensor/FSDP/DCP) once per test session, so a rank starts in milliseconds instead of
  ~4 CPU-seconds of imports; this keeps the suite fast on a 2-core box. Nothing distributed exists
  in the server: every rank creates its own process group after the fork. The rank then changes
  into ``tmp_path`` and redirects its output before running anything.
- ``popen``: ``subprocess.Popen([sys.executable, "-c", ...], cwd=tmp_path)``: fully fresh
  interpreters (slower; for debugging the harness itself).

Either way ``cpuckpt`` is imported only inside the rank, from the installed package (the rank's
``sys.path`` holds neither the repository nor its cwd's parent).

The fixture ``run_ranks`` binds ``tmp_path``: ``run_ranks(2, fn, arg1, arg2)``.

Nothing left behind: at the end of the session, :func:`pytest_sessionfinish` fails the run when a
test leaked a process (a descendant of pytest, or an orphan carrying this session's environment
mark) or a ``cpuckpt*`` entry in /dev/shm (or in /dev/shm/cpuckpt-<uid>) that was not there at the
start, after a grace period of :data:`LEAK_GRACE_S` for things still exiting; it prints what
leaked, then kills and removes it. Another test session running on the same machine makes its own
/dev/shm entries: those are told apart by the pids their names (or lock files) record, and entries
that cannot be told apart are printed but not counted.

Under pytest-xdist (``-n N``) the check runs once, in the controller, after every worker has
finished its tests: the workers are the controller's children, so whatever a test on any worker
started is a descendant of the controller (or carries the environment mark, which the controller
sets before it starts the workers). The workers themselves and their own fork servers / resource
trackers are the harness, not leaks; each worker reports their pids (and its own) when it finishes.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import pickle
import re
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

__all__ = ["RankError", "run_ranks"]

_REPO = Path(__file__).resolve().parents[1]
# tests/dist/_helpers.py is imported by name in the parent (here) and in each rank (its bootstrap).
sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

# Heavy imports done once in the fork server (never cpuckpt: the ranks import the installed one).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "numpy",
            "yaml", "crc32c"]
# megatron-core and DeepSpeed too (~6 s and ~2.5 s of imports per rank on the 2-core box; neither starts a thread
# or changes torch's settings; DeepSpeed picks its CPU accelerator and sets PYTORCH_NVML_BASED_CUDA_CHECK, as each
# of its ranks would; megatron-core adds its safe globals to torch's weights_only allow-list, so every rank has
# them: a test of an allow-list of ours clears them, as test_deepspeed's _torch_safe_globals_only does), where no
# NVIDIA driver is: a fork server must never hold a CUDA context its ranks would inherit. A missing module is
# skipped by the fork server (an import that raises anything else would fail every rank: the versions are pinned).
if not os.path.exists("/dev/nvidiactl"):
    _PRELOAD += ["megatron.core", "megatron.core.dist_checkpointing",
                 "megatron.core.dist_checkpointing.strategies.async_utils",
                 "megatron.core.dist_checkpointing.strategies.fully_parallel", "deepspeed"]

# The rank's program. With the popen start method it is ``python -c`` with arguments in sys.argv;
# forked from the fork server it is run by runpy.run_path with RANK_ARGV, RANK_LOG, RANK_CWD,
# RANK_ENV and RANK_DROP_PATHS in its globals.
_CHILD = r"""
import datetime, importlib.util, os, pickle, sys, time, traceback

if "RANK_ARGV" in globals():
    argv = RANK_ARGV
    fd = os.open(RANK_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(RANK_CWD)
    for key in [k for k in os.environ if k.startswith("CPUCKPT_")]:
        del os.environ[key]
    os.environ.update(RANK_ENV)
    # neither the cwd nor the parent's cwd / the repository may shadow the installed cpuckpt
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) not in RANK_DROP_PATHS]
else:
    argv = sys.argv[1:]
module_path, fn_name, rank, world, store_path, args_path, result_path, timeout_s = argv
rank, world, timeout_s = int(rank), int(world), float(timeout_s)
out = None


def failure(e):
    return {"ok": False, "type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
            "traceback": traceback.format_exc(), "t": time.time()}


try:
    import torch
    import torch.distributed as dist
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        sys.path.insert(0, os.path.dirname(module_path))  # the test module's own helpers (tests/dist/_helpers.py)
        spec = importlib.util.spec_from_file_location(f"_rank_module_{os.getpid()}", module_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        with open(args_path, "rb") as f:
            args = pickle.load(f)
        value = getattr(module, fn_name)(*args)
        out = {"ok": True, "value": value, "t": time.time()}
    except BaseException as e:
        out = failure(e)
    finally:
        dist.destroy_process_group()
except BaseException as e:
    if out is None:
        out = failure(e)
tmp = result_path + ".tmp"
with open(tmp, "wb") as f:
    try:
        pickle.dump(out, f)
    except Exception as e:
        f.seek(0)
        f.truncate()
        pickle.dump({"ok": False, "type": "PicklingError", "message": f"return value not picklable: {e!r}",
                     "traceback": "", "t": time.time()}, f)
os.replace(tmp, result_path)
sys.stdout.flush()
sys.stderr.flush()
sys.exit(0 if out["ok"] else 1)
"""


class RankError(AssertionError):
    """A rank raised (or died, or hung). ``.rank``, ``.exc_type``, ``.message``, ``.results`` describe it."""

    def __init__(self, text: str, rank: int, exc_type: str, message: str, results: dict[int, dict]) -> None:
        super().__init__(text)
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.results = results


class _Rank:
    """One rank's process, whichever way it was started: ``poll()``, ``kill()``, ``wait()``."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.wait()
        self.proc.join()
        return self.proc.exitcode


_run_counter = 0
_forkserver_ctx: Any = None


def _forkserver() -> Any:
    global _forkserver_ctx
    if _forkserver_ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", *_PRELOAD])
        _forkserver_ctx = ctx
    return _forkserver_ctx


def _tail(path: Path, n: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


def run_ranks(
    world_size: int,
    fn: Callable[..., Any] | str,
    *args: Any,
    tmp_path: Path,
    timeout_s: float = 120.0,
    module_path: str | os.PathLike | None = None,
    grace_s: float = 15.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the ranks' return values (rank order).

    ``fn`` is a function defined at module level in a test module (or helper module), or its name
    together with ``module_path``. ``args`` must be picklable; so must the return values. ``env``
    adds environment variables for the ranks (``CPUCKPT_*`` variables of the parent are dropped).

    Raises:
        RankError: a rank raised (re-raised with its traceback text), died, or hung past ``timeout_s``.
    """
    global _run_counter
    if callable(fn):
        module_path = module_path or inspect.getfile(fn)
        fn_name = fn.__name__
    else:
        fn_name = fn
        if module_path is None:
            raise ValueError("run_ranks: give module_path when fn is a name")
    module_path = Path(module_path).resolve()  # ranks run in tmp_path
    tmp_path = Path(tmp_path).resolve()
    _run_counter += 1
    work = tmp_path / f"_ranks{_run_counter}"
    work.mkdir(parents=True)
    store_path = work / "filestore"
    args_path = work / "args.pkl"
    args_path.write_bytes(pickle.dumps(args))
    script = work / "rank_main.py"
    script.write_text(_CHILD)
    rank_env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
    rank_env.update(env or {})
    drop_paths = sorted({os.path.realpath(os.getcwd()), os.path.realpath(_REPO)})
    start = os.environ.get("RANKS_START", "forkserver")
    if start not in ("forkserver", "popen"):
        raise ValueError(f"RANKS_START must be forkserver or popen, got {start!r}")

    ranks: list[_Rank] = []
    logs = [work / f"rank{r}.log" for r in range(world_size)]
    results_paths = [work / f"result{r}.pkl" for r in range(world_size)]
    hung: list[int] = []
    kill_reason = f"still running at the {timeout_s:.0f} s deadline"
    try:
        for r in range(world_size):
            argv = [str(module_path), fn_name, str(r), str(world_size), str(store_path), str(args_path),
                    str(results_paths[r]), str(timeout_s)]
            if start == "popen":
                child_env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
                # the installed cpuckpt, never the source tree: drop the repository from PYTHONPATH
                pythonpath = [p for p in child_env.pop("PYTHONPATH", "").split(os.pathsep)
                              if p and os.path.realpath(p) not in drop_paths]
                if pythonpath:
                    child_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
                child_env.update(rank_env)
                with open(logs[r], "wb") as logf:
                    proc: Any = subprocess.Popen(
                        [sys.executable, "-c", _CHILD, *argv], cwd=str(tmp_path), env=child_env,
                        stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    )
            else:
                init = {"RANK_ARGV": argv, "RANK_LOG": str(logs[r]), "RANK_CWD": str(tmp_path), "RANK_ENV": rank_env,
                        "RANK_DROP_PATHS": drop_paths}
                proc = _forkserver().Process(target=runpy.run_path, args=(str(script),),
                                             kwargs={"init_globals": init, "run_name": "__cpuckpt_rank__"},
                                             name=f"rank{r}")
                proc.start()
            ranks.append(_Rank(proc))
        deadline = time.monotonic() + timeout_s
        first_fail_at: float | None = None
        while True:
            codes = [p.poll() for p in ranks]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_fail_at is None and any(c not in (None, 0) for c in codes):
                first_fail_at = now
            if now > deadline:
                break
            if first_fail_at is not None and now > first_fail_at + grace_s:
                kill_reason = f"still running {grace_s:.0f} s after another rank failed"
                break
            time.sleep(0.02)
    finally:
        for r, p in enumerate(ranks):
            if p.poll() is None:
                hung.append(r)
                p.kill()
        for p in ranks:
            p.wait()

    results: dict[int, dict] = {}
    for r in range(world_size):
        try:
            results[r] = pickle.loads(results_paths[r].read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            how = f"killed: {kill_reason}" if r in hung else f"exit code {ranks[r].poll()}"
            results[r] = {"ok": False, "type": "RankDied", "message": f"no result ({how})", "traceback": "",
                          "t": float("inf") if r in hung else time.time()}
    failed = sorted((res["t"], r) for r, res in results.items() if not res["ok"])
    if failed:
        r = failed[0][1]
        res = results[r]
        hung_note = f"; ranks {hung} were killed ({kill_reason})" if hung else ""
        others = ", ".join(f"rank {q}: {results[q]['type']}: {results[q]['message'][:300]}" for _, q in failed[1:])
        text = (f"rank {r} of {world_size} failed in {fn_name}: {res['type']}: {res['message']}{hung_note}\n"
                f"--- rank {r} traceback ---\n{res['traceback']}"
                f"--- rank {r} output (tail, {logs[r]}) ---\n{_tail(logs[r])}"
                + (f"\n--- other failures --- {others}" if others else ""))
        if hung and all(results[q]["type"] == "RankDied" for _, q in failed):
            text = f"ranks {hung} of {world_size} hung in {fn_name} (killed: {kill_reason})\n" + text
        raise RankError(text, r, res["type"], res["message"], results)
    return [results[r]["value"] for r in range(world_size)]


@pytest.fixture(autouse=True)
def _sigint_left_alone() -> Iterator[None]:
    """A test that leaves this process's SIGINT handler or mask changed fails (and it is put back): every later test
    of the worker, and every process it starts, would inherit it (Ctrl-C tests then see no KeyboardInterrupt)."""
    before = signal.getsignal(signal.SIGINT)
    was_blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if after != before or blocked != was_blocked:
        if before is not None:  # None: a handler not installed from Python, nothing to put back
            signal.signal(signal.SIGINT, before)
        signal.pthread_sigmask(signal.SIG_BLOCK if was_blocked else signal.SIG_UNBLOCK, {signal.SIGINT})
        pytest.fail(f"the test left SIGINT changed: handler {before!r} -> {after!r}, blocked {was_blocked} -> "
                    f"{blocked}")


@pytest.fixture(name="run_ranks")
def _run_ranks_fixture(tmp_path: Path) -> Callable[..., list[Any]]:
    def _run(world_size: int, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        kwargs.setdefault("tmp_path", tmp_path)
        return run_ranks(world_size, fn, *args, **kwargs)

    return _run


@pytest.fixture(scope="session")
def rank_runner() -> Callable[..., list[Any]]:
    """The bare ``run_ranks`` (pass ``tmp_path=``), for fixtures wider than one test."""
    return run_ranks


@pytest.fixture
def fresh_pool() -> Iterator[None]:
    """No host pool in this process when the test starts, and none left when it ends (its saves waited for).

    The pool is per process on purpose (pinned memory is registered once and reused by every save), so a
    test that checks how a pool is made, sized, pinned or reused starts from none, and the next test does
    not inherit its pool.
    """
    import cpuckpt
    from cpuckpt.transfer.staging import release_pool

    release_pool()
    yield
    cpuckpt.wait_all()
    release_pool()


# Test files whose tests take longest (wall): they are collected first, so that under pytest-xdist
# they start at once on every worker instead of being the tail of the run. Only the order changes
# (a stable sort by file: tests keep their order within a file, and every worker sorts the same way).
START_FIRST = (
    "tests/dist/test_multinode_megatron.py",  # two launches of two nodes each: ~2 min per test on 2 cores
    "tests/dist/test_multinode_deepspeed.py",
    "tests/integrations/test_megatron_memory.py",
    "tests/faults/test_kill_sweep.py",
    "tests/integrations/test_megatron.py",
    "tests/test_demo.py",
    "tests/test_bench_",
    "tests/dist/test_multinode.py",
    "tests/integrations/test_deepspeed.py",
    "tests/faults/test_interrupt.py",
    "tests/integrations/",
    "tests/dist/test_memory_tier",
    "tests/cli/test_cli.py",
)


def _start_rank(item: pytest.Item) -> int:
    nodeid = item.nodeid
    return next((i for i, prefix in enumerate(START_FIRST) if nodeid.startswith(prefix)), len(START_FIRST))


def _group_nodeids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``xdist_group`` for pytest >= 9: pytest-xdist (3.8) puts a test on its group's worker by appending
    ``@<group>`` to ``item._nodeid`` in the worker, but pytest 9 keeps the id in ``item._id``, so the
    suffix was silently lost and every grouped test ran wherever it landed (a module fixture such as a
    reference run, a built wheel or a training run was then made once per worker, not once). On an xdist
    worker with ``--dist loadgroup`` (``config.option.loadgroup``), give each marked item the id
    pytest-xdist means to give it; elsewhere, or where the suffix is already there, nothing changes."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId  # pytest >= 9 (the check above)

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (:data:`START_FIRST`); ``slow`` tests (pyproject: "off by default") run only
    with ``-m slow`` or ``CPUCKPT_SLOW=1``."""
    items.sort(key=_start_rank)
    _group_nodeids(config, items)
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("CPUCKPT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or CPUCKPT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------ leak check

LEAK_GRACE_S = 10.0  # processes and files still on their way out get this long
SESSION_MARK = "PYTEST_CPUCKPT_SESSION"  # not CPUCKPT_*: ranks drop those, their children must keep it
_SHM = Path("/dev/shm")
_SAMPLE_S = 0.5


class _LeakWatch:
    """What existed at session start, and every descendant pid seen since (they name /dev/shm entries)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.workers: set[int] = set()  # pytest-xdist workers (pids), reported as they finish
        self.worker_helpers: set[int] = set()  # their fork servers and resource trackers
        self.mark = f"{os.getpid()}-{time.time_ns()}"
        os.environ[SESSION_MARK] = self.mark
        self.t0 = time.time()
        self.procs_at_start = {(p.pid, _created(p)) for p in psutil.process_iter()}
        self.shm_at_start = set(_shm_entries())
        self.foreign = _foreign_sessions(self.me)
        self.seen: set[int] = {os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="leak-watch", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            with contextlib.suppress(psutil.Error):
                self.seen.update(c.pid for c in self.me.children(recursive=True))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def leaked_processes(self) -> list[psutil.Process]:
        """Processes of this session alive now, except pytest itself and its own fork server/resource tracker."""
        out: list[psutil.Process] = []
        descendants: set[int] = set()
        with contextlib.suppress(psutil.Error):
            descendants = {c.pid for c in self.me.children(recursive=True)}
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
            if p.pid == self.me.pid or p.pid in self.workers or (p.pid, _created(p)) in self.procs_at_start:
                continue
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if (p.info["ppid"] == self.me.pid or p.pid in self.worker_helpers) and _harness_helper(p):
                continue  # the harness's own helpers (of pytest or of an xdist worker): they end with it
            ours = p.pid in descendants
            if not ours:
                try:
                    ours = p.environ().get(SESSION_MARK) == self.mark
                except psutil.Error:
                    ours = False
            if ours:
                self.seen.add(p.pid)
                out.append(p)
        return out

    def leaked_shm(self) -> tuple[list[Path], list[Path]]:
        """New cpuckpt entries in /dev/shm: (this session's, ones another session may have made)."""
        new = [e for e in _shm_entries() if e not in self.shm_at_start]
        if not new:
            return [], []
        foreign = self.foreign or _foreign_sessions(self.me)
        ours, unsure = [], []
        for e in new:
            (ours if not foreign or _pids_named(e) & self.seen else unsure).append(e)
        return ours, unsure


def _harness_helper(p: psutil.Process) -> bool:
    """A multiprocessing fork server or resource tracker (the harness starts them; they end with their parent)."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.forkserver import main" in cmd or "multiprocessing.resource_tracker import main" in cmd


def _created(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


def _shm_entries() -> list[Path]:
    """``/dev/shm/cpuckpt*`` and what is in ``/dev/shm/cpuckpt-<uid>`` (the RAM roots)."""
    try:
        top = [_SHM / n for n in os.listdir(_SHM) if n.startswith("cpuckpt")]
    except OSError:
        return []
    base = _SHM / f"cpuckpt-{os.geteuid()}"
    with contextlib.suppress(OSError):
        top += [base / n for n in os.listdir(base)]
    return top


def _pids_named(entry: Path) -> set[int]:
    """Pids an entry records: numbers in its name, and the pid in each lock file of a RAM root."""
    pids = {int(n) for n in re.findall(r"(?<![0-9a-f])p?(\d{2,})", entry.name)}
    if entry.is_dir() and not entry.is_symlink():
        for lock in entry.glob(".*.lock"):
            with contextlib.suppress(OSError, ValueError):
                pids.add(int(lock.read_text().strip() or 0))
    return pids


def _foreign_sessions(me: psutil.Process) -> bool:
    """Whether another test session (a pytest outside this process tree) runs on this machine now."""
    mine = {me.pid, *(c.pid for c in me.children(recursive=True))}
    with contextlib.suppress(psutil.Error):
        mine.update(a.pid for a in me.parents())
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid not in mine and any("pytest" in a for a in (p.info["cmdline"] or [])[:3]):
            return True
    return False


_leak_watch: _LeakWatch | None = None


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    # In pytest_configure, not pytest_sessionstart: xdist starts its workers in its own
    # pytest_sessionstart, and they (so every process a test starts) must inherit the session mark.
    global _leak_watch
    if not _xdist_worker(config) and _leak_watch is None:
        _leak_watch = _LeakWatch()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist (controller): a worker finished; it and its own helpers are not leaks."""
    out = getattr(node, "workeroutput", {})
    if _leak_watch is not None and out.get("leak_watch_pid"):
        _leak_watch.workers.add(int(out["leak_watch_pid"]))
        _leak_watch.worker_helpers.update(out.get("leak_watch_helpers", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a test left a process or a /dev/shm entry behind; print, kill and remove it.

    Runs in the controller (or the only pytest process), never in an xdist worker.
    """
    if _xdist_worker(session.config):
        # sent to the controller when this returns (xdist's own hookwrapper): this worker and its helpers
        me = psutil.Process()
        session.config.workeroutput["leak_watch_pid"] = me.pid  # type: ignore[attr-defined]
        session.config.workeroutput["leak_watch_helpers"] = [  # type: ignore[attr-defined]
            c.pid for c in me.children() if _harness_helper(c)]
        return
    watch = _leak_watch
    if watch is None:
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        procs = watch.leaked_processes()
        ours, unsure = watch.leaked_shm()
        if (not procs and not ours) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    watch.stop()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    if reporter is not None:
        reporter.ensure_newline()

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            sys.stderr.write(line + "\n")

    for e in unsure:
        say(f"leak check: {e} appeared during the session; not counted (another test session runs here)")
    if not procs and not ours:
        return
    say(f"leak check: tests left {len(procs)} process(es) and {len(ours)} /dev/shm entries behind (still there "
        f"{LEAK_GRACE_S:.0f} s after the last test); killing and removing them:")
    for p in procs:
        with contextlib.suppress(psutil.Error):
            say(f"  process {p.pid} (parent {p.ppid()}, cwd {p.cwd()}): {' '.join(p.cmdline())[:300]}")
    for e in ours:
        say(f"  /dev/shm entry {e}")
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)
    for e in ours:
        with contextlib.suppress(OSError):
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
