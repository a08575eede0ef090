"""DeepSpeed 0.19 with cpuckpt's checkpoint engine, on 2 real gloo ranks (CPU, ``torch_adam``).

What is proven, with real DeepSpeed engines and files (no mocks):

- ZeRO-1, 2 and 3 (fp32): ``save_checkpoint`` through ``install()`` writes DeepSpeed's file names
  (plus the hidden completion marker, and no ``.cpuckpt-saving`` once committed; the marker's own
  tests are in test_deepspeed_marker.py);
  training continues (so the snapshot is tested: the saved tensors change right after ``save``);
  a new engine's ``load_checkpoint`` restores the parameters, the fp32 master partitions and every
  optimizer-state tensor bit-exact; ``zero_to_fp32``'s Python API on our files equals the live
  parameters at save time; every file also loads with ``torch.load(weights_only=True)`` plus our
  safe-globals list;
- decoupled saving: ``latest`` does not exist when ``save_checkpoint`` returns (the files may still
  be in flight), appears after the next ``step()``, and a save right before ``destroy()`` gets its
  ``latest`` too (written atomically, no ``latest.tmp`` left);
- a write failure (``io.backend: "fault:ENOSPC@..."`` from the ds_config ``"cpuckpt"`` block)
  raises from ``save_checkpoint`` (sync) or from the committing ``step()`` (async) on both ranks,
  and ``latest`` is not written;
- bf16 (ZeRO-1/2/3, ``bf16_zero_pp_rank_*`` optimizer files) round-trips the same way;
- fp16 with DeepSpeed's ``DynamicLossScaler`` (ZeRO-2 and 3; scale grown twice, one overflow
  recorded): a new engine's load restores the scaler's state (``cur_scale``, ``cur_iter``,
  ``last_overflow_iter``, ``cur_hysteresis``, ...) and every tensor bit-exact, and the resumed run's
  next 3 steps equal the uninterrupted run's (parameters bit-exact, scaler equal); the files' pickled
  globals (listed by ``get_unsafe_globals_in_checkpoint`` *outside* ``safe_globals``) are covered by
  ``safe_globals_for_deepspeed()``;
- ``python -m deepspeed.checkpoint.ds_to_universal`` (run as users run it, its own interpreter) on
  our ZeRO-2 (``--inject_missing_state``) and ZeRO-3 saves: every ``zero/<param>/fp32.pt`` equals
  the live parameter at save time, the Adam moments are written, and a new engine with
  ``"checkpoint": {"load_universal": true}`` loads it (tag from ``latest_universal``) with
  parameters and optimizer state bit-exact, then trains on;
- ``"cpuckpt": {"enabled": false}`` leaves DeepSpeed's engine in place, ``attach()`` switches a
  built engine over, and ``commit_pending()`` writes ``latest`` at once;
- single process: the file holds exactly the zip entries ``torch.save`` writes for a compact clone
  of the same state dict (views compacted, non-leaf views detached, shared objects kept), through
  either skeleton builder; the fast builder's skeleton of a DeepSpeed-shaped state is ``torch.save``'s
  byte for byte;
- ``python -m benchmarks.bench_deepspeed --smoke`` runs with every engine (torch, cpuckpt, cpuckpt-zero,
  DeepSpeed's decoupled) (and its check that DeepSpeed's engine and ours
  write bit-identical tensors for the same state holds).

``_setup_env`` marks DeepSpeed's inference-only shm op incompatible, so no op is JIT-built (no g++
or ninja needed, ~30-45 s saved); ``torch_adam`` avoids the fused-Adam build.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")


# ----------------------------------------------------------------------------------- rank side
def _setup_env() -> None:
    import deepspeed.ops
    import torch.distributed as dist

    # init_distributed would JIT-build a shared-memory all-reduce op (~30-45 s, g++ and ninja) that
    # only inference uses; marking it incompatible makes DeepSpeed skip it (gloo does the rest).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")


def _ds_config(stage: int, cpuckpt: dict | None = None, bf16: bool = False, extra: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64})
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if cpuckpt is not None:
        cfg["cpuckpt"] = cpuckpt
    cfg.update(extra or {})
    return cfg


def _engine(stage: int, seed: int, cpuckpt: dict | None = None, bf16: bool = False, extra: dict | None = None):
    import deepspeed
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_ds_config(stage, cpuckpt, bf16, extra))
    return engine


def _step(engine, k: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + k * 7 + engine.global_rank)
    x = torch.randn(2, 8, generator=g).to(next(engine.module.parameters()).dtype)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _clone(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _tensors(obj, prefix=""):
    """Flatten every tensor in a nested structure to {path: tensor}."""
    import torch

    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def _full_params(engine) -> dict:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}


def _state(engine) -> dict:
    """Live state to compare: full params and this rank's optimizer state (master + Adam moments)."""
    return {"params": _full_params(engine), "optim": _clone(engine.optimizer.state_dict())}


def _assert_same(a: dict, b: dict, what: str) -> None:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys(), f"{what}: keys differ: {sorted(ta.keys() ^ tb.keys())[:5]}"
    assert ta, f"{what}: no tensors compared"
    for k in ta:
        x, y = ta[k], tb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, \
            f"{what}{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        assert torch.equal(x.cpu().view(-1).view(torch.uint8) if x.numel() else x.cpu(),
                           y.cpu().view(-1).view(torch.uint8) if y.numel() else y.cpu()), f"{what}{k}: bytes differ"



