#!/usr/bin/env bash
# On the H200, right after h200_engine.sh (machine still warm, /tmp/site ready):
#   run(command="bash bench/gpu/h200_lm.sh")
# 1. vLLM decode speed, unified-vocab lm_head vs speech-only head (same process image, same run).
# 2. Exact parity: torch fp32 vs vLLM fp32 (TRITON_ATTN, IEEE fp32 dots), greedy.
set -uo pipefail
# Run from the repo root: .gpu/c and .whl live there; the code is this script's tree (a frozen
# snapshot under .gpu/snap when other work is in progress in the checkout).
. "$(dirname "$0")/prepare.sh"
for H in unified speech; do
  timeout 200 python3 -m bench.lm_parity --mode speed --head $H --out $OUT --export-dir /tmp/exp-$H > $OUT/speed-$H.log 2>&1
  echo "speed $H rc=$? at $((SECONDS - T0)) s"
  grep "lm_parity\|vllm c=\|Error\|error" $OUT/speed-$H.log | tail -8
done
HEAD=speech
grep -q '"error"' $OUT/lm_parity-speed-bfloat16-speech.json 2>/dev/null && HEAD=unified
left=$((570 - (SECONDS - T0)))
TRITON_F32_DEFAULT=ieee timeout $left python3 -m bench.lm_parity --mode parity --dtype float32 --head $HEAD \
  --enforce-eager --out $OUT --export-dir /tmp/exp-fp32 > $OUT/parity-fp32.log 2>&1
echo "parity fp32 ($HEAD) rc=$? at $((SECONDS - T0)) s"
grep "lm_parity\|identical\|attention backend\|Error" $OUT/parity-fp32.log | tail -20
