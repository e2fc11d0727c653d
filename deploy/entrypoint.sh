#!/bin/sh
# The GPU image's entrypoint: `cosyvoice-gateway "$@"`, under an NVIDIA MPS daemon of the
# container's own when COSYVOICE_MPS=1.
#
# Why MPS: vLLM's engine core and the audio stage are separate processes on one GPU, and
# without MPS their kernels take turns in time slices. Under MPS they run side by side: on
# one H200 a 64-session burst's opening round took 165-197 ms in most levels against 265-438
# without, first audio p95 a median of 409 ms against 671 (docs/benchmarks.md, round 19).
#
# The daemon serves the GPUs this container sees, through a pipe directory inside it
# (CUDA_MPS_PIPE_DIRECTORY, inherited by the gateway and its child processes), and is told to
# quit once the gateway has exited. SIGTERM and SIGINT go to the gateway, which drains its
# sessions as usual. The daemon needs nvidia-cuda-mps-control in the container (the NVIDIA
# container toolkit mounts it with the `compute` capability) and a GPU whose compute mode
# allows it; when it cannot start, the container stops with the daemon's message rather
# than serving without what was asked for.
set -eu

if [ "${COSYVOICE_MPS:-0}" != 1 ]; then
  exec cosyvoice-gateway "$@"
fi

export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/cosyvoice-mps/pipe}"
export CUDA_MPS_LOG_DIRECTORY="${CUDA_MPS_LOG_DIRECTORY:-/tmp/cosyvoice-mps/log}"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ! nvidia-cuda-mps-control -d; then
  echo "COSYVOICE_MPS=1: the NVIDIA MPS daemon did not start (is nvidia-cuda-mps-control in the" \
       "container, and the GPU's compute mode DEFAULT or EXCLUSIVE_PROCESS?)" >&2
  exit 1
fi
echo "NVIDIA MPS daemon started (pipe directory $CUDA_MPS_PIPE_DIRECTORY)" >&2

# The trap is set before the gateway starts: a signal between its start and a later trap
# killed this shell and left the gateway running, and the daemon with it.
gateway=
signalled=
trap 'signalled=1; [ -z "$gateway" ] || kill -TERM "$gateway" 2>/dev/null || true' TERM INT
cosyvoice-gateway "$@" &
gateway=$!
[ -z "$signalled" ] || kill -TERM "$gateway" 2>/dev/null || true
# `wait` returns early (128 + the signal) when a trapped signal arrives: wait again until the
# gateway is gone. The shell can reap the gateway within the interrupted wait (a test run once
# exited 143 after the gateway's clean 0), so after such a return one more wait asks the
# shell for the status it kept (dash and bash keep it; 127: it kept none).
status=0
while :; do
  wait "$gateway" && status=0 || status=$?
  kill -0 "$gateway" 2>/dev/null || break
done
if [ -n "$signalled" ] && [ "$status" -gt 128 ]; then
  wait "$gateway" 2>/dev/null && status=0 || { again=$?; [ "$again" = 127 ] || status=$again; }
fi
echo quit | nvidia-cuda-mps-control || echo "the NVIDIA MPS daemon did not take quit" >&2
exit "$status"
