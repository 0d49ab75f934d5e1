#!/usr/bin/env bash
# For a time-limited GPU lease: `python -m medddpm bench` whose Triton block-size tuning outlives the call.
# Inductor's tuned block sizes (its autotuning of each Triton kernel) are cached per kernel as `*.best_config`
# files as each kernel is tuned; a kernel of the same source on the next machine finds its file and is not
# tuned again. So this runs the bench with Inductor's cache under BENCH_CACHE, first unpacking the block
# sizes carried in (AUTOTUNE_IN), and at the end, even when the time ran out, packs every `*.best_config`
# into $OUT/autotune.tgz (small: the compiled kernels themselves stay behind). Next call: copy autotune.tgz to
# runs/autotune.tgz, carry that path, and run the same bench: compilation again (about 2 minutes for best),
# tuning only for the kernels not tuned yet.
# Usage: lab/leases/tools/device-bench.sh DEADLINE_S NAME BENCH_ARGS...   (writes $OUT/NAME.json)
#   e.g. lab/leases/tools/device-bench.sh 560 bench-best --size 128 --configs best --micro-steps 30
set -uo pipefail
cd "$(dirname "$0")/../../.."
deadline=$1
name=$2
shift 2
out=${OUT:-runs/out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
source lab/leases/tools/inductor-cache.sh
autotune_in device-bench || exit 2
# Leave time to pack what was tuned; `timeout` stops the bench, whose JSON holds every finished configuration.
left=$((deadline - SECONDS - 15))
((left > 0)) || { echo "device-bench: deadline $deadline s leaves no time for the bench" >&2; exit 2; }
timeout -k 5 "$left" python3 -m medddpm bench "$@" --json "$out/$name.json"
rc=$?
autotune_out "$out"
echo "device-bench: bench exit $rc; $(tar -tzf "$out/autotune.tgz" | grep -c '\.best_config$') tuned kernels packed"
exit $rc
