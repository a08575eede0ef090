"""``cpuckpt ls``, ``inspect``, ``verify`` and ``clean`` on an ``s3://`` root, against the real server
(in-process through click's ``CliRunner``, with the AWS variables of the test server in the environment)."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from cpuckpt.tools.cli import cli

CFG = {"io": {"chunk_bytes": "5MiB"}}


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return res.exit_code, res.output


def test_ls_verify_clean_on_s3(s3_server, s3_env, s3_url):
    import cpuckpt
    from cpuckpt.paths import S3Url

    root = s3_url
    for step in (1, 2):
        cpuckpt.save({"w": torch.full((2 * 1024 * 1024,), float(step))}, f"{root}/step_{step}", CFG, step=step)
    store = s3_server.store()
    torn = S3Url.parse(f"{root}/step_3")
    store.put(torn / "__0_0.distcp", b"x" * 10)  # a save that died before its commit

    code, out = _run("ls", "--json", root)
    assert code == 0, out
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["path"], r["kind"], r["step"], r["status"], r["latest"]) for r in rows] == [
        (f"{root}/step_1", "cpuckpt", 1, "complete", False),
        (f"{root}/step_2", "cpuckpt", 2, "complete", True),
        (f"{root}/step_3", "dcp", None, "incomplete", False)]
    assert rows[0]["nbytes"] > 8 * 1024 * 1024

    code, out = _run("inspect", "--json", f"{root}/step_2")
    assert code == 0, out
    desc = json.loads(out)
    assert (desc["kind"], desc["status"], desc["step"], desc["ranks"]) == ("cpuckpt", "complete", 2, 1), desc
    assert [t["name"] for t in desc["tensors"]] == ["w"] and list(desc["files"]) == ["__0_0.distcp"], desc
    code, out = _run("inspect", f"{root}/step_3")
    assert code == 0 and "no .metadata: the save did not complete" in out, out

    code, out = _run("verify", f"{root}/step_2")
    assert code == 0 and out.startswith(f"OK {root}/step_2: 1 file(s), 2 chunk(s)"), out
    data_url = S3Url.parse(f"{root}/step_2") / "__0_0.distcp"
    damaged = bytearray(store.get(data_url))
    damaged[5 * 1024 * 1024 + 9] ^= 1
    store.put(data_url, bytes(damaged))
    code, out = _run("verify", f"{root}/step_2")
    assert code == 1 and f"DAMAGED {root}/step_2/__0_0.distcp: bytes [5242880, " in out, out
    code, out = _run("ls", "--verify", root)
    assert code == 1 and "damaged" in out and "step_1" in out.split("<- latest")[0].splitlines()[-1], out

    code, out = _run("ls", f"{root}/step_1")  # a checkpoint prefix as ROOT: itself, as a local directory
    assert code == 0 and f"{root}/step_1" in out and "complete" in out and "<- latest" in out, out
    assert "step_2" not in out, out

    store.put(S3Url.parse(f"{root}/step_1") / "__0_.cpuckpt-part.json", b"{}")  # a part a save left behind
    code, out = _run("clean", "--min-age", "0", "--dry-run", "--json", root)
    assert code == 0, out
    assert sorted((r["path"], r["kind"], r["removed"]) for r in map(json.loads, out.splitlines())) == [
        (f"{root}/step_1/__0_.cpuckpt-part.json", "leftover", False), (f"{root}/step_3", "checkpoint", False)], out
    code, out = _run("clean", "--min-age", "0", root)
    assert code == 0 and f"removed {root}/step_3" in out and f"removed {root}/step_1/__0_.cpuckpt-part.json" in out, out
    code, out = _run("ls", root)
    assert "step_3" not in out, out
    code, out = _run("verify", "gs://bucket/x")
    assert code == 2 and "not supported" in out, out


def _safetensors(data: bytes) -> tuple[dict, dict]:
    """(tensors, __metadata__) of a safetensors file's bytes."""
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    return load(data), json.loads(data[8:8 + n])["__metadata__"]


