"""Nsight Compute (ncu) hardware counters for the kernels that make up most of a training step.

The torch.profiler table picks the kernels (`select_kernels`); `ncu_command` profiles only those,
only inside the NVTX range of `medddpm.measure.capture`'s one step, with the clocks left alone; the report is
exported with ``ncu -i REPORT --csv --page details --print-units base --print-rule-details`` and read
into one long table (`parse_details_csv`), from which `kernel_summary` (one row per kernel) and
`priorities` (rules weighted by the kernel's share of the step) are derived. `run_ncu` never raises
for a profiler problem: it returns an empty table and says why.

Kernel names differ between the two profilers (pairs seen on the H200 are in
tests/fixtures/ncu/kernel-names-h200.json). torch.profiler (Kineto) reports the GNU-demangled name,
``void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,
std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)``; ncu's
demangler gives ``void at::vectorized_elementwise_kernel<4, at::CUDAFunctor_add<float>,
std::array<char *, 3>>(int, T2, T3)``: namespaces shortened or dropped, ``<unnamed>`` for
``(anonymous namespace)``, literals without suffixes, ``0/1`` for ``false/true``, parameters as
template names, ``[lambda() (instance 1)]`` for ``{lambda()#1}``. Neither an exact match nor ncu's
``function`` base (``vectorized_elementwise_kernel``, shared by hundreds of launches) selects well,
so names are matched by their *token skeleton*: the function name and the words and numbers of its
template arguments, without namespaces, qualifiers, booleans, literal suffixes or parameter lists,
the first `SKELETON_TOKENS` of them (a distinctive prefix). A name matches when the skeleton's
tokens appear in it in order: `kernel_regex` (with ``--kernel-name-base demangled``) and
`match_kernel` (for `priorities`). cuDNN's generated convolution kernels are matched by family
(``xmma_fprop``/``dgrad``/``wgrad``): its autotuner may pick other algorithms under ncu.

ncu cannot name cuDNN's and cuBLAS's launches when it filters them (it gives them the launch before's
name), so a step is profiled in two passes (`PASSES`): "own" filters the selected kernels of PyTorch and
Triton by name, one launch per launch configuration; "library" profiles every cuDNN and cuBLAS launch
of the step in launch order (`LIBRARY_LAUNCH`), for as long as it is given. Their tables are joined. Each
pass is its own process and pays the step's warm-up again; where that is long (opt2's cuDNN autotuning, 199 s
at 128^3 on the H200), "both" takes both filters in one process, one launch a configuration.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pandas as pd
import psutil
from medddpm import REPO

NVTX_RANGE = "medddpm_step"  # medddpm.capture.NVTX_RANGE (not imported: capture imports torch)

# Sections, not `--set full`: full also collects SourceCounters and PM sampling (55 MB for 12 kernels).
SECTIONS = (
    "SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
    "WarpStateStats", "SchedulerStats", "InstructionStats", "Occupancy", "LaunchStats",
    "SpeedOfLight_RooflineChart",
)

# Section identifier -> display name (`ncu --list-sections`, 2025.3). In the details CSV a metric row
# names its section by display name, but a rule row by the identifier of the section file that holds
# the rule, so both spellings of one section appear ("Compute Workload Analysis" and
# "ComputeWorkloadAnalysis"); parse_details_csv writes display names only.
SECTION_NAMES = {
    "C2CLink": "C2CLink",
    "ComputeWorkloadAnalysis": "Compute Workload Analysis",
    "InstructionStats": "Instruction Statistics",
    "LaunchStats": "Launch Statistics",
    "MemoryWorkloadAnalysis": "Memory Workload Analysis",
    "MemoryWorkloadAnalysis_Chart": "Memory Workload Analysis Chart",
    "MemoryWorkloadAnalysis_Tables": "Memory Workload Analysis Tables",
    "NumaAffinity": "NUMA Affinity",
    "Nvlink": "NVLink",
    "Nvlink_Tables": "NVLink Tables",
    "Nvlink_Topology": "NVLink Topology",
    "Occupancy": "Occupancy",
    "PmSampling": "PM Sampling",
    "PmSampling_WarpStates": "PM Sampling: Warp States",
    "SchedulerStats": "Scheduler Statistics",
    "SourceCounters": "Source Counters",
    "SpeedOfLight": "GPU Speed Of Light Throughput",
    "SpeedOfLight_HierarchicalDoubleRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Double Precision)",
    "SpeedOfLight_HierarchicalHalfRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Half Precision)",
    "SpeedOfLight_HierarchicalSingleRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Single Precision)",
    "SpeedOfLight_HierarchicalTensorRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Tensor Core)",
    "SpeedOfLight_RooflineChart": "GPU Speed Of Light Roofline Chart",
    "WarpStateStats": "Warp State Statistics",
    "WorkloadDistribution": "GPU and Memory Workload Distribution",
}

# Names as in Nsight Compute's own section files (ComputeWorkloadAnalysis, WarpStateStatistics,
# SpeedOfLight_RooflineChart) and its nvprof transition table; `run_ncu` drops any the device lacks.
TENSOR_PIPE_METRICS = (
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",  # warp MMA (Volta..Hopper)
    # Hopper: HMMA plus warpgroup HGMMA/QGMMA (an H200 lists no sm__pipe_tensor_op_gmma_cycles_active)
    "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",  # "Tensor (All)", any architecture
)
INST_CLASSES = ("fp16", "fp32", "fp64", "integer", "memory", "control", "conversion", "bit", "misc", "uniform",
                "inter_thread_communication")
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "lg_throttle",
                 "math_pipe_throttle", "tex_throttle", "not_selected", "selected", "wait", "dispatch_stall",
                 "no_instruction", "drain", "sleeping", "imc_miss", "branch_resolving", "misc", "gmma")
# Thread instructions per op; FLOPs = add + mul + 2 * fma (what the roofline section computes).
FLOP_OPS = {"fp32": ("fadd", "fmul", "ffma"), "fp64": ("dadd", "dmul", "dfma"), "fp16": ("hadd", "hmul", "hfma")}


def _inst_metric(cls: str) -> str:
    return f"smsp__sass_thread_inst_executed_op_{cls}_pred_on.sum"


def _stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


EXTRA_METRICS: list[str] = [
    *TENSOR_PIPE_METRICS,
    *(_inst_metric(c) for c in INST_CLASSES),
    *(_stall_metric(r) for r in STALL_REASONS),
    *(_inst_metric(op) for ops in FLOP_OPS.values() for op in ops),
    "l1tex__t_sector_hit_rate.pct",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes.sum.per_second",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "gpu__time_duration.sum",
]

COLUMNS = {"kernel": "str", "kernel_id": "int64", "kind": "str", "section": "str", "metric": "str",
           "value": "float64", "unit": "str", "text": "str", "speedup_type": "str"}

STOP_MARGIN_S = 60  # for ncu to write and export the report after the profiled program stopped
STOPPED = "medddpm.capture: stopped"  # what capture prints when --stop-after ends it
# If the program has not stopped itself by then, its processes are killed this long before the timeout, leaving ncu
# that long to write what it profiled: on the H200, best-ckpt's pass under ncu ran 60 s past its stop, and the
# timeout that then killed ncu took its report and log with it.
KILL_MARGIN_S = 20
KILLED = "medddpm.ncu: the profiled program was killed"  # what the log says then
NON_KERNEL_CATEGORIES = ("memcpy",)  # copies and fills (medddpm.measure.kernels files memsets here too): not kernels
# Step time the selection aims at: 80% is what the counters must cover, and matching ncu's names back to
# the profiler's loses a few points (cuDNN's dgrad launches, 2-3% of sdpa's and graphs' H200 steps)
COVERAGE = 0.85
SKELETON_TOKENS = 10  # enough to tell instantiations apart, short enough to survive truncated names


def empty_table() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()})


def join_launches(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Long tables of several ncu passes as one, each pass's kernel ids shifted past those before it."""
    shifted, start = [], 0
    for t in (t[list(COLUMNS)] for t in tables if not t.empty):
        shifted.append(t.assign(kernel_id=t["kernel_id"] - t["kernel_id"].min() + start))
        start = int(shifted[-1]["kernel_id"].max()) + 1
    return pd.concat(shifted, ignore_index=True).astype(COLUMNS) if shifted else empty_table()


