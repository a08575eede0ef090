"""A tiny megatron-core GPT trained with asynchronous cpuckpt checkpoints; killed mid-save, resumed.

    # CPU, 2 gloo ranks (tensor parallel 2: each rank holds half of every matrix)
    torchrun --nproc-per-node 2 examples/megatron/train.py --save /tmp/mg --tp 2 --kill-at-step 15
    torchrun --nproc-per-node 2 examples/megatron/train.py --save /tmp/mg --tp 2 --resume
    # GPU: the same commands (NCCL, one rank per GPU); `--nproc-per-node 1` on a single GPU
    bash examples/megatron/run.sh          # all of it on CPU, checked

Real megatron-core: ``parallel_state.initialize_model_parallel``, ``GPTModel`` with the local layer
spec, ``model.sharded_state_dict()``, the optimizer's Adam state turned into ``ShardedTensor``s with
megatron-core's own helpers (``dist_checkpointing.optimizer``, the way its ``FP32Optimizer`` does),
``dist_checkpointing.save(..., sharded_strategy=cpuckpt's, async_sharded_save=True)`` and
``dist_checkpointing.load(..., sharded_strategy=cpuckpt's)``.

Checkpoints follow Megatron-LM's layout: ``<save>/iter_<step, 7 digits>/`` and a tracker file
``<save>/latest_checkpointed_iteration.txt`` written by rank 0 in a finalize function of the async
request, i.e. only once every rank's save is committed and ``metadata.json`` is written. A save that
is still in flight when the job dies is never named by the tracker, so ``--resume`` skips it.

The async request is run by megatron-core's ``AsyncCallsQueue`` (persistent worker) on GPUs. That queue
is CUDA-only (its completion check all-reduces a tensor on ``torch.cuda.current_device()``, its
callers call ``torch.cuda.synchronize`` / ``torch.cuda.set_device``), so on CPU the script uses
:class:`ThreadAsyncCalls`, a small stand-in with the same two methods.

With ``--events FILE`` rank 0 appends one JSON object per line (losses, saves, finalizations, the kill,
the resume) and with ``--snapshot-dir DIR`` every rank keeps a plain ``torch.save`` copy of what each
checkpoint should contain; ``--resume`` then compares the loaded state with it bit for bit. Both are
for checking the example (run.sh, tests/integrations/test_megatron_example.py), not for training.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cpuckpt.integrations.megatron.compat import mcore_async_kwargs

from cpuckpt.transfer.files import write_atomic

logger = logging.getLogger("megatron_example")

REPO = Path(__file__).resolve().parents[2]
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name


# ------------------------------------------------------------------------------------------ args
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--save", required=True, help="checkpoint root: <save>/iter_NNNNNNN/ + the tracker file")
    ap.add_argument("--steps", type=int, default=20, help="train up to this step (total, not per run)")
    ap.add_argument("--save-interval", type=int, default=5, help="async checkpoint every N steps")
    ap.add_argument("--kill-at-step", type=int, default=0,
                    help="save at step N, then SIGKILL every rank (and its checkpoint worker) at once, "
                         "with that save in flight")
    default_config = REPO / "configs" / "megatron.yaml"
    ap.add_argument("--config", default=str(default_config) if default_config.exists() else None,
                    help="cpuckpt settings YAML (default: configs/megatron.yaml)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (must divide the number of ranks)")
    ap.add_argument("--resume", action="store_true", help="load the checkpoint the tracker names, then go on")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per data-parallel rank per step")
    ap.add_argument("--events", default=None, help="JSON-lines event log (rank 0 appends)")
    ap.add_argument("--snapshot-dir", default=None,
                    help="keep torch.save copies of each saved state; --resume compares the loaded state with it")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ------------------------------------------------------------------------------------- helpers
class Events:
    """Rank 0's JSON-lines log: one flushed line per event (it survives a SIGKILL of the writer)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.file = open(path, "a", buffering=1) if path and rank == 0 else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            self.file.flush()


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("megatron", "torch.distributed"):  # megatron-core logs every save at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """torchrun's environment -> process group (NCCL on GPUs, gloo on CPU) -> megatron-core's groups."""
    from megatron.core import parallel_state

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    return rank, world