def test_convert_from_and_to_s3(s3_server, s3_env, s3_url, tmp_path):
    """``convert`` reads an ``s3://`` checkpoint and writes an ``s3://`` object (a multipart upload of several parts)
    or prefix of shards, refuses to replace one without --overwrite, leaves no upload and no staged file behind."""
    import io

    import cpuckpt
    from cpuckpt.paths import S3Url

    g = torch.Generator().manual_seed(7)
    state = {"w1": torch.randn(2 * 1024 * 1024, generator=g), "w2": torch.randn(1024 * 1024, generator=g),
             "h": torch.arange(10, dtype=torch.bfloat16), "meta": {"step": 3}}  # 12 MiB of tensors
    src = f"{s3_url}/step_3"
    cpuckpt.save(state, src, CFG, step=3)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("io:\n  chunk_bytes: 5MiB\n")
    stage = tmp_path / "stage"
    stage.mkdir()
    store = s3_server.store()
    tensors = {k: v for k, v in state.items() if k != "meta"}

    out = f"{s3_url}/export/model.safetensors"
    args = ["convert", src, out, "--to", "safetensors", "--config", str(cfg), "--tmp-dir", str(stage)]
    code, text = _run(*args)
    assert code == 0 and f"wrote {out} (12.0 MiB)" in text and "kept meta.step: 3" in text, text
    got, meta = _safetensors(store.get(S3Url.parse(out)))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert json.loads(meta["meta.step"]) == 3  # DCP flattens the dict
    assert list(stage.iterdir()) == [], "the staged file was not removed"
    code, text = _run(*args)
    assert code == 2 and f"{out}: exists; pass --overwrite" in text, text
    code, text = _run(*args, "--overwrite")
    assert code == 0, text

    shards = f"{s3_url}/export/torch"
    code, text = _run("convert", src, shards, "--to", "torch", "--max-shard-size", "6MiB", "--config", str(cfg))
    assert code == 0, text
    prefix = S3Url.parse(shards)
    names = sorted(o.key[len(prefix.key) + 1:] for o in store.list(S3Url(prefix.bucket, prefix.key + "/")))
    assert names == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                     "pytorch_model.bin.index.json"], names
    index = json.loads(store.get(prefix / "pytorch_model.bin.index.json"))
    merged: dict = {}
    for name in names[:2]:
        merged.update(torch.load(io.BytesIO(store.get(prefix / name)), weights_only=True))
    assert all(torch.equal(merged[k], v) for k, v in tensors.items()) and merged["meta.step"] == 3
    assert set(index["weight_map"]) == set(tensors), index
    assert store.list_uploads(S3Url(prefix.bucket, S3Url.parse(s3_url).key + "/")) == []

    local = tmp_path / "model.safetensors"  # s3:// to a local file
    code, text = _run("convert", src, str(local), "--to", "safetensors")
    assert code == 0, text
    got, _ = _safetensors(local.read_bytes())
    assert all(torch.equal(got[k], v) for k, v in tensors.items())

    code, text = _run("convert", src, "s3://no-such-bucket-31/m.safetensors", "--to", "safetensors")
    assert code == 2 and "bucket 'no-such-bucket-31' does not exist" in text, text
    code, text = _run("convert", f"{s3_url}/step_9", str(tmp_path / "x.pt"), "--to", "torch")
    assert code == 2 and f"{s3_url}/step_9: not a checkpoint" in text, text


def test_a_stock_checkpoint_prefix_missing_a_data_object_is_incomplete(s3_server, s3_env, s3_url, tmp_path):
    """A stock DCP checkpoint in the store (its files uploaded as they are) with a data object gone or cut short was
    complete and the latest: only ``.metadata`` was looked at."""
    import torch.distributed.checkpoint as dcp

    import cpuckpt
    from cpuckpt.paths import S3Url

    local = tmp_path / "stock"
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=dcp.FileSystemWriter(str(local)))
    store = s3_server.store()
    for name in ("good", "bad"):
        for f in local.iterdir():
            store.put(S3Url.parse(f"{s3_url}/{name}") / f.name, f.read_bytes())
    (data,) = local.glob("*.distcp")
    assert cpuckpt.find_latest(s3_url) is not None
    bad = S3Url.parse(f"{s3_url}/bad") / data.name
    store.put(bad, data.read_bytes()[:-1])
    assert cpuckpt.find_latest(s3_url) == S3Url.parse(f"{s3_url}/good")
    store.delete(bad)
    code, out = _run("ls", s3_url)
    row = next(line for line in out.splitlines() if line.startswith("bad"))
    good = next(line for line in out.splitlines() if line.startswith("good"))
    assert code == 0 and "incomplete" in row and "<- latest" in good, out
    code, out = _run("ls", "--verify", s3_url)  # its .metadata is there: damaged since its commit, as verify says
    row = next(line for line in out.splitlines() if line.startswith("bad"))
    assert code == 1 and "damaged" in row, out
