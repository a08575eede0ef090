"""The ``cpuckpt`` command line: ls, inspect, verify, convert, clean, bench, demo. Front end only.

The work is done by :mod:`cpuckpt.tools.catalog` (ls, inspect), :mod:`cpuckpt.tools.verification` (verify),
:mod:`cpuckpt.tools.export` (convert), :mod:`cpuckpt.roots`, :mod:`cpuckpt.tier.tagmarker` (DeepSpeed tags) and
:mod:`cpuckpt.tier.ramroot` (clean); this module parses arguments, configures logging (the only place in cpuckpt
that adds handlers), prints, and maps outcomes to exit codes:

- 0: success (``verify``: every byte checked and sound);
- 1: ``verify`` found damage;
- 2: the command could not run (not a checkpoint, incomplete, bad arguments, missing source tree);
- 3: ``verify`` found no damage, but some contents could not be checked (files saved with
  ``integrity.checksum: none``): not "every byte checked";
- 130: interrupted (Ctrl-C): nothing was decided.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import click

from cpuckpt.config import parse_bytes
from cpuckpt.errors import CpuckptError

__all__ = ["cli", "main"]

logger = logging.getLogger(__name__)

_EXIT_DAMAGED = 1
_EXIT_ERROR = 2
_EXIT_UNVERIFIED = 3
_EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _human_bytes(n: int) -> str:
    if n < 0:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _step_text(info: Any, mark: str = "") -> str:
    """A listed checkpoint's step; one taken from its name (none recorded) marked, or said so."""
    if info.step is None:
        return "-"
    if not info.step_from_name:
        return str(info.step)
    return f"{mark}{info.step}" if mark else f"{info.step} (the last number in its name: it records none)"


def _fail(message: str) -> None:
    click.echo(f"cpuckpt: error: {message}", err=True)
    sys.exit(_EXIT_ERROR)


class _LocalPath(click.Path):
    """``click.Path`` that first refuses a URL (``s3://...``) in one line, before any existence check."""

    def __init__(self, what: str, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **kwargs)
        self.what = what

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from cpuckpt.errors import ConfigError
        from cpuckpt.paths import local_path

        try:
            local_path(value, self.what)
        except ConfigError as e:
            _fail(str(e))
        return super().convert(value, param, ctx)


class _CheckpointPath(_LocalPath):
    """A local directory (``click.Path`` checks) or an ``s3://bucket/prefix`` (an ``S3Url``, checked by the command
    that uses it); any other URL is refused in one line."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from cpuckpt.errors import ConfigError
        from cpuckpt.paths import checkpoint_path, is_s3

        if isinstance(value, str) and is_s3(value):
            try:
                return checkpoint_path(value, self.what)
            except ConfigError as e:
                _fail(str(e))
        return super().convert(value, param, ctx)


class _Bytes(click.ParamType):
    name = "bytes"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            return parse_bytes(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="-v: INFO log lines (telemetry), -vv: DEBUG.")
@click.version_option(package_name="cpuckpt", prog_name="cpuckpt")
def cli(verbose: int) -> None:
    """cpuckpt: list, inspect, verify, convert and clean checkpoints; run the benchmark and the demo."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # DCP warns once per load that it runs without a process group; that is the CLI's normal case.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@cli.command("ls")
