#!/usr/bin/env bash
# Lease of 2026-12-07: best against its new levers, decided in one process on one warm machine.
#   1. Warm Inductor's cache: every variant's training step and denoising step (and the sampling variants' batch
#      shapes) compiled by short benches, WARM_JOBS at a time, sharing runs/inductor. Skipped where a warm machine
#      compiled them in an earlier call (runs/inductor/.levers-warm lists them).
#   2. lab/leases/tools/levers.py until the deadline: the variants interleaved (train, then sample), each
#      variant's kernels, its quality against strict FP32, seconds per volume over batches; into runs/levers-data,
#      which a second call on the warm machine resumes (each phase and variant measured before is skipped).
#   3. With the time left: the other levers' micro-benchmarks, where their code is present
#      (lab/leases/tools/bench-gn.py, lab/leases/tools/bench-conv.py).
#   4. $OUT: levers-data.tgz (the tables, as data/<label>/levers/), autotune.tgz (Triton's tuned block sizes: carry
#      it back in as runs/autotune.tgz), logs.tgz, gpu-state.csv, summary.txt. It exits 0 once nothing is owed, 3
#      while a second call has more to measure (lab/leases/queue.sh then runs it again).
# Usage (GPU): bash lab/leases/2026-12-07-levers.sh            (DEADLINE=570 by default; a second call resumes)
#        (CPU): DEVICE=cpu SIZE=16 bash lab/leases/2026-12-07-levers.sh
# VARIANTS: the configurations, best first; names the code does not know yet are left out with a line saying so.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
deadline=${DEADLINE:-570}
device=${DEVICE:-cuda}
size=${SIZE:-128}
label=${LABEL:-}
# The H100 call of 2026-12-07 also ran best+conv=triton and best+condition_once=true (both retired after it:
# lab/notebook/retired-levers.md); the code no longer knows them, so a name of theirs is left out.
VARIANTS=${VARIANTS:-"best best+tap_major=true best+conv_autotune=true best+group_norm=triton"}
if [ "$device" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
  preset=paper; warm_jobs=${WARM_JOBS:-5}; rounds=${ROUNDS:-5}; steps=${STEPS:-15}; batches=${BATCHES:-1,2,4,8}
else
  preset=smoke; warm_jobs=${WARM_JOBS:-1}; rounds=${ROUNDS:-3}; steps=${STEPS:-2}; batches=${BATCHES:-1,2}
fi
[ "$size" = 128 ] || [ "$device" = cpu ] || preset=paper  # a GPU always measures the paper's model
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export BENCH_CACHE=runs/inductor AUTOTUNE_IN=runs/autotune.tgz
source lab/leases/tools/inductor-cache.sh
autotune_in levers
state=runs/levers-data
if [ ! -d "$state" ] && [ -f runs/levers-data.tgz ]; then  # carried back in after the machine was given back
  mkdir -p "$state" && tar -xzf runs/levers-data.tgz -C "$state" && echo "levers: earlier tables carried in"
fi
logs=runs/levers-logs; mkdir -p "$logs" "$state"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv > "$out/gpu-state.csv"

variants=$(python3 - $VARIANTS << 'EOF'
import sys
from medddpm.configs import ConfigError, get_config
for name in sys.argv[1:]:
    try:
        print(get_config(name).name)
    except ConfigError as e:
        print(f"levers: {name} left out ({e})", file=sys.stderr)
EOF
)
echo "levers: $(echo $variants | wc -w) variants: $(echo $variants)"
sampling=$(echo "$variants" | head -1)  # the batches phase's configuration (levers.py's batch_configs)

# 1. Inductor's cache, WARM_JOBS benches at a time; what a warm machine compiled before is not compiled again
warm=$BENCH_CACHE/.levers-warm; touch "$warm"
jobs=$( (for v in $variants; do echo "train $v"; done; for v in $variants; do echo "sample $v"; done
         for v in $sampling; do echo "batches $v"; done) | grep -vxF -f "$warm")  # in the order the call needs them
if [ -n "$jobs" ]; then
  echo "$jobs" | timeout $((deadline / 2)) xargs -P "$warm_jobs" -L 1 sh -c '
    what=$0 v=$1 log="'"$logs"'/warm-$0-$(echo "$1" | tr "+=" "__").log"
    case $what in
      train) python3 -m medddpm bench --preset '"$preset"' --mask-channels 3 --device '"$device"' --warmup 1 \
               --micro-steps 1 --configs "$v" > "$log" 2>&1 ;;
      sample) python3 -m medddpm bench --phase sample --preset '"$preset"' --mask-channels 3 --device '"$device"' \
               --warmup 1 --micro-steps 1 --configs "$v" > "$log" 2>&1 ;;
      batches) python3 -m medddpm sample-batches --preset '"$preset"' --mask-channels 3 --device '"$device"' \
               --batches '"$batches"' --warmup 1 --micro-steps 1 --configs "$v" --out runs/levers-warm > "$log" 2>&1 ;;
    esac && echo "$what $v" >> '"$warm"'; echo "warm $what $v: exit $? at $(date +%T)"'
fi
echo "levers: warm-up done at $SECONDS s"

# 2. the measurement, until the deadline less the packing's time
timeout -k 10 $((deadline - SECONDS - 40)) python3 lab/leases/tools/levers.py --variants "$(echo $variants | tr ' ' ,)" \
  --preset "$preset" --rounds "$rounds" --steps "$steps" --sample-steps "$steps" --batches "$batches" \
  --device "$device" --out "$state" --deadline $((deadline - SECONDS - 50)) ${label:+--gpu-label "$label"} \
  2>&1 | tee "$logs/levers.log" | grep -v "it/s\]"
rc=${PIPESTATUS[0]}  # 0: nothing owed; 3: a second call resumes; 124: stopped by the deadline

# 3. the other levers' micro-benchmarks, with what is left
for bench in bench-gn bench-conv; do
  f=lab/leases/tools/$bench.py
  if [ -f "$f" ] && [ $((deadline - SECONDS)) -gt 90 ]; then
    help=$(python3 "$f" --help 2>&1); args=()  # the options each takes, as its help names them
    grep -q -- "--json" <<< "$help" && args+=(--json "$logs/$bench.json")
    grep -q -- "--device" <<< "$help" && args+=(--device "$device")
    [ "$device" = cpu ] && export TRITON_INTERPRET=1
    timeout $((deadline - SECONDS - 40)) python3 "$f" "${args[@]}" > "$logs/$bench.log" 2>&1
    echo "$bench: exit $? at $SECONDS s"; tail -n 15 "$logs/$bench.log"
  fi
done

# 4. what comes back
(cd "$state" && tar -czf - .) > "$out/levers-data.tgz"
autotune_out "$out"
tar -czf "$out/logs.tgz" -C runs levers-logs
python3 - "$state" $variants > "$out/summary.txt" << 'EOF'
import sys
import warnings
from pathlib import Path

from medddpm.report.beyond import lever_call, lever_verdicts

warnings.simplefilter("ignore")
call = lever_call(Path(sys.argv[1]))
print(lever_verdicts(call, base=sys.argv[2]).to_string(index=False, float_format="%.3f"))
b = call["sample_batches"]
if len(b):
    print(b[["config", "batch", "status", "step_median_ms", "volume_s", "peak_mem_bytes"]].to_string(index=False))
EOF
cat "$out/summary.txt"
echo "lease: done at $SECONDS s (levers.py exit $rc)"
exit "$rc"
