#!/usr/bin/env bash
# Set up, then run the test suite (CPU, small sizes). The book's browser test needs Debian chromium:
# installed here with apt-get when /usr/bin/chromium is missing (driven by the playwright package).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ] && command -v apt-get > /dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends chromium
fi
exec .venv/bin/python -m pytest -q "$@"