# ---------------------------------------------------------------------------------------- selection

def _kernel_times(kernels: pd.DataFrame) -> pd.Series:
    """Summed device time per distinct kernel name, largest first (name breaks ties: deterministic)."""
    k = kernels[~kernels["category"].isin(NON_KERNEL_CATEGORIES)]
    t = k.groupby("kernel")["total_us"].sum()
    return t.sort_index().sort_values(ascending=False, kind="stable")


def select_kernels(kernels: pd.DataFrame, *, coverage: float = 0.8) -> list[str]:
    """Distinct kernels whose summed time reaches `coverage` of all kernel time, taken by time per launch,
    longest first (by total time where `calls` is absent).

    Nsight Compute's cost grows with the launches it replays (about 2 s each at 128^3 on the H200), so a
    kernel of many short launches comes last: in data/nvidia-h200/opt1, layout conversions are 398
    launches a step for 10% of its time; 80% by total time takes 698 launches a step, by time per launch 369.
    """
    t = _kernel_times(kernels)
    total = t.sum()
    if total <= 0:
        return []
    if "calls" in kernels:
        calls = kernels[kernels["kernel"].isin(t.index)].groupby("kernel")["calls"].sum().reindex(t.index)
        t = t.loc[(t / calls.clip(lower=1)).sort_values(ascending=False, kind="stable").index]
    reached = t.cumsum() >= coverage * total * (1 - 1e-12)  # float sums must not miss an exact boundary
    return t.index[: int(reached.to_numpy().argmax()) + 1].tolist()


