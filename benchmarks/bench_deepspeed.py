"""DeepSpeed checkpointing: DeepSpeed's ``TorchCheckpointEngine`` against cpuckpt's engine, one rank.

Run on the device machine (one H200) from the repository root, no torchrun needed::

    python3 -m benchmarks.bench_deepspeed --out $OUT/bench_deepspeed.json
    python3 -m benchmarks.bench_deepspeed --smoke --out /tmp/ds.json      # CPU, gloo, tiny model, < 1 min

One process, one DeepSpeed engine (a GPT-like decoder, bf16, ZeRO-1 by default, ``torch_adam``).
Its checkpoint holds the bf16 weights (``mp_rank_00_model_states.pt``) and the fp32 master weights
plus both Adam moments (``bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt``): about 14 bytes per
parameter, ~13.6 GB for the default ~0.97 B parameters.

For each engine, in the same process and on the same training state (the engine is built once with
DeepSpeed's default engine, then switched with ``cpuckpt.integrations.deepspeed.attach``), each
repetition does: one training step; ``engine.save_checkpoint(fresh_dir, tag)`` (timed: **stall**,
GPU synchronised before and after); then ``--next-steps`` training steps, each timed.

* torch (DeepSpeed's ``TorchCheckpointEngine``): ``torch.save`` per file, synchronous, no fsync.
  **persist** = stall + fsync of its files and directory right after the save (what durability
  costs on top); the next steps run after that.
* cpuckpt (async): ``save_checkpoint`` returns once the tensors are in the pinned host pool; files
  are written in the background. DeepSpeed asks a decoupled engine to commit at the next
  ``engine.step()`` (before the optimizer update); with ``background_commit`` (default) that commit
  continues on a background thread, so the step does not wait. **persist** = from the call to the
  end of the commit (files and directory fsynced, ``latest`` written). Its first repetition also
  allocates and pins the host pool and is listed apart.
* cpuckpt-blocking (``--engines ...,cpuckpt-blocking``): ``background_commit: false``, DeepSpeed's own
  decoupled timing: the first step after the save waits for the rest of the write.

"next step" is the first step after the save (cpuckpt-blocking: it includes the commit wait), "steady" the
median of the following ones, "alone" the median step time with no checkpoint in flight.
``--verify`` (on in ``--smoke``) also saves the same state with both engines and checks that every
tensor in the files is bit-identical. Old checkpoint directories are deleted before the next
repetition (the page cache cannot be dropped between repetitions on every machine). Prints a
markdown table; raw results go to ``--out`` (a ``.json`` path, or a directory to put
``bench_deepspeed.json`` in).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import GB, ResultLog, fsync_tree, median, named_tensors, same_tensor, tree_nbytes

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench_deepspeed")


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
        if self.cuda:
            torch.cuda.synchronize()

    # -- set-up ------------------------------------------------------------------------------------
    def init_distributed(self) -> None:
        import deepspeed
        import deepspeed.ops

        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        # an inference-only shared-memory op DeepSpeed would JIT-build (g++, ~30 s); gloo/nccl do the rest
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if self.cuda:
            torch.cuda.set_device(self.device)
        deepspeed.init_distributed(dist_backend="nccl" if self.cuda else "gloo")

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

    def step(self, engine: Any, k: int) -> float:
        g = torch.Generator(device=self.device).manual_seed(k)
        ids = torch.randint(0, self.args.vocab, (self.args.micro_batch, self.args.seq), device=self.device, generator=g)
        self.sync()
        t0 = time.perf_counter()
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        self.sync()
        return time.perf_counter() - t0

    # -- measurements ------------------------------------------------------------------------------
    def run_engine(self, engine: Any, label: str, reps: int, root: Path, counter: list[int]) -> None:
        """``reps`` save repetitions with the engine's current checkpoint engine."""
        ck = engine.checkpoint_engine
        commit_end: list[float] = []
        if label.startswith("cpuckpt"):  # note when the commit (started by the next step, maybe in the background) ends
            inner = ck._finish

            def finish(*a: Any) -> None:
                inner(*a)
                commit_end.append(time.perf_counter())

            ck._finish = finish
        prev: Path | None = None
        for rep in range(reps):
            counter[0] += 1
            self.step(engine, counter[0])
            if prev is not None:
                shutil.rmtree(prev, ignore_errors=True)
            save_dir = root / f"{label}_{rep}"
            commit_end.clear()
            self.sync()
            t0 = time.perf_counter()
            engine.save_checkpoint(str(save_dir), tag="t")
            self.sync()
            t1 = time.perf_counter()
            if label == "torch":
                fsync_tree(save_dir)
                persist = time.perf_counter() - t0
            steps = []
            for _ in range(self.args.next_steps):
                counter[0] += 1
                steps.append(self.step(engine, counter[0]))
            if label.startswith("cpuckpt"):
                self.adapter.commit_pending(engine)  # after the timed steps: a background commit ends here
                persist = commit_end[0] - t0 if commit_end else time.perf_counter() - t0
            nbytes = tree_nbytes(save_dir / "t")
            self.record("save", engine=label, rep=rep, stall_s=t1 - t0, persist_s=persist, bytes=nbytes,
                        GBps=nbytes / persist / GB, next_step_s=steps[0] if steps else None,
                        steady_step_s=median(steps[1:]), steps_s=steps)
            prev = save_dir
        if prev is not None:
            shutil.rmtree(prev, ignore_errors=True)
        if label.startswith("cpuckpt"):
            ck._finish = inner

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
        self.record("step_alone", median_s=median(alone), steps_s=alone)
        try:
            if "torch" in a.engines:
                self.run_engine(engine, "torch", a.reps, root, counter)
            settings = {"async": True, "io": {"threads": a.io_threads}, "integrity": {"checksum": a.checksum}}
            self.adapter.attach(engine, settings)
            if a.verify:
                self.verify(engine, root, counter, settings)
            if "cpuckpt" in a.engines:
                self.run_engine(engine, "cpuckpt", a.reps + 1, root, counter)  # rep 0 grows the host pool
            if "cpuckpt-blocking" in a.engines:  # DeepSpeed's own decoupled timing: step() waits for the commit
                self.adapter.attach(engine, dict(settings, background_commit=False))
                self.run_engine(engine, "cpuckpt-blocking", a.reps, root, counter)
            engine.destroy()
        finally:
            shutil.rmtree(root, ignore_errors=True)

    # -- report ------------------------------------------------------------------------------------
    def table(self) -> str:
        saves = [r for r in self.results if r["name"] == "save"]
        eng = next(r for r in self.results if r["name"] == "engine")
        alone = next(r for r in self.results if r["name"] == "step_alone")["median_s"]
        lines = [f"DeepSpeed ZeRO-{eng['stage']} bf16, {eng['params'] / 1e6:,.1f} M params, 1 rank, "
                 f"{self.device.type}; step alone {alone:.3f} s",
                 "",
                 "| engine | rep | stall s | persist s | GB | GB/s | next step s | steady step s |",
                 "|---|---|---:|---:|---:|---:|---:|---:|"]

        def row(engine: str, rep: str, st: float, pe: float, nb: float, ns: float | None, ss: float) -> str:
            return (f"| {engine} | {rep} | {st:.3f} | {pe:.2f} | {nb / GB:.2f} | {nb / pe / GB:.2f} | "
                    f"{'-' if ns is None else f'{ns:.3f}'} | {ss:.3f} |")

        for label in ("torch", "cpuckpt", "cpuckpt-blocking"):
            rows = [r for r in saves if r["engine"] == label]
            for r in rows:
                rep = f"{r['rep']}" + (" (first)" if label == "cpuckpt" and r["rep"] == 0 else "")
                lines.append(row(label, rep, r["stall_s"], r["persist_s"], r["bytes"], r["next_step_s"],
                                 r["steady_step_s"]))
            warm = rows[1:] if label == "cpuckpt" else rows
            if len(warm) > 1:
                lines.append(row(f"**{label}**", f"median of {len(warm)}", median([r["stall_s"] for r in warm]),
                                 median([r["persist_s"] for r in warm]), median([r["bytes"] for r in warm]),
                                 median([r["next_step_s"] for r in warm if r["next_step_s"] is not None]),
                                 median([r["steady_step_s"] for r in warm])))
        lines += ["",
                  "stall: save_checkpoint wall time (GPU synchronised). persist: torch = stall + fsync of its "
                  "files; cpuckpt = until the commit (started by the next step()) ended. next step: first "
                  "step after the save (cpuckpt-blocking: includes waiting for the write). GB = 1e9 bytes."]
        ver = [r for r in self.results if r["name"] == "verify"]
        if ver:
            lines.append(f"verify: same state saved by both engines, {ver[0]['tensors']} tensors compared, "
                         f"bit-identical: {ver[0]['ok']}")
        return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model, 2 reps (< 1 min)")
    ap.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per engine (cpuckpt: one more, listed apart)")
    ap.add_argument("--next-steps", type=int, default=4, help="training steps timed after each save")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--alone-steps", type=int, default=5)
    ap.add_argument("--engines", default="torch,cpuckpt")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--checksum", default="crc32c", choices=("crc32c", "none"),
                    help="integrity.checksum of cpuckpt's saves (crc32c per chunk, kept in each tag's marker)")
    ap.add_argument("--verify", action="store_true", help="save the same state with both engines and compare")
    ap.add_argument("--dir", default="", help="checkpoint root (default: /root/cpuckpt-bench-ds on CUDA, else tmp)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON file, or a directory for its JSON")
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    if args.smoke:
        args.layers, args.hidden, args.heads, args.vocab, args.seq, args.micro_batch = 2, 64, 4, 256, 32, 2
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
