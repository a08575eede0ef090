"""Configuration: one frozen dataclass tree, loaded from YAML, dicts and environment overrides.

Pure: no I/O besides reading the YAML file it is pointed at. Validation is strict: an unknown key,
a wrong type or an impossible value raises :class:`ConfigError` naming the key and the source.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cpuckpt.errors import ConfigError
from cpuckpt.paths import local_path

__all__ = [
    "ADAPTER_SECTIONS",
    "REMOVED_KEYS",
    "AsyncConfig",
    "CheckpointConfig",
    "Config",
    "IOConfig",
    "IntegrityConfig",
    "LayoutConfig",
    "S3Config",
    "StagingConfig",
    "TelemetryConfig",
    "build_options",
    "load_yaml_mapping",
    "overlap_window",
    "parse_bytes",
    "resolve_config",
]

_KiB = 1024
_MiB = 1024 * _KiB
_GiB = 1024 * _MiB
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": _KiB,
    "m": 1000**2, "mb": 1000**2, "mib": _MiB,
    "g": 1000**3, "gb": 1000**3, "gib": _GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024 * _GiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """Parse a byte count: an int, or a string such as ``"32MiB"``, ``"1.5GB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"expected a byte count such as 4096 or '32MiB', got {value!r}")


# The longest wait a seconds key may ask for (~3 years): Queue.get, Event.wait and socket timeouts refuse more than
# threading.TIMEOUT_MAX (OverflowError "timestamp out of range for platform time_t" at the first load that
# waits), and gloo's and TCPStore's timeouts, counted in ns, overflow well below it (a wait failed at once).
MAX_WAIT_S = 1e8
# YAML 1.1's spellings of false: a key whose choices include "off" takes them (and an environment variable's
# text of them) as "off", as a YAML file's bare `off` is read.
_YAML_FALSE = frozenset({"n", "no", "false", "off"})
# A byte count must fit an off_t / ssize_t: a larger pool or chunk failed at the first save (OverflowError).
_MAX_BYTES = 2**63 - 1

# Top-level sections of the project's own adapter files that the core Config leaves to the adapter, so that
# one file serves both (configs/megatron.yaml's `megatron:` block, parsed by cpuckpt.integrations.megatron).
ADAPTER_SECTIONS: frozenset[str] = frozenset({"megatron"})


def _opt(default: Any, doc: str, **checks: Any) -> Any:
    """A config field with its one-line documentation and validation rules."""
    return field(default=default, metadata={"doc": doc, **checks})


# Keys that were deleted (issue 28), dotted -> what to do instead. A file, dict or environment variable
# that still sets one is told that it was removed, not that it is unknown: its author did nothing wrong.
# (A deleted value of a kept key is in that field's ``removed`` metadata.)
REMOVED_KEYS: dict[str, str] = {
    "io.files_per_rank": "cpuckpt writes one data file per rank; checkpoints written with several still load",
    "staging.mode": "the mode follows staging.pool_bytes: set pool_bytes: 0 for snapshot (the whole shard in "
                    "the pool), or a size smaller than the shard for streaming through a bounded pool",
    "staging.pretouch": "a pool is touched at creation, on many threads, exactly when it is pinned (staging.pin); "
                        "cpuckpt.prepare_pool touches one at start-up",
    "memory.writer_threads": "a writer process persists with io.threads threads (2 or 8 interfered with training "
                             "alike on the H200)",
    "memory.writer_nice": "writer processes run at the trainer's niceness (19 interfered with training as much "
                          "as 0 on the H200)",
}


@dataclass(frozen=True)
class IOConfig:
    """How bytes reach storage."""

    backend: str = _opt("auto", "File backend: auto (probe O_DIRECT), direct, buffered, or a registered name.")
    threads: int = _opt(4, "Writer threads per rank (and the stock-checkpoint reader's).", min=1, max=256)
    read_threads: int = _opt(16, "Reader threads per rank for cpuckpt checkpoints: a cold read waits on the disk, so "
                             "more reads in flight than writes help (H200: 16 reached the raw read, 8 did not).",
                             min=1, max=256)
    chunk_bytes: int = _opt(32 * _MiB, "Unit of staging, checksumming and pwrite; multiple of layout.align_bytes.",
                            size=True, min=4 * _KiB)
    fsync: bool = _opt(True, "fsync every file and the directory before a save is reported durable.")