def covered(kernels: pd.DataFrame, names: list[str]) -> float:
    """Fraction of all kernel time spent in `names`."""
    t = _kernel_times(kernels)
    return float(t[t.index.isin(names)].sum() / t.sum()) if t.sum() > 0 else 0.0


def profiled_names(kernels: pd.DataFrame, ncu: pd.DataFrame) -> set[str]:
    """The profiler's kernel names that ncu's table covers (names matched as in `match_kernel`)."""
    names = _kernel_times(kernels).index.tolist()
    return {n for k in ncu["kernel"].unique() for n in match_kernel(k, names)}


def profiled_coverage(kernels: pd.DataFrame, ncu: pd.DataFrame) -> float:
    """Fraction of the step's kernel time in kernels that ncu actually profiled: the selection aims at
    `COVERAGE`, this says what the counters cover."""
    return covered(kernels, sorted(profiled_names(kernels, ncu)))


# ------------------------------------------------------------------------------------ name matching

_ANON = re.compile(r"\(anonymous namespace\)::|<?unnamed>::")
_QUALIFIER = re.compile(r"\b[A-Za-z_]\w*::")
_PARENS = re.compile(r"\([^()]*\)")
_CUDNN_FAMILY = re.compile(r"sm\d+_xmma_(fprop|dgrad|wgrad)_")
# A convolution kernel's direction, from the words its name carries: cuDNN's xmma families
# (`sm90_xmma_dgrad_...`), CUTLASS (`..._s1688fprop_...`, `..._s1688wgrad_...`) and its legacy engines
# (`implicit_convolve_sgemm` forward; `convolveNd_dgrad_float_engine`, `dgrad_alg1_nd_float_engine`;
# `wgrad_alg0_engine`, `convolveNd_wgrad_engine`, `reduce_wgrad_nchw_helper`). The gradient words are
# tried first: a legacy backward engine's name also holds "convolve", so that word never decides.
_CONV_BACKWARD = {"dgrad": re.compile(r"dgrad|[Cc]onv\w*_?(bwd|backward)_?data"),
                  "wgrad": re.compile(r"wgrad|[Cc]onv\w*_?(bwd|backward)_?(filter|weight)")}
