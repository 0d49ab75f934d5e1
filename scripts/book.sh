#!/usr/bin/env bash
# Set up, then build the executable book (Jupyter Book 1, _config.yml/_toc.yml at the repository root)
# into ${BOOK_OUT:-.}/_build/html. Every page is executed (execute_notebooks: force) and the build is
# strict: a cell error, a missing data file or any Sphinx warning fails it, naming the page.
#   MEDDDPM_DATA     data root the pages read (default: data/ of this repository)
#   BOOK_OUT         folder that receives _build/ (default: the repository root)
#   BOOK_SKIP_SETUP  1: skip scripts/setup.sh (the environment is already set up)
#   BOOK_JOBS        pages read (executed) in parallel by this many processes (default: nproc, at most 4)
#   MEDDDPM_STRICT_DATA  1 (the default here): a run folder the pages would leave out (unreadable, incomplete)
#                    fails the build, naming it; 0: the pages leave it out with a warning and show the rest
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
[ "${BOOK_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
export PATH="$repo/.venv/bin:$PATH"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# The pages run with their own folder as working directory: hand them an absolute path.
data=${MEDDDPM_DATA:-$repo/data}
[ -d "$data" ] || { echo "book: MEDDDPM_DATA=$data is not a folder" >&2; exit 1; }
export MEDDDPM_DATA=$(cd "$data" && pwd)
export MEDDDPM_STRICT_DATA=${MEDDDPM_STRICT_DATA:-1}
out=${BOOK_OUT:-$repo}
mkdir -p "$out"
# Charts must not depend on the build machine's clock or locale.
export TZ=UTC PYDEVD_DISABLE_FILE_VALIDATION=1
# Static pages: no live-notebook renderer (medddpm.report.charts.live_notebook), even when run from JupyterLab.
unset JPY_SESSION_NAME MEDDDPM_LAB
start=$(date +%s.%N)
status=0
jobs=${BOOK_JOBS:-$(n=$(nproc); echo $(( n > 4 ? 4 : n )))}
# = `jupyter-book build --all --warningiserror --keep-going --path-output "$out" .`, with Sphinx's
# parallel read (each page's kernel runs in its worker): JB1's CLI has no -j, its build_sphinx has `jobs`.
# The pages' kernels write to this stderr; torch's profiler (kineto) prints a "USDT: ... profiler_start" note there
# at every start and stop, with no switch to turn it off: those notes are left out, everything else stays.
python - "$out" "$jobs" 2> >(grep -v --line-buffered '^USDT:' >&2) <<'PY' || status=$?
import sys
import jupyter_book.sphinx as jb_sphinx
from jupyter_book.cli.main import main

out, jobs = sys.argv[1], int(sys.argv[2])
build_sphinx = jb_sphinx.build_sphinx


def build(*args, **kwargs):
    result = build_sphinx(*args, **{**kwargs, "jobs": jobs})
    # A page that fails in a parallel worker arrives as SphinxParallelError, whose message names the
    # page but not the cell error: print the worker's traceback (the failing cell and its exception).
    if isinstance(result, BaseException) and getattr(result, "traceback", None):
        print(result.traceback, file=sys.stderr)
    if isinstance(result, BaseException):
        print(f"book: FAILED: {type(result).__name__}: {result}", file=sys.stderr)  # names the page
    return result


jb_sphinx.build_sphinx = build
sys.argv = ["jupyter-book", "build", "--all", "--warningiserror", "--keep-going", "--path-output", out, "."]
main()
PY
took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ "$status" -ne 0 ]; then
  echo "book: build FAILED after ${took} s (data: $MEDDDPM_DATA); the page is named in the messages above" >&2
  exit "$status"
fi
echo "book: built in ${took} s with $jobs jobs (data: $MEDDDPM_DATA) -> $out/_build/html/index.html"
