#!/usr/bin/env bash
# Set up, then run the main job on the embedded MNI data on whatever device is present:
# the model summary, a timing of the paper's four configurations, a short training run and one
# generated volume. A GPU runs the real 128^3 model; a CPU runs a 32^3 one so it ends in minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
out=${OUT_DIR:-runs/main}
if $py -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  size=128; steps=200; bench=(--warmup 5 --steps 30)
else
  size=32; steps=20; bench=(--warmup 1 --steps 3)
fi
$py -m medddpm info --size "$size" --mask-channels 3
$py -m medddpm bench --size "$size" --configs paper "${bench[@]}" --json "$out/bench.json"
$py -m medddpm train --size "$size" --config baseline --steps "$steps" --out "$out/train"
$py -m medddpm sample --checkpoint "$out/train" --labels mni:1000 --out "$out/samples"