_CONV_FORWARD = re.compile(r"fprop|(implicit|explicit)_convolve|[Cc]onv\w*_?(fwd|forward)|convNd_grouped_direct")
# Never a convolution: cuDNN's helpers around one (split-K reductions, layout and type conversions, workspace
# set-up), which carry its direction's word in some names (`reduce_wgrad_nchw_helper`) but not its work, and
# its fused attention (`cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...`).
_NOT_CONV = re.compile(r"helper|reduce_|[Ww]orkspace|To(Nhwc|Nchw)|convert|sdpa|flash|fmha|attention")
_TOKEN = re.compile(r"(\d+)[uUlL]*|([A-Za-z_]\w*)")
# Words the two demanglers write differently: GNU "float const" vs ncu "const float"; GNU
# "false, true" vs ncu "0, 1" (seen for cuDNN's nchwToNhwcKernel on the H200).
_UNSTABLE = {"const", "volatile", "true", "false"}


def conv_direction(name: str) -> str | None:
    """"fprop", "dgrad" or "wgrad" for a convolution kernel named as cuDNN, CUTLASS or their legacy engines
    name them; None for any other kernel, cuDNN's helpers and attention included."""
    if _NOT_CONV.search(name):
        return None
    for direction, words in _CONV_BACKWARD.items():
        if words.search(name):
            return direction
    return "fprop" if _CONV_FORWARD.search(name) else None


def _head(name: str) -> str:
    """The name up to its parameter list: the first '(' outside template brackets."""
    name = _ANON.sub("", name)
    depth = 0
    for i, ch in enumerate(name):
        if ch in "<[{":
            depth += 1
        elif ch in ">]}":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def skeleton(name: str, *, tokens: int = SKELETON_TOKENS) -> list[str]:
    """Function name, then the words and numbers of its template arguments (see the module doc).

    Parenthesised groups inside the template arguments go too: they are parameter lists of nested
    functions and lambdas, which ncu prints with template parameter names (T1, T2) instead of types.
    """
    head = _QUALIFIER.sub("", _head(name))  # before the groups go: `f(T&)::{lambda()#1}` keeps `f`
    while (shorter := _PARENS.sub("", head)) != head:
        head = shorter
    head = head.strip().removeprefix("void ")  # the return type (kernels return void)
    words = [num or word for num, word in _TOKEN.findall(head)]
    return [w for w in words if w not in _UNSTABLE][:tokens]


def _skeleton_pattern(name: str) -> str:
    # cuDNN's autotuner (benchmark=True) picks other algorithms under ncu, whose launches time
    # differently (H200, opt1 size 32: the profiler saw sm90_xmma_fprop_..., ncu ran sm80_xmma_fprop_...;
    # at 128^3 no xmma kernel ran under ncu at all), so its convolutions are matched by direction only
    # (`match_kernel` decides with `conv_direction`; this pattern is for ncu's name filter).
    if family := _CUDNN_FAMILY.match(name):
        return _CONV_BACKWARD[family.group(1)].pattern if family.group(1) != "fprop" else _CONV_FORWARD.pattern
    # Word characters only, so escaping is a formality; \b and .* work in ncu's regex engine.
    # Numbers may keep their suffix ("3ul"), so the regex also matches the profiler's own spelling.
    return ".*".join(rf"\b{re.escape(t)}{'[uUlL]*' if t.isdigit() else ''}\b" for t in skeleton(name))


def _matches(profiler_name: str, ncu_name: str) -> bool:
    """Whether ncu's kernel can be the profiler's: a cuDNN convolution family by direction (never a kernel of
    another direction), anything else by its token skeleton."""
    if family := _CUDNN_FAMILY.match(profiler_name):
        return conv_direction(ncu_name) == family.group(1)
    return bool((p := _skeleton_pattern(profiler_name)) and re.search(p, ncu_name))


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


