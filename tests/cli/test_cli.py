"""The ``cpuckpt`` command line on real checkpoints written by the test (no mocks).

A module-scoped root holds: ``step_1`` (cpuckpt, one process, several dtypes and non-tensor items,
64 KiB chunks), ``step_30`` (cpuckpt whose ``.metadata`` was never written: incomplete), ``stock``
(stock DCP ``FileSystemWriter``), ``iter_0000007`` (Megatron layout: ``metadata.json`` with
``sharded_backend`` around a DCP checkpoint) and ``global_step5`` (DeepSpeed layout). The 2-rank
checkpoint is written by real gloo ranks in its own test. ``ls``/``inspect``/``verify``/``convert``
run in-process through click's ``CliRunner``; the memory-bound ``convert``, ``bench`` and ``demo``
run the installed console script in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import cpuckpt
from cpuckpt.testing import faults
from cpuckpt.tier.ramroot import RamRoot, acquire_lock, lock_holder
from cpuckpt.tools.cli import cli

SMALL_CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}}
FULL_2RANK = {"s0": ((64, 33), torch.float32), "s1_bf16": ((10, 300), torch.bfloat16)}


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("cpuckpt")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "cpuckpt.tools.cli"]


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def _small_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.arange(7, dtype=torch.bfloat16),
                  "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5, dtype=torch.float64),
                  "empty": torch.empty(0, 3)},
        "step": 1,
        "meta": {"lr": 0.001, "name": "run-a"},
        "tags": {"a", "b"},  # loadable, not JSON-able
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    cpuckpt.save(_small_state(), root / "step_1", SMALL_CFG, step=1)
    cpuckpt.save({"x": torch.ones(10)}, root / "step_30", SMALL_CFG, step=30)
    (root / "step_30" / ".metadata").unlink()  # the state between the manifest and the .metadata rename
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "n": 3}, storage_writer=dcp.FileSystemWriter(root / "stock"))
    mega = root / "iter_0000007"
    dcp.save({"decoder.w": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(mega))
    (mega / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    ds = root / "global_step5"
    ds.mkdir()
    torch.save({"module": {"w": torch.zeros(2)}}, ds / "mp_rank_00_model_states.pt")
    return root


# ------------------------------------------------------------------------------------------- ls


def test_ls_recognises_every_kind_status_and_latest(root):
    code, out = _run("ls", root, "--json")
    assert code == 0, out
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}
    assert {k: rows[k]["kind"] for k in rows} == {
        "step_1": "cpuckpt", "step_30": "cpuckpt", "stock": "dcp", "iter_0000007": "megatron",
        "global_step5": "deepspeed"}
    assert rows["step_1"]["status"] == "complete" and rows["step_1"]["step"] == 1
    assert rows["step_30"]["status"] == "incomplete" and "no .metadata" in rows["step_30"]["reason"]
    assert rows["stock"]["status"] == "complete" and rows["stock"]["step"] is None
    assert rows["iter_0000007"]["step"] == 7 and rows["global_step5"]["step"] == 5
    assert all(r["nbytes"] > 0 for r in rows.values())
    # the newest *complete* cpuckpt/DCP checkpoint (cpuckpt.find_latest), not the torn step_30: the stock
    # one, step-less but committed after step_1 (a step-less checkpoint outranks those committed before it)
    assert [k for k, r in rows.items() if r["latest"]] == ["stock"] == [cpuckpt.find_latest(root).name]

    code, out = _run("ls", root)
    assert code == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "complete" in lines["step_1"] and "<- latest" in lines["stock"]
    assert "incomplete" in lines["step_30"] and "latest" not in lines["step_30"]


def test_ls_deepspeed_root_uses_its_latest_file(tmp_path):
    for step in (10, 20):
        d = tmp_path / f"global_step{step}"
        d.mkdir()
        torch.save({"step": step}, d / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step10")  # DeepSpeed's pointer wins over the highest step
    code, out = _run("ls", tmp_path, "--json")
    assert code == 0, out
    latest = [Path(r["path"]).name for r in map(json.loads, out.splitlines()) if r["latest"]]
    assert latest == ["global_step10"]


def test_ls_missing_root_is_a_clear_error(tmp_path):
    code, out = _run("ls", tmp_path / "nope")
    assert code == 2 and "nope" in out


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _ls_rows(*args: object, code_wanted: int = 0) -> dict[str, dict]:
    code, out = _run("ls", *args, "--json")
    assert code == code_wanted, out
    return {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}


def test_ls_verify_marks_a_damaged_checkpoint_and_moves_latest(tmp_path):
    for k in (1, 2, 3):
        cpuckpt.save({"w": torch.randn(200, 100), "step": k}, tmp_path / f"step_{k}", SMALL_CFG, step=k)
    _flip(tmp_path / "step_3" / "__0_0.distcp")
    rows = _ls_rows(tmp_path)  # sizes are intact: without --verify it looks complete
    assert rows["step_3"]["status"] == "complete" and rows["step_3"]["latest"]
    rows = _ls_rows(tmp_path, "--verify", code_wanted=1)  # a damaged checkpoint: exit 1, as `verify`
    assert rows["step_3"]["status"] == "damaged" and "checksum mismatch" in rows["step_3"]["reason"]
    assert [k for k, r in rows.items() if r["latest"]] == ["step_2"]
    assert rows["step_1"]["status"] == rows["step_2"]["status"] == "complete"
    code, out = _run("ls", tmp_path, "--verify")
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert code == 1 and "damaged (" in lines["step_3"] and "<- latest" in lines["step_2"]


def test_ls_verify_calls_a_checkpoint_truncated_after_its_commit_damaged(tmp_path):
    """A committed checkpoint (cpuckpt's ``.metadata``, a DeepSpeed tag's marker) with a file cut short since is
    damaged, exit 1, as ``verify`` says of it; plain ``ls`` lists it incomplete, and a save that never committed
    stays incomplete under --verify too (it exited 0 for all of them)."""
    from cpuckpt.tier.tagmarker import TagFile, new_marker, open_tag, write_marker

    for k in (1, 2):
        cpuckpt.save({"w": torch.randn(200, 100), "step": k}, tmp_path / f"step_{k}", SMALL_CFG, step=k)
    os.truncate(tmp_path / "step_2" / "__0_0.distcp", 1000)
    _torn_save(tmp_path / "step_3", 3)
    _torn_save(tmp_path / "step_4", 4)
    (tmp_path / "step_4" / ".metadata").write_bytes(b"")  # a commit that died writing it: torn, as clean has it
    rows = _ls_rows(tmp_path)
    assert {rows[f"step_{k}"]["status"] for k in (2, 3, 4)} == {"incomplete"}, rows
    rows = _ls_rows(tmp_path, "--verify", code_wanted=1)
    assert rows["step_2"]["status"] == "damaged" and "truncated" in rows["step_2"]["reason"], rows
    assert rows["step_3"]["status"] == rows["step_4"]["status"] == "incomplete", rows
    assert rows["step_1"]["status"] == "complete" and rows["step_1"]["latest"]
    ds = tmp_path / "ds"
    for name, committed in (("global_step1", True), ("global_step2", False)):
        d = ds / name
        open_tag(d, fsync=False)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
        if committed:
            write_marker(d, new_marker(name, 1, {"mp_rank_00_model_states.pt": TagFile(0, 64, 0)}, 1), fsync=False)
    os.truncate(ds / "global_step1" / "mp_rank_00_model_states.pt", 10)
    rows = _ls_rows(ds, "--verify", code_wanted=1)
    assert rows["global_step1"]["status"] == "damaged" and rows["global_step2"]["status"] == "incomplete", rows
    marker = ds / "global_step1" / ".cpuckpt-complete.json"
    text = marker.read_text()
    for garbled in (text[:20].encode(), b'{"tag": \xff\xfe'):  # the marker itself damaged since: still a commit
        marker.write_bytes(garbled)
        rows = _ls_rows(ds, "--verify", code_wanted=1)  # (undecodable bytes raised out of ls)
        assert rows["global_step1"]["status"] == "damaged", rows
        code, out = _run("verify", ds / "global_step1")  # verify says so too (it could not verify: exit 2)
        assert code == 1 and ".cpuckpt-complete.json" in out and "not a valid" in out, out
        line = next(x for x in out.splitlines() if x.startswith("DAMAGED"))  # the marker once, no empty byte range
        assert line.count(".cpuckpt-complete.json") == 1 and "bytes [" not in line, line
    marker.write_text(json.dumps({**json.loads(text), "format_version": 99}))  # a newer cpuckpt's: not judged
    rows = _ls_rows(ds, "--verify")
    assert rows["global_step1"]["status"] == "incomplete" and "upgrade cpuckpt" in rows["global_step1"]["reason"], rows
    marker.write_bytes(b"")  # renamed without its bytes (no fsync, a crash): no commit, as an empty .metadata
    rows = _ls_rows(ds, "--verify")
    assert rows["global_step1"]["status"] == "incomplete" and "empty" in rows["global_step1"]["reason"], rows
    shutil.rmtree(ds / "global_step1")
    rows = _ls_rows(ds, "--verify")  # a save that never committed: not damage
    assert rows["global_step2"]["status"] == "incomplete", rows


def test_ls_age_is_the_commit_time_and_a_load_does_not_reset_it(tmp_path):
    path = tmp_path / "step_1"
    cpuckpt.save({"w": torch.ones(10)}, path, SMALL_CFG, step=1)
    faults.rewrite_manifest(path, lambda m: m.update(created_unix=time.time() - 7200))  # written two hours ago
    stock = tmp_path / "stock"
    dcp.save({"w": torch.ones(10)}, storage_writer=dcp.FileSystemWriter(stock))
    old = time.time() - 3600
    for f in stock.iterdir():
        os.utime(f, (old, old))
    for p in (path, stock):
        cpuckpt.load({"w": torch.zeros(10)}, p, SMALL_CFG)  # a loading marker comes and goes in p
    rows = _ls_rows(tmp_path)
    assert 7100 < rows["step_1"]["age_s"] < 7300, rows["step_1"]
    assert 3500 < rows["stock"]["age_s"] < 3700, rows["stock"]
    code, out = _run("ls", tmp_path)
    assert code == 0, out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert " 2h" in lines["step_1"] and " 1h" in lines["stock"], out


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "convert"])
def test_a_url_is_refused_in_one_line(command, tmp_path):
    extra = ["--to", "torch", tmp_path / "x.pt"] if command == "convert" else []
    code, out = _run(command, "gs://bucket/run/step_1", *extra)
    assert code == 2 and "URLs (gs://) are not supported" in out and "Traceback" not in out, out
    if command == "convert":  # s3:// works for every command (tests/s3/test_s3_cli.py)
        code, out = _run("convert", tmp_path, "--to", "torch", "gs://bucket/x.pt")
        assert code == 2 and "output path 'gs://bucket/x.pt'" in out and "not supported" in out, out


# -------------------------------------------------------------------------------------- inspect


def test_inspect_reports_tensors_files_config_versions(root):
    code, out = _run("inspect", root / "step_1")
    assert code == 0, out
    for needle in ("kind:      cpuckpt (complete)", "step:      1", "ranks:     1", "__0_0.distcp",
                   "crc32c", f"torch {torch.__version__}", f"cpuckpt {cpuckpt.__version__}",
                   "coordinator_write_s", "chunk_bytes=65536", "model.w", "300x200", "bfloat16", "meta.lr"):
        assert needle in out, f"{needle!r} missing:\n{out}"
    code, out = _run("inspect", root / "step_1", "--json")
    data = json.loads(out)
    t = {x["name"]: x for x in data["tensors"]}
    assert t["model.w"]["shape"] == [300, 200] and t["model.w"]["dtype"] == "float32"
    assert t["model.w"]["nbytes"] == 300 * 200 * 4 and t["model.w"]["shards"] == 1
    assert t["model.scalar"]["shape"] == [] and t["step"]["dtype"] == "bytes"
    assert data["config"]["io"]["chunk_bytes"] == 65536 and data["ranks"] == 1


def test_inspect_stock_and_incomplete(root):
    code, out = _run("inspect", root / "stock")
    assert code == 0 and "stock DCP" in out and "3x4" in out, out
    code, out = _run("inspect", root / "step_30")
    assert code == 0 and "incomplete" in out and "no .metadata" in out, out


# --------------------------------------------------------------------------------------- verify


def test_verify_ok(root):
    code, out = _run("verify", root / "step_1")
    assert code == 0 and out.startswith("OK "), out
    code, out = _run("verify", root / "stock")
    assert code == 0 and "OK " in out and "record(s)" in out, out


def test_verify_damaged_cpuckpt_names_file_and_range(root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(root / "step_1", bad)
    data = bad / "__0_0.distcp"
    size = data.stat().st_size
    flip = size // 2
    with open(data, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x01]))
    code, out = _run("verify", bad)
    assert code == 1, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("DAMAGED")]
    assert str(data) in line and "checksum mismatch" in line
    lo, hi = (int(x) for x in line.split("bytes [")[1].split(")")[0].split(", "))
    assert lo <= flip < hi and hi - lo <= 64 * 1024
    assert "FAILED" in out


def test_verify_truncated_and_stock_damage(root, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(root / "step_1", bad)
    os.truncate(bad / "__0_0.distcp", 1000)
    code, out = _run("verify", bad)
    assert code == 1 and "__0_0.distcp" in out and "truncated" in out, out

    stock = tmp_path / "stock"
    shutil.copytree(root / "stock", stock)
    (data,) = stock.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    pos = raw.index(torch.arange(12.0).reshape(3, 4).numpy().tobytes())  # the tensor's data bytes
    raw[pos + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, out = _run("verify", stock)
    assert code == 1 and data.name in out and "CRC" in out, out


def test_verify_incomplete_is_an_error(root):
    code, out = _run("verify", root / "step_30")
    assert code == 2 and "no .metadata" in out, out


# -------------------------------------------------------------------------------------- convert


def _flat_source() -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in _small_state()["model"].items()}


def test_convert_safetensors_single_file(root, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out_file = tmp_path / "model.safetensors"
    code, out = _run("convert", root / "step_1", "--to", "safetensors", out_file)
    assert code == 0, out
    loaded = load_file(out_file)
    src = _flat_source()
    assert set(loaded) == set(src)
    for k, v in src.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    with safe_open(out_file, "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["step"]) == 1 and json.loads(meta["meta.lr"]) == 0.001
    assert json.loads(meta["meta.name"]) == "run-a"
    assert "tags" not in meta and "skipped tags" in out and "JSON" in out


def test_convert_refuses_bad_or_existing_outputs_in_one_line(root, tmp_path):
    src = root / "step_1"
    existing_dir = tmp_path / "existing"
    existing_dir.mkdir()
    code, out = _run("convert", src, "--to", "safetensors", existing_dir)
    assert code == 2 and "is a directory" in out and "Traceback" not in out, out
    code, out = _run("convert", src, "--to", "safetensors", tmp_path / "no" / "such" / "m.safetensors")
    assert code == 2 and "does not exist" in out and not (tmp_path / "no").exists(), out
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"precious")
    code, out = _run("convert", src, "--to", "safetensors", target)
    assert code == 2 and "--overwrite" in out and target.read_bytes() == b"precious", out
    code, out = _run("convert", src, "--to", "safetensors", target, "--overwrite")
    assert code == 0 and target.stat().st_size > 100, out
    (existing_dir / "keep.txt").write_text("x")
    code, out = _run("convert", src, "--to", "torch", "--max-shard-size", "100KB", existing_dir)
    assert code == 2 and "not empty" in out, out
    code, out = _run("convert", src, "--to", "torch", "--max-shard-size", "100KB", existing_dir, "--overwrite")
    assert code == 0, out


def test_convert_torch_sharded_with_index(root, tmp_path):
    out_dir = tmp_path / "hf"
    code, out = _run("convert", root / "step_1", "--to", "torch", "--max-shard-size", "100KB", out_dir)
    assert code == 0, out
    index = json.loads((out_dir / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((out_dir / s).is_file() for s in shards)
    merged = {}
    for s in shards:
        merged.update(torch.load(out_dir / s, weights_only=True))
    src = _flat_source()
    for k, v in src.items():
        assert torch.equal(merged[k], v) and index["weight_map"][k] in shards, k
    assert merged["step"] == 1 and merged["tags"] == {"a", "b"}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in src.values())


def _rank_save_sharded(path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {}
    for name, (shape, dtype) in FULL_2RANK.items():
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape).to(dtype)
        dim = 1 if name.startswith("s1") else 0
        local = full.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].clone()
        sd[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    sd["plain"] = torch.full((5,), 7.0)
    cpuckpt.save(sd, path, SMALL_CFG, step=20)


def test_two_rank_checkpoint_inspect_verify_convert_resharded(run_ranks, tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "step_20"
    run_ranks(2, _rank_save_sharded, str(path), timeout_s=120)
    code, out = _run("inspect", path, "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["ranks"] == 2 and set(data["files"]) == {"__0_0.distcp", "__1_0.distcp"}
    shards = {t["name"]: t["shards"] for t in data["tensors"]}
    assert shards["s0"] == 2 and shards["s1_bf16"] == 2 and shards["plain"] == 1
    assert _run("verify", path)[0] == 0

    out_file = tmp_path / "full.safetensors"
    code, out = _run("convert", path, "--to", "safetensors", out_file, "--memory-budget", "8KiB")
    assert code == 0, out
    loaded = load_file(out_file)
    for name, (shape, dtype) in FULL_2RANK.items():
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape).to(dtype)
        assert loaded[name].shape == full.shape and torch.equal(loaded[name], full), name
    assert torch.equal(loaded["plain"], torch.full((5,), 7.0))
    out_pt = tmp_path / "full.pt"
    assert _run("convert", path, "--to", "torch", out_pt)[0] == 0
    loaded_pt = torch.load(out_pt, weights_only=True)
    assert all(torch.equal(loaded_pt[k], loaded[k]) for k in loaded)


# Python wrapper that runs one command and reports the peak RSS of that child alone.
_PEAK = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
         "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _peak_rss_bytes(cmd: list[str]) -> int:
    proc = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, timeout=120)
    rc, kib = proc.stdout.split()
    assert rc == "0", proc.stderr
    return int(kib) * 1024


@pytest.mark.timeout(180)
def test_convert_memory_stays_bounded(tmp_path):
    """Converting a 320 MiB checkpoint with a 32 MiB budget keeps peak RSS far below the checkpoint's
    size: peak minus the RSS of the same CLI merely inspecting the checkpoint (torch, cpuckpt, the
    metadata) must stay under a third of the source. A non-streaming convert holds every tensor, i.e.
    at least the whole 320 MiB (measured: +68 MiB with --memory-budget 32MiB, +340 MiB with 4GiB)."""
    from safetensors import safe_open

    src = tmp_path / "big"
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.w": torch.randn(2048, 2048, generator=g) for i in range(20)}  # 20 x 16 MiB
    source_nbytes = sum(t.numel() * t.element_size() for t in state.values())
    cpuckpt.save(state, src, {"io": {"chunk_bytes": "4MiB", "threads": 2}}, step=3)
    out_file = tmp_path / "big.safetensors"
    # the three CLI runs at once (each peak is its own process's, measured by its own wrapper)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        runs = [ex.submit(_peak_rss_bytes, cmd) for cmd in (
            [*_script(), "inspect", str(src)],
            [*_script(), "convert", str(src), str(out_file), "--to", "safetensors", "--memory-budget", "32MiB"],
            [*_script(), "convert", str(src), str(tmp_path / "big.pt"), "--to", "torch", "--memory-budget", "32MiB"])]
        baseline, peak, peak_pt = (r.result() for r in runs)
    grown = peak - baseline
    assert grown < source_nbytes / 3, (
        f"convert grew {grown / 2**20:.0f} MiB over the baseline {baseline / 2**20:.0f} MiB "
        f"(source {source_nbytes / 2**20:.0f} MiB)")
    with safe_open(out_file, "pt") as f:
        assert set(f.keys()) == set(state)
        for k in ("layer0.w", "layer19.w"):
            assert torch.equal(f.get_tensor(k), state[k]), k
    # --to torch imports FakeTensorMode (~60 MiB of modules) for its skeleton: a looser bound
    assert peak_pt - baseline < source_nbytes / 2, f"--to torch grew {(peak_pt - baseline) / 2**20:.0f} MiB"
    loaded = torch.load(tmp_path / "big.pt", weights_only=True, mmap=True)
    assert torch.equal(loaded["layer7.w"], state["layer7.w"])


# ------------------------------------------------------------------------------ bench, demo, help


# `bench` and `demo` run scripts that ship with the source tree, so they run from a clone.
_CLONE = Path(__file__).resolve().parents[2]


# The CLI only finds the script and passes the arguments through. One call each checks that: the script's own
# argparse refuses an unknown option, its usage line (the script's name, its own options) is printed and its exit
# status 2 comes back. The full runs are tests/test_bench_smoke.py (benchmarks.bench_cpu --smoke) and
# tests/test_demo.py (examples/demo.py --quick, every assertion on its output); each used to run twice.


@pytest.mark.timeout(120)
def test_bench_through_cli_runs_the_benchmark_module_with_its_arguments():
    proc = subprocess.run([*_script(), "bench", "--smoke", "--no-such-option"], cwd=_CLONE, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"  # argparse's status, passed back
    assert "bench_cpu.py" in proc.stderr and "unrecognized arguments: --no-such-option" in proc.stderr, proc.stderr
    for option in ("--smoke", "--shm-dir", "--disk-dir", "--small"):  # bench_cpu's own options, in its usage
        assert option in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_demo_through_cli_runs_the_demo_script_with_its_arguments():
    proc = subprocess.run([*_script(), "demo", "--quick", "--no-such-option"], cwd=_CLONE, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"
    assert "demo.py" in proc.stderr and "unrecognized arguments: --no-such-option" in proc.stderr, proc.stderr
    for option in ("--quick", "--workdir"):  # demo.py's own options, in its usage
        assert option in proc.stderr, proc.stderr


def test_help_lists_every_command():
    code, out = _run("--help")
    assert code == 0
    for name in ("ls", "inspect", "verify", "convert", "bench", "demo"):
        assert name in out


# ---------------------------------------------------------------------------------------- clean


def _ram_base(tmp_path: Path) -> Path:
    """A directory for RAM roots that passes ramroot's checks: ours, mode 0700 whatever the umask."""
    base = tmp_path / "base"
    base.mkdir()
    os.chmod(base, 0o700)
    return base


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_clean_ram_removes_stale_roots_and_keeps_live_ones(tmp_path):
    base = _ram_base(tmp_path)
    RamRoot.open(base / "job1", "job1", 0).close()  # a trainer that ended: stale
    live = RamRoot.open(base / "job2", "job2", 0)  # a trainer that still runs (this process)
    RamRoot.open(base / "job3", "job3", 0).close()
    writer_fd = acquire_lock(base / "job3" / ".writer-0.lock")  # trainer gone, its writer still persisting
    assert writer_fd is not None
    try:
        # flock is per open file description: a probe through a fresh open() in this same process, as the
        # CLI's, sees our locks as held
        assert lock_holder(base / "job2" / ".rank-0.lock") == os.getpid()
        assert lock_holder(base / "job3" / ".writer-0.lock") == os.getpid()
        code, out = _run("clean", "--ram", base)
        assert code == 0, out
        assert out.splitlines() == [f"removed stale RAM root {base / 'job1'}"]
        assert not (base / "job1").exists()
        assert (base / "job2" / ".owner.json").is_file() and (base / "job3" / ".owner.json").is_file()
    finally:
        live.close()
        os.close(writer_fd)
    code, out = _run("clean", "--ram", base)  # every lock free now: both stale
    assert code == 0, out
    assert out.splitlines() == [f"removed stale RAM root {base / 'job2'}", f"removed stale RAM root {base / 'job3'}"]
    assert sorted(os.listdir(base)) == []
    code, out = _run("clean", "--ram", base)
    assert code == 0 and out.splitlines() == [f"no stale RAM roots under {base}"], out


