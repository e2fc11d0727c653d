#!/usr/bin/env bash
# On the H200 machine (device tool); needs no vLLM, only the server-stack wheels:
#   run(command="CONFIGS='flow_split_prefix_rows=0 flow_split_prefix_rows=1' bash bench/gpu/stage_ab.sh", carry=[".whl"])
# Stage settings A/B on the stage alone (bench/stage_syncs.py, the engine's own stage, full-size
# random model): one process per setting in CONFIGS (space-separated; a setting is one or more
# EngineConfig FIELD=VALUE joined by commas; a piece without "=" continues the value before it,
# as in flow_graph_frames=60,70,80), the same batches in each; then how far each
# one's PCM is from the first's. Results: $OUT/stage_<i>.{json,log,npz}, i = 0, 1, ..., and
# $OUT/stage_<i>_pcm.txt (i >= 1: that difference, as printed)
# Environment: CONFIGS (default: the two attention kernels), ROWS (batch sizes, default 1,64),
# REPS (10), KERNELS (12: the top kernels), OPENING (0; N: every row an utterance's first
# chunk of N tokens, `stage_syncs --opening`), TAIL (log lines shown per setting).
set -uo pipefail
. "$(dirname "$0")/stage_env.sh"
read -r -a configs <<< "${CONFIGS:-flow_attention=sdpa flow_attention=cudnn}"
for i in "${!configs[@]}"; do
  left=$(( 585 - (SECONDS - T0) ))
  [ "$left" -ge 60 ] || { echo "${configs[$i]}: no time left"; break; }
  flags=()
  IFS=',' read -r -a fields <<< "${configs[$i]}"
  for f in "${fields[@]}"; do
    if [[ "$f" == *=* ]] || [ "${#flags[@]}" -eq 0 ]; then flags+=(--config "$f")
    else flags[-1]="${flags[-1]},$f"; fi  # the next item of a tuple value: flow_graph_frames=60,70,80
  done
  timeout "$left" python3 -m bench.stage_syncs --batches "${ROWS:-1,64}" --reps "${REPS:-10}" \
    --kernels "${KERNELS:-12}" --opening "${OPENING:-0}" "${flags[@]}" --pcm $OUT/stage_$i.npz \
    --json $OUT/stage_$i.json > $OUT/stage_$i.log 2>&1
  echo "[$i] ${configs[$i]} rc=$? at $((SECONDS - T0)) s"
  grep -E "chunks: wall|attention|fmha|cudnn|families" $OUT/stage_$i.log | head -${TAIL:-12}
  if [ "$i" -gt 0 ]; then
    python3 -c "from pathlib import Path; from bench.stage_syncs import pcm_difference as d; \
print('PCM relative RMS difference from [0]:', d(Path('$OUT/stage_0.npz'), Path('$OUT/stage_$i.npz')))" \
      | tee $OUT/stage_${i}_pcm.txt
  fi
done
