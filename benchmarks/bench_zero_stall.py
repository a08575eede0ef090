"""Zero-stall saves on the GPU: how long the training thread is blocked, and what a real step pays.

Run on the device machine (one H200), from the repository root::

    python3 -m benchmarks.bench_zero_stall --gib 4 --reps 5 --out $OUT --dir /root/cpuckpt-zs
    python3 -m benchmarks.bench_zero_stall --smoke --out /tmp/zs     # CPU, tiny sizes, < 1 min

Two parts, each in one process, warm (the host pool prepared, one discarded save per variant):

1. **Bench state** (``--gib``, ~1,422 GPU tensors, ``benchmarks.common.build_state_dict``). *Blocked*:
   from the save call (GPU synchronised before it) until the training thread may enqueue work that
   writes saved tensors, without synchronising after:

   * cpuckpt ``ordering="host"``: ``async_save`` + ``staged.wait()`` (today's adapters' default);
   * cpuckpt ``ordering="stream"``: ``async_save`` + ``wait_stream()`` (a GPU-side wait);
   * DCP ``async_save`` with ``DefaultStager(use_async_staging=True, pinned, non-blocking)``: the
     call returning (its staging runs on a thread); DCP's contract then needs a *host* wait on
     ``staging_completion`` before a saved tensor changes, listed as "staging wait".

   Beside them: the pinned D2H floor of the same tensors, and "copies done" (the GPU synchronised
   after the blocked part: when the bytes are really in host memory).
2. **A real step overlapping the copy**: an MLP stack (``--layers`` x ``--dim``^2, fp32 weights, bf16
   autocast) trained with fused Adam; the saved state is its own ``model.state_dict()`` and
   ``optimizer.state_dict()``. A step is forward + backward + optimizer step. *Alone*: the median
   step with no save. *With a save*: the save call at the step's start, the ordering point right
   before ``optimizer.step()`` (``wait_stream`` / ``staged.wait()`` / DCP's staging wait), timed to
   the end of the step (GPU synchronised). The issue's target: <= 1.05 x alone. Each save is then
   waited for (durable) before the next, outside the timing. One stream-ordered save is checked
   bit-exact against the values at its call after its step changed every saved tensor.

``--profile`` adds a cProfile of the cpuckpt variants' save calls (the caller's thread: where the
blocked time goes, per function). Raw JSON goes to ``--out``; one table is printed last. Checkpoints
under ``--dir`` are deleted at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from benchmarks.common import (
    GB,
    GiB,
    ResultLog,
    build_state_dict,
    copy_floors,
    device_sync,
    format_table,
    fresh,
    named_tensors,
    state_dict_nbytes,
    summarize,
)
from cpuckpt.transfer.staging import release_pool

logger = logging.getLogger("bench_zero_stall")
RESULTS = ResultLog(logger)
record = RESULTS.record

# staging.pool_bytes 0: snapshot saves
CFG: dict[str, Any] = {"io": {"threads": 8}, "staging": {"pool_bytes": 0}, "integrity": {"checksum": "crc32c"}}


def _stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=torch.cuda.is_available()))


class Saver:
    """One variant: ``start(state, path)`` returns an opaque handle once the training thread may go on
    reading; ``order(h)`` is the ordering point before saved tensors change; ``finish(h)`` waits durable."""

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, state: dict[str, Any], path: Path) -> Any:
        if self.name == "dcp-async-stager":
            stager = _stager()  # one per save: torch 2.11 raised KeyError on a second save with one stager
            resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path)), async_stager=stager)
            return resp, stager
        return cpuckpt.async_save(state, path, CFG, ordering="stream" if self.name == "cpuckpt-stream" else "host")

    def order(self, h: Any) -> None:
        if self.name == "dcp-async-stager":
            resp, _ = h
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()
        elif self.name == "cpuckpt-stream":
            h.wait_stream()
        else:
            h.staged.wait()

    def finish(self, h: Any) -> None:
        if self.name == "dcp-async-stager":
            resp, stager = h
            (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
            stager.close()
        else:
            h.wait()


VARIANTS = ("cpuckpt-host", "cpuckpt-stream", "dcp-async-stager")


# ------------------------------------------------------------------------------------- bench state
def bench_state_blocked(sd: dict[str, Any], root: Path, reps: int, profile: bool = False) -> None:
    for name in VARIANTS:
        saver = Saver(name)
        prof = cProfile.Profile() if profile and name.startswith("cpuckpt") else None
        for rep in range(reps + 1):  # rep 0: warm-up (plans, pool, item cache), not summarised
            path = fresh(root / "state")
            device_sync()
            t0 = time.perf_counter()
            try:
                if prof is not None and rep:
                    prof.enable()
                h = saver.start(sd, path)
                if prof is not None and rep:
                    prof.disable()
                t_call = time.perf_counter() - t0
                saver.order(h)
                blocked = time.perf_counter() - t0
                device_sync()
                copies = time.perf_counter() - t0
                saver.finish(h)
            except Exception as e:  # a peer that fails here is reported, not fatal
                record("state_blocked", variant=name, rep=rep, error=repr(e))
                break
            stats = getattr(h, "stats", None)
            record("state_blocked", variant=name, rep=rep, call_s=t_call, blocked_s=blocked, copies_done_s=copies,
                   durable_s=time.perf_counter() - t0, resolved=getattr(stats, "resolved", None),
                   planned=getattr(stats, "planned", None))
        if prof is not None:  # the caller's thread only: where the call's time goes, per function
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            record("state_call_profile", variant=name, reps=reps, top=out.getvalue()[-6000:])
            logger.info("call profile, %s, %d saves:\n%s", name, reps, out.getvalue()[-6000:])


# ------------------------------------------------------------------------------------- real model
class Model(torch.nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return self.norm(x)


def _step(model: Model, opt: torch.optim.Optimizer, x: torch.Tensor, before_update: Callable[[], None]) -> None:
    dev = x.device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model: Model, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def real_step(root: Path, layers: int, dim: int, tokens: int, reps: int, device: str) -> None:
    torch.manual_seed(0)
    model = Model(layers, dim).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device == "cuda")
    x = torch.randn(tokens, dim, device=device)
    for _ in range(3):
        _step(model, opt, x, lambda: None)
    state_bytes = state_dict_nbytes(_state(model, opt))
    nparams = sum(p.numel() for p in model.parameters())
    floor_s = copy_floors(_state(model, opt), 2)[1]["d2h"]["median"] if device == "cuda" else float("nan")

    def timed_step(before: Callable[[], Any], order: Callable[[Any], None]) -> tuple[float, float, Any]:
        device_sync()
        t0 = time.perf_counter()
        h = before()
        call = time.perf_counter() - t0
        _step(model, opt, x, lambda: order(h))
        device_sync()
        return time.perf_counter() - t0, call, h

    alone = [timed_step(lambda: None, lambda h: None)[0] for _ in range(max(5, reps))]
    record("model", layers=layers, dim=dim, tokens=tokens, params=nparams, state_bytes=state_bytes,
           d2h_floor_s=floor_s, step_alone=summarize(alone))
    for name in VARIANTS:
        saver = Saver(name)
        for rep in range(reps + 1):
            path = fresh(root / "model")
            try:
                dt, call, h = timed_step(lambda s=saver, p=path: s.start(_state(model, opt), p), saver.order)
                saver.finish(h)
            except Exception as e:
                record("model_step", variant=name, rep=rep, error=repr(e))
                break
            record("model_step", variant=name, rep=rep, step_s=dt, call_s=call,
                   vs_alone=dt / summarize(alone)["median"])
            _step(model, opt, x, lambda: None)  # one plain step between saves
    check_bit_exact(model, opt, x, root / "exact")


def check_bit_exact(model: Model, opt: torch.optim.Optimizer, x: torch.Tensor, path: Path) -> None:
    """A stream-ordered save, then a step that changes every saved tensor: the checkpoint holds the call's values."""
    want = {k: v.detach().cpu().clone() for k, v in named_tensors(_state(model, opt)).items()}
    h = cpuckpt.async_save(_state(model, opt), fresh(path), CFG, ordering="stream")
    _step(model, opt, x, h.wait_stream)
    h.wait()
    got = {k: torch.empty_like(v) for k, v in want.items()}
    cpuckpt.load(_unflatten(got), path, CFG)
    bad = [k for k, v in want.items()
           if not torch.equal(v.reshape(-1).view(torch.uint8), got[k].reshape(-1).view(torch.uint8))]
    changed = sum(not torch.equal(v, t.detach().cpu()) for (k, v), t in
                  zip(want.items(), named_tensors(_state(model, opt)).values()))
    record("model_bit_exact", tensors=len(want), mismatched=bad[:5], n_mismatched=len(bad), changed_by_step=changed)


