"""``s3://bucket/prefix`` checkpoints on a real S3 server (SeaweedFS): 2 gloo ranks save (sync, async, through
``dcp.save`` with our writer) and load bit-exact, resharded 2 -> 1 and 2 -> 3; the objects are DCP's names plus
the manifest, nothing else is left behind (no manifest parts, no multipart uploads), and a committed prefix
is never overwritten.

Chunks are 5 MiB (S3's smallest part) and the big tensor spans three of them per rank, so every data object is
a real multipart upload of several parts, uploaded from several writer threads.
"""

from __future__ import annotations

import _helpers as H
import torch

SEED = 3131
CFG = {"io": {"chunk_bytes": "5MiB", "threads": 3}}
# name -> (shape, dtype, placement when saved by 2 ranks)
TENSORS = {
    "big_s0_f32": ((1536, 4096), torch.float32, "s0"),  # 24 MiB: 12 MiB (3 parts) per rank
    "s1_bf16": ((40, 1100), torch.bfloat16, "s1"),
    "s0_i64": ((11, 7), torch.int64, "s0"),
    "r_f16": ((9, 10), torch.float16, "r"),
    "s0_tiny": ((2, 5), torch.float32, "s0"),  # over 3 ranks one shard is empty
}
LOAD = {  # how each world size loads each tensor (s0/s1: DTensor Shard(d), r: Replicate, plain: a full tensor)
    1: {"big_s0_f32": "plain", "s1_bf16": "plain", "s0_i64": "plain", "r_f16": "plain", "s0_tiny": "plain"},
    2: {"big_s0_f32": "s0", "s1_bf16": "s1", "s0_i64": "s0", "r_f16": "r", "s0_tiny": "s0"},
    3: {"big_s0_f32": "s1", "s1_bf16": "s0", "s0_i64": "s0", "r_f16": "s0", "s0_tiny": "s0"},
}


def _full(name: str) -> torch.Tensor:
    shape, dtype, _ = TENSORS[name]
    return H.make_full(name, shape, dtype, seed=SEED)


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if spec == "r" else [Shard(int(spec[1]))]


def _state(world: int, specs: dict[str, str], *, poisoned: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,)) if dist.is_initialized() else None
    out = {}
    for name, spec in specs.items():
        full = _full(name)
        if spec == "plain":
            out[name] = H.poison(full) if poisoned else full.clone()
        else:
            out[name] = H.make_dtensor(full, mesh, _placements(spec), poisoned=poisoned)
    out["extra"] = {"step": 7, "note": "s3"}
    return out


def _check(state: dict, world: int, specs: dict[str, str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,)) if dist.is_initialized() else None
    for name, spec in specs.items():
        if spec == "plain":
            H.assert_bitexact(state[name], _full(name), name)
        else:
            H.assert_dtensor(state[name], _full(name), mesh, _placements(spec), name)
    assert state["extra"] == {"step": 7, "note": "s3"}


def _saved_specs() -> dict[str, str]:
    return {n: spec for n, (_, _, spec) in TENSORS.items()}


def rank_save(url: str, how: str) -> None:
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    state = _state(2, _saved_specs(), poisoned=False)
    if how == "sync":
        cpuckpt.save(state, url, CFG, step=7)
    elif how == "async":
        handle = cpuckpt.async_save(state, url, CFG, step=7)
        handle.wait()
    else:  # DCP's own entry point with our writer
        dcp.save(state, storage_writer=cpuckpt.StorageWriter(url, CFG, step=7))


def rank_load(url: str, world: int, how: str = "cpuckpt") -> None:
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    state = _state(world, LOAD[world], poisoned=True)
    if how == "cpuckpt":
        cpuckpt.load(state, url, CFG)
    else:
        dcp.load(state, storage_reader=cpuckpt.StorageReader(url, CFG))
    _check(state, world, LOAD[world])


def _objects(server, url: str) -> list[str]:
    from cpuckpt.paths import S3Url

    prefix = S3Url.parse(url)
    store = server.store()
    return sorted(o.key[len(prefix.key) + 1:] for o in store.list(S3Url(prefix.bucket, prefix.key + "/")))


def _assert_committed(server, url: str) -> None:
    from cpuckpt.paths import S3Url

    assert _objects(server, url) == [".cpuckpt.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert server.store().list_uploads(S3Url.parse(url)) == [], "a multipart upload was left behind"


def test_sync_save_load_and_reshard(run_ranks, s3_server, s3_env, s3_url):
    run_ranks(2, rank_save, s3_url, "sync", env=s3_env)
    _assert_committed(s3_server, s3_url)
    run_ranks(2, rank_load, s3_url, 2, env=s3_env)
    run_ranks(3, rank_load, s3_url, 3, "dcp", env=s3_env)
    rank_load(s3_url, 1)  # this process, no process group: the whole checkpoint into plain tensors


def test_async_save_and_dcp_door(run_ranks, s3_server, s3_env, s3_url):
    run_ranks(2, rank_save, s3_url + "/async", "async", env=s3_env)
    _assert_committed(s3_server, s3_url + "/async")
    run_ranks(2, rank_save, s3_url + "/dcp", "dcp", env=s3_env)
    _assert_committed(s3_server, s3_url + "/dcp")
    run_ranks(2, rank_load, s3_url + "/async", 2, env=s3_env)
    rank_load(s3_url + "/dcp", 1, "dcp")


def test_committed_prefix_is_never_overwritten(s3_server, s3_env, s3_url):
    import pytest

    import cpuckpt

    state = {"w": torch.arange(10.0)}
    cpuckpt.save(state, s3_url, CFG)
    with pytest.raises(cpuckpt.StorageIOError, match="holds a committed checkpoint") as err:
        cpuckpt.save({"w": torch.zeros(10)}, s3_url, CFG)
    assert err.value.errno == 17  # EEXIST
    out = {"w": torch.zeros(10)}
    cpuckpt.load(out, s3_url, CFG)
    assert torch.equal(out["w"], torch.arange(10.0))
