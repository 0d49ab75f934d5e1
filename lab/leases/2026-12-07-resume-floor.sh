#!/usr/bin/env bash
# Lease of 2026-12-07: kill-and-resume on a GPU, judged against the floor that two uninterrupted runs set.
# On a GPU, cuDNN's algorithms and atomics are not deterministic: two uninterrupted runs of one command differ too.
# For each configuration (opt1: eager TF32; best: compiled, CUDA graphs), at 32^3, the same command three times:
#   a, b: uninterrupted, STEPS optimizer steps;  cut: SIGKILLed once its first checkpoint is on disk, then resumed.
# Every tensor of the final checkpoints (weights, EMA, Adam's state, RNG states) and the loss logs are compared
# pairwise (a-b: the floor; a-cut and b-cut: the resume), group by group; $OUT/resume-floor-<config>.json keeps the maximum
# absolute difference per tensor and per group, and the logs; resume_floor.py judges it: the resume passes where every
# group's distance is within FACTOR (10) times the floor, bit-exact where the floor is zero.
# First the card's roofs when ROOFS_LABEL is set (written to $OUT/roofs.parquet).
# Usage: CONFIGS="opt1 best" ROOFS_LABEL=nvidia-h200 bash lab/leases/2026-12-07-resume-floor.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
if [ "${DEVICE:-cuda}" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv > "$out/gpu-state.csv"
if [ -n "${ROOFS_LABEL:-}" ]; then
  python3 -m medddpm roofs --out runs/roofs --gpu-label "$ROOFS_LABEL" > "$out/roofs.log" 2>&1 \
    && cp "runs/roofs/$ROOFS_LABEL/roofs.parquet" "$out/roofs.parquet"
  tail -12 "$out/roofs.log"; echo "roofs: done at $SECONDS s"
fi
steps=${STEPS:-60}
every=${SAVE_EVERY:-10}
configs=${CONFIGS:-opt1 best}
rm -rf runs/resume
train() {  # config folder: the same command for every run
  python3 -m medddpm train --config "$1" --out "$2" --size 32 --mask-channels 3 --pairs 4 --grad-accum 2 \
    --steps "$steps" --save-every "$every" --log-every 1 --device "${DEVICE:-cuda}"
}
compare() {  # config: its record, written as soon as its three runs are done, and its verdict (lab/leases/tools/resume_floor.py)
  python3 lab/leases/tools/resume_floor.py record "$out/resume-floor-$1.json" "$1" \
    && python3 lab/leases/tools/resume_floor.py judge "$out/resume-floor-$1.json"
}
logs=runs/resume-logs; mkdir -p "$logs"
for c in $configs; do
  d=runs/resume/$c
  for r in a b; do
    train "$c" "$d/$r" > "$logs/$c-$r.log" 2>&1 || echo "$c: uninterrupted run $r failed (exit $?)"
    echo "$c: run $r done at $SECONDS s"
  done
  train "$c" "$d/cut" > "$logs/$c-cut.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 6000); do [ -f "$d/cut/checkpoint.pt" ] && break; kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
  # train is a shell function run in a background subshell: SIGKILL goes to its child, as a crash would
  if pkill -KILL -P "$pid" -f "medddpm train" 2> /dev/null; then echo "$c: killed at $SECONDS s"; else
    echo "$c: the run ended before the kill"; fi
  wait "$pid" 2> /dev/null
  python3 -c "import torch, sys; print(torch.load(sys.argv[1], weights_only=True)['step'])" \
    "$d/cut/checkpoint.pt" > "$logs/$c-killed-at.txt" 2>&1
  train "$c" "$d/cut" > "$logs/$c-resumed.log" 2>&1 || echo "$c: the resumed run failed (exit $?)"
  echo "$c: resumed run done at $SECONDS s"
  compare "$c"
done
(o=$(cd "$out" && pwd); cd runs && tar czf "$o/resume-logs.tgz" resume-logs) 2> /dev/null
echo "lease: done at $SECONDS s"