def test_clean_ram_dry_run_and_json(tmp_path):
    base = _ram_base(tmp_path)
    RamRoot.open(base / "job1", "job1", 0).close()
    with RamRoot.open(base / "job2", "job2", 0):
        code, out = _run("clean", "--ram", "--dry-run", base)
        assert code == 0 and out.splitlines() == [f"would remove stale RAM root {base / 'job1'}"], out
        assert (base / "job1" / ".owner.json").is_file()
        code, out = _run("clean", "--ram", "--dry-run", "--json", base)
        assert code == 0, out
        assert _json_lines(out) == [{"path": str(base / "job1"), "kind": "ram-root", "removed": False}]
        assert (base / "job1" / ".owner.json").is_file()
        code, out = _run("clean", "--ram", "--json", base / "job1")  # ROOT may be one RAM root
        assert code == 0, out
        assert _json_lines(out) == [{"path": str(base / "job1"), "kind": "ram-root", "removed": True}]
        assert not (base / "job1").exists() and (base / "job2" / ".owner.json").is_file()
        code, out = _run("clean", "--ram", "--json", base)
        assert code == 0 and out == "", out  # nothing stale: no objects


def test_clean_ram_default_base_is_the_per_user_directory(tmp_path, monkeypatch):
    from cpuckpt.tier import ramroot

    shm = tmp_path / "shm"  # a stand-in for /dev/shm, never the real one
    shm.mkdir()
    os.chmod(shm, 0o1777)
    monkeypatch.setattr(ramroot, "SHM_DIR", shm)
    RamRoot.open(None, "job1", 0).close()
    stale = shm / f"cpuckpt-{os.geteuid()}" / "job1"
    assert (stale / ".owner.json").is_file()
    code, out = _run("clean", "--ram", "--dry-run")
    assert code == 0 and out.splitlines() == [f"would remove stale RAM root {stale}"], out
    code, out = _run("clean", "--ram")
    assert code == 0 and out.splitlines() == [f"removed stale RAM root {stale}"], out
    assert not stale.exists()
    code, out = _run("clean", "--ram")
    assert code == 0 and out.splitlines() == [f"no stale RAM roots under {stale.parent}"], out


