#!/usr/bin/env bash
# On the H200, after the bundle is staged (calls 1-2 of the usual workflow):
#   run(command="bash bench/gpu/lm_step.sh", carry=[".gpu/c", ".whl"])
# `bench.lm_step` once per variant (VARIANTS, default "default vllmmin compiled"); the first
# variant also samples the engine core with py-spy and runs vLLM's torch profiler (SPY=0: not;
# ARGS: more bench.lm_step arguments for every variant). Everything
# lands in $OUT/lm_step.tgz; the per-variant lines, py-spy summaries and kernel table also
# come back as files of their own.
set -uo pipefail
. "$(dirname "$0")/prepare.sh"
W=/tmp/lm_step_out
rm -rf $W && mkdir -p $W
first=1
for V in ${VARIANTS:-default vllmmin compiled}; do
  extra="${ARGS:-}"
  [ $first = 1 ] && [ "${SPY:-1}" = 1 ] && extra="$extra --pyspy /tmp/site_bin/py-spy --profile"
  timeout ${PER_VARIANT:-200} python3 -m bench.lm_step --variant $V --out $W $extra > $W/lm_step_$V.log 2>&1
  echo "$V rc=$? at $((SECONDS - T0)) s"
  grep "engine started\|first chunks:\|decode:\|py-spy:\|failed\|Error" $W/lm_step_$V.log | cut -c1-900
  first=0
  # after each variant, so a call cut short keeps what it measured
  tar -czf $OUT/lm_step.tgz -C $W . && cp $W/*_top.txt $OUT/ 2>/dev/null
  find $W -name "profiler_out_*.txt" -exec cp {} $OUT/ \; 2>/dev/null
done | tee $OUT/lm_step_lines.txt
