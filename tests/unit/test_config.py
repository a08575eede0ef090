"""Config: defaults mirror configs/default.yaml, strict validation with clear messages, env overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from cpuckpt import Config, ConfigError
from cpuckpt.config import REMOVED_KEYS, parse_bytes

REPO = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "configs" / "default.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No CPUCKPT_* variable from the caller's environment may leak into these tests."""
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted YAML keys of every leaf field of the Config dataclass tree."""
    out = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            out += _leaf_keys(factory, f"{prefix}{_key(f)}.")
        else:
            out.append(f"{prefix}{_key(f)}")
    return out


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- default.yaml mirror


def test_default_yaml_loads_to_builtin_defaults():
    assert Config.from_yaml(DEFAULT_YAML, env=False) == Config()


def test_default_yaml_values_equal_builtin_defaults_key_by_key():
    raw = _flatten(yaml.safe_load(DEFAULT_YAML.read_text()))
    built = _flatten(Config().to_dict())
    assert set(raw) == set(built), (
        f"keys only in YAML: {set(raw) - set(built)}, only in Config: {set(built) - set(raw)}"
    )
    for key, value in raw.items():
        expect = built[key]
        if isinstance(value, str) and isinstance(expect, int) and not isinstance(expect, bool):
            value = parse_bytes(value)  # size strings such as '32MiB'
        assert value == expect, f"{key}: default.yaml says {value!r}, Config() has {expect!r}"
        assert type(value) is type(expect), f"{key}: {type(value).__name__} vs {type(expect).__name__}"


def test_every_config_field_is_documented_in_default_yaml():
    text = DEFAULT_YAML.read_text()
    raw = _flatten(yaml.safe_load(text))
    for dotted in _leaf_keys(Config):
        assert dotted in raw, f"{dotted} is a Config field but missing from {DEFAULT_YAML}"
        leaf = dotted.rsplit(".", 1)[-1]
        lines = [ln for ln in text.splitlines() if re.match(rf"^\s*{re.escape(leaf)}\s*:", ln)]
        assert lines, dotted
        assert all("#" in ln for ln in lines), f"{dotted} has no comment explaining it in {DEFAULT_YAML}"


def test_every_field_has_doc_metadata():
    def walk(cls):
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
                walk(factory)
            else:
                assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"

    walk(Config)


def test_empty_yaml_means_defaults(tmp_path):
    assert Config.from_yaml(_write(tmp_path, ""), env=False) == Config()
    assert Config.from_yaml(_write(tmp_path, "# only a comment\n"), env=False) == Config()


def test_to_dict_round_trips():
    cfg = Config.from_dict({"io": {"threads": 3, "chunk_bytes": "64KiB"}, "async": {"max_in_flight": 2}}, env=False)
    assert Config.from_dict(cfg.to_dict(), env=False) == cfg
    assert cfg.to_dict()["async"]["max_in_flight"] == 2
    assert cfg.async_.max_in_flight == 2


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.io.threads = 9  # type: ignore[misc]


# ----------------------------------------------------------------------------------------- errors


def _yaml_error(tmp_path: Path, text: str) -> str:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        Config.from_yaml(p, env=False)
    msg = str(ei.value)
    assert str(p) in msg, f"message does not name the file: {msg}"
    return msg


@pytest.mark.parametrize(
    ("text", "dotted"),
    [
        ("io:\n  thread: 4\n", "io.thread"),
        ("io:\n  threads: 4\n  bogus: 1\n", "io.bogus"),
        ("iox:\n  threads: 4\n", "iox"),
        ("layout:\n  align: 4096\n", "layout.align"),
        ("async_:\n  max_in_flight: 2\n", "async_"),
    ],
)
def test_unknown_key_names_dotted_key_and_file(tmp_path, text, dotted):
    msg = _yaml_error(tmp_path, text)
    assert f"'{dotted}'" in msg
    assert "unknown key" in msg


@pytest.mark.parametrize("dotted", sorted(REMOVED_KEYS))
def test_removed_key_names_the_key_and_says_it_was_removed(tmp_path, dotted):
    """A config written for an older cpuckpt that still sets a deleted key fails, saying so (not "unknown")."""
    section, _, key = dotted.rpartition(".")
    text = f"{section}:\n  {key}: 1\n" if section else f"{key}: 1\n"
    msg = _yaml_error(tmp_path, text)
    assert f"{dotted} was removed ({REMOVED_KEYS[dotted]})" in msg and "unknown" not in msg, msg
    with pytest.raises(ConfigError, match=f"<dict>: {re.escape(dotted)} was removed"):
        Config.from_dict({section: {key: 1}} if section else {key: 1}, env=False)


@pytest.mark.parametrize("mode", ["snapshot", "streaming", "auto"])
def test_removed_staging_mode_says_to_set_pool_bytes(tmp_path, mode):
    """staging.mode is derived from staging.pool_bytes now; a config that still sets it is told which value."""
    msg = _yaml_error(tmp_path, f"staging:\n  mode: {mode}\n  pool_bytes: 1GiB\n")
    assert "staging.mode was removed" in msg and "delete the key" in msg, msg
    assert "pool_bytes: 0 for snapshot" in msg and "smaller than the shard for streaming" in msg, msg


@pytest.mark.parametrize(
    ("text", "dotted", "fragment"),
    [
        ("io:\n  threads: eight\n", "io.threads", "'eight'"),
        ("io:\n  threads: 4.5\n", "io.threads", "4.5"),
        ("io:\n  threads: true\n", "io.threads", "True"),
        ("io:\n  fsync: 1\n", "io.fsync", "true or false"),
        ("io:\n  backend: 3\n", "io.backend", "string"),
        ("io:\n  chunk_bytes: lots\n", "io.chunk_bytes", "'lots'"),
        ("io:\n  chunk_bytes: [1]\n", "io.chunk_bytes", "byte count"),
        ("timeout_s: soon\n", "timeout_s", "number"),
        ("staging:\n  pin: 'maybe'\n", "staging.pin", "true or false"),
        ("io: 5\n", "io", "mapping"),
    ],
)
def test_wrong_type_names_dotted_key_and_file(tmp_path, text, dotted, fragment):
    msg = _yaml_error(tmp_path, text)
    assert dotted in msg
    assert fragment in msg


@pytest.mark.parametrize(
    ("text", "dotted"),
    [
        ("io:\n  threads: 0\n", "io.threads"),
        ("io:\n  threads: -3\n", "io.threads"),
        ("io:\n  threads: 100000\n", "io.threads"),
        ("io:\n  chunk_bytes: 1000\n", "io.chunk_bytes"),
        ("layout:\n  align_bytes: 3000\n", "layout.align_bytes"),
        ("layout:\n  align_bytes: 6144\n", "layout.align_bytes"),
        ("layout:\n  align_bytes: 256\n", "layout.align_bytes"),
        ("staging:\n  pool_bytes: -1\n", "staging.pool_bytes"),
        ("timeout_s: 0\n", "timeout_s"),
        ("async:\n  max_in_flight: 0\n", "async.max_in_flight"),
        ("integrity:\n  verify: sometimes\n", "integrity.verify"),
        ("integrity:\n  checksum: md5\n", "integrity.checksum"),
    ],
)
def test_impossible_value_names_dotted_key_and_file(tmp_path, text, dotted):
    msg = _yaml_error(tmp_path, text)
    assert dotted in msg


def test_power_of_two_message(tmp_path):
    assert "power of two" in _yaml_error(tmp_path, "layout:\n  align_bytes: 3072\n")


def test_bad_choice_lists_the_choices(tmp_path):
    msg = _yaml_error(tmp_path, "integrity:\n  verify: sometimes\n")
    assert "always" in msg and "off" in msg and "'sometimes'" in msg


def test_chunk_not_multiple_of_align_names_both_keys_and_file(tmp_path):
    msg = _yaml_error(tmp_path, "io:\n  chunk_bytes: 12KiB\nlayout:\n  align_bytes: 8KiB\n")
    assert "io.chunk_bytes" in msg and "layout.align_bytes" in msg
    assert "multiple" in msg


def test_chunk_not_multiple_of_align_from_dict_and_constructor():
    with pytest.raises(ConfigError, match=r"io\.chunk_bytes.*layout\.align_bytes"):
        Config.from_dict({"io": {"chunk_bytes": 6144}}, env=False)
    from cpuckpt.config import IOConfig

    with pytest.raises(ConfigError, match="multiple"):
        Config(io=IOConfig(chunk_bytes=6144))


def test_dict_source_is_named():
    with pytest.raises(ConfigError, match=r"<dict>.*io\.threads"):
        Config.from_dict({"io": {"threads": "eight"}}, env=False)
    with pytest.raises(ConfigError, match=r"my-source.*'io\.nope'"):
        Config.from_dict({"io": {"nope": 1}}, source="my-source", env=False)


def test_malformed_yaml_names_file(tmp_path):
    msg = _yaml_error(tmp_path, "io:\n  threads: [4\n  backend: auto\n")
    assert "YAML" in msg


def test_yaml_top_level_not_a_mapping(tmp_path):
    msg = _yaml_error(tmp_path, "- io\n- layout\n")
    assert "mapping" in msg


def test_missing_file_names_path(tmp_path):
    p = tmp_path / "does-not-exist.yaml"
    with pytest.raises(ConfigError) as ei:
        Config.from_yaml(p, env=False)
    assert str(p) in str(ei.value)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        Config.from_dict({"io": {"threads": 0}}, env=False)


# ------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("32MiB", 32 * 2**20),
        ("32mib", 32 * 2**20),
        ("1GB", 10**9),
        ("1GiB", 2**30),
        ("64KiB", 65536),
        ("64 KiB", 65536),
        ("1.5KiB", 1536),
        ("2kb", 2000),
        ("1TiB", 2**40),
        ("7B", 7),
        (0, 0),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["lots", "", "-1", "1 XB", "MiB", True, None, 1.5, [4096]])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_size_strings_in_yaml(tmp_path):
    p = _write(tmp_path, "io:\n  chunk_bytes: 64KiB\nstaging:\n  pool_bytes: 1GB\n"
                         "layout:\n  align_data_min_bytes: 2MiB\n")
    cfg = Config.from_yaml(p, env=False)
    assert cfg.io.chunk_bytes == 65536
    assert cfg.staging.pool_bytes == 10**9
    assert cfg.layout.align_data_min_bytes == 2 * 2**20


def test_size_key_rejects_non_size_string(tmp_path):
    msg = _yaml_error(tmp_path, "staging:\n  pool_bytes: 1 gallon\n")
    assert "staging.pool_bytes" in msg and "byte count" in msg


# -------------------------------------------------------------------------------------------- env


def test_env_override_threads(monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "8")
    cfg = Config.from_dict(None)
    assert cfg.io.threads == 8
    assert cfg.io.chunk_bytes == Config().io.chunk_bytes


def test_env_override_top_level_timeout(monkeypatch):
    monkeypatch.setenv("CPUCKPT_TIMEOUT_S", "5")
    cfg = Config.from_dict({})
    assert cfg.timeout_s == 5.0
    assert isinstance(cfg.timeout_s, float)


def test_env_overrides_yaml_value(monkeypatch, tmp_path):
    p = _write(tmp_path, "io:\n  threads: 2\n  backend: buffered\n")
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "8")
    cfg = Config.from_yaml(p)
    assert cfg.io.threads == 8
    assert cfg.io.backend == "buffered"  # the rest of the file still applies
    assert Config.from_yaml(p, env=False).io.threads == 2


def test_env_override_sizes_bools_and_async_section(monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_CHUNK_BYTES", "64KiB")
    monkeypatch.setenv("CPUCKPT_IO_FSYNC", "false")
    monkeypatch.setenv("CPUCKPT_INTEGRITY_VERIFY", "off")
    monkeypatch.setenv("CPUCKPT_ASYNC_MAX_IN_FLIGHT", "3")
    cfg = Config.from_dict(None)
    assert cfg.io.chunk_bytes == 65536
    assert cfg.io.fsync is False
    assert cfg.integrity.verify == "off"
    assert cfg.async_.max_in_flight == 3


def test_env_ignored_when_disabled(monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "8")
    assert Config.from_dict(None, env=False).io.threads == Config().io.threads


def test_env_bad_value_names_key_and_variable(monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "eight")
    with pytest.raises(ConfigError) as ei:
        Config.from_dict(None)
    msg = str(ei.value)
    assert "io.threads" in msg
    assert "CPUCKPT_IO_THREADS" in msg, f"the error does not say the value came from the environment: {msg}"


def test_env_bad_value_with_yaml_source_names_variable(monkeypatch, tmp_path):
    p = _write(tmp_path, "io:\n  backend: buffered\n")
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "0")
    with pytest.raises(ConfigError) as ei:
        Config.from_yaml(p)
    assert "io.threads" in str(ei.value)
    assert "CPUCKPT_IO_THREADS" in str(ei.value)


def test_env_malformed_yaml_value(monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "[8")
    with pytest.raises(ConfigError, match="CPUCKPT_IO_THREADS"):
        Config.from_dict(None)


@pytest.mark.parametrize(("name", "text", "dotted"), [
    ("CPUCKPT_MEMORY_JOB", "12345", "memory.job"),
    ("CPUCKPT_TELEMETRY_FILE", "", "telemetry.file"),
    ("CPUCKPT_MEMORY_REPLICA_HOST", "on", "memory.replica_host"),
    ("CPUCKPT_MEMORY_ROOT", "", "memory.root"),
    ("CPUCKPT_S3_REGION", "no", "s3.region"),
    ("CPUCKPT_IO_BACKEND", "buffered", "io.backend"),
    ("CPUCKPT_INTEGRITY_VERIFY", "off", "integrity.verify"),
])
def test_env_override_of_a_string_key_is_the_text_as_it_is(monkeypatch, name, text, dotted):
    """Regression: env values were read as YAML for every key, so CPUCKPT_MEMORY_JOB=12345 failed with
    "memory.job must be a string, got 12345", CPUCKPT_TELEMETRY_FILE= (empty: off, as documented) with
    "got None", and CPUCKPT_MEMORY_REPLICA_HOST=on became True."""
    monkeypatch.setenv(name, text)
    section, key = dotted.split(".")
    assert Config.from_dict(None).to_dict()[section][key] == text


@pytest.mark.parametrize("text", ["off", "Off", "false", "no", "N"])
@pytest.mark.parametrize("source", ["env", "yaml"])
def test_yaml_spellings_of_false_are_off_for_a_key_that_has_off(monkeypatch, tmp_path, text, source):
    """Regression: with environment text taken as it is, CPUCKPT_INTEGRITY_VERIFY=false (or no, Off), which YAML
    read as false and so "off", was refused."""
    if source == "env":
        monkeypatch.setenv("CPUCKPT_INTEGRITY_VERIFY", text)
        cfg = Config.from_dict(None)
    else:
        cfg = Config.from_yaml(_write(tmp_path, f"integrity:\n  verify: {text}\n"), env=False)
    assert cfg.integrity.verify == "off"


def test_env_override_of_an_optional_string_option_is_the_text(monkeypatch):
    """``str | None`` fields of an option tree built with build_options (the adapters' trees) too."""
    from cpuckpt.config import build_options

    monkeypatch.setenv("CPUCKPT_TEST_OPTS_NAME", "007")
    monkeypatch.setenv("CPUCKPT_TEST_OPTS_COUNT", "7")
    opts = build_options(_Opts, None, env_prefix="CPUCKPT_TEST_OPTS_")
    assert opts.name == "007" and opts.count == 7  # a non-string key still reads a YAML scalar


def test_bare_off_in_yaml_means_the_string_off(tmp_path):
    """YAML 1.1 reads an unquoted ``off`` as false; ``verify: off`` must still mean "off"."""
    cfg = Config.from_yaml(_write(tmp_path, "integrity:\n  verify: off\n"), env=False)
    assert cfg.integrity.verify == "off"
    msg = _yaml_error(tmp_path, "integrity:\n  verify: on\n")
    assert "integrity.verify" in msg


def test_nan_timeout_is_rejected(tmp_path):
    """NaN compares false with every bound, so a range check alone would let it through."""
    msg = _yaml_error(tmp_path, "timeout_s: .nan\n")
    assert "timeout_s" in msg


_FLOAT_KEYS = ["timeout_s", "checkpoint.sigterm_grace_s", "s3.connect_timeout_s", "s3.read_timeout_s",
               "integrity.sample_fraction"]
_SECONDS_KEYS = [k for k in _FLOAT_KEYS if k.endswith("_s")]


def _nested(dotted: str, value: object) -> dict:
    section, _, key = dotted.rpartition(".")
    return {section: {key: value}} if section else {key: value}


def _float_key_error(dotted: str, value: object) -> str:
    with pytest.raises(ConfigError) as ei:
        Config.from_dict(_nested(dotted, value), env=False)
    return str(ei.value)


def test_every_float_key_is_covered():
    floats = [k for k in _leaf_keys(Config) if isinstance(_flatten(Config().to_dict())[k], float)]
    assert sorted(floats) == sorted(_FLOAT_KEYS)


@pytest.mark.parametrize("dotted", _FLOAT_KEYS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), pytest.param(10**400, id="10**400")])
def test_float_keys_refuse_values_that_are_not_finite(dotted, value):
    """Regression: ``timeout_s: .inf`` was accepted; saves worked, then every load failed deep inside with
    "timestamp out of range for platform time_t" (Queue.get(timeout=inf))."""
    msg = _float_key_error(dotted, value)
    assert msg.startswith(f"<dict>: {dotted} must be a finite number, got "), msg


