#!/usr/bin/env bash
# On a 2-GPU H200 machine (device tool, kind nvidia-h200-x2), after `bash .gpu/a/stage.sh` and `bash .gpu/b/stage.sh`:
#   run(command="bash bench/gpu/x2_checks.sh", carry=[".gpu/c", ".whl"], kind="nvidia-h200-x2")
# The correctness and latency checks, two chains in parallel, one GPU each (every result is
# a single-GPU measurement):
#   GPU 0: flow CUDA graphs and the prompt K/V cache vs eager (stage_bench), bistream torch-vs-vLLM parity (fp32),
#          then vLLM decode speed with async scheduling off and on.
#   GPU 1: CosyVoice2 torch-vs-vLLM token parity (fp32), then first audio bistream vs
#          segment mode (engine_bench, text at 30 tokens/s).
# At most 8 files come back from $OUT: the JSON results go there, logs to /tmp/logs (their
# tails are printed at the end).
set -uo pipefail
L=/tmp/logs; mkdir -p $L
. "$(dirname "$0")/prepare.sh"
nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
left() { echo $((575 - (SECONDS - T0))); }
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 -m bench.stage_bench --device cuda --batches 1,8,32,64 --check-batches 3,13 --reps 5 --graphs --prompt-cache \
    --json $OUT/stage_graphs.json > $L/stage_graphs.log 2>&1
  echo "stage_bench rc=$? at $((SECONDS - T0)) s"
  TRITON_F32_DEFAULT=ieee timeout $(( $(left) < 220 ? $(left) : 220 )) python3 -m bench.bistream_parity --out $OUT \
    --dtype float32 --enforce-eager --cases 8 --require-vllm > $L/bistream_parity.log 2>&1
  echo "bistream_parity rc=$? at $((SECONDS - T0)) s"
  for a in "" "--async-scheduling"; do
    [ $(left) -gt 60 ] || break
    timeout $(left) python3 -m bench.lm_parity --mode speed --concurrency 1 16 64 $a \
      --json $OUT/lm_speed${a:+-async}.json > $L/lm_speed${a:+-async}.log 2>&1
    echo "lm speed ${a:-sync} rc=$? at $((SECONDS - T0)) s"
  done
) > $L/chain0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  TRITON_F32_DEFAULT=ieee timeout 240 python3 -m bench.lm_parity --model full-random-cv2 --mode parity --dtype float32 \
    --enforce-eager --out $OUT --json $OUT/lm_parity_cv2.json > $L/lm_parity_cv2.log 2>&1
  echo "lm_parity cv2 rc=$? at $((SECONDS - T0)) s"
  for m in stream segment; do
    [ $(left) -gt 60 ] || break
    timeout $(left) python3 -m bench.engine_bench --model full-random --cache-dir /tmp/models --device cuda \
      --lm-backend vllm --sessions 1,16 --mode $m --text-rate 30 --utterances 2 --no-text-normalization \
      --json $OUT/engine_$m.json > $L/engine_$m.log 2>&1
    echo "engine_bench $m rc=$? at $((SECONDS - T0)) s"
  done
) > $L/chain1.txt 2>&1 &
wait
cat $L/chain0.txt $L/chain1.txt | tee $OUT/checks.log
grep -h "PARITY\|identical\|FAILED\|speedup\|graph\|sessions=" $L/*.log 2>/dev/null | tail -40 | tee -a $OUT/checks.log
