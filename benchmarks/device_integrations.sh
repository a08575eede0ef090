#!/usr/bin/env bash
# The adapters on the GPU machine, in one script (phases: setup, tests, mlm-tests, deepspeed, megatron-lm, example,
# zero (benchmarks/bench_zero_stall.py), loop (benchmarks/bench_loop.py, LOOP_ARGS), goodput-ds
# (benchmarks/bench_goodput_ds.py, GOODPUT_DS_ARGS), goodput (benchmarks/bench_goodput.py: whole Megatron-LM runs, GOODPUT_ARGS,
# bounded by GOODPUT_TIMEOUT, default 420 s; the floor tool runs too when .out/overlap_floor.py is there, and +base
# variants with a baseline commit's cpuckpt wheel when .whl-base/ holds one);
# default all but zero, loop, goodput-ds and goodput). Extra arguments per phase: DS_ARGS, MLM_ARGS.
# megatron-lm: benchmarks/bench_megatron_lm.py, its own phases through MLM_ARGS (default load,reuse,kill;
# "save" is the torch_dist-vs-cpuckpt save comparison), bounded by MLM_TIMEOUT seconds (default 480; the
# script gets --budget MLM_TIMEOUT-20 and skips a phase that cannot fit), e.g.
#   MLM_ARGS="--phases load" bash benchmarks/device_integrations.sh setup megatron-lm
# Needs the carried wheels in .whl/ (for the image's CPython 3.12: megatron-core 0.19.2, deepspeed 0.19.8 (a
# py3-none-any wheel built from its sdist), nvidia-resiliency-ext 0.7.0 (manylinux_2_39), crc32c, hjson, pydantic
# with its pydantic-core, annotated-types, typing-inspection, typing-extensions, tqdm, nvidia-ml-py, psutil, py-spy)
# and, for the megatron-lm, mlm-tests and goodput phases, a Megatron-LM tree (d98e8a64) in .megatron-lm/ (not part of
# this repository; its tests/ and docs/ left out, the carry is 64 MiB at most). Phase blocksum: benchmarks/
# bench_blocksum.py (BLOCKSUM_ARGS).
# Results go to $OUT (logs, JSON) and to stdout (tables).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
phases=${*:-setup tests megatron-lm example deepspeed}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site PATH=/tmp/tools/bin:$PATH
export PYTHONSAFEPATH=1  # the repo root must not shadow the installed cpuckpt (cpuckpt.integrations lives in /tmp/site)
BENCH_PATH=/tmp/site:$PWD  # benchmarks run as modules (python -m benchmarks.X); /tmp/site still wins for cpuckpt
for phase in $phases; do
  echo "=== $phase ($(date +%T))"
  case $phase in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      # --upgrade: a machine still warm from an earlier call would keep that call's cpuckpt
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . \
        || { echo "cpuckpt install failed"; exit 1; }
      # py-spy apart: --target --upgrade above replaces /tmp/site/bin, and the profilers look for it on PATH
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tools \
        .whl/py_spy-*.whl >/dev/null 2>&1 || echo "py-spy install failed (no --pyspy profiles)"
      rm -rf /tmp/site-base
      if ls .whl-base/cpuckpt-*.whl >/dev/null 2>&1; then  # a baseline commit's wheel: goodput's +base variants
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-base \
          .whl-base/cpuckpt-*.whl || { echo "baseline install failed"; exit 1; }
      fi
      python3 -c "import torch, megatron.core, deepspeed, cpuckpt.integrations.megatron as m; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'deepspeed', deepspeed.__version__)"
      ;;
    tests)
      timeout 480 python3 -m pytest --import-mode=importlib -p no:cacheprovider -q -x -o addopts="" --timeout 120 \
        tests/integrations/test_megatron.py tests/integrations/test_megatron_hook.py tests/gpu 2>&1 | tee "$OUT/device_tests.log" | tail -25
      ;;
    mlm-tests)  # the tests that need Megatron-LM itself (megatron.training: its in-tree megatron-core first)
      PYTHONPATH=$PWD/.megatron-lm:/tmp/site timeout 200 python3 -m pytest --import-mode=importlib -p no:cacheprovider \
        -q -x -o addopts="" tests/integrations/test_megatron_hook.py tests/integrations/test_megatron_fallback.py \
        -k "megatron_training or install" -rs 2>&1 | tee "$OUT/device_mlm_tests.log" | tail -15
      ;;
    zero)  # zero-stall: bench state blocked time (with a profile of the call), a real step overlapping its copy
      PYTHONPATH=$BENCH_PATH timeout 240 python3 -m benchmarks.bench_zero_stall --gib 4 --reps 4 --profile \
        --out "$OUT" --dir /root/cpuckpt-zs 2>&1 | tee "$OUT/bench_zero_stall.log" | grep -v "^20" | tail -16
      rm -rf /root/cpuckpt-zs
      ;;
    deepspeed)
      PYTHONPATH=$BENCH_PATH timeout 300 python3 -m benchmarks.bench_deepspeed --out "$OUT" ${DS_ARGS:-} 2>&1 \
        | tee "$OUT/bench_deepspeed.log" | tail -30
      ;;
    megatron-lm)
      (cd .megatron-lm && make -s -C megatron/core/datasets >/dev/null 2>&1 || echo "datasets helpers build failed")
      MLM_TIMEOUT=${MLM_TIMEOUT:-480}
      PYTHONPATH=$BENCH_PATH timeout -k 15 "$MLM_TIMEOUT" python3 -m benchmarks.bench_megatron_lm \
        --megatron-lm .megatron-lm --out "$OUT" --timeout 200 --budget $((MLM_TIMEOUT - 20)) ${MLM_ARGS:-} 2>&1 \
        | tee "$OUT/bench_megatron_lm.log" | grep -v "^\s*$" | tail -70
      ;;
    goodput)
      (cd .megatron-lm && make -s -C megatron/core/datasets >/dev/null 2>&1 || echo "datasets helpers build failed")
      GOODPUT_TIMEOUT=${GOODPUT_TIMEOUT:-420}
      EXTRA=(); [ -f .out/overlap_floor.py ] && EXTRA=(--floor .out/overlap_floor.py)
      [ -d /tmp/site-base ] && EXTRA+=(--base-site /tmp/site-base)  # +base variants
      PYTHONPATH=$BENCH_PATH timeout -k 15 "$GOODPUT_TIMEOUT" python3 -m benchmarks.bench_goodput \
        --megatron-lm .megatron-lm --out "$OUT" --budget $((GOODPUT_TIMEOUT - 20)) "${EXTRA[@]}" ${GOODPUT_ARGS:-} 2>&1 \
        | tee "$OUT/bench_goodput.log" | grep -v "^\s*$" | tail -45
      rm -rf /root/cpuckpt-goodput /dev/shm/cpuckpt*
      ;;
    blocksum)  # benchmarks/bench_blocksum.py: blocksum32's reduction and the snapshot's copy beside a step
      PYTHONPATH=$BENCH_PATH timeout 300 python3 -m benchmarks.bench_blocksum --json "$OUT/bench_blocksum.json" \
        ${BLOCKSUM_ARGS:-} 2>&1 | tee "$OUT/bench_blocksum.log" | tail -8
      ;;
    goodput-ds)  # benchmarks/bench_goodput_ds.py: whole DeepSpeed runs per variant (GOODPUT_DS_ARGS)
      EXTRA=(); [ -d /tmp/site-base ] && EXTRA=(--base-site /tmp/site-base)  # +base variants
      PYTHONPATH=$BENCH_PATH timeout -k 15 "${GOODPUT_DS_TIMEOUT:-480}" python3 -m benchmarks.bench_goodput_ds \
        --out "$OUT" "${EXTRA[@]}" ${GOODPUT_DS_ARGS:-} 2>&1 | tee "$OUT/bench_goodput_ds.log" | grep -v "^\s*$" | tail -14
      rm -rf /root/cpuckpt-goodput-ds /dev/shm/cpuckpt*
      ;;
    loop)  # benchmarks/bench_loop.py: a plain loop checkpointing every iteration through MemoryTier (LOOP_ARGS)
      PYTHONPATH=$BENCH_PATH CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 300 python3 -m benchmarks.bench_loop --out "$OUT" \
        ${LOOP_ARGS:-} 2>&1 | tee "$OUT/bench_loop.log" | grep -v "^cpuckpt\|^removed" | tail -12
      rm -rf /dev/shm/cpuckpt-bench-loop-*
      ;;
    example)  # examples/megatron on the GPU: train, SIGKILL during the save of step 15, resume
      A="examples/megatron/train.py --device cuda --save /tmp/mg --steps 20 --save-interval 5 --events /tmp/mg.events --snapshot-dir /tmp/mg.snap"
      timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $A --kill-at-step 15 > "$OUT/example_kill.log" 2>&1
      echo "kill run exit code: $? (expected non-zero: SIGKILL)"
      timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $A --resume > "$OUT/example_resume.log" 2>&1
      echo "resume run exit code: $?"
      grep -h -E "skipping|resumed from|bit-identical|done: step" "$OUT/example_resume.log" | tail -6
      ;;
  esac
done
