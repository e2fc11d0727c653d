#!/usr/bin/env bash
# On the H200 (device tool), after `bash .gpu/a/stage.sh` and `bash .gpu/b/stage.sh` in the calls before:
#   run(command="bash bench/gpu/h200_engine.sh", carry=[".gpu/c", ".whl"])
# Stage microbench (flow fp32 vs bf16, vocoder), then the in-process engine benchmark with
# the full-size random model and vLLM. Everything lands in $OUT.
set -uo pipefail
# Run from the repo root: .gpu/c and .whl live there; the code is this script's tree (a frozen
# snapshot under .gpu/snap when other work is in progress in the checkout).
. "$(dirname "$0")/prepare.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
# Warm vLLM's imports (writes its .pyc) and the model dir while the stage bench runs.
( python3 -c "import vllm.engine.arg_utils, vllm.v1.engine.async_llm" > $OUT/preimport.log 2>&1 ) &
( python3 -c "from pathlib import Path; from engine.hub import resolve_model; print(resolve_model('full-random', Path('/tmp/models')))" > $OUT/model.log 2>&1 ) &
timeout 150 python3 -m bench.stage_bench --device cuda --batches 1,8,32,64 --json $OUT/stage_bench.json 2>&1 | tee $OUT/stage.log
wait
echo "prep+stage bench done at $((SECONDS - T0)) s"
timeout $((560 - (SECONDS - T0))) python3 -m bench.engine_bench --model full-random --cache-dir /tmp/models --device cuda \
  --lm-backend vllm --sessions 1,8,32,64 --warm-level --no-text-normalization --json $OUT/engine_vllm.json \
  > $OUT/engine_vllm.log 2>&1
echo "engine bench rc=$? at $((SECONDS - T0)) s"
grep -v "^(EngineCore" $OUT/engine_vllm.log | grep -v "^\s*$" | tail -25
