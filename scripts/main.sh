#!/usr/bin/env bash
# Set up, then measure this machine on the embedded MNI data and build the book:
#   1. the model summary (the whole-head model at 128^3);
#   2. the measurement sweep (every configuration at 128^3 on a GPU; the paper's four at the tiny `smoke` size
#      on a CPU, so that it ends in minutes) into data/<label>/<config>/. The label is the device type
#      (nvidia-h200, cpu) unless data/ already holds rows of that type measured on another machine, such as the
#      committed ones: then <type>-<host>, so this machine's rows sit beside those, never over them.
#      MEDDDPM_LABEL names it instead; CONFIGS picks the configurations (e.g. CONFIGS=baseline,best);
#   3. the book (_build/html/index.html), in which this machine appears beside the committed results;
#   4. a summary: what was measured, where, how the fastest configuration compares with the committed rows of
#      the same device type, and where the book is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if $py -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  preset=paper; configs=${CONFIGS:-all}
else
  preset=smoke; configs=${CONFIGS:-paper}
fi
label=()
[ -z "${MEDDDPM_LABEL:-}" ] || label=(--gpu-label "$MEDDDPM_LABEL")
$py -m medddpm info --size 128
# A configuration that failed is recorded with why (the book shows it): the book and the summary come all the
# same, and the script exits as the sweep did.
$py -m medddpm sweep --preset "$preset" --configs "$configs" --out data "${label[@]}" || swept=$?
# Then the book, built from everything under data/ (this machine's results included), and the summary, which
# says where the book is or that its build failed (the failing page is named above it).
book=(--book _build/html/index.html)
BOOK_SKIP_SETUP=1 bash scripts/book.sh || { status=$?; book=(); }
echo
$py -m medddpm summary --out data "${book[@]}" "${label[@]}"
[ -z "${status:-}" ] || { echo "The book's build failed (exit $status): its messages above name the page." >&2; exit "$status"; }
[ -z "${swept:-}" ] || { echo "The sweep's last line above names the configurations that failed." >&2; exit "$swept"; }
