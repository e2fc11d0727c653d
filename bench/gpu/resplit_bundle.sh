#!/usr/bin/env bash
# Here (not on the device): moves the tail of the vLLM bundle's first part into its second,
# so that each of the two staging calls stays under the device tool's 64 MiB per call with
# this repo's tracked files beside it (they grow a round at a time: round 42 found part a
# 0.03 MiB over). Run once after ../shared/gpu/make-vllm-bundle .gpu ...; idempotent.
# Then as before: run "bash .gpu/a/stage.sh" carrying .gpu/a, and at once
# "bash .gpu/b/stage.sh" carrying .gpu/b alone (the wheels travel with the next call:
# bench/gpu/prepare.sh installs them).
# Usage: bash bench/gpu/resplit_bundle.sh [.gpu] [bytes kept in part a, default 48000000]
set -euo pipefail
G="${1:-.gpu}"
KEEP="${2:-48000000}"
if [ -f "$G/a/core.so.xz" ]; then
  head -c "$KEEP" "$G/a/core.so.xz" > "$G/a/core.so.xz.part1"
  tail -c +"$((KEEP + 1))" "$G/a/core.so.xz" > "$G/b/core.so.xz.part2"
  cat "$G/a/core.so.xz.part1" "$G/b/core.so.xz.part2" | cmp - "$G/a/core.so.xz"
  rm "$G/a/core.so.xz"
fi
test -f "$G/a/core.so.xz.part1" && test -f "$G/b/core.so.xz.part2" || { echo "no bundle under $G" >&2; exit 1; }
cat > "$G/a/stage.sh" <<'STAGE'
#!/usr/bin/env bash
# On the device: first call. Keeps the first part of vLLM's compiled core in /tmp; stage b
# joins the rest (split by bench/gpu/resplit_bundle.sh) and unpacks it.
set -euo pipefail
D="$(cd "$(dirname "$0")" && pwd)"
mkdir -p /tmp/site/vllm
cp "$D/core.so.xz.part1" /tmp/core.so.xz.part1
echo "stage a done"
STAGE
cat > "$G/b/stage.sh" <<'STAGE'
#!/usr/bin/env bash
# On the device: second call, within 30 s of the first (the machine stays warm that long).
# Joins and unpacks vLLM's core, unpacks the rest; then: export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
D="$(cd "$(dirname "$0")" && pwd)"
test -f /tmp/core.so.xz.part1 || { echo "stage a missing: the machine was not warm; run stage a again" >&2; exit 3; }
mkdir -p /tmp/site/vllm
cat /tmp/core.so.xz.part1 "$D/core.so.xz.part2" | xz -dc > /tmp/site/vllm/_C_stable_libtorch.abi3.so
xz -dc "$D/site.tar.xz" | tar xf - -C /tmp/site
touch /tmp/site/.vllm-ready
echo "stage b done"
STAGE
chmod +x "$G/a/stage.sh" "$G/b/stage.sh"
for d in a b; do echo "$G/$d: $(du -sm "$G/$d" | cut -f1) MiB"; done
