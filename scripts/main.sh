#!/usr/bin/env bash
# Set up, then run the main job on the embedded MNI data on whatever device is present: the model
# summary, the measurement sweep into data/<gpu-slug>/<config>/ (every configuration at 128^3 on a
# GPU; the paper's four at the tiny `smoke` size on a CPU, so that it ends in minutes), and the book
# (_build/html/index.html), in which this machine now appears beside the committed results.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if $py -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  preset=paper; configs=${CONFIGS:-all}
else
  preset=smoke; configs=${CONFIGS:-paper}
fi
$py -m medddpm info --size 128 --mask-channels 3
$py -m medddpm sweep --preset "$preset" --configs "$configs" --out data
# Then the book, built from everything under data/ (this machine's results included).
BOOK_SKIP_SETUP=1 bash scripts/book.sh
