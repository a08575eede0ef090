"""Replicas of memory checkpoints on partner nodes: the TCP protocol, its sender and its receiver.

Who and over what: the *writer process* of each node's leader replicates (it outlives its trainer, and
a gloo group dies with any member, so no collective is used): after the node's memory commit it sends
the node's slot (every data file its manifest lists, the manifest, ``.metadata``) to the writer of each
partner node over a plain TCP connection. The receiver writes it into
``<its RAM root>/replica-<hash of the source node key>/slot-<k>``: it checks the RAM bound first
(the headroom check of the RAM root), preallocates every file, compares each chunk's checksum with the
source manifest's as it arrives, and commits the replica the way every checkpoint commits (manifest,
then ``.metadata`` last) only when every byte arrived and verified and the sender confirms that its
slot was not reused meanwhile. A replica directory is thus an ordinary checkpoint directory, complete
for the source node's ranks. An adapter's file set across nodes (:mod:`cpuckpt.tier.nodefiles`) travels the
same way: its listed files, then its node listing and its marker, written last in that order. The same
protocol restores a lost node at restart (``into="slot"``: the holder's trainer sends the replica into the new
node's own ``slot-<k>``).

On a GPU cluster this copy should use the RDMA NIC (a verbs/UCX or NCCL send from the registered,
pinned image memory, GPUDirect-free since the bytes are in host RAM already): a TCP socket costs a
kernel copy per side and a core per few GB/s, where RDMA moves the bytes at line rate with no CPU.

Connections are authenticated by a per-job token that the trainers agree on and keep in the RAM root
(``.replica-token``, 0600): a listener on a shared host must not accept another user's bytes. Each connection
is served on a thread of its own; it must authenticate within ``AUTH_S`` (however slowly its bytes trickle),
then waits for the receiver's lock (one slot written at a time, so the RAM bound holds) for up to ``timeout_s``,
and each of its reads after that for up to ``timeout_s``: a peer that connects and stalls delays no sender,
and a long transfer is never cut short while bytes flow. Nothing in the RAM root changes before the sender,
still connected, answers the receiver's acceptance (a sender that gave up waiting in the queue is never acted
on later), and a restore names what it expects the slot to hold, as planned: a slot that changed since is left
as it is. ``stop`` lets the transfer in progress end, for up to ``DRAIN_S``; it cuts connections not yet
authenticated or still waiting for the lock, and one that would take the lock after it. The writer process marks
itself leaving first (:func:`cpuckpt.tier.ramroot.mark_leaving`), so that a new trainer never adopts a writer that
no longer listens.

Must not: run collectives, import the trainer's state, read the durable root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpuckpt.backend.commit import clear_commit
from cpuckpt.backend.committed import METADATA_NAME, check_slot_complete, metadata_damage, read_manifest
from cpuckpt.errors import CheckpointCorrupt, CpuckptError
from cpuckpt.format.checksums import chunk_checksum, verifiable
from cpuckpt.format.manifest import MANIFEST_NAME, FileEntry, manifest_from_json
from cpuckpt.tier.nodefiles import NODE_FILES_NAME, committed_node_files
from cpuckpt.tier.ramroot import require_free
from cpuckpt.transfer.files import write_atomic
from cpuckpt.transfer.threads import new_executor
from cpuckpt.version import __version__

__all__ = ["Endpoint", "Listener", "ReplicaError", "SlotContent", "partners", "read_endpoint", "read_token",
           "replica_dir", "replica_slots", "send_slot", "slot_content", "write_token"]

logger = logging.getLogger(__name__)

# The connection opens with "CPKREP<version>\n", then a length-prefixed JSON head: that framing is the part
# every version keeps, so a receiver of another version reads the head and refuses with both versions named (a
# mixed-version job is told to run one cpuckpt on every node, not "not a replica connection").
PROTOCOL = 3  # 2: file sets (a listing and a marker) besides DCP slots; 3: the sender's go, a restore's expected slot
_PREFIX = b"CPKREP"
MAGIC = _PREFIX + str(PROTOCOL).encode() + b"\n"
TOKEN_NAME = ".replica-token"  # noqa: S105 (a file name, not a secret)
ENDPOINT_NAME = "replica-endpoint.json"
SOURCE_NAME = "source.json"
_LEN = struct.Struct("!Q")
_RECV_BYTES = 4 << 20  # receive buffer when a file records no chunk size
_GO = b"G"  # the sender's answer to the acceptance: it is still there, the receiver may change the slot
_CONNECTIONS = 16  # connections served at once; more wait for a free thread
AUTH_S = 30.0  # a connection's magic and head (its token) arrive within this, or it is closed
DRAIN_S = 30.0  # a stopping listener lets the transfer in progress run this long at most


class ReplicaError(CpuckptError):
    """A replica could not be sent, received or committed (names the peer and the slot)."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where a node's replica receiver (its leader's writer) listens."""

    host: str
    port: int


