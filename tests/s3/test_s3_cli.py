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

    code, out = _run("clean", "--min-age", "0", root)
    assert code == 0 and f"removed {root}/step_3" in out, out
    code, out = _run("ls", root)
    assert "step_3" not in out, out
    code, out = _run("verify", "gs://bucket/x")
    assert code == 2 and "not supported" in out, out
