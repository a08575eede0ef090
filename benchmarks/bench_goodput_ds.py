"""Goodput with DeepSpeed: whole training runs with and without checkpoints, timed by the job's own log lines.

The DeepSpeed side of ``bench_goodput`` (issue 29). Every variant is a whole run of this module's trainer in a
fresh process (``--train``: one rank, ZeRO-1, bf16, ``torch_adam``, the GPT of ``bench_deepspeed``: 18 x 2048,
~0.97 B parameters, ~13.6 GB per checkpoint), one after the other in one call:

``none``      no checkpoints (the reference of every ratio)
``ds8``       DeepSpeed's own engine (``TorchCheckpointEngine``: ``torch.save`` per file), a save every 8
``cpuckpt8``  cpuckpt to disk every 8 (``ordering: optimizer``: the copies overlap the next forward and backward)
``mem8``      cpuckpt's memory tier every 8, durable every 64 (``memory.persist_every``), 3 slots
``mem1``      the memory tier every iteration, durable every 64
``+ahead``    after a memory variant (``mem8+ahead``): ``memory_save_dir`` set, the slots' images reserved inside
              ``deepspeed.initialize`` instead of by the first save into each slot
``+snap``     ``staging.device_snapshot``: a save copies the state on the device (the next step waits for that
              only), the host copies follow from the snapshot
``+copyproc`` ``memory.copy_process``: the snapshot's device-to-host copies and the checksums run in a process of
              ours (CUDA IPC), none in the trainer's (with ``+snap``: the engine Megatron-LM's goodput measured best)
``+nocrc``    ``memory.checksum: false``: no checksums of the memory saves (what they cost the training beside
              it: with crc32c, reading every image back; with blocksum32, the GPU's reduction and the host share)
``+bsum``     ``memory.checksum_kind: blocksum32``: with ``+snap+copyproc`` the device bytes' share of the checksums
              summed on the GPU, the rest by the copy process (no read of every image back); what the default
              ``auto`` takes there
``+crc``      ``memory.checksum_kind: crc32c``: every image read back for its crc32c (the default before session 43)
``+slots<N>`` ``memory.slots: N`` (2-9) instead of 3 (the adapter's default is 2: a slot fewer to reserve and pin
              before training, 13.6 GB)

The trainer prints one line per iteration (``iteration N/M | elapsed time per iteration (ms): ... | at T s |``, the
host time since the previous line and the time of the line, by its own clock); the result is the wall time from
iteration ``--warm`` to the last, by the trainer's clock (the job's own wall clock, not a framework's timer),
over ``none``'s, as in ``bench_goodput`` (per save, largest gap against the median,
launch to exit). ``engine.destroy()`` ends every run (the memory variants persist their newest tag there, as a
job ending does). ``--pyspy VARIANTS`` records those variants' trainer with ``py-spy record --gil`` from outside for
``--pyspy-seconds`` from iteration warm + 2, as ``bench_goodput`` does (which of its threads held the interpreter,
and where; the sampler's cost is in that run's wall too, so its ratio is not the result). ``+base`` runs a variant
with ``--base-site``'s cpuckpt first on the path, ``+rep<N>`` runs it again under another name, ``+u1`` with
``memory.max_uncommitted: 1``. ``--kill VARIANTS`` also runs those memory variants killed (the whole job, as
iteration ``--kill-after-log``'s line arrives) and relaunched from the newest complete tag: the iterations lost, and
whether the relaunch logs the losses of ``none``. ``--sample VARIANTS`` samples those variants' trainer's main thread
inside its loop every 2 ms (``benchmarks/stack_sampler``, as ``bench_goodput --sample``): where a save's time goes,
as ms per iteration against ``none``'s (sample ``none`` too; the sampler's cost is in the sampled runs' wall).

    python -m benchmarks.bench_goodput_ds --out $OUT                       # one H200
    python -m benchmarks.bench_goodput_ds --smoke --out /tmp/g             # CPU, gloo, a tiny model
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_deepspeed import GPT, SMOKE_MODEL, add_model_args, free_port, import_adapter, model_argv
from benchmarks.bench_goodput import (
    GilProfile,
    _saves_between,
    gil_table,
    goodput,
    read_samples,
    sample_env,
    sample_table,
    summarize,
)
from benchmarks.bench_megatron_lm import JobKiller, run
from benchmarks.common import file_safe, format_table

logger = logging.getLogger("bench_goodput_ds")

VARIANTS = ("none", "ds8", "cpuckpt8", "mem8", "mem1")
EVERY = {"none": 0, "ds8": 8, "cpuckpt8": 8, "mem8": 8, "mem1": 1}
# u1: memory.max_uncommitted 1 (the step after a save waits for it)
MODIFIERS = ("ahead", "snap", "copyproc", "u1", "nocrc", "bsum", "crc")
_REPEAT = re.compile(r"rep\d+")  # the same run again under another name (pairs alternated in one call)
_SLOTS = re.compile(r"slots([2-9])")  # memory.slots instead of 3 (the adapter's default, configs/deepspeed.yaml: 2)


def settings(variant: str, ram: str, durable_every: int, save: str = "") -> dict[str, Any] | None:
    """The adapter's settings of ``variant`` (None: DeepSpeed's own engine) and its modifiers (:data:`MODIFIERS`)."""
    base, *mods = variant.split("+")
    if base in ("none", "ds8"):
        return None
    out: dict[str, Any] = {"ordering": "optimizer", "io": {"threads": 8}}
    if base.startswith("mem"):
        slots = next((int(m.group(1)) for x in mods if (m := _SLOTS.fullmatch(x))), 3)
        out.update(memory_tier=True, memory={"root": ram, "slots": slots, "persist_every": durable_every,
                                             "copy_process": "copyproc" in mods})
        if "ahead" in mods:
            out["memory_save_dir"] = save
        if "u1" in mods:
            out["memory"]["max_uncommitted"] = 1
        if "nocrc" in mods:
            out["memory"]["checksum"] = False
        if "bsum" in mods:
            out["memory"]["checksum_kind"] = "blocksum32"
        if "crc" in mods:
            out["memory"]["checksum_kind"] = "crc32c"
    if "snap" in mods:
        out["staging"] = {"device_snapshot": True}
    return out


def check_variant(name: str, base_site: str = "") -> str | None:
    """Why ``name`` is not a variant (None: it is)."""
    base, *changes = name.split("+")
    slots = [m for m in changes if _SLOTS.fullmatch(m)]
    mods = [m for m in changes if m != "base" and not _REPEAT.fullmatch(m) and m not in slots]
    if len(slots) > 1:
        return f"{name}: one +slots<N> at most"
    if slots and not base.startswith("mem"):
        return f"{name}: +slots<N> needs a memory variant"
    if base not in VARIANTS:
        return f"unknown variant {base}; known: {VARIANTS}"
    if not set(mods) <= set(MODIFIERS) or len(set(changes)) != len(changes):
        return f"{name}: modifiers are {MODIFIERS}, +slots<N>, +base and +rep<N>, each once"
    if len({"bsum", "crc", "nocrc"} & set(mods)) > 1:
        return f"{name}: +bsum, +crc and +nocrc are three different checksum settings: one at most"
    if "base" in changes and not base_site:
        return f"{name}: +base needs --base-site"
    if mods and base in ("none", "ds8"):
        return f"{name}: modifiers are cpuckpt's"
    if not base.startswith("mem") and set(mods) - {"snap"}:
        return f"{name}: +ahead, +copyproc, +u1, +nocrc, +bsum and +crc need a memory variant"
    return None


# ------------------------------------------------------------------------------------------ trainer
def train(args: argparse.Namespace) -> int:
    """One whole run (``--train``): set up, ``--iters`` iterations with a save every ``EVERY[variant]``, destroy."""
    import torch


    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.deterministic:  # the same kernels in every run, so a relaunch's losses can be compared with none's
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)  # their backward accumulates with atomics: the math kernel
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)  # and cuDNN's (picked on the H100 with the two above off)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "CROSS_SIZE": "1", "CROSS_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # an op DeepSpeed would JIT-build (g++)
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    ckpt = settings(args.variant, args.ram, args.durable, args.save)
    if ckpt is not None:
        import_adapter().install(ckpt)
    torch.manual_seed(0)
    with device:
        model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    every = EVERY[args.variant.split("+")[0]]
    first = 1
    if args.resume:  # the relaunch after a whole-job kill: the newest complete tag of both tiers
        path, _ = import_adapter().load_latest(engine, args.save)
        print(f"resumed from global step {engine.global_steps} ({path})", flush=True)
        first = engine.global_steps + 1
    _train_loop(engine, args, first, every, device)
    engine.destroy()
    return 0


def _train_loop(engine: Any, args: argparse.Namespace, first: int, every: int, device: Any) -> None:
    """Iterations ``first``..``--iters``, a save after every ``every``-th (the frame ``--sample`` samples in)."""
    import torch

    last = time.perf_counter()
    for it in range(first, args.iters + 1):
        g = torch.Generator(device=device).manual_seed(it)
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=device, generator=g)
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        value = loss.item()  # the loss report of the iteration (as Megatron-LM's training_log reads it)
        now = time.perf_counter()
        print(f" iteration {it:8d}/{args.iters:8d} | elapsed time per iteration (ms): {1e3 * (now - last):.1f} | "
              f"loss {value:.6f} | at {now:.6f} s |", flush=True)
        if every and it % every == 0:
            engine.save_checkpoint(args.save, tag=f"global_step{it}")
        last = time.perf_counter()


# ------------------------------------------------------------------------------------------- driver
_AT_RE = re.compile(r"iteration\s+(\d+)/.*\| at ([\d.]+) s \|")


def own_clock(log: Path) -> list[dict[str, Any]]:
    """The iterations by the trainer's own clock (its lines' ``at``), not by when their lines arrived: a reader
    starved on a loaded box (the CPU smoke run beside a test suite) took a burst of lines at one instant."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [{"it": int(m.group(1)), "t": float(m.group(2))} for m in _AT_RE.finditer(text)]