@dataclass(frozen=True)
class LayoutConfig:
    """How records are placed in a file image."""

    align_bytes: int = _opt(4096, "Block alignment of chunks and O_DIRECT I/O (power of two).",
                            size=True, min=512, pow2=True)
    align_data_min_bytes: int = _opt(1 * _MiB, "Tensors at least this large start their data on an "
                                     "align_bytes boundary (padding is free at that size); 0 aligns none.",
                                     size=True, min=0)


@dataclass(frozen=True)
class IntegrityConfig:
    """Checksums written with every chunk and checked on load."""

    checksum: str = _opt("crc32c", "Checksum per chunk: crc32c or none.", choices=("crc32c", "none"))
    verify: str = _opt("always", "Verify checksums on load: always, sample (a random share of the chunks), or off.",
                       choices=("always", "sample", "off"))
    sample_fraction: float = _opt(0.1, "With verify: sample, the share of chunks checked on each load.", min=0.0,
                                  max=1.0)
    trusted: bool = _opt(False, "Unpickle non-tensor values with full pickle (it runs any code a checkpoint "
                         "names: only for checkpoints you wrote). Off: torch.load(weights_only=True) semantics "
                         "plus numpy arrays; other classes need torch.serialization.add_safe_globals.")


@dataclass(frozen=True)
class StagingConfig:
    """Host staging: the pool that tensors are copied into before they are written."""

    pool_bytes: int = _opt(0, "Host pool size; it also picks how async saves stage. 0: snapshot, the pool grows "
                           "to hold the shard of every save in flight. Smaller than shard x async.max_in_flight: "
                           "streaming through a pool of that size (at least 2 chunks per io thread), reused while "
                           "the files are written: host memory bounded, and the call waits until the last chunk "
                           "has a slot. At least that large: snapshot in a pool of that size. Synchronous saves "
                           "always stream through it (0: 2 chunks per io thread).", size=True, min=0)
    pin: bool = _opt(True, "Pin the pool with cudaHostRegister when CUDA is present (its pages are touched "
                     "first, on many threads: pinning would fault them in on one).")
    d2h_window_bytes: int = _opt(0, "Paced device-to-host copies (GPU sources, snapshot saves): pieces of this "
                                 "many bytes enqueued from the trainer's own thread (module forward hooks, the "
                                 "gradients of module outputs, cpuckpt.tick), one piece in flight at a time, the "
                                 "rest at the next wait_stream or optimizer step, so the trainer's own small "
                                 "copies (.item()) wait behind one piece at most; 0 enqueues a save's copies at "
                                 "once.", size=True, min=0)
    device_snapshot: bool = _opt(False, "Copy a snapshot save's GPU bytes into spare device memory first "
                                 "(device-to-device, at memory speed), then to the host from there: the GPU-side "
                                 "ordering of the trainer's next writes (ordering stream/optimizer) then waits for "
                                 "that copy only, not for PCIe. Costs device memory as large as those bytes, kept "
                                 "for later saves; where the GPU sums the memory checksums (memory.checksum_kind "
                                 "blocksum32, or auto where that adds at most a chunk per file and one more), as large "
                                 "as the save's files.")


@dataclass(frozen=True)
class AsyncConfig:
    """Background saves."""

    max_in_flight: int = _opt(1, "Saves allowed in flight; a further save waits for the oldest. Memory-tier saves "
                              "have their own bound: memory.max_uncommitted.", min=1, max=16)


@dataclass(frozen=True)
class CheckpointConfig:
    """What the coordinator does in the checkpoint's parent directory (the root) after a commit."""

    update_latest: bool = _opt(False, "After each commit, atomically point <root>/latest at the new checkpoint.")
    keep_last: int = _opt(0, "Retention: keep the N newest complete checkpoints in the root; 0 keeps all.",
                          min=0)
    keep_every: int = _opt(0, "Retention: also keep every checkpoint whose step is a multiple of K; 0 = none.",
                           min=0)
    clean_incomplete: bool = _opt(False, "After each commit, delete leftovers of crashed saves in the root.")
    sigterm_grace_s: float = _opt(30.0, "install_sigterm_handler(): how long SIGTERM waits for in-flight "
                                  "saves before the previous handler runs, seconds.", min=0.0,
                                  max=MAX_WAIT_S)