def test_clean_ram_unsafe_directory_is_a_clear_error(tmp_path):
    base = _ram_base(tmp_path)
    RamRoot.open(base / "job1", "job1", 0).close()
    os.chmod(base, 0o755)  # group and others may read it: ramroot refuses to touch it
    code, out = _run("clean", "--ram", base)
    assert code == 2, out
    assert out.startswith("cpuckpt: error: ") and str(base) in out and "mode 755" in out, out
    assert "Traceback" not in out and (base / "job1" / ".owner.json").is_file()


def _torn_save(path: Path, step: int) -> None:
    cpuckpt.save({"x": torch.full((10,), float(step))}, path, SMALL_CFG, step=step)
    (path / ".metadata").unlink()  # a save that died before its commit


def _age(path: Path, seconds: float) -> None:
    """Backdate ``path`` and everything directly in it, as if nothing touched it for ``seconds``."""
    t = time.time() - seconds
    for p in [*path.iterdir(), path]:
        os.utime(p, (t, t), follow_symlinks=False)


def test_clean_removes_torn_checkpoint_and_keeps_complete_one(tmp_path):
    root = tmp_path / "ckpts"
    cpuckpt.save({"x": torch.ones(10)}, root / "step_1", SMALL_CFG, step=1)
    _torn_save(root / "step_2", 2)
    code, out = _run("clean", root, "--min-age", "0")
    assert code == 0 and out.splitlines() == [f"removed {root / 'step_2'}"], out
    assert sorted(os.listdir(root)) == ["step_1"]
    assert cpuckpt.find_latest(root) == root / "step_1"
    sd = {"x": torch.zeros(10)}
    cpuckpt.load(sd, root / "step_1")
    assert torch.equal(sd["x"], torch.ones(10))
    code, out = _run("clean", root, "--min-age", "0", "--json")
    assert code == 0 and out == "", out
    code, out = _run("clean", root, "--min-age", "0")
    assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], out