_LOSS_RE = re.compile(r"iteration\s+(\d+)/.*\| loss (\S+) \|")
_RESUMED_RE = re.compile(r"resumed from global step (\d+)")


def logged_losses(log: Path) -> dict[int, str]:
    """The loss each iteration logged (as printed: a bit-identical run prints the same)."""
    try:
        return {int(m.group(1)): m.group(2) for m in _LOSS_RE.finditer(log.read_text(errors="replace"))}
    except OSError:
        return {}


def kill_and_resume(name: str, argv_run: list[str], env: dict[str, str], out: Path, timeout: float, at: int,
                    reference: dict[int, str]) -> dict[str, Any]:
    """Run ``name`` again, SIGKILL the whole job (its writers aside) as iteration ``at``'s log line arrives, relaunch
    it from the newest complete tag (``load_latest``): the iterations lost, and whether every iteration the relaunch
    logged has ``reference``'s loss (the run without checkpoints)."""
    killer = JobKiller(at, logged=True)
    killed_log, resumed_log = out / f"ds_{file_safe(name)}_killed.log", out / f"ds_{file_safe(name)}_resumed.log"
    run(f"{name}-killed", argv_run, env, killed_log, timeout, killer)
    resumed = run(f"{name}-resumed", [*argv_run, "--resume"], env, resumed_log, timeout)
    logged, got = logged_losses(killed_log), logged_losses(resumed_log)
    try:
        m = _RESUMED_RE.search(resumed_log.read_text(errors="replace"))
    except OSError:
        m = None
    last, start = max(logged, default=None), int(m.group(1)) if m else None
    both = sorted(reference.keys() & got.keys())
    differ = [it for it in both if reference[it] != got[it]]
    before = sorted(reference.keys() & logged.keys())  # the control: the killed run itself, up to the kill
    return {"killed": killer.info["killed"], "last_logged": last, "resumed_from": start,
            "iterations_lost": None if last is None or start is None else last - start, "relaunch_rc": resumed["rc"],
            "compared": len(both), "values_differ_at": differ[:10], "values_equal": None if not both else not differ,
            "before_kill_compared": len(before),
            "before_kill_equal": None if not before else all(reference[it] == logged[it] for it in before)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=100, help="iterations per run (the issue's window: 10-100)")
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--durable", type=int, default=64, help="memory.persist_every of the memory variants")
    add_model_args(ap)
    ap.add_argument("--root", default="/root/cpuckpt-goodput-ds", help="durable checkpoints (deleted after)")
    ap.add_argument("--ram", default="/dev/shm/cpuckpt-goodput-ds-ram", help="the memory tier's RAM root")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model, few iterations")
    ap.add_argument("--pyspy", default="", help="variants whose trainer's GIL is profiled by py-spy from outside")
    ap.add_argument("--pyspy-seconds", type=float, default=6.0)
    ap.add_argument("--sample", default="", help="variants whose trainer's main thread is sampled (a profile)")
    ap.add_argument("--base-site", default="", help="another cpuckpt install (a baseline commit's wheel): variants "
                    "named +base run with it first on PYTHONPATH (before and after in one call)")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the trainer of one run
    ap.add_argument("--variant", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--save", default="", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kill", default="", help="memory variants also run SIGKILLed (the whole job, its writers "
                    "aside) as iteration --kill-after-log's line arrives, then relaunched from the newest tag: the "
                    "iterations lost, and whether the relaunch logs the losses of none (run first)")
    ap.add_argument("--kill-after-log", type=int, default=30)
    ap.add_argument("--deterministic", action="store_true", help="every run with deterministic kernels (math "
                    "attention, torch's deterministic algorithms): without, DeepSpeed's GPU runs differ from the "
                    "first iterations on, so --kill's relaunch cannot be compared with none")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE_MODEL)
        args.iters, args.warm, args.durable = 10, 2, 4
    if args.train:
        return train(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_goodput_ds_"))
    root = Path(args.root) if not args.smoke else tmp / "root"
    ram = args.ram if not args.smoke else str(tmp / "ram")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         *filter(None, os.environ.get("PYTHONPATH", "").split(":"))])}
    names = [v for v in args.variants.split(",") if v]
    for name in names:
        if (why := check_variant(name, args.base_site)) is not None:
            ap.error(why)
    killed = [v for v in args.kill.split(",") if v]
    if killed and names[:1] != ["none"]:
        ap.error("--kill compares the relaunch's losses with none's: run none first")
    if any(v not in names or not v.startswith("mem") for v in killed):
        ap.error("--kill names memory variants of --variants")
    if killed and not 0 < args.kill_after_log < args.iters:
        ap.error(f"--kill-after-log {args.kill_after_log} is not an iteration before the last ({args.iters})")
    results: dict[str, Any] = {"args": vars(args), "summary": [], "runs": {}}
    ref: dict[str, Any] | None = None
    rows: list[list[Any]] = []
    kills: list[list[Any]] = []
    try:
        for name in names:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)
            argv_run = [sys.executable, "-m", "benchmarks.bench_goodput_ds", "--train", "--variant", name,
                        "--save", str(root / name), "--ram", ram, "--iters", str(args.iters), "--durable",
                        str(args.durable), *model_argv(args), *(["--smoke"] if args.smoke else []),
                        *(["--deterministic"] if args.deterministic else [])]
            logger.info("== %s", name)
            gil = (GilProfile(out, f"ds_{name}", args.warm + 2, args.pyspy_seconds, pid_of=lambda proc: proc.pid)
                   if name in args.pyspy.split(",") else None)  # the trainer is the process itself (no torchrun)
            run_env = env
            if "base" in name.split("+")[1:]:
                run_env = {**env, "PYTHONPATH": os.pathsep.join([args.base_site, env["PYTHONPATH"]])}
            sampled = name in args.sample.split(",")
            # the trainer's main thread inside its loop (this module's _train_loop); "--train --variant" is in no
            # other process's command line (the writer's has --trainer-lock); the measured run only, not --kill's
            r = run(name, argv_run, sample_env(run_env, out, name, match="--train --variant",
                                               loop="bench_goodput_ds.py:_train_loop") if sampled else run_env,
                    out / f"ds_{file_safe(name)}.log", args.timeout, gil.hook() if gil else None)
            if gil is not None and (prof := gil.summary()) is not None:
                results.setdefault("gil", {})[name] = prof
            own = own_clock(Path(r["log"]))
            if r["iters"] and not own:
                logger.warning("%s: no trainer clock in its iteration lines; timed by their arrival", name)
            r["iters"] = own or r["iters"]
            if sampled and (sample := read_samples(out, name, max((x["it"] for x in r["iters"]), default=0))):
                results.setdefault("samples", {})[name] = sample
            g = goodput(r["iters"], args.warm)
            every = EVERY[name.split("+")[0]]
            s = summarize(name, r, ref, _saves_between(g.get("first", args.warm), g.get("last", args.iters), every),
                          args.warm, every)
            s["clock"] = "trainer" if own else "arrival"
            if name == "none":
                ref = {**g, "run_s": r["wall_s"]}
            results["summary"].append(s)
            results["runs"][name] = {k: v for k, v in r.items() if k in ("rc", "timed_out", "wall_s", "errors")}
            rows.append([name, s["rc"], s.get("ratio"), s.get("wall_s"), s.get("per_save_ms"), s.get("saves"),
                         f'{s.get("gap_max_ms")} @{s.get("gap_max_it")} ({s.get("gap_max_over_median")}x)',
                         s.get("gap_median_ms"), s.get("save_cost_in_run_ms"), s.get("run_s"),
                         s.get("run_over_none_s")])
            if name in killed:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(ram, ignore_errors=True)
                reference = logged_losses(out / "ds_none.log")
                k = kill_and_resume(name, argv_run, run_env, out, args.timeout, args.kill_after_log, reference)
                results.setdefault("kill", {})[name] = k
                kills.append([name, k["killed"], k["last_logged"], k["resumed_from"], k["iterations_lost"],
                              k["relaunch_rc"], f'{k["values_equal"]} ({k["compared"]} compared)',
                              f'{k["before_kill_equal"]} ({k["before_kill_compared"]} compared)'])
            (out / "bench_goodput_ds.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(format_table(
        ["variant", "rc", "wall x none", f"wall s it {args.warm}-last", "ms per save", "saves",
         "largest gap ms @it (x median)", "median gap ms", "save in run ms", "run s", "run - none s"], rows,
        title=f"goodput: DeepSpeed ZeRO-1 GPT {args.layers}x{args.hidden}, {args.iters} iterations, memory durable "
              f"every {args.durable}, slots 3 unless +slots<N>",
        footnotes=["wall: by the trainer's own clock in its iteration lines; run s: launch to exit; save in run: "
                   "saves every K >= 2, the gaps after a save (its call, the iterations its copies and checksums "
                   "overlap) over the quiet second half of the interval, summed: a save's cost within its own run "
                   "(per position in the JSON: after_save_ms)"]))
    if kills:
        print(format_table(["variant", "killed", "last logged", "resumed from", "iterations lost", "relaunch rc",
                            "losses equal none's", "killed run's equal none's (control)"], kills,
                           title=f"whole-job SIGKILL as iteration {args.kill_after_log}'s log line arrived, relaunched "
                                 "from the newest complete tag (load_latest)"))
    if results.get("gil"):
        print(gil_table(results["gil"]))
    if results.get("samples"):
        print(sample_table(results["samples"]))
    return 0 if all(s["rc"] == 0 for s in results["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