@dataclass(frozen=True)
class MemoryConfig:
    """The memory tier (``cpuckpt.tier``): checkpoints committed in a node-local RAM root as reused
    images, persisted to the durable root by a writer process."""

    root: str = _opt("", "RAM root directory; empty: /dev/shm/cpuckpt-<uid>/<job>.", path=True)
    job: str = _opt("", "Job identity of the RAM root, stable across restarts of the same job; empty: derived "
                    "from the durable root's absolute path. The RAM root records its durable root: a tier of "
                    "another durable root given the same job is refused.")
    slots: int = _opt(2, "Memory checkpoints kept in RAM (a ring of reused images, one shard per rank each).",
                      min=1, max=64)
    max_uncommitted: int = _opt(0, "Memory saves that may still be uncommitted when save() returns, that save "
                                "counted; a save first waits for older ones. 0: memory.slots - 1 (saves overlap, each "
                                "in its own slot, and one slot always holds a committed save). 1: save(step) returns "
                                "only once every older save is committed, so a job killed after it returned restarts "
                                "from step - 1 or newer (at most one step lost; needs slots >= 2). At most "
                                "max(1, slots - 1). The DeepSpeed adapter always waits for the previous commit at "
                                "the next save; also at the end of the step() after a save, so that save is committed "
                                "before the trainer logs that step: with 1 always, otherwise where that save came "
                                "one step after the one before it (saves every iteration: the next save would wait "
                                "anyway; not the engine's first save, nor saves further apart), not with its pipeline "
                                "engine (it calls no step()). With Megatron-LM (a queue cpuckpt "
                                "watches) setting 1 also finalizes each memory save before the next iteration's log "
                                "line, so its tracker names N before N + 1 is logged, "
                                "except while a persistent save's persist is ahead in the queue or Megatron-LM's "
                                "logits saver carries the save's finalize (docs/ARCHITECTURE.md 6b); with any "
                                "setting it does so before each line Megatron-LM prints at a --log-interval above "
                                "one.",
                                min=0, max=63)
    persist_every: int = _opt(1, "Persist every K-th memory checkpoint to the durable root (1: all; 0: none).",
                              min=0)
    when_full: str = _opt("wait", "Every slot still held by a persist: wait for one, or disk (save to the durable "
                          "root instead).", choices=("wait", "disk"),
                          removed={"skip": "skipping a save breaks Megatron's contract, and its adapter refused it; "
                                   "use wait or disk"})
    headroom_bytes: int = _opt(1 << 30, "Free space the RAM filesystem must keep after the images are reserved "
                               "(NCCL, DataLoader shared memory).", size=True, min=0)
    on_writer_failure: str = _opt("raise", "A writer process found dead at a save: raise on every rank, or "
                                  "respawn it (what it owed is reported lost) and go on.",
                                  choices=("raise", "respawn"))
    checksum: bool = _opt(True, "Record a checksum per chunk of memory checkpoints (memory.checksum_kind; with "
                          "integrity.checksum: crc32c), "
                          "computed on worker threads after the copies, before the memory commit; loads verify "
                          "them per integrity.verify and the writer verifies them while persisting.")
    checksum_kind: str = _opt("auto", "What memory checkpoints' chunk checksums are: crc32c, blocksum32 (a "
                              "position-weighted sum of 32-bit words, docs/FORMAT.md), which a device snapshot copied "
                              "by the copy process gets from the GPU: one reduction over the snapshot (laid out as "
                              "the files are: GPU memory for the files' size), plus the bytes written on the host, "
                              "instead of a read of every image back on the host (a save every iteration read 4.7 GB "
                              "per iteration). Elsewhere the host sums whole chunks, at about half crc32c's speed. "
                              "Weaker than crc32c against some multi-bit changes (docs/FORMAT.md). Persists still "
                              "write crc32c. auto (the default): blocksum32 for a save whose device bytes the GPU "
                              "sums that way where the files take at most a chunk per file and one more of GPU "
                              "memory than the device bytes, crc32c for every other (a "
                              "DeepSpeed save every iteration: 190 against 334 ms per save; Megatron-LM's: within "
                              "the noise; BENCHMARKS.md, session 43).",
                              choices=("crc32c", "blocksum32", "auto"))
    copy_process: bool = _opt(False, "Compute memory saves' checksums, and with staging.device_snapshot copy their GPU "
                              "bytes from the snapshot over CUDA IPC, in a process of ours per rank (started with the "
                              "tier), so none of that work runs in the trainer's process.")
    prepare_slots: bool = _opt(True, "After the first save, reserve, map and pin the other slots' images to the same "
                               "sizes on a background thread, so no later save pays for it.")
    replicas: int = _opt(0, "Copy each memory checkpoint to this many partner nodes' RAM roots (the next nodes "
                         "in the sorted list of node identities), in the background, over TCP between the writer "
                         "processes; a node then holds (slots + replicas x slots) x shard. A restart restores a lost "
                         "node's slot from a replica instead of reading the durable root.", min=0, max=8)
    replica_host: str = _opt("", "Address this node's replica receiver listens on and partners connect to; empty: "
                             "the host name.")


