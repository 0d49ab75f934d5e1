#!/usr/bin/env bash
# Lease of 2026-12-05: kill-and-resume of training on a GPU, bit-exact against an uninterrupted run.
# For opt1 (CUDA, eager, TF32) and best (compiled, CUDA graphs) at 32^3: one uninterrupted run of STEPS steps, and
# one SIGKILLed once its first checkpoint is on disk, then resumed by the same command. The final checkpoints are
# compared tensor by tensor (weights, EMA, Adam's state, RNG states) and the loss logs line by line. A checkpoint
# is also restored with map_location=cuda (its RNG states then on the GPU), which stopped a resume with
# "RNG state must be a torch.ByteTensor". Writes $OUT/resume.json (one record per configuration) and the logs.
# DEVICE=cpu runs the same check on the CPU (the pip install of the GPU machine's wheels is then skipped).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/out}; mkdir -p "$out" runs
if [ "${DEVICE:-cuda}" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/inductor
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > "$out/gpu-state-$(date +%H%M).csv"
steps=${STEPS:-60}
every=${SAVE_EVERY:-10}
configs=${CONFIGS:-opt1 best}
rm -rf runs/resume
train() {  # config folder: the same command for the whole run, the killed one and its resumption
  python3 -m medddpm train --config "$1" --out "$2" --size 32 --mask-channels 3 --pairs 4 --grad-accum 2 \
    --steps "$steps" --save-every "$every" --log-every 1 --device "${DEVICE:-cuda}"
}
for c in $configs; do
  d=runs/resume/$c
  train "$c" "$d/whole" > "$out/$c-whole.log" 2>&1 || echo "$c: the uninterrupted run failed (exit $?)"
  train "$c" "$d/cut" > "$out/$c-cut.log" 2>&1 &
  pid=$!
  # SIGKILL once the first checkpoint is whole on disk (atomic_write renames it into place)
  for _ in $(seq 1 3000); do [ -f "$d/cut/checkpoint.pt" ] && break; kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
  # the training is the background subshell's child (train is a shell function): SIGKILL goes to it, as a crash would
  if pkill -KILL -P "$pid" -f "medddpm train" 2> /dev/null; then echo "$c: killed at $SECONDS s"; else
    echo "$c: the run ended before the kill"; fi
  wait "$pid" 2> /dev/null
  python3 -c "import torch, sys; print('killed after step', torch.load(sys.argv[1], weights_only=True)['step'])" \
    "$d/cut/checkpoint.pt" > "$out/$c-killed-at.txt" 2>&1
  train "$c" "$d/cut" > "$out/$c-resumed.log" 2>&1 || echo "$c: the resumed run failed (exit $?)"
done
python3 - "$out/resume.json" $configs << 'EOF'
import json, os, sys
from pathlib import Path

import torch

from medddpm.model.unet import ModelSpec
from medddpm.train import checkpoint
from medddpm.train.engine import Engine
from medddpm.train.loop import read_loss_log


def tensors(x, prefix=""):
    """Every tensor of a nested state with its path."""
    if isinstance(x, torch.Tensor):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from tensors(v, f"{prefix}/{i}")


records = []
for config in sys.argv[2:]:
    root = Path("runs/resume") / config
    device = os.environ.get("DEVICE", "cuda")
    rec = {"config": config, "device": torch.cuda.get_device_name() if device == "cuda" else device}
    try:
        whole, cut = (torch.load(root / d / checkpoint.CHECKPOINT, weights_only=True) for d in ("whole", "cut"))
        killed = (Path(sys.argv[1]).parent / f"{config}-killed-at.txt").read_text().strip()
        a, b = dict(tensors(whole)), dict(tensors(cut))
        differ = sorted(k for k in a if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))
        rec |= {"steps": int(whole["step"]), "resumed_steps": int(cut["step"]), "killed": killed,
                "tensors": len(a), "tensors_differing": len(differ), "first_differing": differ[:5],
                "loss_logs_equal": read_loss_log(root / "whole") == read_loss_log(root / "cut"),
                "bit_exact": not differ and a.keys() == b.keys()}
        # a resume that maps the checkpoint onto the GPU: the RNG states arrive as CUDA tensors
        state = checkpoint.read(root / "cut" / checkpoint.CHECKPOINT, map_location=device)
        rec["rng_device_after_map"] = str(state["cpu_rng"].device)
        spec = ModelSpec(**state["spec"])
        engine = Engine(spec, config, device=device)
        engine.load_state_dict(state)
        rec["rng_restored_from_cuda_map"] = bool(torch.equal(torch.get_rng_state(), state["cpu_rng"].cpu()))
    except Exception as e:  # noqa: BLE001 - recorded, and the next configuration still runs
        rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    records.append(rec)
    print(json.dumps(rec))
Path(sys.argv[1]).write_text(json.dumps(records, indent=2) + "\n")
EOF
echo "lease: done at $SECONDS s"
