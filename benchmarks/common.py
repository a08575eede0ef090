"""Reusable pieces of the cpuckpt benchmarks (every ``benchmarks.bench_*`` module imports them from here).

* state dicts: :func:`build_state_dict` (deterministic, mixed sizes and dtypes, non-tensor items)
  and :func:`small_state_dict` (many tiny tensors, same or all-distinct shapes); :func:`clone_empty`
  (load targets), :func:`same_state_dict` / :func:`same_tensor` (bit-exact checks),
  :func:`named_tensors` (every tensor of nested dicts, lists and tuples);
* measurement: :class:`Meter` (wall time, process CPU-seconds, peak extra RSS from a
  :class:`RssSampler` thread), :func:`summarize` (median with min-max), :func:`median`;
  :class:`ResultLog` (raw result rows, each logged as a JSON line);
* raw storage floors: :func:`pwrite_floor` and :func:`pread_floor` (aligned buffers, parallel
  ``os.pwrite``/``os.preadv``, O_DIRECT or buffered, fsync);
* files: :func:`fresh` (remove before a run), :func:`files_under`, :func:`tree_nbytes`,
  :func:`fsync_dir`, :func:`fsync_tree`;
* page-cache control (:func:`drop_caches`, :func:`evict_files`) and memory hygiene (:func:`release_memory`);
* :func:`format_table`, a plain-text table printer.

Sizes are in bytes; GB means 1e9 bytes, GiB/MiB 2**30/2**20.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import math
import mmap
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a driver that only launches and tabulates (bench_goodput) starts without torch
    import torch

__all__ = [
    "FloorResult",
    "Meter",
    "ResultLog",
    "RssSampler",
    "Sample",
    "build_state_dict",
    "clone_empty",
    "copy_floors",
    "count_leaves",
    "device_sync",
    "drop_caches",
    "evict_files",
    "file_safe",
    "files_under",
    "format_table",
    "freeze_heap",
    "fresh",
    "fsync_dir",
    "fsync_tree",
    "matmul_loop",
    "median",
    "named_tensors",
    "pread_floor",
    "pwrite_floor",
    "read_rss_bytes",
    "release_memory",
    "same_state_dict",
    "same_tensor",
    "small_state_dict",
    "state_dict_nbytes",
    "summarize",
    "timed_call",
    "tree_nbytes",
    "with_time_spent",
]

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
GB = 1e9

# ------------------------------------------------------------------------------------- state dicts

#: Share of the bytes of :func:`build_state_dict` in large (>= 128 MiB), medium and small (<= 1 MiB) tensors.
LARGE_SHARE, MEDIUM_SHARE = 0.60, 0.34
#: Sizes of the large tensors, cycled (the remainder below 128 MiB joins the last one).
LARGE_PATTERN = (512 * MiB, 256 * MiB, 128 * MiB)
MEDIUM_RANGE = (2 * MiB, 64 * MiB)  # log-uniform
SMALL_RANGE = (4 * KiB, 1 * MiB)  # log-uniform
_FILL_BLOCK_NUMEL = 4 * MiB  # elements in the random block that tensors are tiled from


def _fill(t: torch.Tensor, block: torch.Tensor, start: int) -> None:
    """Fill ``t`` by tiling ``block`` (same dtype, 1-D) from element ``start``: fast, deterministic, finite."""
    flat = t.view(-1)
    n, blen = flat.numel(), block.numel()
    pos, off = 0, start % blen
    while pos < n:
        k = min(n - pos, blen - off)
        flat[pos : pos + k].copy_(block[off : off + k])
        pos += k
        off = 0


def _blocks(device: str | torch.device, seed: int) -> dict[torch.dtype, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(_FILL_BLOCK_NUMEL, generator=gen, dtype=torch.float32)
    return {torch.float32: base.to(device), torch.bfloat16: base.to(torch.bfloat16).to(device)}


def _shape_for(numel: int) -> tuple[int, ...]:
    """A 2-D shape of exactly ``numel`` elements when a nice divisor exists, else 1-D."""
    for cols in (4096, 2048, 1024, 512, 256, 128, 64):
        if numel >= cols and numel % cols == 0:
            return (numel // cols, cols)
    return (numel,)


def _log_uniform(rng: torch.Generator, lo: int, hi: int) -> int:
    import torch

    u = torch.rand((), generator=rng).item()
    return int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))


def build_state_dict(total_bytes: int, device: str | torch.device = "cpu", seed: int = 0) -> dict[str, Any]:
    """A deterministic, training-like state dict of about ``total_bytes`` tensor bytes.

    About 60% of the bytes are in a few large tensors (512/256/128 MiB, cycled: all >= 128 MiB
    once ``total_bytes`` is at least ~220 MiB; below that there is one smaller "large" tensor),
    34% in medium tensors (2-64 MiB), 6% in many small ones (4 KiB - 1 MiB, log-uniform). dtypes
    alternate fp32/bf16; values are finite (tiled from one ``randn`` block, so building is fast).
    Non-tensor items (ints, floats, strings, a list, a nested dict) sit under ``"extra"``.

    Args:
        total_bytes: target tensor bytes (the result is within a few KiB of it).
        device: where tensors live ("cpu", "cuda", ...).
        seed: same seed, same state dict (names, shapes, dtypes and values).
    """
    import torch

    rng = torch.Generator().manual_seed(seed)
    blocks = _blocks(device, seed)
    dtypes = (torch.float32, torch.bfloat16)
    sizes: list[tuple[str, int]] = []

    large_budget = int(total_bytes * LARGE_SHARE)
    i = 0
    while large_budget > 0:
        want = LARGE_PATTERN[i % len(LARGE_PATTERN)]
        take = min(want, large_budget)
        if large_budget - take < LARGE_PATTERN[-1]:
            take = large_budget  # fold a remainder below 128 MiB into this tensor
        sizes.append(("large", take))
        large_budget -= take
        i += 1
    medium_budget = int(total_bytes * MEDIUM_SHARE)
    while medium_budget > 0:
        take = min(_log_uniform(rng, *MEDIUM_RANGE), medium_budget)
        sizes.append(("medium", take))
        medium_budget -= take
    small_budget = total_bytes - sum(n for _, n in sizes)
    while small_budget > 0:
        take = min(_log_uniform(rng, *SMALL_RANGE), small_budget)
        sizes.append(("small", take))
        small_budget -= take

    sd: dict[str, Any] = {}
    start = 0
    for k, (kind, nbytes) in enumerate(sizes):
        dtype = dtypes[k % 2]
        numel = max(1, nbytes // (4 if dtype == torch.float32 else 2))
        t = torch.empty(_shape_for(numel), dtype=dtype, device=device)
        _fill(t, blocks[dtype], start)
        start += 7919 * (k + 1)
        sd[f"model.{kind}.{k:05d}.weight"] = t
    sd["extra"] = {
        "step": 123456,
        "epoch": 7,
        "lr": 3.0e-4,
        "run_name": "cpuckpt-bench",
        "loss_history": [1.0 / (j + 1) for j in range(1000)],
        "sampler": {"seed": seed, "offset": 98765},
    }
    return sd


def _distinct_shapes(n: int) -> list[tuple[int, int, int]]:
    """``n`` distinct 3-D shapes of smallest element count (all (a, b, c) with a*b*c <= some bound)."""
    bound = 16
    while True:
        shapes = [(a, b, c) for a in range(1, bound + 1) for b in range(1, bound // a + 1)
                  for c in range(1, bound // (a * b) + 1)]
        if len(shapes) >= n:
            shapes.sort(key=lambda s: (s[0] * s[1] * s[2], s))
            return shapes[:n]
        bound *= 2


def small_state_dict(n: int = 10000, *, distinct_shapes: bool = False, device: str | torch.device = "cpu",
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` small fp32 tensors: all the same 1-D shape, or ``n`` all-distinct 3-D shapes.

    The distinct shapes are the ``n`` smallest (a, b, c) triples (mean ~250 elements for n=10,000);
    the same-shape case uses the mean element count of those, so both carry about the same bytes.
    """
    import torch

    shapes: Sequence[tuple[int, ...]] = _distinct_shapes(n)
    if not distinct_shapes:
        mean = max(1, round(sum(a * b * c for a, b, c in shapes) / max(n, 1)))  # type: ignore[misc]
        shapes = [(mean,)] * n
    block = _blocks(device, seed)[torch.float32]
    sd: dict[str, torch.Tensor] = {}
    for i, shape in enumerate(shapes):
        t = torch.empty(shape, dtype=torch.float32, device=device)
        _fill(t, block, 104729 * (i + 1))
        sd[f"layers.{i // 16:04d}.param{i % 16:02d}"] = t
    return sd


