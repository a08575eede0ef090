"""CPU benchmark of cpuckpt against the storage floor and DCP's FileSystemWriter/Reader.

One run, one process, one state dict; per target directory (tmpfs and/or local disk):

* raw floors: durable ``pwrite`` (1/2/4 threads x O_DIRECT and buffered + fsync) and ``pread`` of the
  same number of bytes (cold where the page cache can be dropped);
* saves: DCP ``FileSystemWriter`` (thread_count 1, 2, 8) and cpuckpt (default config, threads 1, 2, 8),
  every one durable (files and directory fsynced);
* loads: DCP ``FileSystemReader`` and cpuckpt (verify always / off), each before a dropped page cache,
  checked bit-exact against the source;
* 10,000 small tensors (all-same and all-distinct shapes): DCP planning alone (a do-nothing writer,
  driven by ``dcp.save`` and by cpuckpt.save's entry point), DCP ``FileSystemWriter`` and cpuckpt
  (for distinct shapes also with cpuckpt's record-skeleton cache cleared); cost per item beyond planning.

Before measuring a target, the state dict's size is written there once, untimed (``--no-warmup``
skips it): on the lent VMs memory never touched before costs ~0.4 s/GiB the first time.

Variants run one after another, repetitions interleaved (rep 1 of every variant, then rep 2, ...),
each output deleted before the next. Prints one table at the end (stdout); ``--json`` writes the raw
samples. Rules: /work/shared/BENCHMARKING.md (ratios within one run, medians of >= 3 with min-max).

Usage (from the repository root; ``cpuckpt bench ARGS`` runs the same):
    .venv/bin/python -m benchmarks.bench_cpu --gib 4 --targets shm,disk --disk-dir /work/bench-tmp \\
        --reps 3 --json bench-cpu.json
    .venv/bin/python -m benchmarks.bench_cpu --smoke      # seconds; exercises every path, asserts nothing
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import cpuckpt
from benchmarks import common
from benchmarks.common import GB, GiB, MiB, Sample, files_under, fresh, tree_nbytes

logger = logging.getLogger("bench_cpu")

FLOOR_THREADS = (1, 2, 4)
PLAN_DCP = "DCP planning only: dcp.save, null writer"
PLAN_CPUCKPT = "DCP planning only: cpuckpt.save's path, null writer"
DCP_SAVE_THREADS = (1, 2, 8)
CPUCKPT_SAVE_THREADS = (1, 2, 8)  # besides the default config (threads 4 in configs/default.yaml)


# --------------------------------------------------------------------------------- DCP helpers


class NullStorageWriter(StorageWriter):
    """A DCP StorageWriter that stores nothing: ``dcp.save`` with it costs DCP's planning alone.

    ``write_data`` neither resolves nor writes any item; it returns one empty ``WriteResult`` per
    planned item at once, and ``finish`` drops the metadata, so ``dcp.save`` completes normally.
    """

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items])
        return fut

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def dcp_save(sd: dict[str, Any], path: Path, thread_count: int) -> None:
    """Durable DCP save: ``FileSystemWriter`` (fsyncs files and .metadata) plus an fsync of the directory."""
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=thread_count))
    common.fsync_dir(path)


def dcp_load(sd: dict[str, Any], path: Path) -> None:
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))


def null_save(sd: dict[str, Any]) -> None:
    """DCP's planning as ``dcp.save`` does it (what a FileSystemWriter user pays besides writing)."""
    dcp.save(sd, storage_writer=NullStorageWriter())


def cpuckpt_null_save() -> Callable[[dict[str, Any]], None] | None:
    """DCP's planning as ``cpuckpt.save`` drives it (``collectives.dcp_save``), or None if it has no such hook.

    cpuckpt.save may skip parts of ``dcp.save`` (e.g. its per-key logging wrapper), so its cost per
    item is taken beyond this planning, not beyond ``dcp.save``'s.
    """
    import cpuckpt.backend.collectives as collectives

    hook = getattr(collectives, "dcp_save", None)
    if hook is None:
        return None
    return lambda sd: hook(sd, NullStorageWriter())