def test_clean_spares_recent_torn_saves_by_default(tmp_path):
    """Without --min-age a torn directory touched in the last timeout_s (600 s) may be another process's
    live save and stays; once older, it goes."""
    root = tmp_path / "ckpts"
    cpuckpt.save({"x": torch.ones(10)}, root / "step_1", SMALL_CFG, step=1)
    _torn_save(root / "step_2", 2)
    _age(root / "step_2", 500)
    code, out = _run("clean", root)
    assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], out
    assert (root / "step_2").is_dir()
    _age(root / "step_2", 700)
    code, out = _run("clean", root, "--json")
    assert code == 0, out
    assert _json_lines(out) == [{"path": str(root / "step_2"), "kind": "checkpoint", "removed": True}]
    assert sorted(os.listdir(root)) == ["step_1"]


def test_clean_dry_run_lists_exactly_what_clean_removes(tmp_path):
    root = tmp_path / "ckpts"
    cpuckpt.save({"x": torch.ones(10)}, root / "step_1", SMALL_CFG, step=1)
    (root / "step_1" / ".metadata.tmp").write_bytes(b"torn")  # a leftover inside a complete checkpoint
    _torn_save(root / "step_2", 2)
    _age(root / "step_2", 3600)  # dead long ago: goes
    _torn_save(root / "step_3", 3)  # fresh: may be live, stays
    _torn_save(root / "step_4", 4)
    (root / "step_4" / f".cpuckpt-loading-{socket.gethostname()}-{os.getpid()}-0123abcd").touch()
    _age(root / "step_4", 3600)  # old, but being loaded (by this live process): stays
    (root / "latest.tmp").write_text("step_1\n")  # a pointer update that died
    for leftover in (root / "latest.tmp", root / "step_1" / ".metadata.tmp"):  # long ago: a fresh one may be live
        os.utime(leftover, (time.time() - 3600,) * 2)
    (root / "notes").mkdir()  # not a checkpoint: never touched
    (root / "notes" / "a.tmp").write_text("mine")
    expected = [root / "step_1" / ".metadata.tmp", root / "step_2", root / "latest.tmp"]

    def snapshot() -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*"))

    before = snapshot()
    code, out = _run("clean", root, "--dry-run")
    assert code == 0, out
    assert sorted(out.splitlines()) == sorted(f"would remove {p}" for p in expected)
    code, out = _run("clean", root, "--dry-run", "--json")
    assert code == 0, out
    planned = _json_lines(out)
    assert snapshot() == before  # removed nothing
    assert sorted(r["path"] for r in planned) == sorted(map(str, expected))
    assert all(r["removed"] is False for r in planned)
    # a file a save left is no checkpoint: a consumer of --json must not take step_1/.metadata.tmp for step_1
    assert {r["path"]: r["kind"] for r in planned} == {str(root / "step_2"): "checkpoint",
                                                       str(root / "step_1" / ".metadata.tmp"): "leftover",
                                                       str(root / "latest.tmp"): "leftover"}

    code, out = _run("clean", root, "--json")
    assert code == 0, out
    done = _json_lines(out)
    assert [r["path"] for r in done] == [r["path"] for r in planned]  # what the dry run promised, in order
    assert all(r["removed"] is True for r in done)
    assert not any(p.exists() for p in expected)
    assert sorted(os.listdir(root)) == ["notes", "step_1", "step_3", "step_4"]
    assert (root / "notes" / "a.tmp").is_file() and cpuckpt.find_latest(root) == root / "step_1"


