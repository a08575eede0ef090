"""Megatron-LM's saves through cpuckpt's memory tier, with real megatron-core on 2 gloo ranks.

Each rank drives megatron-core the way Megatron-LM's ``save_checkpoint`` does (rank 0 prunes the
non-persistent directory and creates ``iter_<N>``, ``dist_checkpointing.save`` with the async
strategy, a finalize function that writes the directory's ``latest_checkpointed_iteration.txt``,
megatron-core's persistent ``AsyncCallsQueue`` where its worker takes part in what is asserted, else
the temporal one: a worker forked per save, not spawned with seconds of imports) and restarts the way
Megatron-LM's loader does (the newer of the two trackers, ``dist_checkpointing.load`` of ``iter_<N>``).
Megatron-LM itself is not on PyPI; the hook that installs this into ``pretrain_gpt.py`` runs on the GPU
machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks load this file by path, too
from test_megatron import ENV, _check, _setup, _sharded, _template

TRACKER = "latest_checkpointed_iteration.txt"


def _config(root: Path) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"},
            "memory": {"root": str(root / "ram"), "slots": 2, "headroom_bytes": 0}, "timeout_s": 60}


def _watched(base: Path, timeout_s: float = 60.0, **memory: Any) -> tuple[Any, Any, Any]:
    """The hook's arrangement in a rank: megatron-core's persistent queue watched by cpuckpt, a ``MegatronMemory`` of
    it (``memory`` overrides ``_config``'s ``memory:`` keys) and the strategy; returns (queue, router, strategy)."""
    from cpuckpt.integrations.megatron.guard import watch_async_queue
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config

    cfg = {**_config(base), "memory": {**_config(base)["memory"], **memory}, "timeout_s": timeout_s}
    queue = watch_async_queue(AsyncCallsQueue(persistent=True), timeout_s)
    router = MegatronMemory(base / "save", base / "save" / "non_persistent", Config.from_dict(cfg),
                            queue_of=lambda: queue)
    return queue, router, CpuckptSaveStrategy(cfg, memory=router)


def _read_tracker(d: Path) -> int | None:
    try:
        return int((d / TRACKER).read_text())
    except FileNotFoundError:
        return None


def _megatron_save(strategy, queue, router, d: Path, it: int, device: str, order: list | None = None,
                   logits: bool = False) -> dict:
    """One save as Megatron-LM's save_checkpoint makes it (async, persistent worker). ``order``: its tracker write
    appends ``it`` (a persistent save's: with whether its directory held a complete checkpoint then). ``logits``: as
    with Megatron-LM's logits saver, the request's finalize functions move onto a second request, whose worker
    function runs in megatron-core's worker, scheduled after it."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from megatron.core import dist_checkpointing

    path = d / f"iter_{it:07d}"
    if dist.get_rank() == 0:
        if d == router.np_dir:
            assert router.cleanup(d)  # replaces Megatron-LM's cleanup_old_non_persistent_checkpoint
        path.mkdir(parents=True, exist_ok=True)  # ensure_directory_exists
    sd = _sharded(it, device)
    request = dist_checkpointing.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                      **mcore_async_kwargs())

    def iter_finalize_fn() -> None:  # Megatron-LM's: the tracker of the directory saved to
        if dist.get_rank() == 0:
            (d / TRACKER).write_text(str(it))
        if order is not None:
            from cpuckpt.backend.committed import check_complete

            order.append(it if d == router.np_dir else (it, check_complete(path).complete))

    request.add_finalize_fn(iter_finalize_fn)
    second = None
    if logits:
        from cpuckpt.integrations.megatron.compat import make_async_request

        second = make_async_request("mcore", time.sleep, (0.2,), request.finalize_fns.copy())
        request.finalize_fns.clear()
    queue.schedule_async_request(request)
    if second is not None:
        queue.schedule_async_request(second)
    return sd


def rank_train(root: str, iterations: list[int]) -> None:
    """Memory (non-persistent) saves every iteration, persistent ones every 4th; then SIGKILL (a crash)."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config

    _, _, device = _setup()
    root_p = Path(root)
    router = MegatronMemory(root_p / "save", root_p / "save" / "non_persistent", Config.from_dict(_config(root_p)))
    from cpuckpt.integrations.megatron.hook import order_optimizer_steps

    order_optimizer_steps()  # the training below orders its writes after the saves' copies (ordering optimizer)
    strategy = CpuckptSaveStrategy(_config(root_p), memory=router, ordering="optimizer")
    queue = AsyncCallsQueue(persistent=True)
    for it in iterations:
        d = router.save_dir if it % 4 == 0 else router.np_dir
        sd = _megatron_save(strategy, queue, router, d, it, device)
        from cpuckpt.integrations.megatron.strategy import order_pending_saves

        order_pending_saves()  # what the wrapped optimizer step does first
        for t in (sd["w"].data, sd["b"].data):  # the next optimizer step changes every saved tensor
            t.fill_(-7.0)
        queue.maybe_finalize_async_calls(blocking=True)  # finalize: memory commit (or durable, every 4th)
    # stock megatron-core reads the newest memory checkpoint through its iter_<N> link, and the durable one
    newest = router.np_dir / f"iter_{iterations[-1]:07d}"
    _check(dist_checkpointing.load(_template(device), str(newest)), iterations[-1], device)
    durable = max(i for i in iterations if i % 4 == 0)
    _check(dist_checkpointing.load(_template(device), str(router.save_dir / f"iter_{durable:07d}")), durable, device)
    (root_p / f"trainer-pid-{dist.get_rank()}").write_text(str(os.getpid()))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def rank_restart(root: str) -> dict:
    """Megatron-LM's restart: load the newer of the two trackers' checkpoints, then train on. Its one save goes
    through megatron-core's temporal caller (a forked worker): what is asserted is the tier's, and the persistent
    worker (seconds of imports to spawn) is :func:`rank_train`'s."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import load_strategy
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config

    _, _, device = _setup()
    root_p = Path(root)
    router = MegatronMemory(root_p / "save", root_p / "save" / "non_persistent", Config.from_dict(_config(root_p)))
    np_it, save_it = _read_tracker(router.np_dir) or -1, _read_tracker(router.save_dir) or -1
    d, it = (router.np_dir, np_it) if np_it >= save_it else (router.save_dir, save_it)
    loaded = dist_checkpointing.load(_template(device), str(d / f"iter_{it:07d}"),
                                     sharded_strategy=load_strategy(_config(root_p)))
    _check(loaded, it, device)
    from_memory = os.path.realpath(d / f"iter_{it:07d}").startswith(str(root_p / "ram"))
    strategy = CpuckptSaveStrategy(_config(root_p), memory=router)
    queue = AsyncCallsQueue(persistent=False)
    _megatron_save(strategy, queue, router, router.np_dir, it + 1, device)
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    # the save after the restart took the other slot: the checkpoint just loaded is still there
    _check(dist_checkpointing.load(_template(device), str(d / f"iter_{it:07d}")), it, device)
    out = {"loaded": it, "from_memory": from_memory, "np_tracker": _read_tracker(router.np_dir),
           "links": sorted(p.name for p in router.np_dir.iterdir() if p.is_symlink()),
           "ram": str(router.tier.root.path)}
    queue.close()
    router.close()  # end of training (Megatron-LM: maybe_finalize_async_save(terminate=True))
    dist.barrier()
    out["after_close"] = {"ram_exists": Path(out["ram"]).exists(), "np_tracker": _read_tracker(router.np_dir),
                          "links": sorted(p.name for p in router.np_dir.iterdir() if p.is_symlink())}
    return out


def _wait_writers_gone(ram: Path, timeout_s: float = 30.0) -> None:
    from cpuckpt.tier.persister import lock_held

    deadline = time.monotonic() + timeout_s
    while any(lock_held(p) for p in ram.rglob(".writer-*.lock")):
        assert time.monotonic() < deadline, "writer processes still running after their trainers died"
        time.sleep(0.05)


def _processes_in(cwd: Path) -> list[str]:
    """Processes (of any parent) whose working directory is ``cwd``: the ranks' and their children's."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            if p.cwd() == str(cwd) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"pid {p.pid} (parent {p.info['ppid']}): {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _wait_no_process_in(cwd: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while left := _processes_in(cwd):
        assert time.monotonic() < deadline, f"processes outlived their SIGKILLed trainers: {left}"
        time.sleep(0.2)


HOLD_LIMIT_S = 60.0  # a commit held by a test that is never released fails (loudly) after this long


def _done_probe(call: Any) -> Any:
    """The done probe of a memory save's call on a watched queue (whether this rank's save ended, committed or
    failed): what the watchdog's finalize agrees on. Asking it finalizes nothing."""
    from cpuckpt.integrations.megatron.guard import DONE_MARK

    probes = [getattr(fn, DONE_MARK) for fn in call.async_request.finalize_fns if hasattr(fn, DONE_MARK)]
    assert len(probes) == 1, call
    return probes[0]


def _wait_ended(calls: list[Any], what: str, timeout_s: float = HOLD_LIMIT_S) -> None:
    """Wait until the saves of ``calls`` (queue calls of memory saves) ended on this rank, without finalizing any."""
    probes = [_done_probe(call) for call in calls]
    deadline = time.monotonic() + timeout_s
    while not all(probe() for probe in probes):
        assert time.monotonic() < deadline, f"{what} did not end within {timeout_s:.0f} s"
        time.sleep(0.01)


class _RaiseOnce:
    """A :mod:`cpuckpt.faultpoint` handler: raises (as ``<stage>=raise`` does) the first time ``stage`` is reached
    in this process, and sets :attr:`hit`; passes every other time."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.hit = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, stage: str) -> None:
        if stage != self.stage:
            return
        with self._lock:
            if self.hit.is_set():
                return
            self.hit.set()
        raise RuntimeError(f"fault point: raise at {stage}")


class _HeldCommits:
    """A :mod:`cpuckpt.faultpoint` handler that holds the commit of each save at its ``.metadata`` rename (on the
    coordinator: the n-th rename in this process is save n's where saves commit one at a time) until the test
    :meth:`release` s it; one never released fails after :data:`HOLD_LIMIT_S`."""

    STAGE = "before-rename:.metadata"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._renames = 0
        self._released: dict[int, threading.Event] = {}
        self._all = False

    def _event(self, n: int) -> threading.Event:
        with self._lock:
            event = self._released.setdefault(n, threading.Event())
            if self._all:
                event.set()
            return event

    def __call__(self, stage: str) -> None:
        if stage != self.STAGE:
            return
        with self._lock:
            self._renames += 1
            n = self._renames
        if not self._event(n).wait(HOLD_LIMIT_S):
            raise RuntimeError(f"test: the commit of save {n} was held {HOLD_LIMIT_S:.0f} s and never released (did "
                               "the trainer wait for it where the test holds it?)")

    def release(self, n: int, after_s: float = 0.0) -> None:
        """Let the commit of save ``n`` go on (now, or ``after_s`` later from a timer thread); 0: no save."""
        if n < 1:
            return
        event = self._event(n)
        if after_s:
            timer = threading.Timer(after_s, event.set)
            timer.daemon = True
            timer.start()
        else:
            event.set()

    def release_all(self) -> None:
        with self._lock:
            self._all = True
            events = list(self._released.values())
        for event in events:
            event.set()


def test_memory_and_persistent_saves_then_sigkill_resume_from_memory(run_ranks, tmp_path):
    from cpuckpt import procs, runfiles

    with pytest.raises(AssertionError, match="rank"):
        run_ranks(2, rank_train, str(tmp_path), list(range(1, 7)), timeout_s=240, env=ENV)
    _wait_writers_gone(tmp_path / "ram")
    # Megatron's persistent workers (spawned by the killed trainers) exit with them, not orphaned to init
    _wait_no_process_in(tmp_path)
    # what a trainer killed mid-save leaves in /dev/shm: the restart's first save removes it
    dead = [int((tmp_path / f"trainer-pid-{r}").read_text()) for r in range(2)]
    owner = f"b{runfiles.boot_tag()}-h{procs.host_tag()}-n{procs.pid_ns_tag()}"
    stale = [runfiles.run_dir() / f"cpuckpt-megatron-p{pid}-{owner}-r{r}-0123456789ab.{ext}"
             for r, pid in enumerate(dead) for ext in ("alive", "status")]
    for path in stale:
        path.write_text("1")
    save, np_dir = tmp_path / "save", tmp_path / "save" / "non_persistent"
    # memory-only saves never advance --save's tracker: it names the persistent save (4); the memory one 6
    assert _read_tracker(save) == 4 and _read_tracker(np_dir) == 6
    # the ring of 2 slots holds the two newest memory checkpoints (5, 6), each under Megatron's name
    links = {p.name: os.path.realpath(p) for p in np_dir.iterdir() if p.is_symlink()}
    assert sorted(links) == ["iter_0000005", "iter_0000006"], links
    assert len(set(links.values())) == 2 and all("/slot-" in t for t in links.values()), links
    durable = save / "iter_0000004"  # a whole torch_dist checkpoint: data, .metadata, metadata.json (and, up to
    assert not durable.is_symlink()  # megatron-core 0.16, common.pt; 0.19 keeps the common state in the DCP files)
    assert {".metadata", "metadata.json"} <= {p.name for p in durable.iterdir()}
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000004"]

    res = run_ranks(2, rank_restart, str(tmp_path), timeout_s=240, env=ENV)
    assert [(r["loaded"], r["from_memory"]) for r in res] == [(6, True), (6, True)], res
    assert res[0]["np_tracker"] == 7 and res[0]["links"] == ["iter_0000006", "iter_0000007"], res[0]
    # end of training: RAM root removed, and no link or tracker left pointing into it
    assert res[0]["after_close"] == {"ram_exists": False, "np_tracker": None, "links": []}, res[0]["after_close"]
    assert [p.name for p in stale if p.exists()] == []
    _wait_no_process_in(tmp_path)


def rank_pending_saves_overlap(root: str) -> dict:
    """Saves every iteration into a ring of 3 slots (iteration 4 persistent, into --save; the others non-persistent),
    finalized only where the adapter does it (as in Megatron-LM's ``save_checkpoint``, with the hook's wrapper of
    its cleanup): each save first finalizes the saves older than the newest two, of either kind."""
    import types

    import torch.distributed as dist
    from cpuckpt.integrations.megatron import hook
    from megatron.core import dist_checkpointing

    from cpuckpt.testing import faults

    # Each save's worker reports 1 s late (the persistent worker takes them one by one): the saves are still
    # pending when the next ones start, so what the adapter finalizes is what it chose to, not what had ended.
    faults.install("megatron-worker:rank0=sleep:1.0;megatron-worker:rank1=sleep:1.0")
    _, _, device = _setup()
    root_p = Path(root)
    queue, router, strategy = _watched(root_p, slots=3)
    module = types.SimpleNamespace(cleanup_old_non_persistent_checkpoint=lambda save_dir, leave_ckpt_num=1,
                                   do_async=False: router.cleanup(save_dir) if dist.get_rank() == 0 else None)
    hook._finalize_before_cleanup(module, queue_of=lambda: queue, memory_of=lambda: router)

    def pending() -> list[str]:
        return sorted(Path(fn.cpuckpt_dir).name for call in queue.async_calls
                      for fn in call.async_request.finalize_fns if hasattr(fn, "cpuckpt_dir"))

    seen, trackers = [], []
    for it in range(1, 7):
        d = router.save_dir if it == 4 else router.np_dir
        if d == router.np_dir:
            module.cleanup_old_non_persistent_checkpoint(str(d), leave_ckpt_num=1)
        path = d / f"iter_{it:07d}"
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        request = dist_checkpointing.save(_sharded(it, device), str(path), sharded_strategy=strategy,
                                          async_sharded_save=True, **_async_kwargs())
        seen.append(pending())  # what the save of ``it`` went beside
        dist.barrier()  # rank 0 moved D's tracker off a reused slot by now
        named = _read_tracker(router.np_dir)  # never a checkpoint megatron-core has not finalized (no metadata.json)
        trackers.append((named, named is None or (router.np_dir / f"iter_{named:07d}" / "metadata.json").is_file()))

        def iter_finalize_fn(it: int = it, d: Path = d) -> None:
            if dist.get_rank() == 0:
                (d / TRACKER).write_text(str(it))

        request.add_finalize_fn(iter_finalize_fn)
        queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    out = {"seen": seen, "trackers": trackers, "np_tracker": _read_tracker(router.np_dir),
           "save_tracker": _read_tracker(router.save_dir),
           "links": sorted(p.name for p in router.np_dir.iterdir() if p.is_symlink())}
    for it, d in ((4, router.save_dir), (5, router.np_dir), (6, router.np_dir)):  # each loads with its own values
        _check(dist_checkpointing.load(_template(device), str(d / f"iter_{it:07d}")), it, device)
    queue.close()
    router.close()
    faults.uninstall()
    return out


def rank_memory_saves_finalized_in_the_trainer(root: str, fail_at: int, ram: str | None = None) -> dict:
    """Saves every iteration through a queue the adapter watches (as Megatron-LM's, with the hook): memory saves
    (all but iteration 3, a persistent one, unless ``fail_at``) go to no worker; each iteration starts with
    Megatron-LM's non-blocking finalize. ``fail_at``: that save's commit raises (a fault point), on the coordinator.
    ``ram``: the RAM root (default ``root/ram``; on another filesystem than ``root``, as /dev/shm usually is from
    --save, megatron-core 0.16's common.pt crosses filesystems into each slot)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from cpuckpt import faultpoint
    from cpuckpt.errors import CpuckptError

    _, _, device = _setup()
    root_p = Path(root)
    queue, router, strategy = _watched(root_p, slots=3, **({"root": ram} if ram else {}))

    def worker_spawned() -> bool:
        caller = getattr(queue, "persistent_caller", None)
        return caller is not None and caller.process is not None

    finalized, workers, errors, order = [], [], [], []
    for it in range(1, 8):
        try:  # Megatron-LM: the previous saves that ended on every rank, at the top of each iteration
            finalized += queue.maybe_finalize_async_calls(blocking=False)
        except CpuckptError as e:
            errors.append((it, type(e).__name__, str(e)))
        if it == fail_at:
            # the earlier saves (two may still be in flight) committed first: only this save's commit meets the fault
            _wait_ended(list(queue.async_calls), f"the saves before {it}")
            fault = _RaiseOnce("before-rename:.metadata")
            previous = faultpoint.set_handler(fault)
        durable = it == 3 and not fail_at
        _megatron_save(strategy, queue, router, router.save_dir if durable else router.np_dir, it, device, order)
        workers.append(worker_spawned())
        if it == fail_at:
            if dist.get_rank() == 0:  # the coordinator: its commit (the .metadata rename) raised before the fault goes
                assert fault.hit.wait(HOLD_LIMIT_S), f"the commit of save {it} never reached its .metadata rename"
            faultpoint.set_handler(previous)
        time.sleep(0.3)  # a training iteration
    try:
        finalized += queue.maybe_finalize_async_calls(blocking=True)
    except CpuckptError as e:
        errors.append((8, type(e).__name__, str(e)))
    dist.barrier()
    out = {"finalized": finalized, "order": order, "workers": workers, "errors": errors,
           "ram": os.path.realpath(router.np_dir / "iter_0000007").startswith(str(router.tier.root.path)),
           "np_tracker": _read_tracker(router.np_dir),
           "save_tracker": _read_tracker(router.save_dir),
           "finalized_dirs": sorted(p.parent.name for p in router.np_dir.glob("iter_*/metadata.json"))}
    for it in (3, 6, 7) if not fail_at else (6, 7):  # what Megatron-LM's restart would load: their own values
        if it != fail_at:
            d = router.save_dir if it == 3 else router.np_dir
            _check(dist_checkpointing.load(_template(device), str(d / f"iter_{it:07d}")), it, device)
    queue.close()
    router.close()
    return out


def rank_persist_fails_on_rank1(root: str) -> dict:
    """A persistent save on a watched queue whose persist fails on rank 1 only (its writer's durable writes fail):
    the finalize raises the same error on every rank, and Megatron's finalize functions (the tracker) never run."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.guard import watch_async_queue
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config
    from cpuckpt.errors import CpuckptError
    from cpuckpt.testing import faults

    _, _, device = _setup()
    root_p = Path(root)
    clean = dict(os.environ)
    os.environ.update(faults.child_env(root_p / "site", "unused=sleep:0"))  # the writers register the fault backends
    cfg = {**_config(root_p), "memory": {**_config(root_p)["memory"], "slots": 3}}
    if dist.get_rank() == 1:
        cfg["io"] = {**cfg["io"], "backend": "fault:ENOSPC@0"}  # rank 1's writer: every durable write fails
    queue = watch_async_queue(AsyncCallsQueue(persistent=True), 60.0)
    router = MegatronMemory(root_p / "save", root_p / "save" / "non_persistent", Config.from_dict(cfg),
                            queue_of=lambda: queue)
    strategy = CpuckptSaveStrategy(cfg, memory=router)
    order: list[int] = []
    _megatron_save(strategy, queue, router, router.save_dir, 4, device, order)
    no_worker = queue.async_calls[-1].async_request.async_fn is None
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except CpuckptError as e:
        error = (type(e).__name__, str(e))
    dist.barrier()
    out = {"no_worker": no_worker, "error": error, "order": order, "save_tracker": _read_tracker(router.save_dir)}
    queue.close()
    try:
        router.close()
    except CpuckptError:  # the failed persist is raised again at the end of training; seen above already
        pass
    os.environ.clear()
    os.environ.update(clean)  # the next cases' processes start clean (megatron-core's worker: the CPU stubs)
    return out


def rank_in_trainer_cases(root: str, shm: str) -> list[dict]:
    """The cases in one launch of the ranks (each its own tier, queue and RAM root): all saves committed (RAM root
    ``shm``); a commit that fails (iteration 5); the finalize functions moved onto a logits request; a persist that
    fails on rank 1."""
    return [rank_memory_saves_finalized_in_the_trainer(str(Path(root) / "ok"), 0, shm),
            rank_memory_saves_finalized_in_the_trainer(str(Path(root) / "fails"), 5),
            rank_logits_requests_carry_the_finalize(str(Path(root) / "logits")),
            rank_persist_fails_on_rank1(str(Path(root) / "persist"))]


def test_memory_saves_are_finalized_in_the_trainer_without_a_worker(run_ranks, tmp_path):
    shm = Path("/dev/shm") / f"cpuckpt-test-in-trainer-{os.getpid()}"  # the usual case: another filesystem
    try:
        res = run_ranks(2, rank_in_trainer_cases, str(tmp_path), str(shm), timeout_s=240, env=ENV)
        assert not shm.exists()  # end of training removed the RAM root
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert res[0] == res[1], res  # every rank finalized the same calls and raised the same error
    out, failed, logits, persist = res[0]
    # a persistent save: no worker either; rank 1's failed persist raised alike on every rank, nothing named it
    assert persist["no_worker"] and persist["order"] == [] and persist["save_tracker"] is None, persist
    assert persist["error"] is not None and "rank 1" in persist["error"][1], persist
    # no worker ever, not for the persistent save of iteration 3 either (finalized once its persist is reported)
    assert not any(out["workers"]), out["workers"]
    assert out["save_tracker"] == 3 and out["np_tracker"] == 7 and out["ram"], out
    # in queue order (the persistent save, call 2, maybe by the save whose slot it held, 6, inside its save call)
    assert out["errors"] == [] and out["finalized"] in ([0, 1, 2, 3, 4, 5, 6], [0, 1, 3, 4, 5, 6]), out
    assert out["order"] == [1, 2, (3, True), 4, 5, 6, 7], out  # Megatron's finalize functions, in queue order
    assert out["finalized_dirs"] == ["iter_0000005", "iter_0000006", "iter_0000007"], out
    # memory saves only: no worker ever; the failure is raised once, alike on every rank, at a finalize after the
    # commit failed; its Megatron finalize never ran
    assert not any(failed["workers"]) and failed["np_tracker"] == 7, failed
    assert len(failed["errors"]) == 1 and failed["errors"][0][0] in (6, 7, 8), failed["errors"]
    assert "commit failed (coordinator): fault point" in failed["errors"][0][2], failed["errors"]
    assert failed["finalized_dirs"] == ["iter_0000006", "iter_0000007"], failed
    # Megatron-LM's logits saver left the memory calls with no async_fn and nothing to finalize, their finalize
    # functions on its own requests (a worker's): every one ran, in order (megatron-core's finalize never saw a
    # call without a worker: it would have credited it with the next worker call's completion, and timed out); the
    # persistent save's tracker only once its persist is durable
    assert logits == {"order": [1, 2, (3, True), 4, 5], "np_tracker": 5, "save_tracker": 3, "pending": 0}, logits


def rank_trackers_at_each_log(root: str, max_uncommitted: int, slots: int, log_looks: bool = False,
                              worked: bool = False, log_interval: int | None = None) -> dict:
    """Megatron-LM's loop with a memory save every iteration: the non-blocking finalize at the top of each iteration,
    the log, then the save. What D's tracker names at each log is what a whole-job kill right after that log leaves
    for the restart (Megatron-LM loads the newer of the two trackers). With ``log_looks`` the log is a
    ``training_log`` wrapped by the hook (:func:`.hook.finalize_before_log`, in a module that stands for
    ``megatron.training.training``, whose ``train`` calls it by name), as Megatron-LM's is; then also what the tracker
    named right after the top's finalize. ``log_interval``: Megatron-LM's ``--log-interval`` as the look reads it
    (None: no arguments parsed).

    The commit of the save of N (at most one save is in flight here: it commits before the save of N + 1 starts) is
    held at its ``.metadata`` rename (:class:`_HeldCommits`): with no look, until 0.3 s after the top of N + 1 began
    (which waits for it); with looks, through the top of N + 1, then until 0.3 s after a look that must wait for it
    began (``max_uncommitted: 1``, a printed line), else through the log (it has not committed at the look), or, with
    ``worked``, until the iteration's work, which outlasts it: released, and ended on this rank, before the log."""
    import types

    import torch.distributed as dist
    from cpuckpt.integrations.megatron.hook import finalize_before_log
    from megatron.core import dist_checkpointing

    from cpuckpt import faultpoint

    _, _, device = _setup()
    root_p = Path(root)
    queue, router, strategy = _watched(root_p, slots=slots, max_uncommitted=max_uncommitted)
    training = types.ModuleType("training")

    def training_log(iteration: int) -> int | None:  # Megatron-LM logs the iteration (then saves it)
        dist.barrier()  # rank 0's tracker write (in the look) is visible to every rank after it
        return _read_tracker(router.np_dir)

    training.training_log = training_log
    if log_looks:
        assert finalize_before_log(training, queue_of=lambda: queue, log_interval_of=lambda: log_interval)
        assert training.training_log is not training_log
    commits = _HeldCommits()
    previous = faultpoint.set_handler(commits)
    at_log, at_top = {}, {}
    try:
        for it in range(1, 7):
            last = it - 1  # the save in flight (0: none yet)
            if not log_looks:
                commits.release(last, after_s=0.3)  # the top waits for it
            queue.maybe_finalize_async_calls(blocking=False)  # the top of the iteration
            dist.barrier()  # the iteration's collectives: rank 0's tracker write is visible to every rank after it
            at_top[it] = _read_tracker(router.np_dir)
            waits = max_uncommitted == 1 or ((log_interval or 0) > 1 and it % log_interval == 0)
            if log_looks and waits:
                commits.release(last, after_s=0.3)  # ends while the look waits for it
            elif log_looks and worked and last:  # forward, backward, step: the commit of the save of N ends meanwhile
                commits.release(last)
                _wait_ended(list(queue.async_calls), f"the save of {last}")
            at_log[it] = named = training.training_log(it)
            commits.release(last)  # the save of it waits for its commit (one in flight)
            if it == 6 and named is not None:  # what a kill right here restarts from loads, with its own values
                _check(dist_checkpointing.load(_template(device), str(router.np_dir / f"iter_{named:07d}")), named,
                       device)
            _megatron_save(strategy, queue, router, router.np_dir, it, device)
    finally:
        commits.release_all()
    queue.maybe_finalize_async_calls(blocking=True)
    faultpoint.set_handler(previous)
    queue.close()
    router.close()
    return {"log": at_log, "top": at_top}


def rank_trackers_five_ways(root: str) -> list[dict]:
    """``max_uncommitted: 1`` (3 slots) with no log look, then with the hook's look before Megatron-LM's log, then the
    default (2 slots) with that look, with no work in the iteration, with work that outlasts the commit, and with
    Megatron-LM printing every second line (``--log-interval 2``), in one launch of the ranks."""
    return [rank_trackers_at_each_log(str(Path(root) / name), k, slots, log_looks, worked, interval)
            for name, k, slots, log_looks, worked, interval in (
                ("top", 1, 3, False, False, None), ("log", 1, 3, True, False, None),
                ("default", 0, 2, True, False, 1), ("worked", 0, 2, True, True, None),
                ("printed", 0, 2, True, False, 2))]


def test_a_kill_after_the_log_of_n_restarts_from_n_minus_1_with_max_uncommitted_1_or_a_printed_line(
        run_ranks, tmp_path):
    res = run_ranks(2, rank_trackers_five_ways, str(tmp_path), timeout_s=240, env=ENV)
    assert res[0] == res[1], res
    top, log, default, worked, printed = res[0]
    one_behind = {it: it - 1 if it > 1 else None for it in range(1, 7)}
    # megatron-core driven by its own loop (no log look): the top of N + 1 waits for the commit of N
    assert top["log"] == one_behind and top["top"] == one_behind, top
    # Megatron-LM's: the look before the log waits for it instead, after the iteration's work; the top did not wait
    # (the held commit of N had not ended there, so the tracker still named N - 1 or older)
    assert log["log"] == one_behind, log
    assert all(n is None or n <= it - 2 for it, n in log["top"].items()), log
    # the control, the default (2 slots: one save in flight, as with 1, but not asked for): the looks finalize what
    # has committed by then, and a held commit has not: the tracker lags two or more
    assert all(n is None or n <= it - 2 for it, n in default["log"].items()), default
    assert default["log"][6] is not None, default  # memory checkpoints were finalized all the same, later
    # the default where the iteration's work outlasts the commit (ended on every rank before the log): the look before
    # the log finalizes the save of N, committed by then, without being asked to wait: one iteration lost here too
    assert worked["log"] == one_behind, worked
    # the default where Megatron-LM prints every second line: before a printed line the look waits for the commit of
    # N (a kill after it loses one iteration); before the others it does not (the held commit has not ended)
    assert {it: n for it, n in printed["log"].items() if it % 2 == 0} == {2: 1, 4: 3, 6: 5}, printed
    assert all(n is None or n <= it - 2 for it, n in printed["log"].items() if it % 2), printed


def rank_logits_requests_carry_the_finalize(root: str) -> dict:
    """Saves every iteration whose finalize functions Megatron-LM's logits saver moved onto its own request (a
    worker's call, scheduled right after): the memory-tier call is left with no ``async_fn`` and nothing to
    finalize. Iteration 3 is a persistent save, its writers slowed (1.5 s before their first chunk): the tracker
    names it only once it is durable (its finalize waits for the persist, the probe never asked)."""
    import torch.distributed as dist

    from cpuckpt.testing import faults

    _, _, device = _setup()
    root_p = Path(root)
    # the bound covers the writers' start (imports: tens of seconds on a loaded 2-core box) and the slowed persist
    queue, router, strategy = _watched(root_p, 90.0, slots=3)
    clean = dict(os.environ)
    os.environ.update(faults.child_env(root_p / "site", ";".join(
        f"persist-chunk:__{r}_0.distcp:0=sleep:1.5" for r in (0, 1))))
    router.tier.start_writer()  # armed: the writers; not megatron-core's worker (its CPU stubs' sitecustomize)
    os.environ.clear()
    os.environ.update(clean)
    order: list = []
    for it in range(1, 6):
        queue.maybe_finalize_async_calls(blocking=False)
        d = router.save_dir if it == 3 else router.np_dir
        _megatron_save(strategy, queue, router, d, it, device, order, logits=True)
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    out = {"order": order, "np_tracker": _read_tracker(router.np_dir), "save_tracker": _read_tracker(router.save_dir),
           "pending": len(queue.async_calls)}
    queue.close()
    router.close()
    return out


def rank_unfinalized_without_a_queue(root: str) -> str:
    """The strategy used without Megatron-LM's queue (``queue_of`` unset) by a caller that never finalizes: the
    save that would refill the slot of an unfinalized one is refused, before it touches the slot. (megatron-core's
    temporal caller, a worker forked per save: the refusal is the strategy's, whichever caller; no spawned worker.)"""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from cpuckpt.config import Config
    from cpuckpt.errors import ConfigError

    _, _, device = _setup()
    root_p = Path(root)
    router = MegatronMemory(root_p / "save", root_p / "save" / "non_persistent", Config.from_dict(_config(root_p)))
    strategy = CpuckptSaveStrategy(_config(root_p), memory=router)  # 2 slots
    queue = AsyncCallsQueue(persistent=False)
    for it in (1, 2):
        _megatron_save(strategy, queue, router, router.np_dir, it, device)  # scheduled, never finalized here
    outcome = "saved"
    try:
        _megatron_save(strategy, queue, router, router.np_dir, 3, device)
    except ConfigError as e:
        outcome = str(e)
    dist.barrier()
    link = os.path.realpath(router.np_dir / "iter_0000001")
    queue.maybe_finalize_async_calls(blocking=True)
    _check(dist_checkpointing.load(_template(device), str(router.np_dir / "iter_0000001")), 1, device)
    queue.close()
    router.close()
    return outcome if "/slot-" in link else f"iter_1 lost its slot: {link}"


def test_a_caller_that_never_finalizes_is_refused_before_a_slot_is_refilled(run_ranks, tmp_path):
    res = run_ranks(2, rank_unfinalized_without_a_queue, str(tmp_path), timeout_s=120, env=ENV)
    assert res[0] == res[1] and "2 earlier saves into the ring are not finalized" in res[0], res


def _async_kwargs() -> dict:
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs

    return mcore_async_kwargs()


def test_saves_every_iteration_overlap_one_per_slot(run_ranks, tmp_path):
    res = run_ranks(2, rank_pending_saves_overlap, str(tmp_path), timeout_s=180, env=ENV)
    for rank, out in enumerate(res):
        # each save went beside the two before it, still pending (nothing else finalizes them here); the one
        # three back, whose slot it reuses, was finalized first, also before the persistent save of 4
        want = [[f"iter_{k:07d}" for k in range(max(1, it - 2), it)] for it in range(1, 7)]
        assert out["seen"] == want, (rank, out["seen"])
        assert all(ok for _, ok in out["trackers"]), (rank, out["trackers"])
        assert out["np_tracker"] == 6 and out["save_tracker"] == 4, (rank, out)
        # the slot of 4 (a durable save) holds no link; 5 and 6 are memory checkpoints; 3's slot went to 6
        assert out["links"] == ["iter_0000005", "iter_0000006"], (rank, out)


@pytest.mark.parametrize("async_save,np_type", [(True, "global"), (False, "global"), (True, "local")],
                         ids=["async", "sync", "local-non-persistent"])
def test_slots_are_reserved_when_megatron_lm_setup_returns(tmp_path, async_save, np_type):
    """The hook's wrapper of ``setup_model_and_optimizer`` (``megatron.training.training``, not on PyPI: a module
    with that function here) makes the tier and reserves every slot's image before the first iteration, sized
    from the optimizer (a megatron-core optimizer class around a torch Adam, no step yet); sync runs do not."""
    import types

    import torch
    from cpuckpt.integrations.megatron import hook, prepare
    from cpuckpt.integrations.megatron.memory import MegatronMemory
    from test_megatron_prepare import TinyOptimizer

    from cpuckpt.config import Config

    model = torch.nn.Linear(256, 128)
    optimizer = TinyOptimizer(model, torch.optim.Adam(model.parameters()))
    module = types.SimpleNamespace(setup_model_and_optimizer=lambda *a, **k: ([model], optimizer, None))
    args = types.SimpleNamespace(async_save=async_save, save=str(tmp_path / "save"), save_interval=None,
                                 non_persistent_save_interval=1, non_persistent_ckpt_type=np_type)
    cfg = {**_config(tmp_path), "memory": {**_config(tmp_path)["memory"], "slots": 3}}
    router = MegatronMemory(tmp_path / "save", tmp_path / "save" / "non_persistent", Config.from_dict(cfg))
    run = types.SimpleNamespace(memory=lambda: router)
    hook._reserve_slots_after_setup(run, module, args_of=lambda: args)
    try:
        assert module.setup_model_and_optimizer("gpt", None)[1] is optimizer
        if not async_save or np_type == "local":  # no save of this run reaches the tier
            assert router._tier is None  # no tier, no RAM held
            return
        want = prepare.shard_nbytes_estimate(optimizer)
        assert want > 3 * 256 * 128 * 4  # the parameters and both moments
        tier = router.tier
        for images in tier.images:
            assert [images.get(n).nbytes for n in images.names] == [want], images.directory
        assert tier.writer_pid() is None  # no --save-interval: nothing will persist, no writer process
        args.save_interval = 64
        module.setup_model_and_optimizer("gpt", None)  # a later setup (the tier exists): the writer starts now
        writer = tier.writer_pid()
        assert writer is not None
    finally:
        router.close()
    if async_save and np_type == "global":  # close() ended the writer it started
        import psutil

        deadline = time.monotonic() + 15
        while True:
            try:
                if psutil.Process(writer).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"writer {writer} outlived close()"
            time.sleep(0.05)


def test_reusing_a_slot_moves_the_tracker_off_the_checkpoint_it_held(tmp_path):
    """slots=1: the next memory save overwrites the only slot, so the tracker must not name the old one."""
    from cpuckpt.integrations.megatron.memory import MegatronMemory, Route

    from cpuckpt.config import Config

    router = MegatronMemory(tmp_path / "save", tmp_path / "np", Config.from_dict(_config(tmp_path)))
    slot = tmp_path / "slot-0"
    slot.mkdir()
    (slot / ".metadata").write_bytes(b"x")
    (slot / "common.pt").write_bytes(b"old")
    router.np_dir.mkdir()
    os.symlink(slot, router.np_dir / "iter_0000008")
    (router.np_dir / TRACKER).write_text("8")
    given = router.np_dir / "iter_0000016"
    given.mkdir()
    (given / "common.pt").write_bytes(b"new")  # megatron-core wrote it before the strategy ran
    router._link(Route("memory", 16, given), slot)
    assert not (router.np_dir / "iter_0000008").exists()
    assert not (router.np_dir / TRACKER).exists(), "the tracker still names a checkpoint being overwritten"
    assert not (slot / ".metadata").exists()
    assert (router.np_dir / "iter_0000016").is_symlink() and (slot / "common.pt").read_bytes() == b"new"


def test_the_first_save_after_a_restart_keeps_the_checkpoint_megatron_loads(tmp_path):
    """Iteration 11 committed in memory but killed before Megatron finalized it: the restart loads the tracked 10,
    and the next save goes to 11's slot, never 10's (before: the ring went on after its newest commit, 11, refilled
    10's slot and left no loadable memory checkpoint until that save was finalized)."""
    import torch
    from cpuckpt.integrations.megatron.memory import MegatronMemory

    from cpuckpt.config import Config

    cfg = Config.from_dict({**_config(tmp_path), "memory": {**_config(tmp_path)["memory"], "prepare_slots": False}})
    np_dir = tmp_path / "save" / "non_persistent"

    def save(router: MegatronMemory, it: int, *, finalize: bool) -> tuple[Path, int | None]:
        route = router.route(np_dir / f"iter_{it:07d}")
        route.path.mkdir(parents=True, exist_ok=True)
        (route.path / "common.pt").write_bytes(b"common %d" % it)  # megatron-core's, before the strategy runs
        handle, _ = router.save({"w": torch.full((4096,), float(it))}, route)
        tracked_meanwhile = _read_tracker(np_dir)
        handle.wait()
        if finalize:  # Megatron-LM's finalize: metadata.json, then D's tracker
            (route.path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
            (np_dir / TRACKER).write_text(str(it))
        return Path(os.path.realpath(route.path)), tracked_meanwhile

    router = MegatronMemory(tmp_path / "save", np_dir, cfg)
    slot10, _ = save(router, 10, finalize=True)
    slot11, _ = save(router, 11, finalize=False)  # killed before its finalize
    router.tier.abandon()
    router = MegatronMemory(tmp_path / "save", np_dir, cfg)
    try:
        assert router.prepare_restart() is None and _read_tracker(np_dir) == 10
        again, tracked_meanwhile = save(router, 11, finalize=False)
        assert again == slot11 != slot10, "the first save after the restart refilled the slot Megatron-LM loaded"
        assert tracked_meanwhile == 10 and (np_dir / "iter_0000010").is_symlink(), "10 stays loadable meanwhile"
    finally:
        router.close()


def test_skip_when_full_is_refused_for_megatron(tmp_path):
    """``when_full: skip`` (which the adapter refused: Megatron-LM would still name the skipped iteration
    in its tracker) was removed: a Megatron config that still sets it fails, saying so."""
    from cpuckpt.integrations.megatron.settings import split_config

    from cpuckpt.errors import ConfigError

    cfg = _config(tmp_path)
    cfg["memory"]["when_full"] = "skip"
    with pytest.raises(ConfigError, match=r"memory\.when_full: skip was removed"):
        split_config(cfg)


def test_configs_megatron_memory_yaml_loads():
    from cpuckpt.integrations.megatron.settings import split_config

    core, options = split_config(Path(__file__).resolve().parents[2] / "configs" / "megatron-memory.yaml")
    assert options.memory_tier and core.memory.slots == 3 and core.memory.when_full == "wait"


def test_links_are_found_through_a_symlinked_ram_root(tmp_path):
    """/dev/shm may be a symlink (/run/shm): a slot's old links must still be recognised and removed."""
    from cpuckpt.integrations.megatron.memory import MegatronMemory, Route

    from cpuckpt.config import Config

    router = MegatronMemory(tmp_path / "save", tmp_path / "np", Config.from_dict(_config(tmp_path)))
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "shm")
    slot = tmp_path / "shm" / "slot-0"  # the path the tier uses: through the symlink
    slot.mkdir()
    (slot / ".metadata").write_bytes(b"x")
    router.np_dir.mkdir()
    os.symlink(slot, router.np_dir / "iter_0000008")
    (router.np_dir / TRACKER).write_text("8")
    given = router.np_dir / "iter_0000016"
    given.mkdir()
    router._link(Route("memory", 16, given), slot)
    assert not (router.np_dir / "iter_0000008").is_symlink(), "the old link to the refilled slot is still there"
    assert not (router.np_dir / TRACKER).exists()


def rank_two_nodes(root: str) -> str:
    """Each rank its own RAM root (two nodes) but one shared non-persistent directory: refused on every rank at the
    first memory save (across nodes each node names its own slots in its own, node-local, directory)."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory, Route

    from cpuckpt.config import Config
    from cpuckpt.errors import ConfigError

    rank = dist.get_rank()
    cfg = _config(Path(root))
    cfg["memory"]["root"] = str(Path(root) / f"ram{rank}")
    cfg["memory"]["copy_process"] = True  # a process of the tier's, which a failed start must end
    router = MegatronMemory(Path(root) / "save", Path(root) / "save" / "non_persistent", Config.from_dict(cfg))
    route = Route("memory", 4, router.np_dir / "iter_0000004")
    try:
        router.save({"x": __import__("torch").zeros(4)}, route)
    except ConfigError as e:
        return str(e) + _retried_on_node_local_dirs(root, cfg)
    return "saved"


def _retried_on_node_local_dirs(root: str, cfg: dict) -> str:
    """After a refused start: the tier made for it was closed (its lock given back, no process of it left) and its
    RAM root kept (at a restart it may hold the run before's newest checkpoints), so a corrected start saves."""
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory, Route

    from cpuckpt.config import Config

    rank = dist.get_rank()
    ram = Path(root) / f"ram{rank}"
    kept = ram.is_dir()
    children = _child_pids()
    router = MegatronMemory(Path(root) / "save", Path(root) / f"np{rank}", Config.from_dict(cfg))
    x = torch.arange(4.0)
    handle, _ = router.save({"x": x}, Route("memory", 8, router.np_dir / "iter_0000008"))
    handle.wait()
    router.tier.close(persist_newest=False)
    return f"; root kept: {kept}; children left: {children}; saved after"


def rank_lost_node(root: str, phase: str, lost: int) -> tuple[int | None, int | None]:
    """Two nodes (a RAM root and ``D`` each), ``memory.replicas: 1``. ``train``: iterations 5 and 6 saved to memory,
    finalized and replicated, then the job dies. ``restart`` (node ``lost``'s RAM root and ``D`` gone, ``--save``'s
    tracker naming an older 4): ``prepare_restart``'s iteration and this node's ``D`` tracker."""
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory

    from cpuckpt.config import Config

    rank = dist.get_rank()
    base = Path(root)
    cfg = _config(base)
    cfg["memory"] = {**cfg["memory"], "root": str(base / f"ram{rank}"), "replicas": 1, "replica_host": "127.0.0.1",
                     "prepare_slots": False, "persist_every": 0}
    np_dir = base / f"np{rank}"
    router = MegatronMemory(base / "save", np_dir, Config.from_dict(cfg))
    if phase == "restart":
        found = router.prepare_restart()
        tracked = _read_tracker(np_dir)
        router.close()
        return found, tracked
    router.prepare_restart()
    for it in (5, 6):
        route = router.route(np_dir / f"iter_{it:07d}")
        if rank == 0:  # megatron-core's common state, rank 0's, in D's iter_<N> (the slot)
            route.path.mkdir(parents=True, exist_ok=True)
            (route.path / "common.pt").write_bytes(b"common %d" % it)
        dist.barrier()
        handle, _ = router.save({f"r{rank}": torch.full((64, 33), float(it))}, route)
        handle.wait()
        router.finalized(route)
    router.tier.wait_persisted()
    assert router.tier.replicated(6)
    dist.barrier()
    router.tier.abandon()  # the job dies: the RAM roots stay
    return None, _read_tracker(np_dir)


@pytest.mark.parametrize("lost", [0, 1])
def test_a_lost_node_restarts_from_a_replica_newer_than_the_durable_tracker(run_ranks, tmp_path, lost):
    """Either node lost (rank 0's too): its slot of iteration 6 comes back from the other node's replica and both
    nodes' ``D`` name 6, never ``--save``'s older 4 (before: rank 0 read the step from its own slot, empty on a
    replaced node, and dropped 6 whenever rank 0's node was the one lost)."""
    assert run_ranks(2, rank_lost_node, str(tmp_path), "train", lost, timeout_s=120, env=ENV) == [(None, 6)] * 2
    shutil.rmtree(tmp_path / f"ram{lost}")
    shutil.rmtree(tmp_path / f"np{lost}")
    (tmp_path / "save").mkdir(exist_ok=True)
    (tmp_path / "save" / TRACKER).write_text("4")  # an older persistent save
    assert run_ranks(2, rank_lost_node, str(tmp_path), "restart", lost, timeout_s=120, env=ENV) == [(6, 6)] * 2


def _child_pids() -> list[int]:
    """This process's children still running (zombies not counted: they have exited)."""
    import os

    me = os.getpid()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if int(ppid) == me and state != "Z":
                out.append(int(d.name))
    return out


def rank_two_nodes_failing_test(root: str) -> str:
    """The node-name test of D itself fails on every node (D cannot be made: a file in its place): the tier made for
    it is closed on every rank, its RAM root kept, and the failure raised alike."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron.memory import MegatronMemory, Route

    from cpuckpt.config import Config

    rank = dist.get_rank()
    cfg = _config(Path(root))
    cfg["memory"]["root"] = str(Path(root) / f"ram{rank}")
    cfg["memory"]["copy_process"] = True  # a process of the tier's, which a failed start must end
    blocked = Path(root) / f"blocked{rank}"
    if not blocked.exists():
        blocked.write_text("not a directory")
    router = MegatronMemory(Path(root) / "save", blocked / "np", Config.from_dict(cfg))
    try:
        router.save({"x": __import__("torch").zeros(4)}, Route("memory", 4, router.np_dir / "iter_0000004"))
    except Exception as e:
        said = "naming the node names" if "node names" in str(e) else f"without naming them: {e}"
        return f"{type(e).__name__} {said}" + _retried_on_node_local_dirs(root, cfg)
    return "saved"


def test_a_non_persistent_dir_shared_by_nodes_is_refused_on_every_rank(run_ranks, tmp_path):
    res = run_ranks(2, rank_two_nodes, str(tmp_path), timeout_s=120)
    assert all("across 2 nodes" in r and "shared by several nodes" in r and "node-local" in r for r in res), res
    assert all(r.endswith("; root kept: True; children left: []; saved after") for r in res), res


def test_a_failing_node_name_test_closes_the_tier_on_every_rank(run_ranks, tmp_path):
    res = run_ranks(2, rank_two_nodes_failing_test, str(tmp_path), timeout_s=120)
    assert all(r.startswith("StorageIOError naming the node names; ") for r in res), res
    assert all(r.endswith("; root kept: True; children left: []; saved after") for r in res), res


def test_a_non_persistent_directory_on_a_network_filesystem_is_recognised(tmp_path):
    """Across nodes D must be node-local: one on NFS & co. is refused (their clients cache directory listings, so the
    names other nodes leave there can be missed), found from the mount table (the longest mount point above D)."""
    from cpuckpt.integrations.megatron.memory import network_filesystem

    mounts = ("/dev/vda / ext4 rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw 0 0\n"
              "server:/export /mnt/shared nfs4 rw 0 0\n"
              "server:/other /mnt/shared/local\\040dir ext4 rw 0 0\n")
    assert network_filesystem(Path("/mnt/shared/job/np"), mounts) == "nfs4"
    assert network_filesystem(Path("/mnt/shared"), mounts) == "nfs4"
    assert network_filesystem(Path("/mnt/shared/local dir/np"), mounts) is None  # a local mount inside it
    assert network_filesystem(Path("/mnt/sharedx/np"), mounts) is None  # a name sharing the prefix only
    assert network_filesystem(Path("/dev/shm/job/np"), mounts) is None
    assert network_filesystem(tmp_path) is None  # this machine's own table: the test directory is local
