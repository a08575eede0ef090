"""Replication throughput beside raw send/recv of the same bytes, in one run (memory.replicas).

``python -m benchmarks.bench_replica [--nbytes 1GiB] [--reps 5] [--dir /dev/shm] [--out DIR] [--smoke]``
(CPU box, loopback). A checkpoint of ``--nbytes`` written by ``cpuckpt.save`` into a RAM directory stands
in for a node's memory slot. A receiver process (this script with ``--serve``) runs the writer's replica
receiver (:class:`cpuckpt.tier.replica.Listener`) and a raw receiver on loopback. Per repetition, in turn:

* ``raw``: the slot's data files sent with ``sendfile``, received with ``recv_into`` into one reused buffer
  and ``pwrite`` into a preallocated RAM file: the floor of this transport with the same destination work;
* ``replica``: ``send_slot`` (the protocol: header, acceptance, ``sendfile``, crc32c per chunk on receipt,
  commit of manifest and ``.metadata``).

Reported: GB/s (data bytes / wall seconds), median (min-max). Raw results go to ``DIR/bench_replica.json``.
On a GPU cluster the copy belongs on the RDMA NIC (no kernel copies, no receiving core); this measures the
TCP path that runs anywhere.
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
from benchmarks.common import format_table, summarize
from cpuckpt.backend.committed import read_manifest
from cpuckpt.tier.replica import Endpoint, Listener, send_slot, write_token

logger = logging.getLogger(__name__)

TOKEN = "bench-replica-token-0123456789ab"
_LEN = struct.Struct("!Q")


def _serve(root: Path) -> int:
    """Receiver process: the replica listener on a thread, the raw receiver in the main thread."""
    from cpuckpt.transfer.threads import new_executor

    write_token(root, TOKEN)
    listener = Listener(root, "127.0.0.1", headroom_bytes=0, timeout_s=120)
    rx = new_executor(1, "bench-replica-rx")
    rx.submit(listener.serve_forever)
    raw = socket.create_server(("127.0.0.1", 0))
    sys.stdout.write(json.dumps({"replica": listener.endpoint.port, "raw": raw.getsockname()[1]}) + "\n")
    sys.stdout.flush()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    try:
        while True:
            conn, _ = raw.accept()
            with conn:
                head = bytearray(_LEN.size)
                conn.recv_into(head, _LEN.size, socket.MSG_WAITALL)
                (nbytes,) = _LEN.unpack(head)
                if nbytes == 0:
                    return 0
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


def _raw_send(port: int, files: list[Path], nbytes: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(_LEN.pack(nbytes))
        for f in files:
            with open(f, "rb") as fh:
                sock.sendfile(fh)
        if sock.recv(1) != b"K":
            raise ConnectionError("raw receiver did not confirm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nbytes", type=float, default=1 << 30, help="checkpoint bytes (default 1 GiB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm", help="RAM directory for the slot and the receiver's root")
    p.add_argument("--out", default=".", help="directory for bench_replica.json")
    p.add_argument("--smoke", action="store_true", help="a tiny run that keeps the script working")
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        return _serve(Path(args.serve))
    if args.smoke:
        args.nbytes, args.reps = 8 << 20, 2
    work = Path(tempfile.mkdtemp(prefix="cpuckpt-bench-", dir=args.dir))
    server = None
    try:
        slot, rx_root = work / "slot-0", work / "rx"
        rx_root.mkdir(mode=0o700)
        numel = int(args.nbytes) // 4
        state = {f"t{i}": torch.randn(numel // 8) for i in range(8)}
        cpuckpt.save(state, slot, {"io": {"chunk_bytes": 4 << 20}}, step=1)
        manifest = read_manifest(slot)
        files = [slot / n for n in sorted(manifest.files)]
        nbytes = sum(e.nbytes for e in manifest.files.values())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                            os.environ.get("PYTHONPATH", "")])}
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_replica", "--serve", str(rx_root)],
                                  stdout=subprocess.PIPE, text=True, env=env)
        ports = json.loads(server.stdout.readline())
        results: dict[str, list[float]] = {"raw": [], "replica": []}
        for _ in range(args.reps):
            t0 = time.perf_counter()
            _raw_send(ports["raw"], files, nbytes)
            results["raw"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            sent = send_slot(Endpoint("127.0.0.1", ports["replica"]), TOKEN, source="bench:node0", slot=slot,
                             save_id=manifest.save_id, into="replica", timeout_s=120)
            results["replica"].append(sent / (time.perf_counter() - t0) / 1e9)
        summary = {k: summarize(v) for k, v in results.items()}
        rows = [[k, f"{s['median']:.2f}", f"{s['min']:.2f}-{s['max']:.2f}"] for k, s in summary.items()]
        sys.stdout.write(f"cpuckpt replica throughput, {nbytes / 2**20:.0f} MiB, loopback, {args.reps} reps\n")
        sys.stdout.write(format_table(["path", "GB/s median", "min-max"], rows) + "\n")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_replica.json").write_text(json.dumps({"nbytes": nbytes, "gbps": results, "summary": summary},
                                                           indent=1))
        with socket.create_connection(("127.0.0.1", ports["raw"]), timeout=60) as sock:
            sock.sendall(_LEN.pack(0))  # a transfer of 0 bytes tells the receiver to exit
        server.wait(timeout=60)
        return 0
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
