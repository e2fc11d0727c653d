#!/usr/bin/env bash
# Here (not on the device): re-cuts the vLLM bundle of ../shared/gpu/make-vllm-bundle into three
# parts, .gpu/a, .gpu/b and .gpu/c, so that each staging call stays under the device tool's
# 64 MiB a call with this repo's tracked files beside it (they grow a round at a time: round
# 42 found two parts 0.03 MiB over, round 61 the second part ~2 MiB over). The parts are cut
# from one stream, vLLM's compiled core (core.so.xz) then the site packages (site.tar.xz).
# Then, three calls back to back (the machine stays warm 30 s between calls):
#   run "bash .gpu/a/stage.sh" carrying .gpu/a; "bash .gpu/b/stage.sh" carrying .gpu/b;
#   "bash .gpu/c/stage.sh" carrying .gpu/c (the wheels travel with the next call:
#   bench/gpu/prepare.sh installs them).
# Accepts the bundle as make-vllm-bundle writes it (a/core.so.xz, b/site.tar.xz) or as an
# earlier run of this script left it (two or three parts); idempotent.
# Usage: bash bench/gpu/resplit_bundle.sh [.gpu] [bytes a part, default 40000000]
set -euo pipefail
G="${1:-.gpu}"
PART="${2:-40000000}"
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
if [ -f "$G/a/core.so.xz" ]; then cp "$G/a/core.so.xz" "$T/core.so.xz"; cp "$G/b/site.tar.xz" "$T/site.tar.xz"
elif [ -f "$G/a/core.so.xz.part1" ]; then  # the two-part layout of rounds 42-60
  cat "$G/a/core.so.xz.part1" "$G/b/core.so.xz.part2" > "$T/core.so.xz"; cp "$G/b/site.tar.xz" "$T/site.tar.xz"
elif [ -f "$G/a/bundle.part" ]; then
  cat "$G/a/bundle.part" "$G/b/bundle.part" "$G/c/bundle.part" > "$T/all"
  CORE=$(sed -n 's/^CORE_BYTES=//p' "$G/c/stage.sh")
  head -c "$CORE" "$T/all" > "$T/core.so.xz"; tail -c +"$((CORE + 1))" "$T/all" > "$T/site.tar.xz"; rm "$T/all"
else echo "no bundle under $G" >&2; exit 1; fi
xz -t "$T/core.so.xz" && xz -t "$T/site.tar.xz"
CORE=$(stat -c %s "$T/core.so.xz")
TOTAL=$(( CORE + $(stat -c %s "$T/site.tar.xz") ))
[ "$TOTAL" -le $(( 3 * PART )) ] || { echo "bundle of $TOTAL bytes does not fit three parts of $PART" >&2; exit 1; }
rm -rf "$G/a" "$G/b" "$G/c"; mkdir -p "$G/a" "$G/b" "$G/c"
cat "$T/core.so.xz" "$T/site.tar.xz" > "$T/all"
head -c "$PART" "$T/all" > "$G/a/bundle.part"
dd if="$T/all" of="$G/b/bundle.part" iflag=skip_bytes,count_bytes skip="$PART" count="$PART" status=none
tail -c +"$((2 * PART + 1))" "$T/all" > "$G/c/bundle.part"
cat "$G/a/bundle.part" "$G/b/bundle.part" "$G/c/bundle.part" | cmp - "$T/all"
for p in a b; do
  cat > "$G/$p/stage.sh" <<STAGE
#!/usr/bin/env bash
# On the device: keeps part $p of the vLLM bundle in /tmp; .gpu/c/stage.sh joins and unpacks.
set -euo pipefail
cp "\$(cd "\$(dirname "\$0")" && pwd)/bundle.part" /tmp/vllm-bundle.$p
echo "stage $p done"
STAGE
done
cat > "$G/c/stage.sh" <<STAGE
#!/usr/bin/env bash
# On the device: the third call, within 30 s of the second. Joins the three parts, unpacks
# vLLM's core and the site packages; then: export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
CORE_BYTES=$CORE
D="\$(cd "\$(dirname "\$0")" && pwd)"
for p in a b; do
  test -f /tmp/vllm-bundle.\$p || { echo "stage \$p missing: the machine was not warm; stage a, b, c again" >&2; exit 3; }
done
mkdir -p /tmp/site/vllm
cat /tmp/vllm-bundle.a /tmp/vllm-bundle.b "\$D/bundle.part" > /tmp/vllm-bundle.all
rm -f /tmp/vllm-bundle.a /tmp/vllm-bundle.b
# Files, not pipes: under pipefail a reader that stops early (head) fails its writer.
head -c "\$CORE_BYTES" /tmp/vllm-bundle.all | xz -dc > /tmp/site/vllm/_C_stable_libtorch.abi3.so
tail -c +"\$((CORE_BYTES + 1))" /tmp/vllm-bundle.all | xz -dc | tar xf - -C /tmp/site
rm -f /tmp/vllm-bundle.all
touch /tmp/site/.vllm-ready
echo "stage c done"
STAGE
chmod +x "$G/a/stage.sh" "$G/b/stage.sh" "$G/c/stage.sh"
for d in a b c; do echo "$G/$d: $(du -sm "$G/$d" | cut -f1) MiB"; done
