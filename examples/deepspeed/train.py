"""DeepSpeed ZeRO training with cpuckpt's checkpoint engine (CPU or GPU).

    deepspeed --num_gpus 2 examples/deepspeed/train.py --save-dir /tmp/ds_ckpt            # GPUs
    torchrun --nproc-per-node 2 examples/deepspeed/train.py --save-dir /tmp/ds_ckpt --cpu  # CPU, gloo

Saves every ``--save-every`` steps; ``save_checkpoint`` returns once the tensors are in host memory
and the checkpoint is committed (``latest`` written atomically) at the next step or at
``engine.destroy()``. Run it twice: the second run resumes from ``latest``. The files are the ones
DeepSpeed writes, so ``python <save-dir>/zero_to_fp32.py`` and ``ds_to_universal`` work on them.
"""

from __future__ import annotations

import argparse
import time

import cpuckpt.integrations.deepspeed as ckpt_ds
import deepspeed
import deepspeed.ops
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="gloo, fp32, torch Adam (no GPU, no op builds)")
    ap.add_argument("--config", default=None, help="cpuckpt settings YAML (configs/deepspeed.yaml)")
    args = ap.parse_args()

    if args.cpu:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip an inference-only JIT build
    ckpt_ds.install(args.config)  # before deepspeed.initialize
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": args.cpu}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": not args.cpu},
        "cpuckpt": {"async": True},  # a block here overrides the YAML, key by key
    }
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    path, _ = engine.load_checkpoint(args.save_dir)
    if path is not None and engine.global_rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}")
    dtype = next(engine.module.parameters()).dtype
    for _ in range(args.steps):
        x = torch.randn(4, 1024, device=engine.device, dtype=dtype)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if engine.global_steps % args.save_every == 0:
            t0 = time.perf_counter()
            engine.save_checkpoint(args.save_dir)
            if engine.global_rank == 0:
                print(f"step {engine.global_steps}: save_checkpoint returned in {time.perf_counter() - t0:.3f} s")
    engine.destroy()  # commits the last checkpoint: files durable, then `latest`


if __name__ == "__main__":
    main()
