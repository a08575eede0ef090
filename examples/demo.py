"""cpuckpt demo: train, checkpoint asynchronously, get SIGKILLed mid-save, resume, verify, compare with DCP.

What it does (every step in real processes, on real files):

1. **reference run** (child process): trains a small residual MLP with AdamW on synthetic data for
   ``--steps`` steps without checkpointing. Data, dropout and initialisation are deterministic, so
   any run of the same steps gives bit-identical results.
2. **crashed run** (child process): the same training, with ``cpuckpt.async_save`` of model +
   optimizer (``get_state_dict``) + step, RNG state and loss history every ``--save-every`` steps
   into ``<workdir>/step_<n>``. The training thread waits for ``handle.staged`` only before the next
   ``optimizer.step()``, so staging overlaps the next forward/backward. The parent SIGKILLs the child
   right after the third save has been scheduled (two saves are committed by then; the third is
   being written).
3. **resumed run** (child process): looks for the newest *complete* checkpoint (only directories with
   ``.metadata``; the torn one is skipped), loads it with ``cpuckpt.load`` + ``set_state_dict`` and
   trains to the end, checkpointing as before.
4. **check**: the resumed run's loss history, final parameters and optimizer state must equal the
   reference run's bit for bit, and the final checkpoint must load back bit-exact: prints PASS or
   FAIL (exit code 1).
5. **comparison** (this process): on the same state dict (the final checkpoint), stall and persist
   time of ``cpuckpt.async_save`` beside ``dcp.save`` (FileSystemWriter) and ``dcp.async_save``
   (DefaultStager).

Usage:
    .venv/bin/python examples/demo.py                 # ~1 minute on a 2-core CPU box
    .venv/bin/python examples/demo.py --quick         # seconds (CI)
    .venv/bin/python examples/demo.py --workdir /data/demo --keep --steps 60 --save-every 10

Progress goes to stderr (logging); the results go to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cpuckpt
from cpuckpt.backend.committed import is_complete, read_manifest

logger = logging.getLogger("demo")

EVENT = "@@cpuckpt-demo "  # prefix of the child -> parent protocol lines on the child's stdout
STEP_DIR = re.compile(r"^step_(\d+)$")
MB = 1e6
GB = 1e9


# ------------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Sizes:
    width: int
    hidden: int
    blocks: int
    batch: int


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if quick:
        return Sizes(width=256, hidden=1024, blocks=2, batch=16)  # ~1.1 M params, ~13 MB with AdamW
    if device.type == "cuda":
        return Sizes(width=2048, hidden=8192, blocks=4, batch=8192)  # ~139 M params, ~1.7 GB with AdamW
    return Sizes(width=1024, hidden=4096, blocks=3, batch=32)  # ~26 M params, ~315 MB with AdamW


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(0.1)  # consumes the global RNG: its state is checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(s.width, s.hidden) for _ in range(s.blocks)))
        self.head = nn.Linear(s.width, s.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Task:
    """Synthetic regression: y = tanh(x A) B, with x drawn from a generator seeded by the step."""

    def __init__(self, s: Sizes, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        self.a = (torch.randn(s.width, s.width, generator=g) / math.sqrt(s.width)).to(device)
        self.b = (torch.randn(s.width, s.width, generator=g) / math.sqrt(s.width)).to(device)
        self.s, self.seed, self.device = s, seed, device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.s.batch, self.s.width, generator=g, device=self.device)
        return x, torch.tanh(x @ self.a) @ self.b


def build(s: Sizes, seed: int, device: torch.device) -> tuple[Net, torch.optim.Optimizer, Task]:
    torch.manual_seed(seed)
    model = Net(s).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    return model, optim, Task(s, seed, device)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoint_state(model: Net, optim: torch.optim.Optimizer, step: int, losses: list[float],
                     device: torch.device) -> dict[str, Any]:
    """What is checkpointed: model + optimizer (live tensors, not copies), RNG state and plain objects."""
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd,
            "extra": {"step": step, "losses": list(losses), "rng": rng_state(device)}}


def param_nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def tensor_nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    return 0


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """None when ``a`` and ``b`` are bit-identical (tensors) / equal (other objects), else where they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b).__name__}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)):
            return f"{where}: tensor values differ (max |diff| {(a.double() - b.double()).abs().max().item():.3e})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys differ: {sorted(map(str, set(a) ^ set(b)))[:5]}"
        for k in a:
            d = first_difference(a[k], b[k], f"{where}.{k}" if where else str(k))
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def step_dirs(workdir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<n>`` directory, newest first."""
    found = [(int(m.group(1)), p) for p in workdir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def dir_summary(path: Path) -> str:
    files = [f for f in path.iterdir() if f.is_file()]
    return f"{len(files)} file{'s' * (len(files) != 1)}, {allocated_bytes(path) / MB:.1f} MB"


def allocated_bytes(path: Path) -> int:
    """Bytes actually on disk (allocated blocks) in the files of ``path``."""
    try:
        return sum(f.stat().st_blocks * 512 for f in path.iterdir() if f.is_file())
    except FileNotFoundError:
        return 0


# ------------------------------------------------------------------------------- the child: train


@dataclass
class Save:
    step: int
    handle: cpuckpt.AsyncSaveHandle
    wait_s: float = 0.0  # time the training thread spent blocked in handle.staged.wait()


def emit(event: str, **fields: Any) -> None:
    print(EVENT + json.dumps({"event": event, **fields}), flush=True)


def train_child(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    s = sizes_for(device, args.quick)
    workdir = Path(args.workdir)
    model, optim, task = build(s, args.seed, device)
    config = args.config
    start = 1
    losses: list[float] = []

    if args.resume:
        for step, path in step_dirs(workdir):
            if not is_complete(path):
                logger.info("skipping %s: no .metadata, the save was torn by the kill (%s)", path.name,
                            dir_summary(path))
                emit("skipped", ckpt=path.name, why="no .metadata", summary=dir_summary(path))
                continue
            t0 = time.perf_counter()
            state = checkpoint_state(model, optim, 0, [], device)  # load targets (initialises AdamW state)
            cpuckpt.load(state, path, config)
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            set_rng_state(state["extra"]["rng"], device)
            manifest = read_manifest(path)
            manifest_step = manifest.step if manifest is not None else None
            if state["extra"]["step"] != step or manifest_step != step:
                raise RuntimeError(f"{path}: directory says step {step}, checkpoint {state['extra']['step']}, "
                                   f"manifest {manifest_step}")
            start, losses = step + 1, list(state["extra"]["losses"])
            load_s = time.perf_counter() - t0
            logger.info("resuming from %s (manifest step %s), loaded in %.2f s", path.name, manifest_step, load_s)
            emit("resumed", ckpt=path.name, step=step, manifest_step=manifest_step, load_s=load_s)
            break
        else:
            logger.info("no complete checkpoint in %s: starting from scratch", workdir)
            emit("resumed", ckpt=None, step=0, manifest_step=None, load_s=0.0)

    if args.save:
        # Pre-touch the host pool now, so the first save does not pay for fresh memory.
        cpuckpt.prepare_pool(3 * param_nbytes(model) + (1 << 20), config)

    pending: list[Save] = []  # scheduled, not yet reported committed
    staging: Save | None = None  # the save whose staging must end before the next optimizer.step()
    saves_done = 0

    def wait_staged(save: Save) -> None:
        t0 = time.perf_counter()
        save.handle.staged.wait()
        save.wait_s = time.perf_counter() - t0

    def report_done(block: bool) -> None:
        nonlocal saves_done
        for save in list(pending):
            if save is staging or not (block or save.handle.done()):
                continue
            save.handle.wait()  # raises if the save failed
            pending.remove(save)
            saves_done += 1
            st = save.handle.stats
            emit("committed", ckpt=f"step_{save.step}", mode=st.mode, nbytes=st.nbytes, call_s=st.call_s,
                 wait_s=save.wait_s, staged_s=st.staged_s, durable_s=st.durable_s, committed_s=st.committed_s)

    model.train()
    t_train = time.perf_counter()
    for step in range(start, args.steps + 1):
        x, y = task.batch(step)
        loss = F.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if staging is not None:
            # The last save may still be copying parameters and optimizer state: wait for its
            # staging (not for its writes) before the optimizer changes them.
            wait_staged(staging)
            staging = None
        optim.step()
        losses.append(loss.item())
        report_done(block=False)
        if args.save and (step % args.save_every == 0 or step == args.steps):
            path = workdir / f"step_{step}"
            handle = cpuckpt.async_save(checkpoint_state(model, optim, step, losses, device), path, config,
                                        step=step)
            staging = Save(step, handle)
            pending.append(staging)
            report_done(block=False)
            emit("scheduled", ckpt=path.name, step=step, index=saves_done + len(pending), committed=saves_done,
                 call_s=handle.stats.call_s)
            logger.info("step %d/%d loss %.6f: async_save of %s scheduled (%.3f s in the call)", step, args.steps,
                        losses[-1], path.name, handle.stats.call_s)
    if staging is not None:
        wait_staged(staging)
        staging = None
    report_done(block=True)
    cpuckpt.wait_all()
    train_s = time.perf_counter() - t_train
    logger.info("trained steps %d..%d in %.1f s, final loss %.6f", start, args.steps, train_s,
                losses[-1] if losses else math.nan)
    torch.save({"losses": losses, "model": model.state_dict(), "optim": optim.state_dict(), "start": start,
                "train_s": train_s}, args.result)
    emit("finished", start=start, steps=args.steps, train_s=train_s)
    return 0


# ----------------------------------------------------------------------------- the parent: drive


class Child:
    """A training child process; its protocol events are collected from stdout, its logs go to stderr."""

    started: ClassVar[list[Child]] = []

    def __init__(self, args: argparse.Namespace, tag: str, workdir: Path, *, save: bool, resume: bool) -> None:
        self.tag = tag
        self.result = workdir / f"result_{tag}.pt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "train", "--tag", tag,
               "--workdir", str(workdir), "--steps", str(args.steps), "--save-every", str(args.save_every),
               "--device", args.device, "--seed", str(args.seed), "--result", str(self.result)]
        cmd += ["--quick"] * args.quick + ["--save"] * save + ["--resume"] * resume
        cmd += ["--config", args.config] if args.config else []
        cmd += ["--verbose"] * args.verbose
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        Child.started.append(self)
        self.events: list[dict[str, Any]] = []

    def next_event(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(EVENT):
                ev = json.loads(line[len(EVENT):])
                self.events.append(ev)
                return ev
            sys.stdout.write(line)
        return None

    def finish(self) -> int:
        while self.next_event() is not None:
            pass
        return self.proc.wait()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def run_to_end(args: argparse.Namespace, tag: str, workdir: Path, **kw: bool) -> tuple[Child, dict[str, Any]]:
    child = Child(args, tag, workdir, **kw)
    rc = child.finish()
    if rc != 0:
        raise RuntimeError(f"the {tag} run exited with code {rc}")
    return child, torch.load(child.result, weights_only=True)


def run_and_kill(args: argparse.Namespace, workdir: Path) -> tuple[Child, dict[str, Any]]:
    """Train with checkpoints; SIGKILL the child while its third save is being written (two are committed).

    The child reports each ``async_save`` call as it returns. Once the third is scheduled, the parent
    waits for that save's first bytes to reach the disk (at most 2 s) and kills the child at once.
    """
    child = Child(args, "crashed", workdir, save=True, resume=False)
    while (ev := child.next_event()) is not None:
        if ev["event"] == "scheduled" and ev["index"] >= 3 and ev["committed"] >= 2:
            path = workdir / ev["ckpt"]
            deadline = time.monotonic() + 2.0
            while allocated_bytes(path) == 0 and not is_complete(path) and time.monotonic() < deadline:
                time.sleep(0.0005)
            child.proc.send_signal(signal.SIGKILL)
            ev["on_disk_at_kill"] = allocated_bytes(path)
            rc = child.finish()
            logger.info("SIGKILLed the crashed run while %s was being written (%.1f MB on disk; exit code %d)",
                        ev["ckpt"], ev["on_disk_at_kill"] / MB, rc)
            return child, ev
    rc = child.proc.wait()
    raise RuntimeError(f"the crashed run ended (exit code {rc}) before a third save was scheduled")


# ------------------------------------------------------------------------------ the comparison


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_cpuckpt(sd: dict[str, Any], path: Path, config: str | None, device: torch.device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    h = cpuckpt.async_save(sd, path, config)
    h.staged.wait()
    stall = time.perf_counter() - t0
    h.wait()
    return stall, time.perf_counter() - t0


def bench_dcp_save(sd: dict[str, Any], path: Path, config: str | None, device: torch.device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)))  # fsyncs its files (sync_files=True)
    _fsync_dir(path)
    total = time.perf_counter() - t0
    return total, total


def stager_options(device: torch.device) -> list[tuple[str, Any]]:
    """StagingOptions to try for dcp.async_save, best first: (label, options)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if device.type == "cuda":
        return [("pinned, async staging", StagingOptions(True, False, True, True)),
                ("sync staging", StagingOptions(False, False, False, False))]
    # On CPU the pinned-memory and non-blocking options need an accelerator; background staging does not.
    return [("async staging", StagingOptions(False, False, True, False)),
            ("sync staging", StagingOptions(False, False, False, False))]


def bench_dcp_async(sd: dict[str, Any], path: Path, stager: Any, device: torch.device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(path)), async_stager=stager)
    if hasattr(resp, "staging_completion"):  # AsyncSaveResponse: staging runs in the background
        resp.staging_completion.result()
        stall = time.perf_counter() - t0
        resp.upload_completion.result()
    else:  # a plain Future: staging happened inside the call
        stall = time.perf_counter() - t0
        resp.result()
    _fsync_dir(path)
    return stall, time.perf_counter() - t0


