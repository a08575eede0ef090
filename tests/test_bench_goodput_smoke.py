"""benchmarks/bench_goodput.py without a GPU: its log arithmetic and its command lines (asserting no speed).

Run as ``python -m benchmarks.bench_goodput`` with the repository root on PYTHONPATH, as on the device
machine (from the repository root, which it reads configs/ from): the test process itself does not have the
root on ``sys.path`` (``--import-mode=importlib``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_goodput", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_self_test_arithmetic(tmp_path: Path) -> None:
    proc = _bench("--self-test", cwd=tmp_path)
    assert proc.returncode == 0 and "self-test ok" in proc.stdout, proc.stdout + proc.stderr


def test_dry_run_prints_every_variant(tmp_path: Path) -> None:
    proc = _bench("--dry-run", "--out", str(tmp_path), "--floor", "overlap_floor.py", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in ("none", "torch_dist8", "cpuckpt8", "mem8", "mem1", "mem1snap"):
        assert f"# {name}\n" in out
    assert "--non-persistent-save-interval 1 " in out and "--non-persistent-save-interval 8 " in out
    assert "# floor" in out


def test_dry_run_takes_memory_variants_with_changes(tmp_path: Path) -> None:
    proc = _bench("--dry-run", "--out", str(tmp_path), "--variants", "mem1+nocrc,mem1snap+window16", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# mem1+nocrc\n" in proc.stdout and "# mem1snap+window16\n" in proc.stdout  # (a bad change: below)


def test_dry_run_takes_the_variants_the_device_calls_ask_for(tmp_path: Path) -> None:
    """What BENCHMARKS.md's owed calls name (a variant refused on the device machine costs that call's variants)."""
    names = ("none+mgc,mem8snap+copyproc,mem1snap+copyproc+mgc,mem1snap+copyproc+slots5+rep2,mem1snap+copyproc+io1,"
             "mem1snap+copyproc+base,mem1snap+copyproc+crc,mem2snap+copyproc")
    proc = _bench("--dry-run", "--out", str(tmp_path), "--variants", names, "--base-site", "/opt/base-site", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    blocks = {b.split("\n", 1)[0]: b for b in proc.stdout.split("# ")[1:]}
    assert set(names.split(",")) <= set(blocks), list(blocks)
    assert "--manual-gc" in blocks["none+mgc"] and "--manual-gc" in blocks["mem1snap+copyproc+mgc"]
    assert "--manual-gc" not in blocks["mem8snap+copyproc"]
    assert "--non-persistent-save-interval 8 " in blocks["mem8snap+copyproc"]
    assert "--non-persistent-save-interval 2 " in blocks["mem2snap+copyproc"]  # mem<K>: any interval
    assert "PYTHONPATH=/opt/base-site" + os.pathsep in blocks["mem1snap+copyproc+base"]  # the baseline's cpuckpt first
    assert "/opt/base-site" not in blocks["mem1snap+copyproc+io1"]
    unset = _bench("--dry-run", "--out", str(tmp_path), "--variants", "mem1snap+copyproc+base", cwd=REPO)
    assert unset.returncode != 0 and "--base-site" in unset.stderr, unset.stderr


def test_dry_run_takes_the_synchronization_variants(tmp_path: Path) -> None:
    """+timers (Megatron-LM's level-1 timers, against none+timers) and the probes (benchmarks/probe)."""
    names = ("none+timers,mem1snap+copyproc+timers,mem1snap+copyproc+syncstart,mem1snap+copyproc+syncstep,"
             "torch_dist8+timers,cpuckpt8+mgc,mem1snap+copyproc+gcfreeze,mem1snap+copyproc+nodma+nod2d,"
             "mem1snap+copyproc+log10,none+log10")
    proc = _bench("--dry-run", "--out", str(tmp_path), "--variants", names, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    blocks = {b.split("\n", 1)[0]: b for b in proc.stdout.split("# ")[1:]}
    assert all("--timing-log-level 1" in blocks[n] for n in ("none+timers", "mem1snap+copyproc+timers"))
    assert "--timing-log-level" not in blocks["mem1snap+copyproc+syncstart"]
    assert "--save-interval 8 " in blocks["torch_dist8+timers"] and "--manual-gc" in blocks["cpuckpt8+mgc"]
    assert "--non-persistent-save-interval 1 " in blocks["mem1snap+copyproc+gcfreeze"]
    assert "GOODPUT_PROBE=syncstart" in blocks["mem1snap+copyproc+syncstart"]
    assert "GOODPUT_PROBE=syncstep" in blocks["mem1snap+copyproc+syncstep"]
    assert "GOODPUT_PROBE=nodma,nod2d" in blocks["mem1snap+copyproc+nodma+nod2d"]
    assert "GOODPUT_PROBE" not in blocks["mem1snap+copyproc+gcfreeze"]
    assert "--non-persistent-save-interval 1 " in blocks["mem1snap+copyproc+log10"]
    for n in ("none+log10", "mem1snap+copyproc+log10"):  # the last one given is Megatron-LM's
        assert blocks[n].rindex("--log-interval") == blocks[n].index("--log-interval 10"), blocks[n]
    assert "--log-interval 10" not in blocks["none+timers"]
    # every variant is checked before the first runs, and every error is said at once (one run here)
    bad = _bench("--dry-run", "--out", str(tmp_path), "--iters", "60", "--variants",
                 "none,none+syncstart,mem1+nod2d,mem1snap+nodma,mem1+log0,none+log30,mem1snap+fast,"
                 "mem1snap+copyproc+bsum+crc", cwd=REPO)
    assert bad.returncode != 0 and "# none\n" not in bad.stdout, bad.stdout  # nothing ran
    for variant, why in (("none+syncstart", "unknown variant none+syncstart"), ("mem1+nod2d", "device snapshot"),
                         ("mem1snap+nodma", "copy process"), ("mem1+log0", "N >= 1"),
                         ("none+log30", "fewer than 3 log lines"), ("mem1snap+fast", "unknown change"),
                         ("mem1snap+copyproc+bsum+crc", "one at most")):
        assert why in bad.stderr and variant in bad.stderr, (variant, bad.stderr)


def test_the_probes_patch_what_they_are_asked_for(tmp_path: Path) -> None:
    """benchmarks/probe: with GOODPUT_PROBE, cpuckpt's function is patched once its module is imported (and still
    runs); the copy process is handed no copies, the snapshot copies nothing. ``syncstep`` patches the strategy module
    the same way (importing it takes megatron-core's ~7 s: the name is checked in the source instead)."""
    code = ("from cpuckpt.integrations.megatron import deferred\n"
            "deferred.defer(lambda: print('started'))\n"
            "print('starts', deferred.start_all(), hasattr(deferred.start_all, '__wrapped__'))\n"
            "import torch\n"
            "from array import array\n"
            "from types import SimpleNamespace as NS\n"
            "from cpuckpt.tier.images import ImageSink\n"
            "from cpuckpt.transfer import device_snapshot\n"
            "from cpuckpt.transfer.sinks import DeviceCopies\n"
            "sent = {}\n"
            "copier = NS(submit=lambda files, chunks, **kw: sent.update(kw))\n"
            "sink = NS(images=NS(copier=copier, describe=list), _opened=[1], _chunks=[], checksum=True,\n"
            "          cfg=NS(io=NS(chunk_bytes=1)))\n"
            "ImageSink.submit_offload(sink, DeviceCopies(torch.zeros(1), None, array('q', [1, 2, 3])), 'crc32c')\n"
            "dst, src = torch.zeros(3), torch.ones(3)\n"
            "device_snapshot.torch._foreach_copy_([dst], [src])\n"
            "print('copied', int(dst.sum()), 'ops', len(sent['ops']))\n")
    for probe, want in (("syncstart,nodma,nod2d", "starts 1 True\ncopied 0 ops 0\n"),
                        ("", "starts 1 False\ncopied 3 ops 3\n"), ("syncstep", "starts 1 False\ncopied 3 ops 3\n")):
        env = {**os.environ, "GOODPUT_PROBE": probe,
               "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks" / "probe"),
                                              *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert want in proc.stdout, (probe, proc.stdout)
    probe = (REPO / "benchmarks" / "probe" / "sitecustomize.py").read_text()
    assert '"syncstep": ("cpuckpt.integrations.megatron.strategy", _sync_before_a_step)' in probe
    assert "\ndef order_pending_saves(" in (REPO / "integrations" / "megatron" / "strategy.py").read_text()


def test_alt_probes_every_other_save_only(tmp_path: Path) -> None:
    """``alt``: nod2d acts on the saves of odd starts only, and each start says which it was, before it runs."""
    code = ("from cpuckpt.integrations.megatron import deferred\n"
            "from cpuckpt.transfer import device_snapshot\n"
            "import torch\n"
            "def start():\n"
            "    dst = torch.zeros(3)\n"
            "    device_snapshot.torch._foreach_copy_([dst], [torch.ones(3)])\n"
            "    print('copied', int(dst.sum()), flush=True)\n"
            "for _ in range(3):\n"
            "    deferred.defer(start)\n"
            "    deferred.start_all()\n"
            "deferred.start_all()\n")  # nothing to start: not counted
    env = {**os.environ, "GOODPUT_PROBE": "alt,nod2d",
           "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks" / "probe"),
                                          *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("probe: alt:", "copied"))]
    assert lines == ["probe: alt: start 1 probed", "copied 0", "probe: alt: start 2 plain", "copied 3",
                     "probe: alt: start 3 probed", "copied 0"], proc.stdout