def replica_dir(root: Path, source: str, slot_name: str) -> Path:
    """``<root>/replica-<16 hex of sha256(source node key)>/<slot_name>``: the source key holds ':' and '/'."""
    return root / f"replica-{hashlib.sha256(source.encode()).hexdigest()[:16]}" / slot_name


def replica_slots(root: Path) -> list[tuple[str, Path]]:
    """(source node key, slot directory) of every replica slot directory in ``root``."""
    out = []
    for d in sorted(root.glob("replica-*")):
        try:
            source = json.loads((d / SOURCE_NAME).read_text())["source"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out += [(source, s) for s in sorted(d.glob("slot-*")) if s.is_dir()]
    return out


def partners(keys: list[str] | tuple[str, ...], mine: str, replicas: int) -> list[str]:
    """The ``replicas`` nodes after ``mine`` in the sorted list of stable node keys (never itself)."""
    ring = sorted(set(keys))
    i = ring.index(mine)
    return [ring[(i + j) % len(ring)] for j in range(1, min(replicas, len(ring) - 1) + 1)]


def write_token(root: Path, token: str) -> None:
    write_atomic(root / TOKEN_NAME, token.encode(), fsync=False)
    os.chmod(root / TOKEN_NAME, 0o600)


def read_token(root: Path) -> str | None:
    try:
        return (root / TOKEN_NAME).read_text().strip() or None
    except OSError:
        return None


def new_token() -> str:
    return secrets.token_hex(16)


def read_endpoint(root: Path, pid: int | None = None) -> Endpoint | None:
    """The endpoint the writer ``pid`` (any, when None) published in ``root``, or None."""
    try:
        data = json.loads((root / ENDPOINT_NAME).read_text())
    except (OSError, ValueError):
        return None
    if pid is not None and data.get("pid") != pid:
        return None
    return Endpoint(data["host"], int(data["port"]))


# ------------------------------------------------------------------------------------------- framing


def _send_msg(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with a ``deadline`` (``time.monotonic``) the whole read ends by then, not each ``recv``
    (a peer that trickles a byte at a time is cut off); without, each ``recv`` waits the socket's timeout."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the connection's time ran out after {got} of {len(view)} bytes")
            sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as e:
            raise TimeoutError(f"no bytes from the peer for {sock.gettimeout():.0f} s, after {got} of {len(view)} "
                               "bytes") from e
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def _recv_msg(sock: socket.socket, limit: int = 1 << 30, deadline: float | None = None) -> Any:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ReplicaError(f"message of {n} bytes refused (limit {limit})")
    data = bytearray(n)
    _recv_exact(sock, memoryview(data), deadline)
    return json.loads(data)


# ------------------------------------------------------------------------------------------- sender


@dataclasses.dataclass(frozen=True)
class SlotContent:
    """What a committed slot holds, as the protocol sends it: its data files, then its commit files in the order
    they are written (a DCP checkpoint: manifest, ``.metadata``; a file set across nodes: its node listing, its
    marker: :mod:`cpuckpt.tier.nodefiles`)."""

    save_id: str
    step: int | None
    files: tuple[FileEntry, ...]
    commit: tuple[tuple[str, bytes], ...]


def slot_content(slot: Path) -> SlotContent | None:
    """The checkpoint committed in ``slot`` (a DCP directory, or a file set with a node listing); None: none.
    Unpickles nothing: the writer process that sends replicas imports no torch (:func:`check_slot_complete`)."""
    if check_slot_complete(slot).complete:
        manifest = read_manifest(slot)
        if manifest is None:
            return None
        try:
            commit = ((MANIFEST_NAME, (slot / MANIFEST_NAME).read_bytes()), (METADATA_NAME, (slot / METADATA_NAME)
                                                                              .read_bytes()))
        except OSError:
            return None
        return SlotContent(manifest.save_id, manifest.step, tuple(manifest.files[n] for n in sorted(manifest.files)),
                           commit)
    listing = committed_node_files(slot)
    if listing is None:
        return None
    try:
        commit = ((NODE_FILES_NAME, (slot / NODE_FILES_NAME).read_bytes()),
                  (listing.marker, (slot / listing.marker).read_bytes()))
    except OSError:
        return None
    return SlotContent(listing.save_id, listing.step, tuple(listing.files[n] for n in sorted(listing.files)), commit)


def _content_id(slot: Path) -> str | None:
    content = slot_content(slot)
    return content.save_id if content is not None else None


def send_slot(endpoint: Endpoint, token: str, *, source: str, slot: Path, save_id: str, into: str,
              timeout_s: float, expect: str | None = None) -> int:
    """Send the memory checkpoint ``save_id`` in ``slot`` to ``endpoint``; returns the data bytes sent.

    ``into``: ``"replica"`` (kept as a replica of node ``source``) or ``"slot"`` (the receiver's own slot of
    the same name: a restore, which overwrites only what the restore was planned over: ``expect``, the save id
    that slot held complete then, or None for none). Returns only after the receiver committed it. Connection
    refusals are retried for ``CONNECT_RETRY_S``; every later wait (a receiver busy with another node's
    slot first, the transfer) is bounded by ``timeout_s``.

    Raises:
        ReplicaError: the slot is not (or no longer) that save, the peer refused or failed (its reason),
            or the connection failed or timed out.
    """
    content = slot_content(slot)
    if content is None or content.save_id != save_id:
        reason = check_slot_complete(slot).reason if content is None else ""
        why = f" ({reason})" if reason else ""
        raise ReplicaError(f"{slot}: not the committed memory checkpoint {save_id[:8]}{why}; nothing sent")
    what = f"replica of {slot} ({save_id[:8]}) to {endpoint.host}:{endpoint.port}"
    nbytes = 0
    try:
        with _connect(endpoint, min(timeout_s, CONNECT_RETRY_S), timeout_s) as sock:
            sock.sendall(MAGIC)
            _send_msg(sock, {"token": token, "into": into, "source": source, "slot": slot.name, "save_id": save_id,
                             "step": content.step, "files": [dataclasses.asdict(e) for e in content.files],
                             "commit": [[name, len(data)] for name, data in content.commit], "expect": expect})
            accept = _recv_msg(sock)  # token, slot name and RAM bound are checked before any data moves
            if not accept.get("ok"):
                raise ReplicaError(f"{what} refused by the receiver: {accept.get('error')}")
            sock.sendall(_GO)  # still here: only now does the receiver change its slot
            for entry in content.files:
                with open(slot / entry.name, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < entry.nbytes:
                        raise ReplicaError(f"{what}: {slot / entry.name} has {size} bytes, its listing says "
                                           f"{entry.nbytes}")
                    sent = sock.sendfile(f, 0, entry.nbytes)  # no copy through Python (tmpfs page cache → socket)
                    if sent != entry.nbytes:  # the file shrank meanwhile: the stream would lose its framing
                        raise ReplicaError(f"{what}: sent {sent} of {entry.nbytes} bytes of {slot / entry.name}")
                    nbytes += sent
            for _, data in content.commit:
                sock.sendall(data)
            # The slot must still hold that save after the last byte left (its trainer reuses slots in a ring):
            # else abort, and the receiver never commits what it got.
            intact = _content_id(slot) == save_id
            sock.sendall(b"C" if intact else b"A")
            reply = _recv_msg(sock)
    except (OSError, ValueError) as e:
        raise ReplicaError(f"{what} failed: {type(e).__name__}: {e}") from e
    if not intact:
        raise ReplicaError(f"{what}: the slot was reused while sending; aborted, not committed there")
    if not reply.get("ok"):
        raise ReplicaError(f"{what} refused by the receiver: {reply.get('error')}")
    return nbytes


# A partner refusing connections for this long is down (or its writer was respawned on another port): the
# replica fails with a warning instead of holding its slot, and so the ring, for the whole timeout.
CONNECT_RETRY_S = 10.0


def _connect(endpoint: Endpoint, connect_s: float, timeout_s: float) -> socket.socket:
    """Connect, retrying refusals for ``connect_s`` (a receiver starting after a restart is not up yet); each
    later operation on the socket is bounded by ``timeout_s``."""
    deadline = time.monotonic() + connect_s
    while True:
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port),
                                            timeout=max(0.1, deadline - time.monotonic()))
            sock.settimeout(timeout_s)
            return sock
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ------------------------------------------------------------------------------------------ receiver


class Listener:
    """The replica receiver of one writer process: a listening socket; each connection on a thread of its own;
    one authenticated connection writes at a time (:func:`receive`).

    ``serve_forever`` runs on a thread of its own (started by the writer through ``transfer.threads``);
    ``stop`` ends it once the transfer in progress ends, for up to ``DRAIN_S`` (a crashed job's partners may still
    be sending the newest save's replicas; a sender whose node died would hold it for ``timeout_s``); connections
    not yet authenticated, or waiting for the lock, are cut. Every failure of a connection is answered to the sender
    and logged; none ends it.
    """

    def __init__(self, root: Path, host: str, *, headroom_bytes: int, timeout_s: float) -> None:
        self.root, self.headroom_bytes, self.timeout_s = root, headroom_bytes, timeout_s
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.5)  # stop() is noticed within this
        self.endpoint = Endpoint(host, self.sock.getsockname()[1])
        self._stop = threading.Event()
        self._writing = threading.Lock()  # one slot written at a time: the RAM bound is checked against the rest
        self._waiting: set[socket.socket] = set()  # not yet transferring: stop() cuts them
        self._transferring: set[socket.socket] = set()  # holding the write lock: stop() gives them DRAIN_S
        self._conns_lock = threading.Lock()

    def publish(self) -> None:
        """Write ``<root>/replica-endpoint.json`` (host, port, this pid): the trainers read and exchange it."""
        data = {**dataclasses.asdict(self.endpoint), "pid": os.getpid()}
        write_atomic(self.root / ENDPOINT_NAME, json.dumps(data).encode(), fsync=False)

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        pool = new_executor(_CONNECTIONS, "cpuckpt-replica-conn")
        try:
            while not self._stop.is_set():
                try:
                    conn, peer = self.sock.accept()
                except TimeoutError:
                    continue
                with self._conns_lock:
                    self._waiting.add(conn)
                pool.submit(self._serve, conn, peer)
        finally:
            self.sock.close()
            with self._conns_lock:  # none moves to transferring from here on (_transferring checks _stop under it)
                _shut(self._waiting)
            deadline = time.monotonic() + min(DRAIN_S, self.timeout_s)
            while self._transferring and time.monotonic() < deadline:
                time.sleep(0.05)
            with self._conns_lock:
                _shut(self._transferring)  # its sender is told it failed; nothing of it commits
            pool.shutdown(wait=True)

    def _transfer(self, conn: socket.socket) -> None:
        """The connection holds the write lock now: a transfer, unless the listener is stopping (then refused)."""
        with self._conns_lock:
            if self._stop.is_set():
                raise ReplicaError(f"{self.root}: the receiver is stopping (its writer's trainer is gone); not "
                                   "received")
            self._waiting.discard(conn)
            self._transferring.add(conn)

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        with conn, self._tracked(conn):
            try:
                receive(conn, self.root, headroom_bytes=self.headroom_bytes, timeout_s=self.timeout_s,
                        lock=self._writing, stop=self._stop, transferring=lambda: self._transfer(conn))
            except Exception as e:  # answered to the sender (best effort), then the next connection
                logger.error("replica from %s failed: %s", peer, e)
                try:
                    conn.settimeout(1.0)
                    _send_msg(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                except OSError:
                    pass

    @contextlib.contextmanager
    def _tracked(self, conn: socket.socket) -> Any:
        try:
            yield
        finally:
            with self._conns_lock:
                self._waiting.discard(conn)
                self._transferring.discard(conn)


def _shut(conns: set[socket.socket]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def receive(conn: socket.socket, root: Path, *, headroom_bytes: int, timeout_s: float, lock: threading.Lock,
            stop: threading.Event, transferring: Callable[[], None]) -> Path:
    """Receive one slot from ``conn`` into ``root`` (see the module docstring); returns its directory. The magic and
    head arrive within ``AUTH_S`` in all; then ``lock`` (the listener's) is taken within ``timeout_s`` (given up
    once ``stop`` is set) and held to the end, ``transferring()`` called under it (it raises when the listener
    stopped meanwhile); each later read waits ``timeout_s``.

    Raises:
        ReplicaError: a bad token or header, a slot name outside the RAM root, a restore over a slot that
            changed since it was planned, the receiver stopping.
        RamRootError: the RAM bound (the headroom would not stay free).
        CheckpointCorrupt: a chunk whose checksum is not the source manifest's.
        TimeoutError / ConnectionError: the peer was too slow, or went away.
    """
    deadline = time.monotonic() + min(AUTH_S, timeout_s)
    magic = bytearray()
    while not magic.endswith(b"\n") and len(magic) < 16:  # "CPKREP<version>\n", any version's length
        one = bytearray(1)
        _recv_exact(conn, memoryview(one), deadline)
        magic += one
    if not magic.startswith(_PREFIX) or not magic.endswith(b"\n"):
        raise ReplicaError("not a cpuckpt replica connection")
    head = _recv_msg(conn, limit=256 << 20, deadline=deadline)
    if bytes(magic) != MAGIC:  # the head is read first, so that the refusal reaches the sender
        theirs = magic[len(_PREFIX):-1].decode("ascii", "replace")
        raise ReplicaError(f"replica refused: the sender speaks replica protocol {theirs}, this receiver "
                           f"{PROTOCOL} (cpuckpt {__version__}): run one cpuckpt version on every node")
    token = read_token(root)
    if token is None or not hmac.compare_digest(str(head.get("token", "")), token):
        raise ReplicaError(f"{root}: replica refused: wrong job token")
    conn.settimeout(timeout_s)
    until = time.monotonic() + timeout_s
    while not lock.acquire(timeout=0.2):
        if stop.is_set():
            raise ReplicaError(f"{root}: the receiver is stopping (its writer's trainer is gone); not received")
        if time.monotonic() > until:
            raise TimeoutError(f"{root}: the receiver stayed busy with other slots for {timeout_s:.0f} s")
    try:
        transferring()
        return _receive_slot(conn, root, head, headroom_bytes)
    finally:
        lock.release()


def _receive_slot(conn: socket.socket, root: Path, head: dict[str, Any], headroom_bytes: int) -> Path:
    """:func:`receive` once the sender is authenticated and the lock held."""
    name = str(head["slot"])
    if not name.startswith("slot-") or not name[5:].isdigit():
        raise ReplicaError(f"replica refused: bad slot name {name!r}")
    save_id, step = str(head["save_id"]), head.get("step")
    entries = [FileEntry(**e) for e in head["files"]]
    commit = [(str(n), int(k)) for n, k in head["commit"]]
    for n in [e.name for e in entries] + [n for n, _ in commit]:
        if "/" in n or n in ("", ".", ".."):
            raise ReplicaError(f"replica refused: file name {n!r} outside the slot")
    if head["into"] == "slot":
        target = root / name
        _refuse_overwriting_newer(target, save_id, step, head.get("expect"))
    elif head["into"] == "replica":
        target = replica_dir(root, str(head["source"]), name)
    else:
        raise ReplicaError(f"replica refused: unknown destination {head['into']!r}")
    existing = sum(_size(target / e.name) for e in entries)
    # The RAM bound: (own slots + replica slots) x shard must leave memory.headroom_bytes free. Checked
    # before anything changes: a refused copy leaves the target's complete checkpoint as it was.
    require_free(root, sum(e.nbytes for e in entries), already_reserved=existing, headroom_bytes=headroom_bytes,
                 what=f"a replica of {head['source']} ({name})")
    _send_msg(conn, {"ok": True})
    go = bytearray(1)
    _recv_exact(conn, memoryview(go))  # a sender that gave up (closed) ends it here: nothing changed
    if bytes(go) != _GO:
        raise ReplicaError(f"{target}: the sender did not confirm the transfer; nothing changed")
    if head["into"] == "replica":
        target.parent.mkdir(mode=0o700, exist_ok=True)
        write_atomic(target.parent / SOURCE_NAME, json.dumps({"source": head["source"]}).encode(), fsync=False)
    target.mkdir(mode=0o700, exist_ok=True)
    # incomplete from its first changed byte until the commit below (the last-written commit file goes first)
    clear_commit(target, fsync=False)
    for n, _ in reversed(commit):
        (target / n).unlink(missing_ok=True)
    t0 = time.perf_counter()
    damaged: list[str] = []  # the stream is read to its end either way, so the sender gets the reason
    for e in entries:
        _receive_file(conn, target / e.name, e, damaged)
    commit_bytes = []
    for n, k in commit:
        data = bytearray(k)
        _recv_exact(conn, memoryview(data))
        commit_bytes.append((n, bytes(data)))
    verdict = bytearray(1)
    _recv_exact(conn, memoryview(verdict))
    if bytes(verdict) != b"C":  # first: a slot reused while it was sent explains any damage
        raise ReplicaError(f"{target}: the sender aborted (its slot was reused while sending); not committed")
    damaged += _commit_damage(target, dict(commit_bytes))
    if damaged:
        raise CheckpointCorrupt(f"{damaged[0]}; the replica is not committed")
    for n, data in commit_bytes:  # in the sender's order: its last file commits
        write_atomic(target / n, data, fsync=False)
    _send_msg(conn, {"ok": True})
    logger.info("received %s of %s (save %s, step %s) into %s in %.3f s", _human(sum(e.nbytes for e in entries)),
                head["source"], save_id[:8], step, target, time.perf_counter() - t0)
    return target


def _commit_damage(target: Path, commit: dict[str, bytes]) -> list[str]:
    """A DCP slot's ``.metadata`` as it arrived, against the crc32c its manifest records (the data chunks are
    checked as they arrive); a file set's commit files carry none."""
    if MANIFEST_NAME not in commit or METADATA_NAME not in commit:
        return []
    try:
        damage = metadata_damage(manifest_from_json(commit[MANIFEST_NAME]), commit[METADATA_NAME])
    except (ValueError, TypeError) as e:
        damage = f"unreadable manifest: {e}"
    return [f"{target}: {damage}"] if damage else []


def _refuse_overwriting_newer(target: Path, save_id: str, step: int | None, expect: str | None) -> None:
    """A restore into a node's own slot must never destroy a complete checkpoint that is not older than the
    one restored (a newer step, or another save of the same step: which one is newer is not known): the slot
    may hold the newest checkpoint of the job. Nor one other than ``expect``, what the restore was planned over
    (a trainer may have saved there since). Checked before a byte of the slot changes."""
    present = slot_content(target)
    if present is None or present.save_id == save_id:
        return
    if present.save_id != expect:
        raise ReplicaError(f"{target}: restore of step {step} ({save_id[:8]}) refused: the slot holds the complete "
                           f"checkpoint of step {present.step} ({present.save_id[:8]}), not what the restore was "
                           f"planned over ({expect[:8] if expect else 'nothing complete'}); it is left as it is")
    if present.step is None or step is None or present.step >= step:
        raise ReplicaError(f"{target}: restore of step {step} ({save_id[:8]}) refused: the slot holds the complete "
                           f"checkpoint of step {present.step} ({present.save_id[:8]}), which is not older; it is "
                           "left as it is")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _receive_file(conn: socket.socket, path: Path, entry: Any, damaged: list[str]) -> None:
    """Preallocate ``path`` (a full tmpfs fails here, never as a SIGBUS later), receive and verify each chunk;
    a chunk whose checksum (of the manifest's kind) differs is named in ``damaged`` and the rest is still read (never
    written)."""
    check = verifiable(entry)
    chunk = entry.chunk_bytes if entry.chunk_bytes > 0 else _RECV_BYTES
    buf = bytearray(min(chunk, max(entry.nbytes, 1)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if entry.nbytes:
            os.posix_fallocate(fd, 0, entry.nbytes)
        os.ftruncate(fd, entry.nbytes)
        offset = 0
        for k in range((entry.nbytes + chunk - 1) // chunk if entry.nbytes else 0):
            n = min(chunk, entry.nbytes - offset)
            view = memoryview(buf)[:n]
            _recv_exact(conn, view)
            if check and chunk_checksum(entry.checksum, view) != entry.chunk_checksums[k]:
                damaged.append(f"{path}: chunk {k} (offset {offset}, {n} bytes) arrived with a {entry.checksum} "
                               "other than the source manifest's")
            if not damaged:
                os.pwrite(fd, view, offset)
            offset += n
    finally:
        os.close(fd)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
