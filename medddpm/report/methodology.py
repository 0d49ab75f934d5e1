"""The methodology page: what ran where (hardware, software, commit, container), the configurations and their
switches, how each quantity is measured, and the columns of every table."""

from __future__ import annotations

import inspect
import json

import pandas as pd

from medddpm.configs import CONFIGS, Config
from medddpm.report import tables
from medddpm.report.counters import ncu_sections
from medddpm.report.loading import Data
from medddpm.report.safe import code, md
from medddpm.store import schema
from medddpm.train.timing import StepTimer, summarize, time_steps  # the loop every timed step runs through

MACHINE_COLUMNS = {"gpu_slug": "device", "gpu_name": "name", "software": "torch · CUDA · cuDNN", "driver": "driver",
                   "python": "Python", "host_threads": "CPU threads", "container": "container", "input": "input",
                   "runs": "runs"}


def machines(run: pd.DataFrame) -> pd.DataFrame:
    """One row per machine and software stack: device, torch · CUDA · cuDNN, driver, Python, threads, container,
    the input its runs used and how many runs it made ("-" where a field does not apply, as on a CPU)."""
    env = run.assign(software=run["torch"] + " · CUDA " + run["cuda"].replace("", "-") + " · cuDNN "
                     + run["cudnn"].replace("", "-"), driver=run["driver"].replace("", "-"),
                     container=run["container"].replace("", "bare metal"))
    keys = ["gpu_slug", "gpu_name", "driver", "software", "python", "host_threads", "container"]
    out = (env.groupby(keys, sort=False).agg(runs=("config", "size"), preset=("preset", "first"),
                                             size=("size", "first")).reset_index())
    out["input"] = out["preset"] + ", " + out["size"].astype(str) + "³"
    return out[list(MACHINE_COLUMNS)]


def provenance(run: pd.DataFrame) -> pd.DataFrame:
    """Each run's status, the repository commit it ran (10 characters, ``-dirty`` with uncommitted changes), its
    container and when it started (UTC, to the minute)."""
    commit = (run["git_commit"].str.replace("-dirty", "", regex=False).str.slice(0, 10)
              + run["git_commit"].str.endswith("-dirty").map({True: "-dirty", False: ""}))
    out = run.assign(commit=commit, container=run["container"].replace("", "bare metal"),
                     started=run["start_time"].str.slice(0, 16).str.replace("T", " "))
    return out[["gpu_slug", "config", "status", "commit", "container", "started"]]


def unfinished_text(data: Data) -> str:
    """The runs that did not finish, with why, and the bench timings kept beside the data."""
    run = data.run
    failed = run[run["status"] != "ok"]
    lines = [f"- {code(f'{r.gpu_slug}/{r.config}')}: **{md(r.status)}**, {md(r.message)}" for r in failed.itertuples()]
    text = ("Runs that did not finish, with why:\n\n" + "\n".join(lines) if lines else
            f"All {len(run)} runs finished (status `ok`).")
    if not data.bench.empty:
        b = data.bench.groupby(["gpu_slug", "torch", "cudnn"], sort=False)["source"].nunique()
        text += ("\n\nBench timings kept beside the data (`python -m medddpm bench`, ours and the reference "
                 "implementation: step time and peak memory only, no kernels or counters): "
                 + "; ".join(f"{n} bench run{'s' if n > 1 else ''} on {code(slug)} (torch {md(t)}, cuDNN {md(c)})"
                             for (slug, t, c), n in b.items())
                 + "; the [step-time page](step-time.md) sets them side by side.")
    return text


def changed(config: Config) -> str:
    """The switches where a configuration differs from strict FP32: a bool as its name, others as name=value."""
    base = CONFIGS["baseline"].flags
    return ", ".join(k if v is True else f"{k}={v}" for k, v in config.flags.items() if base[k] != v) or "none"


def configurations() -> pd.DataFrame:
    """Every configuration: what it is and the switches it changes from strict FP32."""
    return pd.DataFrame([{"configuration": c.name, "what it is": c.description,
                          "switches changed from baseline": changed(c)} for c in CONFIGS.values()])


def switches_html() -> str:
    """Every switch of every configuration, a column per configuration, folded under a one-line summary."""
    flags = pd.DataFrame([{"configuration": c.name, **c.flags} for c in CONFIGS.values()])
    wide = flags.set_index("configuration").T.reset_index().rename(columns={"index": "switch"})
    return tables.fold(f"Every switch of every configuration ({len(flags.columns) - 1} switches)",
                       tables.table_html(wide))


def not_applicable(run: pd.DataFrame) -> pd.DataFrame:
    """The switches a run recorded as not applicable on its device (TF32 or CUDA graphs on a CPU), with why."""
    rows = [(r.gpu_slug, r.config, k, v) for r in run.itertuples()
            for k, v in json.loads(r.not_applicable or "{}").items()]
    return pd.DataFrame(rows, columns=["device", "configuration", "switch", "why"])


def step_time_text(ok: pd.DataFrame) -> str:
    """How a micro-step is timed, with the warm-up and timed steps each preset's runs used."""
    steps = ", ".join(f"{md(s)}: {g['warmup_steps'].iloc[0]} warm-up + {g['timed_steps'].iloc[0]} timed"
                      for s, g in ok.groupby("preset"))
    return (f"**Step time.** Every precision and layout flag is set explicitly and read back, `cudnn.benchmark` is "
            f"on, and untimed warm-up steps absorb compilation and autotuning ({steps} micro-steps per preset in these "
            "runs). Each micro-step (forward, backward, Adam) is timed with CUDA events on a GPU and with the host "
            "clock on a CPU; pages report the median and the 10th-90th percentile spread. No profiler is attached to "
            "timed steps.")


def counters_text() -> str:
    """How Nsight Compute is run, with the sections it collects."""
    return ("**Hardware counters.** Nsight Compute (`ncu --clock-control none`, clocks left alone) replays only the "
            "kernels that make up 85% of one step (from the profiler's table, longest launches first, since ncu's "
            "cost grows with each launch it replays; 85% so that the counters still cover 80% of the step when a few "
            "chosen kernels are not matched back, such as cuDNN's dgrad launches, 2-3% of some H200 steps; each run "
            "records the share it chose), inside an NVTX range around that step, in two passes: PyTorch's and "
            "Triton's kernels by name, every launch configuration once; then every cuDNN and cuBLAS launch in order "
            "(at launch time ncu gives those the name of the launch before, so a name filter loses them). The "
            "profiled program stops itself before the time limit so that ncu keeps what it has. It collects the "
            "sections " + ", ".join(f"`{s}`" for s in ncu_sections()) + ", plus tensor-pipe, instruction-class, "
            "stall and FLOP metrics. The [counters page](counters.md) weights each profiled launch by its duration, "
            "and ranks Nsight Compute's rules by share of step time x estimated speedup.")


def schema_html() -> str:
    """Every table of the data tree with its columns, types and meanings, each folded under its name."""
    parts = []
    for table, cols in schema.TABLES.items():
        df = pd.DataFrame([{"column": name, "type": str(typ), "meaning": text} for name, (typ, text) in cols.items()])
        parts.append(tables.fold(f"{table}: {len(df)} columns", tables.table_html(df, code=("column",))))
    return "\n".join(parts)


def source(*objects) -> str:
    """The source of functions or classes of the package as one fenced Python block, for a page to show the
    code that made its numbers."""
    return "```python\n" + "\n\n".join(inspect.getsource(o).rstrip() for o in objects) + "\n```"
