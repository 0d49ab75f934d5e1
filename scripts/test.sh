#!/usr/bin/env bash
# Set up, then run the test suite (CPU, small sizes): the unit tests and the slow ones (marked `slow`:
# sweeps, the book, compiled steps, training CLI runs, notebooks, distributed launches). Extra arguments
# go to pytest after the script's own, so a later -m wins: `bash scripts/test.sh -m "not slow"` is the
# fast loop (what a plain `pytest` runs, pyproject.toml's addopts). The book's browser test needs Debian
# chromium: installed here with apt-get when /usr/bin/chromium is missing (driven by the playwright package).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ] && command -v apt-get > /dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends chromium
fi
# One worker a core (at most 4; PYTEST_WORKERS overrides, 0 runs in this process): most of the suite's
# time is torch.compile tracing on the CPU, single-threaded Python. The cores are shared out among the
# workers and the processes they start (sweeps, notebook kernels): with two workers of two OpenMP threads
# each on two cores, the smoke sweep's test took 428 s instead of 122 s.
cores=$(nproc)
workers=${PYTEST_WORKERS:-$(( cores > 4 ? 4 : cores ))}
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=$(( cores / workers > 1 ? cores / workers : 1 ))
fi
# worksteal: the slow tests take from seconds to minutes, and an idle worker takes the other's pending ones.
# The book is built once a run whichever worker asks first (tests/conftest.py's built_book). The 25 slowest
# tests are listed at the end, so that a run's time can be read test by test.
exec .venv/bin/python -m pytest -q -n "$workers" --dist worksteal --durations=25 -m "slow or not slow" "$@"
