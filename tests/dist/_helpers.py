"""Shared helpers for the multi-process tests (test modules load this file by path).

Every tensor is built deterministically from (name, shape, dtype, seed), so any process, at any
world size, can recompute the full reference tensor and the slice a rank should hold. Tensors are
random *bytes* (all bit patterns, NaN payloads and infinities included), so equality is checked on
byte views: a conversion, a lost NaN payload or a shifted byte anywhere fails the test.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ALL_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2,
)


def make_full(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The deterministic full reference tensor ``name`` (random bytes; random 0/1 for bool)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{shape}:{dtype}".encode()))
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The logical tensor's bytes, in row-major order, as a 1-D uint8 tensor."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8)


def poison(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of t's dtype/shape in which every byte differs from t's."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return ~t
    return (byte_view(t) ^ 0xFF).view(t.dtype).reshape(t.shape).clone()


def assert_bitexact(actual: Any, expected: torch.Tensor, what: str) -> None:
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, expected a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}, expected " \
        f"{tuple(expected.shape)}"
    a, e = byte_view(actual), byte_view(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte {bad[0].item()} "
                             f"(got {a[bad[0]].item():#04x}, expected {e[bad[0]].item():#04x}); dtype "
                             f"{expected.dtype}, shape {tuple(expected.shape)}")


# ------------------------------------------------------------------------------------ DTensor


def local_slice(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """The part of ``full`` this rank holds under ``placements`` (DTensor's own sharding rule)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    t = full
    for d, (o, n) in enumerate(zip(offset, shape)):
        t = t.narrow(d, o, n)
    return t


def make_dtensor(full: torch.Tensor, mesh: Any, placements: Any, *, poisoned: bool = False) -> Any:
    """A DTensor over ``mesh`` whose local shard is this rank's slice of ``full`` (or its poison).

    Built with ``from_local`` and no collectives, so it works for every dtype on gloo.
    """
    from torch.distributed.tensor import DTensor

    local = local_slice(full, mesh, placements).clone()
    if poisoned:
        local = poison(local)
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=full.shape,
                              stride=full.stride())


def assert_dtensor(actual: Any, full: torch.Tensor, mesh: Any, placements: Any, what: str) -> None:
    from torch.distributed.tensor import DTensor

    assert isinstance(actual, DTensor), f"{what}: got {type(actual).__name__}, expected a DTensor"
    assert tuple(actual.placements) == tuple(placements), f"{what}: placements {actual.placements}"
    assert_bitexact(actual.to_local(), local_slice(full, mesh, placements), f"{what} (local shard)")


# ------------------------------------------------------------------------------ ShardedTensor


def make_sharded_tensor(full: torch.Tensor, rank: int, world: int, *, poisoned: bool = False) -> Any:
    """A row-sharded ShardedTensor (torch.chunk rows per rank) holding ``full``."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rows = full.shape[0]
    per = -(-rows // world)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    local = full[lo:hi].clone()
    if poisoned:
        local = poison(local)
    md = ShardMetadata(shard_offsets=[lo, *([0] * (full.dim() - 1))], shard_sizes=list(local.shape),
                       placement=f"rank:{rank}/cpu")
    return init_from_local_shards([Shard(local, md)], list(full.shape))


def assert_sharded_tensor(actual: Any, full: torch.Tensor, rank: int, world: int, what: str) -> None:
    rows = full.shape[0]
    per = -(-rows // world)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    shards = actual.local_shards()
    assert len(shards) == 1, f"{what}: {len(shards)} local shards"
    assert_bitexact(shards[0].tensor, full[lo:hi], f"{what} (local shard)")


# ------------------------------------------------------------------------------------ files


def checkpoint_listing(path: str | Path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


def assert_committed_layout(path: str | Path, world: int, files_per_rank: int = 1) -> None:
    """Exactly the data files, ``.metadata`` and the manifest: no parts, no temporaries."""
    names = set(checkpoint_listing(path))
    expected = {".metadata", ".cpuckpt.json"}
    for r in range(world):
        for k in range(files_per_rank):
            expected.add(f"__{r}_{k}.distcp")
    assert names == expected, f"{path}: files {sorted(names)}, expected {sorted(expected)}"


# ------------------------------------------------------------------------------------ layouts


@contextlib.contextmanager
def files_per_rank(n: int) -> Iterator[None]:
    """cpuckpt saves made inside spread each rank's items over up to ``n`` data files, as the writer did
    with ``io.files_per_rank: n`` before that key was removed (issue 28): the checkpoints older versions
    wrote, which loads must still read. Wraps ``LayoutCache.plan`` (every writer's layouts) in this process;
    not for a save that runs concurrently with another one."""
    from cpuckpt.format.layout import LayoutCache

    real = LayoutCache.plan

    def spread(self: LayoutCache, items: Any, **kw: Any) -> Any:
        return real(self, items, **{**kw, "num_files": n})

    LayoutCache.plan = spread  # type: ignore[method-assign]
    try:
        yield
    finally:
        LayoutCache.plan = real  # type: ignore[method-assign]


def plan_layout(values: list[Any], cfg: Any, num_files: int = 2) -> tuple[list[str], list[Any], list[Any]]:
    """What the StorageWriter plans for ``values`` (tensors as records, ``bytes`` as raw items) on rank 0:
    file names, file layouts and per-item sources, for driving a SaveJob directly (``memory_job``)."""
    from cpuckpt.format.layout import LayoutItem, plan_files
    from cpuckpt.format.record import record_template
    from cpuckpt.transfer.staging import flat_bytes

    items, sources = [], []
    for v in values:
        if isinstance(v, bytes):
            items.append(LayoutItem(data_nbytes=len(v), payload=v))
            sources.append(None)
            continue
        tpl = record_template(v.dtype, tuple(v.shape))
        items.append(LayoutItem(tpl.data_nbytes, tpl.head, tpl.tail))
        sources.append(flat_bytes(v))
    files, _ = plan_files(items, num_files=num_files, chunk_bytes=cfg.io.chunk_bytes,
                          align_bytes=cfg.layout.align_bytes, align_data_min_bytes=cfg.layout.align_data_min_bytes)
    return [f"__0_{k}.distcp" for k in range(len(files))], files, sources


def memory_job(directory: Any, names: list[str], files: list[Any], sources: list[Any], cfg: Any, *, rank: int,
               images: Any) -> Any:
    """The save engine's job of a memory save: ``SaveJob`` with the sink of ``images`` (an ``ImageSet``)."""
    from cpuckpt.transfer.save_job import SaveJob

    return SaveJob(directory, names, files, sources, cfg, rank=rank, mode="snapshot",
                   sink=images(directory, names, files, cfg, rank=rank))


def refuse_forks() -> None:
    """From now on this process cannot start a subprocess (``subprocess.Popen`` raises EAGAIN, as a full process
    table does): a rank whose writer process cannot start."""
    import subprocess

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "planted: cannot fork")

    subprocess.Popen = refuse  # type: ignore[misc, assignment]


AGREEMENTS = ("all_reduce", "all_gather_object", "broadcast_object_list")


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """How many of each :data:`AGREEMENTS` collective this process makes inside the block (the real ones run)."""
    import torch.distributed as dist

    made = dict.fromkeys(AGREEMENTS, 0)
    real = {name: getattr(dist, name) for name in AGREEMENTS}

    def counting(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            made[name] += 1
            return real[name](*args, **kwargs)
        return counted

    for name in AGREEMENTS:
        setattr(dist, name, counting(name))
    try:
        yield made
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