@dataclass(frozen=True)
class TelemetryConfig:
    """Per-save/load telemetry records (see cpuckpt.backend.telemetry)."""

    file: str = _opt("", "Append one JSON line per save and load of cpuckpt.save/load/async_save and the memory "
                     "tier (not of dcp.save/dcp.load given cpuckpt's writer or reader) to this file; empty: log lines "
                     "only.",
                     path=True)


@dataclass(frozen=True)
class S3Config:
    """Object storage for ``s3://bucket/prefix`` checkpoint paths (see cpuckpt.transfer.objstore)."""

    endpoint_url: str = _opt("", "S3 endpoint, e.g. http://127.0.0.1:8333 for a local server; empty: the AWS "
                             "conventions (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS itself).")
    region: str = _opt("", "Region; empty: the AWS conventions (AWS_REGION, AWS_DEFAULT_REGION, the profile), "
                       "else us-east-1.")
    path_style: bool = _opt(True, "Path-style addressing (http://host/bucket/key), which S3-compatible servers "
                            "need; false: virtual-hosted style (http://bucket.host/key).")
    max_attempts: int = _opt(3, "Attempts per request, the first included (the client's retries with backoff, "
                             "throttling such as 503 SlowDown included: each throttled answer is logged, and "
                             "throttling that outlasts them is a StorageIOError saying so); retry n waits up to "
                             "min(2^(n-1), 20) s, and every save stays bounded by timeout_s.", min=1, max=20)
    connect_timeout_s: float = _opt(10.0, "Bound on opening one connection to the endpoint, seconds.",
                                    min=0.1, max=MAX_WAIT_S)
    read_timeout_s: float = _opt(60.0, "Bound on waiting for one response (or its next bytes), seconds.",
                                 min=0.1, max=MAX_WAIT_S)