@click.argument("root", type=_CheckpointPath("checkpoint root", file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per checkpoint.")
@click.option("--verify", is_flag=True,
              help="Read every byte of each complete checkpoint and check it (its chunk checksums); damaged ones "
                   "are marked and the latest is the newest that verifies (the one cpuckpt.load_latest loads); "
                   "exit code 1 when one is damaged.")
def ls_cmd(root: Any, as_json: bool, verify: bool) -> None:
    """List the checkpoints in ROOT: step, size, status, age; the latest is marked.

    Recognises cpuckpt, stock DCP, Megatron (metadata.json) and DeepSpeed (*_model_states.pt) checkpoint
    directories, and cpuckpt and DCP checkpoints under an s3:// root. ROOT may also be a checkpoint directory
    itself. Order and latest are find_latest's
    (step, then commit time); AGE is the time since the checkpoint was written (its manifest, else its
    commit), which loading it does not change. Without --verify, "complete" means committed with every
    file at its size; checksums are not read. STEP is the step the checkpoint records, or ~N (JSON:
    step_from_name), the last number in its name, where it records none (stock DCP, Megatron, DeepSpeed).
    """
    from cpuckpt.tools.catalog import scan_root

    try:
        found = scan_root(root, verify=verify)
    except (OSError, CpuckptError) as e:
        _fail(str(e))
    damaged = any(info.damaged for info in found)  # --verify found one: exit as `verify` does, so scripts can tell
    if as_json:
        for info in found:
            click.echo(json.dumps({"path": str(info.path), "kind": info.kind, "step": info.step,
                                   "step_from_name": info.step_from_name,
                                   "nbytes": info.nbytes, "status": info.status, "reason": info.reason,
                                   "age_s": round(info.age_s, 1), "latest": info.latest}))
        if damaged:
            sys.exit(_EXIT_DAMAGED)
        return
    if not found:
        click.echo(f"no checkpoints in {root}")
        return
    rows = [("NAME", "KIND", "STEP", "SIZE", "STATUS", "AGE", "")]
    for info in found:
        status = info.status if info.complete and not info.damaged else \
            f"{info.status} ({info.reason})" if info.reason else info.status
        rows.append((info.path.name if info.path != root else str(root), info.kind,
                     _step_text(info, "~"), _human_bytes(info.nbytes), status,
                     _human_age(info.age_s), "<- latest" if info.latest else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if damaged:
        sys.exit(_EXIT_DAMAGED)


@cli.command("inspect")
@click.argument("path", type=_CheckpointPath("checkpoint path", exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--tensors/--no-tensors", default=True, help="List every tensor (default) or only totals.")
def inspect_cmd(path: Any, as_json: bool, tensors: bool) -> None:
    """Show ranks, files, tensors, bytes, config, versions and timings of the checkpoint at PATH (a directory,
    or an s3:// prefix)."""
    from cpuckpt.tools.catalog import describe

    try:
        d = describe(path)
    except (OSError, CpuckptError) as e:
        _fail(str(e))
    m = d.manifest
    if as_json:
        click.echo(json.dumps({
            "path": str(path), "kind": d.info.kind, "status": d.info.status, "reason": d.info.reason,
            "step": d.info.step, "step_from_name": d.info.step_from_name, "ranks": d.ranks,
            "nbytes": d.info.nbytes, "files": d.files,
            "save_id": d.save_id, "dcp_version": d.dcp_version,
            "cpuckpt_version": m.cpuckpt_version if m else None, "torch_version": m.torch_version if m else None,
            "created_unix": m.created_unix if m else None, "timings": m.timings if m else {},
            "config": m.config if m else {}, "notes": d.notes,
            "tensors": [dataclasses.asdict(t) for t in d.tensors],
        }, indent=2, default=str))
        return
    tensor_bytes = sum(t.nbytes for t in d.tensors if t.dtype != "bytes")
    lines = [
        f"path:      {path}",
        f"kind:      {d.info.kind} ({d.info.status}{', ' + d.info.reason if d.info.reason else ''})",
        f"step:      {_step_text(d.info)}",
        f"ranks:     {'-' if d.ranks is None else d.ranks}",
        f"size:      {_human_bytes(d.info.nbytes)} on disk ({d.info.nbytes} bytes), "
        f"tensor data {_human_bytes(tensor_bytes)}",
    ]
    if d.save_id:
        lines.append(f"save id:   {d.save_id}")
    if m is not None:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix)) if m.created_unix else "-"
        lines.append(f"written:   {created} by cpuckpt {m.cpuckpt_version or '?'}, torch {m.torch_version or '?'} "
                     f"(manifest format {m.format_version}, DCP {d.dcp_version or '?'})")
        if m.timings:
            lines.append("timings:   " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(m.timings.items())))
    elif d.dcp_version:
        lines.append(f"written:   stock DCP (metadata version {d.dcp_version}); no cpuckpt manifest")
    lines.append(f"files:     {len(d.files)}")
    for name, nbytes in sorted(d.files.items()):
        extra = ""
        if m is not None and name in m.files:
            e = m.files[name]
            extra = f"  {len(e.chunk_checksums)} chunk(s) of {_human_bytes(e.chunk_bytes)}, {e.checksum}"
        lines.append(f"  {name}  {_human_bytes(nbytes)}{extra}")
    n_tensors = sum(1 for t in d.tensors if t.dtype != "bytes")
    lines.append(f"tensors:   {n_tensors}; other items: {len(d.tensors) - n_tensors}")
    if tensors and d.tensors:
        rows = [("NAME", "DTYPE", "SHAPE", "SHARDS", "BYTES")]
        rows += [(t.name, t.dtype, "x".join(map(str, t.shape)) if t.shape else "()", str(t.shards), str(t.nbytes))
                 for t in d.tensors]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if m is not None and m.config:
        lines.append("config:")
        for section, values in m.config.items():
            if isinstance(values, dict):
                lines.append(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
            else:
                lines.append(f"  {section}: {values}")
    lines += [f"note:      {n}" for n in d.notes]
    click.echo("\n".join(lines))


@cli.command("verify")
@click.argument("path", type=_CheckpointPath("checkpoint path", exists=True, file_okay=False))
def verify_cmd(path: Any) -> None:
    """Read every byte of the checkpoint at PATH (a directory, or an s3:// prefix) and check it.

    cpuckpt checkpoints: every chunk's checksum (crc32c or blocksum32) against the manifest, file sizes, record
    bounds. DeepSpeed tags written by cpuckpt's engine: every file's size and chunks' checksums against the tag's
    marker.
    Stock DCP checkpoints: every record's zip CRCs, and every tensor record must load. Exit code 1
    names each damaged file and byte range; 2 means the checkpoint could not be checked at all; 3 that
    nothing was found damaged but some contents had nothing to be checked against (saved without checksums).
    """
    from tqdm import tqdm

    from cpuckpt.backend import s3commit
    from cpuckpt.backend.committed import read_manifest
    from cpuckpt.config import resolve_config
    from cpuckpt.paths import S3Url
    from cpuckpt.tools.verification import verify_checkpoint
    from cpuckpt.transfer.objstore import open_store

    try:
        if isinstance(path, S3Url):
            manifest = s3commit.read_manifest(open_store(resolve_config(None).s3, threads=1), path)
        else:
            manifest = read_manifest(path)
        total = sum(e.nbytes for e in manifest.files.values()) if manifest is not None else None
        # disable=None: a bar on a terminal, nothing when stderr is a pipe or a file
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", disable=None,
                  file=sys.stderr, leave=False) as bar:
            report = verify_checkpoint(path, progress=bar.update)
    except (CpuckptError, OSError) as e:
        _fail(f"cannot verify: {e}")
    for note in report.notes:
        click.echo(f"note: {note}")
    for damage in report.damage:
        click.echo(f"DAMAGED {path / damage.file}: {damage.where}{damage.what}")
    what = "record(s)" if report.kind == "dcp" else "chunk(s)"
    if report.ok and report.unverified:
        click.echo(f"UNVERIFIED {path}: no damage in {report.chunks} {what} ({report.nbytes} bytes) checked, but "
                   f"{len(report.unverified)} file(s) or record(s) carry nothing to check their contents against")
        sys.exit(_EXIT_UNVERIFIED)
    if report.ok:
        click.echo(f"OK {path}: {report.files} file(s), {report.chunks} {what}, {report.nbytes} bytes verified")
        return
    click.echo(f"FAILED {path}: {len(report.damage)} problem(s) in {report.files} file(s)")
    sys.exit(_EXIT_DAMAGED)


@cli.command("convert")
@click.argument("path", type=_CheckpointPath("checkpoint path", exists=True, file_okay=False))
@click.argument("out", type=_CheckpointPath("output path"))
@click.option("--to", "fmt", type=click.Choice(["safetensors", "torch"]), required=True, help="Output format.")
@click.option("--max-shard-size", type=_Bytes(), default=None,
              help="Write HF-style shards of at most this size (e.g. 5GB) and an index into the directory OUT.")
@click.option("--memory-budget", type=_Bytes(), default="1GiB", show_default=True,
              help="Tensor bytes held in memory at once (a larger tensor is loaded alone).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="A cpuckpt YAML config for reading (threads, verification).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT (sharded: write into a non-empty OUT).")
@click.option("--tmp-dir", "staging_dir", type=_LocalPath("temporary directory", exists=True, file_okay=False),
              default=None, help="Where an s3:// OUT's files are written before their upload (one at a time; "
                                 "default $TMPDIR).")
def convert_cmd(path: Any, out: Any, fmt: str, max_shard_size: int | None, memory_budget: int,
                config_path: str | None, overwrite: bool, staging_dir: Path | None) -> None:
    """Write the checkpoint at PATH as full (resharded) tensors to OUT, in safetensors or torch.save format.

    Streams: at most --memory-budget of tensor data is in memory at a time. Non-tensor items go to
    the safetensors metadata as JSON (or into the torch file); items that cannot are listed as skipped.
    OUT's parent directory must exist; an existing OUT is refused unless --overwrite.

    PATH may be an s3:// checkpoint prefix, OUT an s3:// object (with --max-shard-size, a prefix): each
    output file is written to --tmp-dir, uploaded as one multipart upload, then removed there.
    """
    from tqdm import tqdm

    from cpuckpt.tools.catalog import describe
    from cpuckpt.tools.export import export_checkpoint

    try:
        total = sum(t.nbytes for t in describe(path).tensors if t.dtype != "bytes")
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=None,
                  file=sys.stderr, leave=False) as bar:
            report = export_checkpoint(path, out, fmt=fmt, max_shard_bytes=max_shard_size,
                                       memory_budget_bytes=memory_budget, config=config_path, progress=bar.update,
                                       overwrite=overwrite, staging_dir=staging_dir)
    except (CpuckptError, OSError, ValueError) as e:
        _fail(f"cannot convert {path}: {e}")
    for f, nbytes in zip(report.files, report.sizes):
        click.echo(f"wrote {f} ({_human_bytes(nbytes)})")
    if report.index is not None:
        click.echo(f"wrote {report.index}")
    click.echo(f"{report.tensors} tensor(s), {report.nbytes} bytes of tensor data")
    for name in sorted(report.metadata):
        click.echo(f"kept {name}: {report.metadata[name]}")
    for name, why in sorted(report.skipped.items()):
        click.echo(f"skipped {name}: {why}")



@cli.command("clean")
@click.argument("root", required=False, type=_CheckpointPath("checkpoint root"))
@click.option("--ram", is_flag=True,
              help="Remove stale memory-tier RAM roots (no live trainer or writer) under ROOT, a RAM root or the "
                   "directory holding them; default /dev/shm/cpuckpt-<uid>. Without ROOT (or with ROOT /dev/shm) "
                   "also stale cpuckpt-* process files in /dev/shm (their owner pid gone on this host, or this "
                   "host's earlier boot; another host's once untouched for a day).")
@click.option("--min-age", "min_age", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Durable roots: remove only leftovers untouched this long. A live save touches its directory "
                   "at least once per timeout_s, so keep this >= the trainers' timeout_s; 0 also removes saves "
                   "that other processes are writing right now (with --deepspeed-tags a torn tag also needs a tag "
                   "committed after it).  [default: the default timeout_s, 600]")
@click.option("--deepspeed-tags", is_flag=True,
              help="Also remove torn DeepSpeed tags of cpuckpt's engine (.cpuckpt-saving, no marker) once a tag "
                   "was committed after their last change. Assumes ONE engine per save_dir: another engine's "
                   "pending tag (an EMA or reference engine that never calls step()) would be removed. --min-age "
                   "must exceed the longest persist of a memory-tier writer.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per removed path: path, kind (checkpoint: a torn checkpoint; leftover: a file "
                   "a save left, or a torn tag an interrupted clean moved aside; deepspeed-tag: a torn tag; "
                   "ram-root; process-file), removed (false with --dry-run).")
def clean_cmd(root: Any, ram: bool, min_age: float | None, deepspeed_tags: bool, dry_run: bool,
              as_json: bool) -> None:
    """Delete leftovers of crashed saves in the checkpoint root ROOT, or (--ram) stale RAM roots.

    ROOT: torn checkpoint directories (no valid commit) untouched for --min-age, *.tmp files, manifest
    parts and O_DIRECT probes inside complete checkpoints, and a stray latest.tmp; complete checkpoints and
    checkpoints being loaded stay. With --deepspeed-tags, in a DeepSpeed save_dir of one engine: tags of
    cpuckpt's engine that never committed (.cpuckpt-saving, no marker), untouched for --min-age, and only where
    another tag was committed after their last change (a tag waits for its commit until the engine's next
    step(), save or destroy(), however long; its engine commits in order); never a tag that latest names, one
    with a marker (committed, even if damaged since), one of stock DeepSpeed, one a memory tier's writer
    persists (its parts there, or its save id in .cpuckpt-saving), or latest itself. An s3:// ROOT: incomplete
    checkpoint prefixes, manifest parts and the multipart uploads of dead saves, untouched for --min-age.
    --ram: RAM roots whose trainer and writer locks
    are all free; live ones stay; and process files (``cpuckpt-<tag>-p<pid>-b<boot>-h<host>-n<pidns>-*``, e.g. the
    Megatron adapter's) of processes gone (a pid is asked about only on the boot, host and pid namespace that
    recorded it; a file of this host and another boot goes when modified before this boot started, any other once
    untouched for a day).

    --json kinds: ``checkpoint`` (a torn checkpoint directory or s3:// prefix), ``leftover`` (anything else a
    dead save or an interrupted clean left: *.tmp files, manifest parts, probes, latest.tmp, a dead save's
    multipart upload, a torn tag moved aside to .cpuckpt-removing-*), ``deepspeed-tag`` (a torn DeepSpeed tag),
    ``ram-root`` and ``process-file`` (--ram).
    """
    verb = "would remove" if dry_run else "removed"
    failed = ""
    files: list[Path] = []
    tags: list[Path] = []  # torn DeepSpeed tags
    from cpuckpt.paths import S3Url

    if ram and isinstance(root, S3Url):
        _fail(f"--ram cleans RAM roots; {root} is an object-storage root")
    if deepspeed_tags and (ram or isinstance(root, S3Url)):
        _fail("--deepspeed-tags cleans a local DeepSpeed save_dir, not RAM roots or an object-storage root")
    if ram:
        from cpuckpt import runfiles
        from cpuckpt.tier.ramroot import RamRootError, clean_ram_roots, default_root, is_shared_dir

        if min_age is not None:
            _fail("--min-age applies to checkpoint roots, not to --ram")
        base = root if root is not None else default_root("x").parent
        files_dir = base.parent if root is None else None
        if root is not None and is_shared_dir(root):  # /dev/shm itself: our directory and our files in it
            base, files_dir = root / f"cpuckpt-{os.geteuid()}", root
            click.echo(f"{root} is a shared system directory, not a RAM root: cleaning {base} and stale "
                       f"cpuckpt process files in {root}", err=True)
        try:
            removed = clean_ram_roots(root, dry_run=dry_run)
            if files_dir is not None:
                files = runfiles.clean_stale(files_dir, dry_run=dry_run)
        except (RamRootError, OSError) as e:  # a RamRootError's message names the offending path too
            _fail(f"cannot clean RAM roots under {base}: {e}")
        kind, what = "ram-root", "stale RAM root "
    else:
        from cpuckpt.config import Config
        from cpuckpt.roots import clean_incomplete

        if root is None:
            _fail("clean needs a checkpoint ROOT (or --ram for RAM roots)")
        if not isinstance(root, S3Url) and not root.is_dir():
            _fail(f"{root}: no such checkpoint root directory")
        min_age_s = Config().timeout_s if min_age is None else min_age
        try:
            removed = clean_incomplete(root, min_age_s=min_age_s, dry_run=dry_run)
        except (OSError, CpuckptError) as e:
            _fail(f"cannot clean {root}: {e}")
        if deepspeed_tags:
            from cpuckpt.tier.tagmarker import clean_torn_tags

            try:
                tags = clean_torn_tags(root, min_age_s=min_age_s, dry_run=dry_run)
            except (OSError, CpuckptError) as e:  # said after what was removed already
                failed = f"cannot clean the DeepSpeed tags of {root}: {e}"
        base, kind, what = root, "checkpoint", ""
    kinds = [_removed_kind(root, p) if kind == "checkpoint" else kind for p in removed]
    tag_kinds = ["leftover" if _moved_aside(p) else "deepspeed-tag" for p in tags]
    if as_json:
        for path, k in zip(removed, kinds):
            click.echo(json.dumps({"path": str(path), "kind": k, "removed": not dry_run}))
        for path, k in zip(tags, tag_kinds):
            click.echo(json.dumps({"path": str(path), "kind": k, "removed": not dry_run}))
        for path in files:
            click.echo(json.dumps({"path": str(path), "kind": "process-file", "removed": not dry_run}))
    else:
        for path in removed:
            click.echo(f"{verb} {what}{path}")
        for path, k in zip(tags, tag_kinds):
            click.echo(f"{verb} torn DeepSpeed tag {path}" if k == "deepspeed-tag" else
                       f"{verb} leftover of an interrupted clean {path}")
        for path in files:
            click.echo(f"{verb} stale process file {path}")
        if not removed and not tags and not files and not failed:
            click.echo(f"no stale RAM roots under {base}" if ram else f"nothing to clean in {base}")
    if failed:
        _fail(failed)


def _removed_kind(root: Any, path: Any) -> str:
    """``checkpoint`` for a checkpoint ``clean_incomplete`` removed (a directory, or s3:// prefix, directly under
    ``root``), ``leftover`` for anything else it removed (a file in a complete checkpoint, latest.tmp, a dead
    save's multipart upload): a consumer of --json must not take a leftover file for a checkpoint."""
    from cpuckpt.rootinfo import LATEST_NAME

    return "checkpoint" if path.parent == root and path.name != LATEST_NAME + ".tmp" else "leftover"


def _moved_aside(path: Path) -> bool:
    """A torn tag an interrupted clean moved aside (``.cpuckpt-removing-*``): a leftover, not a tag of the run."""
    from cpuckpt.rootinfo import REMOVING_PREFIX

    return path.name.startswith(REMOVING_PREFIX)


def _source_root(rel: str) -> Path:
    """The source tree holding ``rel``, a file that ships with it (not the wheel): the tree the package
    lies in (an editable install), or the current directory."""
    for base in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (base / rel).is_file():
            return base
    _fail(f"{rel} ships with the cpuckpt source tree, not with the installed package; run this command from a "
          "clone of the repository (or an editable install: pip install -e .)")
    raise AssertionError("unreachable")  # _fail exits


def _run_script(rel: str, args: tuple[str, ...]) -> None:
    script = _source_root(rel) / rel
    sys.stdout.flush()
    sys.exit(subprocess.call([sys.executable, str(script), *args]))


def _run_module(module: str, args: tuple[str, ...]) -> None:
    """``python -m module ARGS`` with the source tree's root on PYTHONPATH (the cwd stays, for relative paths)."""
    root = _source_root(module.replace(".", "/") + ".py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    sys.stdout.flush()
    sys.exit(subprocess.call([sys.executable, "-m", module, *args], env=env))


_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@cli.command("bench", context_settings=_PASS_THROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_cmd(args: tuple[str, ...]) -> None:
    """Run python -m benchmarks.bench_cpu with ARGS (e.g. --smoke; --help for its options)."""
    _run_module("benchmarks.bench_cpu", args)


@cli.command("demo", context_settings=_PASS_THROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo_cmd(args: tuple[str, ...]) -> None:
    """Run examples/demo.py with ARGS (e.g. --quick; --help for its options)."""
    _run_script("examples/demo.py", args)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``cpuckpt``). Click's own standalone mode would exit 1 on Ctrl-C, which is
    ``verify``'s "damaged": an interrupted check exits 130 instead, as a shell reports SIGINT."""
    try:
        code = cli.main(args=argv, prog_name="cpuckpt", standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C (click's form of KeyboardInterrupt) or end of input at a prompt
        click.echo("\nAborted!", err=True)
        return _EXIT_INTERRUPTED
    except click.ClickException as e:  # bad arguments: the usage message, exit 2
        e.show()
        return e.exit_code
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())

