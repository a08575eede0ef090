"""Probes that change one thing in a memory-tier save's iteration, for bench_goodput's ``+<probe>`` variants (an
instrument: it changes what it measures, on purpose; a probed run's checkpoints are not valid).

With a save every iteration the trainer's step ran ~35 ms longer while the copy process copied (BENCHMARKS.md,
sessions 30-31), and neither Megatron-LM's synchronizations nor the copy process's events explained it. Put on
PYTHONPATH with ``GOODPUT_PROBE`` set (a comma-separated list), it patches cpuckpt once the module is imported:

- ``syncstart``: ``deferred.start_all`` (the saves' starts at the top of an iteration) synchronizes the device after a
  call that started a save, so the forward is enqueued only after the device snapshot ran;
- ``syncstep``: ``strategy.order_pending_saves`` (the first thing of every optimizer step) synchronizes the device
  before the step's kernels are enqueued;
- ``nodma``: the copy process is handed no device-to-host copies (``ImageSink.submit_offload`` with empty ops): it
  still waits for the snapshot, records its events and checksums the images, but no byte crosses PCIe;
- ``nod2d``: the device snapshot's device-to-device copy is not made (``device_snapshot``'s ``_foreach_copy_``);
- ``swi``: the interpreter's switch interval 0.5 ms instead of 5 (``sys.setswitchinterval``, every process): a
  thread that released the GIL (a collective, a device synchronization, a file write) gets it back from another
  thread running Python after at most 0.5 ms instead of 5. The trainer's own threads of ours (the committer) run
  Python beside its main thread; this says what that costs it.
- ``aff``: the machine's physical cores split in two halves (hyperthread siblings kept together, from
  ``/sys/devices/system/cpu``): cpuckpt's own processes (the copy process, the writer) run on the upper half only,
  every other process of the run (the trainer's) on the lower half. Says whether the trainer's host work is slowed
  by the copy process's checksum threads sharing its cores (or their siblings) rather than by memory traffic.
- ``idle``: cpuckpt's own processes run under ``SCHED_IDLE`` (their threads inherit it): they get a CPU only when
  no other thread wants it, so the trainer's threads never wait in a run queue behind the checksum threads.
- ``pace<G>``: the copy process enqueues a save's device-to-host copies chunk by chunk at ``G`` GB/s at most
  (copies spread over the iteration instead of a burst at the link's 55 GB/s); ``dmadelay<MS>``: it starts them
  ``MS`` ms after the save's message (past the trainer's forward). Both hold the process's next message, and the
  start of the save's checksums, meanwhile.
  Whether the trainer's host work slows with the rate of the copies' traffic, or with when it comes, not only
  with its bytes.
- ``alt``: ``nodma`` and ``nod2d`` act on every other save only (the odd starts of ``deferred.start_all``), and each
  start prints ``probe: alt: start N probed|plain`` before it runs: the gaps after probed and plain saves of one
  run compare a probe's effect free of the drift between runs (alone, a control: both halves alike).

Another ``sitecustomize`` further down ``sys.path`` (an image's own) still runs after this one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.util
import os
import re
import sys
from array import array
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_after_a_start(module: Any) -> str:
    fn = module.start_all

    @functools.wraps(fn)
    def start_all(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if out:
            _synchronize()
        return out

    module.start_all = start_all
    return "start_all synchronizes the device after a start"


def _sync_before_a_step(module: Any) -> str:
    fn = module.order_pending_saves

    @functools.wraps(fn)
    def order_pending_saves(*args: Any, **kwargs: Any) -> Any:
        _synchronize()
        return fn(*args, **kwargs)

    module.order_pending_saves = order_pending_saves
    return "order_pending_saves synchronizes the device first"


_ALT = {"on": False, "probing": True, "starts": 0}  # alt: whether the save being started is a probed one


def _probing() -> bool:
    return not _ALT["on"] or bool(_ALT["probing"])


def _alternate(module: Any) -> str:
    fn = module.start_all

    @functools.wraps(fn)
    def start_all(*args: Any, **kwargs: Any) -> Any:
        if module._STARTS:  # this call starts a save: every other one is probed, the first one first
            _ALT["starts"] += 1
            _ALT["probing"] = _ALT["starts"] % 2 == 1
            print(f"probe: alt: start {_ALT['starts']} {'probed' if _ALT['probing'] else 'plain'}", file=sys.stderr,
                  flush=True)
        return fn(*args, **kwargs)

    module.start_all = start_all
    return "nodma and nod2d act on every other start of start_all"


def _no_dma(module: Any) -> str:
    fn = module.ImageSink.submit_offload

    @functools.wraps(fn)
    def submit_offload(self: Any, copies: Any, kind: str) -> Any:
        if copies is not None and _probing():
            copies = dataclasses.replace(copies, ops=array("q"))
        return fn(self, copies, kind)

    module.ImageSink.submit_offload = submit_offload
    return "ImageSink.submit_offload hands the copy process no copies"


class _NoCopyTorch:
    """``torch`` for one module, whose ``_foreach_copy_`` copies nothing."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def _foreach_copy_(*args: Any, **kwargs: Any) -> None:
        if not _probing():
            import torch

            torch._foreach_copy_(*args, **kwargs)
        return None