@contextlib.contextmanager
def _torch_safe_globals_only() -> Iterator[None]:
    """Only torch's own ``weights_only`` allow-list inside: another library's import registers its globals process-wide
    (megatron-core's, which the tests' fork server preloads, adds numpy's and argparse's), and they would hide a global
    missing from ``safe_globals_for_deepspeed()``."""
    import torch

    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(
        [g for g in registered if (g[0] if isinstance(g, tuple) else g).__module__.split(".")[0] == "torch"])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


def rank_roundtrip(stage: int, bf16: bool, root: str) -> dict:
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine, safe_globals_for_deepspeed

    ckpt_ds.install({"io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    save_dir = Path(root) / f"ckpt{stage}"
    engine = _engine(stage, seed=0, bf16=bf16)
    assert isinstance(engine.checkpoint_engine, CpuckptCheckpointEngine)
    for k in range(3):
        _step(engine, k)
    saved = _state(engine)
    engine.save_checkpoint(str(save_dir), tag="t1")
    latest_after_save = (save_dir / "latest").exists()
    pending_jobs = len(engine.checkpoint_engine._jobs)
    for k in range(3, 5):  # the first step starts the commit (background), then the update changes every tensor
        _step(engine, k)
    engine.checkpoint_engine.wait()  # the background commit has written `latest`
    latest_after_step = (save_dir / "latest").read_text() if (save_dir / "latest").exists() else None
    changed = not torch.equal(_full_params(engine)["0.weight"], saved["params"]["0.weight"])
    # zero_to_fp32 on our files equals the parameters at save time
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="t1")
    # (bf16: the live parameters are the fp32 master weights rounded to bf16)
    cast = (lambda v: v.bfloat16().float()) if bf16 else (lambda v: v.float())
    _assert_same({k: cast(v) for k, v in fp32.items()}, saved["params"], "zero_to_fp32")
    # a second save right before destroy(): its latest must appear
    engine.save_checkpoint(str(save_dir), tag="t2")
    engine.destroy()
    latest_final = (save_dir / "latest").read_text()

    # a fresh engine restores t1 bit-exact
    engine2 = _engine(stage, seed=123, bf16=bf16)
    _step(engine2, 99)
    load_path, _ = engine2.load_checkpoint(str(save_dir), tag="t1")
    assert load_path is not None, "load_checkpoint found nothing"
    _assert_same(_state(engine2), saved, f"stage {stage} restored")
    engine2.destroy()
    # every file is torch.load(weights_only=True)-able with the documented globals
    names = sorted(p.name for p in (save_dir / "t1").iterdir())
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals_for_deepspeed()}
    unsafe = set()
    with _torch_safe_globals_only():
        for p in (save_dir / "t1").glob("*.pt"):  # the hidden completion marker is not a torch file
            # outside safe_globals(): inside, the listed globals count as safe and are not reported
            unsafe |= set(torch.serialization.get_unsafe_globals_in_checkpoint(str(p)))
            with torch.serialization.safe_globals(safe_globals_for_deepspeed()):
                torch.load(p, weights_only=True, map_location="cpu")
    assert unsafe <= allowed, f"globals missing from safe_globals_for_deepspeed(): {unsafe - allowed}"
    ckpt_ds.uninstall()
    dist.barrier()
    return {"names": names, "latest_after_save": latest_after_save, "pending_jobs": pending_jobs,
            "latest_after_step": latest_after_step, "latest_final": latest_final, "changed": changed,
            "leftovers": sorted(p.name for p in save_dir.iterdir() if p.name.endswith(".tmp")),
            "unsafe_globals": sorted(unsafe)}


