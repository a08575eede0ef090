"""The cached save call path with CUDA tensors: device gathers of small tensors, stream order, fallbacks.

Run on the device machine (``pytest -m gpu tests/gpu``); skipped where CUDA is absent. The host side of
the same code (programs filled by ``torch.cat`` on the CPU) runs in tests/unit/test_itemcache.py and
tests/unit/test_fillplan.py.

A repeated save reuses the previous save's items (``stats.resolved == "cached"``); a chunk of many
small CUDA tensors is gathered on the device by one ``torch.cat`` into a scratch buffer on the side
stream and copied to the host in one D2H (``transfer.fillplan``). Checked: the bytes (bit-exact loads),
that the gather path really ran, that copies wait for kernels queued before the call, that a chunk
holding host bytes (a CPU tensor or a pickled value) is copied segment by segment, and that tensors
may change once ``staged`` completed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cpuckpt
from cpuckpt.tier.images import ImageSet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
    pytest.mark.usefixtures("fresh_pool"),  # tests/conftest.py
]

CFG = {"io": {"chunk_bytes": "256KiB", "threads": 4, "fsync": False}}


class _Trainer:
    def __init__(self, n: int = 600, *, with_cpu: bool = False) -> None:
        g = torch.Generator(device="cuda").manual_seed(n)
        self.params: dict[str, torch.Tensor] = {}
        for i in range(n):
            self.params[f"l{i}.w"] = torch.randn(8, 8 + i % 3, device="cuda", generator=g).to(
                torch.bfloat16 if i % 4 == 0 else torch.float32)
            if with_cpu and i == n // 2:
                self.params["host"] = torch.arange(64, dtype=torch.int64)  # host bytes among device ones
        self.params["big"] = torch.randn(512, 1024, device="cuda", generator=g)  # 2 MiB: chunks of its own
        self.params["nc"] = torch.randn(64, 32, device="cuda", generator=g).t()  # copied afresh each save
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        self.step += 1
        return {"model": {k: v.detach() for k, v in self.params.items()}, "extra": {"step": self.step}}

    def update(self) -> None:
        with torch.no_grad():
            for v in self.params.values():
                v.add_(1 if v.is_floating_point() else 3)


def _load_and_compare(path: Path, want: dict[str, torch.Tensor], step: int) -> None:
    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}, "extra": {"step": None}}
    cpuckpt.load(out, path, CFG)
    for k, v in want.items():
        got = out["model"][k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8).cpu(), v.reshape(-1).view(torch.uint8).cpu()), k
    assert out["extra"]["step"] == step


def _device_programs(handle: cpuckpt.AsyncSaveHandle) -> int:
    job = handle._writer.job
    return sum(1 for f in job.files for p in (f.fill_programs or {}).values() if p.device is not None)


@pytest.mark.parametrize("where", ["pool", "images"])
def test_repeated_gpu_saves_gather_on_device_bit_exact(tmp_path: Path, where: str) -> None:
    trainer = _Trainer()
    images = ImageSet(tmp_path / "slot", pin=True) if where == "images" else None
    try:
        resolved, gathers = [], []
        for k in range(4):
            trainer.update()  # queued on the current stream, not synchronised: the copies must wait for it
            sd = trainer.state_dict()
            path = tmp_path / ("slot" if images is not None else f"s{k}")
            h = cpuckpt.async_save(sd, path, CFG, step=k, sink=images)
            h.staged.wait()
            want = {key: v.clone() for key, v in trainer.params.items()}  # after staged: the values saved
            trainer.update()  # the trainer moves on once staged: the checkpoint keeps the earlier values
            h.wait()
            resolved.append(h.stats.resolved)
            gathers.append(_device_programs(h))
            _load_and_compare(path, want, trainer.step)
        assert resolved == ["planner", "cached", "cached", "cached"]
        assert gathers[0] == 0 and all(n > 0 for n in gathers[1:]), gathers
    finally:
        if images is not None:
            images.close()


def test_host_bytes_in_a_chunk_keep_it_on_the_segment_path(tmp_path: Path) -> None:
    """A CPU tensor among CUDA ones: its chunk has no device program, the others still gather; bytes exact."""
    trainer = _Trainer(with_cpu=True)
    handles = []
    for k in range(3):
        trainer.update()
        h = cpuckpt.async_save(trainer.state_dict(), tmp_path / f"s{k}", CFG, step=k)
        h.staged.wait()
        want = {key: v.clone() for key, v in trainer.params.items()}
        h.wait()
        handles.append(h)
        _load_and_compare(tmp_path / f"s{k}", want, trainer.step)
    last = handles[-1]
    assert last.stats.resolved == "cached"
    job = last._writer.job
    assert any(p.device is not None for f in job.files for p in (f.fill_programs or {}).values())
    host = next(i for i, src in enumerate(job.sources) if src is not None and not src.is_cuda)
    for f in job.files:
        for chunk in f.chunks:
            if any(seg.item == host for seg in f.segments_in(chunk.offset, chunk.offset + chunk.nbytes)):
                assert (f.fill_programs or {}).get(chunk.index) is None, "mixed devices: segment by segment"


def test_device_gathers_do_not_grow_reserved_memory(tmp_path: Path) -> None:
    """The gather scratch comes from the trainer's stream: repeated saves reserve no more device memory.

    (A scratch allocated on the side stream would stay cached for that stream; copiers take their
    streams from a pool of 32, so every save could keep another chunk-sized block reserved.)
    """
    trainer = _Trainer(n=2000)
    reserved = []
    for k in range(10):
        trainer.update()
        h = cpuckpt.async_save(trainer.state_dict(), tmp_path / f"s{k % 2}", CFG, step=k)
        h.wait()
        assert k < 2 or _device_programs(h) > 0
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[3], reserved
