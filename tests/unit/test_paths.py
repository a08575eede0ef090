"""A URL given as a checkpoint path is refused, also after pathlib collapsed its slashes (issue 27 item 9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.errors import ConfigError
from cpuckpt.paths import local_path


@pytest.mark.parametrize("url", ["s3://bucket/run/step_1", Path("s3://bucket/run/step_1"), "gs://b/x", "file:///tmp/x"])
def test_urls_are_refused_naming_the_path(url):
    with pytest.raises(ConfigError, match="URLs"):
        local_path(url)


@pytest.mark.parametrize("path", ["/tmp/ckpt", "relative/dir", "step:1", Path("a/b")])
def test_local_paths_pass_unchanged(path):
    assert local_path(path) == str(path)


def test_a_path_object_url_creates_no_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        cpuckpt.save({"w": torch.ones(3)}, Path("s3://bucket/run/step_1"))
    assert list(tmp_path.iterdir()) == []
