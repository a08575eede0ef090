"""Replication throughput beside raw send/recv and gloo send/recv of the same bytes, in one run
(memory.replicas), and what replication adds to a memory save's blocked time.

``python -m benchmarks.bench_replica [--nbytes 1GiB] [--reps 5] [--dir /dev/shm] [--out DIR] [--smoke]
[--only throughput|stall] [--stall-nbytes 10MB] [--stall-saves 20] [--stall-block 5] [--gap-s 0.05]``
(CPU box, loopback).

**Throughput.** A checkpoint of ``--nbytes`` written by ``cpuckpt.save`` into a RAM directory stands in for
a node's memory slot. A receiver process (this script with ``--serve``) runs the writer's replica receiver
(:class:`cpuckpt.tier.replica.Listener`), a raw receiver on loopback, and rank 1 of a 2-rank gloo group
(this process is rank 0). Per repetition, each path once, the order rotating from one repetition to the next:

* ``raw``: the slot's data files sent with ``sendfile``, received with ``recv_into`` into one reused buffer
  and ``pwrite`` into a preallocated RAM file: the floor of this transport with the same destination work;
* ``gloo``: the same bytes (the slot's data files read into one tensor) sent with ``dist.send`` in
  ``--chunk`` pieces (32 MiB), received with ``dist.recv`` into one preallocated tensor of the same size;
  timed from the request on the control socket to the receiver's acknowledgement;
* ``replica``: ``send_slot`` (the protocol: header, acceptance, ``sendfile``, crc32c per chunk on receipt,
  commit of manifest and ``.metadata``).

Reported: GB/s (data bytes / wall seconds), median (min-max), and replica / gloo, replica / raw per
repetition (median, min-max).

**Stall** (:mod:`benchmarks.replica_stall`): two nodes on loopback, each rank saving ``--stall-nbytes`` into
a memory tier with ``replicas: 1`` and one with ``replicas: 0``, ``--stall-saves`` each in alternating blocks;
the blocked time (call to ``staged``), the memory commit (call to ``wait()``) and the replica's landing,
median (min-max) over the saves of the slower rank, and the differences of the medians (replicas 1 - 0).

Raw results go to ``DIR/bench_replica.json``. On a GPU cluster the copy belongs on the RDMA NIC (no kernel
copies, no receiving core); this measures the TCP path that runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import cpuckpt
from benchmarks import replica_stall
from benchmarks.common import format_table, summarize
from cpuckpt.backend.committed import read_manifest
from cpuckpt.tier.replica import Endpoint, Listener, send_slot, write_token

logger = logging.getLogger(__name__)

TOKEN = "bench-replica-token-0123456789ab"
_HEAD = struct.Struct("!cQ")  # operation (b"R" raw, b"G" gloo, b"X" exit), bytes
_CHUNK = 32 << 20


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]


def _init_gloo(init: str, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)


def _serve(root: Path, gloo_init: str, chunk: int) -> int:
    """Receiver process: the replica listener on a thread; the raw receiver and gloo rank 1 in the main thread."""
    import torch.distributed as dist

    from cpuckpt.transfer.threads import new_executor

    write_token(root, TOKEN)
    listener = Listener(root, "127.0.0.1", headroom_bytes=0, timeout_s=120)
    rx = new_executor(1, "bench-replica-rx")
    rx.submit(listener.serve_forever)
    raw = socket.create_server(("127.0.0.1", 0))
    sys.stdout.write(json.dumps({"replica": listener.endpoint.port, "raw": raw.getsockname()[1]}) + "\n")
    sys.stdout.flush()
    _init_gloo(gloo_init, 1)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    dest: torch.Tensor | None = None
    try:
        while True:
            conn, _ = raw.accept()
            with conn:
                head = bytearray(_HEAD.size)
                conn.recv_into(head, _HEAD.size, socket.MSG_WAITALL)
                op, nbytes = _HEAD.unpack(head)
                if op == b"X":
                    return 0
                if op == b"G":
                    if dest is None or dest.numel() != nbytes:
                        dest = torch.ones(nbytes, dtype=torch.uint8)  # allocated and touched once, reused
                    for o, n in _chunks(nbytes, chunk):
                        dist.recv(dest[o:o + n], src=0)
                    conn.sendall(b"K")
                    continue
                fd = os.open(root / "raw.bin", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                    offset = 0
                    while offset < nbytes:
                        n = conn.recv_into(view[: min(len(buf), nbytes - offset)], 0, socket.MSG_WAITALL)
                        if n == 0:
                            raise ConnectionError("raw sender closed early")
                        os.pwrite(fd, view[:n], offset)
                        offset += n
                finally:
                    os.close(fd)
                conn.sendall(b"K")
    finally:
        listener.stop()
        rx.shutdown(wait=True)
        dist.destroy_process_group()


def _raw_send(port: int, files: list[Path], nbytes: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(_HEAD.pack(b"R", nbytes))
        for f in files:
            with open(f, "rb") as fh:
                sock.sendfile(fh)
        if sock.recv(1) != b"K":
            raise ConnectionError("raw receiver did not confirm")


def _gloo_send(port: int, data: torch.Tensor, chunk: int) -> None:
    import torch.distributed as dist

    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(_HEAD.pack(b"G", data.numel()))
        for o, n in _chunks(data.numel(), chunk):
            dist.send(data[o:o + n], dst=1)
        if sock.recv(1) != b"K":
            raise ConnectionError("gloo receiver did not confirm")


def _read_files(files: list[Path], nbytes: int) -> torch.Tensor:
    """The files' bytes, concatenated, in one uint8 tensor."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    view, offset = memoryview(data.numpy()), 0
    for f in files:
        with open(f, "rb") as fh:
            while n := fh.readinto(view[offset:]):
                offset += n
    if offset != nbytes:
        raise RuntimeError(f"read {offset} bytes of {nbytes}")
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ratio_rows(results: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """replica / gloo and replica / raw, per repetition (the paths of one repetition ran back to back)."""
    return {f"replica/{ref}": summarize([a / b for a, b in zip(results["replica"], results[ref])])
            for ref in ("gloo", "raw")}


def _throughput(args: argparse.Namespace, work: Path) -> tuple[dict, str]:
    slot, rx_root = work / "slot-0", work / "rx"
    rx_root.mkdir(mode=0o700)
    numel = int(args.nbytes) // 4
    state = {f"t{i}": torch.randn(numel // 8) for i in range(8)}
    cpuckpt.save(state, slot, {"io": {"chunk_bytes": 4 << 20}}, step=1)
    del state
    manifest = read_manifest(slot)
    files = [slot / n for n in sorted(manifest.files)]
    nbytes = sum(e.nbytes for e in manifest.files.values())
    data = _read_files(files, nbytes)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    gloo_init = f"tcp://127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_replica", "--serve", str(rx_root),
                               "--gloo-init", gloo_init, "--chunk", str(args.chunk)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        ports = json.loads(server.stdout.readline())
        _init_gloo(gloo_init, 0)

        def replica() -> int:
            return send_slot(Endpoint("127.0.0.1", ports["replica"]), TOKEN, source="bench:node0", slot=slot,
                             save_id=manifest.save_id, into="replica", timeout_s=120)

        paths = {"raw": lambda: _raw_send(ports["raw"], files, nbytes),
                 "gloo": lambda: _gloo_send(ports["raw"], data, args.chunk),
                 "replica": replica}
        results: dict[str, list[float]] = {k: [] for k in paths}
        order = list(paths)
        for rep in range(args.reps):
            for name in order[rep % 3:] + order[:rep % 3]:  # interleaved, the order rotating
                t0 = time.perf_counter()
                sent = paths[name]()
                seconds = time.perf_counter() - t0
                if name == "replica" and sent != nbytes:
                    raise RuntimeError(f"replica sent {sent} bytes, expected {nbytes}")
                results[name].append(nbytes / seconds / 1e9)
        with socket.create_connection(("127.0.0.1", ports["raw"]), timeout=60) as sock:
            sock.sendall(_HEAD.pack(b"X", 0))  # tells the receiver to exit
        server.wait(timeout=60)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if server.poll() is None:
            server.kill()
            server.wait()
    summary = {k: summarize(v) for k, v in results.items()}
    ratios = _ratio_rows(results)
    rows = [[k, f"{s['median']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}"] for k, s in {**summary, **ratios}.items()]
    text = (f"cpuckpt replica throughput, {nbytes / 2**20:.0f} MiB, loopback, {args.reps} reps "
            f"(interleaved), gloo in {args.chunk >> 20} MiB chunks\n"
            + format_table(["path", "GB/s median (ratio)", "min-max"], rows) + "\n")
    return {"nbytes": nbytes, "chunk": args.chunk, "gbps": results, "summary": summary, "ratios": ratios}, text


def _stall(args: argparse.Namespace, work: Path) -> tuple[dict, str]:
    d = work / "stall"
    d.mkdir()
    result = replica_stall.run(d, nbytes=int(args.stall_nbytes), saves=args.stall_saves, block=args.stall_block,
                               warmup=args.stall_warmup, gap_s=args.gap_s,
                               open_order="0,1" if args.smoke else "1,0")
    s = result["summary"]
    rows = []
    for m in replica_stall.METRICS:
        a, b = s["replicas=1"][m], s["replicas=0"][m]
        rows.append([m, f"{b['median'] * 1e3:.2f} ({b['min'] * 1e3:.2f}-{b['max'] * 1e3:.2f})",
                     f"{a['median'] * 1e3:.2f} ({a['min'] * 1e3:.2f}-{a['max'] * 1e3:.2f})",
                     f"{(a['median'] - b['median']) * 1e3:+.2f}"])
    result["diff_ms"] = {m: (s["replicas=1"][m]["median"] - s["replicas=0"][m]["median"]) * 1e3
                         for m in replica_stall.METRICS}
    text = (f"cpuckpt replica save stall, 2 nodes on loopback, {args.stall_nbytes / 1e6:.0f} MB per rank, "
            f"{args.stall_saves} saves per config in blocks of {args.stall_block} (alternating), "
            f"gap {args.gap_s * 1e3:.0f} ms; ms from the call, slower rank per save\n"
            + format_table(["event", "replicas 0: median (min-max)", "replicas 1: median (min-max)",
                            "1 - 0 (median)"], rows) + "\n")
    return result, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nbytes", type=float, default=1 << 30, help="checkpoint bytes (default 1 GiB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk", type=int, default=_CHUNK, help="gloo send/recv size (default 32 MiB)")
    p.add_argument("--dir", default="/dev/shm", help="RAM directory for the slots and the receivers' roots")
    p.add_argument("--out", default=".", help="directory for bench_replica.json")
    p.add_argument("--only", choices=("throughput", "stall"), default="", help="run one part only")
    p.add_argument("--stall-nbytes", type=float, default=10e6, help="bytes per rank of the stall part (10 MB)")
    p.add_argument("--stall-saves", type=int, default=20, help="measured saves per configuration")
    p.add_argument("--stall-block", type=int, default=5, help="saves per block (replicas 1 and 0 alternate)")
    p.add_argument("--stall-warmup", type=int, default=4, help="uncounted saves per configuration first")
    p.add_argument("--gap-s", type=float, default=0.05, help="sleep before each save (a training step)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny run that keeps the script working (both parts at the same time)")
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)
    p.add_argument("--gloo-init", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        return _serve(Path(args.serve), args.gloo_init, args.chunk)
    if args.smoke:
        args.nbytes, args.reps, args.chunk = 8 << 20, 2, 1 << 20
        args.stall_nbytes, args.stall_saves, args.stall_block, args.stall_warmup = 1 << 20, 2, 1, 1
    work = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-", dir=args.dir))
    try:
        result: dict = {"argv": sys.argv[1:] if argv is None else argv}
        stall = None
        if args.smoke and not args.only:
            # the two parts run at the same time (their processes' imports overlap; a smoke run's times mean
            # nothing); the stall part's processes are its own, the throughput part's gloo group is this process's
            from concurrent.futures import ThreadPoolExecutor

            ex = ThreadPoolExecutor(1)
            stall = ex.submit(_stall, args, work)
            ex.shutdown(wait=False)
        try:
            if args.only != "stall":
                part, text = _throughput(args, work)
                result.update(part)
                sys.stdout.write(text)
        finally:
            if stall is not None:
                result["stall"], text = stall.result()
                sys.stdout.write(text)
        if args.only != "throughput" and stall is None:
            result["stall"], text = _stall(args, work)
            sys.stdout.write(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_replica.json").write_text(json.dumps(result, indent=1))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