@dataclass(frozen=True)
class Config:
    """Everything cpuckpt can be told. Defaults live here and are mirrored in configs/default.yaml."""

    io: IOConfig = field(default_factory=IOConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    s3: S3Config = field(default_factory=S3Config)
    timeout_s: float = _opt(600.0, "Bound on every wait (threads, peers, pool leases), seconds; also the timeout of "
                            "the gloo group cpuckpt creates for its collectives over a non-gloo (NCCL) trainer "
                            "group. Not bounded by it: collectives on a trainer group that is already gloo (that "
                            "group's own timeout), and on a gloo group first created by the DeepSpeed adapter's "
                            "commit or the Megatron load fallback (torch's default, 30 min); see "
                            "docs/ARCHITECTURE.md section 6.", min=0.001, max=MAX_WAIT_S)

    def __post_init__(self) -> None:
        if self.io.chunk_bytes % self.layout.align_bytes:
            raise ConfigError(
                f"io.chunk_bytes ({self.io.chunk_bytes}) must be a multiple of layout.align_bytes "
                f"({self.layout.align_bytes})"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, source: str = "<dict>", env: bool = True) -> Config:
        """Build a config from nested mappings, then apply ``CPUCKPT_<SECTION>_<KEY>`` overrides.

        The adapters' own top-level sections (:data:`ADAPTER_SECTIONS`: ``megatron``) are left out: their
        adapter reads and checks them, so configs/megatron.yaml also serves ``cpuckpt`` commands.

        Raises:
            ConfigError: naming the source, the dotted key and the bad value.
        """
        if env:
            warn_unknown_env(cls)
        if isinstance(data, Mapping):
            _refuse_deepspeed_file(data, source)
            data = {k: v for k, v in data.items() if k not in ADAPTER_SECTIONS}
        return build_options(cls, data, source=source, env_prefix="CPUCKPT_" if env else None)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, env: bool = True) -> Config:
        """Load a YAML file (see configs/default.yaml for every key).

        Raises:
            ConfigError: the file is missing, not YAML, or holds a bad key or value.
        """
        return cls.from_dict(load_yaml_mapping(path), source=str(path), env=env)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with YAML key names (``async`` rather than ``async_``)."""
        return _to_dict(self)


def _refuse_deepspeed_file(data: Mapping[str, Any], source: str) -> None:
    """A DeepSpeed adapter file (configs/deepspeed.yaml) sets ``async: true``: its own keys sit at the top level,
    and its ``async`` is not the core ``async:`` section, so the core cannot read around them as it does for a
    ``megatron:`` block. Say so, rather than "async must be a mapping" or "unknown key 'background_commit'"."""
    if isinstance(data.get("async"), bool):
        raise ConfigError(
            f"{source}: async: {str(data['async']).lower()} is a key of the DeepSpeed adapter's settings "
            f"(configs/deepspeed.yaml), which only cpuckpt.integrations.deepspeed reads; give cpuckpt a file with the "
            f"core sections only (configs/default.yaml), where async is a section (async: {{max_in_flight: 1}})")


T = typing.TypeVar("T")


def warn_unknown_scoped_env(cls: type, env_prefix: str, scope: str) -> list[str]:
    """:func:`warn_unknown_env` for an adapter's own variables: those starting with ``scope``
    (``CPUCKPT_DEEPSPEED_``, ``CPUCKPT_MEGATRON_``) that match no key of ``cls`` read with ``env_prefix``."""
    known = set(_env_names(cls, env_prefix))
    warned = []
    for name in sorted(os.environ):
        if not name.startswith(scope) or name in known or name in _warned_env:
            continue
        _warned_env.add(name)
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(f"environment variable {name} matches no key of the adapter's settings and is ignored{hint}",
                      UserWarning, stacklevel=3)
        warned.append(name)
    return warned


def build_options(cls: type[T], data: Mapping[str, Any] | None, *, source: str = "<dict>",
                  env_prefix: str | None = "CPUCKPT_") -> T:
    """Build the frozen dataclass tree ``cls`` from nested mappings, as :meth:`Config.from_dict` does.

    Fields declare their checks in their metadata (``doc``, ``min``, ``max``, ``size``, ``pow2``,
    ``choices``, ``removed`` for deleted choices (value -> what to use instead), ``path`` for a local
    path that refuses URLs, ``key`` for a YAML name that is not the field's); a field whose type is a dataclass
    is a section. Unknown keys and bad values raise :class:`ConfigError` naming ``source`` and the
    dotted key. With ``env_prefix``, ``<env_prefix><SECTION>_<KEY>`` (``<env_prefix><KEY>`` for
    top-level keys) environment variables override ``data``: the text as it is for a string key, a YAML
    scalar for any other.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {data!r}")
    data = dict(data)
    from_env: dict[str, str] = {}
    if env_prefix is not None:
        data = _apply_env(cls, data, from_env, env_prefix, source)
    return _build(cls, data, source, prefix="", from_env=from_env)


def load_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping (an empty file is ``{}``).

    Raises:
        ConfigError: naming the file: missing or unreadable, not YAML, or not a mapping.
    """
    src = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{src}: cannot read config file: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{src}: not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{src}: top level must be a mapping of sections, got {type(data).__name__}")
    return dict(data)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[_key(f)] = _to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolving string annotations costs ~1 ms per class


def _build(cls: type, data: Mapping[str, Any], source: str, prefix: str,
           from_env: Mapping[str, str] | None = None) -> Any:
    hints = _type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    for k in data:
        if not isinstance(k, str):  # YAML reads `1:` or `true:` as a non-string key; sorted() would fail on it
            where = f"section {prefix[:-1]}" if prefix else "the top level"
            raise ConfigError(f"{source}: key {k!r} in {where} is not a name; known keys here: "
                              f"{', '.join(sorted(fields))}")
    unknown = sorted(set(data) - set(fields))
    for k in unknown:
        if f"{prefix}{k}" in REMOVED_KEYS:
            raise ConfigError(f"{source}: {prefix}{k} was removed ({REMOVED_KEYS[prefix + k]}); delete the key")
    if unknown:
        where = f"{prefix}{unknown[0]}"
        raise ConfigError(f"{source}: unknown key '{where}'; known keys here: {', '.join(sorted(fields))}")
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        if key not in data:
            continue
        dotted = f"{prefix}{key}"
        tp = hints[f.name]
        value = data[key]
        if dataclasses.is_dataclass(tp):
            if value is None:  # a section whose keys are all commented out
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {dotted} must be a mapping of keys, got {value!r}")
            kwargs[f.name] = _build(tp, value, source, prefix=f"{dotted}.", from_env=from_env)
        else:
            env_name = (from_env or {}).get(dotted)
            where = f"environment variable {env_name}" if env_name else source
            kwargs[f.name] = _check(dotted, tp, f.metadata, value, where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _check(dotted: str, tp: Any, meta: Mapping[str, Any], value: Any, source: str) -> Any:
    def bad(expect: str) -> ConfigError:
        return ConfigError(f"{source}: {dotted} must be {expect}, got {value!r}")

    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
    elif tp is int:
        if meta.get("size"):
            try:
                value = parse_bytes(value)
            except ValueError:
                raise bad("a byte count such as 4096 or '32MiB'") from None
            if value > _MAX_BYTES:
                raise bad(f"a byte count <= {_MAX_BYTES}")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"an int >= {meta.get('min', 0)}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        try:
            value = float(value)
        except OverflowError:  # an int past the largest double
            raise bad("a finite number") from None
        if not math.isfinite(value):  # NaN passes every range check; inf (.inf) overflows every wait
            raise bad("a finite number")
    elif tp is str:
        if "off" in meta.get("choices", ()) and (value is False or (
                isinstance(value, str) and value.lower() in _YAML_FALSE)):
            value = "off"  # YAML 1.1 reads a bare `off` (`no`, `false`) as false; an environment variable's text
        if not isinstance(value, str):
            raise bad("a string")
        if meta.get("path"):
            local_path(value, what=f"{source}: {dotted}")  # "s3://b/x" would become the local dir s3:/b/x
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise bad(f">= {lo}")
    if hi is not None and value > hi:
        raise bad(f"<= {hi}")
    if meta.get("pow2") and value & (value - 1):
        raise bad("a power of two")
    removed = meta.get("removed", {})
    if isinstance(value, str) and value in removed:
        raise ConfigError(f"{source}: {dotted}: {value} was removed ({removed[value]})")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise bad(f"one of {', '.join(choices)}")
    return value


def _apply_env(cls: type, data: dict[str, Any], from_env: dict[str, str], prefix: str = "CPUCKPT_",
               source: str = "<dict>") -> dict[str, Any]:
    """Overlay ``CPUCKPT_<SECTION>_<KEY>`` (or ``CPUCKPT_<KEY>`` for top-level keys): the text as it is for a
    string key, a YAML scalar for any other (see :func:`_env_value`).

    Records in ``from_env`` the dotted key -> variable name of every override, for error messages.
    """
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _key(f)
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            given = data.get(key)
            if given is not None and not isinstance(given, Mapping):  # `io: fast`: dict() would fail unnamed
                raise ConfigError(f"{source}: {key} must be a mapping of keys, got {given!r}")
            section = dict(given or {})
            section_hints = _type_hints(factory)
            for sf in dataclasses.fields(factory):
                name = f"{prefix}{key}_{sf.name}".upper()
                if name in os.environ:
                    section[sf.name] = _env_value(name, section_hints[sf.name])
                    from_env[f"{key}.{sf.name}"] = name
            if section:
                data[key] = section
        else:
            name = f"{prefix}{key}".upper()
            if name in os.environ:
                data[key] = _env_value(name, hints[f.name])
                from_env[key] = name
    return data


def _is_str(tp: Any) -> bool:
    """``str``, or a union holding it (``str | None``)."""
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp))


def _env_value(name: str, tp: Any) -> Any:
    """The override of variable ``name`` for a key of type ``tp``.

    A string key takes the text as it is: as YAML, ``CPUCKPT_MEMORY_JOB=12345`` was the int 12345,
    ``CPUCKPT_TELEMETRY_FILE=`` (empty: off, as documented) was None and ``CPUCKPT_MEMORY_REPLICA_HOST=on`` was
    True, each refused as "not a string". Other keys read a YAML scalar (``8``, ``false``, ``32MiB``).
    """
    if _is_str(tp):
        return os.environ[name]
    try:
        return yaml.safe_load(os.environ[name])
    except yaml.YAMLError as e:
        raise ConfigError(f"environment variable {name}: not a valid value: {e}") from e


# CPUCKPT_ variables that are not keys of Config: the adapters' own settings (their option trees read
# them), the test suite's and the benchmarks' switches. A misspelled key must not hide among them.
NOT_CONFIG_ENV_PREFIXES = ("CPUCKPT_MEGATRON_", "CPUCKPT_DEEPSPEED_", "CPUCKPT_TEST_", "CPUCKPT_BENCH_")
NOT_CONFIG_ENV = frozenset({"CPUCKPT_SWEEP_SEED", "CPUCKPT_LONG_SWEEP", "CPUCKPT_SLOW"})
_warned_env: set[str] = set()  # per process: an unknown CPUCKPT_* variable is warned about once


def _env_names(cls: type, prefix: str = "CPUCKPT_") -> list[str]:
    """Every override variable :func:`_apply_env` reads for ``cls``."""
    names = []
    for f in dataclasses.fields(cls):
        key = _key(f)
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            names += [f"{prefix}{key}_{sf.name}".upper() for sf in dataclasses.fields(factory)]
        else:
            names.append(f"{prefix}{key}".upper())
    return names


def warn_unknown_env(cls: type | None = None) -> list[str]:
    """Warn (once per process and variable) about ``CPUCKPT_*`` variables that match no key of ``cls``.

    A misspelled override (``CPUCKPT_IO_THREAD=8``) is otherwise ignored without a word. Returns the
    variables it warned about now.
    """
    known = set(_env_names(Config if cls is None else cls))
    warned = []
    for name in sorted(os.environ):
        if (not name.startswith("CPUCKPT_") or name in known or name in NOT_CONFIG_ENV
                or name.startswith(NOT_CONFIG_ENV_PREFIXES) or name in _warned_env):
            continue
        _warned_env.add(name)
        removed = [k for k in REMOVED_KEYS if f"CPUCKPT_{k.replace('.', '_')}".upper() == name]
        if removed:
            warnings.warn(f"environment variable {name} sets {removed[0]}, which was removed "
                          f"({REMOVED_KEYS[removed[0]]}), and is ignored", UserWarning, stacklevel=3)
            warned.append(name)
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(f"environment variable {name} matches no cpuckpt config key and is ignored{hint}; "
                      f"see docs/CONFIG.md for the names", UserWarning, stacklevel=3)
        warned.append(name)
    return warned


def resolve_config(config: Config | str | os.PathLike | dict | None) -> Config:
    """Accept a Config, a YAML path, a dict, or None (defaults plus environment overrides)."""
    if isinstance(config, Config):
        return config
    if config is None or isinstance(config, dict):
        return Config.from_dict(config)
    return Config.from_yaml(config)


OVERLAP_WINDOW_BYTES = 64 * _MiB


def overlap_window(core: Config) -> Config:
    """``core`` for saves whose copies overlap the next training step (the adapters' ``ordering: optimizer``):
    ``staging.d2h_window_bytes`` left 0 becomes 64 MiB: the copies are paced from the trainer's thread in
    pieces of that size (:mod:`cpuckpt.transfer.pacing`), so the trainer's own small device-to-host copies
    (``.item()``) wait behind one piece at most (~1.2 ms on the H200), not behind the whole save."""
    if core.staging.d2h_window_bytes:
        return core
    return dataclasses.replace(core, staging=dataclasses.replace(core.staging, d2h_window_bytes=OVERLAP_WINDOW_BYTES))