@dataclass
class BenchRow:
    name: str
    stalls: list[float]
    persists: list[float]
    error: str = ""


class DcpAsync:
    """``dcp.async_save`` with one DefaultStager kept across saves (it caches its staging buffers, as
    cpuckpt keeps its pool).

    Should the first save fail, the next StagingOptions are tried. Should a later save with the reused
    stager fail (torch 2.11 with pinned memory raises ``KeyError: <class 'type'>`` on the second save),
    that save is retried, and every later one made, with a fresh stager, and the table says so.
    """

    def __init__(self, device: torch.device, row: BenchRow) -> None:
        self.options = stager_options(device)
        self.device, self.row = device, row
        self.stager: Any = None
        self.saved = False
        self.reuse = True
        row.name = f"dcp.async_save + DefaultStager({self.options[0][0]})"

    def __call__(self, sd: dict[str, Any], path: Path) -> tuple[float, float]:
        from torch.distributed.checkpoint.staging import DefaultStager

        while True:
            try:
                if self.stager is None:
                    self.stager = DefaultStager(self.options[0][1])
                result = bench_dcp_async(sd, path, self.stager, self.device)
                self.saved = True
                if not self.reuse:
                    self.close()
                return result
            except Exception as e:
                self.close()
                shutil.rmtree(path, ignore_errors=True)
                if self.saved and self.reuse:
                    logger.warning("dcp.async_save with a reused DefaultStager(%s) failed: %r; a fresh stager for "
                                   "every save from now on", self.options[0][0], e)
                    self.reuse = False
                    self.row.error = f"reused stager failed ({type(e).__name__}): fresh stager per save"
                    continue
                if self.saved or len(self.options) == 1:
                    raise
                logger.warning("dcp.async_save with DefaultStager(%s) failed: %r; trying %s", self.options[0][0], e,
                               self.options[1][0])
                self.row.error = f"{self.options[0][0]} failed: {type(e).__name__}"
                self.options.pop(0)
                self.row.name = f"dcp.async_save + DefaultStager({self.options[0][0]})"

    def close(self) -> None:
        if self.stager is not None:
            try:
                self.stager.close()
            finally:
                self.stager = None


