"""Goodput: whole Megatron-LM training runs with and without checkpoints, timed by the job's own log lines.

Every variant is a whole ``pretrain_gpt.py`` run from scratch (24 x 1024 GPT, 16 heads, seq 1024, micro-batch 4:
~4.7 GB of checkpoint per save on one GPU), one after the other in this process's call, on the same machine:

``none``          no checkpoints (the reference of every ratio)
``torch_dist8``   Megatron-LM's own engine: ``--ckpt-format torch_dist --async-save --use-persistent-ckpt-worker``,
                  a save every 8 iterations
``cpuckpt8``      ``--ckpt-format cpuckpt`` (configs/megatron.yaml with ``ordering: optimizer``), to disk every 8
``mem8``          cpuckpt's memory tier: memory checkpoints every 8 iterations (``--non-persistent-save-interval``),
                  durable every 64 (``--save-interval``), ``ordering: optimizer``
``mem1``          the same with a memory checkpoint **every iteration**
``mem1snap``      ``mem1`` with ``staging.device_snapshot``: the GPU bytes are copied device-to-device first (ms), so
                  the optimizer step waits for that copy only and the copies to the host may take the whole
                  iteration (where a forward and backward are shorter than the state's device-to-host copy)
``mem8snap``      ``mem8`` with the device snapshot
``mem<K>``        (and ``mem<K>snap``) memory checkpoints every K iterations, any K: with K >= 2 the table's "save in
                  run" is a save's cost within its own run, free of the drift between runs (the gaps after a save over
                  the quiet second half of the interval; ``mem2``: where a save's effects end within the next
                  iteration, what a save every iteration costs each one)

A memory variant may name changes after ``+`` to say what a part costs (not defaults; not a result by themselves):
``+nocrc`` (``memory.checksum: false``: no checksums of the images), ``+bsum`` (``memory.checksum_kind: blocksum32``:
with a device snapshot and the copy process, the device bytes summed on the GPU; what the default ``auto`` takes
there), ``+crc`` (``memory.checksum_kind: crc32c``: every image read back for its crc32c, the default before session
43), ``+io<N>`` (``io.threads: N``: the
copy process's checksum threads, and the writer's and the trainer's I/O and staging pools), ``+copyproc``
(``memory.copy_process: true``: the checksums, and with a device snapshot the D2H copies, in a process of ours),
``+window<MiB>`` (the paced pieces' size, ``staging.d2h_window_bytes``), ``+host`` (``megatron.ordering: host``: the
save returns once its copies are done), ``+u<N>`` (``memory.max_uncommitted: N``; ``u1``: each memory save finalized
at the next iteration's top, at most one iteration lost), ``+slots<N>`` (``memory.slots: N`` instead of ``--slots``:
N-1 saves may be in flight), e.g. ``mem1+nocrc``, ``mem1snap+copyproc``, ``mem1snap+window16``, ``mem1+u1+host``;
``+rep<N>`` changes nothing (the same variant run again under another name, e.g. a sampled copy of an unsampled run:
``mem1snap+copyproc+rep2``); ``+base`` runs the variant with ``--base-site``'s cpuckpt (a baseline commit's install)
first on the path: before and after a change in one call, on one machine. ``+mgc`` (any variant, ``none`` included)
runs Megatron-LM with ``--manual-gc``: the interpreter's automatic collector off for the whole run; a variant with it
is compared with ``none+mgc`` (so ``none+mgc,mem1snap+copyproc+mgc`` against ``none,mem1snap+...`` says what the
trainer's garbage collections under saves cost). ``+timers`` (any variant) adds Megatron-LM's level-1 timers
(``--timing-log-level 1``: forward-backward, optimizer, ...), which synchronize the device at each start and stop:
where in the step a save's cost lands, not a goodput figure. ``+syncstart``, ``+syncstep``, ``+nodma`` and ``+nod2d``
(memory variants; any together) are probes (``benchmarks/probe``): the device synchronized after the iteration's save
start or before each optimizer step; the copy process handed no copies (its saves then record crc32c: compare with
``+crc``); the device snapshot not copied (a probed run's
checkpoints are not valid). ``+pace<G>`` / ``+dmadelay<MS>`` (with ``+copyproc``; probes): the copy process enqueues
a save's copies at ``G`` GB/s at most, or starts them ``MS`` ms late (past the forward): whether the trainer's slowdown
beside a save follows the copies' rate or their timing. ``+alt`` with ``+nodma`` or ``+nod2d``: the probe acts on
every other save only, and the
table's "save in run" column holds the median gap after a probed save minus the median after a plain one (the probe's
effect within one run, free of the drift between runs; ``+alt`` alone is the control, ~0).
``+gcfreeze`` (memory variants): ``megatron: {freeze_gc: true}``, the collector's objects
frozen once setup returned (full collections then skip them). ``+swi`` (any variant, ``none`` included, compared with
``none+swi``; a probe): the interpreter's switch interval 0.5 ms instead of 5 in every process of the run, what the
trainer pays when a thread of ours runs Python beside its main thread. ``+aff`` (memory variants; a probe): cpuckpt's
processes on one half of the physical cores, the trainer's on the other, whether the copy process's threads slow the
trainer by sharing its cores; ``+idle`` (likewise): cpuckpt's processes under ``SCHED_IDLE``, whether the trainer's
threads wait for a CPU behind them. ``+log<N>`` (any variant, ``none`` included, compared with the ``none`` of the
same interval): Megatron-LM's ``--log-interval N`` instead of the benchmark's 1 (jobs log every 10-100 iterations;
each line is a barrier and a device synchronization); the wall and the gaps are then read every N iterations.

Every variant that saves runs with ``--ckpt-assume-constant-structure`` (what a job saving this often sets).

The result is the wall time from iteration ``--warm`` (default 10) to the last iteration, taken from the arrival
times of Megatron-LM's own ``iteration N/...`` log lines, as a ratio to ``none``'s; Megatron-LM's timers exclude the
saves (``save_checkpoint_and_time`` stops its interval timer around them) and are only listed beside it. Also per
variant: the cost per save ((wall - none's wall) / saves in the window), the largest single-iteration gap between
consecutive log lines against their median (and which iteration), the whole run from launch to exit (start-up, slot
preparation and the final wait included) against ``none``'s, and its two ends against none's (launch to the first
iteration's line; the last one's to the exit), the median time from a save's call to its memory commit (cpuckpt's
telemetry), and Megatron-LM's ``save-checkpoint`` timers. ``--floor`` runs ``overlap_floor.py`` (copied from the
shared tools into an ignored folder) in the same call for the floor of a full snapshot every iteration. ``--sample``
names variants whose trainer's main thread is sampled (``benchmarks/stack_sampler``: every 2 ms, inside the training
loop): the functions it was in, as ms per iteration, against ``none``'s, to say where a variant's time goes (the
sampler's own cost is in the sampled runs' wall too, so their wall ratio is not the result). ``--pyspy`` names
variants whose trainer is recorded by ``py-spy record --gil`` from outside (a carried wheel on the GPU machine) for
``--pyspy-seconds`` from iteration warm + 10: which of its threads held the interpreter, and where.

    python -m benchmarks.bench_goodput --megatron-lm .megatron-lm --out $OUT
    python -m benchmarks.bench_goodput --dry-run        # the commands only
    python -m benchmarks.bench_goodput --self-test      # the log arithmetic on a made-up log (CPU)

Results: ``$OUT/bench_goodput.json``, one log per run (``mlm_<variant>.log``), the table last on stdout.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_megatron_lm import ASYNC, ITER_RE, Bench, LineHook, megatron_config, memory_tier_config, parse_log
from benchmarks.common import file_safe, format_table

logger = logging.getLogger("bench_goodput")

VARIANTS = ("none", "torch_dist8", "cpuckpt8", "mem8", "mem8snap", "mem1", "mem1snap")
_MEMORY_KIND = re.compile(r"mem([1-9][0-9]*)(snap)?")


def memory_every(kind: str) -> int | None:
    """The memory save interval of a memory kind (``mem<K>``, ``mem<K>snap``: mem8 and mem1 by default; with K >= 2 a
    save's cost is also read within its own run, :func:`goodput`); None for another kind."""
    m = _MEMORY_KIND.fullmatch(kind)
    return int(m.group(1)) if m else None


def goodput(iters: list[dict[str, Any]], warm: int, every: int = 0) -> dict[str, Any]:
    """Wall time of iterations ``warm``..last from the log lines' arrival times, and the largest gap.

    With saves every ``every`` >= 2 iterations (the save of N follows N's line), also what a save costs within its own
    run, whatever the machine's drift between runs does to the ratios: the median gap at each position after a save
    (``after_save_ms``: the gaps ending at N + 1 .. N + every), and the sum over those positions of their excess over
    the median of the positions in the second half of the interval (``save_cost_in_run_ms``): the cost of a save
    whose effects (its call, its copies, its checksums) end within half the interval (every 2: within the iteration
    after its call, which a commit within that iteration says; crc32c's read-back of a 13.6 GB DeepSpeed save
    reached 3 iterations further)."""
    pts = sorted({x["it"]: x["t"] for x in iters}.items())
    pts = [(it, t) for it, t in pts if it >= warm]
    if len(pts) < 3:
        return {"wall_s": None, "iters": len(pts)}
    gaps = [(b[0], b[1] - a[1]) for a, b in itertools.pairwise(pts)]
    med = statistics.median(g for _, g in gaps)
    worst_it, worst = max(gaps, key=lambda g: g[1])
    out = {"first": pts[0][0], "last": pts[-1][0], "iters": pts[-1][0] - pts[0][0],
           "wall_s": round(pts[-1][1] - pts[0][1], 3), "gap_median_ms": round(1000 * med, 1),
           "gap_max_ms": round(1000 * worst, 1), "gap_max_it": worst_it,
           "gap_max_over_median": round(worst / med, 2) if med else None}
    if every >= 2:
        by_position: dict[int, list[float]] = collections.defaultdict(list)
        for it, g in gaps:
            by_position[(it - 1) % every + 1].append(g)  # the gap ending at N + p, N a save's iteration
        if len(by_position) == every:
            after = [statistics.median(by_position[p]) for p in range(1, every + 1)]
            quiet = statistics.median(after[every // 2:])
            out.update({"after_save_ms": [round(1000 * a, 1) for a in after],
                        "save_cost_in_run_ms": round(1000 * sum(a - quiet for a in after), 1)})
    return out


def alt_gaps(iters: list[dict[str, Any]], alts: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """``+alt`` (benchmarks/probe): the gaps from iteration ``warm`` on whose interval holds exactly one save's start,
    split by whether that save was probed: the probe's effect within one run (``alt_effect_ms``: the median gap after
    a probed save minus the median after a plain one), free of the drift between runs. A start belongs to the gap
    after the last iteration line read before it (``after_it``, by the order of the lines: one pipe carries both)."""
    pts = sorted({x["it"]: x["t"] for x in iters}.items())
    starts: dict[int, list[bool]] = collections.defaultdict(list)
    for a in alts:
        if a.get("after_it") is not None:
            starts[a["after_it"]].append(a["probed"])
    split: dict[bool, list[float]] = {True: [], False: []}
    for (it0, t0), (it1, t1) in itertools.pairwise(pts):
        if it0 < warm or it1 != it0 + 1:
            continue
        inside = starts.get(it0, [])
        if len(inside) == 1:
            split[inside[0]].append(t1 - t0)
    if not split[True] or not split[False]:
        return {"alt_counts": [len(split[True]), len(split[False])]}
    probed, plain = statistics.median(split[True]), statistics.median(split[False])
    return {"alt_probed_ms": round(1000 * probed, 1), "alt_plain_ms": round(1000 * plain, 1),
            "alt_effect_ms": round(1000 * (probed - plain), 1), "alt_counts": [len(split[True]), len(split[False])]}


def run_ends(iters: list[dict[str, Any]], run_s: float | None, ref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Launch to exit in its two ends, by the lines' arrival (seconds since launch): from launch to the first
    iteration's line (``start_s``: set-up, slots reserved and pinned) and from the last iteration's line to the exit
    (``end_s``: final saves, persists, teardown); with ``ref`` (none's ends) each over none's."""
    ts = [x["t"] for x in iters]
    if not ts or not run_s:
        return {}
    out: dict[str, Any] = {"start_s": round(min(ts), 2), "end_s": round(run_s - max(ts), 2)}
    for end in ("start", "end"):
        if ref is not None and f"{end}_s" in ref:
            out[f"{end}_over_none_s"] = round(out[f"{end}_s"] - ref[f"{end}_s"], 1)
    return out


def commit_ms(telemetry: list[dict[str, Any]], skip: int = 5) -> float | None:
    """Median time from a save's call to its memory commit (rank 0's ``async_save`` records' ``persist_s``), past the
    first ``skip`` saves: losing at most one iteration at a printed log line rests on it being under an iteration."""
    ms = [1000 * x["persist_s"] for x in telemetry
          if x.get("event") == "async_save" and x.get("rank") == 0 and x.get("persist_s") is not None][skip:]
    return round(statistics.median(ms), 1) if ms else None


def summarize(name: str, r: dict[str, Any], ref: dict[str, Any] | None, saves_in_window: int,
              warm: int, every: int = 0) -> dict[str, Any]:
    g = goodput(r["iters"], warm, every)
    out: dict[str, Any] = {"variant": name, "rc": r["rc"], "timed_out": r["timed_out"], **g,
                           "run_s": r["wall_s"], "saves": saves_in_window,
                           "save_timer_ms": [round(x["ms"]) for x in r["saves"]][:6],
                           "np_timer_median_ms": round(statistics.median(x["ms"] for x in r["np_saves"]), 1)
                           if r["np_saves"] else None,
                           "commit_ms": commit_ms(r.get("telemetry_file") or []),
                           "errors": r["errors"][:3]}
    if r.get("alt"):
        out.update(alt_gaps(r["iters"], r["alt"], warm))
    if ref is not None and ref.get("wall_s") and g.get("wall_s") and ref.get("iters") == g.get("iters"):
        out["ratio"] = round(g["wall_s"] / ref["wall_s"], 3)
        extra_s = g["wall_s"] - ref["wall_s"]
        out["per_save_ms"] = round(1000 * extra_s / saves_in_window, 1) if saves_in_window else None
    if ref is not None and ref.get("run_s") and r["wall_s"]:
        out["run_over_none_s"] = round(r["wall_s"] - ref["run_s"], 1)
    return out


def log_interval(changes: list[str]) -> int | None:
    """``+log<N>``: Megatron-LM's ``--log-interval`` (the benchmark's own is 1: a line, and with it a device
    synchronization, every iteration; jobs log every 10-100). The wall is then read every N iterations."""
    values = [int(c[3:]) for c in changes if c.startswith("log") and c[3:].isdigit()]
    if any(v < 1 for v in values):
        raise ValueError(f"+log<N> needs N >= 1 (got {values})")
    return values[-1] if values else None


def _saves_between(first: int, last: int, every: int) -> int:
    """Saves after iterations first..last-1: each one's cost lands in the window."""
    return sum(1 for it in range(first, last) if every and it % every == 0)


# changes read outside the cpuckpt config
_PROBES = ("syncstart", "syncstep", "nodma", "nod2d", "swi", "aff", "idle", "alt")  # benchmarks/probe
_ENV_CHANGES = ("mgc", "base", "timers", *_PROBES)


_PACING = re.compile(r"(pace|dmadelay)[1-9][0-9]*")  # benchmarks/probe: the copy process's copies paced or late


def is_probe(change: str) -> bool:
    """A change made by benchmarks/probe: a named one, or ``pace<G>`` / ``dmadelay<MS>`` (:data:`_PACING`)."""
    return change in _PROBES or _PACING.fullmatch(change) is not None


def variant_argv(b: Bench, name: str, root: Path, tmp: Path, ram: Path, iters: int) -> tuple[list[str], int]:
    """The command line of a variant and its save interval (0: none)."""
    a = b.args
    kind, *changes = name.split("+")
    base = ["--train-iters", str(iters), "--eval-interval", str(10 * iters)]
    if "mgc" in changes:
        base.append("--manual-gc")  # interval 0: no collection at all while it trains
    if "timers" in changes:  # Megatron-LM's level-1 timers (forward-backward, optimizer, ...; each synchronizes)
        base += ["--timing-log-level", "1"]
    if (interval := log_interval(changes)) is not None:  # Megatron-LM's training_log synchronizes at each line
        base += ["--log-interval", str(interval)]
    if kind == "none":
        return b.argv("torch_dist", "goodput", base), 0
    # Megatron-LM's own promise for repeated saves: without it every save validates the sharding again
    # (validate_sharding_integrity, ~20-40 ms per save on this model); every variant that saves gets it.
    save = ["--save", str(root / name), "--ckpt-assume-constant-structure"]
    if kind == "torch_dist8":
        return b.argv("torch_dist", "goodput", [*base, *save, "--save-interval", "8", *ASYNC]), 8
    if kind == "cpuckpt8":
        cfg = megatron_config(a.config, tmp / "cpuckpt8.yaml", ordering="optimizer")
        return b.argv("cpuckpt", "goodput", [*base, *save, "--save-interval", "8", *ASYNC], config=str(cfg)), 8
    every = memory_every(kind)
    if every is None:
        raise ValueError(f"variant {name}: unknown kind {kind!r}")
    slots = next((int(c[len("slots"):]) for c in changes if c.startswith("slots") and c[len("slots"):].isdigit()),
                 a.slots)
    cfg = memory_tier_config(a.config, tmp / f"{name}.yaml", ram, slots)
    staging: dict[str, Any] = {"device_snapshot": True} if kind.endswith("snap") else {}
    memory: dict[str, Any] = {}
    io: dict[str, Any] = {}
    adapter: dict[str, Any] = {}  # the megatron: block's other keys
    ordering = "optimizer"
    for change in changes:
        if change == "nocrc":
            memory["checksum"] = False
        elif change == "bsum":
            memory["checksum_kind"] = "blocksum32"
        elif change == "crc":
            memory["checksum_kind"] = "crc32c"
        elif change == "copyproc":
            memory["copy_process"] = True
        elif change == "host":
            ordering = "host"
        elif change == "gcfreeze":
            adapter["freeze_gc"] = True
        elif change.startswith("window") and change[len("window"):].isdigit():
            staging["d2h_window_bytes"] = int(change[len("window"):]) << 20
        elif change.startswith("io") and change[2:].isdigit():
            io["threads"] = int(change[2:])  # the copy process's checksum threads (and every pool sized by io.threads)
        elif change.startswith("u") and change[1:].isdigit():
            memory["max_uncommitted"] = int(change[1:])
        elif (change.startswith("rep") and change[len("rep"):].isdigit()) or (
                change.startswith("log") and change[3:].isdigit()) or (
                change.startswith("slots") and change[len("slots"):].isdigit()) or change in _ENV_CHANGES or \
                is_probe(change):
            pass  # rep: a name only; slots, mgc, timers: read above; base, probes: the environment (main)
        else:
            raise ValueError(f"variant {name}: unknown change {change!r} (nocrc, bsum, crc, copyproc, host, "
                             "window<MiB>, io<N>, "
                             "u<N>, slots<N>, rep<N>, log<N>, gcfreeze, mgc, base, timers, syncstart, syncstep, "
                             "nodma, nod2d, swi, aff, idle, alt, pace<G>, dmadelay<MS>)")
    if any(_PACING.fullmatch(c) for c in changes):
        if not (kind.endswith("snap") and "copyproc" in changes):  # else the copy process copies nothing
            raise ValueError(f"variant {name}: +pace<G> and +dmadelay<MS> pace the copy process's copies of a "
                             "device snapshot (<kind>snap+copyproc)")
        if "alt" in changes:
            raise ValueError(f"variant {name}: +alt alternates +nodma and +nod2d only, not +pace<G> or +dmadelay<MS>")
    if "nod2d" in changes and not kind.endswith("snap"):
        raise ValueError(f"variant {name}: +nod2d needs a device snapshot (mem1snap, mem8snap)")
    if len({"bsum", "crc", "nocrc"} & set(changes)) > 1:
        raise ValueError(f"variant {name}: +bsum, +crc and +nocrc are three different checksum settings: one at most")
    if "nodma" in changes and "bsum" in changes:
        raise ValueError(f"variant {name}: +nodma with +bsum would record checksums of images no copy filled")
    if "nodma" in changes and "checksum_kind" not in memory:  # auto would take blocksum32 of the unfilled images
        memory["checksum_kind"] = "crc32c"
    if "nodma" in changes and not (kind.endswith("snap") and "copyproc" in changes):
        raise ValueError(f"variant {name}: +nodma needs the copy process's copies (<kind>snap+copyproc)")
    cfg = megatron_config(str(cfg), cfg, ordering=ordering, staging=staging, memory=memory, io=io, **adapter)
    extra = [*base, *save, "--save-interval", str(a.durable), "--non-persistent-save-interval", str(every),
             "--non-persistent-ckpt-type", "global", *ASYNC]
    return b.argv("cpuckpt", "goodput", extra, config=str(cfg)), every


def variant_error(b: Bench, args: argparse.Namespace, name: str, tmp: Path) -> str | None:
    """Why ``name`` cannot run as asked (None: it can): its kind, its changes, the arguments it needs."""
    kind, *changes = name.split("+")
    general = {c for c in changes if c in ("mgc", "timers", "swi") or (c.startswith("log") and c[3:].isdigit())}
    every = memory_every(kind)
    if every is None and (kind not in VARIANTS or set(changes) != general):
        return (f"unknown variant {name}; known: {VARIANTS} and mem<K>[snap] (memory ones with +nocrc, +copyproc, "
                "+window<MiB>, ...; "
                "any with +mgc, +timers, +log<N>)")
    try:
        interval = log_interval(changes)
        variant_argv(b, name, tmp / "check", tmp, tmp / "check-ram", args.iters)  # the changes' own checks
    except ValueError as e:
        return str(e) if str(e).startswith("variant ") else f"variant {name}: {e}"
    if every and not _saves_between(args.warm, args.iters, every):
        return f"variant {name}: no memory save falls in iterations {args.warm}-{args.iters} (nothing to measure)"
    if interval is not None and (args.iters - args.warm) // interval < 2:
        return (f"variant {name}: with --log-interval {interval} fewer than 3 log lines fall in iterations "
                f"{args.warm}-{args.iters} (no wall to compare)")
    if "base" in changes and not args.base_site:
        return f"variant {name}: +base needs --base-site"
    return None


SAMPLER = Path(__file__).resolve().parent / "stack_sampler"
PROBE = Path(__file__).resolve().parent / "probe"  # +syncstart, +syncstep, +nodma, +nod2d


def sample_env(env: dict[str, str], out: Path, name: str, **where: str) -> dict[str, str]:
    """The environment (``env`` with the sampler first on its path) that loads the stack sampler into the trainer of
    ``name``; ``where``: the sampler's ``CPUCKPT_SAMPLE_MATCH`` / ``CPUCKPT_SAMPLE_LOOP`` (default: Megatron-LM's)."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(SAMPLER), env["PYTHONPATH"]]),
            "CPUCKPT_SAMPLE_OUT": str(out / f"samples_{file_safe(name)}"),
            **{f"CPUCKPT_SAMPLE_{k.upper()}": v for k, v in where.items()}}


def read_samples(out: Path, name: str, iterations: int) -> dict[str, Any] | None:
    """The sampler's counts of ``name``'s trainer as ms per iteration (its largest file: the trainer)."""
    files = sorted((out / f"samples_{file_safe(name)}").glob("sample_*.json"), key=lambda f: f.stat().st_size)
    if not files or iterations <= 0:
        return None
    data = json.loads(files[-1].read_text())
    shutil.rmtree(out / f"samples_{file_safe(name)}", ignore_errors=True)  # the files back from the machine are few
    per = data["interval_ms"] / iterations
    return {"in_loop": data["in_loop"], "samples": data["samples"], "iterations": iterations,
            "inclusive_ms": {k: round(v * per, 2) for k, v in data["inclusive"].items()},
            "leaf_ms": {k: round(v * per, 2) for k, v in data["leaf"].items()}}


class GilProfile:
    """``py-spy record --gil`` of a variant's trainer (``--pyspy``): which of its threads held the interpreter, and
    where, for ``seconds`` from iteration ``at`` on. From outside the process (``--nonblocking``: never paused), so
    the threads of ours that take the trainer's GIL show up by name, which the main thread's sampler cannot say."""

    def __init__(self, out: Path, name: str, at: int, seconds: float, rate: int = 200,
                 pid_of: Callable[[subprocess.Popen], int | None] | None = None) -> None:
        self.path = out / f"gil_{name.replace('+', '_')}.txt"
        self.at, self.seconds, self.rate = at, seconds, rate
        self.pid_of = pid_of or (lambda proc: _trainer_pid(proc.pid))  # default: the trainer under torchrun
        self.proc: subprocess.Popen | None = None
        self.exe = shutil.which("py-spy") or str(Path(sys.prefix) / "bin" / "py-spy")
        for site in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            if site and (Path(site) / "bin" / "py-spy").exists():
                self.exe = str(Path(site) / "bin" / "py-spy")

    def hook(self) -> LineHook:
        def on_line(t: float, line: str, proc: subprocess.Popen, ctl: dict[str, Any]) -> None:
            m = ITER_RE.search(line)
            if self.proc is not None or m is None or int(m.group(1)) < self.at:
                return
            pid = self.pid_of(proc)
            if pid is None:
                logger.warning("py-spy: no trainer process under pid %d", proc.pid)
                self.at = 1 << 30
                return
            try:
                self.proc = subprocess.Popen(
                    [self.exe, "record", "--pid", str(pid), "--duration", str(int(self.seconds)), "--rate",
                     str(self.rate), "--format", "raw", "--threads", "--gil", "--nonblocking", "-o", str(self.path)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            except OSError as e:  # no profile, but the run and the benchmark go on
                logger.warning("py-spy: cannot start %s: %s", self.exe, e)
                self.at = 1 << 30
        return on_line

    def summary(self, top: int = 8) -> dict[str, Any] | None:
        """ms of GIL per second by thread, and each thread's innermost frames by ms per second."""
        if self.proc is None:
            return None
        try:
            _, err = self.proc.communicate(timeout=self.seconds + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return {"error": "py-spy did not finish"}
        if not self.path.exists():
            return {"error": f"py-spy wrote nothing: {err[-300:]}"}
        per_s = 1000.0 / self.rate / self.seconds  # ms of GIL per second, per sample
        threads: dict[str, collections.Counter[str]] = {}
        for raw in self.path.read_text().splitlines():
            stack, _, count = raw.rpartition(" ")
            head, _, frames = stack.partition(";")
            thread = head.split(": ", 1)[-1].split(" (")[0]
            leaf = " < ".join(_frame(f) for f in frames.split(";")[::-1][:3]) if frames else "(no Python frame)"
            threads.setdefault(thread, collections.Counter())[leaf] += int(count)
        return {t: {"gil_ms_per_s": round(per_s * sum(c.values()), 1),
                    "where": {k: round(per_s * v, 1) for k, v in c.most_common(top)}}
                for t, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))}


def _frame(text: str) -> str:
    """``fn (path/file.py:12)`` as ``fn@file.py``."""
    fn, _, where = text.partition(" (")
    return f"{fn}@{os.path.basename(where.rsplit(':', 1)[0])}" if where else fn


def _trainer_pid(launcher: int) -> int | None:
    """The training process under torchrun ``launcher`` (the first child whose command line is Python's)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher:
            return int(stat.parent.name)
    return None


def gil_table(profiles: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, prof in profiles.items():
        for thread, t in prof.items():
            if not isinstance(t, dict):
                rows.append([name, thread, t, ""])
                continue
            rows.append([name, thread, t["gil_ms_per_s"], ""])
            rows.extend(["", "", v, k] for k, v in t["where"].items())
    return format_table(["variant", "thread", "GIL ms/s", "innermost frames"], rows,
                        title="who held the trainer's GIL (py-spy --gil, from outside the process)")


def sample_table(samples: dict[str, dict[str, Any]], top: int = 40) -> str:
    """Functions by ms per iteration in every sampled variant, largest difference to ``none`` first."""
    names = list(samples)
    base = samples.get("none", {}).get("inclusive_ms", {})
    keys = {k for s in samples.values() for k in list(s["inclusive_ms"])[:top]}
    def spread(k: str) -> float:
        return max(abs(s["inclusive_ms"].get(k, 0.0) - base.get(k, 0.0)) for s in samples.values())
    rows = [[k, *[samples[n]["inclusive_ms"].get(k, 0.0) for n in names]]
            for k in sorted(keys, key=spread, reverse=True)[:top]]
    leaf_rows = []
    for n in names:
        if n == "none":
            continue
        for k, v in list(samples[n]["leaf_ms"].items())[:12]:
            leaf_rows.append([n, v, k[:150]])
    return (format_table(["function (inclusive)", *[f"{n} ms/it" for n in names]], rows,
                         title="trainer main thread, sampled every 2 ms inside the training loop")
            + "\n\n" + format_table(["variant", "ms/it", "innermost frames"], leaf_rows,
                                     title="where the sampled variants' main thread was"))


def run_floor(b: Bench, path: Path, budget_s: float) -> dict[str, Any]:
    """overlap_floor.py in this call: none, d2h_paced, ipc_d2h (one hardware queue, Megatron's timers)."""
    argv = [sys.executable, str(path), "--modes", "1:L1", "--variants", "none,d2h_thread,d2h_paced,ipc_d2h,none_end",
            "--budget-s", str(int(budget_s)), "--iters", "16"]
    if b.args.dry_run:
        print("# floor\n" + " ".join(argv))
        return {}
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=b.env, timeout=budget_s + 30)
    (b.out / "overlap_floor.log").write_text(p.stdout + p.stderr)
    js = b.out / "overlap_floor.json"
    data = json.loads(js.read_text()) if js.exists() else {}
    return {"rc": p.returncode, "s": round(time.perf_counter() - t0, 1), "tail": p.stdout[-3000:], "json": data}


def self_test() -> int:
    """The arithmetic on a made-up log: 150 ms iterations, one 600 ms gap after iteration 16."""
    lines, t = [], 5.0
    for it in range(1, 31):
        t += 0.6 if it == 17 else 0.15
        lines.append((t, f" [2026-12-03 10:00:00] iteration {it:8d}/      30 | consumed samples: {4 * it} | "
                         f"elapsed time per iteration (ms): 150.0 | learning rate: 1.0E-04 |"))
    g = goodput(parse_log(lines)["iters"], 10)
    assert g["first"] == 10 and g["last"] == 30 and g["iters"] == 20, g
    assert abs(g["wall_s"] - (20 * 0.15 + 0.45)) < 1e-6, g
    assert g["gap_max_it"] == 17 and g["gap_max_ms"] == 600.0 and g["gap_median_ms"] == 150.0, g
    assert _saves_between(10, 30, 8) == 2 and _saves_between(10, 30, 1) == 20
    g8 = goodput(parse_log(lines)["iters"], 10, 8)  # saves after 16 and 24: the gaps ending at 17 (600) and 25 (150)
    assert g8["after_save_ms"] == [375.0] + [150.0] * 7 and g8["save_cost_in_run_ms"] == 225.0, g8
    g2 = goodput(parse_log(lines)["iters"], 10, 2)  # one 600 among ten gaps ending at odd iterations: the median holds
    assert g2["after_save_ms"] == [150.0, 150.0] and g2["save_cost_in_run_ms"] == 0.0, g2
    # +alt: a start between lines N and N + 1, probed at odd starts; the probed saves' gaps 30 ms longer
    alt_lines, alts, t = [], [], 5.0
    for it in range(1, 31):
        if it > 1:
            alts.append((t + 0.01, f"probe: alt: start {it - 1} {'probed' if (it - 1) % 2 else 'plain'}"))
        t += 0.18 if it > 1 and (it - 1) % 2 else 0.15
        alt_lines.append((t, f" [2026-12-03 10:00:00] iteration {it:8d}/      30 | consumed samples: {4 * it} | "
                             f"elapsed time per iteration (ms): 150.0 | learning rate: 1.0E-04 |"))
    parsed = parse_log(sorted(alt_lines + alts))
    a = alt_gaps(parsed["iters"], parsed["alt"], 10)
    assert (a["alt_probed_ms"], a["alt_plain_ms"], a["alt_effect_ms"], a["alt_counts"]) == (180.0, 150.0, 30.0,
                                                                                           [10, 10]), a
    ends = run_ends(parse_log(lines)["iters"], t + 7.5)
    assert ends == {"start_s": 5.15, "end_s": 7.5}, ends
    later = [{**x, "t": x["t"] + 2.0} for x in parse_log(lines)["iters"]]  # 2 s more set-up, 1 s more at the end
    over = run_ends(later, t + 10.5, ends)
    assert (over["start_over_none_s"], over["end_over_none_s"]) == (2.0, 1.0), over
    records = [{"event": "async_save", "rank": r, "persist_s": 0.1 * k} for k in range(1, 10) for r in (0, 1)]
    assert commit_ms(records + [{"event": "save", "rank": 0, "persist_s": 9.0}]) == 750.0  # rank 0, saves 6-9
    assert commit_ms(records[:10]) is None
    fake = {"none": {"inclusive_ms": {"training.py:train": 150.0}, "leaf_ms": {}},
            "mem1": {"inclusive_ms": {"training.py:train": 300.0, "checkpointing.py:save_checkpoint": 120.0},
                     "leaf_ms": {"a < b": 80.0}}}
    table = sample_table(fake)
    assert table.index("training.py:train") < table.index("save_checkpoint") and "a < b" in table, table
    print("self-test ok:", g)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", default=".megatron-lm")
    ap.add_argument("--out", default=".")
    ap.add_argument("--root", default="/root/cpuckpt-goodput", help="durable checkpoints go here (deleted after)")
    ap.add_argument("--ram", default="/dev/shm/cpuckpt-goodput-ram", help="the memory tier's RAM root")
    ap.add_argument("--config", default="configs/megatron.yaml")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=100, help="iterations per run (the issue's window: 10-100)")
    ap.add_argument("--warm", type=int, default=10, help="the window starts at this iteration")
    ap.add_argument("--durable", type=int, default=64, help="--save-interval of the memory variants")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=200.0, help="per run, seconds")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for all runs (0: no limit)")
    ap.add_argument("--floor", default=None, help="path of overlap_floor.py: run it after the variants")
    ap.add_argument("--floor-budget", type=float, default=150.0)
    ap.add_argument("--base-site", default="", help="a directory holding another cpuckpt install (a baseline "
                    "commit's wheel): variants named +base run with it first on PYTHONPATH, so that one call compares "
                    "two versions on one machine")
    ap.add_argument("--sample", default="", help="variants whose trainer's main thread is sampled (a profile)")
    ap.add_argument("--pyspy", default="", help="variants whose trainer's GIL is profiled by py-spy from outside")
    ap.add_argument("--pyspy-seconds", type=float, default=6.0)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.self_test:
        return self_test()
    # What Bench (benchmarks.bench_megatron_lm) reads; the model is its 24 x 1024 phase model.
    args.concurrent, args.keep, args.nproc = False, False, 1
    args.layers = args.hidden = args.heads = None
    args.seq, args.mbs = 1024, 4
    b = Bench(args)
    root, ram = Path(args.root), Path(args.ram)
    tmp = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    if not args.dry_run:
        b.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "runs": {}, "summary": []}
    refs: dict[tuple, dict[str, Any]] = {}  # the run without checkpoints, per (+mgc, +timers, +swi, +log<N>)
    rows = []
    names = [v for v in args.variants.split(",") if v]
    errors = [e for name in names if (e := variant_error(b, args, name, tmp)) is not None]
    if errors:  # every variant checked before the first runs: a bad last one would waste a device call's others
        shutil.rmtree(tmp, ignore_errors=True)
        ap.error("; ".join(errors))
    try:
        for name in names:
            kind, *changes = name.split("+")
            ref_key = ("mgc" in changes, "timers" in changes, "swi" in changes, log_interval(changes))
            if args.budget and b.left() < 60:
                logger.warning("variant %s skipped: %.0f s of the budget left", name, b.left())
                continue
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)
            cmd, every = variant_argv(b, name, root, tmp, ram, args.iters)
            sampled = name in args.sample.split(",")
            gil = GilProfile(b.out, name, args.warm + 10, args.pyspy_seconds) if name in args.pyspy.split(",") else None
            env = sample_env(b.env, b.out, name) if sampled else None
            if "base" in changes:  # the same run with the baseline's cpuckpt first on the path (--base-site)
                env = {**(env or {}), "PYTHONPATH": os.pathsep.join([args.base_site, (env or b.env)["PYTHONPATH"]])}
            probes = [c for c in changes if is_probe(c)]
            if probes:  # one thing of the iteration changed (benchmarks/probe)
                env = {**(env or {}), "GOODPUT_PROBE": ",".join(probes),
                       "PYTHONPATH": os.pathsep.join([str(PROBE), (env or b.env)["PYTHONPATH"]])}
            r = b.run(name, cmd, env=env, on_line=gil.hook() if gil else None)
            if gil is not None and (prof := gil.summary()) is not None:
                results.setdefault("gil", {})[name] = prof
            g = goodput(r["iters"], args.warm)
            saves = _saves_between(g.get("first", args.warm), g.get("last", args.iters), every)
            # the gaps after a save by position: lines every iteration, and no durable save in the window off the
            # memory saves' positions (Megatron-LM makes a durable save instead of that iteration's memory save)
            in_run = every if (log_interval(changes) or 1) == 1 and not (
                args.durable <= args.iters and every and args.durable % every) else 0
            s = summarize(name, r, refs.get(ref_key), saves, args.warm, in_run)
            ends = run_ends(r["iters"], r["wall_s"], refs.get(ref_key))  # arrival times: since launch
            s.update(ends)
            if kind == "none":
                refs[ref_key] = {**g, "run_s": r["wall_s"], **ends}
            if sampled and not args.dry_run:
                sample = read_samples(b.out, name, max((x["it"] for x in r["iters"]), default=0))
                if sample is not None:
                    results.setdefault("samples", {})[name] = sample
            results["runs"][name] = {k: v for k, v in r.items() if k not in ("telemetry_file",)}
            results["summary"].append(s)
            rows.append([name, s["rc"], s.get("ratio"), s.get("wall_s"), s.get("per_save_ms"), s.get("saves"),
                         f'{s.get("gap_max_ms")} @{s.get("gap_max_it")} ({s.get("gap_max_over_median")}x)',
                         s.get("gap_median_ms"),
                         s.get("save_cost_in_run_ms") if "alt_counts" not in s else
                         f'alt {s.get("alt_probed_ms")} - {s.get("alt_plain_ms")} = {s.get("alt_effect_ms")} '
                         f'({s["alt_counts"][0]}/{s["alt_counts"][1]})', s.get("run_s"),
                         s.get("run_over_none_s"), f'{s.get("start_over_none_s")} / {s.get("end_over_none_s")}',
                         s.get("commit_ms"),
                         s.get("np_timer_median_ms"), s.get("save_timer_ms")])
            if not args.dry_run:
                (b.out / "bench_goodput.json").write_text(json.dumps(results, indent=1, default=str))
        if args.floor and args.budget and b.left() < args.floor_budget + 10:
            logger.warning("floor skipped: %.0f s of the budget left", b.left())
        elif args.floor:
            results["floor"] = run_floor(b, Path(args.floor), args.floor_budget)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if not args.dry_run:
            (b.out / "bench_goodput.json").write_text(json.dumps(results, indent=1, default=str))
    table = format_table(
        ["variant", "rc", "wall x none", f"wall s it {args.warm}-last", "ms per save", "saves",
         "largest gap ms @it (x median)", "median gap ms", "save in run ms", "run s", "run - none s",
         "start / end - none s", "commit ms", "np timer ms", "save timer ms"],
        rows, title=f"goodput: Megatron-LM 24x1024, {args.iters} iterations, memory durable every {args.durable}, "
                    f"slots {args.slots}",
        footnotes=["wall: from the arrival of iteration lines (the job's clock), not Megatron's timers; "
                   "run s: launch to exit; start / end: launch to the first iteration's line, the last one's to exit; "
                   "commit: a save's call to its memory commit (median, telemetry); save in run: saves every K >= 2, "
                   "the gaps after a save over the quiet second half of the interval, summed (per position in the "
                   "JSON: after_save_ms); +alt: median gap after a probed save - after a plain one = the probe's "
                   "effect within the run (gaps counted)"])
    print()
    print(table)
    if results.get("samples"):
        print()
        print(sample_table(results["samples"]))
    if results.get("gil"):
        print()
        print(gil_table(results["gil"]))
    floor = results.get("floor") or {}
    if floor.get("tail"):
        print()
        print("floor (overlap_floor.py, same call):")
        print(floor["tail"][-2500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
