#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="bash bench/gpu/stage_share.sh", carry=[".whl"])
# A burst's opening round, the stage alone and beside a stand-in for the LM (round 19 of
# docs/benchmarks.md). In its own process the gateway's stage took 210-405 ms for 64 opening
# chunks of 17-19 tokens (round 18), against 128 ms alone for 8-token chunks. Three runs of
# bench/stage_syncs.py separate the causes:
#   alone:  64, 40 and 1 opening chunks of $OPENING tokens (the chunk length's share);
#   shared: 64 and 1 beside bench/decode_load.py, a second process stepping an LM-decode-
#           sized CUDA graph of 64 rows $STEPS times a second (vLLM's rate at 64 sessions):
#           the two processes' kernels take turns on the GPU;
#   mps:    the same under an NVIDIA MPS daemon, where they can run side by side.
# Results: $OUT/stage_{alone,shared,mps}.{json,log}, $OUT/decode_load_{shared,mps}.log.
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
S=(python3 -m bench.stage_syncs --opening "${OPENING:-18}" --reps "${REPS:-5}")
timeout 200 "${S[@]}" --batches 64,40,1 --json $OUT/stage_alone.json > $OUT/stage_alone.log 2>&1
echo "alone rc=$? at $((SECONDS - T0)) s"

beside() {  # $1: the run's name
  python3 -m bench.decode_load --rows 64 --steps-per-s "${STEPS:-140}" --seconds 170 > $OUT/decode_load_$1.log 2>&1 &
  local load=$!
  for _ in $(seq 60); do grep -q "decode load running" $OUT/decode_load_$1.log && break; sleep 1; done
  timeout 160 "${S[@]}" --batches 64,1 --json $OUT/stage_$1.json > $OUT/stage_$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS - T0)) s"
  kill $load 2>/dev/null; wait $load 2>/dev/null
  tail -1 $OUT/decode_load_$1.log
}

beside shared
if [ $((SECONDS - T0)) -lt 390 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    beside mps
    echo quit | timeout 20 nvidia-cuda-mps-control
  else
    echo "mps: the daemon did not start"
  fi
else
  echo "mps: no time left"
fi
for f in alone shared mps; do [ -f $OUT/stage_$f.log ] && { echo "== $f"; grep -E "chunks: wall" $OUT/stage_$f.log; }; done