def test_clean_argument_errors(tmp_path):
    code, out = _run("clean")
    assert code == 2 and "ROOT" in out and "--ram" in out, out
    code, out = _run("clean", tmp_path / "nope")
    assert code == 2 and "nope" in out, out
    code, out = _run("clean", "--ram", "--min-age", "5", tmp_path)
    assert code == 2 and "--min-age" in out, out
    code, out = _run("--help")
    assert code == 0 and "clean" in out


# ------------------------------------------------------------------------- clean: torn DeepSpeed tags


def _ds_torn(root: Path, tag: str, *, ago: float) -> Path:
    """A tag cpuckpt's engine began and never committed (``open_tag``, then its file; no marker), last changed
    ``ago`` seconds ago."""
    from cpuckpt.tier.tagmarker import open_tag

    d = root / tag
    open_tag(d, fsync=False)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"t" * 100)
    _age(d, ago)
    return d


def test_clean_removes_a_torn_deepspeed_tag_only_once_a_later_tag_committed(tmp_path):
    """A torn tag of cpuckpt's engine whose save died: its engine commits tags in order, so a tag committed after
    its last change proves its commit will never come. Before that commit, however old, it is kept (a tag waits
    for its commit until the engine's next step(), save or destroy()); --dry-run lists exactly what goes."""
    root = tmp_path / "save_dir"
    _ds_tag(root, "global_step10", 10, b"a" * 100, ago=3000)
    torn = _ds_torn(root, "global_step20", ago=2000)  # untouched far longer than timeout_s
    (root / "latest").write_text("global_step10")
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], out
    assert torn.is_dir()

    _ds_tag(root, "global_step30", 30, b"c" * 100)  # committed now: global_step20's save is over
    (root / "latest").write_text("global_step30")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    code, out = _run("clean", "--deepspeed-tags", root, "--dry-run")
    assert code == 0 and out.splitlines() == [f"would remove torn DeepSpeed tag {torn}"], out
    code, out = _run("clean", "--deepspeed-tags", root, "--dry-run", "--json")
    assert code == 0 and _json_lines(out) == [{"path": str(torn), "kind": "deepspeed-tag", "removed": False}], out
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    code, out = _run("clean", "--deepspeed-tags", root, "--json")
    assert code == 0 and _json_lines(out) == [{"path": str(torn), "kind": "deepspeed-tag", "removed": True}], out
    assert sorted(os.listdir(root)) == ["global_step10", "global_step30", "latest"]
    assert (root / "latest").read_text() == "global_step30"
    from cpuckpt.tier.tagmarker import check_tag

    assert [check_tag(root, t).state for t in ("global_step10", "global_step30")] == ["complete", "complete"]
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], out


def test_clean_keeps_a_torn_tag_newer_than_every_commit_or_with_none(tmp_path):
    """A torn tag changed after the newest commit (a live save waiting for its commit: its engine committed
    everything before it first) stays, as does one in a save_dir with no committed tag at all; one older than a
    commit goes. A commit within ORDER_MARGIN_S of a tag's last change orders nothing."""
    alone = tmp_path / "alone"
    _ds_torn(alone, "global_step20", ago=5000)
    code, out = _run("clean", "--deepspeed-tags", alone, "--min-age", "0")
    assert code == 0 and out.splitlines() == [f"nothing to clean in {alone}"], out

    root = tmp_path / "save_dir"
    dead = _ds_torn(root, "global_step10", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=3000)
    live = _ds_torn(root, "global_step30", ago=2000)  # its commit still to come: newer than every commit
    close = _ds_torn(root, "global_step5", ago=3000.5)  # 0.5 s before global_step20's commit: not ordered
    code, out = _run("clean", "--deepspeed-tags", root, "--min-age", "0")
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}"], out
    assert live.is_dir() and close.is_dir() and not dead.exists()