@pytest.mark.parametrize("dotted", _SECONDS_KEYS)
def test_seconds_keys_refuse_waits_longer_than_python_allows(dotted, tmp_path):
    """1e12 s is finite but past threading.TIMEOUT_MAX: every bounded wait raised OverflowError (and gloo's
    timeouts overflow far below it)."""
    import threading

    from cpuckpt.config import MAX_WAIT_S

    assert MAX_WAIT_S < threading.TIMEOUT_MAX
    msg = _float_key_error(dotted, 1e12)
    assert f"{dotted} must be <= {MAX_WAIT_S}, got 1000000000000.0" in msg, msg
    ok = Config.from_dict(_nested(dotted, MAX_WAIT_S), env=False)
    assert _flatten(ok.to_dict())[dotted] == MAX_WAIT_S
    section, _, key = dotted.rpartition(".")
    text = f"{section}:\n  {key}: .inf\n" if section else f"{key}: .inf\n"
    assert f"{dotted} must be a finite number, got inf" in _yaml_error(tmp_path, text)


def test_timeout_from_env_refusing_inf_names_the_variable(monkeypatch):
    monkeypatch.setenv("CPUCKPT_TIMEOUT_S", ".inf")
    with pytest.raises(ConfigError, match=r"^environment variable CPUCKPT_TIMEOUT_S: timeout_s must be a finite "
                                          r"number, got inf$"):
        Config.from_dict(None)


