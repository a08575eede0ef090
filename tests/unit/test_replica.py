"""The replica protocol over a real loopback socket, into real files; and the restart plan over replicas.

A checkpoint written by ``cpuckpt.save`` (crc32c per chunk in its manifest) stands in for a node's memory
slot; a :class:`Listener` on a thread receives it. Proven: a replica is byte-identical, complete only after
its ``.metadata``, and loads bit-exact; a damaged byte, a wrong token or the RAM bound refuse it and
leave nothing complete; a restore lands in the receiver's own slot; partners follow the sorted node keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.backend.committed import check_complete, read_manifest
from cpuckpt.config import Config
from cpuckpt.format.checksums import blocksum32
from cpuckpt.testing.faults import flip_byte, rewrite_manifest
from cpuckpt.tier import replica
from cpuckpt.tier.nodes import NodeMap
from cpuckpt.tier.persister import replicate_one
from cpuckpt.tier.queue import PersistRequest
from cpuckpt.tier.recovery import Copy, overwrites, plan_restores
from cpuckpt.tier.replica import (
    MAGIC,
    Listener,
    ReplicaError,
    _commit_damage,
    _recv_msg,
    _send_msg,
    partners,
    replica_dir,
    replica_slots,
    send_slot,
    slot_content,
    write_token,
)
from cpuckpt.transfer.threads import new_executor

pytestmark = pytest.mark.timeout(60)

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def slot(tmp_path: Path) -> Path:
    path = tmp_path / "node0" / "slot-1"
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(300, 257, generator=g), "b": torch.arange(10, dtype=torch.int64)}
    cpuckpt.save(state, path, {"io": {"chunk_bytes": 64 * 1024}}, step=5)
    return path


@contextlib.contextmanager
def _serving(root: Path, *, headroom_bytes: int = 0, timeout_s: float = 10) -> Iterator[tuple[Listener, Future]]:
    """A listener on ``root`` (made, with the job token), and the future of its ``serve_forever``; stopped after."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_token(root, TOKEN)
    listener = Listener(root, "127.0.0.1", headroom_bytes=headroom_bytes, timeout_s=timeout_s)
    pool = new_executor(1, "test-replica-rx")
    done = pool.submit(listener.serve_forever)
    try:
        yield listener, done
    finally:
        listener.stop()
        done.result(timeout=10)
        pool.shutdown()


@pytest.fixture
def partner(tmp_path: Path) -> Iterator[Listener]:
    with _serving(tmp_path / "node1") as (listener, _):
        yield listener


def _send(listener: Listener, slot: Path, *, token: str = TOKEN, into: str = "replica") -> int:
    return send_slot(listener.endpoint, token, source="hostA:boot:/ram0", slot=slot,
                     save_id=read_manifest(slot).save_id, into=into, timeout_s=10)


def test_replica_is_byte_identical_complete_and_loads(slot: Path, partner: Listener) -> None:
    nbytes = _send(partner, slot)
    target = replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")
    assert replica_slots(partner.root) == [("hostA:boot:/ram0", target)]
    assert check_complete(target).complete and check_complete(target).step == 5
    names = sorted(read_manifest(slot).files)
    assert nbytes == sum((slot / n).stat().st_size for n in names)
    for name in names + [".metadata"]:
        assert (target / name).read_bytes() == (slot / name).read_bytes(), name
    state = {"w": torch.zeros(300, 257), "b": torch.zeros(10, dtype=torch.int64)}
    cpuckpt.load(state, target)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(state["w"], torch.randn(300, 257, generator=g))
    # a restore: the same bytes into the receiver's own slot of that name
    _send(partner, slot, into="slot")
    assert check_complete(partner.root / "slot-1").complete