def test_clean_keeps_committed_damaged_stock_and_unjudged_deepspeed_tags(tmp_path, caplog):
    """Only a tag that never committed goes: a committed tag damaged since (a file short), a tag of stock
    DeepSpeed (no cpuckpt file), a marker left empty by a crash, a newer format's marker, all older than a
    commit, stay; so does a torn tag older than a tag whose garbled marker dates nothing."""
    import logging

    from cpuckpt.tier.tagmarker import MARKER_NAME

    root = tmp_path / "save_dir"
    damaged = _ds_tag(root, "global_step10", 10, b"a" * 100, ago=4000)
    (damaged / "mp_rank_00_model_states.pt").write_bytes(b"a" * 60)
    _age(damaged, 4000)
    stock = root / "global_step11"
    stock.mkdir(parents=True)
    (stock / "mp_rank_00_model_states.pt").write_bytes(b"s" * 100)
    _age(stock, 4000)
    empty = _ds_torn(root, "global_step12", ago=4000)
    (empty / MARKER_NAME).write_bytes(b"")
    newer = _ds_torn(root, "global_step13", ago=4000)
    (newer / MARKER_NAME).write_text('{"format": "cpuckpt-deepspeed-tag", "format_version": 99}')
    for d in (empty, newer):
        _age(d, 4000)
    dead = _ds_torn(root, "global_step14", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    before = {p: p.stat().st_size for p in root.rglob("*") if p.is_file() and dead not in p.parents}
    with caplog.at_level(logging.WARNING):
        code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}"], out
    assert {p: p.stat().st_size for p in root.rglob("*") if p.is_file()} == before
    assert f"not removing DeepSpeed tag {damaged}: committed once, incomplete now" in caplog.text

    garbled = tmp_path / "garbled"
    torn = _ds_torn(garbled, "global_step14", ago=4000)
    later = _ds_tag(garbled, "global_step20", 20, b"b" * 100)
    (later / MARKER_NAME).write_bytes(b'{"tag": \xff')  # committed (written last), but when is unknown
    code, out = _run("clean", "--deepspeed-tags", garbled)
    assert code == 0 and out.splitlines() == [f"nothing to clean in {garbled}"], out
    assert torn.is_dir()


def test_clean_with_latest_a_symlink_never_follows_or_removes_it(tmp_path):
    """``latest`` a symlink to a tag: it is neither read through nor removed, and the tag it names stays even torn
    (a tag a symlink names is not a tag of its own either); the other torn tags are judged as always."""
    root = tmp_path / "save_dir"
    dead = _ds_torn(root, "global_step10", ago=4000)
    named = _ds_torn(root, "global_step15", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    (root / "latest").symlink_to("global_step15")
    (root / "alias").symlink_to(dead)
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}"], out
    assert os.readlink(root / "latest") == "global_step15" and named.is_dir()
    assert os.readlink(root / "alias") == str(dead)
    os.unlink(root / "latest")
    (root / "latest").symlink_to(root / "global_step20")
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {named}"], out
    assert os.readlink(root / "latest") == str(root / "global_step20")
    assert sorted(os.listdir(root)) == ["alias", "global_step20", "latest"]


def test_clean_keeps_a_tag_a_memory_tier_writer_persists(tmp_path):
    """A memory tag persisted into save_dir by its writer process looks torn while it is copied. It stays while
    a rank's part is there (the coordinator's writer commits from the parts, maybe later than any commit), while
    it changes within --min-age (a writer copying), and when the later commit is a writer's persist of a tag
    committed in memory before the torn tag's files were written (a disk save still waiting for its commit)."""
    from cpuckpt.format.manifest import FileEntry, Manifest
    from cpuckpt.tier.formats import part_path
    from cpuckpt.transfer.files import write_atomic

    root = tmp_path / "save_dir"
    parted = _ds_torn(root, "global_step10", ago=4000)  # rank 1's writer done, the coordinator's not yet
    entry = FileEntry(name="zero_pp_rank_1_mp_rank_00_optim_states.pt", nbytes=100, chunk_bytes=100)
    write_atomic(part_path(parted, 1), Manifest(save_id="job-0001", files={entry.name: entry}).to_json().encode(),
                 fsync=False)
    _age(parted, 4000)
    copying = _ds_torn(root, "global_step11", ago=300)  # a writer copied into it 300 s ago
    dead = _ds_torn(root, "global_step12", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}"], out
    assert parted.is_dir() and copying.is_dir()

    mem = tmp_path / "memory"
    waiting = _ds_torn(mem, "global_step30", ago=2000)  # went to disk (when_full: disk), waits for its commit
    persisted = _ds_tag(mem, "global_step25", 25, b"p" * 100, ago=3000, save_id="job-0002")  # memory commit
    marker = persisted / ".cpuckpt-complete.json"
    os.utime(marker, (time.time() - 5, time.time() - 5))  # its writer's durable commit: long after the memory one
    code, out = _run("clean", "--deepspeed-tags", mem)
    assert code == 0 and out.splitlines() == [f"nothing to clean in {mem}"], out
    assert waiting.is_dir()


def test_clean_touches_no_deepspeed_tag_without_the_flag(tmp_path):
    """Removing torn tags rests on one engine per save_dir (another engine's commit says nothing of this one's
    pending tag): it is opt-in. Without --deepspeed-tags a dead torn tag and a tag left aside by a killed cleaner
    stay; the flag is refused with --ram and for an s3:// root."""
    root = tmp_path / "save_dir"
    dead = _ds_torn(root, "global_step10", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    aside = _ds_torn(root, ".cpuckpt-removing-global_step5-999999999", ago=4000)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    code, out = _run("clean", root, "--min-age", "0")
    assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], out
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}",
                                              f"removed leftover of an interrupted clean {aside}"], out
    for args in (("--ram",), ("s3://bucket/run",)):
        code, out = _run("clean", "--deepspeed-tags", *args)
        assert code == 2 and "--deepspeed-tags cleans a local DeepSpeed save_dir" in out, out


