"""Nsight Compute (ncu) hardware counters for the kernels that make up most of a training step.

The torch.profiler table picks the kernels (`select_kernels`); `ncu_command` profiles only those,
only inside the NVTX range of `medddpm.measure.profile.capture`'s one step, with the clocks left alone; the report is
exported (`export_command`) and read into one long table (`medddpm.analysis.ncu_table`, which derives the
per-kernel summary and the rules' priorities from it), with the layer range of each launch
(`medddpm.measure.profile.ncu_layers`). Kernels are named to ncu's filter by their token skeleton
(`medddpm.analysis.ncu_names`). `run_ncu` never raises for a profiler problem: it returns an empty table and
says why.

ncu cannot name cuDNN's and cuBLAS's launches when it filters them (it gives them the launch before's
name), so a step is profiled in two passes (`PASSES`): "own" filters the selected kernels of PyTorch and
Triton by name, one launch per launch configuration; "library" profiles every cuDNN and cuBLAS launch
of the step in launch order (`LIBRARY_LAUNCH`), for as long as it is given. Their tables are joined. Each
pass is its own process and pays the step's warm-up again; where that is long (opt2's cuDNN autotuning takes
minutes at 128^3), "both" takes both filters in one process, one launch a configuration.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
from medddpm import REPO
from medddpm.measure.profile.ncu_layers import with_layers
from medddpm.analysis.ncu_names import kernel_regex
from medddpm.analysis.ncu_table import (COVERAGE, EXTRA_METRICS, SECTIONS, covered, empty_table, join_launches,
                                        parse_details_csv, profiled_coverage, profiled_names, select_kernels)

NVTX_RANGE = "medddpm_step"  # medddpm.capture.NVTX_RANGE (not imported: capture imports torch)

STOP_MARGIN_S = 60  # for ncu to write and export the report after the profiled program stopped
STOPPED = "medddpm.capture: stopped"  # what capture prints when --stop-after ends it
# If the program has not stopped itself by then, its processes are killed this long before the timeout, leaving ncu
# that long to write what it profiled: a compiled configuration's pass can run a minute past its stop, and a
# timeout that then kills ncu takes its report and log with it.
KILL_MARGIN_S = 20
KILLED = "medddpm.ncu: the profiled program was killed"  # what the log says then


# ------------------------------------------------------------------------------------------- passes

# cuDNN's and cuBLAS's kernels (cuDNN's xmma convolutions and their helpers, cuBLAS's CUTLASS, xmma and nvjet GEMMs).
LIBRARY = re.compile(r"xmma|cudnn|cask|cutlass|nvjet")
# At launch time ncu names a launch of cuDNN's (and cuBLAS's) xmma kernels after the launch before it,
# printed mangled (H200, ncu 2025.3.1: a dgrad launch logged as `_ZN7cutlass7Kernel2I42cutlass_80_simt_sgemm...`,
# the kernel launched just before it); the report's names are right. Its name filter and its
# per-launch-config filter see the launch-time name: filtered by the selected names, one launch a
# configuration, a pass over opt12 profiled 0 or 1 of its 60 dgrad launches a step; filtered by library
# names alone, every launch, 37 in its first 266 (measured on the H200). So the library
# pass admits every library name, in either spelling, and any mangled name (a launch after a C++ kernel;
# one right after a Triton kernel would carry that kernel's plain name and still be missed).
LIBRARY_LAUNCH = r"xmma|cudnn|cask|cutlass|nvjet|^_Z"
PASSES = ("own", "library")
# Both filters in one process, one launch per launch configuration (per logged name, grid, block, shared
# memory): a library launch then counts under the name of the launch before it, so a convolution repeated
# after the same kernel at the same grid is profiled once. Coverage needs one launch of each kernel; in the
# first 266 launches of opt12's step (tests/fixtures/ncu), that filter keeps 125, fprop, dgrad and wgrad among them.
BOTH = "both"


def split_library(names: list[str]) -> tuple[list[str], list[str]]:
    """(own, library): the selected kernels of PyTorch and Triton, and those of cuDNN and cuBLAS."""
    return [n for n in names if not LIBRARY.search(n)], [n for n in names if LIBRARY.search(n)]


def check_passes(passes: tuple[str, ...]) -> None:
    """ValueError, with one line saying why, for passes `run_ncu` cannot run."""
    if unknown := sorted(set(passes) - {*PASSES, BOTH}):
        raise ValueError(f"unknown ncu pass {', '.join(unknown)}: choose from {', '.join(PASSES)} or {BOTH}")
    if BOTH in passes and len(set(passes)) > 1:
        raise ValueError(f"the {BOTH} pass profiles {' and '.join(PASSES)} in one process: ask for it alone")


def pass_regex(name: str, own: list[str]) -> str:
    """A pass's name filter: the own kernels by name ("own"), every library launch ("library"), or both."""
    parts = [kernel_regex(own)] if name in ("own", BOTH) and own else []
    return "|".join(parts + ([LIBRARY_LAUNCH] if name in ("library", BOTH) else []))


