"""The wheel built from this repository installs a working ``cpuckpt`` and ``cpuckpt.integrations``.

The repository (without .git, .venv and build leftovers) is copied to tmp_path first, so the build
never writes ``build/`` or ``*.egg-info`` into the source tree (a stale ``build/lib`` would silently
ship deleted modules in later wheels). The wheel is built without build isolation and without
network, installed with ``pip install --target``, and imported in a fresh interpreter whose cwd is
tmp_path and whose PYTHONPATH is only the install target: both ``__file__``s must lie there, i.e.
the top-level ``integrations/`` directory is shipped as ``cpuckpt.integrations`` (pyproject's
``package-dir``), and neither the source tree nor the editable install of the dev venv shadows it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# One worker for the module: its fixture (a wheel built and installed, ~12 s) is then made once, not once per
# pytest-xdist worker that runs one of these tests.
pytestmark = pytest.mark.xdist_group("packaging")

REPO = Path(__file__).resolve().parents[1]
_SKIP_TOP = {".git", ".venv", "venv", "build", "dist", ".ruff_cache", ".pytest_cache", ".whl", ".out"}

_PROBE = r"""
import importlib, json, sys
import cpuckpt.integrations
import cpuckpt
from importlib import metadata
out = {"cpuckpt": cpuckpt.__file__, "integrations": cpuckpt.integrations.__file__,
       "version": cpuckpt.__version__, "entry_points": {}}
dist = metadata.distribution("cpuckpt")
for ep in dist.entry_points:
    try:
        ep.load()
        out["entry_points"][ep.name] = "ok"
    except Exception as e:
        out["entry_points"][ep.name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory).resolve() == REPO:
        skip |= _SKIP_TOP & set(names)
    return skip


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("packaging")
    src, wheels, site = tmp / "src", tmp / "wheels", tmp / "site"
    shutil.copytree(REPO, src, ignore=_ignore, symlinks=True)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src), cwd=tmp)
    (wheel,) = wheels.glob("cpuckpt-*.whl")
    _pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel), cwd=tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"importing the installed wheel failed:\n{proc.stderr[-3000:]}"
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tmp": tmp, "site": site, "wheel": wheel, "probe": probe}


def test_wheel_installs_cpuckpt_and_integrations(installed):
    site = installed["site"].resolve()
    probe = installed["probe"]
    for key in ("cpuckpt", "integrations"):
        path = Path(probe[key]).resolve()
        assert path.is_relative_to(site), f"{key} imported from {path}, not from the installed wheel in {site}"
    assert Path(probe["integrations"]).resolve() == site / "cpuckpt" / "integrations" / "__init__.py"
    version = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert version and probe["version"] == version.group(1), (probe["version"], version)

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "cpuckpt/integrations/__init__.py" in names
    assert not any(n.startswith(("integrations/", "tests/")) for n in names), sorted(names)
    # Every module of every subpackage ships (a subpackage missing from pyproject's package list would not).
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "cpuckpt").rglob("*.py")}
    expected |= {"cpuckpt/" + p.relative_to(REPO).as_posix() for p in (REPO / "integrations").rglob("*.py")}
    missing = expected - set(names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {sorted(missing)}"


def test_wheel_console_scripts_resolve(installed):
    """Every ``[project.scripts]`` entry point of the installed wheel imports (no dangling console script)."""
    bad = {k: v for k, v in installed["probe"]["entry_points"].items() if v != "ok"}
    assert not bad, f"console scripts whose target cannot be imported: {bad}"


def test_cli_outside_the_source_tree_says_where_bench_and_demo_live(installed):
    """From the installed wheel (no benchmarks/ or examples/ beside it), ``bench``/``demo`` exit 2 with
    a clear message instead of a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(installed["site"])
    for cmd in ("bench", "demo"):
        proc = subprocess.run([sys.executable, "-m", "cpuckpt.tools.cli", cmd, "--smoke"], cwd=installed["tmp"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "ships with the cpuckpt source tree" in proc.stderr, proc.stderr
