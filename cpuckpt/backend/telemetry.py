"""Telemetry: one structured record per save and load. No threads; appends one line per event.

Each record is logged as one INFO line on the ``cpuckpt.telemetry`` logger and, when
``telemetry.file`` is set (or the environment variable ``CPUCKPT_TELEMETRY_FILE``, through the usual
config override), appended to that file as one JSON object per line. Lines from several ranks or
processes may share the file: each is written by a single ``write`` of an ``O_APPEND`` descriptor,
so lines do not interleave.

Record fields (JSON keys), all per rank:

- ``event``: ``"save"``, ``"async_save"`` or ``"load"``; ``path``, ``rank``, ``step`` (or null);
- ``stall_s``: how long the caller was blocked (the whole call for synchronous save/load; the
  staging wait for ``async_save``, or the call alone when nobody waited for staging, as with
  ``ordering="stream"``); ``call_s``: the ``async_save`` call itself (planning and enqueueing);
  ``persist_s``: until this rank's files were durable (save) or read (load); ``committed_s``:
  until committed on every rank (``async_save`` only, else equal to ``persist_s``);
- ``nbytes`` and ``gbps`` (``nbytes / persist_s / 1e9``); ``mode`` (staging mode); ``files``;
- ``pool_nbytes`` and ``pool_pinned``: this process's host pool when the record was made;
- ``unix_time``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field

from cpuckpt.config import Config
from cpuckpt.transfer.staging import pool_state

__all__ = ["TelemetryRecord", "record_load", "record_save"]

logger = logging.getLogger("cpuckpt.telemetry")  # the documented logger name


@dataclass
class TelemetryRecord:
    """One save or load of one rank (see the module docstring for each field)."""

    event: str
    path: str
    rank: int = 0
    step: int | None = None
    stall_s: float = 0.0
    persist_s: float = 0.0
    committed_s: float = 0.0
    call_s: float = 0.0  # async_save: the call itself (planning + enqueue)
    nbytes: int = 0
    gbps: float = 0.0
    mode: str = ""
    files: int = 0
    pool_nbytes: int = 0
    pool_pinned: bool = False
    metadata_s: float = 0.0  # loads: reading and unpickling .metadata
    plan_s: float = 0.0  # loads: DCP's load planning and its collectives
    read_s: float = 0.0  # loads: reads, checksums, copies into the targets (H2D included)
    read_io_s: float = 0.0  # loads: of read_s, the parallel reads (with checksums and H2D of chunks)
    read_copy_s: float = 0.0  # loads: of read_s, bounce buffers copied into targets on the caller's thread
    unix_time: float = field(default_factory=time.time)


def record_save(config: Config, *, path: str | os.PathLike, rank: int = 0, step: int | None = None,
                stall_s: float, persist_s: float, nbytes: int, mode: str = "", files: int = 0,
                committed_s: float | None = None, event: str = "save", call_s: float = 0.0) -> TelemetryRecord:
    """Log (and, if configured, append as JSON) one save of this rank.

    Called by the core after a save is durable (synchronous ``save``) or committed (``async_save``).
    Never raises for a telemetry problem: a failing telemetry file is logged as a warning, because a
    checkpoint must not fail for its statistics.

    Returns:
        The record that was emitted.
    """
    rec = _make(event, path, rank, step, stall_s, persist_s, nbytes, mode, files, committed_s)
    rec.call_s = round(call_s, 6)
    _emit(rec, config)
    return rec


def record_load(config: Config, *, path: str | os.PathLike, rank: int = 0, seconds: float, nbytes: int,
                files: int = 0, metadata_s: float = 0.0, read_s: float = 0.0, read_io_s: float = 0.0,
                read_copy_s: float = 0.0) -> TelemetryRecord:
    """Log (and, if configured, append as JSON) one load of this rank; the caller was blocked throughout.

    ``seconds`` splits into ``metadata_s``, ``read_s`` and the rest, recorded as ``plan_s`` (DCP's planning).
    """
    rec = _make("load", path, rank, None, seconds, seconds, nbytes, "", files, None)
    rec.metadata_s, rec.read_s = round(metadata_s, 6), round(read_s, 6)
    rec.read_io_s, rec.read_copy_s = round(read_io_s, 6), round(read_copy_s, 6)
    rec.plan_s = round(max(0.0, seconds - metadata_s - read_s), 6)
    _emit(rec, config)
    return rec


def _make(event: str, path: str | os.PathLike, rank: int, step: int | None, stall_s: float, persist_s: float,
          nbytes: int, mode: str, files: int, committed_s: float | None) -> TelemetryRecord:
    pool_nbytes, pinned = pool_state()
    return TelemetryRecord(
        event=event, path=str(path), rank=rank, step=step, stall_s=round(stall_s, 6),
        persist_s=round(persist_s, 6), committed_s=round(persist_s if committed_s is None else committed_s, 6),
        nbytes=nbytes, gbps=round(nbytes / persist_s / 1e9, 4) if persist_s > 0 else 0.0, mode=mode, files=files,
        pool_nbytes=pool_nbytes, pool_pinned=pinned,
    )


def _emit(rec: TelemetryRecord, config: Config) -> None:
    phases = (f" (metadata {rec.metadata_s:.3f} s, planning {rec.plan_s:.3f} s, reads {rec.read_s:.3f} s: "
              f"parallel reads {rec.read_io_s:.3f} s, copies into targets {rec.read_copy_s:.3f} s)"
              if rec.event == "load" else "")
    logger.info(
        "cpuckpt %s %s rank %d: stall %.3f s, persist %.3f s%s, %d bytes, %.2f GB/s, mode %s, %d file(s), "
        "pool %d bytes%s", rec.event, rec.path, rec.rank, rec.stall_s, rec.persist_s, phases, rec.nbytes, rec.gbps,
        rec.mode or "-", rec.files, rec.pool_nbytes, " pinned" if rec.pool_pinned else "",
    )
    target = config.telemetry.file
    if not target:
        return
    line = (json.dumps(dataclasses.asdict(rec), sort_keys=True) + "\n").encode()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        logger.warning("telemetry.file %s: cannot append the %s record (%s); set telemetry.file to a writable "
                       "path or to '' to turn it off", target, rec.event, e.strerror or e)