def test_pace_and_dmadelay_probes_hold_the_copy_process_copies(tmp_path: Path) -> None:
    """``pace<G>``: the copy process's ``_foreach_copy_`` enqueues at G GB/s at most; ``dmadelay<MS>``: a save's
    copies start MS ms late, from where it opens the trainer's event (``Event.from_ipc_handle``, once per save). Only
    the copy process is patched, which runs ``cpuckpt.tier.copier`` as ``__main__`` and starts with the probe."""
    site = str(REPO / "benchmarks" / "probe" / "sitecustomize.py")
    code = ("import importlib.util, time, torch\n"
            f"spec = importlib.util.spec_from_file_location('probe_site', {site!r})\n"
            "probe = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(probe)  # not the copy process: patches nothing itself\n"
            "slept, real_sleep = [], time.sleep\n"
            "def sleep(s):  # the probe's waits, counted (and waited)\n"
            "    slept.append(round(s, 3))\n"
            "    real_sleep(s)\n"
            "time.sleep = sleep\n"
            "real_copy, real_open = torch._foreach_copy_, torch.cuda.Event.__dict__['from_ipc_handle']\n"
            "def save(n):\n"
            "    t0 = time.monotonic()\n"
            "    try:\n"
            "        torch.cuda.Event.from_ipc_handle(0, b'x')  # a save opens the trainer's event (no CUDA here)\n"
            "    except Exception:\n"
            "        pass\n"
            "    for _ in range(n):\n"
            "        torch._foreach_copy_([torch.empty(4 << 20, dtype=torch.uint8)], [torch.ones(4 << 20, "
            "dtype=torch.uint8)])\n"
            "    return round(time.monotonic() - t0, 3)\n"
            "print('untouched', torch._foreach_copy_ is real_copy, probe._pacing('pace0'), probe._pacing('pacex'))\n"
            "probe.pace_foreach_copy(torch, 1.0, 0.0)\n"
            "print('pace1', save(20))\n"
            "torch._foreach_copy_ = real_copy\n"
            "torch.cuda.Event.from_ipc_handle = real_open\n"
            "probe.pace_foreach_copy(torch, 0.0, 60.0)\n"
            "slept.clear()\n"
            "for _ in range(5):\n"
            "    torch._foreach_copy_([torch.empty(4 << 20, dtype=torch.uint8)], [torch.ones(4 << 20, "
            "dtype=torch.uint8)])\n"
            "print('dmadelay60', save(5), save(5), *slept)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "GOODPUT_PROBE": ""},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    assert rows["untouched"] == ["True", "None", "None"], rows
    assert float(rows["pace1"][0]) >= 0.075, rows  # 20 x 4 MiB at 1 GB/s: the last enqueued ~80 ms after the first
    first, second, *waits = map(float, rows["dmadelay60"])
    assert first >= 0.06 and second >= 0.06 and waits == [0.06, 0.06], rows  # each save once, not each copy
    env = {**os.environ, "GOODPUT_PROBE": "pace30,dmadelay40",
           "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks" / "probe"),
                                          *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    copier = subprocess.run([sys.executable, "-m", "cpuckpt.tier.copier", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # runs as __main__: starts, patched
    assert copier.returncode == 0, copier.stderr
    assert "probe: pace/dmadelay: each save's copies start 40 ms late, at 30 GB/s" in copier.stderr, copier.stderr


def test_two_instruments_and_the_images_sitecustomize_each_run_once(tmp_path: Path) -> None:
    """The probe and the stack sampler on one path (a sampled probed variant): each runs once, then the
    image's own sitecustomize; they ran each other without end before."""
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import sys\nprint('image ran', file=sys.stderr)\n")
    code = ("from cpuckpt.integrations.megatron import deferred\n"
            "f, depth = deferred.start_all, 0\n"
            "while hasattr(f, '__wrapped__'):\n    f, depth = f.__wrapped__, depth + 1\n"
            "print('depth', depth)\n")
    path = [str(REPO / "benchmarks" / "probe"), str(REPO / "benchmarks" / "stack_sampler"), str(image),
            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "GOODPUT_PROBE": "syncstart", "CPUCKPT_SAMPLE_MATCH": "no-such-process",
           "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "depth 1\n" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("image ran") == 1, proc.stderr


def test_megatron_lm_bench_self_test(tmp_path: Path) -> None:
    """benchmarks/bench_megatron_lm.py's parsers and lost-work arithmetic (its --self-test, from the root it reads
    configs/ from), among them the comparison of a relaunch's logged values at a log interval above one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_megatron_lm", "--self-test"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert "ok   log interval 10:" in proc.stdout
