#!/usr/bin/env bash
# megatron-core + cpuckpt on 2 CPU ranks (torchrun, gloo), ~30 s on a 2-core box: train a tiny GPTModel
# with asynchronous checkpoints, SIGKILL both ranks while a save is in flight, resume from the newest
# *complete* checkpoint (the one Megatron's tracker file names), then check that the loaded state is
# bit-identical to what was saved and that the loss curve carries on exactly where the killed run was.
#
#   bash examples/megatron/run.sh                          # tensor parallel 2: each rank holds half of each matrix
#   TP=1 bash examples/megatron/run.sh                     # data parallel 2: the replicas split the writing
#   KEEP=1 WORKDIR=/tmp/mg bash examples/megatron/run.sh   # keep checkpoints, logs and the event log
#
# Uses the repository's .venv; makes it and installs torch (CPU wheel), cpuckpt and megatron-core into it
# only if it cannot import them (REINSTALL=1 forces that). Works from any directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ "${REINSTALL:-0}" = 1 ] || ! .venv/bin/python -c "import cpuckpt.integrations.megatron, megatron.core" 2>/dev/null
then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # torch first and pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check ".[megatron]"
fi

TP=${TP:-2} STEPS=${STEPS:-20} INTERVAL=${INTERVAL:-5} KILL_AT=${KILL_AT:-15}
WORK=${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/cpuckpt-megatron.XXXXXX")}
mkdir -p "$WORK"
rm -rf "$WORK/ckpt" "$WORK/snapshots" "$WORK/events.jsonl"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
torchrun=(.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2)
train=(examples/megatron/train.py --device cpu --save "$WORK/ckpt" --tp "$TP" --steps "$STEPS"
       --save-interval "$INTERVAL" --events "$WORK/events.jsonl" --snapshot-dir "$WORK/snapshots")
show() { grep -E '^[0-9:]+ \[rank 0\] ' "$1" | grep -vE 'cpuckpt (async_save|load) |host pool|snapshot mode' | sed 's/^/    /'; }

echo "[1/3] train on 2 CPU ranks (tp=$TP), async save every $INTERVAL steps, SIGKILL at step $KILL_AT mid-save"
if "${torchrun[@]}" "${train[@]}" --kill-at-step "$KILL_AT" >"$WORK/train.log" 2>&1; then
  echo "FAIL: the run was not killed (log: $WORK/train.log)"; exit 1
fi
show "$WORK/train.log"
tracker=$(cat "$WORK/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
torn="$WORK/ckpt/iter_$(printf %07d "$KILL_AT")"
torn_complete=$([ -e "$torn/metadata.json" ] && echo yes || echo no)
echo "    after the kill: tracker names step $tracker; $(basename "$torn") has metadata.json: $torn_complete"

echo "[2/3] resume (--resume) and train on to step $STEPS"
if ! "${torchrun[@]}" "${train[@]}" --resume >"$WORK/resume.log" 2>&1; then
  tail -40 "$WORK/resume.log"; echo "FAIL: the resumed run failed (log: $WORK/resume.log)"; exit 1
fi
show "$WORK/resume.log"

echo "[3/3] check"
.venv/bin/python - "$WORK" "$KILL_AT" "$STEPS" "$tracker" "$torn_complete" <<'EOF'
import json
import sys
from pathlib import Path

work, kill_at, steps, tracker, torn_complete = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
starts = [i for i, e in enumerate(events) if e["event"] == "start"]
killed, resumed = events[starts[0]:starts[1]], events[starts[1]:]
losses = lambda run: {e["step"]: float.fromhex(e["loss"]) for e in run if e["event"] == "loss"}  # noqa: E731
finalized = [e["step"] for e in killed if e["event"] == "finalized"]
resume = next(e for e in resumed if e["event"] == "resumed")
kl, rl = losses(killed), losses(resumed)
redo = list(range(resume["step"] + 1, kill_at + 1))
final_tracker = (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
checks = {
    f"killed at step {kill_at} with its save in flight; finalized before: {finalized}":
        any(e["event"] == "kill" and e["step"] == kill_at for e in killed)
        and not any(e["event"] == "done" for e in killed),
    f"the tracker named step {tracker} (the last finalized save), iter_{kill_at:07d} left incomplete":
        finalized and tracker == str(finalized[-1]) and torn_complete == "no",
    f"resumed from step {resume['step']}, skipping {resume['skipped']}":
        finalized and resume["step"] == finalized[-1] and kill_at in resume["skipped"],
    f"loaded state bit-identical to what was saved at step {resume['step']} ({resume['verified']['tensors']} "
    "shards of parameters and Adam exp_avg/exp_avg_sq on 2 ranks, Adam's step, the iteration)":
        resume["verified"]["tensors"] > 0 and not resume["verified"]["mismatches"],
    f"losses of steps {redo[0]}-{redo[-1]} recomputed bit-identical to the killed run's":
        bool(redo) and all(rl[s] == kl[s] for s in redo),
    f"training went on to step {steps}: loss {kl[1]:.4f} (step 1) -> {rl[steps]:.4f}; tracker now names {final_tracker}":
        any(e["event"] == "done" for e in resumed) and rl[steps] < kl[1] and final_tracker == str(steps),
}
for text, ok in checks.items():
    print(f"    {'ok  ' if ok else 'FAIL'} {text}")
print("PASS" if all(checks.values()) else "FAIL")
sys.exit(0 if all(checks.values()) else 1)
EOF
