"""FSDP2 model + Adam through ``get_state_dict`` -> cpuckpt.save -> cpuckpt.load -> ``set_state_dict``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) runs on gloo over a 1-D CPU device mesh with torch
2.13, so no fallback is needed: parameters and Adam's ``exp_avg``/``exp_avg_sq`` are DTensors
sharded Shard(0) over 2 ranks, ``step`` is a plain tensor. A freshly built (differently initialised)
model and optimizer receive the checkpoint; every parameter and every optimizer state tensor must
then be bit-exact, and one more identical training step on both must give bit-identical parameters.
"""

from __future__ import annotations

import _helpers as H
import torch


def _build(mesh, seed: int):
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 40), nn.LayerNorm(40), nn.ReLU(), nn.Linear(40, 7, bias=False))
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.LayerNorm)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)
    return model, opt


def _train_step(model, opt, step: int) -> None:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(6, 12, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _flatten(obj, prefix: str = "") -> dict:
    """Every leaf of a nested state dict, keyed by its path."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}/"))
    else:
        out[prefix.rstrip("/")] = obj
    return out


def _snapshot(model, opt) -> dict:
    """Deep copies (local shards) of the FQN-keyed model and optimizer state dicts, plus raw ones."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    snap = {}
    for prefix, sd in (("model", msd), ("optim", osd), ("raw_optim", opt.state_dict())):
        for k, v in _flatten(sd).items():
            snap[f"{prefix}/{k}"] = _local(v).detach().clone() if isinstance(v, torch.Tensor) else v
    for name, p in model.named_parameters():
        snap[f"param/{name}"] = _local(p).detach().clone()
    return snap


def _compare(got: dict, want: dict, what: str) -> int:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    n = 0
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            H.assert_bitexact(got[k], w, f"{what}: {k}")
            n += 1
        else:
            assert got[k] == w, f"{what}: {k}: {got[k]!r} != {w!r}"
    return n


def rank_fsdp2_roundtrip(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import cpuckpt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = _build(mesh, seed=0)
    for step in range(2):
        _train_step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    assert all(isinstance(v, DTensor) for v in msd.values()), "FSDP2 parameters should be DTensors"
    exp_avg = [s["exp_avg"] for s in osd["state"].values()]
    assert exp_avg and all(isinstance(t, DTensor) for t in exp_avg), "Adam state should be DTensors"
    want = _snapshot(model, opt)
    cpuckpt.save({"model": msd, "optim": osd}, path, {"io": {"chunk_bytes": "4KiB", "threads": 2}}, step=2)

    fresh, fresh_opt = _build(mesh, seed=123)
    before = _snapshot(fresh, fresh_opt)
    assert not torch.equal(H.byte_view(before["param/0.weight"]), H.byte_view(want["param/0.weight"]))
    msd2, osd2 = get_state_dict(fresh, fresh_opt)  # initialises Adam's state tensors to load into
    cpuckpt.load({"model": msd2, "optim": osd2}, path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    checked = _compare(_snapshot(fresh, fresh_opt), want, "restored")

    # The restored pair trains on exactly like the original.
    _train_step(model, opt, 2)
    _train_step(fresh, fresh_opt, 2)
    checked += _compare(_snapshot(fresh, fresh_opt), _snapshot(model, opt), "after one more step")
    dist.barrier()
    return {"tensors_checked": checked, "adam_states": len(exp_avg)}


def test_fsdp2_model_and_adam_roundtrip(run_ranks, tmp_path):
    results = run_ranks(2, rank_fsdp2_roundtrip, str(tmp_path / "fsdp2"), timeout_s=120)
    for r in results:
        # 5 parameters (Linear weight+bias, LayerNorm weight+bias, bias-free Linear weight)
        assert r["adam_states"] == 5, r
        assert r["tensors_checked"] > 40, r
