#!/usr/bin/env bash
# The GPU work still owed, in the issue's order, advanced by any call on either card (lab/leases/tools/lease_queue.py holds
# the order, the done checks and the estimates). It does the next owed items that fit LIMIT seconds, packs each one
# into $OUT as it ends (NN-<item>.tgz, the sixth and later into 06-more.tgz; unpack them in order from the repository
# root), and prints what it did, what it skipped and why, and what is left, in minutes ($OUT/queue.log).
# Usage (carry .whl, and runs/autotune.tgz if there is one):
#   COMMIT=<sha> LIMIT=560 bash lab/leases/queue.sh
#   DRY_RUN=1 [CARD=nvidia-h200] [LIMIT=560] bash lab/leases/queue.sh      (on the CPU: the order, skips and minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -n "${DRY_RUN:-}" ]; then  # on the CPU: the project's .venv where there is one
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec "$py" lab/leases/tools/lease_queue.py plan
fi
out=${OUT:-runs/out}; mkdir -p "$out" runs/queue
out=$(cd "$out" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 OUT=$out
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor MEDDDPM_GIT_COMMIT=${COMMIT:?the commit the call runs} COMMIT
python3 -m ipykernel install --user > /dev/null
[ -d runs/queue/data ] || cp -r data runs/queue/data  # the machine's data tree, once per machine
source lab/leases/tools/inductor-cache.sh && autotune_in queue
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active \
  --format=csv 2>&1 | tee -a "$out/queue.log"
# the setup above counts against LIMIT
LIMIT=$((${LIMIT:-560} - SECONDS)) python3 lab/leases/tools/lease_queue.py run 2>&1 | tee -a "$out/queue.log"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader 2>&1 | tee -a "$out/queue.log"
