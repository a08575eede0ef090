"""Megatron-LM's own ``pretrain_gpt.py`` with ``--ckpt-format torch_dist`` and ``--ckpt-format cpuckpt``.

Phases (``--phases``, comma-separated, run in the order given; default ``load,reuse,kill``):

``save``
    The save comparison: both formats with the same model, the same save interval and ``--async-save
    --use-persistent-ckpt-worker``; then stock ``--ckpt-format torch_dist`` resumes the cpuckpt
    checkpoint (no cpuckpt anywhere in the load path: the files stay loadable by stock Megatron-LM).
    Parsed: the ``save-checkpoint`` timer (the trainer's stall per save), the per-iteration times
    (iterations right after a save are listed apart: they pay for any background work), and the time
    from the last log line to process exit (the final wait for the async save). Model default: 16
    layers, hidden 2048.
``load``
    The load profile. One checkpoint per format after ``--load-iters`` iterations (the two save runs
    overlap, ``--concurrent``: only the files matter here), then per format: drop the page cache,
    resume (``--load``, one more iteration) and parse Megatron-LM's ``load-checkpoint`` timer, the
    adapter's ``cpuckpt megatron load ...: translate, cpuckpt.load, unwrap`` line and the
    ``cpuckpt.telemetry`` load line (metadata, planning, reads). Then the raw floor: every file of
    the checkpoint directory read cold (page cache dropped before each pass) with ``--floor-threads``
    threads, buffered and with O_DIRECT (page-aligned buffers), 32 MiB ``preadv`` chunks interleaved
    over the threads. The ratio compares cpuckpt.load with the floor for the same bytes (target 1.15).
``reuse``
    Plan reuse: three cpuckpt runs saving ``--reuse-saves`` times every ``--reuse-interval`` iterations:
    DCP plans every save (``megatron.reuse_plan: false``), plan reuse (the default), and
    ``--ckpt-assume-constant-structure``; the ``save-checkpoint`` timer per save
    (warm: the saves after the first), cpuckpt's telemetry per save, and whether the previous save was
    finalized before each save started (if not, the timer includes waiting for it: raise the interval).
``kill``
    Dead worker: cpuckpt runs with ``--async-save --use-persistent-ckpt-worker``; right after save
    ``--kill-after-save`` was scheduled (its ``save-checkpoint`` timer line), the trainer's persistent
    checkpoint worker (the trainer's child started by ``multiprocessing.spawn``, or by its forkserver;
    its command line is recorded) gets SIGKILL. Variant ``default``: configs/megatron.yaml (expected: the trainer stops
    with an error naming the dead worker; "HANG" when it is still running ``--kill-grace`` seconds
    after the kill). Variant ``continue``: the same YAML plus ``megatron: {on_failure: continue}``
    (expected: training goes on and later saves succeed).

Models of ``load``, ``reuse`` and ``kill``: 24 layers, hidden 1024, 16 heads (~0.36 B parameters,
~5 GB per checkpoint with the optimizer state); ``--layers/--hidden/--heads`` override every phase.

``--use-distributed-optimizer`` is left out: without Apex or Transformer Engine, Megatron-LM (main,
d98e8a64) cannot resume a distributed-optimizer checkpoint into a fresh optimizer
(``DistributedOptimizer.state_dict`` asserts a single Adam ``step`` and finds none), whatever the format.

Megatron-LM is not on PyPI and is not part of this repository: point ``--megatron-lm`` at a checkout
(``megatron/``, ``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``). From the repository root:

    python -m benchmarks.bench_megatron_lm --megatron-lm .megatron-lm --out $OUT --phases load,reuse,kill
    python -m benchmarks.bench_megatron_lm --dry-run      # the commands, nothing run
    python -m benchmarks.bench_megatron_lm --self-test    # the log parsers and the floor reader (CPU)

Results: ``$OUT/bench_megatron_lm.json`` (rewritten after every phase), one log per run, one table per
phase on stdout. Every checkpoint directory under ``--root`` is deleted when done (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import logging
import mmap
import os
import queue
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import FloorResult, drop_caches, file_safe, files_under, format_table, tree_nbytes

logger = logging.getLogger("bench_megatron_lm")

MiB = 2**20
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+)")
# Megatron's Timers.log: "(min, max) time across ranks (ms):" then "    save-checkpoint ....: (min, max)";
# with --timing-log-option max: "    save-checkpoint ....: max". The timer is on by default (log level 0).
SAVE_RE = re.compile(r"save-checkpoint \.*: \(?([\d.]+)(?:, ([\d.]+)\))?")
NP_SAVE_RE = re.compile(r"save-checkpoint-non-persistent \.*: \(?([\d.]+)(?:, ([\d.]+)\))?")
LOAD_RE = re.compile(r"load-checkpoint \.*: \(?([\d.]+)(?:, ([\d.]+)\))?")
LOADED_RE = re.compile(r"successfully loaded checkpoint from (\S+).*iteration\D+(\d+)")
VALUES_RE = re.compile(r"(lm loss|grad norm): [-+\d.Ee]+")  # on an iteration's line: what a continuation must equal
ALT_RE = re.compile(r"probe: alt: start (\d+) (probed|plain)")  # benchmarks/probe's alt: which saves were probed
SAVED_RE = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) to (\S+)")
# cpuckpt.integrations.megatron.strategy (INFO): cpuckpt's share of Megatron's load-checkpoint.
MLOAD_RE = re.compile(r"cpuckpt megatron load (\S+): translate ([\d.]+) s, cpuckpt\.load ([\d.]+) s, "
                      r"unwrap ([\d.]+) s, (\d+) bytes")
# cpuckpt.telemetry (INFO), one line per save/load of a rank.
TELEMETRY_RE = re.compile(
    r"cpuckpt (\w+) (\S+) rank (\d+): stall ([\d.]+) s, persist ([\d.]+) s"
    r"(?: \(metadata ([\d.]+) s, planning ([\d.]+) s, reads ([\d.]+) s"
    r"(?:: parallel reads ([\d.]+) s, copies into targets ([\d.]+) s)?\))?, (\d+) bytes, ([\d.]+) GB/s, "
    r"mode (\S+), (\d+) file\(s\)")
WORKER_ERROR_RE = re.compile(r"WorkerDiedError|checkpoint worker")
ERROR_RE = re.compile(r"Traceback|Error|error:|CUDA out of memory")

FLAGS = (
    "--transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 --bf16 "
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
    "--disable-bias-linear --log-interval 1 --log-throughput"
)
ASYNC = ["--async-save", "--use-persistent-ckpt-worker"]
RESUME = ["--exit-on-missing-checkpoint", "--override-opt-param-scheduler"]  # train-iters grew: LR schedule differs
PHASES = ("save", "load", "reuse", "kill", "memory", "fallback")
# save phase: --formats may name these cpuckpt variants (their keys merged into --config's megatron: block)
VARIANTS: dict[str, dict[str, Any]] = {
    "cpuckpt-zero": {"ordering": "optimizer"},  # copies overlap the next forward/backward (zero-stall)
    "cpuckpt-unprepared": {"prepare_pool": False},  # the pool made inside the first save (as before)
    "cpuckpt-zero-constant": {"ordering": "optimizer"},  # zero-stall with VARIANT_FLAGS below
    # zero-stall with the device snapshot: the next optimizer step waits for a device-to-device copy only
    "cpuckpt-zero-snapshot": {"ordering": "optimizer", "staging": {"device_snapshot": True}},
}
# Megatron-LM flags a variant adds to its command line. --ckpt-assume-constant-structure: Megatron-LM
# validates the sharding of the first save only (otherwise of every save, inside save-checkpoint's timer).
VARIANT_FLAGS: dict[str, list[str]] = {"cpuckpt-zero-constant": ["--ckpt-assume-constant-structure"],
                                       "cpuckpt-zero-snapshot": ["--ckpt-assume-constant-structure"]}
SAVE_MODEL = (16, 2048, 16)  # layers, hidden, heads of the save phase (BENCHMARKS.md's table)
PHASE_MODEL = (24, 1024, 16)  # load, reuse, kill
# Rough seconds per phase on one H200 (startup of pretrain_gpt ~30 s per run); --budget skips a phase
# that cannot start with at least this much left.
PHASE_MIN_S = {"save": 240, "load": 150, "reuse": 110, "kill": 90, "memory": 200, "fallback": 90}
RESERVE_S = 15.0  # kept back from --budget for tables, JSON and cleanup


# ------------------------------------------------------------------------------------------- parsing


def _max_ms(m: re.Match) -> float:
    return float(m.group(2) or m.group(1))  # (min, max) across ranks, or max alone


def parse_log(lines: Sequence[tuple[float, str]]) -> dict[str, Any]:
    """Everything the phases read from one run's log; ``lines`` are (seconds since start, text)."""
    out: dict[str, Any] = {"iters": [], "saves": [], "np_saves": [], "load_ms": None, "loaded": [], "saved": [],
                           "mload": [], "telemetry": [], "worker_errors": [], "errors": [], "alt": []}
    for t, line in lines:
        if m := ITER_RE.search(line):
            out["iters"].append({"t": round(t, 4), "it": int(m.group(1)), "ms": float(m.group(2)),  # 0.1 ms: gaps
                                 "values": " | ".join(v.group(0) for v in VALUES_RE.finditer(line))})
        elif m := SAVE_RE.search(line):
            # The timer line comes right after save_checkpoint returned: the save started ms earlier.
            ms = _max_ms(m)
            out["saves"].append({"t": round(t, 2), "ms": ms, "start_t": round(t - ms / 1000, 2)})
        elif m := NP_SAVE_RE.search(line):
            ms = _max_ms(m)
            out["np_saves"].append({"t": round(t, 2), "ms": ms, "start_t": round(t - ms / 1000, 2)})
        elif m := LOAD_RE.search(line):
            out["load_ms"] = _max_ms(m)
        elif m := LOADED_RE.search(line):
            out["loaded"].append(line.strip())
        elif m := ALT_RE.search(line):
            out["alt"].append({"t": round(t, 4), "start": int(m.group(1)), "probed": m.group(2) == "probed",
                               "after_it": out["iters"][-1]["it"] if out["iters"] else None})
        elif m := SAVED_RE.search(line):
            out["saved"].append({"t": round(t, 2), "it": int(m.group(1)), "dir": m.group(2)})
        elif m := MLOAD_RE.search(line):
            out["mload"].append({"path": m.group(1), "translate_s": float(m.group(2)), "load_s": float(m.group(3)),
                                 "unwrap_s": float(m.group(4)), "nbytes": int(m.group(5))})
        elif m := TELEMETRY_RE.search(line):
            rec = {"t": round(t, 2), "event": m.group(1), "path": m.group(2), "rank": int(m.group(3)),
                   "stall_s": float(m.group(4)), "persist_s": float(m.group(5)), "nbytes": int(m.group(11)),
                   "gbps": float(m.group(12)), "mode": m.group(13), "files": int(m.group(14))}
            if m.group(6) is not None:
                rec.update(metadata_s=float(m.group(6)), plan_s=float(m.group(7)), read_s=float(m.group(8)))
            if m.group(9) is not None:
                rec.update(read_io_s=float(m.group(9)), read_copy_s=float(m.group(10)))
            out["telemetry"].append(rec)
        if WORKER_ERROR_RE.search(line):
            out["worker_errors"].append({"t": round(t, 2), "line": line.strip()[:400]})
        elif ERROR_RE.search(line):
            out["errors"].append({"t": round(t, 2), "line": line.strip()[:400]})
    out["errors"] = out["errors"][:20]
    out["worker_errors"] = out["worker_errors"][:20]
    return out