def init_rng(args: argparse.Namespace) -> None:
    """Same seed on every rank (the CPU initialisation draws each full matrix, then keeps this rank's part).

    megatron-core's tensor-parallel RNG tracker holds CUDA generator states, so it is seeded only on
    GPUs. On CPU the attention's ``get_cuda_rng_tracker().fork()`` (around the attention dropout, which
    is 0 here) gets megatron-core's no-op tracker: ``initialize_rng_tracker(inference_rng_tracker=True)``.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(args.seed)
    if args.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def presize_attention_buffer(args: argparse.Namespace) -> None:
    """On CPU: give megatron-core's global memory buffer its attention-scores tensor up front.

    ``DotProductAttention`` takes its ``[b * heads, sq, sk]`` scratch tensor from
    ``parallel_state.get_global_memory_buffer()``, which allocates on ``torch.cuda.current_device()``
    only when the buffer it holds under that name is missing or too small; one CPU tensor of the right
    size placed there first is what every later call returns a view of.
    """
    from megatron.core import parallel_state

    if args.device != "cpu":
        return
    heads = HEADS // args.tp
    buffer = parallel_state.get_global_memory_buffer().buffer
    buffer[("mpu", torch.float32)] = torch.empty(args.micro_batch * heads * SEQ * SEQ, dtype=torch.float32)


# --------------------------------------------------------------------------------------- model
VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 128, 32, 64, 4, 2


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=args.tp, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
    return model.to(args.device)


def batch(step: int, args: argparse.Namespace, device: str) -> dict[str, torch.Tensor]:
    """Deterministic synthetic data, a function of (step, data-parallel rank) only: sequences that
    count up with a random start and stride (mod the vocabulary), so the next token is learnable."""
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(args.seed * 100_003 + step * 1009 + parallel_state.get_data_parallel_rank())
    start = torch.randint(0, VOCAB, (args.micro_batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.micro_batch, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    # causal mask in megatron-core's convention (True = masked), given explicitly: megatron-core's
    # default causal mask is allocated on "cuda"
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(SEQ).expand(args.micro_batch, SEQ).to(device),
            "attention_mask": mask.to(device)}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, args: argparse.Namespace) -> float:
    """Forward/backward on this rank's micro-batch, gradients averaged over the data-parallel group
    (by hand: megatron-core's DDP wrapper is optional), Adam step. Returns the global mean loss."""
    from megatron.core import parallel_state

    b = batch(step, args, args.device)
    per_token = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    loss = per_token.float().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    dp_group, dp_size = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_world_size()
    if dp_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp_size)
    optimizer.step()
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=dp_group)
    return (reported / dp_size).item()