def kernel_regex(names: list[str]) -> str:
    """One regex matching each name (and ncu's demangling of it) by its token skeleton."""
    patterns = sorted({p for p in map(_skeleton_pattern, names) if p})
    if not patterns:
        raise ValueError("no kernel names to match")
    return "|".join(f"({p})" for p in patterns)


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
    """ncu over `medddpm.measure.capture`: one step (NVTX range), the launches whose name matches, clocks untouched.

    `launches_per_config`: profile only the first N launches of each launch configuration (kernel,
    grid, block, shared memory); a layer repeated with the same shape is measured once, which keeps
    a 128^3 step inside the time limit (about 1.3 s of replay per profiled launch on the H200).
    None profiles every launch that matches (the library pass: see `LIBRARY_LAUNCH`).
    `launch_skip`: pass over the first N launches that match (ncu counts them after its filters), so that
    a library pass goes on where an earlier one stopped.
    `stop_after_s`: the profiled program exits after that long, and ncu writes the launches done so far.
    `from_backward`: the step's range starts at the first layer's backward ('') or at the backward of the layer
    range so named (eager configurations; `medddpm.measure.capture`), so that a pass spends its time on what a pass
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
    target = [python, "-m", "medddpm.measure.capture", "--config", config, "--preset", preset]
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
    # capture runs as `python -m medddpm.measure.capture`: the package's parent must be importable
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


# ------------------------------------------------------------------------------------------ parsing

def _read_text(path_or_buffer: str | os.PathLike | IO) -> str:
    if hasattr(path_or_buffer, "read"):
        data = path_or_buffer.read()
    else:
        data = Path(path_or_buffer).read_bytes()
    if isinstance(data, bytes):
        data = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8")
    return data


def parse_details_csv(path_or_buffer: str | os.PathLike | IO) -> pd.DataFrame:
    """ncu's `--page details --csv` export (optionally gzipped) as the long table `COLUMNS`."""
    text = _read_text(path_or_buffer)
    start = text.find('"ID",')  # ncu may print ==PROF==/==WARNING== lines before the header
    if start < 0:
        return empty_table()
    raw = pd.read_csv(io.StringIO(text[start:]), dtype=str, keep_default_na=False)
    if raw.empty:
        return empty_table()
    rule = raw["Rule Name"].ne("") & raw["Metric Name"].eq("")

    def number(s: pd.Series) -> pd.Series:  # "3,153,508,771.93" -> 3153508771.93; "n/a", text -> NaN
        return pd.to_numeric(s.str.replace(",", "", regex=False), errors="coerce")

    df = pd.DataFrame({
        "kernel": raw["Kernel Name"],
        "kernel_id": raw["ID"].astype("int64"),
        "kind": rule.map({True: "rule", False: "metric"}),
        "section": raw["Section Name"].replace(SECTION_NAMES),
        "metric": raw["Metric Name"].where(~rule, raw["Rule Name"]),
        "value": number(raw["Metric Value"]).where(~rule, number(raw["Estimated Speedup"])),
        "unit": raw["Metric Unit"].where(~rule, "%"),
        "text": raw["Metric Value"].where(~rule, raw["Rule Description"]),
        "speedup_type": raw["Estimated Speedup Type"].where(rule, ""),
    })
    return df.astype(COLUMNS)


# ------------------------------------------------------------------------------------------- layers

# `medddpm.measure.capture` names each convolution of an eager step with an NVTX push/pop range (`LAYER_PREFIX`, then
# the layer's channels, kernel, stride and input size), around its forward and around its backward. ncu
# records the ranges open at each launch; they are kept in the long table as one text row per launch
# (section `LAYER_SECTION`), so that the same layer can be compared kernel against kernel across
# configurations (`medddpm.measure.layers`).
LAYER_PREFIX = "conv3d "  # medddpm.capture.LAYER_PREFIX (not imported: capture imports torch)
LAYER_SECTION, LAYER_METRIC = "NVTX", "layer"


