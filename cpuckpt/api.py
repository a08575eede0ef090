"""``save``, ``load``, ``prepare_pool`` (also in the background): sugar over ``dcp.save``/``dcp.load``.

Checkpoint collectives run on a dedicated gloo group (``backend.collectives``). DCP's
``CheckpointException`` derives from ``BaseException``; these functions raise the same
:class:`CpuckptError` on every rank instead (see :func:`cpuckpt.errors.rank_error`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpuckpt.backend import collectives, fastload
from cpuckpt.backend.reader import StorageReader
from cpuckpt.backend.telemetry import record_load, record_save
from cpuckpt.backend.writer import StorageWriter
from cpuckpt.background import gc_paused
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import ConfigError, is_interrupt
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.roots import after_commit, loading
from cpuckpt.transfer.pacing import PACER
from cpuckpt.transfer.staging import caller_device, get_pool

__all__ = ["PoolPreparation", "load", "prepare_pool", "prepare_pool_in_background", "save", "tick"]

logger = logging.getLogger(__name__)

def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    step: int | None = None,
    process_group: Any = None,
    planner: Any = None,
) -> None:
    """Save ``state_dict`` (DTensors, ShardedTensors, tensors on any device, other objects) to ``path``.

    Every rank calls it. Files are stock DCP-compatible; ``path/.metadata`` appears only once every
    rank's files are durable.

    Args:
        state_dict: what to save, as for ``dcp.save``.
        path: checkpoint directory, or ``s3://bucket/prefix`` (object storage: the ``s3`` config section and
            the AWS conventions; a prefix holding a committed checkpoint is refused, see ``backend.s3commit``).
        config: a :class:`Config`, a YAML path, a dict, or None.
        step: training step, recorded in the manifest.
        process_group: the trainer's group; checkpoint collectives use a gloo group over its ranks.
        planner: a DCP ``SavePlanner`` (default: DCP's default planner).

    Raises:
        CpuckptError: any rank failed; the message names the rank and the cause (``StorageIOError``, an
            ``OSError`` with errno and path, when the cause was one: also a directory that cannot be created).
        ConfigError: ``path`` is a URL other than ``s3://`` (nothing is created).
        KeyboardInterrupt: Ctrl-C, as itself (never a ``CpuckptError``); the save's threads stop and
            ``path`` is left without ``.metadata``.

    Example:
        >>> cpuckpt.save({"model": model.state_dict()}, "/ckpt/step_100", step=100)
    """
    path = checkpoint_path(path, "save: checkpoint path")  # another URL is refused before anything is created
    t0 = time.perf_counter()
    writer: StorageWriter | None = None
    with collectives.one_contract(f"save of {path}", lambda: writer.rank if writer is not None else 0):
        writer = StorageWriter(path, config, step=step)
        group = collectives.checkpoint_group(process_group, writer.config.timeout_s)
        try:
            collectives.run_dcp(
                lambda: collectives.dcp_save(state_dict, writer, planner=planner, process_group=group),
                "save", path, rank=dist.get_rank(group) if group is not None else 0)
        except BaseException as e:
            if is_interrupt(e):  # Ctrl-C: no writer thread goes on; `.metadata` is never written
                writer.cancel(e)
            raise
        elapsed = time.perf_counter() - t0
        record_save(writer.config, path=path, rank=writer.rank, step=step, stall_s=elapsed, persist_s=elapsed,
                    nbytes=writer.last_write_nbytes, mode="streaming",
                    files=len(writer.job.names) if writer.job else 0)
        if writer.is_coordinator:
            after_commit(path, writer.config)  # `latest`, cleaning, retention: only when configured


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    process_group: Any = None,
    planner: Any = None,
    storage_reader: StorageReader | None = None,
) -> None:
    """Load ``path`` in place into ``state_dict`` (resharding as needed), like ``dcp.load``.

    Reads cpuckpt checkpoints (verifying checksums when configured) and stock DCP checkpoints. When
    no planner (or DCP's ``DefaultLoadPlanner``) is given and every value is a plain tensor saved
    whole with its shape (or a non-tensor), DCP's planning is skipped with the same result
    (``backend.fastload``); ``storage_reader.last_stats.fast_path`` says which way a load went.

    Args:
        storage_reader: a :class:`StorageReader` of ``path`` to use (default: a new one); afterwards its
            ``metadata`` and read statistics (``last_read_s``, ``last_read_nbytes``, ``last_stats``) describe
            this load.

    Raises:
        CheckpointCorrupt: a file is missing, truncated or fails its checksum.
        IntegrityError: the checkpoint is not committed (no ``.metadata``).
        StorageIOError: a read failed (errno, path), ``.metadata`` included; the same error on every rank.
        ConfigError: ``path`` is a URL other than ``s3://``.
        KeyboardInterrupt: Ctrl-C, as itself; the reader threads stop.
    """
    path = checkpoint_path(path, "load: checkpoint path")
    t0 = time.perf_counter()
    rank = 0
    with collectives.one_contract(f"load of {path}", lambda: rank):
        reader = storage_reader if storage_reader is not None else StorageReader(path, config)
        if reader.path != (path if isinstance(path, S3Url) else Path(path)):
            raise ConfigError(f"load of {path}: storage_reader reads {reader.path}, not this checkpoint")
        # No cyclic GC inside a load: unpickling .metadata and planning allocate an object or more per item,
        # and a full collection they trigger costs more than the rest of a load from RAM.
        with gc_paused():
            group = collectives.checkpoint_group(process_group, reader.config.timeout_s)
            rank = dist.get_rank(group) if group is not None else 0
            # DCP (torch 2.13) swallows read_metadata's exception and raises a bare AssertionError
            # ("metadata is None; ..."), so an uncommitted checkpoint is reported here. Every rank agrees
            # first (one all-reduce): a rank that cannot read it must not leave its peers in DCP's collectives.
            metadata, error = None, None
            try:
                metadata = reader.load_metadata()
            except Exception as e:
                error = e
            collectives.agree_or_raise(error, rank, group, f"load of {path}")
            reader.use_metadata(metadata)
            metadata_s = time.perf_counter() - t0
            with loading(path):  # retention never deletes a checkpoint while it is being loaded
                # DCP's load, or its result without DCP's planner where that is provably the same (fastload)
                collectives.run_dcp(lambda: fastload.load(state_dict, reader, metadata, planner=planner,
                                                          process_group=group), "load", path, rank=rank)
    record_load(reader.config, path=path, rank=rank, seconds=time.perf_counter() - t0,
                nbytes=reader.last_read_nbytes, files=len({getattr(s, "relative_path", None)
                                                           for s in reader.storage_data.values()}),
                metadata_s=metadata_s, read_s=reader.last_read_s, read_io_s=reader.last_stats.io_s,
                read_copy_s=reader.last_stats.finish_s)


def prepare_pool(nbytes: int, config: Config | str | os.PathLike | dict | None = None) -> None:
    """Create, pre-touch and pin this process's host pool now, sized for a shard of ``nbytes``.

    Call it at start-up so that the first snapshot-mode ``async_save`` does not pay for fresh
    memory (~0.4 s/GiB on the lent VM) or for pinning it.
    """
    cfg = resolve_config(config)
    chunk = cfg.io.chunk_bytes
    # Records add ~2 KB each and large tensors are aligned: leave a few chunks of slack.
    nslots = -(-nbytes // chunk) + max(4, nbytes // chunk // 64)
    get_pool(chunk, max(nslots, cfg.staging.pool_bytes // chunk), pin=cfg.staging.pin, pretouch=True)


class PoolPreparation:
    """:func:`prepare_pool` running on a background thread (made by :func:`prepare_pool_in_background`).

    ``nbytes`` is what it prepares for; ``seconds`` how long that took and ``error`` why it failed
    (None until then, or when it did not fail). A failure is logged, never raised: the first save
    then makes the pool itself.
    """

    def __init__(self, nbytes: int, config: Config | str | os.PathLike | dict | None = None) -> None:
        self.nbytes = nbytes
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._config = config
        device = caller_device()
        # not a daemon: a daemon thread inside a torch call that released the GIL (pinning) when the interpreter
        # finalizes is ended in C++ and aborts the process ("terminate called without an active exception")
        self._thread = threading.Thread(target=self._run, args=(device,), name="cpuckpt-prepare-pool")
        self._thread.start()

    def _run(self, device: int | None) -> None:
        t0 = time.perf_counter()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # pin under the caller's device (its context), as a save would
            prepare_pool(self.nbytes, self._config)
        except Exception as e:
            self.error = e
            logger.warning("cpuckpt: preparing a host pool for %d bytes failed (the first save makes it): %s",
                           self.nbytes, e)
            return
        self.seconds = time.perf_counter() - t0
        logger.info("cpuckpt: host pool for %d bytes prepared in the background in %.2f s", self.nbytes, self.seconds)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> float:
        """Wait for the preparation (at most ``timeout`` s); returns the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join(timeout)
        return time.perf_counter() - t0


def prepare_pool_in_background(nbytes: int, config: Config | str | os.PathLike | dict | None = None
                               ) -> PoolPreparation:
    """:func:`prepare_pool` on a background thread, under the caller's CUDA device; returns at once.

    For adapters that learn a shard's size while training runs (after the first optimizer step). A save
    must :meth:`~PoolPreparation.join` a preparation still running before it takes the pool: the
    preparation may replace a smaller idle pool, and a save must never hold the pool it replaces.
    """
    return PoolPreparation(nbytes, config)


def tick() -> None:
    """Enqueue the next piece of the pending saves' device-to-host copies, if the piece before it is done.

    Saves with ``staging.d2h_window_bytes`` (both adapters' ``ordering: optimizer``) enqueue their copies in
    pieces from the trainer's own thread (:mod:`cpuckpt.transfer.pacing`): at every module's forward and at
    the gradients of the modules' outputs, so a trainer's ``.item()`` never waits behind more than one piece.
    A loop that runs no ``torch.nn.Module`` calls this at its own natural points (between layers); whatever
    is left goes at ``handle.wait_stream()``. Cheap when nothing is pending. ::

        handle = cpuckpt.async_save(state, path, {"staging": {"d2h_window_bytes": 64 << 20}}, ordering="stream")
        for layer in layers:
            x = layer(x)
            cpuckpt.tick()
        handle.wait_stream()  # GPU-side: the step's kernels wait for the copies
        optimizer.step()
    """
    PACER.tick()


_MOVED_TO_COLLECTIVES = ("checkpoint_group", "dcp_save", "new_gloo_group", "resolve_stateful")


def __getattr__(name: str) -> Any:
    # One-release aliases: these lived here in cpuckpt 0.1.0 and moved to backend.collectives.
    if name in _MOVED_TO_COLLECTIVES:
        import warnings

        warnings.warn(f"cpuckpt.api.{name} moved to cpuckpt.backend.collectives.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(collectives, name)
    raise AttributeError(f"module 'cpuckpt.api' has no attribute {name!r}")