def test_clean_json_tells_torn_tags_from_leftovers(tmp_path):
    """--json gives a torn tag kind deepspeed-tag and what a killed cleaner left moved aside (.cpuckpt-removing-*)
    kind leftover, so a consumer never takes the leftover for a tag of the run (nor its name for a tag's); the
    text says which is which too."""
    root = tmp_path / "save_dir"
    dead = _ds_torn(root, "global_step10", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    aside = _ds_torn(root, ".cpuckpt-removing-global_step5-999999999", ago=4000)
    (root / "latest.tmp").write_text("global_step20\n")  # a pointer update that died: clean_incomplete's leftover
    os.utime(root / "latest.tmp", (time.time() - 4000,) * 2)
    code, out = _run("clean", "--deepspeed-tags", root, "--dry-run")
    assert code == 0 and out.splitlines() == [f"would remove {root / 'latest.tmp'}",
                                              f"would remove torn DeepSpeed tag {dead}",
                                              f"would remove leftover of an interrupted clean {aside}"], out
    for dry in (True, False):
        code, out = _run("clean", "--deepspeed-tags", root, "--json", *(["--dry-run"] if dry else []))
        assert code == 0 and _json_lines(out) == [
            {"path": str(root / "latest.tmp"), "kind": "leftover", "removed": not dry},
            {"path": str(dead), "kind": "deepspeed-tag", "removed": not dry},
            {"path": str(aside), "kind": "leftover", "removed": not dry}], out
    assert sorted(os.listdir(root)) == ["global_step20"]


def test_clean_keeps_a_tag_it_cannot_delete_and_cleans_the_others(tmp_path, monkeypatch, caplog):
    """A tag that cannot be deleted whole (EACCES in a subdirectory, say) is named in a WARNING and kept aside;
    the other tags are still removed and printed, exit 0. A later clean deletes what was left."""
    import logging
    import shutil

    root = tmp_path / "save_dir"
    stuck = _ds_torn(root, "global_step5", ago=4000)
    (stuck / "sub").mkdir()
    (stuck / "sub" / "x").write_bytes(b"x")
    _age(stuck, 4000)
    _age(stuck / "sub", 4000)
    dead = _ds_torn(root, "global_step10", ago=4000)
    _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    rmtree = shutil.rmtree

    def denied(path, *args, **kwargs):
        if "global_step5" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", denied)
    with caplog.at_level(logging.WARNING):
        code, out = _run("clean", "--deepspeed-tags", root)
    assert code == 0 and out.splitlines() == [f"removed torn DeepSpeed tag {dead}"], out
    assert f"torn DeepSpeed tag {stuck}, moved aside to" in caplog.text and "Permission denied" in caplog.text
    (aside,) = [p for p in root.iterdir() if p.name.startswith(".cpuckpt-removing-global_step5-")]
    assert (aside / "sub" / "x").exists() and not dead.exists()
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    _age(aside, 4000)
    code, out = _run("clean", "--deepspeed-tags", root, "--json")
    assert code == 0 and _json_lines(out) == [{"path": str(aside), "kind": "leftover", "removed": True}], out
    assert sorted(os.listdir(root)) == ["global_step20"]


def test_clean_survives_a_marker_whose_created_unix_is_no_number(tmp_path):
    """A later marker whose ``created_unix`` is text, NaN or out of range dates nothing: nothing removed, exit 0."""
    from cpuckpt.tier.tagmarker import MARKER_NAME

    root = tmp_path / "save_dir"
    torn = _ds_torn(root, "global_step10", ago=4000)
    later = _ds_tag(root, "global_step20", 20, b"b" * 100, ago=10)
    data = json.loads((later / MARKER_NAME).read_text())
    for bad in ("soon", float("nan"), 1e300):
        (later / MARKER_NAME).write_text(json.dumps({**data, "created_unix": bad}))
        _age(later, 10)
        code, out = _run("clean", "--deepspeed-tags", root)
        assert code == 0 and out.splitlines() == [f"nothing to clean in {root}"], (bad, out)
    assert torn.is_dir()


# ------------------------------------------------------------------------------- stock data files, paths


def _stock_save(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((1000,), value), "n": 7}, storage_writer=dcp.FileSystemWriter(str(path)))
    return path


def test_a_stock_checkpoint_whose_data_file_is_gone_or_short_is_incomplete(tmp_path):
    """A stock DCP checkpoint was "complete" with its data file deleted or truncated (only ``.metadata`` was
    looked at): ``ls`` and ``find_latest`` named it the latest, and the load then failed."""
    root = tmp_path / "root"
    good = _stock_save(root / "a", 1.0)
    for name, damage in (("gone", lambda f: f.unlink()), ("short", lambda f: os.truncate(f, f.stat().st_size - 1))):
        bad = _stock_save(root / name, 2.0)
        (data,) = bad.glob("*.distcp")
        os.utime(bad / ".metadata", (time.time() + 60, time.time() + 60))  # committed after `good`
        assert cpuckpt.find_latest(root) == bad
        damage(data)
        assert cpuckpt.find_latest(root) == good, name
        code, out = _run("ls", root)
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert code == 0 and "incomplete" in row and "<- latest" not in row, out
        shutil.rmtree(bad)