def test_a_large_timeout_within_the_bound_saves_and_loads(tmp_path):
    """The bound is a real limit: a config at it still saves and, above all, loads."""
    import torch

    import cpuckpt
    from cpuckpt.config import MAX_WAIT_S

    cfg = {"timeout_s": MAX_WAIT_S, "io": {"backend": "buffered", "threads": 2}}
    cpuckpt.save({"w": torch.arange(10.0)}, tmp_path / "ck", config=cfg)
    out = {"w": torch.zeros(10)}
    cpuckpt.load(out, tmp_path / "ck", config=cfg)
    assert torch.equal(out["w"], torch.arange(10.0))


@pytest.mark.parametrize("dotted", ["io.chunk_bytes", "staging.pool_bytes", "staging.d2h_window_bytes",
                                    "layout.align_data_min_bytes", "memory.headroom_bytes"])
def test_byte_counts_past_an_off_t_are_refused(dotted):
    """A pool or chunk of 2**64 bytes passed validation and failed at the first save with an OverflowError."""
    with pytest.raises(ConfigError, match=rf"^<dict>: {re.escape(dotted)} must be a byte count <= {2**63 - 1}"):
        Config.from_dict(_nested(dotted, 2**64), env=False)


def test_section_with_every_key_commented_out_means_defaults(tmp_path):
    """Users copy default.yaml and comment lines out; an emptied section must not be an error."""
    text = "io:\n  # threads: 4\nlayout:\nintegrity:\n  verify: always\n"
    assert Config.from_yaml(_write(tmp_path, text), env=False) == Config()


