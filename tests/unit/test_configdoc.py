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


def test_the_command_writes_the_file_it_is_given_and_takes_help_as_an_option(tmp_path, monkeypatch, capsys):
    """``--help`` prints the usage (it once became the name of the file written)."""
    import pytest

    from cpuckpt.tools.configdoc import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert main(["ref.md"]) == 0 and (tmp_path / "ref.md").read_text() == config_markdown()
