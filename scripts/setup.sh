#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned requirements into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# --no-compile: pip would write bytecode for every module of every package (half of a fresh install: 182 s against
# 88 s on a 2-core machine); Python writes it for the modules a run imports, the first time they are imported.
.venv/bin/python -m pip install -q --no-compile -r requirements.txt
.venv/bin/python -c "import torch, medddpm; print('torch', torch.__version__, '| cuda' if torch.cuda.is_available() else '| cpu')"
# Kernels started from .venv read its etc/ipython: leave out ipykernel's notice about its signed local transport.
mkdir -p .venv/etc/ipython && cp scripts/ipython_kernel_config.py .venv/etc/ipython/