def compare(sd: dict[str, Any], nbytes: int, root: Path, reps: int, config: str | None,
            device: torch.device) -> list[BenchRow]:
    """Save ``sd`` with each method: one untimed warm-up round, then ``reps`` timed rounds (methods
    interleaved); every output is deleted before the next save."""
    cp = BenchRow("cpuckpt.async_save", [], [])
    sync = BenchRow("dcp.save + FileSystemWriter (sync)", [], [])
    asy = BenchRow("dcp.async_save", [], [])
    dcp_async = DcpAsync(device, asy)
    methods = [(cp, lambda path: bench_cpuckpt(sd, path, config, device)),
               (sync, lambda path: bench_dcp_save(sd, path, config, device)),
               (asy, lambda path: dcp_async(sd, path))]
    cpuckpt.prepare_pool(nbytes + (1 << 20), config)
    try:
        for rep in range(reps + 1):
            for i, (row, fn) in enumerate(methods):
                path = root / f"method{i}_rep{rep}"
                try:
                    stall, persist = fn(path)
                    what = "warm-up" if rep == 0 else f"rep {rep}"
                    logger.info("comparison %-7s %-48s stall %.3f s, persist %.3f s", what, row.name, stall,
                                persist)
                    if rep:
                        row.stalls.append(stall)
                        row.persists.append(persist)
                except Exception as e:
                    logger.warning("comparison: %s failed: %r", row.name, e)
                    row.error = f"failed: {type(e).__name__}: {e}"[:80]
                finally:
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        dcp_async.close()
    return [cp, sync, asy]


