"""Interop with the S3 Connector for PyTorch on a real S3 server: a checkpoint cpuckpt wrote to ``s3://`` loads
bit-exact with stock ``s3torchconnector.dcp.S3StorageReader`` (no cpuckpt at load), resharded from 2 ranks to
1; and cpuckpt loads (2 ranks, and 1) a checkpoint that ``S3StorageWriter`` wrote.

The stock side runs with the AWS conventions a user would set (``AWS_ENDPOINT_URL``, credentials, region in
the environment) and ``S3ClientConfig(force_path_style=True)`` for an S3-compatible server.
"""

from __future__ import annotations

import _helpers as H
import torch

SEED = 4242
CFG = {"io": {"chunk_bytes": "5MiB", "threads": 2}}
TENSORS = {  # name -> (shape, dtype); saved by 2 ranks as DTensors sharded on dim 0
    "big_f32": ((1280, 2048), torch.float32),  # 10 MiB: 5 MiB (one part) per rank
    "bf16": ((33, 70), torch.bfloat16),
    "i64": ((9, 4), torch.int64),
}


def _full(name: str) -> torch.Tensor:
    shape, dtype = TENSORS[name]
    return H.make_full(name, shape, dtype, seed=SEED)


def _sharded(*, poisoned: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,))
    out = {n: H.make_dtensor(_full(n), mesh, [Shard(0)], poisoned=poisoned) for n in TENSORS}
    out["meta"] = {"step": 11}
    return out


def _check_sharded(state: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,))
    for n in TENSORS:
        H.assert_dtensor(state[n], _full(n), mesh, [Shard(0)], n)
    assert state["meta"] == {"step": 11}


def _stock_config():
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def rank_save_cpuckpt(url: str) -> None:
    import cpuckpt

    cpuckpt.save(_sharded(poisoned=False), url, CFG)


def rank_save_stock(url: str) -> None:
    import os

    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    dcp.save(_sharded(poisoned=False),
             storage_writer=S3StorageWriter(os.environ["AWS_REGION"], url, s3client_config=_stock_config()))


def rank_load_cpuckpt(url: str) -> None:
    import cpuckpt

    state = _sharded(poisoned=True)
    cpuckpt.load(state, url, CFG)
    _check_sharded(state)


def test_stock_s3_reader_loads_ours_resharded(run_ranks, s3_env, s3_url):
    """2 ranks save with cpuckpt; this process (no process group, no cpuckpt in the load) reads full tensors."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    run_ranks(2, rank_save_cpuckpt, s3_url, env=s3_env)
    state = {n: H.poison(_full(n)) for n in TENSORS}
    state["meta"] = {"step": 0}
    dcp.load(state, storage_reader=S3StorageReader(s3_env["AWS_REGION"], s3_url, s3client_config=_stock_config()),
             no_dist=True)
    for n in TENSORS:
        H.assert_bitexact(state[n], _full(n), n)
    assert state["meta"] == {"step": 11}


def test_cpuckpt_loads_a_stock_s3_checkpoint(run_ranks, s3_env, s3_url):
    import cpuckpt

    run_ranks(2, rank_save_stock, s3_url, env=s3_env)
    run_ranks(2, rank_load_cpuckpt, s3_url, env=s3_env)
    state = {n: H.poison(_full(n)) for n in TENSORS}  # resharded 2 -> 1, in this process
    state["meta"] = {"step": 0}
    cpuckpt.load(state, s3_url, CFG)
    for n in TENSORS:
        H.assert_bitexact(state[n], _full(n), n)
    assert state["meta"] == {"step": 11}