def read_telemetry_file(path: Path) -> list[dict[str, Any]]:
    """cpuckpt's JSON telemetry (``CPUCKPT_TELEMETRY_FILE``), a second source next to the log lines."""
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    return recs


# ------------------------------------------------------------------------------------ process control


def _children(pid: int) -> list[dict[str, Any]]:
    """Direct children of ``pid``: pid, cmdline, create time (psutil, else /proc)."""
    try:
        import psutil

        out = []
        for c in psutil.Process(pid).children(recursive=False):
            try:
                out.append({"pid": c.pid, "cmdline": c.cmdline(), "create_time": c.create_time()})
            except psutil.Error:
                continue
        return out
    except ImportError:
        pass
    except Exception:  # the process is gone
        return []
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) != pid:
                continue
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            out.append({"pid": int(d.name), "cmdline": [c.decode(errors="replace") for c in cmd if c],
                        "create_time": float(fields[19])})
        except (OSError, ValueError, IndexError):
            continue
    return out


def _descendants(pid: int) -> list[dict[str, Any]]:
    """Every process below ``pid`` (children first)."""
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += [k["pid"] for k in kids]
    return out


def find_ckpt_worker(launcher_pid: int) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The persistent checkpoint worker of the first trainer below ``launcher_pid`` (torchrun).

    The trainer is torchrun's child running ``pretrain_gpt.py``; its checkpoint worker is the child
    started by ``multiprocessing.spawn`` (megatron-core's / nvidia-resiliency-ext's PersistentAsyncCaller),
    not the resource tracker and not the forked data-loader workers (same command line as the trainer).
    Returns (worker or None, what was seen).
    """
    trainers = [c for c in _children(launcher_pid) if any("pretrain_gpt" in a for a in c["cmdline"])]
    seen: dict[str, Any] = {"trainers": trainers, "children": []}
    if not trainers:
        return None, seen
    trainer = trainers[0]
    kids = _children(trainer["pid"])
    for k in list(kids):  # multiprocessing's forkserver (async_strategy mcore): its children are the workers
        if any("forkserver" in a for a in k["cmdline"]):
            kids += [{**g, "via": "forkserver"} for g in _children(k["pid"])]
    seen["children"] = kids
    spawned = [k for k in kids if (k.get("via") or any("spawn_main" in a or "--multiprocessing-fork" in a
                                                       for a in k["cmdline"]))
               and not any("resource_tracker" in a or "forkserver import main" in a for a in k["cmdline"])]
    if not spawned:  # fall back: anything that is not a fork of the trainer and not the resource tracker
        spawned = [k for k in kids if k["cmdline"] != trainer["cmdline"]
                   and not any("resource_tracker" in a for a in k["cmdline"])]
    if not spawned:
        return None, seen
    return max(spawned, key=lambda k: k["create_time"]), seen  # the newest: started at the first save


_ACTIVE: set[subprocess.Popen] = set()  # runs in flight: their process groups die with this script


def _on_sigterm(signum: int, frame: Any) -> None:
    """An outer ``timeout`` ends this script: take the runs' process groups along, then clean up (finally)."""
    for proc in list(_ACTIVE):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a run this script started (torchrun, trainers, their workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


LineHook = Callable[[float, str, subprocess.Popen, dict[str, Any]], None]


def run(name: str, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float,
        on_line: LineHook | None = None) -> dict[str, Any]:
    """Run one training job in its own process group; keep its log with per-line timestamps; parse it.

    ``on_line(t, line, proc, ctl)`` sees every line as it arrives; it may lower ``ctl["deadline"]``
    (seconds since start). Past the deadline, the whole process group is killed (``timed_out``).
    """
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    ctl: dict[str, Any] = {"deadline": timeout_s}
    timed_out = False
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            errors="replace", start_new_session=True)
    assert proc.stdout is not None
    _ACTIVE.add(proc)
    q: queue.Queue[tuple[float, str] | None] = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put((time.perf_counter() - t0, line))
        q.put(None)

    threading.Thread(target=reader, name=f"log-{name}", daemon=True).start()
    exited_at: float | None = None
    with open(log_path, "w") as log:
        while True:
            try:
                item = q.get(timeout=0.25)
            except queue.Empty:
                item = ()
            if item is None:
                break
            now = time.perf_counter() - t0
            if item:
                t, line = item
                log.write(f"[{t:8.2f}] {line}")
                lines.append((t, line))
                if on_line is not None:
                    on_line(t, line, proc, ctl)
            if now > ctl["deadline"]:
                timed_out = True
                log.write(f"[{now:8.2f}] bench_megatron_lm: deadline passed, killing the process group\n")
                break
            if proc.poll() is not None:  # torchrun ended; a leftover child may still hold the pipe open
                exited_at = exited_at if exited_at is not None else now
                if now - exited_at > 5:
                    break
    _kill_group(proc)  # leftovers (a worker orphaned by a failed trainer) must not keep the GPU
    rc = proc.wait()
    _ACTIVE.discard(proc)
    wall = time.perf_counter() - t0
    parsed = parse_log(lines)
    last = max([x["t"] for x in parsed["iters"]] + [x["t"] for x in parsed["saves"]], default=0.0)
    return {"name": name, "argv": argv, "rc": rc, "timed_out": timed_out, "wall_s": round(wall, 2),
            "exit_wait_s": round(wall - last, 2) if last else None, "log": str(log_path), **parsed}


# ------------------------------------------------------------------------------------------- raw floor


def read_tree_floor(files: Sequence[Path], threads: int, direct: bool, *, chunk_bytes: int = 32 * MiB,
                    align: int = 4096) -> FloorResult:
    """Read every byte of ``files`` with ``threads`` threads of ``os.preadv`` (32 MiB chunks, interleaved).

    Each thread reads into its own page-aligned buffer (anonymous mmap, touched before timing). With
    ``direct`` the files are opened with O_DIRECT and every read is padded to ``align`` (a file's tail
    comes back short, as it should). Time: open, reads, close. Drop the page cache first for a cold read.
    A filesystem that refuses O_DIRECT marks the result unsupported.
    """
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    res = FloorResult("pread-tree", direct, threads, total, chunk_bytes)
    jobs = [(i, off, min(chunk_bytes, size - off))
            for i, size in enumerate(sizes) for off in range(0, size, chunk_bytes)]
    bufs = [mmap.mmap(-1, chunk_bytes) for _ in range(threads)]
    for b in bufs:
        for off in range(0, chunk_bytes, mmap.PAGESIZE):
            b[off] = 1
    got = [0] * threads
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def worker(k: int) -> None:
        view = memoryview(bufs[k])
        try:
            for i, off, want in jobs[k::threads]:
                n = -(-want // align) * align if direct else want
                done = 0
                while done < want:
                    r = os.preadv(fds[i], [view[done:n]], off + done)
                    if r == 0:
                        break
                    done += r
                    if direct and done < want and done % align:
                        raise OSError(errno.EIO, f"short O_DIRECT read in {files[i]} at {off + done}")
                got[k] += min(done, want)
        finally:
            view.release()

    cpu0, t0 = sum(os.times()[:2]), time.perf_counter()
    fds: list[int] = []
    try:
        try:
            for f in files:
                fds.append(os.open(f, flags))
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(worker, range(threads)))
        finally:
            for fd in fds:
                os.close(fd)
        res.wall_s, res.cpu_s = time.perf_counter() - t0, sum(os.times()[:2]) - cpu0
    except OSError as e:
        if not direct:
            raise
        res.supported, res.error = False, str(e)
        return res
    finally:
        for b in bufs:
            b.close()
    if sum(got) != total:
        raise RuntimeError(f"floor read {sum(got)} of {total} bytes")
    return res


# ------------------------------------------------------------------------------------------- context


