#!/usr/bin/env bash
# Set up, then run the test suite (CPU, small sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
