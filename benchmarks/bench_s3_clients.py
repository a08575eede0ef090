"""Which S3 client cpuckpt keeps: raw parallel multipart PUT and ranged GET of the same bytes, per client.

Starts a local SeaweedFS (``cpuckpt.testing.seaweed``), then for each candidate uploads ``--mib`` MiB as one
object in ``--part-mib`` parts on ``--threads`` threads and reads it back with ranged GETs of the same size,
best of ``--repeat`` runs. Candidates: boto3 (``upload_part`` from our buffers, ``get_object`` with
``Range``), obstore (Rust ``object_store``: ``put`` with multipart, ``get_range``), and
``s3torchconnectorclient`` (the CRT client of the S3 Connector for PyTorch: ``put_object`` stream,
``get_object`` with a range). What each API allows matters as much as speed: see docs/ARCHITECTURE.md
("Object storage") for the choice. Prints a table last; ``--out`` writes the raw JSON.

    python -m benchmarks.bench_s3_clients --mib 512
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cpuckpt.testing.seaweed import SeaweedServer

logger = logging.getLogger("bench_s3_clients")


def _boto3(server: SeaweedServer, data: memoryview, part: int, threads: int) -> tuple[Callable, Callable]:
    import boto3
    from botocore.config import Config as BotoConfig

    s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                      aws_secret_access_key=server.secret_key, region_name="us-east-1",
                      config=BotoConfig(s3={"addressing_style": "path"}, max_pool_connections=threads * 2))
    key = "bench/boto3"

    def put() -> None:
        up = s3.create_multipart_upload(Bucket=server.bucket, Key=key)["UploadId"]

        def one(i: int) -> dict:
            body = _View(data[i * part:(i + 1) * part])
            r = s3.upload_part(Bucket=server.bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=body)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        with cf.ThreadPoolExecutor(threads) as ex:
            parts = list(ex.map(one, range(-(-len(data) // part))))
        s3.complete_multipart_upload(Bucket=server.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

    def get(out: memoryview) -> None:
        def one(i: int) -> None:
            lo, hi = i * part, min((i + 1) * part, len(out))
            body = s3.get_object(Bucket=server.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
            got = 0
            while got < hi - lo:
                n = body.readinto(out[lo + got:hi]) if hasattr(body, "readinto") else 0
                if not n:
                    chunk = body.read(hi - lo - got)
                    if not chunk:
                        raise OSError("short read")
                    out[lo + got:lo + got + len(chunk)] = chunk
                    n = len(chunk)
                got += n

        with cf.ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(-(-len(out) // part))))

    return put, get


class _View:
    """A read-only file over a memoryview (boto3 takes no memoryview as a body)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(self.pos + n, len(self.view))
        out = bytes(self.view[self.pos:end])
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.view) + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def __len__(self) -> int:
        return len(self.view)


def _obstore(server: SeaweedServer, data: memoryview, part: int, threads: int) -> tuple[Callable, Callable]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(server.bucket, endpoint=server.endpoint, access_key_id=server.access_key,
                    secret_access_key=server.secret_key, region="us-east-1", virtual_hosted_style_request=False,
                    client_options={"allow_http": True})
    key = "bench/obstore"

    def put() -> None:
        obstore.put(store, key, (data[i:i + part] for i in range(0, len(data), part)), chunk_size=part,
                    max_concurrency=threads)

    def get(out: memoryview) -> None:
        def one(i: int) -> None:
            lo, hi = i * part, min((i + 1) * part, len(out))
            out[lo:hi] = memoryview(obstore.get_range(store, key, start=lo, end=hi))

        with cf.ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(-(-len(out) // part))))

    return put, get


def _crt(server: SeaweedServer, data: memoryview, part: int, threads: int) -> tuple[Callable, Callable]:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

    os.environ.update(server.env())
    client = MountpointS3Client("us-east-1", endpoint=server.endpoint, part_size=part, force_path_style=True)
    key = "bench/crt"

    def put() -> None:
        stream = client.put_object(server.bucket, key)
        for i in range(0, len(data), part):
            stream.write(bytes(data[i:i + part]))  # takes bytes only: one copy per part
        stream.close()

    def get(out: memoryview) -> None:
        def one(i: int) -> None:
            lo, hi = i * part, min((i + 1) * part, len(out))
            pos = lo
            for chunk in client.get_object(server.bucket, key, start=lo, end=hi):
                out[pos:pos + len(chunk)] = chunk
                pos += len(chunk)

        with cf.ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(-(-len(out) // part))))

    return put, get


CLIENTS = {"boto3": _boto3, "obstore": _obstore, "s3torchconnectorclient": _crt}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--part-mib", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="the server's data directory (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="16 MiB in 8 MiB parts, once (keeps the script working)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.mib, args.part_mib, args.repeat = 16, 8, 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    nbytes, part = args.mib << 20, args.part_mib << 20
    data = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    out = memoryview(bytearray(nbytes))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d, SeaweedServer(Path(d)) as server:
        for name, make in CLIENTS.items():
            try:
                put, get = make(server, data, part, args.threads)
            except ImportError as e:
                logger.warning("%s: not installed (%s)", name, e)
                continue
            puts, gets = [], []
            for _ in range(args.repeat):
                t = time.perf_counter()
                put()
                puts.append(nbytes / (time.perf_counter() - t) / 1e9)
                t = time.perf_counter()
                get(out)
                gets.append(nbytes / (time.perf_counter() - t) / 1e9)
                if out != data:
                    raise RuntimeError(f"{name}: read back differs from what was written")
            rows.append({"client": name, "put_gbps": puts, "get_gbps": gets})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_s3_clients.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"{args.mib} MiB, {args.part_mib} MiB parts, {args.threads} threads, median (min-max) of {args.repeat}")
    print(f"{'client':<24} {'PUT GB/s':>20} {'GET GB/s':>20}")
    for r in rows:
        fmt = [f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for v in (r["put_gbps"], r["get_gbps"])]
        print(f"{r['client']:<24} {fmt[0]:>20} {fmt[1]:>20}")


if __name__ == "__main__":
    main()