def _no_d2d(module: Any) -> str:
    module.torch = _NoCopyTorch()
    return "the device snapshot copies nothing"


def pace_foreach_copy(torch: Any, rate_gbps: float, delay_ms: float) -> str:
    """``pace<G>`` / ``dmadelay<MS>`` in the copy process: each save's copies start ``delay_ms`` late, and its
    ``torch._foreach_copy_`` (called by nothing else there: a save's copies, one call per chunk, back to back)
    enqueues at ``rate_gbps`` at most (0: unpaced). A save begins where ``_Worker.enqueue`` opens the trainer's
    event, once per save before its first copy (``torch.cuda.Event.from_ipc_handle``): the delay and a fresh pace
    clock go there. Patched on torch itself: the process runs ``cpuckpt.tier.copier`` as ``__main__``, which no
    import of that name patches. Both hold the process's message loop, and with it the start of the save's
    checksums (handed to their threads once every copy is enqueued)."""
    import time

    real_copy = torch._foreach_copy_
    real_open = torch.cuda.Event.from_ipc_handle  # bound to the class
    state = {"due": 0.0}

    def from_ipc_handle(cls: Any, device: Any, handle: Any) -> Any:
        if delay_ms:
            time.sleep(delay_ms / 1e3)
        state["due"] = time.monotonic()
        return real_open(device, handle)

    def paced(dsts: Any, srcs: Any, **kw: Any) -> Any:
        if rate_gbps:
            now = time.monotonic()
            if state["due"] > now:
                time.sleep(state["due"] - now)
            state["due"] = max(state["due"], now) + sum(d.numel() * d.element_size() for d in dsts) / (
                rate_gbps * 1e9)
        return real_copy(dsts, srcs, **kw)

    torch.cuda.Event.from_ipc_handle = classmethod(from_ipc_handle)
    torch._foreach_copy_ = paced
    return f"each save's copies start {delay_ms:g} ms late, at {rate_gbps:g} GB/s at most (0: unpaced)"


_PACING = re.compile(r"(pace|dmadelay)([1-9][0-9]*)")


def _pacing(name: str) -> tuple[float, float] | None:
    """``pace<G>`` -> (G, 0), ``dmadelay<MS>`` -> (0, MS); None for another name."""
    m = _PACING.fullmatch(name)
    if m is None:
        return None
    value = float(m.group(2))
    return (value, 0.0) if m.group(1) == "pace" else (0.0, value)