def test_commented_out_copy_of_default_yaml_loads(tmp_path):
    lines = []
    for ln in DEFAULT_YAML.read_text().splitlines():
        stripped = ln.lstrip()
        indented = ln != stripped
        lines.append(("  # " + stripped) if indented and stripped and not stripped.startswith("#") else ln)
    assert Config.from_yaml(_write(tmp_path, "\n".join(lines) + "\n"), env=False) == Config()


# ---------------------------------------------------------------------------- malformed shapes, URLs


@pytest.mark.parametrize("text, expect", [
    ("io: fast\n", "cfg.yaml: io must be a mapping of keys, got 'fast'"),
    ("memory: [1, 2]\n", "cfg.yaml: memory must be a mapping of keys, got [1, 2]"),
    ("- io\n- layout\n", "cfg.yaml: top level must be a mapping of sections"),
    ("1: 2\n", "cfg.yaml: key 1 in the top level is not a name"),
    ("io:\n  true: 2\n", "cfg.yaml: key True in section io is not a name"),
])
def test_malformed_shapes_name_the_file_and_the_key(tmp_path, text, expect):
    """A section given a scalar used to escape as a bare ValueError ("dictionary update sequence")."""
    with pytest.raises(ConfigError) as ei:
        Config.from_yaml(_write(tmp_path, text))  # env=True: the env overlay is where `io: fast` crashed
    assert str(ei.value).startswith(f"{tmp_path}/{expect}"), str(ei.value)