def test_a_damaged_byte_is_refused_and_nothing_is_committed(slot: Path, partner: Listener) -> None:
    _send(partner, slot)  # a complete replica first: the failed one below must not leave it looking complete
    flip_byte(slot / sorted(read_manifest(slot).files)[0], 70_000, 0x01)  # in chunk 1 (64 KiB chunks)
    with pytest.raises(ReplicaError, match=r"chunk 1 .*crc32c"):
        _send(partner, slot)
    assert not check_complete(replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")).complete


def test_a_blocksum32_slot_is_checked_by_its_own_kind(slot: Path, partner: Listener) -> None:
    """A slot whose manifest records blocksum32 (GPU-summed chunks) replicates whole and loads; a damaged byte is
    named by that kind and nothing is committed."""
    def edit(raw: dict) -> None:
        for name, e in raw["files"].items():
            data = memoryview((slot / name).read_bytes())
            e["checksum"] = "blocksum32"
            e["chunk_checksums"] = [blocksum32(data[o:o + e["chunk_bytes"]]) for o in range(0, len(data),
                                                                                           e["chunk_bytes"])]

    rewrite_manifest(slot, edit)
    _send(partner, slot)
    target = replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")
    assert check_complete(target).complete
    assert {e.checksum for e in read_manifest(target).files.values()} == {"blocksum32"}
    state = {"w": torch.zeros(300, 257), "b": torch.zeros(10, dtype=torch.int64)}
    cpuckpt.load(state, target, {"integrity": {"verify": "always"}})
    assert torch.equal(state["b"], torch.arange(10))

    flip_byte(slot / sorted(read_manifest(slot).files)[0], 70_000, 0x01)  # in chunk 1 (64 KiB chunks)
    with pytest.raises(ReplicaError, match=r"chunk 1 .*blocksum32"):
        _send(partner, slot)
    assert not check_complete(target).complete


def test_a_changed_metadata_is_never_sent_and_the_previous_replica_stays(slot: Path, partner: Listener) -> None:
    """A slot's ``.metadata`` changed after its commit (still a pickle of this save: a key renamed) is not sent: the
    partner's replica of the slot stays the complete one it was."""
    _send(partner, slot)
    target = replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")
    before = (target / ".metadata").read_bytes()
    md = (slot / ".metadata").read_bytes()
    (slot / ".metadata").write_bytes(md.replace(b"\x8c\x01w\x94", b"\x8c\x01v\x94"))
    assert (slot / ".metadata").read_bytes() != md
    with pytest.raises(ReplicaError, match=r"not the committed memory checkpoint .*\(\.metadata is not the one"):
        _send(partner, slot)
    assert check_complete(target).complete and (target / ".metadata").read_bytes() == before


def test_a_metadata_changed_on_the_way_is_refused_by_the_receiver(slot: Path, partner: Listener,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver checks the commit files as they arrived (the data chunks are checked as they arrive): a
    ``.metadata`` other than its manifest's (here changed after the sender's check) is never committed."""
    import dataclasses

    from cpuckpt.tier import replica

    real = replica.slot_content

    def changed_on_the_way(path: Path) -> replica.SlotContent | None:
        content = real(path)
        commit = tuple((n, d.replace(b"\x8c\x01w\x94", b"\x8c\x01v\x94") if n == ".metadata" else d)
                       for n, d in content.commit)
        assert commit != content.commit
        return dataclasses.replace(content, commit=commit)

    monkeypatch.setattr(replica, "slot_content", changed_on_the_way)
    with pytest.raises(ReplicaError, match=r"\.metadata is not the one committed with the manifest"):
        _send(partner, slot)
    target = replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")
    assert not (target / ".metadata").exists() and not check_complete(target).complete


def test_a_metadata_changed_on_the_way_is_named_before_the_commit(slot: Path) -> None:
    """The receiver's check of the commit files as they arrived, alone."""
    commit = {".cpuckpt.json": (slot / ".cpuckpt.json").read_bytes(), ".metadata": (slot / ".metadata").read_bytes()}
    assert _commit_damage(slot, commit) == []
    commit[".metadata"] = commit[".metadata"].replace(b"\x8c\x01w\x94", b"\x8c\x01v\x94")
    (why,) = _commit_damage(slot, commit)
    assert why.startswith(f"{slot}: .metadata is not the one committed with the manifest"), why
    assert _commit_damage(slot, {"node-files": b"{}", "marker": b"x"}) == []  # a file set's commit files: none


def test_a_wrong_token_is_refused(slot: Path, partner: Listener) -> None:
    with pytest.raises(ReplicaError, match="wrong job token"):
        _send(partner, slot, token="f" * 32)
    assert replica_slots(partner.root) == []


def test_the_ram_bound_refuses_a_replica_that_would_eat_the_headroom(slot: Path, tmp_path: Path) -> None:
    with _serving(tmp_path / "tight", headroom_bytes=1 << 60) as (listener, _):
        with pytest.raises(ReplicaError, match=r"memory.headroom_bytes.*memory.replicas"):
            _send(listener, slot)
        assert not check_complete(replica_dir(listener.root, "hostA:boot:/ram0", "slot-1")).complete


def test_a_slot_that_is_not_that_save_is_not_sent(slot: Path, partner: Listener) -> None:
    with pytest.raises(ReplicaError, match="not the committed memory checkpoint"):
        send_slot(partner.endpoint, TOKEN, source="x", slot=slot, save_id="other", into="replica", timeout_s=5)


def test_partners_follow_the_sorted_node_keys_not_the_ranks() -> None:
    keys = ("c:1:/r", "a:1:/r", "b:1:/r", "a:1:/r")
    assert partners(keys, "a:1:/r", 1) == ["b:1:/r"]
    assert partners(keys, "c:1:/r", 1) == ["a:1:/r"]
    assert partners(keys, "b:1:/r", 5) == ["c:1:/r", "a:1:/r"]  # never itself, at most the other nodes
    assert partners(("a",), "a", 1) == []


def _copy(holder: int, slot: str, replica: bool, files: tuple[str, ...], step: int = 9) -> Copy:
    return Copy(holder, f"/n{holder}/{slot}", slot, replica, step, "s9", files, ("__0_0.distcp", "__1_0.distcp"))


def test_plan_restores_a_lost_node_from_the_partner_replica_only() -> None:
    nodes = NodeMap(0, ("n0", "n1"))
    own0 = _copy(0, "slot-1", False, ("__0_0.distcp",))
    rep1 = _copy(0, "slot-1", True, ("__1_0.distcp",))
    # node 1 lost its RAM: rank 1 holds nothing, node 0 holds its own slot and a replica of node 1's
    plans = plan_restores(nodes, [[(9, "s9")], []], [own0, rep1])
    assert [(r.target, r.source) for r in plans[(9, "s9")]] == [(1, rep1)]
    # without the replica: not available
    assert plan_restores(nodes, [[(9, "s9")], []], [own0]) == {}
    # both hold their own: available, nothing to restore
    own1 = _copy(1, "slot-1", False, ("__1_0.distcp",))
    assert plan_restores(nodes, [[(9, "s9")], [(9, "s9")]], [own0, own1, rep1]) == {(9, "s9"): []}
    # node 1 has its own copy yet rank 1 needs more (deduplicated values): not restorable from a replica
    assert plan_restores(nodes, [[(9, "s9")], []], [own0, own1, rep1]) == {}


def _replicate_request(slot: Path, endpoints: list[tuple[str, int]], tmp_path: Path) -> PersistRequest:
    cfg = Config.from_dict({"timeout_s": 5}, env=False).to_dict()
    return PersistRequest(seq=1, slot=str(slot), save_id=read_manifest(slot).save_id, step=5, dest=str(slot), rank=0,
                          world_size=1, coordinator=True, config=cfg, trainer_pid=0,
                          trainer_lock=str(tmp_path / "no-trainer.lock"), kind="replicate", partners=tuple(endpoints),
                          source="hostA:boot:/ram0", token=TOKEN)


def test_the_writer_replicates_to_every_partner_and_reports_a_failed_one_as_a_replica(
        slot: Path, partner: Listener, tmp_path: Path) -> None:
    ok = replicate_one(_replicate_request(slot, [("127.0.0.1", partner.endpoint.port)], tmp_path))
    assert ok.ok and ok.nbytes > 0, ok
    assert check_complete(replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")).complete
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead_port = closed.getsockname()[1]  # nothing listens there once closed
    out = replicate_one(_replicate_request(slot, [("127.0.0.1", dead_port), ("127.0.0.1", partner.endpoint.port)],
                                           tmp_path))
    # the live partner still got its copy; the outcome is a failed *replica* (the trainer warns, never raises)
    assert not out.ok and out.error.startswith("replica:") and f"127.0.0.1:{dead_port}" in out.error, out
    assert out.nbytes == ok.nbytes


@pytest.mark.parametrize("theirs", ["1", "2", "10"])
def test_a_sender_of_another_protocol_version_is_refused_with_both_versions_named(
        partner: Listener, theirs: str) -> None:
    """A mixed-version job (one node upgraded): the receiver reads the head (the framing every version keeps), then
    refuses in words the sender can report, instead of a bare "not a replica connection" or a reset connection."""
    from cpuckpt.tier.replica import PROTOCOL

    with socket.create_connection((partner.endpoint.host, partner.endpoint.port), timeout=10) as sock:
        sock.sendall(f"CPKREP{theirs}\n".encode())
        _send_msg(sock, {"token": TOKEN, "into": "replica", "source": "x", "slot": "slot-0", "save_id": "s",
                         "step": 1, "files": [], "commit": [], "a later version's key": True})
        reply = _recv_msg(sock)
    assert not reply["ok"] and (f"speaks replica protocol {theirs}, this receiver {PROTOCOL}" in reply["error"]
                                and "one cpuckpt version on every node" in reply["error"]), reply
    assert replica_slots(partner.root) == []


def test_a_connection_that_is_not_a_replica_is_refused(partner: Listener) -> None:
    with socket.create_connection((partner.endpoint.host, partner.endpoint.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.0\n")  # one line: the receiver reads it, refuses and closes (nothing unread)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        assert b"not a cpuckpt replica connection" in reply
    assert replica_slots(partner.root) == []


# ------------------------------------------------------------------ a busy receiver, stalled and abandoned peers


def _head(slot: Path, into: str, expect: str | None = None) -> dict:
    """The head :func:`send_slot` sends for ``slot`` (a peer of this test speaks the protocol by hand)."""
    content = slot_content(slot)
    return {"token": TOKEN, "into": into, "source": "hostA:boot:/ram0", "slot": slot.name, "save_id": content.save_id,
            "step": content.step, "files": [dataclasses.asdict(e) for e in content.files],
            "commit": [[n, len(d)] for n, d in content.commit], "expect": expect}


def _accepted(listener: Listener, slot: Path, into: str = "replica") -> socket.socket:
    """A connection of an authenticated sender whose slot the receiver accepted and which said go, then stalls:
    it holds the receiver's lock until it is closed."""
    sock = socket.create_connection((listener.endpoint.host, listener.endpoint.port), timeout=10)
    sock.sendall(MAGIC)
    _send_msg(sock, _head(slot, into))
    assert _recv_msg(sock)["ok"]
    sock.sendall(b"G")
    return sock


def _save(path: Path, step: int) -> str:
    cpuckpt.save({"w": torch.full((64,), float(step))}, path, {"io": {"chunk_bytes": 64 * 1024}}, step=step)
    return read_manifest(path).save_id


def test_a_restore_waits_for_a_transfer_in_progress_longer_than_the_connect_retries(
        slot: Path, partner: Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver serves one slot at a time: a second sender waits for the first, bounded by its timeout_s, not
    by the connect retries' bound (a replica of many GB holds the receiver longer than that)."""
    monkeypatch.setattr(replica, "CONNECT_RETRY_S", 0.5)
    busy = _accepted(partner, slot)
    threading.Timer(2.0, busy.close).start()  # the first transfer ends (here: fails) 2 s on
    t0 = time.monotonic()
    _send(partner, slot, into="slot")  # timeout_s 10
    assert time.monotonic() - t0 >= 1.5
    assert check_complete(partner.root / "slot-1").complete


def test_a_stalled_peer_delays_no_one_and_is_cut_off_at_its_deadline(slot: Path, tmp_path: Path) -> None:
    """A peer that connects and trickles (never authenticating) holds no lock: a sender beside it is served at
    once; and its connection ends when its time (timeout_s in all, not per byte) runs out."""
    with _serving(tmp_path / "node1", timeout_s=3) as (listener, _):
        with socket.create_connection((listener.endpoint.host, listener.endpoint.port), timeout=10) as stalled:
            t0 = time.monotonic()
            stalled.sendall(b"C")
            send_slot(listener.endpoint, TOKEN, source="hostA:boot:/ram0", slot=slot,
                      save_id=read_manifest(slot).save_id, into="replica", timeout_s=10)
            assert time.monotonic() - t0 < 2.5  # not behind the stalled one
            stalled.settimeout(0.5)
            closed = False
            while not closed and time.monotonic() - t0 < 8:
                try:
                    stalled.sendall(b"P")  # a byte every 0.5 s: a per-byte timeout would never end it
                    closed = stalled.recv(4096) == b"" or closed
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
            assert closed and 2.5 < time.monotonic() - t0 < 6


def _wait_logged(caplog: pytest.LogCaptureFixture, text: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"no log record with {text!r}"
        time.sleep(0.02)


def test_a_sender_that_gave_up_before_its_acceptance_changes_nothing(
        slot: Path, partner: Listener, caplog: pytest.LogCaptureFixture) -> None:
    """A restore that timed out while the receiver was busy is still queued there: when the receiver gets to it,
    its head is in the socket, but the sender is gone. The slot (here: an older checkpoint, which a restore may
    replace) stays complete and as it was."""
    caplog.set_level(logging.ERROR, logger="cpuckpt.tier.replica")
    target = partner.root / "slot-1"
    older = _save(target, 2)
    sock = socket.create_connection((partner.endpoint.host, partner.endpoint.port), timeout=10)
    sock.sendall(MAGIC)
    _send_msg(sock, _head(slot, "slot", expect=older))
    sock.close()  # gave up before the acceptance
    _wait_logged(caplog, "replica from")
    assert "did not confirm" in caplog.text or "peer closed" in caplog.text or "Connection" in caplog.text
    assert check_complete(target).complete and read_manifest(target).save_id == older


def test_a_restore_refuses_a_slot_that_changed_since_it_was_planned(slot: Path, partner: Listener) -> None:
    """Planned over an empty slot, the restore finds an older complete checkpoint there (a trainer saved since):
    refused, and that checkpoint stays; planned over it, the restore replaces it."""
    target = partner.root / "slot-1"
    older = _save(target, 2)
    save_id = read_manifest(slot).save_id
    with pytest.raises(ReplicaError, match="not what the restore was planned over"):
        send_slot(partner.endpoint, TOKEN, source="x", slot=slot, save_id=save_id, into="slot", timeout_s=10)
    assert read_manifest(target).save_id == older and check_complete(target).complete
    send_slot(partner.endpoint, TOKEN, source="x", slot=slot, save_id=save_id, into="slot", timeout_s=10,
              expect=older)
    assert read_manifest(target).save_id == save_id and check_complete(target).complete


def test_a_slot_of_no_step_is_never_older_than_a_restore() -> None:
    assert overwrites((None, "a"), (5, "b"))
    assert overwrites((5, "a"), (5, "b")) and not overwrites((4, "a"), (5, "b")) and not overwrites(None, (5, "b"))


def _waiting_for_the_lock(listener: Listener, slot: Path) -> socket.socket:
    """An authenticated connection, its head sent, waiting for the receiver's lock (another holds it)."""
    sock = socket.create_connection((listener.endpoint.host, listener.endpoint.port), timeout=10)
    sock.sendall(MAGIC)
    _send_msg(sock, _head(slot, "replica"))
    time.sleep(0.3)
    return sock


def _final_answer(sock: socket.socket) -> dict:
    """The receiver's answer on ``sock``, or a refusal when it closed the connection instead."""
    try:
        return _recv_msg(sock)
    except (ConnectionError, OSError):
        return {"ok": False, "error": "closed"}


def _paced_transfer(listener: Listener, slot: Path, seconds: float) -> dict:
    """An authenticated sender that sends ``slot`` by hand, its bytes spread over ``seconds`` (a slow network);
    returns the receiver's final answer."""
    content = slot_content(slot)
    with _accepted(listener, slot) as sock:
        data = b"".join((slot / e.name).read_bytes()[:e.nbytes] for e in content.files)
        pieces = 8
        step = -(-len(data) // pieces)
        for i in range(pieces):
            sock.sendall(data[i * step:(i + 1) * step])
            time.sleep(seconds / pieces)
        for _, d in content.commit:
            sock.sendall(d)
        sock.sendall(b"C")
        return _recv_msg(sock)


def test_a_transfer_longer_than_timeout_s_completes_while_bytes_flow_even_after_a_wait_for_the_lock(
        slot: Path, tmp_path: Path) -> None:
    """timeout_s bounds each wait, not the whole transfer: a slot that takes longer to arrive than timeout_s
    (a large slot, a slow link), after waiting for another sender's transfer, still commits. A whole-connection
    deadline failed it midway, after the receiver had cleared the slot's previous replica."""
    with _serving(tmp_path / "node1", timeout_s=2) as (listener, _):
        busy = _accepted(listener, slot)
        threading.Timer(1.5, busy.close).start()  # holds the lock for 1.5 s of the 2
        t0 = time.monotonic()
        assert _paced_transfer(listener, slot, 3.0)["ok"]
        assert time.monotonic() - t0 > 4.0
        assert check_complete(replica_dir(listener.root, "hostA:boot:/ram0", "slot-1")).complete


def test_stop_lets_a_transfer_in_progress_end(slot: Path, partner: Listener) -> None:
    """A writer stops its listener once its trainer is gone and nothing is owed, while partners may still be
    sending it the replicas of the newest save (the job crashed): the transfer in progress ends and commits."""
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(_paced_transfer(partner, slot, 1.5)))
    sender.start()
    time.sleep(0.5)
    partner.stop()
    sender.join(timeout=20)
    assert result.get("ok"), result
    assert check_complete(replica_dir(partner.root, "hostA:boot:/ram0", "slot-1")).complete


def test_stop_refuses_a_connection_that_gets_the_lock_after_it_and_bounds_a_stalled_transfer(
        slot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection waiting for the lock when the listener stops is refused even if the lock frees at once (it would
    start a whole new transfer after stop); a transfer in progress that stalls (its sender's node died) holds the
    stopping writer DRAIN_S at most, not timeout_s."""
    monkeypatch.setattr(replica, "DRAIN_S", 1.0)
    with _serving(tmp_path / "node1", timeout_s=60) as (listener, done):
        busy = _accepted(listener, slot)  # holds the lock, then stalls (a dead sender)
        waiter = _waiting_for_the_lock(listener, slot)
        t0 = time.monotonic()
        listener.stop()
        answer = _final_answer(waiter)
        assert not answer.get("ok"), answer
        done.result(timeout=10)
        assert time.monotonic() - t0 < 4.0  # the stalled transfer was cut after DRAIN_S, not timeout_s (60 s)
        assert not check_complete(replica_dir(listener.root, "hostA:boot:/ram0", "slot-1")).complete
        busy.close()
        waiter.close()


def test_a_connection_that_gets_the_lock_just_after_stop_is_refused(slot: Path, tmp_path: Path) -> None:
    """The transfer holding the lock ends right as the listener stops: the connection waiting for the lock gets it
    before the listener's loop has cut the waiting ones, and must be refused then, not start a new transfer."""
    with _serving(tmp_path / "node1", timeout_s=60) as (listener, done):
        busy = _accepted(listener, slot)
        waiter = _waiting_for_the_lock(listener, slot)
        listener.stop()
        busy.close()  # the lock frees at once (its transfer fails)
        answer = _final_answer(waiter)
        assert not answer.get("ok") and "stopping" in answer.get("error", "stopping"), answer
        done.result(timeout=10)
        waiter.close()
