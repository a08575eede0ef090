"""examples/megatron end to end: 2 gloo ranks under torchrun, real megatron-core, real processes and files.

A tiny ``GPTModel`` (tensor parallel 2: every rank holds half of each matrix) trains with async cpuckpt
checkpoints every 4 steps and SIGKILLs itself right after scheduling the save of step 12; a second
torchrun resumes (``--resume``) and trains to step 16. Asserted:

- the kill: both ranks die by SIGKILL with the step-12 save in flight; that checkpoint has no
  ``metadata.json`` and the tracker file names the last *finalized* save, step 8 (the example
  finalizes earlier saves before its deliberate crash);
- the files of that checkpoint, read back with plain ``torch.distributed.checkpoint`` (no cpuckpt, no
  megatron-core), hold bit for bit every shard each rank saved (parameters and Adam's exp_avg /
  exp_avg_sq, from the example's ``--snapshot-dir`` copies), and cover every tensor in the file;
- the resume picks exactly that checkpoint, skips the torn one, and the state it loads (every shard,
  Adam's step, the iteration) is bit-identical to what was saved;
- training continues: the resumed run recomputes the killed run's losses bit for bit and reaches the
  killed run's exact step-12 state, re-saves step 12 into the torn directory (now complete and
  correct), goes on to step 16 with a lower loss, and the tracker ends at 16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "train.py"
STEPS, INTERVAL, KILL_AT, TP, WORLD = 16, 4, 12, 2, 2
TRACKER = "latest_checkpointed_iteration.txt"


def _torchrun(tmp_path: Path, log: str, *extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(TRAIN),
           "--device", "cpu", "--tp", str(TP), "--save", str(tmp_path / "ckpt"), "--steps", str(STEPS),
           "--save-interval", str(INTERVAL), "--events", str(tmp_path / "events.jsonl"),
           "--snapshot-dir", str(tmp_path / "snapshots"), *extra]
    with open(tmp_path / log, "w") as f:
        rc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=150).returncode
    return rc, (tmp_path / log).read_text()


def _events(tmp_path: Path) -> tuple[list[dict], list[dict]]:
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    return events[starts[0]:starts[1] if len(starts) > 1 else None], events[starts[1]:] if len(starts) > 1 else []


def _snapshots(tmp_path: Path, step: int) -> list[dict]:
    return [torch.load(tmp_path / "snapshots" / f"iter_{step}_rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _check_files(path: Path, snapshots: list[dict], step: int) -> int:
    """Read the checkpoint with stock DCP (single process) and compare it with every rank's saved shards."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(full, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    covered, shards = set(), 0
    for rank, snap in enumerate(snapshots):
        assert snap["iteration"] == step and snap["adam_step"] == float(step), (rank, snap["iteration"])
        for name, data in snap["tensors"].items():
            key, offset, prepend = snap["index"][name]
            where = tuple(offset[:prepend]) + tuple(slice(o, o + n) for o, n in zip(offset[prepend:], data.shape))
            assert _bits_equal(full[key][where], data), f"{path.name}: {name} (rank {rank}) differs from what was saved"
            covered.add(key)
            shards += 1
    assert covered == set(full), f"tensors in {path.name} no rank saved: {sorted(set(full) - covered)}"
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in full)
    assert any("linear_qkv.weight" in k for k in full)
    common = path / "common.pt"  # megatron-core <= 0.16; 0.19 keeps the common state in the DCP files
    if common.exists():
        state = torch.load(common, weights_only=False)
        assert state["iteration"] == step and float(state["optimizer"]["state"]["common_step"]) == step
    return shards


@pytest.mark.timeout(300)
def test_megatron_example_kill_mid_save_and_resume(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ckpt = tmp_path / "ckpt"

    # ---- run 1: killed right after scheduling the save of step KILL_AT
    rc, log = _torchrun(tmp_path, "train.log", "--kill-at-step", str(KILL_AT))
    assert rc != 0, f"the run was not killed:\n{log[-3000:]}"
    assert "Signal 9 (SIGKILL)" in log or "exitcode  : -9" in log, log[-3000:]
    killed, _ = _events(tmp_path)
    assert [e["step"] for e in killed if e["event"] == "kill"] == [KILL_AT], killed
    assert not any(e["event"] == "done" for e in killed)
    saves = [e["step"] for e in killed if e["event"] == "save_scheduled"]
    assert saves == [4, 8, 12], saves
    finalized = [e["step"] for e in killed if e["event"] == "finalized"]
    assert finalized == [4, 8], f"finalized before the kill: {finalized}"  # train.py finalizes them first
    last = finalized[-1]
    assert (ckpt / TRACKER).read_text().strip() == str(last)
    assert not (ckpt / f"iter_{KILL_AT:07d}" / "metadata.json").exists(), "the in-flight save looks complete"
    assert (ckpt / f"iter_{last:07d}" / "metadata.json").exists()
    saved = _snapshots(tmp_path, last)
    shards = _check_files(ckpt / f"iter_{last:07d}", saved, last)
    assert shards == sum(len(s["tensors"]) for s in saved)
    killed_state_at_kill = _snapshots(tmp_path, KILL_AT)  # overwritten by run 2's save of that step

    # ---- run 2: resume from the tracker's checkpoint, train on
    rc, log = _torchrun(tmp_path, "resume.log", "--resume")
    assert rc == 0, f"the resumed run failed:\n{log[-5000:]}"
    _, resumed = _events(tmp_path)
    [resume] = [e for e in resumed if e["event"] == "resumed"]
    assert resume["step"] == last and resume["skipped"] == [KILL_AT], resume
    assert resume["verified"] == {"tensors": shards, "mismatches": []}, resume["verified"]

    loss = {run: {e["step"]: e["loss"] for e in events if e["event"] == "loss"}
            for run, events in (("killed", killed), ("resumed", resumed))}
    assert sorted(loss["killed"]) == list(range(1, KILL_AT + 1))
    assert sorted(loss["resumed"]) == list(range(last + 1, STEPS + 1))
    for step in range(last + 1, KILL_AT + 1):
        assert loss["resumed"][step] == loss["killed"][step], f"step {step}: loss differs after the resume"
    assert float.fromhex(loss["resumed"][STEPS]) < float.fromhex(loss["killed"][1]), loss
    assert any(e["event"] == "done" and e["step"] == STEPS for e in resumed)
    assert [e["step"] for e in resumed if e["event"] == "finalized"] == [12, 16]

    # the resumed run reached the killed run's exact state at the kill, and saved it correctly
    # into the torn directory; the last checkpoint is complete too
    resumed_state_at_kill = _snapshots(tmp_path, KILL_AT)
    for before, after in zip(killed_state_at_kill, resumed_state_at_kill):
        assert before["tensors"].keys() == after["tensors"].keys()
        assert all(_bits_equal(before["tensors"][k], after["tensors"][k]) for k in before["tensors"])
    for step in (KILL_AT, STEPS):
        assert (ckpt / f"iter_{step:07d}" / "metadata.json").exists()
        _check_files(ckpt / f"iter_{step:07d}", _snapshots(tmp_path, step), step)
    assert (ckpt / TRACKER).read_text().strip() == str(STEPS)
    print(f"example end to end in {time.monotonic() - t0:.1f} s")