class Bench:
    """Command lines, runs, budget and results shared by the phases."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mlm = Path(args.megatron_lm).resolve()
        self.out = Path(args.out)
        self.root = Path(args.root)
        self.t0 = time.perf_counter()
        self.results: dict[str, Any] = {"args": vars(args), "phases": {}, "timing_s": {}}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.mlm),
                                             *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        env.setdefault("MEGATRON_LOGGING_LEVEL", "20")  # root logger at INFO: cpuckpt's INFO lines reach the log
        self.env = env

    # -- commands
    def model(self, phase: str) -> tuple[int, int, int]:
        layers, hidden, heads = SAVE_MODEL if phase == "save" else PHASE_MODEL
        a = self.args
        return (a.layers or layers, a.hidden or hidden, a.heads or heads)

    def model_flags(self, phase: str) -> list[str]:
        layers, hidden, heads = self.model(phase)
        a = self.args
        return [
            "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--ffn-hidden-size", str(int(hidden * 8 / 3) // 64 * 64),
            "--num-attention-heads", str(heads), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
            "--global-batch-size", str(a.mbs * a.nproc),
        ]

    def argv(self, fmt: str, phase: str, extra: list[str], config: str | None = None) -> list[str]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={self.args.nproc}"]
        if fmt in VARIANTS:  # cpuckpt with the variant's megatron: keys merged into --config
            extra = [*extra, *VARIANT_FLAGS.get(fmt, [])]
            dest = Path(tempfile.mkdtemp(prefix="bench_mlm_")) / f"{fmt}.yaml"
            config = str(megatron_config(config or self.args.config, dest, **VARIANTS[fmt]))
            fmt = "cpuckpt"
        if fmt == "cpuckpt":
            entry = ["-m", "cpuckpt.integrations.megatron.launch", str(self.mlm / "pretrain_gpt.py"),
                     "--ckpt-format", "cpuckpt", "--cpuckpt-config", config or self.args.config]
        else:
            entry = [str(self.mlm / "pretrain_gpt.py"), "--ckpt-format", fmt]
        return [*torchrun, *entry, *FLAGS.split(), *self.model_flags(phase), *extra]

    # -- budget
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget - self.elapsed() if self.args.budget else float("inf")

    def run_timeout(self) -> float:
        return max(10.0, min(self.args.timeout, self.left() - RESERVE_S))

    # -- runs
    def run(self, name: str, argv: list[str], on_line: LineHook | None = None,
            env: dict[str, str] | None = None) -> dict[str, Any]:
        if self.args.dry_run:
            extra = {k: v for k, v in (env or {}).items() if self.env.get(k) != v}
            prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
            print(f"# {name}\n{prefix + ' ' if prefix else ''}{shlex.join(argv)}")
            return {"name": name, "argv": argv, "rc": 0, "timed_out": False, "wall_s": 0.0, "exit_wait_s": None,
                    "dry_run": True, **parse_log([])}
        timeout = self.run_timeout()
        logger.info("== %s (timeout %.0f s, %.0f s into the benchmark)", name, timeout, self.elapsed())
        telemetry = self.out / f"telemetry_{name}.jsonl"
        telemetry.unlink(missing_ok=True)
        # the run's own telemetry file last: a whole environment passed in (a sampled run's) may name another
        run_env = {**self.env, **(env or {}), "CPUCKPT_TELEMETRY_FILE": str(telemetry)}
        r = run(name, argv, run_env, run_log(self.out, name), timeout, on_line)
        r["telemetry_file"] = read_telemetry_file(telemetry)
        logger.info("%s: rc %s%s, wall %.1f s, %d iterations, save-checkpoint ms %s, load-checkpoint ms %s",
                    name, r["rc"], " (timed out)" if r["timed_out"] else "", r["wall_s"], len(r["iters"]),
                    [round(s["ms"]) for s in r["saves"]], r["load_ms"])
        return r

    def run_many(self, jobs: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
        """Several runs at once (``--concurrent``) or one after the other."""
        if not self.args.concurrent or self.args.dry_run or len(jobs) < 2:
            return [self.run(n, a) for n, a in jobs]
        with ThreadPoolExecutor(len(jobs)) as ex:
            return list(ex.map(lambda j: self.run(*j), jobs))

    def drop_caches(self) -> bool:
        if self.args.dry_run:
            print("# sync; echo 3 > /proc/sys/vm/drop_caches")
            return True
        ok = drop_caches()
        if not ok:
            logger.warning("could not drop the page cache (not root?): reads below may be warm")
        return ok

    def clean(self, path: Path) -> None:
        if self.args.dry_run:
            print(f"# rm -rf {path}")
        elif not self.args.keep:
            shutil.rmtree(path, ignore_errors=True)

    def save_json(self) -> None:
        if self.args.dry_run:
            return
        (self.out / "bench_megatron_lm.json").write_text(json.dumps(self.results, indent=1, default=str))


# ---------------------------------------------------------------------------------------------- save


def summarize_save(r: dict, save_interval: int) -> dict:
    times = [x["ms"] for x in r["iters"]]
    after_save = [x["ms"] for x in r["iters"] if x["it"] > 1 and (x["it"] - 1) % save_interval == 0]
    steady = [x["ms"] for x in r["iters"]
              if x["it"] > 5 and (x["it"] - 1) % save_interval != 0 and x["it"] % save_interval != 0]
    ours = [x for x in r.get("telemetry_file") or [] if x.get("event") == "async_save" and x.get("rank") == 0]
    return {
        "run": r["name"], "rc": r["rc"],
        "save_checkpoint_ms": [round(s["ms"], 1) for s in r["saves"]],
        # cpuckpt's share of each save: the async_save call, and how long the caller was blocked in all
        # (the call, or the staging wait when the strategy waited for it); the rest is Megatron-LM's own work
        "cpuckpt_call_ms": [round(1000 * x.get("call_s", 0.0), 1) for x in ours],
        "cpuckpt_stall_ms": [round(1000 * x.get("stall_s", 0.0), 1) for x in ours],
        "iter_ms_median": round(statistics.median(steady), 1) if steady else None,
        "iter_ms_after_save": [round(x, 1) for x in after_save],
        "iter_ms_mean_all": round(statistics.fmean(times), 1) if times else None,
        "exit_wait_s": r.get("exit_wait_s"), "wall_s": r.get("wall_s"),
    }


def phase_save(b: Bench) -> tuple[dict, str]:
    """torch_dist against cpuckpt, both async with the persistent worker; stock torch_dist resumes cpuckpt's."""
    a = b.args
    root = b.root / "save"
    common = ["--train-iters", str(a.iters), "--save-interval", str(a.save_interval),
              "--eval-interval", str(10 * a.iters), *ASYNC]
    formats = a.formats.split(",")
    results = []
    for fmt in formats:
        b.clean(root)  # one run's checkpoints at a time (disk space)
        results.append(b.run(f"save-{fmt}", b.argv(fmt, "save", [*common, "--save", str(root / fmt)])))
    resumed = formats[-1]  # the last run's checkpoints are the ones still on disk
    if a.resume and (resumed == "cpuckpt" or resumed in VARIANTS):
        resume = ["--train-iters", str(a.iters + 5), "--eval-interval", str(10 * a.iters),
                  "--load", str(root / resumed), *RESUME]
        results.append(b.run("save-resume-stock", b.argv("torch_dist", "save", resume)))
    b.clean(root)
    rows = [summarize_save(r, a.save_interval) for r in results]
    table = format_table(
        ["run", "rc", "save-checkpoint ms (per save)", "cpuckpt call / stall ms", "iter ms (median)",
         "iter ms right after saves", "exit wait s", "wall s"],
        [[s["run"], s["rc"], s["save_checkpoint_ms"], f"{s['cpuckpt_call_ms']} / {s['cpuckpt_stall_ms']}",
          s["iter_ms_median"], s["iter_ms_after_save"], s["exit_wait_s"], s["wall_s"]] for s in rows],
        title=f"save: torch_dist vs cpuckpt, {a.iters} iterations, --save-interval {a.save_interval}, "
              f"model {b.model('save')}",
        footnotes=[f"{r['name']}: {line}" for r in results for line in r["loaded"]])
    return {"runs": rows, "raw": results}, table


# ---------------------------------------------------------------------------------------------- load


def _ckpt_dir(save_dir: Path, iteration: int) -> Path:
    return save_dir / f"iter_{iteration:07d}"