def rank_roundtrips(bf16: bool, root: str) -> list[dict]:
    """ZeRO-1, 2 and 3 in one launch (an engine and a directory each)."""
    return [rank_roundtrip(stage, bf16, str(Path(root) / f"stage{stage}")) for stage in (1, 2, 3)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero_roundtrip(run_ranks, tmp_path, bf16):
    cases = run_ranks(2, rank_roundtrips, bf16, str(tmp_path), timeout_s=240)
    for stage, results in zip((1, 2, 3), zip(*cases)):
        r0 = results[0]
        optim = "bf16_zero" if bf16 else "zero"  # DeepSpeed names bf16 optimizer files bf16_zero_pp_rank_*
        if stage == 3:
            expected = {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} | {
                f"{optim}_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
        else:
            expected = {"mp_rank_00_model_states.pt"} | {f"{optim}_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                         for r in (0, 1)}
        assert set(r0["names"]) == expected | {".cpuckpt-complete.json"}, stage  # the marker; no .cpuckpt-saving
        for r in results:
            assert r["latest_after_save"] is False, ("latest written before the checkpoint was committed", stage)
            assert r["pending_jobs"] >= 1, ("save_checkpoint waited for durability in async mode", stage)
            assert r["latest_after_step"] == "t1", stage
            assert r["latest_final"] == "t2", ("the save before destroy() got no latest", stage)
            assert r["changed"], ("training after the save did not change the parameters", stage)
            assert r["leftovers"] == [], stage


def rank_write_failure(root: str, async_save: bool, background: bool, surface: str) -> dict:
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.testing import faults

    faults.install()  # io.backend "fault:ENOSPC@4096"
    ckpt_ds.install()
    block = {"async": async_save, "background_commit": background,
             "io": {"backend": "fault:ENOSPC@4096", "chunk_bytes": 64 * 1024}}
    engine = _engine(2, seed=0, cpuckpt=block)
    _step(engine, 0)
    save_dir = Path(root) / "ckpt"
    raised, where = None, "save_checkpoint"
    try:
        engine.save_checkpoint(str(save_dir), tag="bad")
        where = "step"
        _step(engine, 1)  # async, blocking commit: the commit in step() reports the failure
        where = surface
        if surface == "next_save":
            engine.save_checkpoint(str(save_dir), tag="next")  # background: reported before it starts
        else:
            ckpt_ds.commit_pending(engine)  # background: reported when waited for
    except Exception as e:
        raised = e
    ckpt_ds.uninstall()
    err = raised if raised is None or isinstance(raised, OSError) else raised.__cause__ or raised
    return {"raised": type(raised).__name__ if raised else None,
            "errno": getattr(err, "errno", None), "msg": str(raised),
            "is_oserror": isinstance(raised, OSError), "raised_errno": getattr(raised, "errno", None),
            "rank": getattr(raised, "rank", None), "path": getattr(raised, "path", None),
            "latest": (save_dir / "latest").exists(), "where": where, "next_started": (save_dir / "next").exists()}


WRITE_FAILURES = [(False, False, "save_checkpoint"), (True, False, "step"), (True, True, "commit_pending"),
                  (True, True, "next_save")]  # (async, background commit, where the failure must surface)


def rank_write_failures(root: str) -> list[dict]:
    """Every case of :data:`WRITE_FAILURES` in one launch, each with an engine and a directory of its own."""
    return [rank_write_failure(str(Path(root) / f"case{k}"), *case) for k, case in enumerate(WRITE_FAILURES)]


def test_write_failure_raises(run_ranks, tmp_path):
    cases = run_ranks(2, rank_write_failures, str(tmp_path), timeout_s=240)
    for k, (async_save, _background, surface) in enumerate(WRITE_FAILURES):
        results = [rank_cases[k] for rank_cases in cases]
        for r in results:
            assert r["raised"] is not None, ("a failing write did not raise", surface)
            assert r["errno"] == errno.ENOSPC or "ENOSPC" in r["msg"] or "No space" in r["msg"], r
            assert "bad" in r["msg"], r  # the failure of the first checkpoint, not of a later one
            assert r["latest"] is False
            assert r["where"] == surface, r
            assert not r["next_started"], "a new save started while an earlier one had failed unreported"
            # The error contract: an OSError (StorageIOError) carrying errno and the failing file.
            assert r["raised"] == "StorageIOError" and r["is_oserror"], r
            assert r["raised_errno"] == errno.ENOSPC and r["path"] and "bad" in r["path"], r
            if async_save:  # the commit gathered every rank's failure: the lowest failing rank (both fail)
                assert r["rank"] == 0 and "failed on rank 0" in r["msg"], r
        if async_save:
            assert results[0]["msg"] == results[1]["msg"], results


def rank_save_16bit_model(root: str) -> dict:
    """DeepSpeed's save_16bit_model commits right after saving and expects the file on return."""
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    import torch.distributed as dist

    ckpt_ds.install({"io": {"backend": "buffered"}})
    engine = _engine(1, seed=0)
    _step(engine, 0)
    out = Path(root) / "weights"
    engine.save_16bit_model(str(out), "model.bin")
    in_flight = engine.checkpoint_engine._background is not None
    result = {"in_flight": in_flight}
    if dist.get_rank() == 0:
        sd = torch.load(out / "model.bin", weights_only=True)  # right away: must be complete
        live = {k: v.detach() for k, v in engine.module.state_dict().items()}
        result["equal"] = sd.keys() == live.keys() and all(torch.equal(sd[k], live[k]) for k in sd)
    engine.destroy()
    ckpt_ds.uninstall()
    return result


def test_save_16bit_model_is_complete_on_return(run_ranks, tmp_path):
    results = run_ranks(2, rank_save_16bit_model, str(tmp_path), timeout_s=240)
    assert results[0]["equal"], "save_16bit_model's file differs from the live weights"
    assert not any(r["in_flight"] for r in results), "save_16bit_model's commit was left in the background"


def rank_commit_timing(root: str, background: bool) -> dict:
    """The step after a save: does it wait for the commit? Rank 0's rename of ``latest`` is held back: 2 s (blocking
    commit), or (background commit) until every rank has measured its step and looked for ``latest``."""
    import time

    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.testing import faults

    faults.install()  # the stage action of $CPUCKPT_TEST_HOOK
    ckpt_ds.install({"background_commit": background, "io": {"backend": "buffered"}})
    engine = _engine(1, seed=0)
    _step(engine, 0)
    save_dir = Path(root) / "ckpt"
    engine.save_checkpoint(str(save_dir), tag="a")
    t0 = time.monotonic()
    _step(engine, 1)
    step_s = time.monotonic() - t0
    latest_after_step = (save_dir / "latest").exists()
    (Path(root) / f"stepped_rank{dist.get_rank()}").touch()  # the background case: releases the held rename
    ckpt_ds.commit_pending(engine)
    latest = (save_dir / "latest").read_text()
    engine.destroy()
    ckpt_ds.uninstall()
    return {"step_s": step_s, "latest_after_step": latest_after_step, "latest": latest}


@pytest.mark.parametrize("background", [True, False], ids=["background", "blocking"])
def test_commit_in_background_does_not_block_the_step(run_ranks, tmp_path, background):
    if background:  # held until every rank is past its step and has looked: a step that waited for it would hang
        hook = ";".join(f"before-rename:latest=wait:{tmp_path / f'stepped_rank{r}'}" for r in (0, 1))
    else:  # a step that waits for the commit takes at least this long, however loaded the machine
        hook = "before-rename:latest=sleep:2"
    results = run_ranks(2, rank_commit_timing, str(tmp_path), background, timeout_s=240,
                        env={"CPUCKPT_TEST_HOOK": hook})
    for r in results:
        assert r["latest"] == "a"
        if background:  # the step returned while the commit was still held: it did not wait for it
            assert not r["latest_after_step"], r
        else:
            assert r["step_s"] >= 2.0 and r["latest_after_step"], r


def rank_attach_and_block(root: str) -> dict:
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ckpt_ds.install()
    try:
        engine = _engine(1, seed=0, cpuckpt={"enabled": False})  # the ds_config block turns it off
        off = type(engine.checkpoint_engine).__name__
        assert isinstance(engine.checkpoint_engine, TorchCheckpointEngine)
    finally:
        ckpt_ds.uninstall()
    new = ckpt_ds.attach(engine, {"async": True, "io": {"backend": "buffered"}})
    assert isinstance(new, CpuckptCheckpointEngine) and engine.checkpoint_engine is new
    _step(engine, 0)
    save_dir = Path(root) / "ckpt"
    engine.save_checkpoint(str(save_dir), tag="a")
    before = (save_dir / "latest").exists()
    ckpt_ds.commit_pending(engine)
    after = (save_dir / "latest").read_text()
    engine.destroy()
    return {"off": off, "before": before, "after": after}


def test_attach_commit_pending_and_disabled_block(run_ranks, tmp_path):
    results = run_ranks(2, rank_attach_and_block, str(tmp_path), timeout_s=240)
    for r in results:
        assert r == {"off": "TorchCheckpointEngine", "before": False, "after": "a"}


def rank_universal(stage: int, root: str) -> dict:
    """Our save -> ``python -m deepspeed.checkpoint.ds_to_universal`` (rank 0) -> universal load."""
    _setup_env()
    import subprocess
    import sys

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    import torch.distributed as dist

    ckpt_ds.install({"io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    save_dir = Path(root) / "ckpt"
    engine = _engine(stage, seed=0)
    for k in range(3):
        _step(engine, k)
    saved = _state(engine)
    engine.save_checkpoint(str(save_dir), tag="t1")
    _step(engine, 3)  # commits t1 (and changes every tensor)
    engine.destroy()
    dist.barrier()

    out_dir = save_dir / "t1_universal"
    conv = None
    if dist.get_rank() == 0:  # the way users run it, in its own interpreter
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(save_dir / "t1"),
               "--output_folder", str(out_dir), "--num_extract_workers", "1", "--num_merge_workers", "1"]
        if stage < 3:  # ZeRO-1/2 conversion wants universal_checkpoint_info, which plain models do not record
            cmd.append("--inject_missing_state")
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=180)
        conv = {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}
    dist.barrier()
    # every parameter's universal fp32 file equals the live parameter at save time
    fp32 = {}
    for name in saved["params"]:
        f = out_dir / "zero" / name / "fp32.pt"
        # ZeRO-1/2 output is {"param": tensor, ...}; ZeRO-3's merge saves the (flat) tensor itself
        obj = torch.load(f, weights_only=True) if f.exists() else None
        fp32[name] = obj["param"] if isinstance(obj, dict) else obj
    missing = sorted(n for n, v in fp32.items() if v is None)
    assert not missing, f"ds_to_universal wrote no fp32.pt for {missing} ({conv})"
    _assert_same({k: v.reshape(saved["params"][k].shape) for k, v in fp32.items()}, saved["params"], "universal fp32")
    moments = sorted(p.name for p in (out_dir / "zero" / "0.weight").iterdir())

    # a new engine loads the universal checkpoint: parameters and optimizer state as saved
    engine2 = _engine(stage, seed=123, extra={"checkpoint": {"load_universal": True}})
    path, _ = engine2.load_checkpoint(str(save_dir))  # tag from latest_universal
    restored = _state(engine2)
    _assert_same(restored["params"], saved["params"], f"stage {stage} universal-loaded params")
    optim_diff = None
    try:
        _assert_same(restored["optim"], saved["optim"], f"stage {stage} universal-loaded optimizer")
    except AssertionError as e:
        optim_diff = str(e)
    _step(engine2, 4)  # it trains on
    engine2.destroy()
    ckpt_ds.uninstall()
    return {"conv": conv, "latest_universal": (save_dir / "latest_universal").read_text(), "path": path,
            "moments": moments, "optim_diff": optim_diff}


def rank_universals(root: str) -> list[dict]:
    """ZeRO-2 and ZeRO-3 in one launch (an engine and a directory each)."""
    return [rank_universal(stage, str(Path(root) / f"stage{stage}")) for stage in (2, 3)]


def test_ds_to_universal_and_universal_load(run_ranks, tmp_path):
    cases = run_ranks(2, rank_universals, str(tmp_path), timeout_s=240)
    for stage, results in zip((2, 3), zip(*cases)):
        conv = results[0]["conv"]
        assert conv["rc"] == 0, (stage, conv["tail"])
        for r in results:
            assert r["latest_universal"] == "t1_universal", stage
            assert r["path"] is not None, stage
            assert {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"} <= set(r["moments"]), (stage, r["moments"])
            assert r["optim_diff"] is None, (stage, r["optim_diff"])


_FP16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2,
                  "hysteresis": 2, "min_loss_scale": 1}}


def _scaler_state(engine) -> dict:
    sc = engine.optimizer.loss_scaler
    return {"type": type(sc).__name__, **{k: v for k, v in vars(sc).items() if not callable(v)}}


def rank_fp16(stage: int, root: str) -> dict:
    """fp16 with DeepSpeed's DynamicLossScaler: save -> load restores the scaler and every tensor."""
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    from cpuckpt.integrations.deepspeed.engine import safe_globals_for_deepspeed
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed refuses fp16 on a CPU without AVX512-FP16 (is_fp16_supported); torch computes it anyway.
    get_accelerator().is_fp16_supported = lambda: True
    ckpt_ds.install({"io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    save_dir = Path(root) / "ckpt"
    engine = _engine(stage, seed=0, extra=_FP16)
    scalers = [_scaler_state(engine)]
    for k in range(5):  # window 2: the scale grows twice
        _step(engine, k)
    # an overflowing step (inf loss): skipped by the optimizer; hysteresis 2 keeps the scale, counts down
    x = torch.full((2, 8), 6e4, dtype=torch.float16)
    engine.backward(engine(x).pow(2).mean() * 6e4)
    engine.step()
    overflowed = bool(engine.optimizer.overflow)
    saved, saved_scaler = _state(engine), _scaler_state(engine)
    scalers.append(saved_scaler)
    engine.save_checkpoint(str(save_dir), tag="t1")
    for k in range(5, 8):
        _step(engine, k)
    scalers.append(_scaler_state(engine))
    uninterrupted = _full_params(engine)
    engine.destroy()

    engine2 = _engine(stage, seed=123, extra=_FP16)
    _step(engine2, 99)
    path, _ = engine2.load_checkpoint(str(save_dir), tag="t1")
    assert path is not None
    _assert_same(_state(engine2), saved, f"fp16 stage {stage} restored")
    restored_scaler = _scaler_state(engine2)
    # the next steps continue exactly as the original run did
    for k in range(5, 8):
        _step(engine2, k)
    continued = _scaler_state(engine2)
    _assert_same(_full_params(engine2), uninterrupted, "fp16 resumed run vs uninterrupted run")
    engine2.destroy()
    unsafe = set()
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals_for_deepspeed()}
    with _torch_safe_globals_only():
        for p in (save_dir / "t1").glob("*.pt"):
            unsafe |= set(torch.serialization.get_unsafe_globals_in_checkpoint(str(p)))
            with torch.serialization.safe_globals(safe_globals_for_deepspeed()):
                torch.load(p, weights_only=True, map_location="cpu")
    assert unsafe <= allowed, f"globals missing from safe_globals_for_deepspeed(): {unsafe - allowed}"
    ckpt_ds.uninstall()
    return {"scalers": scalers, "restored": restored_scaler, "continued": continued, "overflowed": overflowed,
            "unsafe_globals": sorted(unsafe), "names": sorted(p.name for p in (save_dir / "t1").iterdir())}


def rank_fp16s(root: str) -> list[dict]:
    """ZeRO-2 and ZeRO-3 in one launch (an engine and a directory each)."""
    return [rank_fp16(stage, str(Path(root) / f"stage{stage}")) for stage in (2, 3)]


def test_fp16_dynamic_loss_scaler_roundtrip(run_ranks, tmp_path):
    cases = run_ranks(2, rank_fp16s, str(tmp_path), timeout_s=240)
    for stage, results in zip((2, 3), zip(*cases)):
        for r in results:
            init, saved, after = r["scalers"]
            assert saved["type"] == "DynamicLossScaler", stage
            assert saved["cur_scale"] > init["cur_scale"], ("the scale never grew: nothing to restore", stage)
            assert r["overflowed"] and saved["cur_hysteresis"] < init["cur_hysteresis"], ("no overflow", stage)
            assert r["restored"] == saved, stage
            assert r["continued"] == after, stage
            assert "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" in r["unsafe_globals"], stage


# ------------------------------------------------------------------------- single process, no ranks
def _zip_entries(data: bytes) -> dict[str, bytes]:
    """Every entry's stored bytes, read through the local headers (the serialization id left out).

    Raw slices, not ``ZipFile.read``: ``torch.save`` under ``skip_data`` (like cpuckpt) leaves the
    data entries' CRC fields unset, which ``torch.load`` does not check but ``zipfile`` does.
    """
    import io
    import zipfile

    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for i in zf.infolist():
            if i.filename.endswith(".data/serialization_id"):
                continue
            o = i.header_offset
            name_len, extra_len = (int.from_bytes(data[o + k : o + k + 2], "little") for k in (26, 28))
            start = o + 30 + name_len + extra_len
            out[i.filename.split("/", 1)[1]] = (start, data[start : start + i.file_size])
    return out


def _compact_clone(obj, memo: dict):
    """DeepSpeed's ``clone_tensors_for_torch_save``, but keeping object identity (as pickling does)."""
    import torch

    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        c = obj.detach().clone(memory_format=torch.contiguous_format)
        if isinstance(obj, torch.nn.Parameter):
            c = torch.nn.Parameter(c, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            c.requires_grad_(True)
    elif isinstance(obj, dict):
        c = {k: _compact_clone(v, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        c = [_compact_clone(v, memo) for v in obj]
    else:
        return obj
    memo[id(obj)] = c
    return c


@pytest.mark.parametrize("builder", ["fast", "torch.save"])
def test_torch_file_matches_torch_save_of_compact_clones(tmp_path, builder):
    """Our file holds what ``torch.save`` writes for a compact clone of the same state dict:
    same zip entries (pickle, records, every storage's bytes), views compacted to their own bytes,
    a non-leaf view that requires grad detached, Parameters and shared objects kept as such. Both
    skeleton builders: the fast one, and ``torch.save`` (taken for a dtype saved as an untyped storage)."""
    import torch
    from cpuckpt.integrations.deepspeed import torchfile
    from cpuckpt.integrations.deepspeed.torchfile import layout_torch_file
    from torch.utils.serialization import config as ser_config

    from cpuckpt.config import Config
    from cpuckpt.transfer.save_job import SaveJob

    base = torch.arange(50_000, dtype=torch.float32)
    w = torch.nn.Parameter(torch.randn(10, 7))
    x = torch.randn(5, 5, requires_grad=True)
    sd = {"view": base[10:20], "base": base, "param": w, "strided": base[::3], "bf16": torch.randn(300).bfloat16(),
          "nonleaf": (x * 2)[1:3], "int": 3, "str": "s", "empty": torch.empty(0), "scalar": torch.tensor(2.5),
          "shared": [w, {"again": base[10:20]}], "i64": torch.arange(7), "bool": torch.arange(6) > 2}
    if builder == "torch.save":
        sd["u16"] = torch.arange(5, dtype=torch.int32).to(torch.uint16)
    with torchfile._ALIGNMENT_LOCK, torchfile._storage_alignment(4096):
        assert (torchfile._fast_skeleton(sd) is not None) == (builder == "fast")
    cfg = Config.from_dict({"io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    files, sources = layout_torch_file(sd, cfg, storage_alignment=4096)
    job = SaveJob(tmp_path, ["ours.pt"], files, sources, cfg, rank=0, mode="streaming")
    job.start()
    job.wait_done()
    ours = (tmp_path / "ours.pt").read_bytes()

    ref = _compact_clone(sd, {})
    buf = __import__("io").BytesIO()
    old = ser_config.save.storage_alignment
    ser_config.save.storage_alignment = 4096
    try:
        torch.save(ref, buf)
    finally:
        ser_config.save.storage_alignment = old
    assert _zip_entries(ours) == _zip_entries(buf.getvalue())
    assert len(ours) == len(buf.getvalue())

    out = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert isinstance(out["param"], torch.nn.Parameter) and out["shared"][0] is out["param"]
    assert out["view"].untyped_storage().nbytes() == 40  # only the view's bytes, not the base's
    for k in ("view", "base", "strided", "bf16", "nonleaf", "empty", "scalar", "i64", "bool", "u16"):
        if k in sd:
            assert torch.equal(out[k], sd[k].detach()) and out[k].dtype == sd[k].dtype, k
    assert out["int"] == 3 and out["str"] == "s"


def _deepspeed_like_model_states():
    """The shape of DeepSpeed's ``mp_rank_00_model_states.pt`` (ZeRO, bf16): its module's tensors, the
    ``param_shapes`` of ``torch.Size``, a scheduler's state, its config, counters, a set, Nones."""
    import collections

    import torch

    module = collections.OrderedDict()
    for layer in range(3):
        for name, shape in (("qkv.weight", (24, 8)), ("qkv.bias", (24,)), ("fc.weight", (8, 8)), ("ln.weight", (8,))):
            module[f"layers.{layer}.{name}"] = torch.randn(shape).bfloat16()
    module["embed.weight"] = torch.nn.Parameter(torch.randn(16, 8))
    module["tied.weight"] = module["embed.weight"]
    module["position_ids"] = torch.arange(16)
    shapes = collections.OrderedDict((k, v.shape) for k, v in module.items())
    return {"module": module, "buffer_names": ["position_ids"], "optimizer": None, "param_shapes": [shapes],
            "frozen_param_shapes": None, "shared_params": {"tied.weight": "embed.weight"},
            "lr_scheduler": {"last_epoch": 8, "base_lrs": [1e-4], "_last_lr": [8e-6]}, "data_sampler": None,
            "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 8, "global_samples": 64,
            "dp_world_size": 2, "mp_world_size": 1, "ds_version": "0.19.8",
            "ds_config": {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
            "scalar": torch.tensor(0.5), "flag": torch.tensor(True), "empty": torch.empty(0, 4)}


@pytest.mark.parametrize("alignment", [64, 4096])
def test_fast_torch_file_skeleton_is_torch_saves(alignment):
    """The fast skeleton builder writes, byte for byte, the skeleton ``torch.save`` writes under ``skip_data``
    (serialization id included), with every storage's bytes at the same offsets, for DeepSpeed's kind of
    file; and this torch passed the process's probe (under another default device too, without a random draw), so
    DeepSpeed saves take the fast builder."""
    import torch
    from cpuckpt.integrations.deepspeed import torchfile

    state = _deepspeed_like_model_states()
    torchfile._fast_matches_torch.cache_clear()
    torchfile._plain_reduce_agrees.cache_clear()
    rng = torch.get_rng_state()
    with torch.device("meta"), torchfile._ALIGNMENT_LOCK, torchfile._storage_alignment(alignment):
        assert torchfile._fast_matches_torch()  # whatever the default device (the proxies are CPU tensors)
    assert torch.equal(torch.get_rng_state(), rng)  # the probe draws no random numbers (the job's stream is its own)
    with torchfile._ALIGNMENT_LOCK, torchfile._storage_alignment(alignment):
        fast = torchfile._fast_skeleton(state)
        slow = torchfile._torch_skeleton(state)
    assert fast is not None
    (fast_sink, fast_regions), (sink, regions) = fast, slow
    assert fast_sink.end == sink.end and fast_sink.read_at(0, fast_sink.end) == sink.read_at(0, sink.end)
    assert [r[:2] for r in fast_regions] == [r[:2] for r in regions]
    assert len(regions) == 17 and all(torch.equal(a[2], b[2]) for a, b in zip(fast_regions, regions, strict=True))


@pytest.mark.timeout(180)
@pytest.mark.slow  # a benchmark's smoke run: CPUCKPT_SLOW=1 (README: "The two commands")
def test_bench_deepspeed_smoke(tmp_path):
    """``python -m benchmarks.bench_deepspeed --smoke`` runs (CPU, gloo, tiny model): every engine (cpuckpt-zero:
    ordering optimizer; decoupled: DeepSpeed's DecoupledCheckpointEngine with its writer process), the host
    pool prepared before the first cpuckpt save, the table, the JSON, and the same state saved by DeepSpeed's
    engine and by ours holds bit-identical tensors."""
    import json
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "ds.json"
    engines = ["torch", "cpuckpt", "cpuckpt-zero", "decoupled"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_deepspeed", "--smoke", "--out", str(out),
                           "--dir", str(tmp_path / "ck"), "--engines", ",".join(engines)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "| torch | 0 |" in proc.stdout and "| cpuckpt | 1 |" in proc.stdout, proc.stdout
    assert "| cpuckpt-zero | 1 |" in proc.stdout and "| decoupled | 1 |" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())["results"]
    assert not [r for r in results if r["name"] == "decoupled_error"], results
    verify = [r for r in results if r["name"] == "verify"]
    assert verify and verify[0]["ok"] and verify[0]["tensors"] > 0, verify
    saves = [r for r in results if r["name"] == "save"]
    assert {r["engine"] for r in saves} == set(engines) and all(r["bytes"] > 0 for r in saves)
    assert all(r["lost_s"] >= r["stall_s"] for r in saves)
    prep = [r for r in results if r["name"] == "prepare"]
    assert prep and prep[0]["pool_bytes"] >= prep[0]["estimate_bytes"] > 0, prep
    assert not (tmp_path / "ck").exists(), "checkpoint directories left behind"


def rank_resume_from_a_stock_tag(root: str, same_tag: bool) -> dict:
    """A tag of ours at step 1, then stock DeepSpeed's at step 2 in the same save_dir (``latest`` names it; with
    ``same_tag``, under our tag's name: its files rewritten, our marker left stale); a fresh engine on cpuckpt
    resumes with load_latest, and loads the tag with DeepSpeed's own load_checkpoint too."""
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds

    save_dir = Path(root) / "ckpt"
    ckpt_ds.install({"io": {"backend": "buffered"}})
    try:
        ours = _engine(1, seed=0)
        _step(ours, 1)
        ours.save_checkpoint(str(save_dir))  # global_step1, a tag of ours (marker)
        ckpt_ds.commit_pending(ours)
        stock = _engine(1, seed=0, cpuckpt={"enabled": False})  # stock DeepSpeed's own engine
        _step(stock, 1)
        _step(stock, 2)
        stock.save_checkpoint(str(save_dir), tag="global_step1" if same_tag else None)  # no marker; latest names it
        want = _state(stock)
        fresh = _engine(1, seed=5)
        path, _ = ckpt_ds.load_latest(fresh, str(save_dir))
        got = _state(fresh)
        again = _engine(1, seed=6)
        again.load_checkpoint(str(save_dir))  # DeepSpeed's own call through cpuckpt's engine: not refused as torn
        for e in (ours, stock, fresh, again):
            e.destroy()
    finally:
        ckpt_ds.uninstall()
    _assert_same(got, want, "resumed from the stock tag")
    _assert_same(_state(again), want, "load_checkpoint of the stock tag")
    return {"path": str(path), "step": fresh.global_steps}


@pytest.mark.parametrize("same_tag", [False, True])
def test_load_latest_resumes_from_a_tag_stock_deepspeed_wrote(run_ranks, tmp_path, same_tag):
    """A run moved onto cpuckpt: load_latest skipped every tag without cpuckpt's marker, so it started from scratch
    (only stock tags) or loaded an older tag of ours over the newer stock tag ``latest`` names, without a word; and
    a tag of ours that stock DeepSpeed saved again (its marker left behind, stale) was refused as torn. The tag
    ``latest`` names counts, unverified (no checksums to check), first like any tag ``latest`` names."""
    tag = "global_step1" if same_tag else "global_step2"
    for r in run_ranks(2, rank_resume_from_a_stock_tag, str(tmp_path), same_tag, timeout_s=240):
        assert f"/{tag}/" in r["path"] and r["step"] == 2, r


_EXIT_SCRIPT = """
import os
import sys
import torch
from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

root, commit = sys.argv[1], sys.argv[2] == "commit"
ck = CpuckptCheckpointEngine({"prepare_pool": False, "io": {"backend": "buffered", "chunk_bytes": 65536}})
info = CheckpointCommitInfo(tag="global_step7", save_dir=root, save_latest=True)
ck.create(info)
ck.save({"w": torch.ones(8)}, f"{root}/global_step7/mp_rank_00_model_states.pt")
child = os.fork()  # a child forked meanwhile, ending normally: the checkpoint is not its to speak of
if child == 0:
    sys.exit(0)
os.waitpid(child, 0)
if commit:
    ck.commit(info)
    ck.wait()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("commit", [False, True])
def test_a_checkpoint_never_committed_is_warned_about_at_exit(tmp_path, commit):
    """A script that ends after ``save_checkpoint`` without ``engine.step()``, ``commit_pending()`` or
    ``engine.destroy()`` leaves its tag torn: the exit says which (once: not also a child forked meanwhile),
    instead of nothing; a committed one says nothing."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), "commit" if commit else "no"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("was never committed") == (0 if commit else 1), proc.stderr[-3000:]
    if not commit:
        assert str(tmp_path / "global_step7") in proc.stderr, proc.stderr[-3000:]
    else:
        assert (tmp_path / "latest").read_text() == "global_step7"


def rank_listing_fails_on_rank0(root: str) -> dict:
    """Rank 0's listing of the tags (``select_tag``'s candidates) raises an ``OSError`` (an unreadable marker)."""
    import time

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.errors import CpuckptError
    from cpuckpt.tier import tagmarker

    def scan_tags(save_dir):
        raise OSError(5, "Input/output error", f"{save_dir}/global_step2/.cpuckpt-complete.json")

    if dist.get_rank() == 0:
        tagmarker.scan_tags = scan_tags
    t0 = time.monotonic()
    try:
        ckpt_ds.select_tag(root)
    except CpuckptError as e:
        return {"error": type(e).__name__, "message": str(e), "s": time.monotonic() - t0}
    return {"error": None, "s": time.monotonic() - t0}


def test_a_listing_that_fails_on_rank_0_fails_on_every_rank_at_once(run_ranks, tmp_path):
    """``load_latest``: rank 0 lists the tags and broadcasts them; its listing raising (EIO on a marker) left the
    other ranks waiting in the broadcast until the group's timeout. Every rank now raises rank 0's error at once."""
    results = run_ranks(2, rank_listing_fails_on_rank0, str(tmp_path), timeout_s=60)
    for r in results:
        assert r["error"] is not None and "rank 0" in r["message"] and "Input/output error" in r["message"], r
        assert f"listing the DeepSpeed tags of {tmp_path}" in r["message"] and r["s"] < 20, r


def rank_restart_over_a_damaged_tag(root: str, older: bool, memory_tier: bool) -> dict:
    """Tags saved and committed through cpuckpt (global_step1 when ``older``, then global_step2); after the commit a
    data file of global_step2 is truncated (rank 1's optimizer file, on rank 0); a fresh engine restarts with
    load_latest (with ``memory_tier``, through the tier's listing of both tiers: its RAM root empty)."""
    _setup_env()
    import logging

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.errors import CheckpointCorrupt

    save_dir = Path(root) / "ckpt"
    ckpt_ds.install({"io": {"backend": "buffered"}})
    try:
        engine = _engine(1, seed=0)
        _step(engine, 1)
        if older:
            engine.save_checkpoint(str(save_dir))  # global_step1
            ckpt_ds.commit_pending(engine)
        want = _state(engine)
        _step(engine, 2)
        engine.save_checkpoint(str(save_dir))  # global_step2, committed: latest names it
        ckpt_ds.commit_pending(engine)
        victim = save_dir / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        dist.barrier()
        if dist.get_rank() == 0:
            os.truncate(victim, victim.stat().st_size // 2)
        dist.barrier()
        warned: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("cpuckpt").addHandler(handler)
        if memory_tier:
            ckpt_ds.install({"memory_tier": True, "io": {"backend": "buffered"}, "memory": {
                "root": str(Path(root) / "ram"), "slots": 2, "persist_every": 1, "headroom_bytes": 0}})
        fresh = _engine(1, seed=5)
        try:
            path, _ = ckpt_ds.load_latest(fresh, str(save_dir))
            out = {"path": path and str(path), "step": fresh.global_steps, "error": None}
            if path is not None:
                _assert_same(_state(fresh), want, f"resumed from {path}")
        except CheckpointCorrupt as e:
            out = {"path": None, "error": str(e)}
        logging.getLogger("cpuckpt").removeHandler(handler)
        out["warned"], out["tiered"] = warned, fresh.checkpoint_engine.memory_tier is not None
        for e in (engine, fresh):
            e.destroy()
    finally:
        ckpt_ds.uninstall()
    return out


@pytest.mark.parametrize("memory_tier", [False, True], ids=["save_dir", "memory_tier"])
@pytest.mark.parametrize("older", [True, False], ids=["older_tag", "only_tag"])
def test_load_latest_never_takes_a_committed_tag_damaged_since_for_a_torn_one(run_ranks, tmp_path, older,
                                                                              memory_tier):
    """A tag committed, then a data file truncated: load_latest skipped it as a torn save, so the restart resumed
    from the older tag (a warning on rank 0 only, calling it torn) or, with no older tag, started from scratch. Now
    every rank names it (committed, why) when falling back, and raises CheckpointCorrupt when nothing loads."""
    results = run_ranks(2, rank_restart_over_a_damaged_tag, str(tmp_path), older, memory_tier, timeout_s=240)
    damaged = f"{tmp_path / 'ckpt' / 'global_step2'}: committed, but incomplete now ("
    for r in results:
        assert r["tiered"] == memory_tier, r
        if older:
            assert r["error"] is None and "/global_step1/" in r["path"] and r["step"] == 1, r
            assert any(damaged in w and "optim_states.pt" in w and "falling back" in w for w in r["warned"]), r
        else:
            assert r["path"] is None and r["error"] is not None, r
            assert damaged in r["error"] and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["error"], r
            assert "not starting from scratch" in r["error"], r
    assert results[0]["error"] == results[1]["error"]
