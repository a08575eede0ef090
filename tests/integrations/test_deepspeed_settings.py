"""The DeepSpeed adapter's settings (``resolve_settings``): cpuckpt's config machinery, no DeepSpeed needed.

configs/deepspeed.yaml loads; the ds_config block wins key by key (``attach`` lets its own settings
win and ignores the block's ``enabled``); own keys and core keys are validated strictly, errors name
the key and the source; ``CPUCKPT_DEEPSPEED_<KEY>`` and ``CPUCKPT_<SECTION>_<KEY>`` override.
"""

from __future__ import annotations

import os
from pathlib import Path

import cpuckpt.integrations.deepspeed as ckpt_ds
import pytest
from cpuckpt.integrations.deepspeed.settings import AdapterOptions, Settings, resolve_settings

from cpuckpt.config import Config
from cpuckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)


def test_public_names_and_defaults():
    for name in ckpt_ds.__all__:
        assert getattr(ckpt_ds, name) is not None, name
    s = resolve_settings(None)
    assert s == Settings()
    assert (s.enabled, s.async_save, s.background_commit, s.storage_alignment) == (True, True, True, 4096)
    assert s.core.integrity.checksum == "crc32c"  # each tag's completion marker keeps the chunk checksums
    assert not s.memory_tier and s.core.memory == Config().memory  # no memory tier unless asked; core defaults
    assert isinstance(s, AdapterOptions) and isinstance(s.core, Config)


def test_configs_deepspeed_yaml_loads():
    s = resolve_settings(REPO / "configs" / "deepspeed.yaml")
    assert (s.enabled, s.async_save, s.background_commit, s.storage_alignment) == (True, True, True, 4096)
    assert s.core.integrity.checksum == "crc32c" and s.core.io.threads == 4 and s.core.io.chunk_bytes == 32 << 20
    assert not s.memory_tier and (s.core.memory.slots, s.core.memory.persist_every) == (2, 1)
    assert s.core.staging.pool_bytes == 0 and s.core.timeout_s == 600  # pool_bytes 0: as the core's default


def test_removed_staging_mode_is_refused_with_what_to_set():
    """A DeepSpeed config written before staging.mode was removed is told to set staging.pool_bytes."""
    with pytest.raises(ConfigError, match=r"staging\.mode was removed \(the mode follows staging\.pool_bytes"):
        resolve_settings({"staging": {"mode": "snapshot"}})


def test_block_wins_key_by_key_and_attach_lets_its_settings_win():
    given = {"async": False, "storage_alignment": "8KiB", "io": {"threads": 8, "chunk_bytes": "64KiB"}}
    block = {"enabled": False, "background_commit": False, "io": {"threads": 2}}
    s = resolve_settings(given, block)
    assert not s.enabled and not s.async_save and not s.background_commit and s.storage_alignment == 8192
    assert s.core.io.threads == 2 and s.core.io.chunk_bytes == 64 << 10
    s = resolve_settings(given, block, block_wins=False)
    assert s.enabled and not s.background_commit and s.core.io.threads == 8 and s.core.io.chunk_bytes == 64 << 10


def test_settings_object_is_kept_and_the_block_goes_over_it():
    own = Settings(async_save=False, core=Config.from_dict({"io": {"threads": 8}}))
    assert resolve_settings(own) is own
    s = resolve_settings(own, {"background_commit": False, "io": {"fsync": False}})
    assert not s.async_save and not s.background_commit
    assert s.core.io.threads == 8 and not s.core.io.fsync


def test_config_file_supplies_core_keys_under_the_given_ones(tmp_path):
    core = tmp_path / "core.yaml"
    core.write_text("io:\n  threads: 6\n  fsync: false\nintegrity:\n  checksum: crc32c\n")
    s = resolve_settings({"config_file": str(core), "io": {"threads": 3}})
    assert s.core.io.threads == 3 and not s.core.io.fsync and s.core.integrity.checksum == "crc32c"


