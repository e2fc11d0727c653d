#!/usr/bin/env bash
# On the H200 machine (device tool), the machine still warm from bench/gpu/x2_checks.sh (or
# after `bash .gpu/a/stage.sh`, `bash .gpu/b/stage.sh` and `bash .gpu/c/stage.sh`):
#   run(command="bash bench/gpu/ws_load_run.sh single", carry=[".whl", ".whl_av"])
#   run(command="bash bench/gpu/ws_load_run.sh multi",  carry=[".whl", ".whl_av"])
# The WebSocket load benchmark (bench/ws_load.py) against real gateway processes with the
# full-size random CosyVoice3 model and the vLLM LM:
#   single: one GPU (CUDA_VISIBLE_DEVICES=0): the product at 1..128 sessions, then the
#           baseline (batch 1, whole-prefix flow, no CUDA graphs) at 1, 8, 32, one invocation;
#   multi:  two GPUs: the LM and one flow+vocoder stage on GPU 0, a second stage on GPU 1.
# Environment: LEVELS / BASE_LEVELS (session levels), BASELINE=0 (single: no baseline run),
# RAMP=S (sessions start spread over S seconds instead of all at once; or S1,S2,... one per
# level of LEVELS, e.g. RAMP=16,16,0,0 for spread and burst levels on one gateway), LEVEL_TIMEOUT (s),
# EXTRA="--engine.x y ..." (more gateway options for the product runs),
# VARIANTS="flags A;flags B" (single, product only: one run per variant, each with EXTRA plus
# its flags, written to ws_load_single_v0.json, _v1 ...: an A/B in one device call),
# KNOBS='{"min_hop":0};{"min_hop":8}' (first-chunk planner knobs, or the stage's fill_padding,
# split_call_cost, first_cut, second_cut, rescue, pipeline_lead_ms, hold_ms, burst_hold_ms and burst_rows, set before each level in turn on the same gateway, `bench.ws_load
# --planner-knobs`: an A/B without a second start),
# MPS=1 (run the gateway's processes under an NVIDIA MPS daemon started for this run and
# stopped after it: vLLM's engine-core process and the gateway's stage then share the GPU
# by running kernels side by side, instead of taking turns in time slices),
# PYSPY=S (sample the gateway process for S seconds with py-spy, PYSPY_DELAY seconds, default
# 10, after it is first ready, i.e. inside the first level: $OUT/pyspy_gateway.txt, raw stacks
# per thread, and $OUT/pyspy_top.txt, their summary by `python -m bench.stack_summary`),
# DEADLINE=S (default 585: the runs end S seconds after the script started, for a call whose
# limit is under 600 s, as when little device time is left; the teardown after them, with
# MPS=1 up to ~25 s, comes on top: set it that much under the call's limit),
# WARM=1 (single: first start one gateway for a 1-session level, so the compile caches are
# warm before the runs that count: on a fresh machine the first start compiles for two
# minutes or more, and round 7 lost a variant to it; each run prints its time to ready).
# .whl holds the gateway's server stack (uvicorn with uvloop and httptools, websockets,
# python-multipart, soxr, opuslib), .whl_av PyAV (decodes uploaded voices): neither is in the
# GPU image. Build both here with `bash bench/gpu/wheels.sh`.
set -uo pipefail
MODE="${1:-single}"
END="${DEADLINE:-585}"  # seconds after the start by which every run has ended
. "$(dirname "$0")/prepare.sh"
python3 -c "from pathlib import Path; from engine.hub import resolve_model; print(resolve_model('full-random', Path('/tmp/models')))" > $OUT/model.log 2>&1
COMMON=(--launch --model full-random --model-cache /tmp/models --engine.device cuda --engine.lm-backend vllm
        --engine.text-normalization false --rate 30 --timeout "${LEVEL_TIMEOUT:-90}" ${RAMP:+--ramp "$RAMP"}
        ${KNOBS:+--planner-knobs "$KNOBS"} ${EXTRA:-})
if [ "$MODE" = single ]; then
  export CUDA_VISIBLE_DEVICES=0
  ARGS=(--sessions "${LEVELS:-1,8,32,64,128}")
  [ "${BASELINE:-1}" = 0 ] || ARGS+=(--baseline --baseline-sessions "${BASE_LEVELS:-1,8,32}")
else
  export CUDA_VISIBLE_DEVICES=0,1
  ARGS=(--sessions "${LEVELS:-64,128,256}" --engine.stage-devices cuda:0,cuda:1)
