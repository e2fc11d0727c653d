# Sourced (not run) by the bench/gpu/*.sh scripts on the device machine, from the repo root:
# stages the vLLM bundle when a carried .gpu/c is there and /tmp/site is not ready yet, installs
# the carried wheels (built here by bench/gpu/wheels.sh: .whl, the server stack with uvloop;
# .whl_av, PyAV), exports the environment and registers our vLLM plugin. Sets ROOT and T0.
BUNDLE="$PWD"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
T0=$SECONDS
if [ ! -f /tmp/site/.vllm-ready ]; then
  if [ -f "$BUNDLE/.gpu/c/stage.sh" ]; then bash "$BUNDLE/.gpu/c/stage.sh" || exit 3
  else echo "vLLM bundle not staged: run .gpu/a/stage.sh and .gpu/b/stage.sh, then carry .gpu/c" >&2; exit 3; fi
fi
for d in .whl .whl_av; do
  if compgen -G "$BUNDLE/$d/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$BUNDLE"/$d/*.whl || exit 4
    # pip --target --upgrade replaces /tmp/site/bin with the last install's own scripts, so
    # each set's scripts (py-spy among them) are kept aside.
    mkdir -p /tmp/site_bin && cp -a /tmp/site/bin/. /tmp/site_bin/ 2>/dev/null || true
  fi
done
export PYTHONPATH=/tmp/site:$ROOT VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# One place for every compile cache, which bench/gpu/compile_cache.sh saves and restores.
export TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor TRITON_CACHE_DIR=/tmp/cc/triton VLLM_CACHE_ROOT=/tmp/cc/vllm
python3 -c "from engine.backends.vllm_model import write_plugin_dist_info as w; w('/tmp/site')"
# What the gateway will run on: uvloop/httptools (a production install) or asyncio/h11, and
# whether Opus over WebSocket can work (opuslib needs the system libopus).
python3 -c "import importlib.util as u, ctypes.util as c; print('server stack: uvloop', bool(u.find_spec('uvloop')), \
'httptools', bool(u.find_spec('httptools')), '| libopus', c.find_library('opus'))"