def report_module(ncu: str = "ncu"):
    """Nsight Compute's Python report interface (`ncu_report`), from the install that `ncu` belongs to
    (its `extras/python` folder: beside the binary, or in the CUDA toolkit's or /opt/nvidia's Nsight Compute
    folders when `ncu` is the toolkit's launcher script), else an installed `ncu_report` module; None where
    there is neither."""
    import importlib

    where = shutil.which(ncu)
    parents = list(Path(os.path.realpath(where)).parents) if where else []
    folders = [p / "extras" / "python" for p in parents]
    for root in [*parents[1:2], Path("/opt/nvidia/nsight-compute")]:  # the toolkit's root, NVIDIA's default
        folders += sorted(root.glob("nsight-compute*/extras/python"), reverse=True)
        folders += sorted(root.glob("*/extras/python"), reverse=True)
    for folder in folders:
        if folder.joinpath("ncu_report.py").is_file():
            if str(folder) not in sys.path:
                sys.path.append(str(folder))
            break
    try:
        return importlib.import_module("ncu_report")
    except ImportError:
        return None


def report_layers(report: Path, module) -> list[tuple[str, str]]:
    """(kernel name, innermost layer range or '') of each result of an ncu report, in result order (the CSV
    export's ID): read with the report interface's NVTX state."""
    ctx = module.load_report(str(report))
    out = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            action = rng.action_by_idx(a)
            state, layer = action.nvtx_state(), ""
            for domain in (state.domains() if state is not None else ()):
                ranges = [n for n in state.domain_by_id(domain).push_pop_ranges() if n.startswith(LAYER_PREFIX)]
                layer = ranges[-1] if ranges else layer
            out.append((action.name(), layer))
    return out


def with_layers(df: pd.DataFrame, report: Path, *, ncu: str = "ncu") -> tuple[pd.DataFrame, str]:
    """The long table with a `LAYER_SECTION` row for each launch made inside a layer range, and a note for the
    pass's message ('' where there is nothing to say). The report's results are matched to the table's IDs by position, checked by name: any
    disagreement, or no report interface, leaves the table as it was and says so."""
    module = report_module(ncu)
    if module is None:  # layer figures are left out, as for a compiled step
        return df, ""
    try:
        layers = report_layers(report, module)
    except Exception as e:  # the report interface's own errors have no common base class
        return df, f"; layer ranges not read ({type(e).__name__}: {e})"
    names = df.groupby("kernel_id")["kernel"].first()
    ids = sorted(names.index)
    # the interface names a result by its function (`vectorized_elementwise_kernel`), the export in full
    if len(layers) != len(ids) or any(function not in names[i] for i, (function, _) in zip(ids, layers)):
        return df, f"; layer ranges not kept ({len(layers)} results in the report, {len(ids)} in the export)"
    rows = [(names[i], i, layer) for i, (_, layer) in zip(ids, layers) if layer]
    if not rows:  # a compiled step: no layer ranges
        return df, ""
    extra = pd.DataFrame({"kernel": [r[0] for r in rows], "kernel_id": [r[1] for r in rows], "kind": "metric",
                          "section": LAYER_SECTION, "metric": LAYER_METRIC, "value": float("nan"), "unit": "",
                          "text": [r[2] for r in rows], "speedup_type": ""})
    return pd.concat([df, extra], ignore_index=True).astype(COLUMNS), f"; {len(rows)} launches inside layer ranges"


def launch_layers(ncu: pd.DataFrame) -> pd.Series:
    """kernel_id -> the layer range it ran in ('' where none was recorded)."""
    rows = ncu[(ncu["section"] == LAYER_SECTION) & (ncu["metric"] == LAYER_METRIC)]
    ids = ncu["kernel_id"].drop_duplicates().sort_values()
    return rows.groupby("kernel_id")["text"].first().reindex(ids, fill_value="")


# ------------------------------------------------------------------------------------------ summary

