#!/usr/bin/env bash
# The README's test command: makes .venv (if missing), installs cpuckpt (non-editable, so tests
# exercise the installed package) with its test extras, runs ruff and the test-suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k reader` (`-n 0` runs it serially).
#
# The install is skipped when nothing it depends on changed since the last one: a stamp in .venv
# records a hash of pyproject.toml, README.md and every file under cpuckpt/, integrations/ and
# configs/ (and the torch pin). A fresh clone has no stamp, so it installs everything;
# CPUCKPT_REINSTALL=1 forces the install.
#
# The tests run on CPUCKPT_TEST_WORKERS pytest-xdist workers (default 4: most of the time goes to
# waiting on spawned ranks and trainers, not to computing, so more workers than cores pay off);
# `--dist loadgroup` keeps the tests marked `xdist_group` together on one worker; `--no-loadscope-reorder`
# keeps the collection order (tests/conftest.py: the longest files first) instead of starting groups first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.cpuckpt-install-stamp
stamp() {
  {
    echo "$TORCH_PIN"
    find pyproject.toml README.md cpuckpt integrations configs -type f \
      ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
}
WANT=$(stamp)
if [ "${CPUCKPT_REINSTALL:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
   && .venv/bin/python -c "import importlib.metadata as m; m.distribution('cpuckpt'); m.distribution('pytest-xdist')" \
      2>/dev/null; then
  echo "run.sh: cpuckpt sources and pyproject.toml unchanged since the last install; not reinstalling"
else
  rm -f "$STAMP"
  # torch first and pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_PIN"
  .venv/bin/python -m pip install -q --disable-pip-version-check ".[test]"
  echo "$WANT" > "$STAMP"
fi
.venv/bin/ruff check .
export PYTHONUNBUFFERED=1
exec .venv/bin/pytest --import-mode=importlib -p no:cacheprovider --durations=15 \
  -n "${CPUCKPT_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder "$@"
