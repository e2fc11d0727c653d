#!/usr/bin/env bash
# Here (not on the device): builds the wheels the GPU machine lacks (it reaches no registry),
# for its Python 3.12, at the versions this checkout's venv runs:
#   .whl     the gateway's server stack: uvicorn with uvloop + httptools (as `uvicorn[standard]`
#            gives a production install; without them uvicorn falls back to the slower asyncio
#            loop and h11), websockets, python-multipart, soxr, opuslib (Opus over WebSocket;
#            needs the system libopus, which prepare.sh reports)
#            and py-spy (samples the gateway under load: ws_load_run.sh's PYSPY=)
#   .whl_av  PyAV (decodes uploaded voices)
# Both are git-ignored (.gitignore) and carried: run(..., carry=[".whl", ".whl_av"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=(.venv/bin/python -m pip)
version() {
  local v
  v=$("${PIP[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ -n "$v" ] || { echo "wheels.sh: $1 is not installed in .venv (run make install first)" >&2; exit 1; }
  echo "$v"
}
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any)
pkgs=()
for p in uvicorn uvloop httptools websockets python-multipart soxr; do v=$(version "$p"); pkgs+=("$p==$v"); done
opus=$(version opuslib)
av=$(version av)
rm -rf .whl .whl_av
mkdir -p .whl .whl_av
"${PIP[@]}" download -q "${TARGET[@]}" -d .whl "${pkgs[@]}"
"${PIP[@]}" wheel -q --no-deps -w .whl "opuslib==$opus"  # sdist only; pure Python
"${PIP[@]}" download -q "${TARGET[@]}" -d .whl "py-spy==0.4.3"  # a tool, not in .venv: pinned here
"${PIP[@]}" download -q "${TARGET[@]}" -d .whl_av "av==$av"
du -sh .whl .whl_av
ls .whl .whl_av
