"""Telemetry: one structured record per save/load, appended as JSON lines when configured; NVTX no-op on CPU."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import cpuckpt
from cpuckpt.transfer.tracing import nvtx_range


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)


def _lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_save_load_async_save_append_json_lines(tmp_path, monkeypatch, caplog):
    sink = tmp_path / "telemetry.jsonl"
    monkeypatch.setenv("CPUCKPT_TELEMETRY_FILE", str(sink))
    sd = {"w": torch.randn(256, 256), "b": torch.ones(3), "step": 4}
    with caplog.at_level(logging.INFO, logger="cpuckpt.telemetry"):
        cpuckpt.save(sd, tmp_path / "a", step=4)
        out = {"w": torch.empty(256, 256), "b": torch.empty(3), "step": 0}
        cpuckpt.load(out, tmp_path / "a")
        cpuckpt.async_save(sd, tmp_path / "b", step=5).wait()
    recs = _lines(sink)
    assert [r["event"] for r in recs] == ["save", "load", "async_save"]
    save, load, asave = recs
    assert save["step"] == 4 and save["nbytes"] > 256 * 256 * 4 and save["files"] == 1
    assert save["stall_s"] > 0 and save["persist_s"] > 0 and save["gbps"] > 0 and save["mode"] == "streaming"
    assert save["path"].endswith("/a") and save["rank"] == 0 and save["pool_nbytes"] > 0
    assert load["nbytes"] >= 256 * 256 * 4 and load["persist_s"] > 0
    assert asave["step"] == 5 and asave["mode"] in ("snapshot", "streaming") and asave["committed_s"] > 0
    messages = [r.getMessage() for r in caplog.records if r.name == "cpuckpt.telemetry"]
    assert len(messages) == 3 and all("GB/s" in m and "stall" in m for m in messages)


def test_no_file_without_config(tmp_path):
    cpuckpt.save({"w": torch.ones(4)}, tmp_path / "a", {"io": {"fsync": False}})
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_unwritable_telemetry_file_does_not_fail_the_save(tmp_path, caplog):
    cfg = {"telemetry": {"file": str(tmp_path / "missing-dir" / "t.jsonl")}}
    with caplog.at_level(logging.WARNING, logger="cpuckpt.telemetry"):
        cpuckpt.save({"w": torch.ones(4)}, tmp_path / "a", cfg)
    assert (tmp_path / "a" / ".metadata").is_file()
    assert any("telemetry.file" in r.getMessage() for r in caplog.records)


def test_nvtx_range_is_a_no_op_without_cuda():
    with nvtx_range("cpuckpt.test"):
        x = 1
    assert x == 1