# ------------------------------------------------------------------------------------- the report


def fmt_range(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)), line]
    out += ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
    return "\n".join(x.rstrip() for x in out)


def parent(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    s = sizes_for(device, args.quick)
    if args.steps < 3 * args.save_every + 1:
        raise SystemExit(f"--steps ({args.steps}) must be > 3 x --save-every ({args.save_every}): the run is "
                         "killed at the third save and must have steps left to resume")
    made = args.workdir is None or not Path(args.workdir).exists()  # then remove it all at the end
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cpuckpt-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    stale = [p.name for _, p in step_dirs(workdir)]
    if stale:
        raise SystemExit(f"{workdir} already holds checkpoints ({', '.join(stale[:3])}...): give an empty --workdir")
    t_start = time.perf_counter()
    ok = False
    try:
        ok = demo(args, device, s, workdir)
    except Exception as e:
        logger.exception("the demo failed")
        print(f"FAIL: {type(e).__name__}: {e}")
    finally:
        for child in Child.started:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
        if args.keep:
            logger.info("kept %s", workdir)
        elif made:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            for _, p in step_dirs(workdir):
                shutil.rmtree(p, ignore_errors=True)
            for p in workdir.glob("result_*.pt"):
                p.unlink()
            shutil.rmtree(workdir / "compare", ignore_errors=True)
    logger.info("demo finished in %.0f s", time.perf_counter() - t_start)
    return 0 if ok else 1


def demo(args: argparse.Namespace, device: torch.device, s: Sizes, workdir: Path) -> bool:
    model, optim, _ = build(s, args.seed, device)
    nparams = sum(p.numel() for p in model.parameters())
    logger.info("device %s, MLP %d x (%d -> %d), %.1f M params, batch %d; workdir %s", device, s.blocks, s.width,
                s.hidden, nparams / 1e6, s.batch, workdir)

    logger.info("1/4 reference run: %d steps, no checkpoints", args.steps)
    _, ref = run_to_end(args, "reference", workdir, save=False, resume=False)

    logger.info("2/4 crashed run: async_save every %d steps, SIGKILL at the third save", args.save_every)
    crashed, kill_ev = run_and_kill(args, workdir)
    on_disk = [(p.name, is_complete(p), dir_summary(p)) for _, p in reversed(step_dirs(workdir))]
    for name, complete, summary in on_disk:
        logger.info("  %s: %s (%s)", name, "complete" if complete else "TORN: no .metadata", summary)

    logger.info("3/4 resumed run: newest complete checkpoint, then train to step %d", args.steps)
    resumed, res = run_to_end(args, "resumed", workdir, save=True, resume=True)
    resume_ev = resumed.of("resumed")[0]

    # -- verification
    problems: list[str] = []
    committed_before_kill = [e["ckpt"] for e in crashed.of("committed")]
    if len(committed_before_kill) < 2 or not all(is_complete(workdir / c) for c in committed_before_kill):
        problems.append(f"expected two committed checkpoints before the kill, got {committed_before_kill}")
    if resume_ev["ckpt"] is None:
        problems.append("the resumed run found no complete checkpoint")
    if d := first_difference(ref["losses"], res["losses"], "losses"):
        problems.append(d)
    if d := first_difference(ref["model"], res["model"], "model"):
        problems.append(d)
    if d := first_difference(ref["optim"], res["optim"], "optim"):
        problems.append(d)
    # the final checkpoint, loaded here, in a third process
    final = workdir / f"step_{args.steps}"
    sd = checkpoint_state(model, optim, 0, [], device)
    t0 = time.perf_counter()
    cpuckpt.load(sd, final, args.config)
    load_s = time.perf_counter() - t0
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if d := first_difference(ref["model"], model.state_dict(), f"{final.name}.model"):
        problems.append(d)
    if d := first_difference(ref["optim"], optim.state_dict(), f"{final.name}.optim"):
        problems.append(d)
    if d := first_difference(ref["losses"], sd["extra"]["losses"], f"{final.name}.losses"):
        problems.append(d)
    ok = not problems

    # -- comparison on the same state dict
    nbytes = tensor_nbytes(sd)
    logger.info("4/4 comparison on the final state dict (%.1f MB), %d repetition(s)", nbytes / MB, args.reps)
    sd = checkpoint_state(model, optim, args.steps, sd["extra"]["losses"], device)
    (workdir / "compare").mkdir(exist_ok=True)
    rows = compare(sd, nbytes, workdir / "compare", args.reps, args.config, device)

    # -- report (stdout)
    model_b = param_nbytes(model)
    torn = [name for name, complete, _ in on_disk if not complete]
    skipped = resumed.of("skipped")
    p = print
    p()
    p("cpuckpt demo: async checkpoints, SIGKILL mid-save, resume")
    p(f"  device {device}, torch {torch.__version__}, MLP {s.blocks} x ({s.width} -> {s.hidden}), "
      f"{nparams / 1e6:.1f} M params, AdamW")
    p(f"  state dict {nbytes / MB:.1f} MB (model {model_b / MB:.1f} MB + AdamW {(nbytes - model_b) / MB:.1f} MB) "
      f"+ step, loss history, RNG state; {args.steps} steps, async_save every {args.save_every}")
    p(f"  reference run : {args.steps} steps uninterrupted, final loss {ref['losses'][-1]:.6f}")
    p(f"  crashed run   : SIGKILL while {kill_ev['ckpt']} was being written "
      f"(committed before: {', '.join(committed_before_kill) or 'none'})")
    p("  on disk       : " + ", ".join(f"{n} {'complete' if c else 'TORN (no .metadata, ' + sm + ')'}"
                                       for n, c, sm in on_disk))
    if not torn:
        p(f"                  ({kill_ev['ckpt']} committed before the kill landed: nothing torn this time)")
    for ev in skipped:
        p(f"  resumed run   : skipped {ev['ckpt']} ({ev['why']})")
    p(f"  resumed run   : loaded {resume_ev['ckpt']} (manifest step {resume_ev['manifest_step']}) in "
      f"{resume_ev['load_s']:.2f} s, trained steps {res['start']}..{args.steps}, final loss {res['losses'][-1]:.6f}")
    p(f"  final ckpt    : {final.name} loaded back in this process in {load_s:.2f} s")
    if ok:
        p(f"  check         : {args.steps}/{args.steps} losses, final parameters and AdamW state bit-identical to "
          "the reference run; final checkpoint bit-identical")
    else:
        for pr in problems:
            p(f"  MISMATCH      : {pr}")
    p("PASS" if ok else "FAIL")

    p()
    p("Checkpoints written while training (cpuckpt.async_save; stall = call + time blocked in staged.wait() "
      "before the next optimizer.step(); persist = call -> committed)")
    hdr = ["run", "checkpoint", "mode", "MB", "call s", "wait s", "stall s", "persist s", "GB/s"]
    trows = []
    for child in (crashed, resumed):
        for e in child.of("committed"):
            trows.append([child.tag, e["ckpt"], e["mode"], f"{e['nbytes'] / MB:.1f}", f"{e['call_s']:.3f}",
                          f"{e['wait_s']:.3f}", f"{e['call_s'] + e['wait_s']:.3f}", f"{e['committed_s']:.3f}",
                          f"{e['nbytes'] / e['committed_s'] / GB:.2f}"])
    p(table(hdr, trows))

    p()
    p(f"Same state dict ({nbytes / MB:.1f} MB), one save at a time, idle trainer, after one untimed warm-up save "
      f"each; {'median (min-max) of ' + str(args.reps) if args.reps > 1 else 'one repetition'}")
    p("  stall = training blocked: cpuckpt call + staged.wait(); dcp.save whole save; dcp.async_save call + staging")
    p("  persist = call -> durable (files and directory fsynced); GB/s = state dict bytes / persist")
    hdr = ["method", "stall s", "persist s", "GB/s"]
    brows = []
    for r in rows:
        gbps = [nbytes / x / GB for x in r.persists]
        brows.append([r.name, fmt_range(r.stalls), fmt_range(r.persists), fmt_range(gbps, 2) if gbps else "-"])
    if any(r.error for r in rows):
        hdr.append("note")
        for row, r in zip(brows, rows):
            row.append(r.error)
    p(table(hdr, brows))
    if rows[0].stalls:
        ratios = []
        for what in ("stalls", "persists"):
            base = statistics.median(getattr(rows[0], what))
            parts = [f"{r.name.split(' + ')[0]} {statistics.median(getattr(r, what)) / base:.1f}x"
                     for r in rows[1:] if getattr(r, what)]
            if parts:
                ratios.append(f"{what[:-1]} " + ", ".join(parts))
        if ratios:
            p(f"  relative to cpuckpt.async_save: {'; '.join(ratios)}")
    sys.stdout.flush()
    return ok


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where checkpoints go (default: a fresh temporary directory, removed at the "
                    "end unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and results")
    ap.add_argument("--steps", type=int, help="training steps (default 40 on CPU, 100 on GPU; 12 with --quick)")
    ap.add_argument("--save-every", type=int, help="checkpoint every N steps (default 8 on CPU, 20 on GPU; 3 with "
                    "--quick)")
    ap.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps: seconds (used by the CI test)")
    ap.add_argument("--reps", type=int, help="repetitions of each comparison save (default 3; 1 with --quick)")
    ap.add_argument("--config", help="a cpuckpt YAML config (default: built-in defaults, CPUCKPT_* overrides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", "-v", action="store_true", help="cpuckpt's own INFO logs too")
    # internal: the training child
    ap.add_argument("--role", choices=("train",), help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    args.device = f"cuda:{dev.index or 0}" if gpu else str(dev)  # an explicit index, for every process
    args.steps = args.steps or (12 if args.quick else 100 if gpu else 40)
    args.save_every = args.save_every or (3 if args.quick else 20 if gpu else 8)
    args.reps = args.reps or (1 if args.quick else 3)
    if args.save_every < 1 or args.steps < 1 or args.reps < 1:
        ap.error("--steps, --save-every and --reps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tag = args.tag if args.role else "demo"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s.%(msecs)03d [{tag}] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("cpuckpt").setLevel(logging.INFO if args.verbose else logging.WARNING)
    # DCP's note that it runs without a process group (this demo is one process, by design)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if torch.device(args.device).type == "cuda":
        # bit-exact resume on GPU: deterministic kernels (CPU kernels are deterministic already)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.role == "train":
        return train_child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
