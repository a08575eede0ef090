#!/usr/bin/env bash
# The README's test command: makes .venv (if missing), installs cpuckpt (non-editable, so tests
# exercise the installed package) with its test extras, runs ruff and the test-suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k reader`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check ".[test]"
.venv/bin/ruff check .
export PYTHONUNBUFFERED=1
exec .venv/bin/pytest --import-mode=importlib -p no:cacheprovider --durations=15 "$@"
