"""Loads into GPU tensors: the fast path, RAM-filesystem files read through pinned slots, stream order.

Run on the device machine (``pytest -m gpu tests/gpu/test_load_gpu.py``); skipped where CUDA is absent.
The CPU paths of the same code run in tests/unit/test_load_fastpath.py.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt.backend.ramread import in_ram

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

CFG = {"io": {"chunk_bytes": "1MiB", "threads": 4}}


@pytest.fixture
def ram_dir() -> Iterator[Path]:
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and in_ram("/dev/shm/x")):
        pytest.skip("no writable tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="cpuckpt-test-") as d:
        yield Path(d)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {f"small.{i}": torch.randn(int(torch.randint(1, 5000, (), generator=g)), generator=g) for i in range(300)}
    sd |= {"big": torch.randn(3 << 20, generator=g), "bf": torch.randn(1000, 700, generator=g).to(torch.bfloat16)}
    return sd


@pytest.mark.parametrize("verify", ["always", "off"])
def test_ram_checkpoint_loads_bit_exact_into_gpu_tensors(ram_dir, verify):
    """GPU targets of a RAM file: read through pinned slots, not copied from the file's mapping."""
    sd = _state()
    cfg = {**CFG, "integrity": {"verify": verify}}
    cpuckpt.save(sd, ram_dir / "c", cfg)
    out = {k: torch.full_like(v, 7, device="cuda") for k, v in sd.items()}
    reader = cpuckpt.StorageReader(ram_dir / "c", cfg)
    cpuckpt.load(out, ram_dir / "c", cfg, storage_reader=reader)
    torch.cuda.synchronize()
    stats = reader.last_stats
    assert stats.fast_path and stats.mapped_files == 0
    for k, v in sd.items():
        assert torch.equal(out[k].cpu(), v), k


def test_load_is_ordered_after_kernels_queued_on_the_targets(ram_dir):
    """Targets still being written by queued kernels (a long matmul, then a fill) get the saved bytes, not the fill."""
    sd = {"w": torch.randn(2048, 2048)}
    cpuckpt.save(sd, ram_dir / "c", CFG)
    out = {"w": torch.empty(2048, 2048, device="cuda")}
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 4096
    out["w"].fill_(1.0)  # queued behind the matmuls when the load starts
    cpuckpt.load(out, ram_dir / "c", CFG, storage_reader=cpuckpt.StorageReader(ram_dir / "c", CFG))
    assert torch.equal(out["w"].cpu(), sd["w"])


def test_fast_path_equals_dcp_planner_on_gpu_with_dtype_change(tmp_path):
    sd = {"a": torch.randn(300, 200).to(torch.bfloat16), "b": torch.randn(50), "n": 4}
    cpuckpt.save(sd, tmp_path / "c", CFG)
    mine = {"a": torch.zeros(300, 200, device="cuda"), "b": torch.zeros(50, device="cuda"), "n": 0}
    ref = {"a": torch.zeros(300, 200, device="cuda"), "b": torch.zeros(50, device="cuda"), "n": 0}
    reader = cpuckpt.StorageReader(tmp_path / "c", CFG)
    cpuckpt.load(mine, tmp_path / "c", CFG, storage_reader=reader)
    dcp.load(ref, storage_reader=cpuckpt.StorageReader(tmp_path / "c", CFG))
    assert reader.last_stats.fast_path
    assert torch.equal(mine["a"], ref["a"]) and torch.equal(mine["b"], ref["b"]) and mine["n"] == ref["n"] == 4
    assert torch.equal(mine["a"].cpu(), sd["a"].float())


@pytest.mark.parametrize("pool_first", [False, True])
def test_a_load_without_a_pool_pins_its_own_slots_one_at_a_time(tmp_path, pool_first):
    """A restart (no process pool) pins only the slots it copies from and keeps no pool; with a pool it reads
    through that pool and pins nothing more."""
    from cpuckpt.transfer import staging

    sd = _state()
    cfg = {**CFG, "io": {**CFG["io"], "read_threads": 3}}
    cpuckpt.save(sd, tmp_path / "c", cfg)
    staging.release_pool()
    if pool_first:
        staging.get_pool(1 << 20, 4, pin=True, pretouch=False)
    out = {k: torch.full_like(v, 7, device="cuda") for k, v in sd.items()}
    reader = cpuckpt.StorageReader(tmp_path / "c", cfg)
    cpuckpt.load(out, tmp_path / "c", cfg, storage_reader=reader)
    pinned = reader.last_stats.slots_pinned_nbytes
    if pool_first:
        assert pinned == 0 and staging.pool_state()[0] == 4 << 20
    else:
        assert 0 < pinned <= 3 << 20 and staging.pool_state() == (0, False)
    for k, v in sd.items():
        assert torch.equal(out[k].cpu(), v), k
    staging.release_pool()
