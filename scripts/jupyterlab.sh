#!/usr/bin/env bash
# Open book pages (MyST text notebooks, book/*.md) as notebooks in JupyterLab:
#   bash scripts/jupyterlab.sh book/explorers.md [book/workshop.md ...] [-- jupyter lab arguments]
# Each page becomes runs/jupyterlab/<page>.ipynb (jupytext, then scripts/page_notebook.py folds the exercises'
# solutions); a notebook there that is newer than its page (edited in JupyterLab) is kept. JupyterLab
# then opens the first one, with the package importable and the data tree the book reads; MyST
# directives render through the jupyterlab-myst extension.
# As root (a container) it adds --allow-root, which jupyter lab otherwise demands. From outside a
# container or a remote machine: bash scripts/jupyterlab.sh book/PAGE.md -- --ip 0.0.0.0 --no-browser
#   JUPYTERLAB_SKIP_SETUP=1     skip scripts/setup.sh (the environment is already set up)
#   JUPYTERLAB_CONVERT_ONLY=1   write the notebooks and print the JupyterLab command, do not start it
#   JUPYTERLAB_OUT              folder for the notebooks (default: runs/jupyterlab)
#   MEDDDPM_DATA         data root the pages read (default: data/ of this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
pages=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pages+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#pages[@]} -eq 0 ]; then
  echo "usage: bash scripts/jupyterlab.sh book/PAGE.md [book/PAGE.md ...] [-- jupyter lab arguments]" >&2
  exit 2
fi
for page in "${pages[@]}"; do
  [ -f "$page" ] || { echo "jupyterlab: no page $page (pages are book/*.md)" >&2; exit 2; }
  # A MyST text notebook names its kernel in its front matter; other Markdown is not a notebook.
  case "$page" in *.md) ;; *) echo "jupyterlab: $page is not a MyST page (book/*.md)" >&2; exit 2 ;; esac
  head -n 20 "$page" | grep -q '^kernelspec:' || {
    echo "jupyterlab: $page is not a MyST text notebook (no kernelspec in its front matter)" >&2; exit 2; }
done
[ "${JUPYTERLAB_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
out=${JUPYTERLAB_OUT:-runs/jupyterlab}
mkdir -p "$out"
notebooks=()
for page in "${pages[@]}"; do
  nb="$out/$(basename "$page" .md).ipynb"
  if [ -f "$nb" ] && [ "$nb" -nt "$page" ]; then
    echo "jupyterlab: keeping $nb (newer than $page; delete it to start again from the page)"
  else
    .venv/bin/python scripts/page_notebook.py "$page" "$nb"
    echo "jupyterlab: $page -> $nb"
  fi
  notebooks+=("$nb")
done
data=${MEDDDPM_DATA:-$repo/data}
# MEDDDPM_LAB=1: charts render as offline JupyterCharts (medddpm.report.charts.setup), not CDN-loading HTML.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" MEDDDPM_DATA="$(cd "$data" && pwd)" MEDDDPM_LAB=1
args=("$@")
# jupyter refuses to run as root unless told; root is the usual user in a container.
if [ "$(id -u)" = 0 ]; then args+=(--allow-root); fi
if [ "${JUPYTERLAB_CONVERT_ONLY:-0}" = 1 ]; then
  echo "PYTHONPATH=$PYTHONPATH MEDDDPM_DATA=$MEDDDPM_DATA MEDDDPM_LAB=1 .venv/bin/jupyter lab ${notebooks[0]} ${args[*]}"
  exit 0
fi
exec .venv/bin/jupyter lab "${notebooks[0]}" "${args[@]}"