def test_malformed_shapes_from_dict_name_the_source():
    with pytest.raises(ConfigError, match=r"^job\.yaml: io must be a mapping of keys, got 3$"):
        Config.from_dict({"io": 3}, source="job.yaml")
    with pytest.raises(ConfigError, match=r"^job\.yaml: top level must be a mapping of sections"):
        Config.from_dict(["io"], source="job.yaml")  # type: ignore[arg-type]


def test_null_section_is_defaults_even_with_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUCKPT_IO_THREADS", "7")
    assert Config.from_yaml(_write(tmp_path, "io:\nmemory: null\n")).io.threads == 7


@pytest.mark.parametrize("key", ["memory.root", "telemetry.file"])
def test_path_keys_refuse_urls_naming_file_and_key(tmp_path, key):
    section, leaf = key.split(".")
    p = _write(tmp_path, f"{section}:\n  {leaf}: s3://bucket/run\n")
    with pytest.raises(ConfigError, match=rf"cfg\.yaml: {re.escape(key)} 's3://bucket/run': URLs \(s3://\)"):
        Config.from_yaml(p, env=False)
    ok = _write(tmp_path, f"{section}:\n  {leaf}: {tmp_path}/x\n", name="ok.yaml")
    assert Config.from_yaml(ok, env=False).to_dict()[section][leaf] == f"{tmp_path}/x"


