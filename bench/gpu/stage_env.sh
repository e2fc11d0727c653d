# Sourced (not run) by the bench/gpu/*_checks.sh scripts that need no vLLM, from the repo
# root on the device machine: installs the carried server-stack wheels (.whl, built here by
# bench/gpu/wheels.sh), exports the environment and writes the full-size random model.
# Sets T0.
T0=$SECONDS
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "from pathlib import Path; from engine.hub import resolve_model; resolve_model('full-random', Path('/tmp/models'))" || exit 5
echo "model ready at $((SECONDS - T0)) s"
