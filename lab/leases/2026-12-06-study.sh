#!/usr/bin/env bash
# Lease of 2026-12-06: the convergence study (64^3, 4,000 optimizer steps, 5 seeds) on the H100, resumed call after
# call. The study writes into runs/study (ignored), not data/: the working tree that each call copies in would
# otherwise replace the folder the study is writing. A fresh machine starts from the committed tables; a warm one
# keeps its tables, checkpoints and Inductor cache. Each call packs the study folder into $OUT/convergence.tgz
# (unpack here with: tar -xzf convergence.tgz -C data/).
# Usage: COMMIT=<sha> LIMIT=<s> CONFIGS=a,b JOBS=n [GRACE=40] bash lab/leases/2026-12-06-study.sh
#   Give the call's timeout at least LIMIT + GRACE + 60 s (set-up and packing).
#   STUDY_OUT: the tree it writes (runs/study; the queue's is runs/queue/data, a copy of data/).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
study=${STUDY_OUT:-runs/study}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor MEDDDPM_GIT_COMMIT=${COMMIT:?the commit the call runs}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv >> "$out/gpu-state.csv"
if [ ! -d "$study" ]; then
  mkdir -p "$study"
  for d in data/*/convergence; do [ -d "$d" ] && mkdir -p "$study/${d#data/}" && cp -r "$d"/. "$study/${d#data/}"; done
fi
# --time-limit starts no run after LIMIT, but a run that finishes training near it still samples (a minute or more
# for fp32): GRACE seconds past LIMIT, SIGTERM stops the study (its runs keep their checkpoints), so the packing
# below always runs. The log goes to $OUT too: a call that overruns its limit returns no output.
timeout --signal=TERM "$(( ${LIMIT:-540} + ${GRACE:-40} ))" \
  python3 -m medddpm study --configs "${CONFIGS:-baseline,opt1,bf16,fp16,best}" --jobs "${JOBS:-4}" \
  --time-limit "${LIMIT:-540}" --out "$study" --work runs/convergence 2>&1 | grep --line-buffered -v "it/s\]$" \
  | tee -a "$out/study.log"
(o=$(cd "$out" && pwd); cd "$study" && tar czf "$o/convergence.tgz" */convergence)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv >> "$out/gpu-state.csv"
ls runs/convergence/*/ 2>/dev/null | head -40
echo "lease: done at $SECONDS s"