def test_path_key_from_env_refusing_url_names_the_variable(monkeypatch):
    monkeypatch.setenv("CPUCKPT_MEMORY_ROOT", "gs://b/ram")
    with pytest.raises(ConfigError, match=r"environment variable CPUCKPT_MEMORY_ROOT: memory\.root 'gs://b/ram'"):
        Config.from_dict(None)


# ------------------------------------------------------------------------------- unknown CPUCKPT_*


@pytest.fixture
def _fresh_env_warnings(monkeypatch):
    import cpuckpt.config as config_mod

    monkeypatch.setattr(config_mod, "_warned_env", set())


def _warnings_of(fn) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_misspelled_env_variable_warns_once(monkeypatch, _fresh_env_warnings):
    monkeypatch.setenv("CPUCKPT_IO_THREAD", "8")
    first = _warnings_of(lambda: Config.from_dict(None))
    assert len(first) == 1 and "CPUCKPT_IO_THREAD " in first[0] and "CPUCKPT_IO_THREADS" in first[0], first
    assert _warnings_of(lambda: Config.from_dict(None)) == []  # once per process and variable
    assert Config.from_dict(None).io.threads == Config().io.threads


def test_removed_value_of_a_kept_key_says_it_was_removed(tmp_path, monkeypatch):
    msg = _yaml_error(tmp_path, "memory:\n  when_full: skip\n")
    assert "memory.when_full: skip was removed (" in msg and "use wait or disk" in msg, msg
    monkeypatch.setenv("CPUCKPT_MEMORY_WHEN_FULL", "skip")
    with pytest.raises(ConfigError, match=r"environment variable CPUCKPT_MEMORY_WHEN_FULL: memory\.when_full: "
                                          r"skip was removed"):
        Config.from_dict(None)
    assert Config.from_dict({"memory": {"when_full": "disk"}}, env=False).memory.when_full == "disk"


