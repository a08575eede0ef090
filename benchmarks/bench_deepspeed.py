"""DeepSpeed checkpointing: DeepSpeed's own engines (torch.save, decoupled) against cpuckpt's, one rank.

Run on the device machine (one H200) from the repository root, no torchrun needed::

    python3 -m benchmarks.bench_deepspeed --out $OUT/bench_deepspeed.json
    python3 -m benchmarks.bench_deepspeed --smoke --out /tmp/ds.json      # CPU, gloo, tiny model, < 1 min

One process, one DeepSpeed engine (a GPT-like decoder, bf16, ZeRO-1 by default, ``torch_adam``).
Its checkpoint holds the bf16 weights (``mp_rank_00_model_states.pt``) and the fp32 master weights
plus both Adam moments (``bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt``): about 14 bytes per
parameter, ~13.6 GB for the default ~0.97 B parameters.

For each engine, in the same process and on the same training state (the engine is built once with
DeepSpeed's default engine, then switched with ``cpuckpt.integrations.deepspeed.attach``), each
repetition does: one training step (it ends with the trainer's stream synchronised);
``engine.save_checkpoint(fresh_dir, tag)``, timed from the call to its return with nothing synchronised
around it (**stall**: the time the training thread cannot run); then ``--next-steps`` training steps,
each timed until the trainer's stream is done (not the whole device: copies on a save's side stream
count only where the trainer's kernels wait for them). **lost** = stall + (next step - step alone): what
the save cost the training loop, the honest figure for engines whose work continues after the call
returns (cpuckpt-zero, decoupled).

* torch (DeepSpeed's ``TorchCheckpointEngine``): ``torch.save`` per file, synchronous, no fsync.
  **persist** = stall + fsync of its files and directory right after the save (what durability
  costs on top); the next steps run after that.
* cpuckpt (async): ``save_checkpoint`` returns once the tensors are in the pinned host pool; files
  are written in the background. DeepSpeed asks a decoupled engine to commit at the next
  ``engine.step()`` (before the optimizer update); with ``background_commit`` (default) that commit
  continues on a background thread, so the step does not wait. **persist** = from the call to the
  end of the commit (files and directory fsynced, ``latest`` written). Its first repetition is
  listed apart (the pool was prepared before it, see below).
* cpuckpt-blocking (``--engines ...,cpuckpt-blocking``): ``background_commit: false``, DeepSpeed's own
  decoupled timing: the first step after the save waits for the rest of the write.
* cpuckpt-zero (``ordering: optimizer``): ``save_checkpoint`` returns once the device-to-host copies
  are enqueued; the next forward and backward overlap them and the next optimizer step waits for them
  on the GPU (no host block). Its cost shows in the next step, hence **lost**.
* cpuckpt-zero-d2d: the same with ``staging: {device_snapshot: true}``: the save's GPU bytes are copied into
  spare device memory first, the next optimizer step waits for that copy only, and the copies to the host
  read it. On a GPU, a **d2d_probe** row first times that device-to-device copy alone over the engine's state.

Every save's record holds ``next_step_phases_s``: the host time of the first step after it, by part
(forward, backward, step; inside the step the checkpoint engine's ``order_pending``, DeepSpeed's
``_commit_decoupled_checkpoint`` with its barrier, ``_take_model_step``; the final synchronisation), so a
step that waits shows where.
* decoupled: DeepSpeed's own ``DecoupledCheckpointEngine`` (``"checkpoint": {"writer": {"decoupled":
  true, "type": ..., "data_parallel": "replica"}}``; 0.19.8 raises without ``data_parallel``), built
  here through DeepSpeed's ``create_checkpoint_engine`` with that writer config (and the launcher's
  ``CROSS_SIZE``/``CROSS_RANK`` variables it reads); ``--decoupled-writer PYTHON`` by default:
  ``FAST`` needs DeepSpeed's ``async_io`` op, a JIT build with libaio. ``save()`` hands the live
  tensors (CUDA IPC handles, no snapshot) to a spawned writer process (started by the engine; its
  first save, listed apart, also waits for that process to import DeepSpeed); the commit at the
  next ``step()`` waits until that process has written every file (``torch.save``, no fsync), so
  the first step after the save carries the whole write. 0.19.8's
  ``save()`` cannot send ZeRO-1/2's optimizer state to that process as DeepSpeed builds it (views of
  the fp32 partitions that require grad; torch refuses non-leaf tensors across processes), so the
  bench detaches every tensor first (no copy: what a fixed DeepSpeed would hand over). Nothing
  snapshots the tensors, so the forward between save and step (buffers) may change what is written.
  **persist** = until that commit ended + an fsync of the files afterwards. It runs in one process on
  one GPU (the writer is a child process); ``--smoke`` runs it on CPU (shared-memory tensors).

The host pool: attaching cpuckpt to an engine that has stepped prepares the pool on a background
thread (``prepare_pool``, sized from the live tensors); the bench keeps training until that is done
(**prepare** row: bytes, seconds, steps run meanwhile and their median), so every cpuckpt rep 0
(listed apart as "first") is the first save of a run that prepared its pool.

"next step" is the first step after the save, timed from the moment the save returned, with no
synchronisation before it (cpuckpt-blocking, decoupled: it includes the commit wait; cpuckpt-zero: the
GPU-side wait for the copies still running), "steady" the median of the following ones, "alone" the
median step time with no checkpoint in flight. Run the new variants with, e.g.::

    python3 -m benchmarks.bench_deepspeed --engines torch,cpuckpt,cpuckpt-zero,decoupled --reps 2 --out $OUT

``--verify`` (on in ``--smoke``) also saves the same state with both engines and checks that every
tensor in the files is bit-identical. Old checkpoint directories are deleted before the next
repetition (the page cache cannot be dropped between repetitions on every machine). Prints a
markdown table; raw results go to ``--out`` (a ``.json`` path, or a directory to put
``bench_deepspeed.json`` in).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import logging
import os
import platform
import pstats
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import (
    GB,
    ResultLog,
    fsync_tree,
    median,
    named_tensors,
    same_tensor,
    tree_nbytes,
    with_time_spent,
)

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench_deepspeed")
ENGINES = ("torch", "cpuckpt", "cpuckpt-zero", "cpuckpt-zero-d2d", "cpuckpt-blocking", "decoupled")


# ----------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------- helpers
def import_adapter() -> Any:
    """``cpuckpt.integrations.deepspeed``, also from a plain source tree (``PYTHONPATH=$PWD``).

    The installed package maps ``cpuckpt.integrations`` to the repository's ``integrations/``; a
    source checkout on ``sys.path`` has no such directory under ``cpuckpt/``, so register it here.
    """
    try:
        import cpuckpt.integrations.deepspeed as adapter

        return adapter
    except ModuleNotFoundError as e:
        if e.name not in ("cpuckpt.integrations", "cpuckpt.integrations.deepspeed"):
            raise
    import cpuckpt  # noqa: F401  (the parent package must exist first)

    spec = importlib.util.spec_from_file_location("cpuckpt.integrations", REPO / "integrations" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "integrations")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpuckpt.integrations"] = module
    spec.loader.exec_module(module)
    import cpuckpt.integrations.deepspeed as adapter

    return adapter


def _detached(obj: Any) -> Any:
    """``obj`` with every tensor detached (no copy): DeepSpeed 0.19.8's decoupled engine puts ZeRO-1/2's
    optimizer state on a multiprocessing queue as it is, and torch refuses to send its fp32 partition
    views (non-leaf tensors that require grad) to another process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return type(obj)((k, _detached(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detached(v) for v in obj)
    return obj


@contextlib.contextmanager
def timed_methods(phases: dict[str, float], methods: list[tuple[Any, str]]) -> Iterator[None]:
    """Within the block, each ``obj.name`` (an instance attribute shadowing the method) adds its host time
    to ``phases[name]``; the instances are left as they were afterwards."""
    installed = []
    for obj, name in methods:
        if obj is None or not hasattr(obj, name) or name in vars(obj):
            continue
        setattr(obj, name, with_time_spent(getattr(obj, name), name, phases))
        installed.append((obj, name))
    try:
        yield
    finally:
        for obj, name in installed:
            delattr(obj, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------- bench
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results = ResultLog(logger)
        self.record = self.results.record
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        """Wait for the trainer's stream (what its next step waits for), not the whole device: a save's
        copies on a side stream count only where the trainer's kernels wait for them."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    # -- set-up ------------------------------------------------------------------------------------
    def init_distributed(self) -> None:
        import deepspeed
        import deepspeed.ops

        # CROSS_SIZE/CROSS_RANK: what DeepSpeed's launcher exports (its checkpoint writer config reads them)
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "CROSS_SIZE": "1", "CROSS_RANK": "0"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        # an inference-only shared-memory op DeepSpeed would JIT-build (g++, ~30 s); gloo/nccl do the rest
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if self.cuda:
            torch.cuda.set_device(self.device)
        deepspeed.init_distributed(dist_backend="nccl" if self.cuda else "gloo")
        # One rank trains without collectives, so the first barrier (in the first save_checkpoint) would set up
        # NCCL's communicator (~30 ms): in a job of several ranks the gradients' all-reduce has done that.
        torch.distributed.barrier()

    def build_engine(self) -> Any:
        import deepspeed

        a = self.args
        torch.manual_seed(0)
        with self.device:
            model = GPT(a.vocab, a.hidden, a.layers, a.heads, a.seq)
        nparams = sum(p.numel() for p in model.parameters())
        ds_config = {
            "train_micro_batch_size_per_gpu": a.micro_batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": a.stage},
            "bf16": {"enabled": True},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        t0 = time.perf_counter()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        self.record("engine", params=nparams, stage=a.stage, init_s=time.perf_counter() - t0,
                    checkpoint_engine=type(engine.checkpoint_engine).__name__, cpuckpt_checksum=a.checksum)
        return engine

    def step(self, engine: Any, k: int, *, sync_first: bool = True, phases: dict[str, float] | None = None
             ) -> float:
        """One training step, timed until the trainer's stream is done. ``sync_first=False`` (the step right
        after a save) starts the clock at once: a synchronisation before it would wait, untimed, for the
        save's copies still running on the side stream. ``phases`` gets the host time of each part: forward,
        backward, step (and inside it the checkpoint engine's ordering, DeepSpeed's decoupled commit with its
        barrier, the model step) and the final synchronisation: where the host waited."""
        t0 = time.perf_counter()
        g = torch.Generator(device=self.device).manual_seed(k)
        ids = torch.randint(0, self.args.vocab, (self.args.micro_batch, self.args.seq), device=self.device, generator=g)
        if sync_first:
            self.sync()
            t0 = time.perf_counter()
        if phases is None:
            phases, inner = {}, []  # the parts are timed all the same (a few clock reads), and dropped
        else:
            inner = [(engine.checkpoint_engine, "order_pending"), (engine, "_commit_decoupled_checkpoint"),
                     (engine, "_take_model_step")]
        with timed_methods(phases, inner):
            t = time.perf_counter()
            loss = engine(ids)
            phases["forward"], t = time.perf_counter() - t, time.perf_counter()
            engine.backward(loss)
            phases["backward"], t = time.perf_counter() - t, time.perf_counter()
            engine.step()
            phases["step"], t = time.perf_counter() - t, time.perf_counter()
            self.sync()
            phases["sync"] = time.perf_counter() - t
        return time.perf_counter() - t0

    # -- measurements ------------------------------------------------------------------------------
    def run_engine(self, engine: Any, label: str, reps: int, root: Path, counter: list[int]) -> None:
        """``reps`` save repetitions with the engine's current checkpoint engine."""
        ck = engine.checkpoint_engine
        commit_end: list[float] = []
        hook = "_finish" if label.startswith("cpuckpt") else "commit" if label == "decoupled" else ""
        if hook:  # note when the commit (started by the next step, maybe in the background) ends
            inner = getattr(ck, hook)

            def finish(*a: Any) -> Any:
                out = inner(*a)
                commit_end.append(time.perf_counter())
                return out

            setattr(ck, hook, finish)
        save_calls: list[float] = []  # the checkpoint engine's own save() calls inside each save_checkpoint
        inner_save = ck.save

        def timed_save(*a: Any, **kw: Any) -> Any:
            s0 = time.perf_counter()
            try:
                return inner_save(*a, **kw)
            finally:
                save_calls.append(time.perf_counter() - s0)

        ck.save = timed_save
        prev: Path | None = None
        for rep in range(reps):
            counter[0] += 1
            self.step(engine, counter[0])
            if prev is not None:
                shutil.rmtree(prev, ignore_errors=True)
            save_dir = root / f"{label}_{rep}"
            commit_end.clear()
            save_calls.clear()
            profiled = rep in (0, reps - 1) and label != "torch"
            prof = cProfile.Profile() if self.args.profile and profiled else None
            t0 = time.perf_counter()  # the step before ended with its stream synchronised (see the docstring)
            if prof is not None:
                prof.enable()
            engine.save_checkpoint(str(save_dir), tag="t")
            if prof is not None:
                prof.disable()
            t1 = time.perf_counter()
            if prof is not None:  # the caller's thread: where the call's time goes (cumulative, then own time)
                out = io.StringIO()
                for key in ("cumulative", "tottime"):
                    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
                self.record("call_profile", engine=label, rep=rep, stall_s=t1 - t0, top=out.getvalue()[-12000:])
                logger.info("call profile, %s rep %d:\n%s", label, rep, out.getvalue()[-12000:])
            if label == "torch":
                fsync_tree(save_dir)
                persist = time.perf_counter() - t0
            steps = []
            phases: dict[str, float] = {}
            for _ in range(self.args.next_steps):
                counter[0] += 1
                steps.append(self.step(engine, counter[0], sync_first=bool(steps), phases=None if steps else phases))
            if label.startswith("cpuckpt"):
                self.adapter.commit_pending(engine)  # after the timed steps: a background commit ends here
                persist = commit_end[0] - t0 if commit_end else time.perf_counter() - t0
            elif label == "decoupled":
                engine._commit_decoupled_checkpoint()  # only if no step committed it (next_steps 0)
                end = commit_end[0] if commit_end else time.perf_counter()
                f0 = time.perf_counter()
                fsync_tree(save_dir)  # DeepSpeed's writer process does not fsync
                persist = end - t0 + time.perf_counter() - f0
            nbytes = tree_nbytes(save_dir / "t")
            lost = t1 - t0 + max(0.0, steps[0] - self.alone) if steps else t1 - t0
            self.record("save", engine=label, rep=rep, stall_s=t1 - t0, engine_save_s=sum(save_calls),
                        engine_saves=len(save_calls), lost_s=lost, persist_s=persist, bytes=nbytes,
                        GBps=nbytes / persist / GB, next_step_s=steps[0] if steps else None,
                        steady_step_s=median(steps[1:]), steps_s=steps,
                        next_step_phases_s=phases)
            prev = save_dir
        if prev is not None:
            shutil.rmtree(prev, ignore_errors=True)
        if hook:
            delattr(ck, hook)  # the class's method again
        del ck.save

    def verify(self, engine: Any, root: Path, counter: list[int], settings: dict[str, Any]) -> None:
        """Same state saved by both engines: every tensor in every file bit-identical."""
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        counter[0] += 1
        self.step(engine, counter[0])
        cpuckpt_engine = engine.checkpoint_engine
        engine.checkpoint_engine = TorchCheckpointEngine(None)
        engine.save_checkpoint(str(root / "verify_torch"), tag="t")
        engine.checkpoint_engine = cpuckpt_engine
        engine.save_checkpoint(str(root / "verify_cpuckpt"), tag="t")
        self.adapter.commit_pending(engine)
        from cpuckpt.integrations.deepspeed.engine import safe_globals_for_deepspeed

        # DeepSpeed's file names only: cpuckpt adds its hidden completion marker, checked apart
        names = sorted(p.name for p in (root / "verify_torch" / "t").iterdir() if not p.name.startswith("."))
        ours = sorted(p.name for p in (root / "verify_cpuckpt" / "t").iterdir() if not p.name.startswith("."))
        bad: list[str] = [] if names == ours else [f"file names differ: {names} vs {ours}"]
        marked = self.adapter.check_tag(root / "verify_cpuckpt", "t", verify=True)
        if not marked.complete:
            bad.append(f"completion marker: {marked.describe()}")
        compared = 0
        with torch.serialization.safe_globals(safe_globals_for_deepspeed()):
            for n in names:
                if n not in ours:
                    continue
                a = named_tensors(torch.load(root / "verify_torch" / "t" / n, map_location="cpu", weights_only=True))
                b = named_tensors(torch.load(root / "verify_cpuckpt" / "t" / n, map_location="cpu", weights_only=True))
                if a.keys() != b.keys():
                    bad.append(f"{n}: tensor keys differ")
                    continue
                for k in a:
                    compared += 1
                    if not same_tensor(a[k], b[k]):
                        bad.append(f"{n}: {k}")
        self.record("verify", files=names, tensors=compared, mismatches=bad[:10], ok=not bad)
        shutil.rmtree(root / "verify_torch", ignore_errors=True)
        shutil.rmtree(root / "verify_cpuckpt", ignore_errors=True)
        if bad:
            raise SystemExit(f"cpuckpt's files differ from DeepSpeed's: {bad[:5]}")

    def run(self) -> None:
        a = self.args
        import deepspeed

        self.adapter = import_adapter()
        self.record("machine", device=torch.cuda.get_device_name() if self.cuda else platform.processor() or "cpu",
                    torch=torch.__version__, deepspeed=deepspeed.__version__, python=platform.python_version(),
                    cpus=os.cpu_count())
        self.init_distributed()
        engine = self.build_engine()
        root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-ds-"))
        root.mkdir(parents=True, exist_ok=True)
        counter = [0]
        for _ in range(a.warmup):
            counter[0] += 1
            self.step(engine, counter[0])
        alone = []
        for _ in range(a.alone_steps):
            counter[0] += 1
            alone.append(self.step(engine, counter[0]))
        self.alone = median(alone)
        self.record("step_alone", median_s=self.alone, steps_s=alone)
        try:
            if "torch" in a.engines:
                self.run_engine(engine, "torch", a.reps, root, counter)
            settings = {"async": True, "io": {"threads": a.io_threads}, "integrity": {"checksum": a.checksum}}
            variants = {"cpuckpt": settings, "cpuckpt-zero": dict(settings, ordering="optimizer"),
                        "cpuckpt-zero-d2d": dict(settings, ordering="optimizer", staging={"device_snapshot": True}),
                        "cpuckpt-blocking": dict(settings, background_commit=False)}
            attached = False
            if a.verify or any(v in a.engines for v in variants):
                self.adapter.attach(engine, settings)
                self.prepare(engine, counter)
                attached = True
            if a.verify:
                self.verify(engine, root, counter, settings)
            if "cpuckpt-zero-d2d" in a.engines and self.cuda:
                try:
                    self.d2d_probe(engine)
                except Exception as e:  # a probe, not a result: the variants still run
                    self.record("d2d_probe", error=repr(e))
            for label, st in variants.items():
                if label in a.engines:
                    if st is not settings or not attached:
                        self.adapter.attach(engine, st)
                    attached = False
                    # rep 0 is listed apart ("first"): the first save of this engine
                    self.run_engine(engine, label, a.reps + 1, root, counter)
            if "decoupled" in a.engines:
                try:
                    self.attach_decoupled(engine)
                except Exception as e:  # e.g. no spawn-able writer process here: reported, the rest still runs
                    logger.exception("decoupled engine unavailable")
                    self.record("decoupled_error", error=f"{type(e).__name__}: {e}")
                else:
                    self.run_engine(engine, "decoupled", a.reps + 1, root, counter)
            engine.destroy()
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def d2d_probe(self, engine: Any, reps: int = 3) -> None:
        """The device snapshot's device-to-device copy (``transfer.device_snapshot``, the code a
        ``device_snapshot`` save runs) over this engine's GPU state, timed alone on an idle device."""
        from cpuckpt.transfer.device_snapshot import DeviceSnapshots, release
        from cpuckpt.transfer.staging import flat_bytes

        state = {"module": engine.module.state_dict(), "optim": engine.optimizer.state_dict()}
        sources = [flat_bytes(t) for t in named_tensors(state).values() if t.is_cuda]
        nbytes = sum(t.numel() for t in sources)
        device = sources[0].device
        stream = torch.cuda.Stream(device=device)
        times, snapshots = [], DeviceSnapshots()
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            _, snap = snapshots.snapshot_sources(sources, device, stream, torch.cuda.current_stream(device))
            stream.synchronize()
            times.append(time.perf_counter() - t)
            release(snap, None)
        snapshots.clear()
        self.record("d2d_probe", bytes=nbytes, tensors=len(sources), s=times, GBps=nbytes / median(times) / GB)

    def prepare(self, engine: Any, counter: list[int]) -> None:
        """Train on while cpuckpt prepares the host pool in the background (``prepare_pool``); record it."""
        ck = engine.checkpoint_engine
        preparer = getattr(ck, "_preparer", None)
        steps: list[float] = []
        t0 = time.perf_counter()
        while preparer is not None and not preparer.done and len(steps) < 200:
            counter[0] += 1
            steps.append(self.step(engine, counter[0]))
        if preparer is not None:
            preparer.join()
        from cpuckpt.transfer.staging import pool_state

        nbytes, pinned = pool_state()
        self.record("prepare", estimate_bytes=getattr(ck, "prepared_bytes", None), pool_bytes=nbytes, pinned=pinned,
                    prepare_s=getattr(preparer, "seconds", None), waited_s=time.perf_counter() - t0,
                    steps_during=len(steps), median_step_during_s=median(steps) if steps else None)

    def attach_decoupled(self, engine: Any) -> None:
        """Switch to DeepSpeed's ``DecoupledCheckpointEngine`` the way ``initialize`` would build it."""
        from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
        from deepspeed.runtime.model_checkpointing.config import get_checkpoint_writer_config
        from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_WRITER
        from deepspeed.utils import groups

        old = engine.checkpoint_engine
        if old is not None and old.is_decoupled():
            self.adapter.commit_pending(engine)
            old.cleanup()
        # data_parallel: DeepSpeed 0.19.8 fails without one (DataParallelWriterFactory reads a dp_rank that
        # UniversalParallelInfo does not have); "replica": every data-parallel rank writes its share.
        writer = {"decoupled": True, "type": self.args.decoupled_writer, "data_parallel": "replica"}
        engine._config.checkpoint_config[CHECKPOINT_WRITER] = get_checkpoint_writer_config({"writer": writer})
        new = create_checkpoint_engine(engine._config, groups, engine.zero_optimization_stage(), engine.has_moe_layers,
                                       not engine.zero_optimization_partition_weights())
        inner_save = new.save

        def save(state_dict: Any, path: str) -> None:
            inner_save(_detached(state_dict), path)

        new.save = save
        engine.checkpoint_engine = new
        dp_rank = groups._get_sequence_data_parallel_rank()
        engine.save_non_zero_checkpoint = new.is_data_parallel_writer(dp_rank) or (
            engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group())
        self.record("decoupled_engine", engine=type(new).__name__, writer=writer)

    # -- report ------------------------------------------------------------------------------------
    def table(self) -> str:
        saves = [r for r in self.results if r["name"] == "save"]
        eng = next(r for r in self.results if r["name"] == "engine")
        alone = next(r for r in self.results if r["name"] == "step_alone")["median_s"]
        lines = [f"DeepSpeed ZeRO-{eng['stage']} bf16, {eng['params'] / 1e6:,.1f} M params, 1 rank, "
                 f"{self.device.type}; step alone {alone:.3f} s",
                 "",
                 "| engine | rep | stall s | engine save() s | lost s | persist s | GB | GB/s | next step s "
                 "| steady step s |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

        def row(engine: str, rep: str, st: float, es: float, lo: float, pe: float, nb: float, ns: float | None,
                ss: float) -> str:
            return (f"| {engine} | {rep} | {st:.3f} | {es:.3f} | {lo:.3f} | {pe:.2f} | {nb / GB:.2f} | "
                    f"{nb / pe / GB:.2f} | {'-' if ns is None else f'{ns:.3f}'} | {ss:.3f} |")

        for label in ENGINES:
            rows = [r for r in saves if r["engine"] == label]
            first = label != "torch"  # rep 0 of these is listed apart
            for r in rows:
                rep = f"{r['rep']}" + (" (first)" if first and r["rep"] == 0 else "")
                lines.append(row(label, rep, r["stall_s"], r.get("engine_save_s", 0.0), r["lost_s"], r["persist_s"],
                                 r["bytes"], r["next_step_s"], r["steady_step_s"]))
            warm = rows[1:] if first else rows
            if len(warm) > 1:
                lines.append(row(f"**{label}**", f"median of {len(warm)}", median([r["stall_s"] for r in warm]),
                                 median([r.get("engine_save_s", 0.0) for r in warm]),
                                 median([r["lost_s"] for r in warm]),
                                 median([r["persist_s"] for r in warm]), median([r["bytes"] for r in warm]),
                                 median([r["next_step_s"] for r in warm if r["next_step_s"] is not None]),
                                 median([r["steady_step_s"] for r in warm])))
        lines += ["",
                  "stall: save_checkpoint call to return (nothing synchronised around it). engine save(): the "
                  "checkpoint engine's save() calls within it (the rest is DeepSpeed's own work). lost: stall + "
                  "(next step - step alone). persist: torch = stall + fsync of its files; cpuckpt* = until the "
                  "commit (started by the next step()) ended; decoupled = until its commit ended + fsync. next "
                  "step: first step after the save (cpuckpt-blocking, decoupled: includes waiting for the write; "
                  "cpuckpt-zero: the GPU-side wait for the copies). GB = 1e9 bytes."]
        prep = [r for r in self.results if r["name"] == "prepare"]
        if prep:
            p = prep[0]
            lines.append(f"prepare_pool: {(p['pool_bytes'] or 0) / GB:.2f} GB pool (estimate "
                         f"{(p['estimate_bytes'] or 0) / GB:.2f} GB, pinned {p['pinned']}) in "
                         f"{p['prepare_s'] or 0:.2f} s in the background; {p['steps_during']} steps ran meanwhile")
        err = [r for r in self.results if r["name"] == "decoupled_error"]
        if err:
            lines.append(f"decoupled: not run: {err[0]['error']}")
        ver = [r for r in self.results if r["name"] == "verify"]
        if ver:
            lines.append(f"verify: same state saved by both engines, {ver[0]['tensors']} tensors compared, "
                         f"bit-identical: {ver[0]['ok']}")
        return "\n".join(lines)


MODEL = {"layers": 18, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 1024, "micro_batch": 4}  # ~0.97 B
SMOKE_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32, "micro_batch": 2}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The GPT's sizes as options (``--layers``, ``--hidden``, ...; defaults :data:`MODEL`)."""
    for key, default in MODEL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=default)


def model_argv(args: argparse.Namespace) -> list[str]:
    """The options that give another process the GPT of ``args``."""
    return [x for key in MODEL for x in ("--" + key.replace("_", "-"), str(getattr(args, key)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model, 2 reps (< 1 min)")
    ap.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    add_model_args(ap)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per engine (cpuckpt: one more, listed apart)")
    ap.add_argument("--next-steps", type=int, default=4, help="training steps timed after each save")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--alone-steps", type=int, default=5)
    ap.add_argument("--engines", default="torch,cpuckpt",
                    help=f"comma-separated, of: {', '.join(ENGINES)}")
    ap.add_argument("--decoupled-writer", default="PYTHON", choices=("PYTHON", "FAST"),
                    help="DeepSpeed's writer type for the decoupled engine (FAST: async_io op, JIT-built)")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--checksum", default="crc32c", choices=("crc32c", "none"),
                    help="integrity.checksum of cpuckpt's saves (crc32c per chunk, kept in each tag's marker)")
    ap.add_argument("--verify", action="store_true", help="save the same state with both engines and compare")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each non-torch engine's first and last save_checkpoint calls (caller's thread)")
    ap.add_argument("--dir", default="", help="checkpoint root (default: /root/cpuckpt-bench-ds on CUDA, else tmp)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON file, or a directory for its JSON")
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if args.smoke:
        vars(args).update(SMOKE_MODEL)
        args.reps, args.next_steps, args.warmup, args.alone_steps = 2, 2, 1, 2
        args.verify = True
    elif not args.dir and torch.cuda.is_available():
        args.dir = "/root/cpuckpt-bench-ds"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("DeepSpeed", "deepspeed", "cpuckpt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_deepspeed.py needs a CUDA device (or --smoke for a CPU run)")
    bench = Bench(args)
    t0 = time.perf_counter()
    try:
        bench.run()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    bench.record("total", s=time.perf_counter() - t0)
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "bench_deepspeed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": bench.results}, indent=1, default=str))
    print(bench.table())


if __name__ == "__main__":
    main()
