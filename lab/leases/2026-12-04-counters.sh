#!/usr/bin/env bash
# Lease of 2026-12-04 (one call, about 580 s): opt1's counters completed from the backward of the layer where the
# previous pass stopped, then best-ckpt's counters from a warm Inductor cache (a bench compiles it first).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs/ncu
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv | tee "$out/gpu-state.csv"
timeout 215 python3 -m medddpm counters data/nvidia-h200/opt1 --passes both --merge --coverage 0.9 --timeout 200 \
  --from-backward "conv3d 128>128 k3 s2 @32x32x32" 2>&1 | tail -3 | tee "$out/opt1.log"
tar czf "$out/opt1.tgz" data/nvidia-h200/opt1/run.parquet data/nvidia-h200/opt1/ncu.parquet
bash lab/leases/tools/device-bench.sh $((415 - SECONDS)) warm --size 128 --mask-channels 3 --warmup 2 --micro-steps 3 \
  --configs best-ckpt 2>&1 | tail -4
COUNTERS_ARGS="--passes both" bash lab/leases/tools/device-counters.sh $((575 - SECONDS)) data/nvidia-h200/best-ckpt 2>&1 \
  | tail -3 | tee "$out/best-ckpt.log"
tar czf "$out/ncu-logs.tgz" --exclude='*.ncu-rep' -C runs ncu
echo "lease: done at $SECONDS s"
