"""Checkpoint roots on object storage (``s3://bucket/run``), against the real server: ``find_latest``,
``list_checkpoints``, the ``latest`` object, retention and ``load_latest`` never pick or delete what they
must not (a torn save is never listed as complete; the newest complete checkpoint is never deleted)."""

from __future__ import annotations

import pytest
import torch

CFG = {"io": {"chunk_bytes": "5MiB"}}


def _save(url: str, step: int, **checkpoint) -> None:
    import cpuckpt

    cfg = {**CFG, "checkpoint": checkpoint} if checkpoint else CFG
    cpuckpt.save({"w": torch.full((8,), float(step))}, url, cfg, step=step)


def test_latest_retention_and_load_latest(s3_server, s3_env, s3_url):
    import cpuckpt
    from cpuckpt.paths import S3Url

    root = s3_url
    store = s3_server.store()
    for step in (1, 2, 3):
        _save(f"{root}/step_{step}", step, update_latest=True, keep_last=2)
    assert [str(c.path) for c in cpuckpt.list_checkpoints(root)] == [f"{root}/step_2", f"{root}/step_3"]
    assert store.get(S3Url.parse(root) / "latest") == b"step_3\n"
    assert str(cpuckpt.read_latest(root)) == f"{root}/step_3"

    # a torn save after it: objects and an open upload, no .metadata
    torn = S3Url.parse(f"{root}/step_4")
    store.put(torn / "__0_0.distcp", b"x" * 100)
    store.create_upload(torn / "__1_0.distcp")
    infos = cpuckpt.list_checkpoints(root)
    assert [(c.path.name, c.complete) for c in infos] == [("step_2", True), ("step_3", True), ("step_4", False)]
    assert str(cpuckpt.find_latest(root)) == f"{root}/step_3"
    assert cpuckpt.apply_retention(root, keep_last=1) == [S3Url.parse(f"{root}/step_2")]
    assert str(cpuckpt.find_latest(root)) == f"{root}/step_3", "retention deleted the newest complete checkpoint"

    out = {"w": torch.zeros(8)}
    assert str(cpuckpt.load_latest(out, root, CFG)) == f"{root}/step_3"
    assert torch.equal(out["w"], torch.full((8,), 3.0))

    removed = cpuckpt.clean_incomplete(root)
    assert S3Url.parse(f"{root}/step_4") in removed
    assert [c.path.name for c in cpuckpt.list_checkpoints(root)] == ["step_3"]
    assert store.list_uploads(S3Url(torn.bucket, torn.key + "/")) == [], "the torn save's upload was not aborted"


def test_bucket_level_root_cleans_uploads(own_s3_server):
    """A root (or checkpoint) that is a whole bucket (``s3://bucket``, empty key): cleaning and ``clear`` find
    the multipart uploads under it (their listing prefix is ``""``, never ``"/"``, which matches nothing)."""
    from cpuckpt import s3roots
    from cpuckpt.backend.s3commit import S3Target
    from cpuckpt.config import S3Config
    from cpuckpt.paths import S3Url

    server = own_s3_server  # a bucket of its own: cleaning a whole bucket must not touch other tests' objects
    store = server.store()
    bucket = S3Url(server.bucket, "")
    store.create_upload(bucket / "step_1" / "__0_0.distcp")  # a save killed before any upload completed
    cfg = S3Config(endpoint_url=server.endpoint, max_attempts=1)
    creds = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in creds.items():
            mp.setenv(k, v)
        removed = s3roots.clean_incomplete(bucket, cfg=cfg)
    assert [str(u) for u in removed] == [f"s3://{server.bucket}/step_1/__0_0.distcp"], removed
    assert store.list_uploads(bucket) == []
    store.create_upload(bucket / "__0_0.distcp")  # a checkpoint at the bucket's top, killed mid-upload
    S3Target(store, bucket, 30).clear()
    assert store.list_uploads(bucket) == []


def test_committed_once_on_s3_comes_from_the_inspection(s3_server, s3_env, s3_url):
    """``s3://`` as locally: a prefix without ``.metadata`` or with an empty one is a torn save; one whose data object
    is cut short after the commit is damaged (committed once). The inspection says so itself, not its reason text."""
    from cpuckpt.paths import S3Url
    from cpuckpt.roots import committed_once, inspect_checkpoint

    store = s3_server.store()
    url = S3Url.parse(f"{s3_url}/step_1")
    _save(str(url), 1)
    held = store.get(url / ".metadata")
    store.delete(url / ".metadata")
    before = inspect_checkpoint(str(url))
    assert not before.complete and not committed_once(before), before
    store.put(url / ".metadata", b"")
    assert not committed_once(inspect_checkpoint(str(url)))
    store.put(url / ".metadata", held)
    assert inspect_checkpoint(str(url)).complete
    data = next(o.key for o in store.list(url.contents) if o.key.endswith(".distcp"))
    body = store.get(S3Url(url.bucket, data))
    store.put(S3Url(url.bucket, data), body[: len(body) // 2])
    after = inspect_checkpoint(str(url))
    assert not after.complete and committed_once(after), after
