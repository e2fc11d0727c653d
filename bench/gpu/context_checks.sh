#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="bash bench/gpu/context_checks.sh", carry=[".whl"])
# The audio stage over whole utterances with the flow context cache off and on
# (bench/context_bench.py, full-size random model, 16/32/64 utterances in lockstep), then the
# unbounded-ring check against the recomputed whole prefix in bf16.
# Results: $OUT/context_bench.json and .log.
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
TORCH_LOGS=recompiles timeout ${CONTEXT_TIMEOUT:-420} python3 -m bench.context_bench --rows ${ROWS:-16,32,64} --reps 2 \
  ${CHECK---check} --kernels ${KERNELS:-0} \
  --json $OUT/context_bench.json > $OUT/context_bench.log 2>&1
echo "context_bench rc=$? at $((SECONDS - T0)) s"
grep -vE "^\s*$" $OUT/context_bench.log | tail -${TAIL:-20}
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