fi
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "MPS daemon started"
    # The daemon's quit waits for its clients: a gateway left running would hold it.
    trap 'pkill -f -- "-m gateway --model"; sleep 2; echo quit | timeout 20 nvidia-cuda-mps-control; echo "MPS daemon stopped"' EXIT
  else
    echo "MPS: the daemon did not start (no nvidia-cuda-mps-control?): running without it"
  fi
fi
echo "prep done at $((SECONDS - T0)) s"
if [ "$MODE" = single ] && [ "${WARM:-0}" = 1 ]; then
  # With variant 0's flags (compiled code can depend on them), leaving 2 minutes at least
  # for the runs that count.
  warm=$(( END - (SECONDS - T0) - 120 )); [ "$warm" -le 300 ] || warm=300
  if [ "$warm" -ge 30 ]; then
    # shellcheck disable=SC2086
    timeout "$warm" python3 -m bench.ws_load "${COMMON[@]}" --sessions 1 ${VARIANTS:+${VARIANTS%%;*}} \
      --json $OUT/warm_up.json > $OUT/warm_up.log 2>&1
    echo "warm-up start rc=$? at $((SECONDS - T0)) s: $(grep -m1 'ready in' $OUT/warm_up.log)"
    # A warm-up cut short leaves its gateway running: let it go before the next one starts.
    pkill -f -- "-m gateway --model" || true
    for _ in $(seq 30); do pgrep -f -- "-m gateway --model" > /dev/null || break; sleep 1; done
  fi
fi
if [ "$MODE" = single ] && [ -n "${VARIANTS:-}" ]; then
  IFS=';' read -ra VS <<< "$VARIANTS"
  for i in "${!VS[@]}"; do
    left=$(( (END - (SECONDS - T0)) / (${#VS[@]} - i) ))  # the time left, shared by the runs still to go
    [ "$left" -ge 30 ] || { echo "variant $i and later: no time left"; break; }
    # shellcheck disable=SC2086
    timeout "$left" python3 -m bench.ws_load "${COMMON[@]}" --sessions "${LEVELS:-1,8,32,64,128}" ${VS[$i]} \
      --json $OUT/ws_load_single_v$i.json > $OUT/ws_load_single_v$i.log 2>&1
    echo "variant $i (${VS[$i]}) rc=$? at $((SECONDS - T0)) s"
    grep -v "^(EngineCore" $OUT/ws_load_single_v$i.log | grep -E "^\[product\]" | tail -8
  done
  exit 0
fi
left=$(( END - (SECONDS - T0) ))
[ "$left" -ge 30 ] || { echo "no time left for the run"; exit 0; }
rm -f /tmp/ws_load_done
if [ -n "${PYSPY:-}" ]; then
  # The gateway's own process (its event loop, the engine's per-token work, vLLM's output
  # handler); the stage and vLLM's engine core are processes of their own.
  (
    until grep -q "ready in" $OUT/ws_load_$MODE.log 2>/dev/null; do
      [ ! -e /tmp/ws_load_done ] || exit 0  # the run ended before a gateway was ready
      sleep 1
    done
    sleep "${PYSPY_DELAY:-10}"
    pid=$(pgrep -f -- "-m gateway --model" | head -1)
    if [ -z "$pid" ]; then echo "py-spy: no gateway process" > $OUT/pyspy.log; exit 0; fi
    /tmp/site_bin/py-spy record --pid "$pid" --duration "$PYSPY" --rate 100 --threads --nonblocking \
      --format raw -o $OUT/pyspy_gateway.txt > $OUT/pyspy.log 2>&1
    python3 -m bench.stack_summary $OUT/pyspy_gateway.txt --rate 100 --duration "$PYSPY" --top 40 \
      > $OUT/pyspy_top.txt 2>&1
  ) &
  spy=$!
fi
timeout "$left" python3 -m bench.ws_load "${COMMON[@]}" "${ARGS[@]}" \
  --json $OUT/ws_load_$MODE.json --plot $OUT/ws_load_$MODE.svg > $OUT/ws_load_$MODE.log 2>&1
echo "ws_load $MODE rc=$? at $((SECONDS - T0)) s"
touch /tmp/ws_load_done
[ -z "${spy:-}" ] || { wait "$spy"; echo "py-spy: $(tail -1 $OUT/pyspy.log 2>/dev/null)"; head -12 $OUT/pyspy_top.txt 2>/dev/null; }
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >> $OUT/ws_load_$MODE.log 2>&1
grep -v "^(EngineCore" $OUT/ws_load_$MODE.log | grep -v "^\s*$" | tail -30