# ------------------------------------------------------------------------------------------ command

def ncu_command(*, name_regex: str, config: str, preset: str, report: Path, metrics: list[str],
                size: int | str | None = None, batch: int = 1, launches_per_config: int | None = 1,
                launch_skip: int = 0, stop_after_s: float | None = None, from_backward: str | None = None,
                python: str = sys.executable) -> list[str]:
    """ncu over `medddpm.measure.profile.capture`: one step (NVTX range), the launches whose name matches, clocks untouched.

    `launches_per_config`: profile only the first N launches of each launch configuration (kernel,
    grid, block, shared memory); a layer repeated with the same shape is measured once, which keeps
    a 128^3 step inside the time limit (each profiled launch costs about a second of replay).
    None profiles every launch that matches (the library pass: see `LIBRARY_LAUNCH`).
    `launch_skip`: pass over the first N launches that match (ncu counts them after its filters), so that
    a library pass goes on where an earlier one stopped.
    `stop_after_s`: the profiled program exits after that long, and ncu writes the launches done so far.
    `from_backward`: the step's range starts at the first layer's backward ('') or at the backward of the layer
    range so named (eager configurations; `medddpm.measure.profile.capture`), so that a pass spends its time on what a pass
    before it did not reach.
    """
    sections = [a for s in SECTIONS for a in ("--section", s)]
    extra = ["--metrics", ",".join(metrics)] if metrics else []
    # Two NVTX filters, OR'ed by ncu: "medddpm_step/" is a push/pop range, which is per thread and so
    # misses the backward kernels autograd launches from its own thread (H200: 325 of 874 launches);
    # "medddpm_step" is a process-wide start/end range (torch.cuda.nvtx.range_start/range_end).
    nvtx = ["--nvtx", "--nvtx-include", f"{NVTX_RANGE}/", "--nvtx-include", NVTX_RANGE]
    per_config = (["--filter-mode", "per-launch-config", "--launch-count", str(launches_per_config)]
                  if launches_per_config else [])
    target = [python, "-m", "medddpm.measure.profile.capture", "--config", config, "--preset", preset]
    skip = ["--launch-skip", str(launch_skip)] if launch_skip else []
    # application-only: ncu's default (all) also injects itself into every process the program starts, which
    # for a compiled configuration are Inductor's compile workers; the step runs in the program's own process.
    return ["ncu", *nvtx, "--target-processes", "application-only", "--clock-control", "none", *per_config, *skip,
            "--kernel-name-base", "demangled", "--kernel-name", f"regex:{name_regex}",
            *sections, *extra, "-o", str(report), "-f",
            *target, *(["--size", str(size)] if size else []), *(["--batch", str(batch)] if batch != 1 else []),
            *(["--stop-after", f"{stop_after_s:g}"] if stop_after_s else []),
            *(["--from-backward", from_backward] if from_backward is not None else [])]


def export_command(report: Path, *, ncu: str = "ncu") -> list[str]:
    return [ncu, "-i", str(report), "--csv", "--page", "details", "--print-units", "base", "--print-rule-details"]


_METRIC_NAME = re.compile(r'^\W*([a-z][a-z0-9]*__[A-Za-z0-9_]+)')


def parse_metric_list(text: str) -> set[str]:
    """Base metric names from `ncu --query-metrics` output, CSV or table."""
    return {m.group(1) for line in text.splitlines() if (m := _METRIC_NAME.match(line))}


