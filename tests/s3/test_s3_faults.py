"""Faults on object storage, against the real server: nothing lost, every failure clear and the same on every
rank.

- the server killed while a 2-rank save uploads (and restarted): the save fails on both ranks with the same
  ``StorageIOError``, the torn checkpoint is never listed as complete, the previous one loads, and cleaning
  aborts the upload the failed save could not;
- wrong credentials and a missing bucket: ``StorageIOError`` saying so (``EACCES``/``ENOENT``), nothing written;
- a data object overwritten (same size) or truncated after the commit: ``CheckpointCorrupt`` naming the object
  and the byte range; the truncated one is not listed as complete;
- two writers: the conditional PUT of ``.metadata`` lets only the first commit, whose manifest stays; a PUT
  refused by this save's own earlier attempt (response lost) commits;
- cleaning that cannot read a checkpoint's ``.metadata`` raises, never deletes it;
- a load with the server gone: ``StorageIOError`` (``ECONNREFUSED``) within the client's bounds, never a hang.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from cpuckpt.testing import faults

faults.install()  # $CPUCKPT_TEST_HOOK, in the rank processes (they import this module by path)

CFG = {"io": {"chunk_bytes": "5MiB", "threads": 2}, "s3": {"max_attempts": 2, "connect_timeout_s": 1}}
MiB = 1 << 20


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 * MiB, generator=g), "b": torch.arange(100) + seed}  # 12 MiB: 3 parts


def rank_save(url: str, seed: int) -> tuple[str, str, int | None] | None:
    import torch.distributed as dist

    import cpuckpt

    state = _state(seed)
    state = {f"{k}{dist.get_rank()}": v for k, v in state.items()}  # every rank writes its own 12 MiB
    try:
        cpuckpt.save(state, url, CFG, step=seed)
    except cpuckpt.CpuckptError as e:
        return type(e).__name__, str(e), getattr(e, "errno", None)
    return None


def _load(url: str, seed: int) -> None:
    import cpuckpt

    want = {f"{k}{r}": v for r in range(2) for k, v in _state(seed).items()}
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    cpuckpt.load(out, url, CFG)
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_server_killed_mid_upload(run_ranks, own_s3_server, monkeypatch, tmp_path):
    import cpuckpt
    from cpuckpt.paths import S3Url

    server = own_s3_server
    env = server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    root = f"s3://{server.bucket}/run"
    assert run_ranks(2, rank_save, f"{root}/step_1", 1, env=env) == [None, None]

    store = server.store()
    killed = threading.Event()
    resume = tmp_path / "server-stopped"  # rank 0 holds before its second part until this exists

    def kill_once_uploading() -> None:  # rank 0's upload is open and cannot finish until ``resume`` exists
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                try:
                    uploads = store.list_uploads(S3Url(server.bucket, "run/step_2/"))
                except OSError:
                    uploads = []
                if any(u.url.key.endswith("/__0_0.distcp") for u in uploads):
                    server.stop()
                    killed.set()
                    return
                time.sleep(0.05)
        finally:
            resume.touch()  # never leave rank 0 waiting (the assertion below tells a kill that never came)

    killer = threading.Thread(target=kill_once_uploading, daemon=True)
    killer.start()
    hook = {"CPUCKPT_TEST_HOOK": f"s3-part:__0_0.distcp:1=wait:{resume}"}
    results = run_ranks(2, rank_save, f"{root}/step_2", 2, env={**env, **hook}, timeout_s=120)
    killer.join(10)
    assert killed.is_set(), "the server was never seen uploading"
    assert results[0] is not None and results[0] == results[1], results  # one error, the same on both ranks
    name, message, err = results[0]
    assert name == "StorageIOError" and "s3://ckpt/run/step_2" in message, message
    assert err in (errno.ECONNREFUSED, errno.EIO), results

    server.start()  # same ports, same data
    _await_objects(server, f"{root}/step_1")
    infos = {str(c.path): c for c in cpuckpt.list_checkpoints(root)}
    assert infos[f"{root}/step_1"].complete
    assert f"{root}/step_2" not in infos or not infos[f"{root}/step_2"].complete
    assert str(cpuckpt.find_latest(root)) == f"{root}/step_1"
    _load(f"{root}/step_1", 1)
    with pytest.raises(cpuckpt.IntegrityError, match=r"no \.metadata"):
        cpuckpt.load({"w0": torch.zeros(3 * MiB)}, f"{root}/step_2", CFG)
    cpuckpt.clean_incomplete(root)  # the torn prefix and the upload the dead server kept
    assert store.list_uploads(S3Url(server.bucket, "run/")) == []
    assert [str(c.path) for c in cpuckpt.list_checkpoints(root)] == [f"{root}/step_1"]


def test_wrong_credentials_and_missing_bucket(s3_server, s3_env, s3_url, monkeypatch):
    import cpuckpt

    cpuckpt.save({"w": torch.ones(4)}, s3_url, CFG)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(cpuckpt.StorageIOError, match="refused the credentials") as err:
        cpuckpt.save({"w": torch.ones(4)}, s3_url + "-2", CFG)
    assert err.value.errno == errno.EACCES
    with pytest.raises(cpuckpt.StorageIOError, match="refused the credentials"):
        cpuckpt.load({"w": torch.zeros(4)}, s3_url, CFG)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(cpuckpt.StorageIOError, match="bucket 'no-such-bucket-31' does not exist") as err:
        cpuckpt.save({"w": torch.ones(4)}, "s3://no-such-bucket-31/x", CFG)
    assert err.value.errno == errno.ENOENT
    assert [c.path for c in cpuckpt.list_checkpoints(s3_url.rsplit("/", 1)[0]) if str(c.path) == s3_url + "-2"] == []


def test_overwritten_or_truncated_object_is_corrupt(s3_server, s3_env, s3_url):
    import cpuckpt
    from cpuckpt.paths import S3Url

    state = {"w": torch.randn(3 * MiB, generator=torch.Generator().manual_seed(5))}
    cpuckpt.save(state, s3_url, CFG)
    store = s3_server.store()
    data_url = S3Url.parse(s3_url) / "__0_0.distcp"
    good = store.get(data_url)
    damaged = bytearray(good)
    damaged[6 * MiB + 123] ^= 0xFF  # inside the second chunk: bytes [5 MiB, 10 MiB)
    store.put(data_url, bytes(damaged))
    bad_range = r"__0_0\.distcp: checksum mismatch in bytes \[5242880, 10485760\)"
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=bad_range):
        cpuckpt.load({"w": torch.zeros(3 * MiB)}, s3_url, CFG)
    store.put(data_url, good[: 7 * MiB])
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=r"__0_0\.distcp: 7340032 bytes in the store, the manifest"):
        cpuckpt.load({"w": torch.zeros(3 * MiB)}, s3_url, CFG)
    info = cpuckpt.list_checkpoints(s3_url.rsplit("/", 1)[0])
    assert [c.complete for c in info if str(c.path) == s3_url] == [False]


def test_a_metadata_changed_after_its_commit_is_refused(s3_server, s3_env, s3_url):
    """A ``.metadata`` object replaced by one that still unpickles (two keys' names swapped: every chunk still
    verifies) does not have the crc32c the manifest recorded at the commit: incomplete, damaged, refused on load."""
    import cpuckpt
    from cpuckpt.backend import s3commit
    from cpuckpt.paths import S3Url
    from cpuckpt.tools.verification import verify_checkpoint

    cpuckpt.save({"a": torch.ones(4), "b": torch.zeros(4)}, s3_url, CFG)
    store = s3_server.store()
    url = S3Url.parse(s3_url)
    assert s3commit.check_complete(store, url).complete and verify_checkpoint(s3_url).ok
    md = store.get(url / ".metadata")
    a, b, x = b"\x8c\x01a\x94", b"\x8c\x01b\x94", b"\x8c\x01x\x94"
    assert md.count(a) == 1 and md.count(b) == 1 and x not in md
    store.put(url / ".metadata", md.replace(a, x).replace(b, a).replace(x, b))
    why = ".metadata is not the one committed with the manifest"
    assert why in s3commit.check_complete(store, url).reason
    assert [d.file for d in verify_checkpoint(s3_url).damage] == [".metadata"]
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=why):
        cpuckpt.load({"a": torch.empty(4), "b": torch.empty(4)}, s3_url, CFG)


def test_only_one_of_two_writers_commits(s3_server, s3_env, s3_url):
    """The writer that loses the race gets EEXIST and leaves the winner whole: its manifest (step, crc32c) is
    not replaced, so it still loads bit-exact and a damaged data object is still caught."""
    import cpuckpt
    from cpuckpt.backend.committed import METADATA_NAME
    from cpuckpt.backend.s3commit import load_metadata, read_manifest
    from cpuckpt.paths import S3Url

    state = {"w": torch.randn(3 * MiB, generator=torch.Generator().manual_seed(3))}
    cpuckpt.save(state, s3_url, CFG, step=7)
    store = s3_server.store()
    url = S3Url.parse(s3_url)
    first = read_manifest(store, url)
    late = cpuckpt.StorageWriter(s3_url, CFG, step=8)  # a writer that planned before the first one committed
    md = load_metadata(late.target.store, late.path)
    with pytest.raises(cpuckpt.StorageIOError, match="another save committed this checkpoint first") as err:
        late.target.commit(md, [], late.manifest_header(1))
    assert err.value.errno == errno.EEXIST and err.value.path.endswith(METADATA_NAME)
    assert read_manifest(store, url) == first
    assert [(c.step, c.complete) for c in cpuckpt.list_checkpoints(s3_url.rsplit("/", 1)[0])
            if str(c.path) == s3_url] == [(7, True)]
    out = {"w": torch.zeros(3 * MiB)}
    cpuckpt.load(out, s3_url, CFG)
    assert torch.equal(out["w"], state["w"])
    damaged = bytearray(store.get(url / "__0_0.distcp"))
    damaged[123] ^= 0xFF
    store.put(url / "__0_0.distcp", bytes(damaged))
    with pytest.raises(cpuckpt.CheckpointCorrupt, match="checksum mismatch"):
        cpuckpt.load({"w": torch.zeros(3 * MiB)}, s3_url, CFG)


def test_a_writer_racing_another_to_its_commit_never_replaces_its_manifest(s3_server, s3_env, s3_url):
    """Both writers past the HEAD of ``.metadata``: the loser's PUT replaced the winner's manifest before its own
    conditional PUT of ``.metadata`` was refused. The winner's ``.metadata`` then stood beside another save's
    manifest, which is ignored, and the load returned the loser's objects without a single check (verify: always).
    The loser now fails at its manifest, and the winner's checksums catch the objects the loser replaced."""
    import cpuckpt
    from cpuckpt.backend.s3commit import load_metadata, read_manifest
    from cpuckpt.paths import S3Url

    winner_data_done, loser_at_commit, winner_manifest_put, loser_done = (threading.Event() for _ in range(4))
    outcome: dict[str, BaseException | None] = {}

    def stages(stage: str) -> None:  # both past the HEAD of .metadata; the winner's manifest PUT after the loser's data
        who = threading.current_thread().name
        if who == "winner" and stage == "before-rename:.cpuckpt.json":
            winner_data_done.set()
            assert loser_at_commit.wait(60)
        elif who == "loser" and stage == "before-rename:.cpuckpt.json":
            loser_at_commit.set()
            assert winner_manifest_put.wait(60)
        elif who == "winner" and stage == "before-rename:.metadata":
            winner_manifest_put.set()
            assert loser_done.wait(60)

    def save(name: str, value: float) -> None:
        try:
            if name == "loser":
                assert winner_data_done.wait(60)  # its objects replace the winner's
            cpuckpt.save({"w": torch.full((MiB,), value)}, s3_url, CFG, step=1)
            outcome[name] = None
        except BaseException as e:
            outcome[name] = e
        finally:
            if name == "loser":
                loser_done.set()

    from cpuckpt import faultpoint

    faultpoint.set_handler(stages)
    try:
        threads = [threading.Thread(target=save, args=(n, v), name=n) for n, v in (("winner", 1.0), ("loser", 2.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        faultpoint.set_handler(None)
    assert outcome["winner"] is None
    loser = outcome["loser"]
    assert isinstance(loser, cpuckpt.StorageIOError) and loser.errno == errno.EEXIST, loser
    assert "another save is committing this checkpoint" in str(loser)
    store, url = s3_server.store(), S3Url.parse(s3_url)
    assert read_manifest(store, url).save_id == load_metadata(store, url).storage_meta.save_id
    with pytest.raises(cpuckpt.CheckpointCorrupt, match="checksum mismatch"):
        cpuckpt.load({"w": torch.zeros(MiB)}, s3_url, {**CFG, "integrity": {"verify": "always"}})


def test_a_manifest_a_dead_save_left_does_not_block_the_next_save(s3_server, s3_env, s3_url, monkeypatch):
    """A save that died between its manifest and its ``.metadata`` left a manifest that made every later save of the
    prefix fail (EEXIST) for ``timeout_s``: older than the new save's own data (and than a live writer's gap between
    its two PUTs: 60 s, shortened here), it is a dead save's."""
    import cpuckpt
    from cpuckpt.backend import s3commit
    from cpuckpt.backend.s3commit import read_manifest
    from cpuckpt.format.manifest import MANIFEST_NAME, Manifest
    from cpuckpt.paths import S3Url

    store, url = s3_server.store(), S3Url.parse(s3_url)
    store.put(url / MANIFEST_NAME, Manifest(save_id="a-dead-save", step=1).to_json().encode())
    monkeypatch.setattr(s3commit, "MANIFEST_DEAD_AFTER_S", 1.0)
    time.sleep(1.1)  # the server's times are whole seconds
    state = {"w": torch.arange(float(MiB))}
    cpuckpt.save(state, s3_url, CFG, step=1)
    assert read_manifest(store, url).save_id != "a-dead-save"
    out = {"w": torch.zeros(MiB)}
    cpuckpt.load(out, s3_url, {**CFG, "integrity": {"verify": "always"}})
    assert torch.equal(out["w"], state["w"])


def test_load_with_the_server_gone_fails_fast(own_s3_server, monkeypatch):
    """A load whose server died raises a StorageIOError naming the object (bounded by the client's connect
    timeout and attempts), never hangs; the checkpoint loads again once the server is back."""
    import cpuckpt

    for k, v in own_s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{own_s3_server.bucket}/gone"
    state = {"w": torch.randn(3 * MiB, generator=torch.Generator().manual_seed(9))}
    cpuckpt.save(state, url, CFG)
    own_s3_server.stop()
    t0 = time.monotonic()
    with pytest.raises(cpuckpt.StorageIOError, match=r"cannot connect to http://127\.0\.0\.1:\d+") as err:
        cpuckpt.load({"w": torch.zeros(3 * MiB)}, url, CFG)
    assert err.value.errno == errno.ECONNREFUSED and url in str(err.value)
    assert time.monotonic() - t0 < 60
    own_s3_server.start()
    _await_objects(own_s3_server, url)
    out = {"w": torch.zeros(3 * MiB)}
    cpuckpt.load(out, url, CFG)
    assert torch.equal(out["w"], state["w"])


def _await_objects(server, url: str, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until a restarted server serves the objects it held: its S3 port and bucket answer before
    its volumes are back, and a GET meanwhile is an HTTP 500 (CFG's 2 attempts do not cover that moment)."""
    from cpuckpt.backend.committed import METADATA_NAME
    from cpuckpt.paths import S3Url

    store, deadline = server.store(), time.monotonic() + timeout_s
    while True:
        try:
            store.get(S3Url.parse(url) / METADATA_NAME)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_read_error_never_deletes_a_complete_checkpoint(own_s3_server, monkeypatch):
    """Cleaning that cannot read a checkpoint's ``.metadata`` (the server gone between its HEAD and its GET)
    raises a StorageIOError; it never takes the checkpoint for incomplete and deletes it (the server is back
    by the time a deletion would run)."""
    import cpuckpt
    from cpuckpt import faultpoint, s3roots
    from cpuckpt.config import S3Config
    from cpuckpt.paths import S3Url

    server = own_s3_server
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    root = f"s3://{server.bucket}/run"
    state = {"w": torch.arange(1000.0)}
    cpuckpt.save(state, f"{root}/step_1", CFG, step=1)

    def handler(stage: str) -> None:
        if stage == "s3-complete:step_1":
            server.stop()  # the GET of .metadata that follows cannot connect
        elif stage == "clean:incomplete:step_1":
            server.start()  # a deletion decided now would succeed

    previous = faultpoint.set_handler(handler)
    try:
        with pytest.raises(cpuckpt.StorageIOError, match=r"step_1/\.metadata") as err:
            s3roots.clean_incomplete(S3Url.parse(root), cfg=S3Config(max_attempts=1, connect_timeout_s=1))
    finally:
        faultpoint.set_handler(previous)
    assert err.value.errno == errno.ECONNREFUSED
    server.start()
    assert [(c.path.name, c.complete, c.step) for c in cpuckpt.list_checkpoints(root)] == [("step_1", True, 1)]
    out = {"w": torch.zeros(1000)}
    cpuckpt.load(out, f"{root}/step_1", CFG)
    assert torch.equal(out["w"], state["w"])


def test_commit_whose_first_metadata_put_landed_succeeds(s3_server, s3_env, s3_url):
    """A conditional PUT of ``.metadata`` retried after its response was lost is refused by its own first
    attempt: the commit reads ``.metadata`` back, finds its own save_id and succeeds. A ``.metadata`` of
    another save landing at the same moment still fails the commit with EEXIST."""
    import copy
    import pickle

    import cpuckpt
    from cpuckpt import faultpoint
    from cpuckpt.backend.committed import METADATA_NAME
    from cpuckpt.backend.s3commit import load_metadata, read_manifest
    from cpuckpt.paths import S3Url

    cpuckpt.save({"w": torch.ones(4)}, s3_url + "-src", CFG, step=1)
    store = s3_server.store()
    template = load_metadata(store, S3Url.parse(s3_url + "-src"))
    for name, lands in (("ours", "ours"), ("theirs", "another-save")):
        url = S3Url.parse(f"{s3_url}-{name}")
        writer = cpuckpt.StorageWriter(str(url), CFG, step=2)
        md = copy.deepcopy(template)
        md.storage_meta.save_id = writer.manifest_header(1).save_id
        landed = copy.deepcopy(md)
        if lands != "ours":
            landed.storage_meta.save_id = "f" * 32

        def put_between_head_and_put(stage: str, url: S3Url = url, landed: object = landed) -> None:
            if stage == f"before-rename:{METADATA_NAME}":  # the first attempt's write, its response lost
                store.put(url / METADATA_NAME, pickle.dumps(landed))

        previous = faultpoint.set_handler(put_between_head_and_put)
        try:
            if lands == "ours":
                writer.target.commit(md, [], writer.manifest_header(1))
                assert read_manifest(store, url).save_id == md.storage_meta.save_id
            else:
                with pytest.raises(cpuckpt.StorageIOError, match=r"conditional PUT of \.metadata refused") as err:
                    writer.target.commit(md, [], writer.manifest_header(1))
                assert err.value.errno == errno.EEXIST
        finally:
            faultpoint.set_handler(previous)
