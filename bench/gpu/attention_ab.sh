#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="bash bench/gpu/attention_ab.sh", carry=[".whl"])
# The DiT's attention kernels on the stage alone (bench/stage_syncs.py, the engine's own stage,
# full-size random model): `sdpa` (the default) then `cudnn` (--engine.flow-attention), one
# process each (a process's DiT holds one kernel), the same batches in both; then how far
# their PCM differ. Results: $OUT/attention_{sdpa,cudnn}.{json,log,npz}.
# Environment: ROWS (batch sizes, default 1,64), REPS (10), KERNELS (12: the top kernels).
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
for k in sdpa cudnn; do
  left=$(( 585 - (SECONDS - T0) ))
  [ "$left" -ge 60 ] || { echo "$k: no time left"; break; }
  timeout "$left" python3 -m bench.stage_syncs --batches "${ROWS:-1,64}" --reps "${REPS:-10}" \
    --kernels "${KERNELS:-12}" --config flow_attention=$k --pcm $OUT/attention_$k.npz \
    --json $OUT/attention_$k.json > $OUT/attention_$k.log 2>&1
  echo "$k rc=$? at $((SECONDS - T0)) s"
  grep -E "chunks: wall|attention|fmha|cudnn" $OUT/attention_$k.log | head -${TAIL:-12}
done
python3 -c "from pathlib import Path; from bench.stage_syncs import pcm_difference as d; \
print('PCM relative RMS difference, cudnn vs sdpa:', d(Path('$OUT/attention_sdpa.npz'), Path('$OUT/attention_cudnn.npz')))"
