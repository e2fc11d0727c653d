#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="bash bench/gpu/stage_checks.sh", carry=[".whl"])
# The audio stage alone, three ways (bench/stage_syncs.py, full-size random model):
#   1. this build's defaults (vocoder decode graphs, one-voice prefix graphs up to 16 chunks),
#      with the top kernels per batch size;
#   2. both of those off: the A/B of round 6's changes (same call, same machine);
#   3. the defaults again beside a second process doing LM-decode-sized GPU work
#      (bench/decode_load.py): what sharing the GPU with another process costs the stage,
#      without vLLM or an event loop (round 6: 2-3x slower per frame inside the gateway).
# Results: $OUT/stage_r7_{defaults,off,shared_gpu}.json and .log, $OUT/decode_load.log.
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
S=(python3 -m bench.stage_syncs --reps 3)
timeout 170 "${S[@]}" --batches 1,8,12,16,64 --kernels 12 --json $OUT/stage_r7_defaults.json > $OUT/stage_r7_defaults.log 2>&1
echo "1 defaults rc=$? at $((SECONDS - T0)) s"
timeout 130 "${S[@]}" --batches 1,8,12,16 --config vocoder_cuda_graphs=false --config flow_graph_shared_rows=0 \
  --json $OUT/stage_r7_off.json > $OUT/stage_r7_off.log 2>&1
echo "2 graphs off rc=$? at $((SECONDS - T0)) s"
python3 -m bench.decode_load --rows 64 --steps-per-s 100 --seconds 170 > $OUT/decode_load.log 2>&1 &
LOAD=$!
for _ in $(seq 60); do grep -q "decode load running" $OUT/decode_load.log && break; sleep 1; done
timeout 150 "${S[@]}" --batches 8,16,64 --json $OUT/stage_r7_shared_gpu.json > $OUT/stage_r7_shared_gpu.log 2>&1
echo "3 beside a decode load rc=$? at $((SECONDS - T0)) s"
kill $LOAD 2>/dev/null; wait $LOAD 2>/dev/null
tail -1 $OUT/decode_load.log
for f in defaults off shared_gpu; do echo "== $f"; grep -E "chunks: wall|sync x|families" $OUT/stage_r7_$f.log; done
