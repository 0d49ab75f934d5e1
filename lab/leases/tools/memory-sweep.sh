#!/usr/bin/env bash
# The memory page's GPU measurements ("what fits where"), most important first, within
# DEADLINE_S seconds of a time-limited lease: the BraTS-size model at batch 1, the whole-head model's
# fastest and checkpointed configurations, then batch 2 of both for the batch line. Each configuration
# is packed into $OUT as soon as it is done (lab/leases/tools/device-sweep.sh: data.tgz, unpack with
# `tar -xzf data.tgz -C data/`); a second call on the same machine skips what is done.
# Usage: lab/leases/tools/memory-sweep.sh DEADLINE_S
set -uo pipefail
cd "$(dirname "$0")/../../.."
deadline=$1
group() {  # PRESET "SWEEP FLAGS" CONFIG... (device-sweep.sh skips what the time left cannot fit)
  local preset=$1 flags=$2
  shift 2
  SWEEP_ARGS="$flags" bash lab/leases/tools/device-sweep.sh "$((deadline - SECONDS))" "$preset" "$@"
}
# No Nsight Compute here (memory and step time are the point); the kernel breakdown for batch 1 only.
group brats "--phases sample,torch,quality" baseline opt1 best best-ckpt
group paper "--phases sample,torch,quality" best best-ckpt opt1-ckpt compile
group brats "--phases=sample,quality --batch 2" best best-ckpt
group paper "--phases=sample,quality --batch 2" best best-ckpt