# ------------------------------------------------------------------------- sharded state dict
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state before its first step (what megatron-core's ``init_state_fn`` does before a load)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["step"] = torch.tensor(0.0)
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                       *, is_loading: bool = False) -> dict[str, Any]:
    """Model + optimizer + iteration as megatron-core sharded state dict.

    The optimizer part mirrors megatron-core's ``FP32Optimizer.sharded_state_dict`` (which itself
    allocates on "cuda" in its constructor, hence not used here): ``exp_avg``/``exp_avg_sq`` become
    ``ShardedTensor``s sharded exactly like their parameter; the per-parameter ``step`` is saved once.
    The tensors are the live ones: the async save copies them before ``dist_checkpointing.save`` returns.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict()
    if is_loading:
        init_optimizer_state(optimizer)
    optim_sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    steps = {float(s["step"]) for s in optim_sd["state"].values()}
    if len(steps) > 1:
        raise RuntimeError(f"Adam's step differs between parameters: {steps}")
    common_step = next(iter(optim_sd["state"].values()))["step"] if optim_sd["state"] else None
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params),
                                  exclude_keys=("step",))
    if common_step is not None:
        optim_sd["state"]["common_step"] = common_step
    return {"model": model_sd, "optimizer": optim_sd, "iteration": step}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of :func:`sharded_state_dict`'s optimizer part (as ``FP32Optimizer.load_state_dict``)."""
    common_step = state["state"].pop("common_step", None)
    if common_step is not None:
        for param_state in state["state"].values():
            param_state["step"] = common_step.clone() if torch.is_tensor(common_step) else common_step
    optimizer.load_state_dict(state)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """This rank's part of the checkpoint of ``step``, as plain CPU copies: every ``ShardedTensor`` of
    :func:`sharded_state_dict` (named ``key@global_offset``, with where it sits in the global tensor),
    Adam's step and the iteration. What --snapshot-dir keeps and what the resumed state is compared with."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = sharded_state_dict(model, optimizer, step)
    tensors, index = {}, {}
    for t in nested_values(sd):
        if isinstance(t, ShardedTensor):
            name = f"{t.key}@{','.join(map(str, t.global_offset))}"
            tensors[name] = t.data.detach().cpu().clone()
            index[name] = (t.key, tuple(t.global_offset), t.prepend_axis_num)
    common_step = sd["optimizer"]["state"].get("common_step")
    return {"tensors": tensors, "index": index, "iteration": step,
            "adam_step": None if common_step is None else float(common_step)}


def compare(now: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """What differs between two :func:`snapshot`s: tensor names (dtype, shape or any bit), or the
    iteration / Adam step; empty when they are identical."""
    a, b = now["tensors"], saved["tensors"]
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                        y.reshape(-1).view(torch.uint8)):
            bad.append(k)
    bad += [k for k in ("iteration", "adam_step") if now[k] != saved[k]]
    return bad


# ---------------------------------------------------------------------------------- async calls
class ThreadAsyncCalls:
    """CPU stand-in for megatron-core's ``AsyncCallsQueue``, which calls torch.cuda and so needs a GPU.

    Same two methods as the queue, same contract: ``schedule_async_request`` starts the request's
    ``async_fn`` (here in a thread; cpuckpt's request only waits there for its own writer threads to
    commit), ``maybe_finalize_async_calls`` runs the oldest request's ``finalize_fns`` on every rank once
    every rank's ``async_fn`` has returned (the ranks agree through an all-reduce of a CPU tensor on the
    gloo group); ``blocking=True`` waits for all of them. cpuckpt's finalize function raises the save's
    error on every rank. Must be called on all ranks, like the original.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.calls: list[tuple[int, Any, threading.Thread]] = []
        self.call_idx = 0

    def schedule_async_request(self, request: Any) -> int:
        self.call_idx += 1
        kwargs = getattr(request, "async_fn_kwargs", None) or {}
        thread = threading.Thread(target=request.async_fn, args=tuple(request.async_fn_args), kwargs=kwargs,
                                  name=f"ckpt-async-{self.call_idx}", daemon=True)
        thread.start()
        self.calls.append((self.call_idx, request, thread))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list[int]:
        finalized = []
        while self.calls:
            call_idx, request, thread = self.calls[0]
            if blocking:
                thread.join()
            done = torch.tensor([0 if thread.is_alive() else 1], dtype=torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
            if not done.item():
                break
            self.calls.pop(0)
            for fn in request.finalize_fns:
                fn()
            finalized.append(call_idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self.calls)

    def close(self) -> None:
        self.maybe_finalize_async_calls(blocking=True)


def make_async_queue(device: str, config: str | None) -> Any:
    if device == "cuda":  # Megatron-LM's choice: one persistent worker process per rank
        from cpuckpt.integrations.megatron.guard import watch_async_queue
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # a worker killed from outside would otherwise leave megatron-core waiting forever; the
        # config's megatron: block says whether a failed save raises or training continues
        return watch_async_queue(AsyncCallsQueue(persistent=True), config=config)
    return ThreadAsyncCalls()


# -------------------------------------------------------------------------------- checkpointing
def iter_dir(save: str | Path, step: int) -> Path:
    return Path(save) / f"iter_{step:07d}"


def write_tracker(save: str, step: int) -> None:
    """Rank 0, in the request's last finalize function: name ``step`` as the latest complete checkpoint."""
    if dist.get_rank() != 0:
        return
    write_atomic(Path(save) / TRACKER, str(step).encode())  # tmp + fsync + rename + directory fsync


def read_tracker(save: str) -> int | None:
    path = Path(save) / TRACKER
    return int(path.read_text().strip()) if path.exists() else None


def schedule_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, args: argparse.Namespace,
                  strategy: Any, queue: Any, events: Events, on_finalized: Callable[[int], None]) -> float:
    """``dist_checkpointing.save(..., async_sharded_save=True)`` + tracker finalize fn; returns the stall (s)."""
    from megatron.core import dist_checkpointing

    path = iter_dir(args.save, step)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if queue.get_num_unfinalized_calls():
        logger.warning("step %d: starting a save while the previous one is not finalized yet", step)
    if args.snapshot_dir:
        Path(args.snapshot_dir).mkdir(parents=True, exist_ok=True)
        torch.save(snapshot(model, optimizer, step), Path(args.snapshot_dir) / f"iter_{step}_rank{dist.get_rank()}.pt")
    t0 = time.perf_counter()
    request = dist_checkpointing.save(sharded_state_dict(model, optimizer, step), str(path),
                                      sharded_strategy=strategy, async_sharded_save=True, **mcore_async_kwargs())

    def finalize() -> None:
        write_tracker(args.save, step)
        on_finalized(step)

    request.add_finalize_fn(finalize)
    queue.schedule_async_request(request)
    stall = time.perf_counter() - t0
    events("save_scheduled", step=step, stall_s=stall)
    logger.info("step %d: async save to %s scheduled, training stalled %.3f s", step, path.name, stall)
    return stall


def resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
           events: Events) -> int:
    """Load the checkpoint the tracker names (the newest complete one); returns its step (0: none)."""
    import cpuckpt.integrations.megatron as ckpt_mg
    from megatron.core import dist_checkpointing

    step = read_tracker(args.save)
    others = sorted(int(p.name[5:]) for p in Path(args.save).glob("iter_*") if p.name[5:].isdigit())
    if step is None:
        logger.warning("no %s in %s: starting from scratch", TRACKER, args.save)
        return 0
    skipped = [s for s in others if s > step]
    if skipped:
        logger.info("skipping %s: not finalized (no tracker entry; metadata.json present: %s)",
                    ", ".join(iter_dir(args.save, s).name for s in skipped),
                    ", ".join(str((iter_dir(args.save, s) / "metadata.json").exists()) for s in skipped))
    path = iter_dir(args.save, step)
    t0 = time.perf_counter()
    state = dist_checkpointing.load(sharded_state_dict(model, optimizer, 0, is_loading=True), str(path),
                                    sharded_strategy=ckpt_mg.load_strategy(args.config))
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    if state["iteration"] != step:
        raise RuntimeError(f"{path} holds iteration {state['iteration']}, the tracker says {step}")
    logger.info("resumed from %s (step %d) in %.2f s", path.name, step, time.perf_counter() - t0)
    verified = None
    saved_path = Path(args.snapshot_dir or ".") / f"iter_{step}_rank{dist.get_rank()}.pt"
    if args.snapshot_dir and not saved_path.exists():
        logger.warning("no %s: the loaded state is not compared with what was saved", saved_path)
    elif args.snapshot_dir:
        saved = torch.load(saved_path, weights_only=True)
        bad = compare(snapshot(model, optimizer, step), saved)
        all_bad: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_bad, (len(saved["tensors"]), bad))
        verified = {"tensors": sum(n for n, _ in all_bad), "mismatches": [b for _, bs in all_bad for b in bs]}
        if verified["mismatches"]:
            logger.error("loaded state differs from what was saved at step %d: %s", step, verified["mismatches"])
        else:
            logger.info("loaded state is bit-identical to what was saved at step %d (%d tensors on %d ranks)",
                        step, verified["tensors"], dist.get_world_size())
    events("resumed", step=step, skipped=skipped, verified=verified)
    return step


def crash(step: int) -> None:
    """SIGKILL this rank as a machine failure would: together with its child processes (megatron-core's
    persistent checkpoint worker on GPUs, which would otherwise wait for work forever); no cleanup runs."""
    logger.warning("step %d: SIGKILL now, with the save of step %d in flight", step, step)
    logging.shutdown()
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import cpuckpt.integrations.megatron as ckpt_mg
    from megatron.core import parallel_state

    rank, world = init_distributed(args)
    setup_logging(rank)
    events = Events(args.events, rank)
    events("start", resume=args.resume, tp=args.tp, world=world, device=args.device, steps=args.steps,
           kill_at_step=args.kill_at_step)
    init_rng(args)
    presize_attention_buffer(args)
    model = build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("GPTModel on %d %s ranks (tp=%d, dp=%d): %d parameters on this rank", world, args.device, args.tp,
                world // args.tp, n_params)

    start = resume(model, optimizer, args, events) if args.resume else 0
    # Megatron-LM's default (--ckpt-fully-parallel-save): the data-parallel replicas split the writing
    strategy = ckpt_mg.save_strategy(args.config, fully_parallel=True,
                                     parallelization_group=parallel_state.get_data_parallel_group())
    queue = make_async_queue(args.device, args.config)

    def on_finalized(step: int) -> None:
        events("finalized", step=step)
        logger.info("checkpoint of step %d finalized: %s now names it", step, TRACKER)

    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, optimizer, step, args)
        events("loss", step=step, loss=loss.hex())
        logger.info("step %3d  loss %.6f", step, loss)
        queue.maybe_finalize_async_calls(blocking=False)
        if step == args.kill_at_step:
            # Crash as a real run would: its earlier saves had a save interval's time to finish (this
            # toy's steps take milliseconds; megatron-core's persistent worker needs seconds to start).
            queue.maybe_finalize_async_calls(blocking=True)
        if step % args.save_interval == 0 or step == args.kill_at_step:
            schedule_save(model, optimizer, step, args, strategy, queue, events, on_finalized)
            if step == args.kill_at_step:
                events("kill", step=step, in_flight=queue.get_num_unfinalized_calls())
                dist.barrier()  # rank 0 recorded it: torchrun stops every rank at the first one's death
                crash(step)
    queue.maybe_finalize_async_calls(blocking=True)
    if hasattr(queue, "close"):
        queue.close()
    events("done", step=args.steps)
    logger.info("done: step %d, latest complete checkpoint: step %s", args.steps, read_tracker(args.save))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