# ----------------------------------------------------------------------------------- utilities


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts; "?" if unknown)."""
    best, kind = "", "?"
    p = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1]
                    if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


class CacheControl:
    """Makes a target cold before a read: drop_caches, else fadvise(DONTNEED) on the files, else warm.

    ``mode``: "auto" (drop_caches, falling back to fadvise), "drop_caches", "fadvise" or "none".
    :meth:`cold` returns what was actually done, used as the "cache" label of the measurement.
    """

    def __init__(self, mode: str, tmpfs: bool) -> None:
        self.mode = mode
        self.tmpfs = tmpfs
        self._drop_ok: bool | None = None

    def cold(self, paths: list[Path]) -> str:
        if self.tmpfs:
            return "tmpfs (in RAM)"
        if self.mode in ("auto", "drop_caches") and self._drop_ok is not False:
            self._drop_ok = common.drop_caches()
            if self._drop_ok:
                return "cold (drop_caches)"
            logger.warning("drop_caches refused; %s", "falling back to fadvise" if self.mode == "auto" else "warm")
        if self.mode in ("auto", "fadvise") and common.evict_files([str(p) for p in paths]):
            return "cold (fadvise)"
        return "WARM"


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _fmt_range(s: dict[str, float], digits: int = 2) -> str:
    if not s or s.get("n", 0) == 0:
        return "-"
    if s["n"] == 1:
        return _fmt(s["median"], digits)
    return f"{_fmt(s['median'], digits)} ({_fmt(s['min'], digits)}-{_fmt(s['max'], digits)})"


# ------------------------------------------------------------------------------ the benchmark


class Bench:
    """Runs every measurement of one invocation and keeps the raw results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.reps = args.reps
        self.results: dict[str, Any] = {"meta": self._meta(), "targets": {}}
        self.failures: list[str] = []

    def _meta(self) -> dict[str, Any]:
        a = self.args
        env = {k: v for k, v in os.environ.items() if k.startswith("CPUCKPT_")}
        if env:
            logger.warning("CPUCKPT_* environment overrides are set and change cpuckpt's config: %s", env)
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "host": platform.node(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB RAM, "
                       f"kernel {platform.release()}, {_cpu_model()}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpuckpt": cpuckpt.__version__,
            "cpuckpt_default_config": cpuckpt.Config.from_dict(None).to_dict(),
            "cpuckpt_env_overrides": env,
            "gib": a.gib,
            "reps": a.reps,
            "small": a.small,
            "chunk_bytes_floor": a.floor_chunk_mib * MiB,
            "cache_drop": a.cache_drop,
        }

    # -- measurement primitives ---------------------------------------------------------------------
    def _measure(self, fn: Callable[[], Any]) -> Sample:
        common.release_memory()
        return common.measure(fn)

    def _record(self, table: dict[str, Any], name: str, sample: Sample, nbytes: int, **extra: Any) -> None:
        entry = table.setdefault(name, {"samples": [], "nbytes": nbytes})
        entry["samples"].append({**asdict(sample), **extra})

    # -- per target -------------------------------------------------------------------------------
    def run_target(self, name: str, root: Path, sd: dict[str, Any], dst: dict[str, Any] | None) -> None:
        run_dir = root / f"cpuckpt-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        run_dir.mkdir(parents=True)
        fstype = fs_type(run_dir)
        cache = CacheControl(self.args.cache_drop, tmpfs=fstype == "tmpfs")
        res: dict[str, Any] = {"dir": str(run_dir), "fstype": fstype, "floors": [], "saves": {}, "loads": {},
                               "small": {}}
        self.results["targets"][name] = res
        logger.info("target %s: %s (%s)", name, run_dir, fstype)
        try:
            nbytes = common.state_dict_nbytes(sd)
            if not self.args.no_warmup:
                with common.timed(f"warm-up write of {nbytes / GiB:.2f} GiB to {name} (untimed)"):
                    warm = run_dir / "warmup.bin"
                    common.pwrite_floor(warm, nbytes, 2, False, chunk_bytes=self.args.floor_chunk_mib * MiB)
                    fresh(warm)
            self._floors(res, run_dir, nbytes, cache)
            self._saves(res, run_dir, sd, nbytes)
            if dst is not None:
                self._loads(res, run_dir, sd, dst, nbytes, cache)
            self._small(res, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            common.release_memory()

    def _floors(self, res: dict[str, Any], run_dir: Path, nbytes: int, cache: CacheControl) -> None:
        path = run_dir / "floor.bin"
        chunk = self.args.floor_chunk_mib * MiB
        configs = [(direct, t) for direct in (True, False) for t in FLOOR_THREADS]
        skip: set[tuple[bool, int]] = set()
        for rep in range(self.reps):
            for direct, t in configs:
                if (direct, t) in skip:
                    continue
                fresh(path)
                common.release_memory()
                r = common.pwrite_floor(path, nbytes, t, direct, chunk_bytes=chunk)
                if not r.supported:
                    logger.warning("pwrite floor O_DIRECT unsupported in %s: %s", run_dir, r.error)
                    skip.add((direct, t))
                res["floors"].append({**r.to_dict(), "rep": rep})
                logger.info("floor pwrite %-8s x%d: %.2f GB/s", "O_DIRECT" if direct else "buffered", t, r.gbps)
        if not path.exists() or path.stat().st_size != nbytes:
            common.pwrite_floor(path, nbytes, 1, False, chunk_bytes=chunk)
        for rep in range(self.reps):
            for direct, t in configs:
                if (direct, t) in skip:
                    continue
                label = cache.cold([path])
                r = common.pread_floor(path, nbytes, t, direct, chunk_bytes=chunk)
                res["floors"].append({**r.to_dict(), "rep": rep, "cache": label})
                logger.info("floor pread  %-8s x%d: %.2f GB/s (%s)", "O_DIRECT" if direct else "buffered", t,
                            r.gbps, label)
        fresh(path)

    def _save_variants(self) -> list[tuple[str, str, Callable[[dict[str, Any], Path], None]]]:
        out: list[tuple[str, str, Callable[[dict[str, Any], Path], None]]] = []
        for t in DCP_SAVE_THREADS:
            out.append(("dcp", f"DCP FileSystemWriter thread_count={t}",
                        lambda sd, p, t=t: dcp_save(sd, p, t)))
        default_threads = cpuckpt.Config.from_dict(None).io.threads
        out.append(("cpuckpt", f"cpuckpt default (threads={default_threads})",
                    lambda sd, p: cpuckpt.save(sd, p)))
        for t in CPUCKPT_SAVE_THREADS:
            if t == default_threads:
                continue
            out.append(("cpuckpt", f"cpuckpt threads={t}",
                        lambda sd, p, t=t: cpuckpt.save(sd, p, config={"io": {"threads": t}})))
        return out

    def _saves(self, res: dict[str, Any], run_dir: Path, sd: dict[str, Any], nbytes: int) -> None:
        variants = self._save_variants()
        for rep in range(self.reps):
            for k, (peer, name, fn) in enumerate(variants):
                path = run_dir / f"save-{k}"
                try:
                    s = self._measure(lambda fn=fn, path=path: fn(sd, path))
                except Exception as e:
                    self._fail(f"{res['dir']}: {name} rep {rep}", e)
                    fresh(path)
                    continue
                self._record(res["saves"], name, s, nbytes, peer=peer, rep=rep, file_bytes=tree_nbytes(path),
                             files=len(files_under(path)))
                logger.info("save %-40s %.3f s  %.2f GB/s  cpu %.2f s  rss+ %.0f MiB", name, s.wall_s,
                            nbytes / s.wall_s / GB, s.cpu_s, s.peak_extra_rss / MiB)
                fresh(path)

    def _loads(self, res: dict[str, Any], run_dir: Path, sd: dict[str, Any], dst: dict[str, Any], nbytes: int,
               cache: CacheControl) -> None:
        groups: list[tuple[str, Callable[[Path], None], list[tuple[str, Callable[[dict[str, Any], Path], None]]]]] = [
            ("dcp", lambda p: dcp_save(sd, p, 1), [
                ("DCP FileSystemReader", dcp_load),
            ]),
            ("cpuckpt", lambda p: cpuckpt.save(sd, p), [
                ("cpuckpt verify=always", lambda d, p: cpuckpt.load(d, p, config={"integrity": {"verify": "always"}})),
                ("cpuckpt verify=off", lambda d, p: cpuckpt.load(d, p, config={"integrity": {"verify": "off"}})),
            ]),
        ]
        for peer, writer, readers in groups:
            path = run_dir / f"load-{peer}"
            writer(path)
            files = files_under(path)
            for rep in range(self.reps):
                for name, fn in readers:
                    _reset_targets(dst)
                    label = cache.cold(files)
                    try:
                        s = self._measure(lambda fn=fn, path=path: fn(dst, path))
                    except Exception as e:
                        self._fail(f"{res['dir']}: {name} rep {rep}", e)
                        continue
                    diff = common.same_state_dict(sd, dst)
                    if diff:
                        self._fail(f"{res['dir']}: {name} rep {rep} loaded wrong data", RuntimeError(diff))
                    self._record(res["loads"], name, s, nbytes, peer=peer, rep=rep, cache=label, correct=diff is None)
                    logger.info("load %-40s %.3f s  %.2f GB/s  cpu %.2f s  rss+ %.0f MiB  (%s)%s", name, s.wall_s,
                                nbytes / s.wall_s / GB, s.cpu_s, s.peak_extra_rss / MiB, label,
                                "" if diff is None else f"  WRONG: {diff}")
            fresh(path)
            common.release_memory()

    def _small(self, res: dict[str, Any], run_dir: Path) -> None:
        n = self.args.small
        if n <= 0:
            return
        rt = _record_template_cache()
        plan_cpuckpt = cpuckpt_null_save()
        for case, distinct in (("same shapes", False), ("distinct shapes", True)):
            sd = common.small_state_dict(n, distinct_shapes=distinct)
            nbytes = common.state_dict_nbytes(sd)
            variants: list[tuple[str, str, Callable[[Path], None], bool]] = [
                ("plan", PLAN_DCP, lambda p, sd=sd: null_save(sd), False),
            ]
            if plan_cpuckpt is not None:
                variants.append(("plan", PLAN_CPUCKPT, lambda p, sd=sd: plan_cpuckpt(sd), False))
            variants += [
                ("dcp", "DCP FileSystemWriter thread_count=1", lambda p, sd=sd: dcp_save(sd, p, 1), False),
                ("cpuckpt", "cpuckpt default", lambda p, sd=sd: cpuckpt.save(sd, p), False),
            ]
            if distinct and rt is not None:
                variants.append(("cpuckpt", "cpuckpt default, cold skeleton cache",
                                 lambda p, sd=sd: cpuckpt.save(sd, p), True))
            table = res["small"].setdefault(case, {"n": n, "nbytes": nbytes, "variants": {}})
            for rep in range(self.reps):
                for k, (peer, name, fn, clear) in enumerate(variants):
                    path = run_dir / f"small-{k}"
                    if clear and rt is not None:
                        rt.cache_clear()
                    before = rt.cache_info() if rt is not None else None
                    try:
                        s = self._measure(lambda fn=fn, path=path: fn(path))
                    except Exception as e:
                        self._fail(f"{res['dir']}: small {case} {name} rep {rep}", e)
                        fresh(path)
                        continue
                    extra: dict[str, Any] = {"peer": peer, "rep": rep}
                    if rt is not None and before is not None and peer == "cpuckpt":
                        after = rt.cache_info()
                        extra["skeleton_cache_misses"] = after.misses - before.misses
                        extra["skeleton_cache_hits"] = after.hits - before.hits
                    self._record(table["variants"], name, s, nbytes, **extra)
                    logger.info("small %-15s %-40s %.3f s (%.1f us/item)%s", case, name, s.wall_s,
                                s.wall_s / n * 1e6,
                                f"  skeleton misses {extra['skeleton_cache_misses']}"
                                if "skeleton_cache_misses" in extra else "")
                    fresh(path)
            del sd
            common.release_memory()

    def _fail(self, what: str, e: BaseException) -> None:
        logger.error("%s failed: %r", what, e, exc_info=self.args.verbose)
        self.failures.append(f"{what}: {e!r}")

    # -- report -----------------------------------------------------------------------------------
    def table(self) -> str:
        headers = ["target", "op", "variant", "wall s med (min-max)", "GB/s med (min-max)", "x floor", "x DCP",
                   "CPU-s/GB", "CPU x DCP", "RSS+ MiB med/max", "us/item", "cache / note"]
        right = [False, False, False, True, True, True, True, True, True, True, True, False]
        rows: list[list[Any] | None] = []
        for tname, res in self.results["targets"].items():
            if rows:
                rows.append(None)
            rows += self._bulk_rows(tname, res)
            rows += self._small_rows(tname, res)
        a = self.args
        title = (f"cpuckpt CPU benchmark | {self.results['meta']['date']} | {self.results['meta']['machine']} | "
                 f"torch {torch.__version__}, cpuckpt {cpuckpt.__version__} | state dict {a.gib} GiB "
                 f"({self.results.get('state_dict_items', '?')} items), reps {a.reps}")
        foot = [
            "GB = 1e9 bytes of tensor data; medians with (min-max) over reps; saves are durable (files + dir fsynced).",
            "x floor: GB/s over the best raw floor of the same target (pwrite for saves, pread for loads).",
            "x DCP: speedup over the best DCP variant (saves: max GB/s; loads: FileSystemReader; small: DCP "
            "us/item / this us/item). Higher is better.",
            "CPU x DCP: lowest DCP CPU-s/GB over this CPU-s/GB (target >= 3). RSS+: peak RSS during the call minus "
            "before it (cpuckpt's host pool persists after its first use).",
            "us/item: (median wall - median planning-only wall of the same entry point: dcp.save for DCP, "
            "cpuckpt.save's path for cpuckpt) / items.",
        ]
        if any(r is not None and "WARM" in str(r[-1]) for r in rows):
            foot.append("WARM: the page cache could not be dropped; those loads read cached pages.")
        if self.failures:
            foot.append(f"FAILURES ({len(self.failures)}): " + " | ".join(self.failures))
        return common.format_table(headers, rows, right=right, title=title, footnotes=foot)

    def _bulk_rows(self, tname: str, res: dict[str, Any]) -> list[list[Any]]:
        rows: list[list[Any]] = []
        floor_rows: list[tuple[str, float, list[Any]]] = []
        floors: dict[str, dict[str, Any]] = {}
        for op in ("pwrite", "pread"):
            for direct in (True, False):
                mode = "O_DIRECT" if direct else ("buffered+fsync" if op == "pwrite" else "buffered")
                best: dict[str, Any] | None = None
                for t in FLOOR_THREADS:
                    runs = [f for f in res["floors"] if f["op"] == op and f["direct"] == direct and f["threads"] == t
                            and f["supported"]]
                    if runs:
                        g = common.summarize([f["gbps"] for f in runs])
                        if best is None or g["median"] > best["gbps"]["median"]:
                            best = {"threads": t, "gbps": g, "wall": common.summarize([f["wall_s"] for f in runs]),
                                    "cache": runs[-1].get("cache", "")}
                if best is None:
                    rows.append([tname, f"floor {op}", mode, None, None, None, None, None, None, None, None,
                                 "unsupported"])
                    continue
                if best["gbps"]["median"] > floors.get(op, {}).get("gbps", 0.0):
                    floors[op] = {"gbps": best["gbps"]["median"], "mode": mode, "threads": best["threads"]}
                row = [tname, f"floor {op}", f"{mode}, best {best['threads']} thr", _fmt_range(best["wall"], 3),
                       _fmt_range(best["gbps"]), None, None, None, None, None, None, best["cache"]]
                floor_rows.append((op, best["gbps"]["median"], row))
                rows.append(row)
        for op, gbps, row in floor_rows:
            row[5] = _fmt(gbps / floors[op]["gbps"])
        res["floor_best"] = floors
        for kind, op, fkey in (("saves", "save", "pwrite"), ("loads", "load", "pread")):
            stats = {name: _bulk_stats(e) for name, e in res[kind].items()}
            dcp_names = [n for n, e in res[kind].items() if e["samples"] and e["samples"][0]["peer"] == "dcp"]
            best_dcp = max((stats[n]["gbps"]["median"] for n in dcp_names), default=math.nan)
            min_dcp_cpu = min((stats[n]["cpu_per_gb"]["median"] for n in dcp_names), default=math.nan)
            floor = floors.get(fkey, {}).get("gbps", math.nan)
            for name, st in stats.items():
                is_dcp = name in dcp_names
                note = st["cache"]
                if st["wrong"]:
                    note = f"{note} WRONG DATA x{st['wrong']}".strip()
                rows.append([
                    tname, op, name, _fmt_range(st["wall"], 3), _fmt_range(st["gbps"]),
                    _fmt(st["gbps"]["median"] / floor) if floor else None,
                    None if is_dcp else _fmt(st["gbps"]["median"] / best_dcp),
                    _fmt(st["cpu_per_gb"]["median"]),
                    # smoke runs can measure 0 CPU-s (os.times ticks are 10 ms): no ratio then
                    None if is_dcp or not st["cpu_per_gb"]["median"]
                    else _fmt(min_dcp_cpu / st["cpu_per_gb"]["median"]),
                    f"{st['rss']['median'] / MiB:.0f}/{st['rss']['max'] / MiB:.0f}",
                    None, note,
                ])
                res[kind][name]["summary"] = st
        return rows

    def _small_rows(self, tname: str, res: dict[str, Any]) -> list[list[Any]]:
        rows: list[list[Any]] = []
        for case, table in res["small"].items():
            n = table["n"]
            walls = {name: common.summarize([s["wall_s"] for s in e["samples"]])
                     for name, e in table["variants"].items()}
            plan_dcp = walls.get(PLAN_DCP, {}).get("median", math.nan)
            plan_own = {"dcp": plan_dcp, "cpuckpt": walls.get(PLAN_CPUCKPT, {}).get("median", plan_dcp)}
            per_item: dict[str, float] = {}
            for name, e in table["variants"].items():
                peer = e["samples"][0]["peer"]
                base = plan_own.get(peer, 0.0)
                per_item[name] = (walls[name]["median"] - base) / n * 1e6
            dcp_item = next((v for name, v in per_item.items() if name.startswith("DCP FileSystemWriter")), math.nan)
            for name, e in table["variants"].items():
                peer = e["samples"][0]["peer"]
                rss = [s["peak_extra_rss"] for s in e["samples"]]
                misses = [s["skeleton_cache_misses"] for s in e["samples"] if "skeleton_cache_misses" in s]
                total_us = walls[name]["median"] / n * 1e6
                if peer == "plan":
                    note = "planning: us/item is the total"
                else:
                    note = f"total {total_us:.0f} us/item"
                    if misses:
                        note += f"; skeleton misses/save {int(common.summarize(misses)['median'])}"
                e["summary"] = {"wall": walls[name], "cpu": common.summarize([s["cpu_s"] for s in e["samples"]]),
                                "us_per_item_total": total_us,
                                "us_per_item_beyond_planning": None if peer == "plan" else per_item[name]}
                rows.append([
                    tname, f"save {n} small ({case})", name, _fmt_range(walls[name], 3), None, None,
                    _fmt(dcp_item / per_item[name]) if peer == "cpuckpt" and per_item[name] > 0 else None,
                    None, None,
                    f"{common.summarize(rss)['median'] / MiB:.0f}/{max(rss) / MiB:.0f}",
                    _fmt(total_us if peer == "plan" else per_item[name], 1),
                    note,
                ])
        return rows


def _bulk_stats(entry: dict[str, Any]) -> dict[str, Any]:
    nbytes = entry["nbytes"]
    samples = entry["samples"]
    caches = sorted({s.get("cache", "") for s in samples} - {""})
    return {
        "wall": common.summarize([s["wall_s"] for s in samples]),
        "gbps": common.summarize([nbytes / s["wall_s"] / GB for s in samples]),
        "cpu_per_gb": common.summarize([s["cpu_s"] / (nbytes / GB) for s in samples]),
        "rss": common.summarize([s["peak_extra_rss"] for s in samples]),
        "cache": ", ".join(caches),
        "wrong": sum(1 for s in samples if s.get("correct") is False),
    }


def _reset_targets(sd: Any) -> None:
    """Zero every tensor of a load target and forget its non-tensor leaves, so a load must fill them."""
    for k, v in sd.items():
        if isinstance(v, dict):
            _reset_targets(v)
        elif isinstance(v, torch.Tensor):
            v.zero_()
        else:
            sd[k] = None


def _record_template_cache() -> Any:
    """cpuckpt's record-skeleton cache (an ``lru_cache``), for hit/miss counts; None if it moved."""
    try:
        from cpuckpt.format.record import record_template
    except ImportError:
        return None
    return record_template if hasattr(record_template, "cache_info") else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# ------------------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="state dict size in GiB (default 4)")
    p.add_argument("--targets", default="shm,disk", help="comma-separated: shm, disk (default both)")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs directory for the 'shm' target")
    p.add_argument("--disk-dir", default=os.environ.get("CPUCKPT_BENCH_DISK_DIR", "/var/tmp/cpuckpt-bench"),
                   help="local-disk directory for the 'disk' target (outside the repo)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every variant (default 3)")
    p.add_argument("--small", type=int, default=10000, help="tensors in the small-tensor case (0 skips it)")
    p.add_argument("--floor-chunk-mib", type=int, default=32, help="pwrite/pread size of the raw floors (MiB)")
    p.add_argument("--cache-drop", choices=("auto", "drop_caches", "fadvise", "none"), default=None,
                   help="how loads are made cold: auto (drop_caches, else fadvise; default), drop_caches, "
                        "fadvise (per file, no global sync), none (warm)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed write of the state dict's size to each target before measuring "
                        "(it makes the VM/tmpfs allocate that memory once, so the first variant is not penalised)")
    p.add_argument("--no-load", action="store_true", help="skip the loads (no second copy of the state dict)")
    p.add_argument("--json", metavar="OUT.json", help="write the raw results here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 1 rep, fadvise instead of drop_caches: checks that everything runs")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks of failures")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings on stderr")
    a = p.parse_args(argv)
    if a.smoke:
        a.gib = min(a.gib, 24 / 1024)
        a.reps = 1
        a.small = min(a.small, 300)
        a.floor_chunk_mib = min(a.floor_chunk_mib, 4)
        a.cache_drop = a.cache_drop or "fadvise"
    a.cache_drop = a.cache_drop or "auto"
    if a.reps < 1:
        p.error("--reps must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    warnings.filterwarnings("ignore", message=".*torch.distributed is (not|disabled).*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")
    if args.reps < 3 and not args.smoke:
        logger.warning("--reps %d: BENCHMARKING.md asks for medians of >= 3 runs", args.reps)
    dirs = {"shm": Path(args.shm_dir), "disk": Path(args.disk_dir)}
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in dirs]
    if unknown:
        logger.error("unknown target(s) %s; known: %s", unknown, ", ".join(dirs))
        return 2

    bench = Bench(args)
    t0 = time.perf_counter()
    with common.timed("building the state dict"):
        sd = common.build_state_dict(int(args.gib * GiB))
    bench.results["state_dict_items"] = common.count_leaves(sd)
    bench.results["state_dict_nbytes"] = common.state_dict_nbytes(sd)
    dst = None if args.no_load else common.clone_empty(sd)
    common.freeze_heap()
    table = ""
    try:
        for t in targets:
            bench.run_target(t, dirs[t], sd, dst)
    finally:
        bench.results["wall_s"] = time.perf_counter() - t0
        table = bench.table()  # also adds the summaries to the raw results
        bench.results["failures"] = bench.failures
        if args.json:
            Path(args.json).write_text(json.dumps(bench.results, indent=1, default=str))
            logger.info("raw results: %s", args.json)
    print(table, flush=True)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
