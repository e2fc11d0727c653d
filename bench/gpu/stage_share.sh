#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="bash bench/gpu/stage_share.sh", carry=[".whl"])
# A burst's opening round, the stage alone and beside a stand-in for the LM (round 19 of
# docs/benchmarks.md; round 61 found a 32-row opening round at 195-228 ms in the gateway
# against 90 in round 40). Runs of bench/stage_syncs.py, one per mode in $MODES (default
# "alone mps mps_below"), each timing opening rounds of $BATCHES chunks (default 64,32,8,1) of
# $OPENING tokens (default 12):
#   alone:     the stage by itself;
#   shared:    beside bench/decode_load.py, a second process stepping an LM-decode-sized CUDA
#              graph of $LOAD_ROWS rows (default 32) $STEPS times a second (default 225,
#              vLLM's ~4.4 ms a token in round 61's bursts of 32): the two processes take
#              turns on the GPU;
#   mps:       the same under an NVIDIA MPS daemon, where they run side by side;
#   mps_below: under MPS with the stage the below-normal client (CUDA_MPS_CLIENT_PRIORITY=1,
#              the gateway's default `--engine.stage-mps-priority`).
# Results: $OUT/stage_<mode>.{json,log}, $OUT/decode_load_<mode>.log.
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
BATCHES="${BATCHES:-64,32,8,1}"
S=(python3 -m bench.stage_syncs --opening "${OPENING:-12}" --reps "${REPS:-5}" --batches "$BATCHES")
MODES="${MODES:-alone mps mps_below}"
MPS_UP=0

mps_daemon() {  # started once, for the mps modes
  [ "$MPS_UP" = 1 ] && return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "mps: the daemon did not start"; return 1; }
  MPS_UP=1
  trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
}

beside() {  # $1: the mode's name; the rest: the stage run's environment
  local mode=$1; shift
  python3 -m bench.decode_load --rows "${LOAD_ROWS:-32}" --steps-per-s "${STEPS:-225}" --seconds 170 \
    > $OUT/decode_load_$mode.log 2>&1 &
  local load=$!
  for _ in $(seq 60); do grep -q "decode load running" $OUT/decode_load_$mode.log && break; sleep 1; done
  env "$@" timeout 160 "${S[@]}" --json $OUT/stage_$mode.json > $OUT/stage_$mode.log 2>&1
  echo "$mode rc=$? at $((SECONDS - T0)) s"
  kill $load 2>/dev/null; wait $load 2>/dev/null
  tail -1 $OUT/decode_load_$mode.log
}

for mode in $MODES; do
  if [ $((SECONDS - T0)) -gt "${LAST_START:-400}" ]; then echo "$mode: no time left"; continue; fi
  case $mode in
    alone) timeout 200 "${S[@]}" --json $OUT/stage_alone.json > $OUT/stage_alone.log 2>&1
           echo "alone rc=$? at $((SECONDS - T0)) s" ;;
    shared) beside shared ;;
    mps) mps_daemon && beside mps ;;
    mps_below) mps_daemon && beside mps_below CUDA_MPS_CLIENT_PRIORITY=1 ;;
    *) echo "unknown mode $mode" ;;
  esac
done
for f in $MODES; do [ -f $OUT/stage_$f.log ] && { echo "== $f"; grep -E "chunks: wall" $OUT/stage_$f.log; }; done