_PROBES: dict[str, tuple[str, Callable[[Any], str]]] = {
    "syncstart": ("cpuckpt.integrations.megatron.deferred", _sync_after_a_start),
    "syncstep": ("cpuckpt.integrations.megatron.strategy", _sync_before_a_step),
    "nodma": ("cpuckpt.tier.images", _no_dma),
    "nod2d": ("cpuckpt.transfer.device_snapshot", _no_d2d),
    "alt": ("cpuckpt.integrations.megatron.deferred", _alternate),
}


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Applies ``patches`` to ``module``, in order, once it is executed (a finder first on ``sys.meta_path``)."""

    def __init__(self, module: str, patches: list[Callable[[Any], str]]) -> None:
        self.module = module
        self.patches = patches
        self._inner: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        sys.meta_path.remove(self)
        for patch in self.patches:
            what = patch(module)
            print(f"probe: {self.module}: {what} (pid {os.getpid()})", file=sys.stderr, flush=True)


SWITCH_INTERVAL_S = 0.0005  # swi
_OURS = ("cpuckpt.tier.copier", "cpuckpt.tier.persister")  # aff, idle: our processes


def _core_halves() -> tuple[set[int], set[int]]:
    """The machine's online CPUs as (lower, upper) halves of their physical cores, siblings together (the online
    set, not this process's: a child of a process already on one half would halve that half again)."""
    cores: dict[tuple[str, str], set[int]] = {}
    online: set[int] = set()
    try:
        with open("/sys/devices/system/cpu/online") as f:
            for part in f.read().strip().split(","):
                lo, _, hi = part.partition("-")
                online.update(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError):
        online = set(range(os.cpu_count() or 1))
    for cpu in sorted(online):
        top = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(top + "physical_package_id") as f, open(top + "core_id") as g:
                key = (f.read().strip(), g.read().strip())
        except OSError:
            key = ("?", str(cpu))
        cores.setdefault(key, set()).add(cpu)
    ordered = [cores[k] for k in sorted(cores, key=lambda k: min(cores[k]))]
    half = max(1, len(ordered) // 2)
    return set().union(*ordered[:half]), set().union(*ordered[half:]) or set().union(*ordered)


def _split_cores() -> None:
    lower, upper = _core_halves()
    ours = any(m in sys.orig_argv for m in _OURS)
    cpus = upper if ours else lower
    os.sched_setaffinity(0, cpus)
    print(f"probe: aff: pid {os.getpid()} ({'cpuckpt' if ours else 'trainer'}) on CPUs {sorted(cpus)}",
          file=sys.stderr, flush=True)


def _install() -> None:
    patches: dict[str, list[Callable[[Any], str]]] = {}
    paced = (0.0, 0.0)  # pace<G>, dmadelay<MS>: (G, MS), one patch for both
    for name in filter(None, os.environ.get("GOODPUT_PROBE", "").split(",")):
        if name == "swi":  # no module to patch: the interpreter's own setting, before anything starts a thread
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            continue
        if name == "aff":  # no module either: the process's CPUs, before it starts a thread
            _split_cores()
            continue
        if name == "idle":
            if any(m in sys.orig_argv for m in _OURS):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                print(f"probe: idle: pid {os.getpid()} runs under SCHED_IDLE", file=sys.stderr, flush=True)
            continue
        pacing = _pacing(name)
        if pacing is not None:  # the copy process only (a process of its own; torch is imported there anyway)
            paced = (max(paced[0], pacing[0]), max(paced[1], pacing[1]))
            continue
        found = _PROBES.get(name)
        if found is None:
            print(f"probe: unknown probe {name!r} (known: {', '.join(_PROBES)}, swi, aff, idle, pace<G>, "
                  f"dmadelay<MS>)", file=sys.stderr, flush=True)
            continue
        _ALT["on"] = _ALT["on"] or name == "alt"
        module, patch = found
        patches.setdefault(module, []).append(patch)
    for module, each in patches.items():
        sys.meta_path.insert(0, _Patch(module, each))
    if any(paced) and "cpuckpt.tier.copier" in sys.orig_argv:
        import torch

        what = pace_foreach_copy(torch, *paced)
        print(f"probe: pace/dmadelay: {what} (pid {os.getpid()})", file=sys.stderr, flush=True)


def _chain_original() -> None:
    """The next ``sitecustomize.py`` on ``sys.path`` (``benchmarks/sitechain.py``)."""
    spec = importlib.util.spec_from_file_location("_cpuckpt_sitechain", os.path.join(os.path.dirname(_HERE),
                                                                                       "sitechain.py"))
    if spec is not None and spec.loader is not None:
        chain = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(chain)
        chain.run_next(_HERE)


_install()
_chain_original()
