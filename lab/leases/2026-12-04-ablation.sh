#!/usr/bin/env bash
# Lease of 2026-12-04: the ablation of best at 128^3 (best, and best without each of its levers; step times only).
# The compiled variants are compiled first, six at a time, by one-step benches that share one Inductor cache
# (runs/inductor, which a warm machine keeps between calls); the ablation sweep then times them one after another
# from that cache. A second call resumes the sweep: finished variants are skipped.
#   LABEL: the card's label (nvidia-h200); ABLATION_OUT: the data tree it writes (data; the queue's is runs/queue/data);
#   VARIANTS: the compiled variants to warm up, comma-separated (default: every one).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
deadline=${DEADLINE:-585}
label=${LABEL:-nvidia-h200} tree=${ABLATION_OUT:-data}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -m ipykernel install --user > /dev/null
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv > "$out/gpu-state-$(date +%H%M).csv"
if [ ! -f "runs/inductor/.warm-$label" ]; then
  python3 -c "import sys; from medddpm.configs import ablation; want = set(filter(None, sys.argv[1].split(',')))
[print(c.name) for c in ablation() if c.compile and (not want or c.name in want)]" "${VARIANTS:-}" > runs/variants.txt
  timeout 330 xargs -P 6 -I{} sh -c 'python3 -m medddpm bench --size 128 --mask-channels 3 --warmup 1 --micro-steps 1 \
    --configs "{}" > "runs/warm-{}.log" 2>&1; echo "warm {}: exit $? at $(date +%T)"' < runs/variants.txt
  echo "warm-up done at $SECONDS s"
  touch "runs/inductor/.warm-$label"
fi
left=$((deadline - SECONDS - 25))
timeout -k 10 "$left" python3 -m medddpm ablation --preset paper --out "$tree" --gpu-label "$label" 2>&1 | grep -v "it/s\]" | tail -30 | tee "$out/ablation.log"
tar czf "$out/ablation.tgz" -C "$tree" "$label/ablation"
for f in runs/warm-*.log; do echo "== $f"; tail -n 4 "$f"; done > "$out/warm.log" 2>&1
echo "lease: done at $SECONDS s"
