"""Object storage: save and load GB/s of cpuckpt on ``s3://`` beside its peers and the server's own ceiling, one run.

Starts a local SeaweedFS (``cpuckpt.testing.seaweed``; data in ``--dir``, default a temp dir) and, in this one
process, on the same state dict (``--gib`` GiB of mixed sizes from ``common.build_state_dict`` plus
``--tiny`` small tensors: 1,000+ tensors), measures ``--repeat`` times:

- ``raw``: the server's ceiling with the chosen client (``transfer.objstore``): a parallel multipart PUT of the
  same number of bytes in ``io.chunk_bytes`` parts on ``io.threads`` threads, and ranged GETs of it on
  ``io.read_threads`` threads;
- ``cpuckpt``: ``cpuckpt.save`` / ``cpuckpt.load`` of ``s3://`` (verified loads, the default);
- ``s3torchconnector``: DCP with ``S3StorageWriter``/``S3StorageReader`` (``thread_count`` = ``io.threads``);
- ``dcp+s3fs``: DCP with ``FsspecWriter``/``FsspecReader`` over s3fs (``thread_count`` = ``io.threads``; needs
  ``pip install "s3fs>=2023" "boto3<1.44"``: s3fs's aiobotocore pins an older botocore than boto3 1.44's).

and, with ``--memtier``, the memory tier persisting to ``s3://``: a ``MemoryTier`` save's time to its memory commit
(the trainer's wait), the writer process's persist to the bucket (GB/s, from the call to the durable commit), and a
CPU "training step" (``common.matmul_loop``: 4 bf16 matmuls on the CPU) timed alone and while the persist runs.

Every load is checked bit-exact. Each save goes to a new prefix, deleted after its load. Medians with
min-max; GB = 1e9 bytes of tensor data. Prints a table last; ``--out`` gets the raw JSON. Speed is the
box's (2 shared cores: client and server compete for them); ratios are ours.

    python -m benchmarks.bench_s3 --gib 1 --repeat 3
    python -m benchmarks.bench_s3 --smoke
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    build_state_dict,
    clone_empty,
    count_leaves,
    format_table,
    matmul_loop,
    median,
    same_state_dict,
    small_state_dict,
    state_dict_nbytes,
    summarize,
)
from cpuckpt.config import Config, S3Config
from cpuckpt.paths import S3Url
from cpuckpt.testing.seaweed import SeaweedServer
from cpuckpt.transfer.objstore import S3Store

logger = logging.getLogger("bench_s3")


def _state(gib: float, tiny: int) -> dict[str, Any]:
    sd = build_state_dict(int(gib * (1 << 30)))
    sd["tiny"] = small_state_dict(tiny, distinct_shapes=True, seed=1)
    return sd


def _raw(store: S3Store, bucket: str, nbytes: int, cfg: Config) -> tuple[Callable[[], None], Callable[[], None]]:
    """The server's ceiling with our client: parts and ranges of ``io.chunk_bytes``, our thread counts."""
    part = cfg.io.chunk_bytes
    data = memoryview(bytearray(os.urandom(1 << 20)) * -(-nbytes // (1 << 20)))[:nbytes]
    out = memoryview(bytearray(nbytes))
    url = S3Url(bucket, f"raw-{uuid.uuid4().hex[:8]}/blob")
    ranges = [(lo, min(lo + part, nbytes)) for lo in range(0, nbytes, part)]

    def put() -> None:
        upload = store.create_upload(url)
        with cf.ThreadPoolExecutor(cfg.io.threads) as ex:
            etags = list(ex.map(lambda k: store.upload_part(upload, k + 1, data[ranges[k][0]:ranges[k][1]]),
                                range(len(ranges))))
        store.complete_upload(upload, etags)

    def get() -> None:
        with cf.ThreadPoolExecutor(cfg.io.read_threads) as ex:
            got = sum(ex.map(lambda r: store.get_into(url, r[0], out[r[0]:r[1]]), ranges))
        if got != nbytes or out[:1 << 20] != data[:1 << 20]:
            raise RuntimeError("raw GET read back other bytes")

    return put, get


def _variants(region: str, cfg: Config, cfg_dict: dict) -> dict[str, tuple[Callable[[dict, str], None],
                                                                           Callable[[dict, str], None]]]:
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    out: dict[str, tuple[Callable, Callable]] = {
        "cpuckpt": (lambda sd, url: cpuckpt.save(sd, url, cfg_dict), lambda sd, url: cpuckpt.load(sd, url, cfg_dict)),
    }
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        conf = S3ClientConfig(force_path_style=True)
        out["s3torchconnector"] = (
            lambda sd, url: dcp.save(sd, storage_writer=S3StorageWriter(region, url, s3client_config=conf,
                                                                        thread_count=cfg.io.threads)),
            lambda sd, url: dcp.load(sd, storage_reader=S3StorageReader(region, url, s3client_config=conf)))
    except ImportError as e:
        logger.warning("s3torchconnector: not installed (%s)", e)
    try:
        import s3fs
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if int(s3fs.__version__.split(".")[0]) < 2023:
            raise ImportError(f"s3fs {s3fs.__version__} predates fsspec's async filesystem")
        out["dcp+s3fs"] = (
            lambda sd, url: dcp.save(sd, storage_writer=FsspecWriter(url, thread_count=cfg.io.threads)),
            lambda sd, url: dcp.load(sd, storage_reader=FsspecReader(url)))
    except ImportError as e:
        logger.warning("dcp+s3fs: not measured (%s)", e)
    return out


def _memtier(sd: dict, root: str, ram: Path, repeat: int, step_n: int) -> dict[str, list[float]]:
    """The memory tier persisting to ``root``: memory-commit wait, persist GB/s, step time alone / during."""
    from cpuckpt.tier.memory import MemoryTier

    nbytes = state_dict_nbytes(sd)
    tier = MemoryTier(root, {"memory": {"root": str(ram), "persist_every": 1, "slots": 2, "headroom_bytes": 0}})
    out: dict[str, list[float]] = {}
    try:
        matmul_loop(3, step_n)  # warm
        tier.save(sd, 0).wait()  # warm: the first persist starts the writer process (imports torch)
        tier.wait_persisted()
        for rep in range(repeat):
            alone = matmul_loop(10, step_n)
            t = time.perf_counter()
            tier.save(sd, rep + 1).wait()
            out.setdefault("memory_commit_s", []).append(time.perf_counter() - t)
            during: list[float] = []
            while not tier.persisted(rep + 1):
                during += matmul_loop(1, step_n)
                if time.perf_counter() - t > 600:
                    raise RuntimeError("the persist to s3:// did not finish within 600 s")
            out.setdefault("persist_gbps", []).append(nbytes / (time.perf_counter() - t) / 1e9)
            out.setdefault("step_during_over_alone", []).append(median(during) / median(alone) if during else 1.0)
    finally:
        tier.close(persist_newest=False)
    return out


def _delete_prefix(store: S3Store, bucket: str, key: str) -> None:
    for o in list(store.list(S3Url(bucket, key))):
        store.delete(S3Url(bucket, o.key))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="tensor GiB of the mixed-size part of the state dict")
    ap.add_argument("--tiny", type=int, default=1000, help="small tensors added to it")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the server's data directory (default: the temp dir)")
    ap.add_argument("--out", default=None, help="directory for bench_s3.json")
    ap.add_argument("--memtier", action="store_true", help="also the memory tier persisting to s3:// (see above)")
    ap.add_argument("--step-n", type=int, default=1024, help="matmul size of the CPU training step (--memtier)")
    ap.add_argument("--smoke", action="store_true", help="16 MiB + 50 small tensors, once: keeps the script working")
    args = ap.parse_args(argv)
    if args.smoke:
        args.gib, args.tiny, args.repeat, args.memtier, args.step_n = 1 / 64, 50, 1, True, 128
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    cfg_dict: dict = {}
    cfg = Config.from_dict(cfg_dict)
    sd = _state(args.gib, args.tiny)
    nbytes = state_dict_nbytes(sd)
    ntensors = count_leaves(sd)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-s3-") as d, SeaweedServer(Path(d)) as server:
        os.environ.update(server.env())
        store = S3Store(S3Config(endpoint_url=server.endpoint), credentials=(server.access_key, server.secret_key))
        put, get = _raw(store, server.bucket, nbytes, cfg)
        variants = _variants(server.env()["AWS_REGION"], cfg, cfg_dict)
        for rep in range(args.repeat):
            t = time.perf_counter()
            put()
            results.setdefault("raw", {}).setdefault("save", []).append(nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            get()
            results["raw"].setdefault("load", []).append(nbytes / (time.perf_counter() - t) / 1e9)
            for name, (save, load) in variants.items():
                key = f"{name}-{rep}-{uuid.uuid4().hex[:6]}"
                url = f"s3://{server.bucket}/{key}"
                t = time.perf_counter()
                save(sd, url)
                save_s = time.perf_counter() - t
                target = clone_empty(sd)
                t = time.perf_counter()
                load(target, url)
                load_s = time.perf_counter() - t
                diff = same_state_dict({k: v for k, v in target.items() if k != "extra"},
                                       {k: v for k, v in sd.items() if k != "extra"})
                if diff is not None:
                    raise RuntimeError(f"{name}: the load differs from what was saved: {diff}")
                r = results.setdefault(name, {})
                r.setdefault("save", []).append(nbytes / save_s / 1e9)
                r.setdefault("load", []).append(nbytes / load_s / 1e9)
                _delete_prefix(store, server.bucket, key + "/")
                logger.info("%s rep %d: save %.2f s, load %.2f s", name, rep, save_s, load_s)
        memtier: dict[str, list[float]] = {}
        if args.memtier:  # the RAM root in /dev/shm where there is one, as a job would have it
            ram = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-s3-", dir="/dev/shm" if Path("/dev/shm").is_dir() else d))
            try:
                memtier = _memtier(sd, f"s3://{server.bucket}/memtier", ram / "ram", args.repeat, args.step_n)
            finally:
                shutil.rmtree(ram, ignore_errors=True)
    rows = []
    for name in ["raw", *[v for v in results if v != "raw"]]:
        s, lo = summarize(results[name]["save"]), summarize(results[name]["load"])
        rows.append([name, f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})",
                     f"{lo['median']:.3f} ({lo['min']:.3f}-{lo['max']:.3f})"])
    peers = [v for v in results if v not in ("raw", "cpuckpt")]
    notes = []
    for what in ("save", "load"):
        if peers:
            best = max(peers, key=lambda v: summarize(results[v][what])["median"])
            ours = summarize(results["cpuckpt"][what])["median"]
            ratio = ours / summarize(results[best][what])["median"]
            raw = ours / summarize(results["raw"][what])["median"]
            notes.append(f"cpuckpt {what} / best peer ({best}): {ratio:.2f}x; / raw: {raw:.2f}x")
    if memtier:
        m = {k: summarize(v) for k, v in memtier.items()}
        notes.append(f"memory tier to s3://: memory commit {m['memory_commit_s']['median']:.3f} s, persist "
                     f"{m['persist_gbps']['median']:.3f} GB/s ({m['persist_gbps']['min']:.3f}-"
                     f"{m['persist_gbps']['max']:.3f}), CPU step during persist / alone "
                     f"{m['step_during_over_alone']['median']:.2f}x")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_s3.json").write_text(json.dumps(
            {"args": vars(args), "nbytes": nbytes, "tensors": ntensors, "results": results, "memtier": memtier},
            indent=1))
    print(format_table(["variant", "save GB/s", "load GB/s"], rows, right=[False, True, True],
                       title=f"local SeaweedFS, {nbytes / 1e9:.2f} GB in {ntensors} leaves, median (min-max) of "
                             f"{args.repeat}", footnotes=notes))


if __name__ == "__main__":
    main()