@pytest.mark.parametrize(("data", "pattern"), [
    ({"async": "yes"}, r"async must be true or false, got 'yes'"),
    ({"enabled": 1}, r"enabled must be true or false"),
    ({"storage_alignment": 100}, r"storage_alignment must be a power of two"),
    ({"storage_alignment": 32}, r"storage_alignment must be >= 64"),
    ({"memory_tier": "yes"}, r"memory_tier must be true or false"),
    ({"memory": {"slots": 0}}, r"memory\.slots must be >= 1"),
    ({"io": {"threads": 0}}, r"io\.threads must be >= 1"),
    ({"nope": 1}, r"unknown key 'nope'.*the adapter's own keys: enabled, async, background_commit"),
    ({"io": {"nope": 1}}, r"unknown key 'io\.nope'"),
])
def test_bad_keys_and_values_name_the_key_and_the_source(data, pattern):
    with pytest.raises(ConfigError, match=pattern) as ei:
        resolve_settings(data)
    assert "install()/attach() settings" in str(ei.value)
    with pytest.raises(ConfigError, match=pattern) as ei:
        resolve_settings(None, data)
    assert 'ds_config "cpuckpt" block' in str(ei.value)


@pytest.mark.parametrize(("key", "value", "instead"), [
    ("memory_dir", "/dev/shm/job7", r"memory_tier: true, and memory\.root"),
    ("persist_every", 4, r"memory\.persist_every .*also\* persisted"),
    ("memory_keep", 2, r"memory\.slots"),
])
def test_removed_keys_say_what_to_use_instead(monkeypatch, key, value, instead):
    """The adapter's own memory copy (memory_dir, persist_every, memory_keep) gave way to the core memory tier: each
    removed key is refused, from the settings, the ds_config block and the environment, naming what replaces it."""
    for settings, block in (({key: value}, None), (None, {key: value})):
        with pytest.raises(ConfigError, match=rf"{key} was removed \(.*{instead}") as ei:
            resolve_settings(settings, block)
        assert "cpuckpt deepspeed settings" in str(ei.value)
    monkeypatch.setenv(f"CPUCKPT_DEEPSPEED_{key.upper()}", str(value))
    with pytest.raises(ConfigError, match=rf"CPUCKPT_DEEPSPEED_{key.upper()}: {key} was removed"):
        resolve_settings(None)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds.yaml"
    bad.write_text("async: true\nio:\n  threads: -3\n")
    with pytest.raises(ConfigError, match=r"io\.threads") as ei:
        resolve_settings(bad)
    assert str(bad) in str(ei.value)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping") as ei:
        resolve_settings(bad)
    assert str(bad) in str(ei.value)
    bad.write_text("io: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve_settings(bad)
    with pytest.raises(ConfigError, match="cannot read") as ei:
        resolve_settings(tmp_path / "missing.yaml")
    assert "missing.yaml" in str(ei.value)
    with pytest.raises(ConfigError, match='"cpuckpt" must be a mapping'):
        resolve_settings(None, ["not", "a", "mapping"])  # type: ignore[arg-type]


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("CPUCKPT_DEEPSPEED_ASYNC", "false")
    monkeypatch.setenv("CPUCKPT_DEEPSPEED_STORAGE_ALIGNMENT", "64")
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "3")
    monkeypatch.setenv("CPUCKPT_DEEPSPEED_MEMORY_TIER", "true")
    monkeypatch.setenv("CPUCKPT_MEMORY_PERSIST_EVERY", "3")
    s = resolve_settings(REPO / "configs" / "deepspeed.yaml", {"async": True, "io": {"threads": 5}})
    assert not s.async_save and s.storage_alignment == 64 and s.core.io.threads == 3
    assert s.memory_tier and s.core.memory.persist_every == 3
    monkeypatch.setenv("CPUCKPT_DEEPSPEED_BACKGROUND_COMMIT", "maybe")
    with pytest.raises(ConfigError, match="CPUCKPT_DEEPSPEED_BACKGROUND_COMMIT"):
        resolve_settings(None)


