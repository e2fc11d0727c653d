#!/usr/bin/env bash
# Carries the compile caches (inductor, Triton, vLLM's torch.compile) from one device machine
# to the next. A gateway on a fresh machine was ready after ~300 s, against ~177 s once the
# caches were warm (round 61): two minutes of each session's 30 of device time.
#   On the device, at the end of a session's runs (the machine still warm):
#     run(command="bash bench/gpu/compile_cache.sh save")       # parts come back from $OUT
#   Here: mkdir -p .gpu/cc && cp /work/.device/N/cc.tgz.* .gpu/cc/   (.gpu is ignored)
#   On the next session's fresh machine, after the bundle's three staging calls:
#     run(command="bash bench/gpu/compile_cache.sh restore", carry=[".gpu/cc"])
# The caches are keyed on what they compiled (the kernels' source, torch and vLLM versions, the
# model's graph, the GPU's architecture): a stale entry is not used, only rebuilt. prepare.sh
# points every cache at /tmp/cc, so restored entries are the ones the gateway looks up.
# `save` writes parts of at most 15 MiB (the device tool returns at most 8 files of 16 MiB)
# and refuses more than 4 parts: with the repo's tracked files the restore call must carry
# them under 64 MiB.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CC=/tmp/cc
PART_BYTES=$((15 * 1024 * 1024))
MAX_PARTS=4
case "${1:-}" in
  save)
    [ -d "$CC" ] || { echo "no compile caches under $CC (did a run source prepare.sh?)"; exit 1; }
    echo "caches: $(du -sh "$CC" | cut -f1) in $(find "$CC" -type f | wc -l) files"
    tar -C "$CC" -czf /tmp/cc.tgz . || exit 2
    size=$(stat -c %s /tmp/cc.tgz)
    parts=$(( (size + PART_BYTES - 1) / PART_BYTES ))
    if [ "$parts" -gt "$MAX_PARTS" ]; then
      echo "compressed caches are $size bytes: more than $MAX_PARTS parts of $PART_BYTES; not saved"; exit 3
    fi
    split -b "$PART_BYTES" -d -a 1 /tmp/cc.tgz "${OUT:?}/cc.tgz."
    sha256sum /tmp/cc.tgz | cut -d' ' -f1 > "$OUT/cc.sha256"
    echo "saved $size bytes in $parts part(s): $(cd "$OUT" && ls cc.tgz.* | tr '\n' ' ')"
    ;;
  restore)
    SRC="$ROOT/.gpu/cc"
    compgen -G "$SRC/cc.tgz.*" > /dev/null || { echo "no saved caches under $SRC"; exit 1; }
    if [ -f "$SRC/cc.sha256" ] && [ "$(cat "$SRC"/cc.tgz.* | sha256sum | cut -d' ' -f1)" != "$(cat "$SRC/cc.sha256")" ]; then
      echo "saved caches damaged (checksum differs): not restored"; exit 2
    fi
    mkdir -p "$CC"
    cat "$SRC"/cc.tgz.* | tar -C "$CC" -xzf - || exit 2
    echo "restored: $(du -sh "$CC" | cut -f1) in $(find "$CC" -type f | wc -l) files"
    ;;
  *) echo "usage: bash bench/gpu/compile_cache.sh save|restore"; exit 64 ;;
esac
