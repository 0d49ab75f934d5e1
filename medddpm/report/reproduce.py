"""The reproduce page: the files a measurement writes, each with what it holds and how many columns, and what the
data tree holds now."""

from __future__ import annotations

import pandas as pd

from medddpm.report.loading import Scan, cpu_slugs, data_root
from medddpm.report.safe import code, md
from medddpm.store import schema

# Each table of the schema, in the words of the page. A table added to the schema without a line here fails
# `check_files`, so that the page never leaves one out.
WRITES = {
    "run": "one row: status, environment, switches, step-time summary, projected cost",
    "steps": "every timed training micro-step and every denoising step of one sample",
    "kernels": "torch.profiler breakdown by kernel, category and pass",
    "ncu": "Nsight Compute counters and rule results (GPU with ncu only)",
    "quality": "losses against strict FP32 and one forward pass's relative error",
    "scaling": "every rank's step times of python -m medddpm scale, one file per configuration beside the run folders",
    "bench": "bench timings of ours and the reference implementation (python -m medddpm bench --out): a row per "
             "timed configuration, step time and peak memory only",
    "roofs": "the label's roofs, measured once by the sweep (python -m medddpm roofs measures them again): DRAM "
             "bandwidth and dense matmul rates in FP32, TF32, bf16 and fp16, a row each",
    "partition": "what compiled steps save for their backward, traced on a CPU by python -m medddpm saved --write: "
                 "one file for the whole data tree, a row per model, configuration and torch version",
    "convergence_runs": "the convergence study (python -m medddpm study): a row per configuration and seed, its "
                        "settings, skipped steps and times",
    "convergence_losses": "the study's training loss of every step of every run",
    "convergence_samples": "the study's sample scores (label_dice, hist_w1, ms_ssim) and the real images'",
    "repeats": "blocks of training or denoising steps of best and its variants timed interleaved in one process, "
               "a row per block: what the Beyond page's lever verdicts pair",
    "sample_batches": "seconds per generated volume over batch sizes (python -m medddpm sample-batches)",
    "snapshot": "what is live at the peak of a memory snapshot, by the line that allocated it: written beside the "
                "snapshot by python -m medddpm bench --memory-snapshot DIR, read by python -m medddpm peak",
}
# Where a table is not a run folder's <table>.parquet.
WHERE = {"convergence_runs": "data/<gpu-slug>/convergence/runs.parquet",
         "convergence_losses": "data/<gpu-slug>/convergence/losses.parquet",
         "convergence_samples": "data/<gpu-slug>/convergence/samples.parquet",
         "scaling": "data/<gpu-slug>/scaling/<config>.parquet", "bench": "data/<gpu-slug>/reference/bench.parquet",
         "partition": "data/partition.parquet", "snapshot": "DIR/memory-<config>-<commit>.parquet",
         "roofs": "data/<gpu-slug>/roofs.parquet", "repeats": "data/<gpu-slug>/levers/repeats.parquet",
         "sample_batches": "data/<gpu-slug>/levers/sample_batches.parquet"}


def written_files() -> pd.DataFrame:
    """Every file a measurement writes: its path, what it holds, and its columns (the schema's)."""
    rows = [{"file": WHERE.get(t, f"data/<gpu-slug>/<config>/{t}.parquet"), "what": w,
             "columns": str(len(schema.TABLES[t]))} for t, w in WRITES.items()]
    rows.append({"file": "data/<gpu-slug>/<config>/produce.ipynb", "what": "the executed producer notebook",
                 "columns": ""})
    rows.append({"file": "data/<gpu-slug>/<config>/kernel.log", "what": "what the notebook's kernel process printed "
                 "outside its cells (native libraries' lines, a crash's last words), where it printed anything",
                 "columns": ""})
    return pd.DataFrame(rows)


def check_files(files: pd.DataFrame) -> None:
    """Every table of the schema is on the page, and the run folder's paths keep their placeholders."""
    assert set(WRITES) == set(schema.TABLES), "a table is missing from this page"
    assert files["file"].str.contains("<config>").sum() >= 7, files


def tree_text(found: Scan, run: pd.DataFrame) -> str:
    """What the data tree holds now: each device's configurations, and the folders read for bench timings only."""
    cpus = cpu_slugs(run)
    lines = [f"- **{md(slug)}**{' (a CPU: smoke runs)' if slug in cpus else ''}: "
             + ", ".join(code(c) for c in g["config"]) for slug, g in run.groupby("gpu_slug", sort=False)]  # GPUs first
    text = f"The data tree ({code(data_root().name + '/')}) holds these runs now:\n\n" + "\n".join(lines)
    if found.not_runs:
        text += ("\n\nFolders that are not runs (read for bench timings only): "
                 + ", ".join(code(f"{p.parent.name}/{p.name}/") for p in found.not_runs) + ".")
    return text