@functools.cache
def available_metrics(ncu: str = "ncu") -> set[str]:
    """Base names of the metrics the device offers; empty if ncu cannot say (then nothing is dropped)."""
    for args in (["--query-metrics", "--csv"], ["--query-metrics"]):
        try:
            out = subprocess.run([ncu, *args], capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if names := parse_metric_list(out):
            return names
    return set()


def base_name(metric: str) -> str:
    """`sm__warps_active.avg.pct_of_peak_sustained_active` -> `sm__warps_active`."""
    return metric.split(".", 1)[0]


def split_available(metrics: list[str], available: set[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): an unknown metric name makes ncu fail, so drop those the device lacks."""
    if not available:
        return list(metrics), []
    kept = [m for m in metrics if base_name(m) in available]
    return kept, [m for m in metrics if m not in kept]


# ------------------------------------------------------------------------------------------- runner

def _run(cmd: list[str], *, timeout_s: float, log: Path | None = None, kill_margin_s: float = 0,
         **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout kills the whole process group (ncu and the Python it launched). With
    `log`, stdout and stderr go to that file as they come (the result's stdout reads it back), so that a
    pass killed by the timeout still leaves its log. With `kill_margin_s` (less than `timeout_s`), the processes
    `cmd` started are killed that long before the timeout, and `cmd` (ncu) gets the rest to finish."""
    with open(log, "w") if log else contextlib.nullcontext() as sink:
        streams = {"stdout": sink, "stderr": subprocess.STDOUT} if sink else \
            {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        with subprocess.Popen(cmd, text=True, start_new_session=True, **streams, **kwargs) as proc:
            try:
                try:
                    out, err = proc.communicate(timeout=timeout_s - kill_margin_s)
                except subprocess.TimeoutExpired:
                    if not kill_margin_s:
                        raise
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        with contextlib.suppress(psutil.NoSuchProcess):
                            child.kill()
                    if sink:
                        sink.write(f"\n{KILLED} at {timeout_s - kill_margin_s:.0f} s\n")
                        sink.flush()
                    out, err = proc.communicate(timeout=kill_margin_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout_s) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, Path(log).read_text() if log else out, err or "")


def _tail(text: str, lines: int = 5) -> str:
    """The last `lines` non-blank lines of `text`, on one line."""
    return " | ".join([line for line in text.splitlines() if line.strip()][-lines:])


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _profile(cmd: list[str], report: Path, *, timeout_s: float, stop_s: float, env: dict,
             cwd: str) -> tuple[pd.DataFrame, str]:
    """One ncu pass and its export: (long table, message); an empty table where it failed."""
    try:
        margin = min(KILL_MARGIN_S, timeout_s / 4)
        prof = _run(cmd, timeout_s=timeout_s, log=report.with_suffix(".log"), kill_margin_s=margin, env=env, cwd=cwd)
        stopped = STOPPED in prof.stdout + prof.stderr or KILLED in prof.stdout
        if (prof.returncode != 0 and not stopped) or not report.is_file():
            return empty_table(), f"ncu exited {prof.returncode}: {_tail(prof.stdout + prof.stderr)}"
        exported = _run(export_command(report, ncu=cmd[0]), timeout_s=timeout_s)
        if exported.returncode != 0:
            why = _tail(exported.stderr or exported.stdout)
            return empty_table(), f"ncu export exited {exported.returncode}: {why}"
        csv = report.with_suffix(".csv")
        csv.write_text(exported.stdout)
        df = parse_details_csv(csv)
        df, layers_said = with_layers(df, report, ncu=cmd[0])
    except subprocess.TimeoutExpired as e:
        log = report.with_suffix(".log")
        return empty_table(), f"ncu timed out after {e.timeout:.0f} s ({log.name}: {_tail(log.read_text(errors='replace'), 2)})"
    except (OSError, ValueError, pd.errors.ParserError) as e:
        return empty_table(), f"{type(e).__name__}: {e}"
    if df.empty:
        return df, "ncu profiled no kernel (did the NVTX range or the name filter match?)"
    cut = f" before the step was stopped at {stop_s:.0f} s" if stopped else ""
    cut = f" before the program was killed at {timeout_s - margin:.0f} s" if KILLED in prof.stdout else cut
    return df, f"{df['kernel_id'].nunique()} launches{cut}{layers_said}"


def run_ncu(*, kernels_df: pd.DataFrame, config: str, preset: str, out_dir: Path, size: int | str | None = None,
            batch: int = 1, timeout_s: int = 420, coverage: float = COVERAGE, passes: tuple[str, ...] = PASSES,
            profiled: pd.DataFrame | None = None, library_skip: int = 0,
            from_backward: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Profile the kernels covering `coverage` of the step, in the `passes` that have selected kernels
    (see `PASSES`, or `BOTH` alone; they share `timeout_s`); (long table, status). Never raises for ncu.

    To add to counters a run has (`profiled`, their table): the own pass leaves out the kernels that table
    covers, and the library pass, which cannot filter by real name, skips the first `library_skip`
    launches (those earlier library passes profiled: `library_launches_done`). `from_backward`: see
    `ncu_command`."""
    check_passes(passes)
    out_dir = Path(out_dir)
    names = select_kernels(kernels_df, coverage=coverage)
    had = profiled_names(kernels_df, profiled) if profiled is not None else set()
    chosen = dict(zip(PASSES, split_library([n for n in names if n not in had])))
    chosen[BOTH] = chosen["own"] + chosen["library"]
    todo = [p for p in (*PASSES, BOTH) if p in passes and chosen[p]]
    reports = {p: out_dir / f"ncu-{config}-{preset}{size or ''}-{p}.ncu-rep" for p in todo}
    status = {"status": "skipped", "message": "", "selected_kernels": len(names),
              "coverage": covered(kernels_df, names), "dropped_metrics": [],
              "passes": {p: {"report": str(r), "kernels": len(chosen[p])} for p, r in reports.items()}}
    if "library" in todo:
        status["passes"]["library"]["first_launch"] = library_skip
    if from_backward is not None:
        status["from_backward"] = from_backward

    def done(state: str, message: str, df: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
        return (empty_table() if df is None else df), status | {"status": state, "message": message}

    ncu = shutil.which("ncu")
    if ncu is None:
        return done("skipped", "ncu is not on PATH")
    if not _cuda_available():
        return done("skipped", "no CUDA device")
    if not todo:
        return done("skipped", "no kernel time to profile" if not names
                    else f"no selected kernel left to profile in the {' and '.join(passes)} pass")
    metrics, status["dropped_metrics"] = split_available(EXTRA_METRICS, available_metrics(ncu))
    out_dir.mkdir(parents=True, exist_ok=True)
    # capture runs as `python -m medddpm.measure.profile.capture`: the package's parent must be importable
    root = str(REPO)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    start, tables = time.monotonic(), []
    for i, name in enumerate(todo):
        # what is left, shared by the passes still to run; the own pass usually ends early
        budget = (timeout_s - (time.monotonic() - start)) / (len(todo) - i)
        # The program stops itself before the timeout, so that ncu still writes what it profiled; failing
        # that it is killed `KILL_MARGIN_S` before it, and the timeout (which kills ncu, and so loses the
        # report) stays as the last backstop.
        stop_s = max(budget - STOP_MARGIN_S, budget / 2)
        cmd = ncu_command(name_regex=pass_regex(name, chosen["own"]), launches_per_config=None if name == "library" else 1,
                          launch_skip=library_skip if name == "library" else 0, config=config, preset=preset,
                          size=size, batch=batch, report=reports[name], metrics=metrics, stop_after_s=stop_s,
                          from_backward=from_backward)
        cmd[0] = ncu
        df, message = _profile(cmd, reports[name], timeout_s=budget, stop_s=stop_s, env=env, cwd=root)
        status["passes"][name] |= {"message": message, "launches": int(df["kernel_id"].nunique())}
        tables.append(df)
    said = "; ".join(f"{p}: {status['passes'][p]['message']}" for p in todo)
    df = join_launches(tables)
    if df.empty:
        return done("error", said)
    status["profiled_coverage"] = got = profiled_coverage(kernels_df, df)
    short = f"; they cover {got:.2%} of step time, short of {coverage:.0%}" if got < coverage - 1e-9 else ""
    return done("ok", f"{df['kernel_id'].nunique()} kernel launches profiled ({said}){short}", df)


def library_launches_done(status: dict) -> int:
    """Where the next library pass over a run starts: the launches its library passes profiled, in launch
    order from the step's first (`status` is a run's ncu entry, with those it was merged onto)."""
    lib = status.get("passes", {}).get("library", {})
    here = lib.get("first_launch", 0) + lib.get("launches", 0)
    return max(here, library_launches_done(status["merged"]) if "merged" in status else 0)