_SOL, _CWA, _MWA = "GPU Speed Of Light Throughput", "Compute Workload Analysis", "Memory Workload Analysis"
# column -> candidates, best first: (section display name, metric display name) or a raw metric name
HEADLINE: dict[str, tuple[tuple[str, str] | str, ...]] = {
    "duration_ns": ((_SOL, "Duration"), "gpu__time_duration.sum"),
    "sm_throughput_pct": ((_SOL, "Compute (SM) Throughput"), "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    "memory_throughput_pct": ((_SOL, "Memory Throughput"),
                              "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_throughput_pct": ((_SOL, "DRAM Throughput"), "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_bytes_per_s": ("dram__bytes.sum.per_second",),
    "l1_hit_pct": ((_MWA, "L1/TEX Hit Rate"), "l1tex__t_sector_hit_rate.pct"),
    "l2_hit_pct": ((_MWA, "L2 Hit Rate"), "lts__t_sector_hit_rate.pct"),
    "achieved_occupancy_pct": (("Occupancy", "Achieved Occupancy"),
                               "sm__warps_active.avg.pct_of_peak_sustained_active"),
    "theoretical_occupancy_pct": (("Occupancy", "Theoretical Occupancy"),),
    "sm_active_cycles": ((_SOL, "SM Active Cycles"), "sm__cycles_active.avg"),
    "elapsed_cycles": ((_SOL, "Elapsed Cycles"), "gpc__cycles_elapsed.max"),
    "inst_executed": (("Instruction Statistics", "Executed Instructions"), "sm__inst_executed.sum"),
    "ipc": ((_CWA, "Executed Ipc Active"), "sm__inst_executed.avg.per_cycle_active"),
    "warp_cycles_per_inst": (("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
                             "smsp__average_warp_latency_per_inst_issued.ratio"),
    "registers_per_thread": (("Launch Statistics", "Registers Per Thread"), "launch__registers_per_thread"),
    **{f"inst_{c}": (_inst_metric(c),) for c in INST_CLASSES},
    **{f"stall_{r}": (_stall_metric(r),) for r in STALL_REASONS},
}


def _wide(metrics: pd.DataFrame) -> pd.DataFrame:
    """kernel_id x (section, metric) of numeric values (first non-NaN of duplicates)."""
    return metrics.groupby(["kernel_id", "section", "metric"])["value"].first().unstack(["section", "metric"])


def _pick(wide: pd.DataFrame, candidates: tuple[tuple[str, str] | str, ...]) -> pd.Series:
    """First non-NaN among the candidates; a raw metric name is looked up in any section."""
    out = pd.Series(float("nan"), index=wide.index)
    for c in candidates:
        for col in [c] if isinstance(c, tuple) else [k for k in wide.columns if k[1] == c]:
            if col in wide.columns:
                out = out.fillna(wide[col])
    return out


def kernel_summary(ncu: pd.DataFrame) -> pd.DataFrame:
    """One row per profiled launch (kernel_id): the headline numbers, NaN where not collected."""
    names = ncu.groupby("kernel_id")["kernel"].first()
    wide = _wide(ncu[ncu["kind"] == "metric"]).reindex(names.index)
    cols = {col: _pick(wide, cands) for col, cands in HEADLINE.items()}
    cols["tensor_pipe_pct"] = pd.concat([_pick(wide, (m,)) for m in TENSOR_PIPE_METRICS], axis=1).max(axis=1)
    for kind, ops in FLOP_OPS.items():  # thread instructions -> FLOPs (an FMA is two)
        add, mul, fma = (_pick(wide, (_inst_metric(op),)) for op in ops)
        cols[f"flop_{kind}"] = add + mul + 2 * fma
    out = pd.DataFrame(cols, index=names.index).astype("float64")
    out.insert(0, "kernel", names.astype("str"))
    out.insert(1, "layer", launch_layers(ncu).reindex(names.index, fill_value="").astype("str"))
    out.insert(2, "direction", names.map(conv_direction).fillna("").astype("str"))
    return out.reset_index().astype({"kernel_id": "int64"})


# --------------------------------------------------------------------------------------- priorities

def match_kernel(ncu_name: str, profiler_names: list[str]) -> list[str]:
    """The profiler's names for an ncu kernel: the same string, else the most specific skeleton matches.

    Exact first (the names agree when both come from one demangler); otherwise every profiler name
    whose token skeleton appears, in order, in the ncu name is a candidate, and those with the
    longest skeleton win. Several winners are indistinguishable by name (a cuDNN family, or
    instantiations differing after the skeleton): their shares add up.
    """
    if ncu_name in profiler_names:
        return [ncu_name]
    hits = [(len(skeleton(n)), n) for n in profiler_names if _matches(n, ncu_name)]
    best = max((k for k, _ in hits), default=0)
    return [n for k, n in hits if k == best]


def _shares(names: pd.Series, share: pd.Series, duration: pd.Series, ncu: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(profiler name, step share) for each ncu kernel name. ncu kernels matching the same profiler
    names (a cuDNN family) split that share by their profiled durations, so it is counted once."""
    per_name = ncu.groupby("kernel_id")["kernel"].first().to_frame().assign(ns=duration).groupby("kernel")["ns"].sum()
    matches = {k: tuple(match_kernel(k, share.index.tolist())) for k in names.unique()}
    group_ns = pd.Series({k: per_name.get(k, 0.0) for k in matches}).groupby(pd.Series(matches)).transform("sum")
    frac = {k: per_name.get(k, 0.0) / group_ns[k] if group_ns[k] > 0 else 1.0 for k in matches}
    first = names.map(lambda k: matches[k][0] if matches[k] else None)  # the largest share
    return first, names.map(lambda k: share[list(matches[k])].sum() * frac[k] if matches[k] else float("nan"))


def priorities(kernels: pd.DataFrame, ncu: pd.DataFrame, *, include_local: bool = False) -> pd.DataFrame:
    """Per (kernel, rule): share of step time x the rule's estimated speedup; largest gain first.

    `share` is the torch.profiler share summed over all rows (passes) of the matched name. A
    "global" speedup is a fraction of the kernel's duration, so share x speedup estimates the saving
    in step time; a "local" one is relative to a single unit or metric and overstates it, so local
    rules are left out unless asked for. A kernel launched several times is averaged over its
    launches weighted by duration; a rule reported more than once per launch (WorkloadImbalance per
    unit, CPIStall) counts with its largest estimate. Unmatched kernels keep NaN share and priority.
    """
    cols = ["kernel", "profiler_kernel", "rule", "section", "speedup_type", "share", "speedup_pct", "priority"]
    rules = ncu[(ncu["kind"] == "rule") & ncu["value"].notna()]
    if not include_local:
        rules = rules[rules["speedup_type"] == "global"]
    if rules.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64" if c in cols[5:] else "str") for c in cols})
    share = kernels.groupby("kernel")["share"].sum().sort_values(ascending=False)
    duration = kernel_summary(ncu).set_index("kernel_id")["duration_ns"]
    launch = (rules.groupby(["kernel_id", "kernel", "metric", "section", "speedup_type"], as_index=False)["value"]
              .max().rename(columns={"metric": "rule", "value": "speedup_pct"}))
    launch["weight"] = launch["kernel_id"].map(duration).fillna(1.0)
    launch["weighted"] = launch["speedup_pct"] * launch["weight"]
    g = launch.groupby(["kernel", "rule", "section", "speedup_type"], as_index=False)[["weighted", "weight"]].sum()
    g["speedup_pct"] = g["weighted"] / g["weight"]
    g["profiler_kernel"], g["share"] = _shares(g["kernel"], share, duration, ncu)
    g["priority"] = g["share"] * g["speedup_pct"] / 100
    g = g.sort_values(["priority", "speedup_pct"], ascending=False, na_position="last")
    return g[cols].reset_index(drop=True)
