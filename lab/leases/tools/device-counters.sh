#!/usr/bin/env bash
# For a time-limited GPU lease: Nsight Compute counters for runs already measured
# (`python -m medddpm counters`), one run at a time until DEADLINE_S seconds after the script started;
# after each, the run folders' run.parquet and ncu.parquet (and ncu's logs and CSVs) are packed into
# $OUT, so that what was counted comes back even if the lease ends in the middle of the next one.
# Usage: lab/leases/tools/device-counters.sh DEADLINE_S RUN_DIR [RUN_DIR ...]   (e.g. data/nvidia-h200/bf16)
#   COUNTERS_ARGS: more `python -m medddpm counters` flags, e.g. "--coverage 0.9".
#   Inductor's cache is device-bench.sh's (lab/leases/tools/inductor-cache.sh), so that on a warm lease a compiled
#   configuration benched (or profiled) just before can start its ncu pass from the cache instead of compiling and
#   tuning under ncu (on the H200, compiling under ncu, best-ckpt's library pass did not reach its step in 306 s;
#   from a cache a bench had just filled, its both pass reached the step and profiled 141 launches, 79.8% of the
#   step, in 357 s); AUTOTUNE_IN carries block sizes in.
# Unpack here with: tar -xzf counters.tgz   (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/../../.."
deadline=$1
shift
out=${OUT:-runs/out}
mkdir -p "$out" runs/ncu
out=$(cd "$out" && pwd)
python3 -m medddpm counters --check "$@" || exit 2  # every folder, before any profiling
source lab/leases/tools/inductor-cache.sh
autotune_in device-counters || exit 2
for run in "$@"; do
  left=$((deadline - SECONDS))
  if ((left < 120)); then
    echo "device-counters: $run not started, $left s left"
    continue
  fi
  echo "device-counters: $run, $left s left"
  # shellcheck disable=SC2086 - COUNTERS_ARGS is a list of flags
  timeout -k 5 "$left" python3 -m medddpm counters "$run" --timeout $((left - 20)) ${COUNTERS_ARGS:-}
  tar -czf "$out/.counters.tgz" "${@/%//run.parquet}" "${@/%//ncu.parquet}" --ignore-failed-read 2>/dev/null
  mv "$out/.counters.tgz" "$out/counters.tgz"
  tar -czf "$out/.ncu.tgz" --exclude='*.ncu-rep' -C runs ncu && mv "$out/.ncu.tgz" "$out/ncu.tgz"
  autotune_out "$out"
done
