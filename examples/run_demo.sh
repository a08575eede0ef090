#!/usr/bin/env bash
# The README's main job: train a small model with asynchronous cpuckpt checkpoints, SIGKILL it in the
# middle of a save, resume from the newest complete checkpoint, verify the result bit for bit against an
# uninterrupted run, and compare checkpoint stall/throughput with DCP (~1-2 minutes on a 2-core CPU box).
# Makes .venv (if missing) and installs torch (pinned CPU wheel) and cpuckpt into it, like tests/run.sh.
# Works from any directory; arguments go to examples/demo.py (relative paths such as --workdir are taken
# from the directory you call it from), e.g. `bash examples/run_demo.sh --quick`.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check .
export PYTHONUNBUFFERED=1
cd "$CALLER_DIR"
exec "$REPO/.venv/bin/python" "$REPO/examples/demo.py" "$@"
