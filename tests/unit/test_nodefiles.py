"""A file set's node listing across nodes, and file sets over the replica protocol (real loopback sockets, real files).

A node's slot of an adapter's file set (DeepSpeed's tags) holds its own ranks' files, a node listing
(``.cpuckpt-node.json``) and the marker. Proven: the slot counts as committed for its node only while the listing
and the marker name the same save and every listed file has its size; a replica of it is byte-identical and
committed (listing, then marker) only when every chunk's crc32c matched; a damaged byte commits nothing; a restore
never overwrites a newer file set in the receiver's slot; the restart plan restores a lost node from the copy that
holds that node's own files (its listing's), not from another node's slot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest

from cpuckpt.format.manifest import FileEntry
from cpuckpt.tier.nodefiles import NODE_FILES_NAME, NodeFiles, committed_node_files, write_node_files
from cpuckpt.tier.nodes import NodeMap
from cpuckpt.tier.recovery import Copy, plan_restores
from cpuckpt.tier.replica import Listener, ReplicaError, replica_dir, send_slot, slot_content, write_token
from cpuckpt.transfer.threads import new_executor

pytestmark = pytest.mark.timeout(60)

TOKEN = "0123456789abcdef0123456789abcdef"
MARKER = ".cpuckpt-complete.json"
CHUNK = 4096


def _entry(name: str, data: bytes) -> FileEntry:
    crcs = [crc32c.crc32c(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]
    return FileEntry(name=name, nbytes=len(data), chunk_bytes=CHUNK, checksum="crc32c", chunk_checksums=crcs)


def _file_set(slot: Path, save_id: str, step: int, rank: int = 1) -> dict[str, bytes]:
    """A node's slot of a tag: its rank's optimizer file and its own copy of the model states."""
    slot.mkdir(parents=True, exist_ok=True)
    files = {"mp_rank_00_model_states.pt": bytes(range(256)) * 41 + b"model",
             f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": bytes([step % 251]) * 10_000}
    for name, data in files.items():
        (slot / name).write_bytes(data)
    write_node_files(slot, NodeFiles(save_id=save_id, step=step, marker=MARKER, world_size=2, ranks=(rank,),
                                     files={n: _entry(n, d) for n, d in files.items()},
                                     writers=dict.fromkeys(files, rank)))
    (slot / MARKER).write_text(json.dumps({"save_id": save_id, "global_step": step, "tag": f"global_step{step}"}))
    return files


def _serve(root: Path) -> Iterator[Listener]:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_token(root, TOKEN)
    listener = Listener(root, "127.0.0.1", headroom_bytes=0, timeout_s=10)
    pool = new_executor(1, "test-nodefiles-rx")
    done = pool.submit(listener.serve_forever)
    try:
        yield listener
    finally:
        listener.stop()
        done.result(timeout=10)
        pool.shutdown()


@pytest.fixture
def partner(tmp_path: Path) -> Iterator[Listener]:
    yield from _serve(tmp_path / "node0")


def test_a_slot_is_committed_for_its_node_only_while_listing_marker_and_sizes_agree(tmp_path: Path) -> None:
    slot = tmp_path / "slot-0"
    files = _file_set(slot, "s10", 10)
    listing = committed_node_files(slot)
    assert listing is not None and listing.ranks == (1,) and sorted(listing.files) == sorted(files)
    assert listing.owned() == tuple(sorted((1, n) for n in files))
    (slot / MARKER).write_text(json.dumps({"save_id": "other", "global_step": 11}))
    assert committed_node_files(slot) is None, "a marker of another save does not commit this listing"
    _file_set(slot, "s10", 10)
    with open(slot / "mp_rank_00_model_states.pt", "r+b") as f:
        f.truncate(100)
    assert committed_node_files(slot) is None, "a file shorter than its listing"
    (slot / NODE_FILES_NAME).write_text("{not json")
    assert committed_node_files(slot) is None


def test_a_file_set_replica_is_byte_identical_and_committed_last(tmp_path: Path, partner: Listener) -> None:
    slot = tmp_path / "node1" / "slot-1"
    files = _file_set(slot, "s10", 10)
    sent = send_slot(partner.endpoint, TOKEN, source="hostB:boot:/ram1", slot=slot, save_id="s10", into="replica",
                     timeout_s=10)
    assert sent == sum(len(d) for d in files.values())
    got = replica_dir(tmp_path / "node0", "hostB:boot:/ram1", "slot-1")
    for name, data in files.items():
        assert (got / name).read_bytes() == data, name
    assert (got / MARKER).read_bytes() == (slot / MARKER).read_bytes()
    assert committed_node_files(got) is not None and slot_content(got).save_id == "s10"


def test_a_damaged_byte_commits_nothing(tmp_path: Path, partner: Listener) -> None:
    slot = tmp_path / "node1" / "slot-1"
    _file_set(slot, "s10", 10)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray((slot / name).read_bytes())
    data[5000] ^= 0xFF  # the listing's crc32c no longer matches: the sender's bytes arrive damaged
    (slot / name).write_bytes(bytes(data))
    with pytest.raises(ReplicaError, match="crc32c"):
        send_slot(partner.endpoint, TOKEN, source="hostB:boot:/ram1", slot=slot, save_id="s10", into="replica",
                  timeout_s=10)
    got = replica_dir(tmp_path / "node0", "hostB:boot:/ram1", "slot-1")
    assert not (got / MARKER).exists() and not (got / NODE_FILES_NAME).exists()


def test_a_restore_never_overwrites_a_newer_file_set(tmp_path: Path, partner: Listener) -> None:
    newer = _file_set(tmp_path / "node0" / "slot-1", "s12", 12)
    older = tmp_path / "holder" / "slot-1"
    _file_set(older, "s10", 10)
    with pytest.raises(ReplicaError, match="not older"):  # even where planned over it
        send_slot(partner.endpoint, TOKEN, source="hostA:boot:/ram0", slot=older, save_id="s10", into="slot",
                  timeout_s=10, expect="s12")
    target = tmp_path / "node0" / "slot-1"
    assert slot_content(target).save_id == "s12"
    assert all((target / n).read_bytes() == d for n, d in newer.items())


def test_the_restart_plan_restores_a_lost_node_from_the_copy_of_its_own_files() -> None:
    nodes = NodeMap(0, ("hostA:b:/ram0", "hostB:b:/ram1"))
    model, optim0, optim1 = "mp_rank_00_model_states.pt", "zero_pp_rank_0.pt", "zero_pp_rank_1.pt"

    def copy(slot: str, replica: bool, rank: int, optim: str) -> Copy:
        files = tuple(sorted((model, optim)))
        return Copy(0, f"/n0/{slot}", "slot-1", replica, 10, "s10", files, files, ((rank, model), (rank, optim)))

    own0, rep1 = copy("slot-1", False, 0, optim0), copy("replica-x/slot-1", True, 1, optim1)
    plans = plan_restores(nodes, [[(10, "s10")], []], [own0, rep1])
    assert [r.source for r in plans[(10, "s10")]] == [rep1], plans
    assert plan_restores(nodes, [[(10, "s10")], []], [own0]) == {}, "node 0's own slot lacks rank 1's files"