@pytest.mark.parametrize("dotted", sorted(REMOVED_KEYS))
def test_env_variable_of_a_removed_key_warns_that_it_was_removed(monkeypatch, _fresh_env_warnings, dotted):
    name = "CPUCKPT_" + dotted.replace(".", "_").upper()
    monkeypatch.setenv(name, "1")
    (msg,) = _warnings_of(lambda: Config.from_dict(None))
    assert f"{name} sets {dotted}, which was removed" in msg and "ignored" in msg, msg
    assert Config.from_dict(None) == Config()


def test_env_warning_is_shown_by_default(tmp_path):
    """Default warning filters (no pytest capture): a user sees the line on stderr."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    env["CPUCKPT_STAGING_PINN"] = "false"
    out = subprocess.run([sys.executable, "-c", "import cpuckpt; cpuckpt.Config.from_dict(None)"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "CPUCKPT_STAGING_PINN matches no cpuckpt config key" in out.stderr
    assert "did you mean CPUCKPT_STAGING_PIN?" in out.stderr


@pytest.mark.parametrize("name", ["CPUCKPT_TEST_HOOK", "CPUCKPT_SWEEP_SEED", "CPUCKPT_LONG_SWEEP", "CPUCKPT_SLOW",
                                  "CPUCKPT_MEGATRON_ON_FAILURE", "CPUCKPT_DEEPSPEED_ASYNC", "CPUCKPT_BENCH_DISK_DIR",
                                  "CPUCKPT_TEST_SHM", "CPUCKPT_TELEMETRY_FILE", "CPUCKPT_TIMEOUT_S",
                                  "CPUCKPT_ASYNC_MAX_IN_FLIGHT"])
def test_legitimate_env_variables_do_not_warn(monkeypatch, _fresh_env_warnings, name):
    value = "1" if name != "CPUCKPT_TELEMETRY_FILE" else "/tmp/t.jsonl"
    monkeypatch.setenv(name, value)
    assert _warnings_of(lambda: Config.from_dict(None)) == []


@dataclasses.dataclass(frozen=True)
class _Opts:
    """An option tree as an adapter declares one (build_options), with an optional string key."""

    name: str | None = None
    count: int = 1


# ------------------------------------------------------------------------------- adapter files


@pytest.mark.parametrize("name", ["megatron.yaml", "megatron-memory.yaml"])
def test_the_shipped_megatron_files_load_as_core_configs(name, monkeypatch):
    """Regression: ``cpuckpt convert --config configs/megatron.yaml`` failed with "unknown key 'megatron'".
    The core leaves the adapter's block to the adapter; the core sections still apply."""
    path = REPO / "configs" / name
    data = yaml.safe_load(path.read_text())
    assert "megatron" in data
    cfg = Config.from_yaml(path, env=False)
    core = {k: v for k, v in data.items() if k != "megatron"}
    assert cfg == Config.from_dict(core, env=False) and cfg.io.threads == data["io"]["threads"]
    monkeypatch.setenv("CPUCKPT_MEGATRON_ON_FAILURE", "continue")  # the adapter's variables stay the adapter's
    assert Config.from_yaml(path) == cfg


def test_megatron_block_is_left_to_the_adapter_but_other_unknown_sections_are_errors():
    cfg = Config.from_dict({"megatron": {"on_failure": "continue", "whatever": 1}, "io": {"threads": 3}}, env=False)
    assert cfg.io.threads == 3
    with pytest.raises(ConfigError, match=r"unknown key 'deepspeed'"):
        Config.from_dict({"deepspeed": {}}, env=False)
    with pytest.raises(ConfigError, match=r"unknown key 'on_failure'"):  # the adapter's key outside its block
        Config.from_dict({"on_failure": "raise"}, env=False)
    with pytest.raises(ConfigError, match=r"unknown key 'io\.megatron'"):  # a top-level section only
        Config.from_dict({"io": {"megatron": {}}}, env=False)


@pytest.mark.parametrize("env", [True, False])
def test_the_shipped_deepspeed_file_is_refused_with_a_message_saying_why(env):
    """configs/deepspeed.yaml keeps the adapter's keys at the top level (``async: true`` is not the core
    ``async:`` section), so the core cannot read around them: it says what the file is and what to give."""
    path = REPO / "configs" / "deepspeed.yaml"
    with pytest.raises(ConfigError) as ei:
        Config.from_yaml(path, env=env)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: async: true is a key of the DeepSpeed adapter's settings"), msg
    assert "cpuckpt.integrations.deepspeed" in msg and "configs/default.yaml" in msg, msg
