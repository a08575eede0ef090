"""Checkpoint roots on object storage (``s3://bucket/run``), against the real server: ``find_latest``,
``list_checkpoints``, the ``latest`` object, retention and ``load_latest`` never pick or delete what they
must not (a torn save is never listed as complete; the newest complete checkpoint is never deleted)."""

from __future__ import annotations

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