def _metadata_naming(src: Path, dest: Path, relative_path: str) -> None:
    """``dest``: a copy of the stock checkpoint ``src`` whose ``.metadata`` names ``relative_path`` for its data
    (pickled here, by the test, from torch's own classes)."""
    import pickle

    shutil.copytree(src, dest)
    md = pickle.loads((src / ".metadata").read_bytes())  # the test's own checkpoint: trusted
    for info in md.storage_data.values():
        info.relative_path = relative_path
    (dest / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_verify_ls_and_inspect_refuse_a_data_path_outside_the_checkpoint(tmp_path, where):
    """A ``.metadata`` naming ``../outside/x.distcp`` (or an absolute path) was read by ``verify`` ("OK") and
    ``inspect``, and ``ls`` called it complete and latest, where ``cpuckpt.load`` refuses it."""
    src = _stock_save(tmp_path / "src", 1.0)
    (data,) = src.glob("*.distcp")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(data, outside / "x.distcp")  # a file the checkpoint must never read
    root = tmp_path / "root"
    root.mkdir()
    rel = "../../outside/x.distcp" if where == "relative" else str(outside / "x.distcp")
    _metadata_naming(src, root / "step_1", rel)
    code, out = _run("verify", root / "step_1")
    assert code == 2 and "outside the checkpoint directory" in out, out
    code, out = _run("ls", root)
    assert code == 0 and "incomplete" in out and "<- latest" not in out, out
    assert cpuckpt.find_latest(root) is None
    code, out = _run("inspect", root / "step_1")
    files = out.split("files:")[1].split("tensors:")[0]  # what it lists as the checkpoint's files
    assert "outside" not in files and "outside the checkpoint directory" in out, out
    with pytest.raises(cpuckpt.CpuckptError, match="outside the checkpoint directory"):
        cpuckpt.load({"w": torch.zeros(1000), "n": 0}, root / "step_1")


def test_verify_of_a_checkpoint_saved_without_checksums_is_not_ok(tmp_path):
    """``verify`` printed "OK ... 0 bytes verified" and exited 0 ("every byte checked and sound") for files
    saved with ``integrity.checksum: none``, whose bytes it could not check."""
    path = tmp_path / "ck"
    cpuckpt.save({"w": torch.arange(1000.0)}, path, {"integrity": {"checksum": "none"}})
    code, out = _run("verify", path)
    assert code == 3 and out.splitlines()[-1].startswith(f"UNVERIFIED {path}"), out
    assert "contents not verifiable" in out, out
    (data,) = path.glob("*.distcp")
    os.truncate(data, 10)  # what can be checked still is: damage is exit 1
    code, out = _run("verify", path)
    assert code == 1 and "truncated" in out, out


def _ds_tag(root: Path, tag: str, step: int, payload: bytes, *, ago: float | None = None,
            save_id: str = "") -> Path:
    """A DeepSpeed tag as cpuckpt's engine commits it: its files, then the marker listing their crc32c (``ago``:
    committed that many seconds ago, its marker's time and every mtime; ``save_id``: a memory tag's marker)."""
    import dataclasses

    import crc32c

    from cpuckpt.tier.tagmarker import TagFile, new_marker, open_tag, write_marker

    d = root / tag
    open_tag(d, fsync=False)
    name = "mp_rank_00_model_states.pt"
    (d / name).write_bytes(payload)
    listed = {name: TagFile(rank=0, nbytes=len(payload), chunk_bytes=len(payload), checksum="crc32c",
                            chunk_checksums=(crc32c.crc32c(payload),))}
    marker = new_marker(tag, 1, listed, step, save_id=save_id)
    if ago is not None:
        marker = dataclasses.replace(marker, created_unix=time.time() - ago)
    write_marker(d, marker, fsync=False)
    if ago is not None:
        _age(d, ago)
    return d


def test_ls_tells_torn_and_damaged_deepspeed_tags_of_cpuckpts_engine(tmp_path):
    """A tag cpuckpt's DeepSpeed engine was still writing (``.cpuckpt-saving``, no marker) was "complete" and the
    latest in ``ls``, as was one whose file no longer matched its marker; ``latest`` naming a torn tag marked it."""
    from cpuckpt.tier.tagmarker import open_tag

    _ds_tag(tmp_path, "global_step10", 10, b"a" * 100)
    _ds_tag(tmp_path, "global_step20", 20, b"b" * 100)
    open_tag(tmp_path / "global_step20", fsync=False)  # a save into it began: torn until its marker comes
    (tmp_path / "latest").write_text("global_step20")
    code, out = _run("ls", tmp_path, "--json")
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}
    assert code == 0 and rows["global_step20"]["status"] == "incomplete", out
    assert [n for n, r in rows.items() if r["latest"]] == ["global_step10"], out

    _ds_tag(tmp_path, "global_step30", 30, b"c" * 100)
    (tmp_path / "latest").write_text("global_step30")
    data = tmp_path / "global_step30" / "mp_rank_00_model_states.pt"
    data.write_bytes(b"c" * 99 + b"d")  # same size: only the crc32c tells
    code, out = _run("ls", tmp_path, "--json")
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}
    assert code == 0 and rows["global_step30"]["status"] == "complete" and rows["global_step30"]["latest"], out
    code, out = _run("ls", "--verify", tmp_path, "--json")
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}
    assert code == 1 and rows["global_step30"]["status"] == "damaged", out
    assert [n for n, r in rows.items() if r["latest"]] == ["global_step10"], out

    # verify reads such a tag too: damage named by file and byte range, a sound tag OK, a torn one not checkable
    code, out = _run("verify", tmp_path / "global_step30")
    assert code == 1 and f"DAMAGED {data}: bytes [0, 100): checksum mismatch in chunk 0" in out, out
    code, out = _run("verify", tmp_path / "global_step10")
    assert code == 0 and out.startswith(f"OK {tmp_path / 'global_step10'}: 1 file(s), 1 chunk(s), 100 bytes"), out
    code, out = _run("verify", tmp_path / "global_step20")
    assert code == 2 and "torn" in out, out


def test_verify_of_sound_checkpoints_with_nothing_to_checksum_is_ok(tmp_path):
    """Not "UNVERIFIED": an empty data file (a rank with no items, an empty state dict) has no chunks to check, and a
    stock record that ``weights_only`` refuses (an argparse Namespace) had its zip CRCs checked."""
    import argparse

    cpuckpt.save({}, tmp_path / "empty")
    code, out = _run("verify", tmp_path / "empty")
    assert code == 0 and out.startswith("OK "), out
    dcp.save({"w": torch.arange(10.0), "args": argparse.Namespace(lr=0.1)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    code, out = _run("verify", tmp_path / "stock")
    assert code == 0 and out.splitlines()[-1].startswith("OK "), out


def test_ctrl_c_exits_130_not_the_damaged_status(tmp_path, monkeypatch, capsys):
    """Click's standalone mode exits 1 on Ctrl-C, `verify`'s "damaged": a script watching checkpoints would
    call a sound one corrupt because its check was interrupted. Interrupted is 130, as a shell reports SIGINT;
    the other outcomes keep their codes."""
    from cpuckpt.tools import verification
    from cpuckpt.tools.cli import main

    cpuckpt.save({"w": torch.ones(8)}, tmp_path / "c")
    assert main(["verify", str(tmp_path / "c")]) == 0
    assert main(["verify", str(tmp_path / "absent")]) == 2
    assert main(["ls", "--no-such-option"]) == 2

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verification, "verify_checkpoint", interrupted)
    assert main(["verify", str(tmp_path / "c")]) == 130
    assert "Aborted!" in capsys.readouterr().err


def test_a_step_taken_from_the_name_is_marked_as_such(tmp_path):
    """A checkpoint that records no step is listed with the last number of its name, marked (~N, JSON
    step_from_name, inspect says so), not shown as if it were the saved step."""
    from cpuckpt.tools.cli import main

    sd = {"x": torch.ones(3)}
    cpuckpt.save(sd, tmp_path / "r" / "step_100", step=100)
    dcp.save(sd, storage_writer=cpuckpt.StorageWriter(tmp_path / "r" / "final7"))
    runner = CliRunner()
    table = runner.invoke(cli, ["ls", str(tmp_path / "r")]).output
    rows = {line.split()[0]: line.split()[2] for line in table.splitlines()[1:]}
    assert rows == {"step_100": "100", "final7": "~7"}, table
    out = runner.invoke(cli, ["ls", "--json", str(tmp_path / "r")]).output
    listed = [json.loads(line) for line in out.splitlines()]
    assert {Path(d["path"]).name: (d["step"], d["step_from_name"]) for d in listed} == {
        "step_100": (100, False), "final7": (7, True)}
    assert "7 (the last number in its name: it records none)" in runner.invoke(
        cli, ["inspect", "--no-tensors", str(tmp_path / "r" / "final7")]).output
    assert main(["ls", str(tmp_path / "r")]) == 0


def test_convert_keeps_numpy_values_that_load_keeps(tmp_path):
    """cpuckpt.load loads numpy values (README: every load path); convert skipped them ("not loadable with
    torch.load(weights_only=True)"). Now it reads items as load does."""
    import numpy as np

    sd = {"w": torch.ones(4), "counts": np.arange(5, dtype=np.int64), "scale": np.float32(0.5)}
    cpuckpt.save(sd, tmp_path / "c")
    code, out = _run("convert", tmp_path / "c", "--to", "torch", tmp_path / "full.pt")
    assert code == 0, out
    got = torch.load(tmp_path / "full.pt", weights_only=False)
    assert torch.equal(got["w"], sd["w"]) and np.array_equal(got["counts"], sd["counts"])
    assert got["scale"] == np.float32(0.5) and "skipped" not in out, out
