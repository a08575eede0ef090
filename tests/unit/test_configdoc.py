"""docs/CONFIG.md is generated from the Config dataclass tree and must stay in sync with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cpuckpt import Config
from cpuckpt.tools.configdoc import config_markdown

REPO = Path(__file__).resolve().parents[2]


def test_committed_config_reference_matches_the_code():
    committed = (REPO / "docs" / "CONFIG.md").read_text()
    assert committed == config_markdown(), (
        "docs/CONFIG.md is out of date; regenerate it with: .venv/bin/python -m cpuckpt.tools.configdoc docs/CONFIG.md"
    )


def test_every_leaf_key_and_env_var_is_documented():
    text = config_markdown()
    for f in dataclasses.fields(Config):
        key = f.metadata.get("key", f.name)
        value = getattr(Config(), f.name)
        if dataclasses.is_dataclass(value):
            for sf in dataclasses.fields(value):
                assert f"`{key}.{sf.name}`" in text
                assert f"CPUCKPT_{key}_{sf.name}".upper() in text
                assert sf.metadata["doc"].replace("|", "\\|") in text
        else:
            assert f"`{key}`" in text and f"CPUCKPT_{key.upper()}" in text