def _unflatten(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``named_tensors``' dotted names back into a nested dict of the same shape (keys as strings)."""
    out: dict[str, Any] = {}
    for name, t in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t
    return out


# ------------------------------------------------------------------------------------------- table
def table(floor_d2h: float) -> str:
    rows: list[Any] = []
    for name in VARIANTS:
        runs = [r for r in RESULTS if r["name"] == "state_blocked" and r["variant"] == name and r.get("rep")]
        err = [r for r in RESULTS if r["name"] == "state_blocked" and r["variant"] == name and "error" in r]
        if err:
            rows.append([f"bench state: {name}", "error", err[0]["error"][:60], "-", "-"])
            continue
        if not runs:  # --parts without the bench state
            continue
        b = summarize([r["blocked_s"] for r in runs])
        c = summarize([r["copies_done_s"] for r in runs])
        rows.append([f"bench state: {name}", f"{b['median']:.4f} ({b['min']:.4f}-{b['max']:.4f})",
                     f"{b['median'] / floor_d2h:.2f} x D2H", f"{c['median']:.4f}",
                     f"{runs[0].get('resolved') or '-'}"])
    model = [r for r in RESULTS if r["name"] == "model"]
    if model:
        m = model[0]
        alone = m["step_alone"]["median"]
        rows.append(None)
        rows.append([f"model {m['layers']}x{m['dim']}^2, {m['tokens']} tokens: step alone", f"{alone:.4f}",
                     f"state {m['state_bytes'] / GB:.2f} GB", f"D2H floor {m['d2h_floor_s']:.4f}", "-"])
        for name in VARIANTS:
            runs = [r for r in RESULTS if r["name"] == "model_step" and r["variant"] == name and r.get("rep")]
            err = [r for r in RESULTS if r["name"] == "model_step" and r["variant"] == name and "error" in r]
            if err:
                rows.append([f"  step with save: {name}", "error", err[0]["error"][:60], "-", "-"])
                continue
            s = summarize([r["step_s"] for r in runs])
            c = summarize([r["call_s"] for r in runs])
            rows.append([f"  step with save: {name}", f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})",
                         f"{s['median'] / alone:.3f} x alone", f"call {c['median']:.4f}", "-"])
    exact = [r for r in RESULTS if r["name"] == "model_bit_exact"]
    foot = [f"bit-exact check (stream ordering, step changed {exact[0]['changed_by_step']} of {exact[0]['tensors']} "
            f"tensors): {exact[0]['n_mismatched']} mismatched"] if exact else []
    return format_table(["what", "blocked / step s, median (min-max)", "ratio", "copies done s / call s",
                         "items"], rows, title="zero-stall saves", footnotes=foot)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="bench state size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--dir", default="/root/cpuckpt-zs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU allowed, tiny sizes")
    ap.add_argument("--parts", default="state,model")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the bench state's save calls (caller's thread); printed and in the JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("cpuckpt").setLevel(logging.WARNING)
    if args.smoke:
        args.gib, args.reps, args.layers, args.dim, args.tokens = 0.05, 2, 2, 256, 512
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench_zero_stall needs a CUDA device (or --smoke)")
    root = Path(args.dir)
    record("machine", gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
           cpus=os.cpu_count())
    floor = float("nan")
    try:
        if "state" in args.parts:
            sd = build_state_dict(int(args.gib * GiB), device=device)
            nbytes = state_dict_nbytes(sd)
            _, floors = copy_floors(sd, args.reps)
            floor = floors["d2h"]["median"]
            record("state", GiB=nbytes / GiB, tensors=len(named_tensors(sd)), d2h_floor=floors["d2h"])
            cpuckpt.prepare_pool(nbytes, CFG)
            bench_state_blocked(sd, root, args.reps, args.profile)
            del sd
            release_pool()
            if device == "cuda":
                torch.cuda.empty_cache()
        if "model" in args.parts:
            real_step(root, args.layers, args.dim, args.tokens, args.reps, device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_zero_stall.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(table(floor))


if __name__ == "__main__":
    main()