def _leaves(sd: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), sd


def count_leaves(sd: dict[str, Any]) -> int:
    """Leaves (tensors and other objects) of a nested state dict: the items DCP plans."""
    return sum(1 for _ in _leaves(sd))


def state_dict_nbytes(sd: dict[str, Any]) -> int:
    """Bytes held by the tensors of a (nested) state dict."""
    import torch

    return sum(v.numel() * v.element_size() for _, v in _leaves(sd) if isinstance(v, torch.Tensor))


def clone_empty(sd: Any) -> Any:
    """Same structure, tensors replaced by zeroed tensors of the same shape/dtype/device (load targets)."""
    import torch

    if isinstance(sd, dict):
        return {k: clone_empty(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bit-exact: a NaN equals the same NaN)."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def same_state_dict(a: Any, b: Any) -> str | None:
    """None when ``a`` and ``b`` hold bit-identical tensors and equal other leaves; else the first difference."""
    import torch

    la, lb = dict(_leaves(a)), dict(_leaves(b))
    if la.keys() != lb.keys():
        return f"keys differ: {sorted(set(la) ^ set(lb))[:5]}"
    for k, va in la.items():
        vb = lb[k]
        if isinstance(va, torch.Tensor):
            if not isinstance(vb, torch.Tensor) or va.shape != vb.shape or va.dtype != vb.dtype:
                return f"{k}: tensor metadata differs"
            if not same_tensor(va, vb):
                return f"{k}: tensor bytes differ"
        elif va != vb:
            return f"{k}: {va!r} != {vb!r}"
    return None


def named_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested structure of dicts, lists and tuples, by dotted path (``"a.0.b"``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(named_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


# ------------------------------------------------------------------------------------- measurement


def with_time_spent(fn: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    """``fn``, adding the seconds spent in each call to ``spent[name]`` (to time a method from outside)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return timed


def device_sync() -> None:
    """Wait for the GPU's queued work (a no-op without CUDA): timings bracket real device time."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_call(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took, the device synchronised before and after."""
    device_sync()
    t0 = time.perf_counter()
    fn()
    device_sync()
    return time.perf_counter() - t0


def copy_floors(sd: dict[str, Any], reps: int) -> tuple[int, dict[str, dict[str, float]]]:
    """The device-to-host and host-to-device floors of ``sd``'s tensors: every tensor copied into (out of)
    one pinned host buffer (pageable without CUDA), ``reps`` timed runs after a discarded warm-up.

    Returns the bytes and ``{"d2h": summary, "h2d": summary}`` (:func:`summarize` of the seconds).
    """
    import torch

    ts = list(named_tensors(sd).values())
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    views, off = [], 0
    for t in ts:
        n = t.numel() * t.element_size()
        views.append((t.reshape(-1).view(torch.uint8), host[off : off + n]))
        off += n
    out = {}
    for direction in ("d2h", "h2d"):
        def copy(direction: str = direction) -> None:
            for src, h in views:
                if direction == "d2h":
                    h.copy_(src, non_blocking=True)
                else:
                    src.copy_(h, non_blocking=True)
        out[direction] = summarize([timed_call(copy) for _ in range(reps + 1)][1:])
    return nbytes, out


_MATMUL_OPERANDS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def matmul_loop(iters: int, n: int = 8192) -> list[float]:
    """Seconds per iteration of a training-like loop (4 bf16 matmuls of n x n), the device synchronised.

    Every call multiplies the same random operands (made once per size and device). An earlier loop fed
    each product back scaled by 1e-4, so its operands decayed towards zero within one call while each
    new call started from fresh random ones: "alone" (one long call) ran mostly on near-zero data and
    "during a persist" (many 1-iteration calls) on random data, the likely cause of the 1.11-1.15 x once
    reported as interference. A diagnostic on the H200 that used the same data in both measured 0.99-1.01 x
    during in-process and writer-process persists (BENCHMARKS.md, fifth session).
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = _MATMUL_OPERANDS.get((n, device))
    if ops is None:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
        ops = _MATMUL_OPERANDS[(n, device)] = (a, torch.randn(n, n, device=device, dtype=torch.bfloat16,
                                                               generator=g), torch.empty_like(a))
    a, b, c = ops

    def step() -> None:
        for _ in range(4):
            torch.mm(a, b, out=c)

    return [timed_call(step) for _ in range(iters)]


def read_rss_bytes() -> int:
    """This process's resident set size (VmRSS) in bytes."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """A daemon thread sampling VmRSS every ``interval_s`` seconds; ``peak`` is the highest value seen."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.baseline = read_rss_bytes()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, read_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, read_rss_bytes())

    @property
    def extra(self) -> int:
        """Peak minus the RSS when the sampler was created (bytes, >= 0)."""
        return max(0, self.peak - self.baseline)


@dataclass
class Sample:
    """One measured call."""

    wall_s: float
    cpu_s: float  # user + system seconds of the whole process (all threads)
    peak_extra_rss: int  # bytes


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class Meter:
    """Measure a block: wall time, process CPU-seconds and peak extra RSS.

    Example:
        >>> with Meter() as m:
        ...     do_work()
        >>> m.sample.wall_s
    """

    def __init__(self, rss_interval_s: float = 0.005) -> None:
        self._rss = RssSampler(rss_interval_s)
        self.sample: Sample | None = None

    def __enter__(self) -> Meter:
        self._rss.__enter__()
        self._cpu0 = _cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        cpu = _cpu_seconds() - self._cpu0
        self._rss.__exit__(*exc)
        self.sample = Sample(wall_s=wall, cpu_s=cpu, peak_extra_rss=self._rss.extra)


def measure(fn: Callable[[], Any]) -> Sample:
    """Run ``fn`` once under a :class:`Meter`."""
    with Meter() as m:
        fn()
    assert m.sample is not None
    return m.sample


def median(values: Sequence[float]) -> float:
    """The median of ``values``; NaN when empty."""
    return statistics.median(values) if values else math.nan


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of ``values`` (NaN when empty)."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


class ResultLog(list):
    """Raw results: one dict per measurement (``{"name": ..., **fields}``), each logged as a JSON line."""

    def __init__(self, log: logging.Logger) -> None:
        super().__init__()
        self._log = log

    def record(self, name: str, **fields: Any) -> dict[str, Any]:
        row = {"name": name, **fields}
        self.append(row)
        self._log.info("%s", json.dumps(row, default=str))
        return row


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (``gc.freeze``).

    With torch imported a full ``gc.collect()`` costs ~0.1 s; after this, :func:`release_memory` only
    scans what the benchmark allocated since.
    """
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``), so RSS baselines are honest."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -------------------------------------------------------------------------------------- page cache


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted (not root, read-only /proc)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        logger.debug("drop_caches refused: %s", e)
        return False
    return True


def evict_files(paths: Sequence[str | os.PathLike]) -> bool:
    """Drop the page-cache pages of these files (fdatasync, then ``POSIX_FADV_DONTNEED``); True on success."""
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def _fsync(path: str | os.PathLike, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (makes new entries durable)."""
    _fsync(path, os.O_DIRECTORY)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory below ``path``, then ``path`` itself (a durable save)."""
    for p in sorted(Path(path).rglob("*")):
        _fsync(p)
    fsync_dir(path)


# ------------------------------------------------------------------------------------------- files


def fresh(path: str | os.PathLike) -> Path:
    """Remove whatever is at ``path`` (a directory tree or a file), so a run starts clean; return it."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
    return p


def files_under(path: str | os.PathLike) -> list[Path]:
    """Every file below the directory ``path`` (``[path]`` itself when it is not a directory)."""
    p = Path(path)
    return [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]


def tree_nbytes(path: str | os.PathLike) -> int:
    """Bytes of every file below ``path`` (or of the file ``path``)."""
    return sum(f.stat().st_size for f in files_under(path))


# ------------------------------------------------------------------------------------ raw floors


@dataclass
class FloorResult:
    """One raw floor run: ``nbytes`` moved by ``threads`` threads in ``wall_s``.

    ``supported`` is False (and ``error`` says why) when the filesystem refused O_DIRECT.
    """

    op: str  # "pwrite" or "pread"
    direct: bool
    threads: int
    nbytes: int
    chunk_bytes: int
    wall_s: float = math.nan
    cpu_s: float = math.nan
    supported: bool = True
    error: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / GB if self.supported and self.wall_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def _aligned_buffer(nbytes: int, seed: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` filled with pseudo-random, incompressible bytes."""
    import torch

    buf = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    del t
    return buf


def _thread_chunks(i: int, threads: int, nbytes: int, chunk_bytes: int, direct: bool,
                   align: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the chunks thread ``i`` moves (chunks ``i, i+T, ...``); O_DIRECT pads to ``align``."""
    for off in range(i * chunk_bytes, nbytes, threads * chunk_bytes):
        n = min(chunk_bytes, nbytes - off)
        yield off, -(-n // align) * align if direct else n


def _run_floor(res: FloorResult, path: str | os.PathLike, flags: int, worker: Callable[[int, int], None],
               after: Callable[[int], None] = lambda fd: None, closed: Callable[[], None] = lambda: None) -> bool:
    """Open ``path``, run ``worker(i, fd)`` on ``res.threads`` threads, ``after(fd)``, close, ``closed()``;
    the wall time and process CPU time of all that go into ``res``.

    An O_DIRECT open or I/O the filesystem refuses marks ``res`` unsupported (False is returned);
    a buffered failure raises.
    """
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        res.supported, res.error = False, str(e)
        return False
    try:
        with ThreadPoolExecutor(res.threads) as ex:
            list(ex.map(lambda i: worker(i, fd), range(res.threads)))
        after(fd)
    except OSError as e:
        if not res.direct:
            raise
        res.supported, res.error = False, str(e)
        return False
    finally:
        os.close(fd)
    closed()
    res.wall_s, res.cpu_s = time.perf_counter() - t0, _cpu_seconds() - cpu0
    return True


def pwrite_floor(path: str | os.PathLike, nbytes: int, threads: int, direct: bool, *,
                 chunk_bytes: int = 32 * MiB, align: int = 4096) -> FloorResult:
    """Write ``nbytes`` to one file with ``threads`` parallel ``os.pwrite`` calls of ``chunk_bytes``, then fsync.

    Every thread writes from its own page-aligned buffer (mmap), chunks interleaved across threads
    (thread ``i`` writes chunks ``i, i+T, ...``). With ``direct`` the file is opened with O_DIRECT
    (the tail chunk is padded to ``align`` and the file truncated back). The time covers open,
    writes, truncate, fsync of the file and of its directory: a durable write.
    """
    res = FloorResult("pwrite", direct, threads, nbytes, chunk_bytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    bufs = [_aligned_buffer(chunk_bytes, seed=17 + i) for i in range(threads)]

    def worker(i: int, fd: int) -> None:
        view = memoryview(bufs[i])
        for off, n in _thread_chunks(i, threads, nbytes, chunk_bytes, direct, align):
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:n], off + done)

    def durable(fd: int) -> None:
        os.ftruncate(fd, nbytes)
        os.fsync(fd)

    try:
        _run_floor(res, path, flags, worker, durable, lambda: fsync_dir(Path(path).parent))
        return res
    finally:
        for b in bufs:
            b.close()


def pread_floor(path: str | os.PathLike, nbytes: int, threads: int, direct: bool, *,
                chunk_bytes: int = 32 * MiB, align: int = 4096) -> FloorResult:
    """Read the first ``nbytes`` of ``path`` with ``threads`` parallel ``os.preadv`` calls of ``chunk_bytes``.

    Each thread reads into its own page-aligned buffer (the bytes are not kept). Drop the page cache
    before calling it for a cold read.
    """
    import torch

    res = FloorResult("pread", direct, threads, nbytes, chunk_bytes)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    bufs = [mmap.mmap(-1, chunk_bytes) for _ in range(threads)]
    for b in bufs:  # touch, so page faults of the buffers are not timed
        torch.frombuffer(b, dtype=torch.uint8).fill_(1)
    got = [0] * threads

    def worker(i: int, fd: int) -> None:
        view = memoryview(bufs[i])
        for off, n in _thread_chunks(i, threads, nbytes, chunk_bytes, direct, align):
            done = 0
            while done < n:
                k = os.preadv(fd, [view[done:n]], off + done)
                if k == 0:
                    break
                done += k
            got[i] += min(done, nbytes - off)

    try:
        if _run_floor(res, path, flags, worker) and sum(got) != nbytes:
            raise RuntimeError(f"pread floor read {sum(got)} of {nbytes} bytes from {path}")
        return res
    finally:
        for b in bufs:
            b.close()


# ------------------------------------------------------------------------------------------- table


def file_safe(name: str) -> str:
    """A variant's name as part of a file name the device machine hands back (it leaves out names with ``+``)."""
    return name.replace("+", "_")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[bool] | None = None,
                 title: str = "", footnotes: Sequence[str] = ()) -> str:
    """A plain-text table; ``None`` cells print as ``-``; a row ``None`` prints a separator line."""
    cells = [[("-" if c is None else str(c)) for c in r] if r is not None else None for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        if r is not None:
            widths = [max(w, len(c)) for w, c in zip(widths, r)]
    right = right or [False] * len(headers)

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    out = [title] if title else []
    out += [line(headers), sep]
    out += [line(r) if r is not None else sep for r in cells]
    out += list(footnotes)
    return "\n".join(out)


@contextmanager
def timed(label: str) -> Iterator[None]:
    """Log how long a block took (setup steps, not measurements)."""
    t0 = time.perf_counter()
    yield
    logger.info("%s: %.2f s", label, time.perf_counter() - t0)