def _tracker(save_dir: Path) -> str | None:
    try:
        return (save_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return None


def _floor(b: Bench, ckpt: Path) -> dict[str, Any]:
    if b.args.dry_run:
        print(f"# per pass: drop caches, read every file of {ckpt}; buffered then O_DIRECT, threads "
              f"{b.args.floor_threads}")
        return {}
    files = sorted(files_under(ckpt))
    rows = []
    for direct in (False, True):
        for threads in b.args.floor_threads:
            cold = b.drop_caches()
            res = read_tree_floor(files, threads, direct)
            rows.append({**res.to_dict(), "cold": cold})
            logger.info("floor %s %s %d threads: %s", ckpt, "O_DIRECT" if direct else "buffered", threads,
                        f"{res.wall_s:.2f} s, {res.gbps:.2f} GB/s" if res.supported else f"unsupported ({res.error})")
            if not res.supported:
                break

    def best(direct: bool) -> dict[str, Any] | None:
        ok = [r for r in rows if r["direct"] == direct and r["supported"]]
        return min(ok, key=lambda r: r["wall_s"]) if ok else None

    return {"files": len(files), "nbytes": sum(f.stat().st_size for f in files) if files else 0, "runs": rows,
            "best_buffered": best(False), "best_direct": best(True)}


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def phase_load(b: Bench) -> tuple[dict, str]:
    a = b.args
    root = b.root / "load"
    b.clean(root)
    formats = ["torch_dist", "cpuckpt"]
    it = a.load_iters
    save_extra = ["--train-iters", str(it), "--save-interval", str(it), "--eval-interval", str(10 * it), *ASYNC]
    jobs = [(f"load-save-{fmt}", b.argv(fmt, "load", [*save_extra, "--save", str(root / fmt)])) for fmt in formats]
    saves = dict(zip(formats, b.run_many(jobs)))
    for (name, argv), fmt in zip(jobs, formats):  # a failed concurrent save: once more, alone
        if not a.dry_run and _tracker(root / fmt) != str(it) and a.concurrent:
            logger.warning("%s: no checkpoint of iteration %d (rc %s); once more, alone", name, it, saves[fmt]["rc"])
            b.clean(root / fmt)
            saves[fmt] = b.run(name + "-retry", argv)
    loads: dict[str, dict] = {}
    floors: dict[str, dict] = {}
    # (row, format, environment): cpuckpt's loads once with the config's threads, then with each --load-threads
    variants = [(fmt, fmt, {}) for fmt in formats] + [
        (f"cpuckpt io.read_threads={n}", "cpuckpt", {"CPUCKPT_IO_READ_THREADS": str(n)}) for n in a.load_threads]
    for row, fmt, env in variants:
        if not a.dry_run and _tracker(root / fmt) != str(it):
            loads[row] = {"name": f"load-{row}", "rc": None, "skipped": "no checkpoint to load"}
            continue
        cold = b.drop_caches()
        load_extra = ["--train-iters", str(it + 1), "--eval-interval", str(10 * it), "--load", str(root / fmt),
                      *RESUME]
        loads[row] = b.run(f"load-{row.replace(' ', '-')}", b.argv(fmt, "load", load_extra), env=env)
        loads[row]["cache_dropped"] = cold
    for fmt in formats:
        if a.dry_run or _tracker(root / fmt) == str(it):
            floors[fmt] = _floor(b, _ckpt_dir(root / fmt, it))
    if not a.dry_run:
        for fmt in formats:
            d = _ckpt_dir(root / fmt, it)
            if d.is_dir():
                floors.setdefault(fmt, {})["tree_nbytes"] = tree_nbytes(d)
                floors[fmt]["listing"] = {str(f.relative_to(d)): f.stat().st_size for f in sorted(files_under(d))}
    b.clean(root)

    rows, summary = [], {}
    for row, fmt, _ in variants:
        ld, fl = loads.get(row, {}), floors.get(fmt, {})
        ml = ld.get("mload") or []  # one per dist_checkpointing.load; summed if Megatron-LM loads more than once
        tele = [x for x in ld.get("telemetry") or [] if x["event"] == "load"]

        def total(recs: list[dict], key: str) -> float | None:
            vals = [x[key] for x in recs if x.get(key) is not None]
            return round(sum(vals), 3) if vals else None

        tree = fl.get("nbytes") or 0
        nbytes = int(total(ml, "nbytes") or 0) or tree
        bb, bd = fl.get("best_buffered"), fl.get("best_direct")
        # the floor's time for cpuckpt's bytes (the floor read the whole directory: tree bytes)
        raw_b = bb["wall_s"] * nbytes / tree if bb and tree else None
        raw_d = bd["wall_s"] * nbytes / tree if bd and tree else None
        load_s = ld["load_ms"] / 1000 if ld.get("load_ms") is not None else None
        share = total(ml, "load_s")
        s = {"format": row, "rc": ld.get("rc"), "load_checkpoint_s": _r(load_s, 3), "cpuckpt_load_s": share,
             "cpuckpt_loads": len(ml), "translate_s": total(ml, "translate_s"), "unwrap_s": total(ml, "unwrap_s"),
             "metadata_s": total(tele, "metadata_s"), "plan_s": total(tele, "plan_s"),
             "reads_s": total(tele, "read_s"), "read_io_s": total(tele, "read_io_s"),
             "read_copy_s": total(tele, "read_copy_s"), "nbytes": nbytes, "tree_nbytes": tree, "files": fl.get("files"),
             "raw_buffered_s": _r(raw_b, 3), "raw_buffered_threads": bb["threads"] if bb else None,
             "raw_direct_s": _r(raw_d, 3), "raw_direct_threads": bd["threads"] if bd else None,
             "share_over_raw_buffered": _r(share / raw_b if share and raw_b else None),
             "share_over_raw_direct": _r(share / raw_d if share and raw_d else None),
             "load_over_raw_buffered": _r(load_s / raw_b if load_s and raw_b else None),
             "cache_dropped": ld.get("cache_dropped"), "loaded": ld.get("loaded")}
        summary[row] = s
        split = (f"{s['metadata_s']}/{s['plan_s']}/{s['reads_s']} ({s['read_io_s']}+{s['read_copy_s']})"
                 if s["metadata_s"] is not None else None)
        shown = f"{share} ({len(ml)} loads)" if len(ml) > 1 else share
        rows.append([row, s["rc"], s["load_checkpoint_s"], shown, split,
                     f"{s['translate_s']}/{s['unwrap_s']}" if ml else None,
                     f"{nbytes / 1e9:.3f}" if nbytes else None,
                     f"{raw_b:.2f} ({bb['threads']} thr)" if raw_b else None,
                     f"{raw_d:.2f} ({bd['threads']} thr)" if raw_d else None,
                     s["share_over_raw_buffered"], s["share_over_raw_direct"], s["load_over_raw_buffered"]])
    table = format_table(
        ["format", "rc", "load-checkpoint s", "cpuckpt.load s", "metadata/planning/reads (io+copies) s",
         "translate/unwrap s", "GB", "raw buffered s", "raw O_DIRECT s", "share/raw buf", "share/raw direct",
         "load-ckpt/raw buf"],
        rows, right=[False, True, True, True, False, False, True, True, True, True, True, True],
        title=f"load: cold resume, model {b.model('load')}, checkpoint of iteration {it}, one rank",
        footnotes=["raw: the checkpoint directory's files read cold (page cache dropped), best of threads "
                   f"{a.floor_threads}, scaled to the format's bytes (cpuckpt: the bytes cpuckpt.load read); "
                   "share = cpuckpt.load s; target share/raw buf <= 1.15",
                   *[f"{row}: {line}" for row, _, _ in variants for line in loads.get(row, {}).get("loaded") or []]])
    return {"summary": summary, "saves": saves, "loads": loads, "floors": floors}, table


# --------------------------------------------------------------------------------------------- reuse


def summarize_reuse(r: dict[str, Any]) -> dict[str, Any]:
    saves = r["saves"]
    finalized = [x["t"] for x in r["saved"]]
    tele = [x for x in r["telemetry"] if "save" in x["event"]]
    per_save = []
    for i, s in enumerate(saves):
        prev_done = None if i == 0 else sum(1 for t in finalized if t <= s["start_t"]) >= i
        per_save.append({"ms": s["ms"], "prev_finalized_before_start": prev_done,
                         "cpuckpt_stall_s": tele[i]["stall_s"] if i < len(tele) else None,
                         "cpuckpt_persist_s": tele[i]["persist_s"] if i < len(tele) else None})
    warm = [s["ms"] for s in saves[1:]]
    return {"run": r["name"], "rc": r["rc"], "saves": per_save, "first_ms": saves[0]["ms"] if saves else None,
            "warm_mean_ms": round(statistics.fmean(warm), 1) if warm else None,
            "warm_min_ms": min(warm) if warm else None, "finalized": len(finalized)}


def phase_reuse(b: Bench) -> tuple[dict, str]:
    a = b.args
    root = b.root / "reuse"
    iters = a.reuse_interval * a.reuse_saves
    extra = ["--train-iters", str(iters), "--save-interval", str(a.reuse_interval),
             "--eval-interval", str(10 * iters), *ASYNC]
    out: dict[str, Any] = {"runs": {}}
    rows = []
    no_reuse = str(megatron_config(b.args.config, Path(tempfile.mkdtemp(prefix="bench_mlm_")) / "no_reuse.yaml",
                                   reuse_plan=False))
    precheck = precheck_config(Path(no_reuse))
    if precheck:
        logger.warning("reuse: the config loader rejects megatron.reuse_plan here (%s)", precheck)
    out["no_reuse_config_precheck"] = precheck or "accepted"
    for variant, flags, config in (("plan every save (megatron.reuse_plan: false)", [], no_reuse),
                                   ("plan reuse (default)", [], None),
                                   ("--ckpt-assume-constant-structure", ["--ckpt-assume-constant-structure"], None)):
        b.clean(root)
        r = b.run(f"reuse-{variant.split()[0].strip('-')}",
                  b.argv("cpuckpt", "reuse", [*extra, *flags, "--save", str(root / "ckpt")], config))
        s = summarize_reuse(r)
        out["runs"][variant] = {"summary": s, "raw": r}
        rows.append([variant, s["rc"], ", ".join(f"{x['ms']:.0f}" for x in s["saves"]), s["first_ms"],
                     s["warm_mean_ms"], s["warm_min_ms"],
                     ", ".join("-" if x["cpuckpt_stall_s"] is None else f"{x['cpuckpt_stall_s']:.2f}"
                               for x in s["saves"]),
                     ", ".join({None: "-", True: "y", False: "N"}[x["prev_finalized_before_start"]]
                               for x in s["saves"])])
    b.clean(root)
    table = format_table(
        ["variant", "rc", "save-checkpoint ms per save", "first ms", "warm mean ms", "warm min ms",
         "cpuckpt stall s per save", "prev save finalized"],
        rows, right=[False, True, False, True, True, True, False, False],
        title=f"reuse: cpuckpt, {a.reuse_saves} saves every {a.reuse_interval} iterations, model {b.model('reuse')}",
        footnotes=["warm = saves after the first; 'N' in the last column: that save started before the previous "
                   "one was finalized, so its timer may include waiting for it (raise --reuse-interval)"])
    return out, table


# ---------------------------------------------------------------------------------------------- kill


class KillWatcher:
    """SIGKILL the trainer's persistent checkpoint worker right after save ``after_save`` was scheduled."""

    def __init__(self, after_save: int, grace_s: float) -> None:
        self.after_save, self.grace_s = after_save, grace_s
        self.saves = 0
        self.last_iter: int | None = None
        self.info: dict[str, Any] = {"killed": False}

    def __call__(self, t: float, line: str, proc: subprocess.Popen, ctl: dict[str, Any]) -> None:
        if m := ITER_RE.search(line):
            self.last_iter = int(m.group(1))
        if not SAVE_RE.search(line):
            return
        self.saves += 1
        if self.saves != self.after_save or self.info["killed"]:
            return
        worker, seen = find_ckpt_worker(proc.pid)
        self.info.update(seen=seen, kill_t=round(t, 2), iteration=self.last_iter, save_index=self.saves)
        if worker is None:
            self.info["error"] = "no persistent checkpoint worker found below the trainer"
            logger.warning("kill: %s; children seen: %s", self.info["error"], seen)
            return
        try:
            os.kill(worker["pid"], signal.SIGKILL)
        except ProcessLookupError:
            self.info["error"] = f"worker pid {worker['pid']} already gone"
            return
        self.info.update(killed=True, worker=worker)
        ctl["deadline"] = min(ctl["deadline"], t + self.grace_s)
        logger.info("kill: SIGKILL to pid %d (%s) at %.1f s, after iteration %s", worker["pid"],
                    " ".join(worker["cmdline"])[:200], t, self.last_iter)


def megatron_config(base: str, dest: Path, **keys: Any) -> Path:
    """``base`` YAML with ``keys`` merged into its ``megatron:`` block (a ``staging``, ``memory`` or ``io`` mapping
    into the core block of that name), written to ``dest``."""
    import yaml

    data = yaml.safe_load(Path(base).read_text()) or {}
    for section in ("staging", "memory", "io"):
        if section in keys:
            data.setdefault(section, {}).update(keys.pop(section))
    data.setdefault("megatron", {}).update(keys)
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def continue_config(base: str, dest: Path) -> Path:
    """``base`` YAML with ``megatron: {on_failure: continue}`` merged in, written to ``dest``."""
    return megatron_config(base, dest, on_failure="continue")


def precheck_config(path: Path) -> str | None:
    """None when the Megatron adapter's config loader accepts ``path`` (its ``megatron:`` block included),
    else its error. Where the adapter has no loader of its own, cpuckpt's core loader decides."""
    try:
        from cpuckpt.integrations.megatron.settings import split_config as load
    except ImportError:
        try:
            from cpuckpt.config import resolve_config as load  # type: ignore[assignment]
        except ImportError as e:
            return f"cpuckpt not importable here: {e}"
    try:
        load(str(path))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def summarize_kill(variant: str, r: dict[str, Any], w: KillWatcher) -> dict[str, Any]:
    info = w.info
    kill_t = info.get("kill_t")
    kill_it = info.get("iteration") or 0
    s: dict[str, Any] = {"variant": variant, "rc": r["rc"], "killed": info["killed"], "kill_t": kill_t,
                         "kill_iteration": info.get("iteration"), "kill_error": info.get("error"),
                         "worker_cmdline": " ".join(info["worker"]["cmdline"]) if info.get("worker") else None,
                         "worker_pid": info["worker"]["pid"] if info.get("worker") else None,
                         "iterations_reached": max((x["it"] for x in r["iters"]), default=None),
                         "saves_scheduled": len(r["saves"]),
                         "saves_finalized": [x["it"] for x in r["saved"]],
                         "saves_finalized_after_kill": [x["it"] for x in r["saved"] if kill_t and x["t"] > kill_t
                                                        and x["it"] > kill_it],
                         "tracker": r.get("tracker"), "wall_s": r["wall_s"]}
    werr = [e for e in r["worker_errors"] if kill_t is None or e["t"] >= kill_t]
    s["worker_error"] = werr[0]["line"] if werr else None
    s["worker_error_after_s"] = round(werr[0]["t"] - kill_t, 2) if werr and kill_t is not None else None
    s["exit_after_kill_s"] = round(r["wall_s"] - kill_t, 2) if kill_t is not None else None
    if not info["killed"] and r["rc"] not in (0, None) and not r.get("dry_run"):
        first = next((e["line"] for e in r["errors"] if "Error" in e["line"] and "Traceback" not in e["line"]),
                     r["errors"][0]["line"] if r["errors"] else "")
        s["outcome"] = f"failed before the kill (rc {r['rc']}): {first[:160]}"
    elif not info["killed"]:
        s["outcome"] = f"not killed ({info.get('error') or 'save ' + str(w.after_save) + ' never scheduled'})"
    elif r["timed_out"]:
        s["outcome"] = "HANG"
    elif r["rc"] != 0 and werr:
        s["outcome"] = f"error naming the worker, {s['worker_error_after_s']} s after the kill"
    elif r["rc"] != 0:
        s["outcome"] = f"rc {r['rc']} without a worker error in the log"
    else:
        s["outcome"] = "finished rc 0" + (" (worker error logged)" if werr else "")
    s["last_errors"] = [e["line"] for e in r["errors"][-3:]]
    return s


def phase_kill(b: Bench) -> tuple[dict, str]:
    a = b.args
    root = b.root / "kill"
    iters = a.kill_interval * a.kill_saves
    extra = ["--train-iters", str(iters), "--save-interval", str(a.kill_interval),
             "--eval-interval", str(10 * iters), *ASYNC]
    tmp = Path(tempfile.mkdtemp(prefix="bench_mlm_"))
    cont = continue_config(a.config, tmp / "megatron_continue.yaml")
    precheck = precheck_config(cont)
    if precheck:
        logger.warning("kill: the config loader rejects megatron.on_failure here (%s); the run shows what the "
                       "launcher does with it", precheck)
    variants = [("default", a.config), ("continue", str(cont))]
    watchers = {v: KillWatcher(a.kill_after_save, a.kill_grace) for v, _ in variants}
    b.clean(root)

    def one(variant: str, config: str) -> dict[str, Any]:
        save = root / variant
        argv = b.argv("cpuckpt", "kill", [*extra, "--save", str(save)], config=config)
        r = b.run(f"kill-{variant}", argv, on_line=None if a.dry_run else watchers[variant])
        r["tracker"] = _tracker(save)
        return r

    if a.concurrent and not a.dry_run:
        with ThreadPoolExecutor(len(variants)) as ex:
            runs = list(ex.map(lambda v: one(*v), variants))
    else:
        runs = [one(*v) for v in variants]
    if a.dry_run:
        print(f"# kill: SIGKILL the trainer's spawned checkpoint worker after save {a.kill_after_save} is scheduled")
    b.clean(root)
    shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {"continue_config_precheck": precheck or "accepted", "runs": {}}
    rows = []
    for (variant, _), r in zip(variants, runs):
        s = summarize_kill(variant, r, watchers[variant])
        out["runs"][variant] = {"summary": s, "watcher": watchers[variant].info, "raw": r}
        rows.append([variant, s["outcome"], s["kill_iteration"], s["worker_pid"], s["exit_after_kill_s"], s["rc"],
                     s["iterations_reached"], s["saves_scheduled"], s["saves_finalized"],
                     s["saves_finalized_after_kill"],
                     (s["worker_error"] or "")[:90] or None])
    table = format_table(
        ["variant", "outcome", "killed after iter", "worker pid", "exit s after kill", "rc", "iters reached",
         "saves scheduled", "saves finalized (iter)", "finalized after kill", "worker error line"],
        rows, title=f"kill: cpuckpt, persistent worker SIGKILLed after save {a.kill_after_save} of {a.kill_saves} "
                    f"(every {a.kill_interval} iterations), grace {a.kill_grace:.0f} s, model {b.model('kill')}",
        footnotes=[f"continue variant's YAML (megatron.on_failure: continue), cpuckpt config loader here: "
                   f"{precheck or 'accepted'}",
                   *[f"{v} worker: {out['runs'][v]['summary']['worker_cmdline']}" for v, _ in variants]])
    return out, table


# -------------------------------------------------------------------------------------------- memory


class JobKiller:
    """SIGKILL the whole job (torchrun and its trainers) once iteration ``at``'s save is finalized, or (``logged``)
    as soon as iteration ``at``'s log line arrives."""

    def __init__(self, at: int, logged: bool = False) -> None:
        self.at, self.pattern = at, ITER_RE if logged else SAVED_RE
        self.info: dict[str, Any] = {"killed": False, "after": "logged" if logged else "finalized"}

    def __call__(self, t: float, line: str, proc: subprocess.Popen, ctl: dict[str, Any]) -> None:
        m = self.pattern.search(line)
        if m and int(m.group(1)) == self.at and not self.info["killed"]:
            # torchrun starts its trainers in sessions of their own: kill every process below it, but the
            # memory tier's writers (they must survive their trainers), then torchrun's group
            victims = [c for c in _descendants(proc.pid)
                       if not any("cpuckpt.tier.persister" in a for a in c["cmdline"])]
            for c in victims:
                try:
                    os.kill(c["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _kill_group(proc)
            self.info.update(killed=True, kill_t=round(t, 2), pids=[c["pid"] for c in victims])
            logger.info("memory: SIGKILL at %.1f s (iteration %d %s) to %d processes", t, self.at,
                        self.info["after"], len(victims))


def run_log(out: Path, name: str) -> Path:
    """The log of run ``name``."""
    return out / f"mlm_{file_safe(name)}.log"


def lost_work(killed: dict[str, Any], relaunch: dict[str, Any], kill: dict[str, Any]) -> dict[str, Any]:
    """What the kill cost: the last iteration the killed job logged, the iteration the relaunch loaded, the
    iterations lost between them, and whether the relaunch logged the same values (loss, grad norm) as the killed
    job for every iteration both logged (a bit-identical continuation prints the same)."""
    if not kill.get("killed"):  # the kill never fired: nothing was lost, nothing measured
        return {"killed_after": kill.get("after"), "killed": False}
    last = max((i["it"] for i in killed.get("iters") or []), default=None)
    loaded = None
    for line in relaunch.get("loaded") or []:
        if m := LOADED_RE.search(line):
            loaded = int(m.group(2))
    return {"killed_after": kill.get("after"), "last_logged": last, "resumed_from": loaded,
            "iterations_lost": None if last is None or loaded is None else last - loaded,
            **same_values(killed, relaunch)}  # values_equal None: resumed exactly at the last logged one


def same_values(reference: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Whether ``run`` logged the same values (loss, grad norm) as ``reference`` at every iteration both logged.

    Two exceptions, listed as ``logged_mean_at``: Megatron-LM does not reset its loss sums after a line printed at a
    resumed run's first iteration, so its next line's loss is the mean over that first iteration and the interval
    after it (interval 1: the mean of the first two). That line still counts as equal when its grad norm is the
    reference's and its loss is that mean of the run's first line and the reference's line (to the 7 printed digits).
    And with a log interval above one, the loss of a resumed run's first line is the mean over the iterations since
    the resume, not over the interval: that line counts as equal when its grad norm (the iteration's own) is the
    reference's, and the lines after it are compared whole (unless the first exception applies)."""
    ref = {i["it"]: i["values"] for i in reference.get("iters") or []}
    got = {i["it"]: i["values"] for i in run.get("iters") or []}
    both = sorted(ref.keys() & got.keys())
    first, second = (sorted(got) + [None, None])[:2]
    spaced = len(ref) > 1 and min(b - a for a, b in itertools.pairwise(sorted(ref))) > 1  # a log interval above 1
    mean_at = [it for it in both if ref[it] != got[it]
               and ((it == second and _logged_mean(ref, got, it, first))
                    or (spaced and it == first and _same_grad(ref, got, it)))]
    differ = [it for it in both if ref[it] != got[it] and it not in mean_at]
    return {"compared": len(both), "values_differ_at": differ[:10], "logged_mean_at": mean_at,
            "values_equal": None if not both else not differ}


def _logged_mean(ref: dict[int, str], got: dict[int, str], it: int, first: int | None) -> bool:
    """``got``'s line at ``it`` (its second): the reference's grad norm, and its loss the mean of ``got``'s first line
    (one iteration, ``first``) and the reference's ``it - first`` iterations logged at ``it``."""
    if first is None or first >= it:
        return False
    a, b, g = _parse_values(got[first]), _parse_values(ref[it]), _parse_values(got[it])
    if a is None or b is None or g is None or "lm loss" not in g or "lm loss" not in a \
            or g.get("grad norm") != b.get("grad norm") or set(g) != set(b):
        return False
    n = it - first
    mean = (a["lm loss"] + n * b["lm loss"]) / (n + 1)
    return abs(g["lm loss"] - mean) <= 1e-6 * max(1.0, abs(mean))


def _same_grad(ref: dict[int, str], got: dict[int, str], it: int) -> bool:
    """``got``'s line at ``it`` has the reference's grad norm and keys (its loss a mean over other iterations)."""
    a, b = _parse_values(ref[it]), _parse_values(got[it])
    return a is not None and b is not None and "grad norm" in a and set(a) == set(b) \
        and a["grad norm"] == b["grad norm"]


def _parse_values(values: str) -> dict[str, float] | None:
    try:
        return {k: float(v) for k, v in (part.split(": ") for part in values.split(" | ") if ": " in part)}
    except ValueError:
        return None


def memory_tier_config(base: str, dest: Path, ram: Path, slots: int, max_uncommitted: int = 0) -> Path:
    """``base`` YAML with ``megatron: {memory_tier: true}`` and a ``memory:`` section, written to ``dest``."""
    import yaml

    data = yaml.safe_load(Path(base).read_text()) or {}
    data.setdefault("megatron", {})["memory_tier"] = True
    data.setdefault("memory", {}).update(root=str(ram), slots=slots)
    if max_uncommitted:
        data["memory"]["max_uncommitted"] = max_uncommitted
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def summarize_memory(r: dict[str, Any], interval: int) -> dict[str, Any]:
    """Save timers, and iteration times alone vs while a persistent save's write runs."""
    saved_t = {x["it"]: x["t"] for x in r["saved"]}
    windows = []  # (start, end) of each persistent save: the timer line to its "successfully saved" line
    for sv in r["saves"]:
        its = [x["it"] for x in r["iters"] if x["t"] <= sv["t"]]
        it = max(its, default=0)
        if it in saved_t:
            windows.append((sv["t"], saved_t[it]))
    def after_save(x: dict[str, Any]) -> bool:  # carries that save's own device-to-host copy (zero-stall)
        return (x["it"] - 1) % interval == 0

    in_window = [x for x in r["iters"] if any(a < x["t"] <= b for a, b in windows)]
    during_all = [x["ms"] for x in in_window]
    during = [x["ms"] for x in in_window if not after_save(x)]  # the same iterations as alone's, persist or not
    alone = [x["ms"] for x in r["iters"] if x["it"] > 5 and not any(a < x["t"] <= b for a, b in windows)
             and not after_save(x)]
    med = _median
    return {"run": r["name"], "rc": r["rc"], "save_ms": [round(x["ms"]) for x in r["saves"]],
            "np_save_ms": [round(x["ms"]) for x in r["np_saves"]],
            "np_save_warm_median_ms": med([x["ms"] for x in r["np_saves"][1:]]),
            "iter_ms_alone": med(alone), "iter_ms_during_persist": med(during), "n_during": len(during),
            "during_over_alone": round(med(during) / med(alone), 3) if during and alone else None,
            "iter_ms_during_persist_with_saves": med(during_all),  # iterations right after a save included
            "during_with_saves_over_alone": round(med(during_all) / med(alone), 3) if during_all and alone else None,
            "persist_windows_s": [round(b - a, 2) for a, b in windows], "saved_iters": sorted(saved_t),
            "wall_s": r.get("wall_s")}


def phase_memory(b: Bench) -> tuple[dict, str]:
    """Memory saves every --memory-interval iterations, durable every --memory-durable, with and without the
    memory tier; the tier's run is SIGKILLed (whole job) once --memory-kill-at's save is finalized (or, with
    --memory-kill-after-log N, at iteration N's log line: the lost work) and relaunched from memory."""
    a = b.args
    root = b.root / "memory"
    ram = Path(a.memory_ram)
    b.clean(root)
    shutil.rmtree(ram, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_mlm_"))
    cfg_on = memory_tier_config(a.config, tmp / "memory_on.yaml", ram, a.memory_slots, a.memory_max_uncommitted)
    extra = ["--save-interval", str(a.memory_durable), "--non-persistent-save-interval", str(a.memory_interval),
             "--non-persistent-ckpt-type", "global", "--eval-interval", str(10 * a.memory_iters), *ASYNC,
             "--log-interval", str(a.memory_log_interval)]
    train = ["--train-iters", str(a.memory_iters), *extra]
    out: dict[str, Any] = {}
    fmt = a.memory_format
    # the reference run: the same saves without the tier, or (--memory-off-plain) no checkpoints at all
    off_train = ["--train-iters", str(a.memory_iters), "--eval-interval", str(10 * a.memory_iters),
                 "--log-interval", str(a.memory_log_interval)] \
        if a.memory_off_plain else [*train, "--save", str(root / "off")]  # (--save needs --save-interval)
    off = b.run("memory-off", b.argv(fmt, "memory", off_train))
    b.clean(root / "off")
    killer = JobKiller(a.memory_kill_after_log or a.memory_kill_at, logged=bool(a.memory_kill_after_log))
    on = b.run("memory-on", b.argv(fmt, "memory", [*train, "--save", str(root / "on")], config=str(cfg_on)),
               on_line=None if a.dry_run else killer)
    np_dir = root / "on" / "non_persistent"
    out["after_kill"] = {"killed": killer.info, "save_tracker": _tracker(root / "on"), "np_tracker": _tracker(np_dir),
                         "links": {p.name: os.path.realpath(p) for p in np_dir.glob("iter_*") if p.is_symlink()}
                         if np_dir.is_dir() else {}}
    newest = np_dir / f"iter_{int(out['after_kill']['np_tracker'] or 0):07d}"
    if not a.dry_run and newest.exists():  # every byte as the save wrote it (its crc32c), before the relaunch
        v = subprocess.run([sys.executable, "-m", "cpuckpt", "verify", str(newest)], capture_output=True, text=True,
                           env=b.env, timeout=300)
        out["verify"] = {"rc": v.returncode, "out": (v.stdout + v.stderr)[-600:]}
    b.drop_caches()  # the relaunch reads the RAM root; the durable files are not in the page cache
    relaunch = b.run("memory-relaunch", b.argv(fmt, "memory", [
        "--train-iters", str(a.memory_iters), *extra, "--save", str(root / "on"), "--load", str(root / "on"),
        "--exit-on-missing-checkpoint"], config=str(cfg_on)))
    out["after_relaunch"] = {"ram_root_left": sorted(str(p) for p in ram.rglob("*"))[:10] if ram.exists() else [],
                             "save_tracker": _tracker(root / "on")}
    out["lost"] = lost_work(on, relaunch, killer.info)
    out["lost"]["against_uninterrupted"] = same_values(off, relaunch)
    b.clean(root)
    shutil.rmtree(ram, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for r in (off, on):
        s = summarize_memory(r, a.memory_interval)
        out[r["name"]] = {"summary": s, "raw": r}
        rows.append([s["run"], s["rc"], s["np_save_ms"], s["np_save_warm_median_ms"], s["save_ms"],
                     s["iter_ms_alone"], s["iter_ms_during_persist"], s["during_over_alone"],
                     f'{s["iter_ms_during_persist_with_saves"]} / {s["during_with_saves_over_alone"]}',
                     s["persist_windows_s"]])
    ml = relaunch.get("mload") or []
    out["memory-relaunch"] = {"raw": relaunch, "loaded": relaunch.get("loaded"),
                              "load_checkpoint_s": relaunch["load_ms"] / 1000 if relaunch.get("load_ms") else None,
                              "cpuckpt_load_s": round(sum(x["load_s"] for x in ml), 3) if ml else None,
                              "nbytes": sum(x["nbytes"] for x in ml) if ml else None}
    rl = out["memory-relaunch"]
    table = format_table(
        ["run", "rc", "save-checkpoint-non-persistent ms", "warm median", "save-checkpoint ms", "iter ms alone",
         "iter ms during persist", "ratio", "with post-save iterations: ms / ratio", "persist windows s"], rows,
        title=f"memory ({fmt}): saves every {a.memory_interval} iterations, durable every {a.memory_durable}, "
              f"model {b.model('memory')}, memory-on SIGKILLed "
              + (f"at iteration {a.memory_kill_after_log}'s log line" if a.memory_kill_after_log else
                 f"once iteration {a.memory_kill_at}'s save was finalized"),
        footnotes=["iter ms: medians; alone and during persist both leave out the iteration right after each save "
                   "(it carries that save's own copy, zero-stall); the column after the ratio keeps them in",
                   f"after the kill: {out['after_kill']}", f"verify of the newest memory checkpoint: "
                   f"{out.get('verify')}",
                   f"lost work: {out['lost']}",
                   f"relaunch: rc {relaunch['rc']}, load-checkpoint {rl['load_checkpoint_s']} s, cpuckpt's share "
                   f"{rl['cpuckpt_load_s']} s for {rl['nbytes']} bytes; {rl['loaded']}",
                   f"after the relaunch's normal exit: {out['after_relaunch']}"])
    return out, table


def megatron_versions(b: Bench) -> dict[str, Any]:
    """Where the runs find megatron.core, megatron.training and cpuckpt (the checkout is first on PYTHONPATH,
    and ``megatron`` is a namespace package, so its ``megatron.core`` may win over the wheel's); no imports."""
    code = ("import importlib.util as u, json\n"
            "f = lambda n: getattr(u.find_spec(n), 'origin', None)\n"
            "print(json.dumps({n: f(n) for n in ('megatron.core', 'megatron.training', 'cpuckpt', "
            "'nvidia_resiliency_ext')}))")
    try:
        p = subprocess.run([sys.executable, "-c", code], env=b.env, capture_output=True, text=True, timeout=60)
        found: dict[str, Any] = json.loads(p.stdout)
    except (subprocess.TimeoutExpired, ValueError) as e:
        return {"error": repr(e)}
    core = found.get("megatron.core")
    if core:
        info = Path(core).parent / "package_info.py"
        text = info.read_text() if info.exists() else ""
        parts = [re.search(rf"^{k} = (\S+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")]
        found["megatron.core version"] = ".".join(v for v in (m.group(1).strip("'\"") for m in parts if m) if v)
    return found


# ----------------------------------------------------------------------------------------- self test


def self_test(config: str) -> int:
    """Check the parsers against lines built from Megatron-LM's and cpuckpt's own format strings, and the
    floor reader on a few odd-sized files. Runs on CPU."""

    def timer(name: str, lo: float, hi: float, max_only: bool = False) -> list[str]:
        if max_only:
            return ["max time across ranks (ms):", "    {}: {:.2f}".format((name + " ").ljust(48, "."), hi)]
        return ["(min, max) time across ranks (ms):",
                "    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), lo, hi)]

    prefix = "2026-12-01 10:00:00,123 megatron.core.timers INFO "
    lines = [
        " [2026-12-01 10:00:00.000000] iteration        4/       5 | consumed samples:           16 | "
        "elapsed time per iteration (ms): 71.3 | throughput per GPU (TFLOP/s/GPU): 123.4 | lm loss: 1.041234E+01 | "
        "loss scale: 1.0 | grad norm: 12.345 |",
        prefix + timer("save-checkpoint", 400.5, 410.25)[0], timer("save-checkpoint", 400.5, 410.25)[1],
        *timer("save-checkpoint", 0, 399.0, max_only=True),
        prefix + timer("load-checkpoint", 1234.5, 1240.25)[0], timer("load-checkpoint", 1234.5, 1240.25)[1],
        *timer("save-checkpoint-non-persistent", 1.0, 2.0),
        "  [2026-12-01 10:00:01.000000] successfully saved checkpoint from iteration       4 to /root/x/cpuckpt "
        "[ t 1/1, gtp_remat 1/1, p 1/1 ]",
        "  successfully loaded checkpoint from /root/x/cpuckpt [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 4",
        "2026-12-01 10:00:02,000 cpuckpt.integrations.megatron.strategy INFO cpuckpt megatron load "
        "/root/x/cpuckpt/iter_0000004: translate 0.120 s, cpuckpt.load 2.345 s, unwrap 0.010 s, 5098765432 bytes",
        "cpuckpt.integrations.megatron.guard.WorkerDiedError: rank 0's (pid 123 exit code -9) persistent checkpoint "
        "worker died with 1 async save(s) pending; those checkpoints are incomplete",
        "RuntimeError: something else",
    ]
    # cpuckpt's telemetry lines, from cpuckpt's own emitter when it is importable here
    try:
        from cpuckpt.backend import telemetry
        from cpuckpt.config import resolve_config

        records: list[str] = []

        class Grab(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        tlog = logging.getLogger("cpuckpt.telemetry")
        h = Grab()
        tlog.addHandler(h)
        level, propagate = tlog.level, tlog.propagate
        tlog.setLevel(logging.INFO)
        tlog.propagate = False
        try:
            cfg = resolve_config(None)
            telemetry.record_load(cfg, path="/root/x/cpuckpt/iter_0000004", seconds=2.3, nbytes=5098765432,
                                  files=3, metadata_s=0.05, read_s=2.1, read_io_s=1.9, read_copy_s=0.125)
            telemetry.record_save(cfg, path="/root/x/cpuckpt/iter_0000008", stall_s=0.4, persist_s=2.7,
                                  nbytes=5098765432, mode="snapshot", files=1, event="async_save")
        finally:
            tlog.removeHandler(h)
            tlog.setLevel(level)
            tlog.propagate = propagate
        lines += records
        real_telemetry = True
    except ImportError:
        lines += ["cpuckpt load /root/x/cpuckpt/iter_0000004 rank 0: stall 2.300 s, persist 2.300 s (metadata 0.050 s, "
                  "planning 0.150 s, reads 2.100 s), 5098765432 bytes, 2.22 GB/s, mode -, 3 file(s), pool 0 bytes",
                  "cpuckpt async_save /root/x/cpuckpt/iter_0000008 rank 0: stall 0.400 s, persist 2.700 s, "
                  "5098765432 bytes, 1.89 GB/s, mode snapshot, 1 file(s), pool 5100000000 bytes pinned"]
        real_telemetry = False
    p = parse_log([(float(i), line) for i, line in enumerate(lines)])
    checks = [
        (p["iters"] == [{"t": 0.0, "it": 4, "ms": 71.3, "values": "lm loss: 1.041234E+01 | grad norm: 12.345"}],
         "iteration line"),
        (lost_work({"iters": [{"it": k, "values": f"v{k}"} for k in (4, 5, 6)]},
                   {"iters": [{"it": k, "values": f"v{k}"} for k in (6, 7)], "loaded": p["loaded"]},
                   {"after": "logged", "killed": True}) == {"killed_after": "logged", "last_logged": 6,
                                                             "resumed_from": 4,
                                            "iterations_lost": 2, "compared": 1, "values_differ_at": [],
                                            "logged_mean_at": [], "values_equal": True},
         "lost work from two runs' logs"),
        (same_values({"iters": [{"it": 80, "values": "lm loss: 3.518200E+00 | grad norm: 24.569"},
                                {"it": 81, "values": "lm loss: 2.492671E+00 | grad norm: 23.918"},
                                {"it": 82, "values": "lm loss: 5.622334E+00 | grad norm: 23.623"}]},
                     {"iters": [{"it": 80, "values": "lm loss: 3.518200E+00 | grad norm: 24.569"},
                                {"it": 81, "values": "lm loss: 3.005435E+00 | grad norm: 23.918"},
                                {"it": 82, "values": "lm loss: 5.622335E+00 | grad norm: 23.623"}]})
         == {"compared": 3, "values_differ_at": [82], "logged_mean_at": [81], "values_equal": False},
         "a resumed run's logged mean loss is not a difference; any other digit is"),
        (same_values({"iters": [{"it": k, "values": f"lm loss: {v} | grad norm: {g}"}
                                for k, v, g in ((20, 9.1, 7.0), (30, 8.950678, 6.979), (40, 8.529778, 12.444))]},
                     {"iters": [{"it": k, "values": f"lm loss: {v} | grad norm: {g}"}
                                for k, v, g in ((30, 8.656391, 6.979), (40, 8.529778, 12.444))]})
         == {"compared": 2, "values_differ_at": [], "logged_mean_at": [30], "values_equal": True}
         and same_values({"iters": [{"it": 30, "values": "lm loss: 8.9 | grad norm: 6.979"},
                                    {"it": 40, "values": "lm loss: 8.5 | grad norm: 12.4"}]},
                         {"iters": [{"it": 30, "values": "lm loss: 8.6 | grad norm: 6.978"},
                                    {"it": 40, "values": "lm loss: 8.5 | grad norm: 12.4"}]}
                         )["values_differ_at"] == [30],
         "log interval 10: a resumed run's first line averages fewer iterations; its grad norm must still be equal"),
        (same_values({"iters": [{"it": k, "values": f"lm loss: {v} | grad norm: {g}"}
                                for k, v, g in ((20, 9.534409, 1.894), (30, 8.950678, 6.979), (40, 8.529778, 12.444))]},
                     {"iters": [{"it": k, "values": f"lm loss: {v} | grad norm: {g}"}
                                for k, v, g in ((30, 8.535886, 6.979), (40, 8.530334, 12.444))]})
         == {"compared": 2, "values_differ_at": [], "logged_mean_at": [30, 40], "values_equal": True}
         and same_values({"iters": [{"it": 30, "values": "lm loss: 8.950678 | grad norm: 6.979"},
                                    {"it": 40, "values": "lm loss: 8.529778 | grad norm: 12.444"}]},
                         {"iters": [{"it": 30, "values": "lm loss: 8.535886 | grad norm: 6.979"},
                                    {"it": 40, "values": "lm loss: 8.530434 | grad norm: 12.444"}]}
                         )["values_differ_at"] == [40],
         "log interval 10, resumed at 29: the line at 30 is the first iteration's, not reset: 40 averages 30-40"),
        ([s["ms"] for s in p["saves"]] == [410.25, 399.0], "save-checkpoint timer (minmax, max), not -non-persistent"),
        (p["saves"][0]["start_t"] == round(2.0 - 0.41025, 2), "save start time"),
        (p["load_ms"] == 1240.25, "load-checkpoint timer"),
        (p["saved"] == [{"t": 9.0, "it": 4, "dir": "/root/x/cpuckpt"}], "successfully saved"),
        (len(p["loaded"]) == 1, "successfully loaded"),
        (p["mload"] == [{"path": "/root/x/cpuckpt/iter_0000004", "translate_s": 0.12, "load_s": 2.345,
                         "unwrap_s": 0.01, "nbytes": 5098765432}], "cpuckpt megatron load line"),
        (len(p["worker_errors"]) == 1 and "WorkerDiedError" in p["worker_errors"][0]["line"], "worker error"),
        (len(p["errors"]) == 1 and "RuntimeError" in p["errors"][0]["line"], "other errors"),
        (len(p["telemetry"]) == 2, f"telemetry lines ({'cpuckpt emitter' if real_telemetry else 'literal'})"),
    ]
    if len(p["telemetry"]) == 2:
        ld, sv = p["telemetry"]
        checks += [
            (ld["event"] == "load" and ld["metadata_s"] == 0.05 and ld["read_s"] == 2.1 and ld["plan_s"] == 0.15
             and ld["nbytes"] == 5098765432 and ld["files"] == 3, "telemetry load split"),
            (not real_telemetry or (ld.get("read_io_s") == 1.9 and ld.get("read_copy_s") == 0.125),
             "telemetry read split (parallel reads, copies into targets)"),
            (sv["event"] == "async_save" and sv["stall_s"] == 0.4 and sv["persist_s"] == 2.7 and "read_s" not in sv,
             "telemetry save"),
        ]
    r = summarize_reuse({"name": "x", "rc": 0, "saves": [{"t": 10, "ms": 3000, "start_t": 7},
                                                          {"t": 20, "ms": 400, "start_t": 19.6},
                                                          {"t": 22, "ms": 2500, "start_t": 19.5}],
                         "saved": [{"t": 12, "it": 10}, {"t": 24, "it": 20}], "telemetry": []})
    checks.append(([x["prev_finalized_before_start"] for x in r["saves"]] == [None, True, False]
                   and r["warm_mean_ms"] == 1450.0, "reuse summary"))
    # the floor reader: odd sizes, a tail shorter than a page, an empty file; buffered and O_DIRECT
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP") or None) as d:
        sizes = [0, 1000, 4096, 33 * MiB + 123, 5 * MiB]
        files = []
        for i, n in enumerate(sizes):
            f = Path(d) / f"f{i}"
            f.write_bytes(os.urandom(n))
            files.append(f)
        for direct in (False, True):
            for threads in (1, 3):
                res = read_tree_floor(files, threads, direct, chunk_bytes=4 * MiB)
                ok = res.nbytes == sum(sizes) and (res.supported or direct)
                how = f"{res.wall_s:.3f} s" if res.supported else f"unsupported: {res.error}"
                checks.append((ok, f"floor {'O_DIRECT' if direct else 'buffered'} {threads} threads ({how})"))
    # process discovery on this process: a spawned child must be found as the "worker"
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    child = ctx.Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    try:
        kids = _children(os.getpid())
        spawned = [k for k in kids if any("spawn_main" in x or "--multiprocessing-fork" in x for x in k["cmdline"])]
        checks.append((any(k["pid"] == child.pid for k in spawned), "spawned child found by command line"))
    finally:
        child.kill()
        child.join()
    with tempfile.TemporaryDirectory() as d:
        cfg = continue_config(config, Path(d) / "c.yaml")
        import yaml

        data = yaml.safe_load(cfg.read_text())
        checks.append((data["megatron"]["on_failure"] == "continue" and data["io"]["threads"] == 8,
                       "continue config merged"))
        checks.append((True, f"config loader on the continue YAML here: {precheck_config(cfg) or 'accepted'}"))
    bad = 0
    for ok, what in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        bad += not ok
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------- main


def _threads(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


# ------------------------------------------------------------------------------------------ fallback


def flip_byte(path: Path) -> int:
    """Flip one byte in the middle of ``path`` (a data file): damage after the commit. Returns the offset."""
    offset = path.stat().st_size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return offset


def phase_fallback(b: Bench) -> tuple[dict, str]:
    """Restart past damage: save at iterations K and 2K, flip a byte in the newest one's data, relaunch.

    Megatron-LM's tracker names 2K; with ``megatron: {fallback_on_corrupt: true}`` (the default) the
    relaunch must log the damaged checkpoint, load K and train on; with ``false`` it must fail.
    """
    a = b.args
    k = 4
    root = b.root / "fallback"
    save = root / "ckpt"
    b.clean(root)
    saved = b.run("fallback-save", b.argv("cpuckpt", "fallback", ["--train-iters", str(2 * k), "--save-interval",
                                                                  str(k), "--eval-interval", str(100 * k),
                                                                  "--save", str(save), *ASYNC]))
    damaged = None
    if not a.dry_run:
        files = sorted((_ckpt_dir(save, 2 * k)).glob("__0_*.distcp"), key=lambda f: f.stat().st_size)
        if files:
            damaged = {"file": str(files[-1]), "offset": flip_byte(files[-1])}
    tmp = Path(tempfile.mkdtemp(prefix="bench_mlm_"))
    strict = megatron_config(a.config, tmp / "strict.yaml", fallback_on_corrupt=False)
    resume = ["--train-iters", str(2 * k + 2), "--eval-interval", str(100 * k), "--load", str(save), *RESUME]
    runs = {name: b.run(name, b.argv("cpuckpt", "fallback", resume, config=config))
            for name, config in (("fallback-resume", None), ("fallback-strict", str(strict)))}
    b.clean(root)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    out: dict[str, Any] = {"save": saved, "damaged": damaged, "runs": runs}
    for name, r in runs.items():
        log_path = run_log(b.out, name)
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        warned = "falling back to the next newest checkpoint" in log
        corrupt = "CheckpointCorrupt" in log
        last = max((i["it"] for i in r["iters"]), default=None)
        rows.append([name, r["rc"], (r["loaded"] or ["-"])[-1][-80:], warned, corrupt, last])
    table = format_table(["run", "rc", "loaded (Megatron-LM's line)", "fallback logged", "CheckpointCorrupt in log",
                          "last iteration"], rows,
                         title=f"fallback: saves at {k} and {2 * k}, a byte flipped in iter_{2 * k:07d}'s data "
                               f"({damaged}), relaunched; model {b.model('fallback')}")
    return out, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="load,reuse,kill", help=f"comma-separated, run in this order: {PHASES}")
    ap.add_argument("--megatron-lm", default=".megatron-lm")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--root", default="/root/cpuckpt-bench-mlm", help="checkpoint directories go here")
    ap.add_argument("--config", default="configs/megatron.yaml")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run, drop and delete nothing")
    ap.add_argument("--self-test", action="store_true", help="check the log parsers and the floor reader; no GPU")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole benchmark (0: none): run timeouts shrink to fit, a phase that "
                         f"cannot start with its rough minimum left is skipped ({PHASE_MIN_S})")
    ap.add_argument("--timeout", type=float, default=280.0, help="per run, seconds")
    ap.add_argument("--concurrent", action=argparse.BooleanOptionalAction, default=True,
                    help="run the load phase's two save runs, and the kill phase's two variants, at the same time")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint directories")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help=f"default: save {SAVE_MODEL[0]}, others {PHASE_MODEL[0]}")
    ap.add_argument("--hidden", type=int, default=None, help=f"default: save {SAVE_MODEL[1]}, others {PHASE_MODEL[1]}")
    ap.add_argument("--heads", type=int, default=None, help=f"default: {PHASE_MODEL[2]}")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4)
    g = ap.add_argument_group("save phase")
    g.add_argument("--formats", default="torch_dist,cpuckpt")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="resume the cpuckpt checkpoint with stock --ckpt-format torch_dist")
    g.add_argument("--iters", type=int, default=150)
    g.add_argument("--save-interval", type=int, default=50,
                   help="long enough for a save to persist before the next one (both formats wait otherwise)")
    g = ap.add_argument_group("load phase")
    g.add_argument("--load-iters", type=int, default=4, help="iterations before the one save (then resume +1)")
    g.add_argument("--floor-threads", type=_threads, default=[1, 4, 8, 16], help="thread counts of the raw reads")
    g.add_argument("--load-threads", type=_threads, default=[8],
                   help="cpuckpt loads again with these io.read_threads (CPUCKPT_IO_READ_THREADS); empty for none")
    g = ap.add_argument_group("reuse phase")
    g.add_argument("--reuse-interval", type=int, default=80,
                   help="iterations between saves: long enough for the previous save to be finalized")
    g.add_argument("--reuse-saves", type=int, default=4)
    g = ap.add_argument_group("kill phase")
    g.add_argument("--kill-interval", type=int, default=10)
    g.add_argument("--kill-saves", type=int, default=4)
    g.add_argument("--kill-after-save", type=int, default=2, help="SIGKILL the worker once this save is scheduled")
    g.add_argument("--kill-grace", type=float, default=100.0,
                   help="seconds after the kill before a still-running trainer is reported as HANG and killed "
                        "(above the adapter's megatron.heartbeat_timeout_s, 60 s in configs/megatron.yaml)")
    g = ap.add_argument_group("memory phase")
    g.add_argument("--memory-iters", type=int, default=100)
    g.add_argument("--memory-interval", type=int, default=8, help="--non-persistent-save-interval")
    g.add_argument("--memory-durable", type=int, default=64, help="--save-interval")
    g.add_argument("--memory-kill-at", type=int, default=88, help="SIGKILL the job once this save is finalized")
    g.add_argument("--memory-kill-after-log", type=int, default=0,
                   help="instead: SIGKILL the job as soon as this iteration's log line arrives (lost work)")
    g.add_argument("--memory-max-uncommitted", type=int, default=0,
                   help="memory.max_uncommitted of the tier's run (1: at most one iteration lost)")
    g.add_argument("--memory-slots", type=int, default=3)
    g.add_argument("--memory-log-interval", type=int, default=1,
                   help="Megatron-LM's --log-interval of the three runs (a job's: 10 or 100)")
    g.add_argument("--memory-off-plain", action="store_true",
                   help="the reference run saves nothing (its values are the uninterrupted run's)")
    g.add_argument("--memory-format", default="cpuckpt", choices=["cpuckpt", *VARIANTS],
                   help="cpuckpt or a variant (e.g. cpuckpt-zero: ordering optimizer) for all three runs")
    g.add_argument("--memory-ram", default="/dev/shm/cpuckpt-bench-mlm-ram", help="the memory tier's RAM root")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.self_test:
        return self_test(args.config)
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {PHASES}")
    b = Bench(args)
    if not args.dry_run:
        if not (b.mlm / "pretrain_gpt.py").is_file():
            ap.error(f"{b.mlm}/pretrain_gpt.py not found: --megatron-lm must point at a Megatron-LM checkout")
        b.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    b.clean(b.root)
    if not args.dry_run:
        b.results["megatron"] = megatron_versions(b)
        logger.info("the runs import: %s", b.results["megatron"])
    fns = {"save": phase_save, "load": phase_load, "reuse": phase_reuse, "kill": phase_kill, "memory": phase_memory,
           "fallback": phase_fallback}
    tables: list[str] = []
    failed = False
    try:
        for phase in phases:
            if b.left() < PHASE_MIN_S[phase]:
                logger.warning("== phase %s skipped: %.0f s of the budget left, it needs ~%d s", phase, b.left(),
                               PHASE_MIN_S[phase])
                b.results["phases"][phase] = {"skipped": f"budget ({b.left():.0f} s left)"}
                b.results["timing_s"][phase] = "skipped"
                continue
            t0 = time.perf_counter()
            logger.info("==== phase %s (%.0f s into the benchmark)", phase, b.elapsed())
            try:
                res, table = fns[phase](b)
            except Exception as e:  # keep the other phases and what was measured
                logger.exception("phase %s failed", phase)
                res, table, failed = {"error": repr(e)}, f"{phase}: failed: {e!r}", True
            b.results["phases"][phase] = res
            b.results["timing_s"][phase] = round(time.perf_counter() - t0, 1)
            logger.info("==== phase %s: %.1f s", phase, time.perf_counter() - t0)
            tables.append(table)
            b.save_json()
    finally:  # also on SIGTERM (an outer timeout): what was measured is printed and kept
        for proc in list(_ACTIVE):
            _kill_group(proc)
        b.clean(b.root)
        b.results["timing_s"]["total"] = round(b.elapsed(), 1)
        b.save_json()
        for table in tables:
            print()
            print(table)
        print()
        print("phase wall s: " + ", ".join(f"{k} {v}" for k, v in b.results["timing_s"].items()), flush=True)
    return 1 if failed else 0  # a run's own rc is in its table (the kill phase expects failures)


if __name__ == "__main__":
    sys.exit(main())
