#!/usr/bin/env bash
# Run tests on this CPU under the torch of the GPU machine's image (2.11.0+cu130) instead of the pinned one
# (2.13). The package must run there too, and the two differ where it matters: under torch 2.11, Dynamo gives a
# custom autograd function's inputs zero gradients (pytorch/pytorch#180642, fixed in 2.12), and plain
# checkpointing saves the tensors of such a function inside a checkpointed block (pytorch/pytorch#177396:
# best-ckpt+group_norm=fused saves 3.838 GiB under 2.11, 1.479 GiB under 2.13).
#   bash scripts/test-image-torch.sh [pytest arguments]     default: the model and compiled-step tests
#   IMAGE_TORCH=2.11.0                                       the torch release to install (PyPI's wheel)
# The environment is .venv-torch<version> (about 5 GB: PyPI's torch wheel is a CUDA build, which also
# runs on a CPU). Not part of CI (a 2.6 GB download): run it here before a device call measures a new lever.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${IMAGE_TORCH:-2.11.0}
venv=.venv-torch$version
PYTHON=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
# torch at the image's release, everything the tests and `python -m medddpm` import at the project's pins
"$venv/bin/python" -m pip install -q "torch==$version" \
  $(grep -E '^(numpy|scipy|pandas|pyarrow|tqdm|psutil|nibabel|nilearn|pytest|pytest-xdist|execnet)==' requirements.txt)
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
[ $# -gt 0 ] || set -- tests/test_model.py tests/test_engine.py -k "fused or checkpoint or best_levers or tap or store_skip or store_norm"
# Slow tests too (pyproject.toml leaves them out by default): most of these compile a step.
PYTHONPATH=$PWD exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "slow or not slow" "$@"
