"""GPU paths: pinned pool, side-stream D2H ordered after the trainer's stream, H2D loads.

Run on the device machine (``pytest -m gpu tests/gpu``); skipped where CUDA is absent. The same
logic runs on CPU in CI through the host-fill path (tests/unit, tests/dist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt.transfer.staging import get_pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
    pytest.mark.usefixtures("fresh_pool"),  # tests/conftest.py
]

SMALL = {"io": {"chunk_bytes": "256KiB", "threads": 4}}


def _state(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),  # 4 MiB: spans many chunks
        "b": torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16),
        "f8": torch.randn(64, 64, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "view": torch.randn(64, 128, device="cuda", generator=g)[:, ::2],
        "cpu": torch.arange(1000, dtype=torch.int64),
        "scalar": torch.tensor(2.5, device="cuda"),
        "meta": {"step": 7},
    }


def _clone(sd: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in sd.items()}


def _zeros(sd: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0}) for k, v in sd.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _assert_same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].device == v.device, k
            assert torch.equal(_bits(v.contiguous()), _bits(b[k].contiguous())), k
        else:
            assert b[k] == v, k


@pytest.mark.parametrize("mode,pool", [("snapshot", 0), ("streaming", "1MiB")])  # the shard is ~4.1 MiB
def test_tensor_changed_after_staged_is_not_in_checkpoint(tmp_path: Path, mode: str, pool: object) -> None:
    sd = _state()
    ref = _clone(sd)
    cfg = {**SMALL, "staging": {"pool_bytes": pool}}  # pool_bytes picks the mode
    h = cpuckpt.async_save(sd, tmp_path / "ck", cfg)
    h.staged.wait()
    for v in sd.values():  # the trainer's next step, on its own stream and on the CPU
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.bfloat16, torch.int64):
            v.add_(1)
    h.wait()
    assert h.stats.mode == mode
    out = _zeros(ref)
    cpuckpt.load(out, tmp_path / "ck", SMALL)
    _assert_same(ref, out)


def test_pool_is_pinned_and_reused(tmp_path: Path) -> None:
    cpuckpt.prepare_pool(8 << 20, SMALL)
    pool = get_pool(256 << 10, 1, pin=True, pretouch=False)
    assert pool.pinned
    sd = _state()
    for i in range(2):
        cpuckpt.async_save(sd, tmp_path / f"ck{i}", SMALL).wait()  # pool_bytes 0: snapshot
        assert get_pool(256 << 10, 1, pin=True, pretouch=False) is pool


def test_copies_wait_for_kernels_queued_on_the_trainer_stream(tmp_path: Path) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(a)
    torch.matmul(a, a, out=out)  # queued, not synchronised
    for _ in range(8):
        out.mul_(1.0001)
    h = cpuckpt.async_save({"out": out}, tmp_path / "ck", SMALL)
    h.staged.wait()
    expected = out.clone()
    torch.cuda.synchronize()
    h.wait()
    back = {"out": torch.zeros_like(out)}
    cpuckpt.load(back, tmp_path / "ck")
    assert torch.equal(back["out"], expected)


@pytest.mark.parametrize("verify", ["always", "off"])
def test_load_into_gpu_tensors(tmp_path: Path, verify: str) -> None:
    sd = _state(1)
    cpuckpt.save(sd, tmp_path / "ck", SMALL)
    out = _zeros(sd)
    cpuckpt.load(out, tmp_path / "ck", {**SMALL, "integrity": {"verify": verify}})
    _assert_same(sd, out)


def test_dcp_async_save_door_snapshots_gpu_tensors(tmp_path: Path) -> None:
    sd = _state(2)
    ref = _clone(sd)
    w = cpuckpt.StorageWriter(tmp_path / "ck", SMALL)
    resp = dcp.async_save(sd, storage_writer=w)
    resp.staging_completion.result()
    sd["w"].add_(1)
    resp.upload_completion.result()
    w.close()
    out = _zeros(ref)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")))
    _assert_same(ref, out)
