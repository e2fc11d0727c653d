#!/usr/bin/env bash
# On the H200 machine: the DiT's attention kernels on the stage alone, `sdpa` (the default)
# then `cudnn` (--engine.flow-attention), and how far their PCM differ (round 15):
#   run(command="bash bench/gpu/attention_ab.sh", carry=[".whl"])
# Results: $OUT/stage_{0,1}.{json,log,npz}. See stage_ab.sh for ROWS, REPS, KERNELS.
CONFIGS="flow_attention=sdpa flow_attention=cudnn" exec bash "$(dirname "$0")/stage_ab.sh"