def test_ordering_optimizer_keeps_a_copy_window():
    """``ordering: optimizer``: ``staging.d2h_window_bytes`` left 0 becomes 256 MiB (the step's ``.item()``
    would wait behind the whole save's copies on the copy engine); a value given is kept; ``host`` keeps 0."""
    from cpuckpt.config import OVERLAP_WINDOW_BYTES

    window = resolve_settings({"ordering": "optimizer"}).core.staging.d2h_window_bytes
    assert window == OVERLAP_WINDOW_BYTES == 64 << 20
    given = {"ordering": "optimizer", "staging": {"d2h_window_bytes": "16MiB"}}
    assert resolve_settings(given).core.staging.d2h_window_bytes == 16 << 20
    assert resolve_settings({}).core.staging.d2h_window_bytes == 0
    assert resolve_settings({"ordering": "optimizer", "async": False}).core.staging.d2h_window_bytes == 0


def test_memory_save_dir_without_the_memory_tier_is_ignored_with_a_warning(caplog):
    """A higher layer (the ds_config block) may turn the tier off over install()'s memory_save_dir: not an error."""
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine

    settings = resolve_settings({"memory_tier": True, "memory_save_dir": "/ckpt"}, {"memory_tier": False})
    assert settings.memory_save_dir == "/ckpt" and not settings.memory_tier
    with caplog.at_level("WARNING"):
        CpuckptCheckpointEngine(settings)
    assert "memory_save_dir /ckpt is ignored: memory_tier is off" in caplog.text


def test_a_core_async_section_is_the_cores_not_the_adapters_flag(tmp_path):
    """The adapter's own ``async`` is a bool; a core YAML's ``async:`` is a section (configs/megatron.yaml sets
    ``async: {max_in_flight: 1}``). Given to this adapter, that section was taken for its flag ("async must be true
    or false, got {'max_in_flight': 1}"); it now goes to the core, and the flag keeps its default."""
    s = resolve_settings({"async": {"max_in_flight": 1}, "io": {"threads": 3}})
    assert s.async_save is True and s.core.async_.max_in_flight == 1 and s.core.io.threads == 3
    assert resolve_settings({"async": False}).async_save is False


@pytest.mark.parametrize("name", ["megatron.yaml", "megatron-memory.yaml"])
def test_a_megatron_config_file_is_refused_not_dropped_silently(name):
    """Its megatron: block (memory_tier: true, ...) was dropped without a word: a DeepSpeed job given
    configs/megatron-memory.yaml ran without the memory tier it asked for."""
    with pytest.raises(ConfigError, match=r"megatron: block is the Megatron adapter's.*configs/deepspeed.yaml"):
        resolve_settings(REPO / "configs" / name)
    with pytest.raises(ConfigError, match="megatron: block"):
        resolve_settings(None, {"megatron": {"bogus": 1}})
    with pytest.raises(ConfigError, match="megatron: block"):  # through config_file too
        resolve_settings({"config_file": str(REPO / "configs" / name)})


def test_an_s3_save_dir_is_refused_not_written_to_a_local_s3_directory(tmp_path, monkeypatch):
    """DeepSpeed's save_dir is a local directory: s3://bucket/run wrote a complete tag into ./s3:/bucket/run (disk
    and memory tier alike), though the docs say the adapter refuses it. Refused now, before anything is written."""
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    monkeypatch.chdir(tmp_path)
    for opts in ({"prepare_pool": False}, {"prepare_pool": False, "memory_tier": True}):
        engine = CpuckptCheckpointEngine(opts)
        with pytest.raises(ConfigError, match=r"s3://bucket/run.*not supported"):
            engine.create(CheckpointCommitInfo(tag="global_step1", save_dir="s3://bucket/run", save_latest=True))
        with pytest.raises(ConfigError, match="not supported"):
            engine.load("s3://bucket/run/global_step1/mp_rank_00_model_states.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_adapter_variable_is_warned_about(monkeypatch):
    """CPUCKPT_DEEPSPEED_ASYNCC=false was ignored without a word (misspelt core variables get a warning)."""
    from cpuckpt import config

    monkeypatch.setattr(config, "_warned_env", set())
    monkeypatch.setenv("CPUCKPT_DEEPSPEED_ASYNCC", "false")
    with pytest.warns(UserWarning, match=r"CPUCKPT_DEEPSPEED_ASYNCC .*did you mean CPUCKPT_DEEPSPEED_ASYNC\?"):
        assert resolve_settings(None, {"io": {"threads": 2}}).async_save is True
