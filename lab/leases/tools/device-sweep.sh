#!/usr/bin/env bash
# For a time-limited GPU lease: measure configurations one at a time until DEADLINE_S seconds after
# the script started, and after each one pack the results (and Nsight Compute's logs and CSVs) into
# $OUT, so that what was measured comes back even if the lease ends in the middle of the next one.
# Usage: lab/leases/tools/device-sweep.sh DEADLINE_S PRESET CONFIG [CONFIG ...]
#   SWEEP_ARGS: more `python -m medddpm sweep` flags, e.g. "--ncu-timeout 150".
#   SWEEP_OUT: the data tree it writes (runs/device-data; the queue's is runs/queue/data, a copy of data/).
# Each configuration runs with --time-limit set to what is left before the deadline (less a margin for
# papermill and packing), so that Nsight Compute, its last phase, shrinks to fit rather than the whole
# configuration being killed.
# Unpack here with: tar -xzf data.tgz -C data/
set -uo pipefail
cd "$(dirname "$0")/../../.."
deadline=$1 preset=$2
shift 2
out=${OUT:-runs/out}
work=${SWEEP_OUT:-runs/device-data}
mkdir -p "$out" "$work" runs/ncu
pack() {
  tar -czf "$out/.data.tgz" -C "$work" . && mv "$out/.data.tgz" "$out/data.tgz"
  tar -czf "$out/.ncu.tgz" --exclude='*.ncu-rep' -C runs ncu && mv "$out/.ncu.tgz" "$out/ncu.tgz"
}
for c in "$@"; do
  left=$((deadline - SECONDS))
  if ((left < 90)); then
    echo "device-sweep: $c not started, $left s left"
    continue
  fi
  echo "device-sweep: $c, $left s left"
  # shellcheck disable=SC2086 - SWEEP_ARGS is a list of flags
  timeout -k 5 "$left" python3 -m medddpm sweep --preset "$preset" --configs "$c" --out "$work" \
    --time-limit $((left - 30)) ${SWEEP_ARGS:-}
  pack
done
