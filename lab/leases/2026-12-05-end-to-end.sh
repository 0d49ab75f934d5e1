#!/usr/bin/env bash
# Lease of 2026-12-05: best trained from NIfTI folders, end to end (data loader included) against the GPU-only step.
# Two folders written by export-data (whole heads in the reference layout at 128^3; BraTS-layout cases at
# 240x240x155 in float64, cropped to the brats preset's 192x192x144), then `sweep --data` on each: the run table
# gets e2e_median_ms beside train_median_ms, the loader's rate, the first pass's cache build, the step's drift over
# 200 timed steps (target: within 5%) and the NVML clock and throttle summary. A second call resumes: folders
# already written and runs already measured are kept.
#   E2E_OUT: the data tree the sweeps write (data; the queue's is runs/queue/data); LABEL: the card's label (as the
#   sweep derives it where unset).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
deadline=${DEADLINE:-585}
tree=${E2E_OUT:-data}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -m ipykernel install --user > /dev/null
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor MEDDDPM_CACHE=$PWD/runs/cache
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv > "$out/gpu-state-$(date +%H%M).csv"

# the folders: one export per subject in parallel, merged into one folder per layout
export_parallel() {  # layout folder count
  local layout=$1 folder=$2 n=$3
  [ -f "$folder/.done" ] && return 0
  rm -rf "$folder" runs/parts-"$layout"; mkdir -p runs/parts-"$layout"
  seq 0 $((n - 1)) | xargs -P 8 -I{} python3 -m medddpm export-data --out runs/parts-"$layout"/{} --pairs 1 \
    --seed {} --layout "$layout" > "$out/export-$layout.log" 2>&1 || { echo "export $layout failed"; return 1; }
  mkdir -p "$folder"
  for part in runs/parts-"$layout"/*/; do cp -rl "$part"/. "$folder"/; done
  touch "$folder/.done"; echo "export $layout: $n subjects at $SECONDS s"
}
export_parallel reference runs/heads 16 || exit 1
export_parallel brats runs/brats 8 || exit 1
du -sh runs/heads runs/brats | tee "$out/folders.txt"

sweep() {  # preset folder
  local left=$((deadline - SECONDS - 40))
  [ "$left" -lt 120 ] && { echo "sweep $1: not started, $left s left"; return 0; }
  timeout -k 10 "$left" python3 -m medddpm sweep --configs best --preset "$1" --data "$2" --micro-steps 200 --warmup 20 \
    --phases '' --out "$tree" ${LABEL:+--gpu-label "$LABEL"} 2>&1 | grep -v "it/s\]" | tail -20 | tee "$out/sweep-$1.log"
}
sweep paper runs/heads
sweep brats runs/brats

python3 - "$tree" <<'PY' | tee "$out/end-to-end.txt"
import glob
import sys
import pandas as pd
from medddpm.store import schema
files = sorted(glob.glob(f"{sys.argv[1]}/*/*/run.parquet"))
run = pd.concat([schema.read_table(f).assign(folder=f.removesuffix("/run.parquet")) for f in files])
run = run[run["data_source"].str.startswith("folder:")]
open("runs/e2e-folders.txt", "w").write("".join(f + "\n" for f in run["folder"]))
cols = ["gpu_slug", "config", "preset", "data_source", "status", "train_median_ms", "e2e_median_ms", "e2e_drift",
        "loader_items_per_s", "cache_build_s", "sm_clock_mhz", "gpu_temp_max_c", "power_limit_w", "throttle_reasons"]
run = run[cols].assign(ratio=run["e2e_median_ms"] / run["train_median_ms"])
print(run.to_string(index=False))
print("targets: ratio <= 1.10, |drift| <= 0.05")
PY
[ -s runs/e2e-folders.txt ] && tar czf "$out/end-to-end.tgz" -T runs/e2e-folders.txt
echo "lease: done at $SECONDS s"
