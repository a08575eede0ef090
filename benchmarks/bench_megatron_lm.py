"""Megatron-LM's own ``pretrain_gpt.py``: ``--ckpt-format torch_dist`` against ``--ckpt-format cpuckpt``.

Both runs use the same model, the same save interval and ``--async-save --use-persistent-ckpt-worker``.
The cpuckpt run goes through ``python -m cpuckpt.integrations.megatron.launch`` (the script itself is
unmodified). A third run resumes from the cpuckpt checkpoint with stock ``--ckpt-format torch_dist``
(no cpuckpt anywhere in the load path), which shows the files stay loadable by stock Megatron-LM.

Parsed from Megatron-LM's log: the ``save-checkpoint`` timer (the trainer's stall per save), the
per-iteration times (iterations right after a save are listed apart: they pay for any background
work), and the time from the last log line to process exit (the final wait for the async save).

``--use-distributed-optimizer`` is left out: without Apex or Transformer Engine, Megatron-LM (main,
d98e8a64) cannot resume a distributed-optimizer checkpoint into a fresh optimizer
(``DistributedOptimizer.state_dict`` asserts a single Adam ``step`` and finds none), whatever the format.

Megatron-LM is not on PyPI and is not part of this repository: point ``--megatron-lm`` at a checkout
(``megatron/``, ``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``). From the repository root:

    python -m benchmarks.bench_megatron_lm --megatron-lm .megatron-lm --out $OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("bench_megatron_lm")

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+)")
SAVE_RE = re.compile(r"save-checkpoint \.*: \(?([\d.]+)(?:, ([\d.]+)\))?")
LOADED_RE = re.compile(r"successfully loaded checkpoint from (\S+).*iteration\D+(\d+)")

FLAGS = (
    "--transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 --bf16 "
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
    "--disable-bias-linear --log-interval 1 --log-throughput"
)


def model_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--ffn-hidden-size", str(int(args.hidden * 8 / 3) // 64 * 64),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.mbs),
        "--global-batch-size", str(args.mbs * args.nproc),
    ]


def run(name: str, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
    """Run one training job; keep its log with per-line timestamps; parse it."""
    t0 = time.perf_counter()
    iters: list[tuple[int, float]] = []
    saves: list[float] = []
    loaded: list[str] = []
    last_line_t = 0.0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            t = time.perf_counter() - t0
            log.write(f"[{t:8.2f}] {line}")
            if m := ITER_RE.search(line):
                iters.append((int(m.group(1)), float(m.group(2))))
                last_line_t = t
            elif m := SAVE_RE.search(line):
                saves.append(float(m.group(2) or m.group(1)))  # max across ranks
                last_line_t = t
            elif m := LOADED_RE.search(line):
                loaded.append(line.strip())
            if t > timeout_s:
                proc.kill()
                break
        rc = proc.wait()
    wall = time.perf_counter() - t0
    return {"name": name, "rc": rc, "wall_s": round(wall, 2), "iters": iters, "save_ms": saves,
            "exit_wait_s": round(wall - last_line_t, 2) if last_line_t else None, "loaded": loaded}


def summarize(r: dict, save_interval: int) -> dict:
    times = [ms for _, ms in r["iters"]]
    after_save = [ms for it, ms in r["iters"] if it > 1 and (it - 1) % save_interval == 0]
    steady = [ms for it, ms in r["iters"] if it > 5 and (it - 1) % save_interval != 0 and it % save_interval != 0]
    return {
        "run": r["name"], "rc": r["rc"],
        "save_checkpoint_ms": [round(x, 1) for x in r["save_ms"]],
        "iter_ms_median": round(statistics.median(steady), 1) if steady else None,
        "iter_ms_after_save": [round(x, 1) for x in after_save],
        "iter_ms_mean_all": round(statistics.fmean(times), 1) if times else None,
        "exit_wait_s": r["exit_wait_s"], "wall_s": r["wall_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", default=".megatron-lm")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--root", default="/root/cpuckpt-bench-mlm", help="checkpoint directories go here")
    ap.add_argument("--config", default="configs/megatron.yaml")
    ap.add_argument("--formats", default="torch_dist,cpuckpt")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="resume the cpuckpt checkpoint with stock --ckpt-format torch_dist")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--save-interval", type=int, default=50,
                    help="long enough for a save to persist before the next one (both formats wait otherwise)")
    ap.add_argument("--timeout", type=float, default=280.0, help="per run, seconds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    mlm = Path(args.megatron_lm).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(mlm), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    common = [*FLAGS.split(), *model_flags(args), "--train-iters", str(args.iters),
              "--save-interval", str(args.save_interval), "--eval-interval", str(10 * args.iters),
              "--async-save", "--use-persistent-ckpt-worker"]
    results = []
    for fmt in args.formats.split(","):
        save_dir = Path(args.root) / fmt
        shutil.rmtree(args.root, ignore_errors=True)  # one run's checkpoints at a time (disk space)
        if fmt == "cpuckpt":
            entry = ["-m", "cpuckpt.integrations.megatron.launch", str(mlm / "pretrain_gpt.py"),
                     "--ckpt-format", "cpuckpt", "--cpuckpt-config", args.config]
        else:
            entry = [str(mlm / "pretrain_gpt.py"), "--ckpt-format", fmt]
        logger.info("== %s", fmt)
        r = run(fmt, [*torchrun, *entry, *common, "--save", str(save_dir)], env, out / f"mlm_{fmt}.log",
                args.timeout)
        results.append(r)
        logger.info("%s", json.dumps(summarize(r, args.save_interval)))
    if args.resume and "cpuckpt" in args.formats.split(","):
        src = Path(args.root) / "cpuckpt"
        entry = [str(mlm / "pretrain_gpt.py"), "--ckpt-format", "torch_dist"]
        resume = [*FLAGS.split(), *model_flags(args), "--train-iters", str(args.iters + 5),
                  "--eval-interval", str(10 * args.iters), "--load", str(src), "--exit-on-missing-checkpoint",
                  "--override-opt-param-scheduler"]  # train-iters grew, so the LR schedule differs
        logger.info("== stock torch_dist resumes the cpuckpt checkpoint")
        r = run("resume-stock", [*torchrun, *entry, *resume], env, out / "mlm_resume.log", args.timeout)
        results.append(r)
    rows = [summarize(r, args.save_interval) for r in results]
    (out / "bench_megatron_lm.json").write_text(json.dumps({"args": vars(args), "runs": rows,
                                                            "raw": results}, indent=1))
    print("| run | rc | save-checkpoint (ms, per save) | iter ms (median) | iter ms right after saves "
          "| exit wait (s) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for s in rows:
        print(f"| {s['run']} | {s['rc']} | {s['save_checkpoint_ms']} | {s['iter_ms_median']} | "
              f"{s['iter_ms_after_save']} | {s['exit_wait_s']} | {s['wall_s']} |")
    for r in results:
        for line in r["loaded"]:
            print(f"{r['name']}: {line}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
