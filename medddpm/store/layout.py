"""The map of the data tree: every folder and file the measurements write and the book reads, named once.

    data/                                 data_root(): $MEDDDPM_DATA, else the checkout's data/
      partition.parquet                   PARTITION_FILE: what compiled steps save for their backward (traced)
      <label>/                            a device label: its type (nvidia-h200, cpu), or <type>-<host>
        roofs.parquet                     ROOFS_FILE: the label's bandwidth and matmul rates
        <run>/                            run_folder(): a measured run of the producer notebook
          run.parquet                     RUN_FILE, written last: its presence marks a finished run
          steps.parquet, kernels.parquet, ncu.parquet, quality.parquet      RUN_TABLES, run_table()
          produce.ipynb                   NOTEBOOK_FILE: the executed producer notebook
          kernel.log                      KERNEL_LOG: what the notebook's kernel process printed outside its cells
        <run>~<key>/                      the same run under another identity (SEPARATOR, `store.identity`)
        ablation/<run>/                   ABLATION_DIR: the ablation's runs, a run folder each
        levers/                           LEVERS_DIR: calls that time best and its variants interleaved
          repeats.parquet, sample_batches.parquet                           LEVERS_TABLES, every call's rows
          <config>/kernels.parquet, <config>/quality.parquet                LEVER_RUN_TABLES, the latest call's
        scaling/<config>.parquet          SCALING_DIR, scaling_table(): every rank's step times
        reference/bench.parquet           REFERENCE_DIR, BENCH_FILE: bench timings of ours and the reference
        convergence/                      CONVERGENCE_DIR: the convergence study
          runs.parquet, losses.parquet, samples.parquet                     CONVERGENCE_TABLES
          slices/                         SLICES_DIR: PNG slices of the samples
      .<name>.stage-<pid>/, .<name>.old-<pid>/, .<name>.lock               hidden(): a writer's, readers skip them

Beside the tree: the caches a measured run keeps under the checkout's runs/ (`NCU_REPORTS`, `QUALITY_CACHE`), and
the allocator snapshots `bench --memory-snapshot` writes into a folder of the user's (`snapshot_name`), each with
its summary table beside it (`snapshot_summary`). The tables' columns are `medddpm.store.schema`'s; which table a
file holds follows from its place here (`table_of`).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from medddpm import REPO

# ----------------------------------------------------------------------------------------------- the root


def data_root() -> Path:
    """The data tree the book and the claims read: ``$MEDDDPM_DATA`` (an empty value counts as unset), else
    the checkout's ``data/``."""
    return Path(os.environ.get("MEDDDPM_DATA") or REPO / "data")


PARTITION_FILE = "partition.parquet"  # table partition, in the data root beside the labels: counted, not measured

# ------------------------------------------------------------------------------------------------ a label

ROOFS_FILE = "roofs.parquet"  # table roofs, beside the label's run folders
ABLATION_DIR = "ablation"  # `python -m medddpm ablation`: a group of run folders
SCALING_DIR = "scaling"  # `python -m medddpm scale`: one table per configuration, not a run folder
REFERENCE_DIR = "reference"  # `python -m medddpm bench --reference --out`: bench timings, not a run folder
BENCH_FILE = "bench.parquet"  # table bench, in a folder that is not a run (REFERENCE_DIR, or any --out)
CONVERGENCE_DIR = "convergence"  # `python -m medddpm study`
# One process times best and its variants in interleaved blocks (A, B, C, A, B, C, ...) and keeps each block
# (table repeats; every call's rows, told apart by their call_id) and the sampling time by batch (sample_batches),
# and per variant its kernels and its quality against strict FP32 (one run each, the latest call's)
LEVERS_DIR = "levers"
LEVERS_TABLES = ("repeats", "sample_batches")  # levers/<table>.parquet
LEVER_RUN_TABLES = ("kernels", "quality")  # levers/<config>/<table>.parquet
CONVERGENCE_TABLES = ("runs", "losses", "samples")  # file stems; the schema's tables are convergence_<stem>
SLICES_DIR = "slices"  # under CONVERGENCE_DIR
# folders of a label that hold no run of their own name: every other folder is a run (or an incomplete one)
NOT_RUNS = (ABLATION_DIR, SCALING_DIR, CONVERGENCE_DIR, LEVERS_DIR)


def scaling_table(root: str | os.PathLike, label: str, config: str) -> Path:
    return Path(root) / label / SCALING_DIR / f"{config}.parquet"


def convergence_folder(root: str | os.PathLike, label: str) -> Path:
    return Path(root) / label / CONVERGENCE_DIR


def levers_table(root: str | os.PathLike, label: str, table: str, config: str | None = None) -> Path:
    """Where a label's lever calls keep one of `LEVERS_TABLES`, or with `config` one of that variant's
    `LEVER_RUN_TABLES` (each file's schema table is its stem)."""
    assert table in (LEVER_RUN_TABLES if config else LEVERS_TABLES), (table, config)
    folder = Path(root) / label / LEVERS_DIR
    return (folder / config if config else folder) / f"{table}.parquet"


# -------------------------------------------------------------------------------------------------- a run

RUN_FILE = "run.parquet"  # table run, one row; written last
RUN_TABLES = ("run", "steps", "kernels", "ncu", "quality")  # one <table>.parquet each in a run folder
NOTEBOOK_FILE = "produce.ipynb"  # the producer notebook: notebooks/<this>, and its executed copy in each run
KERNEL_LOG = "kernel.log"
SEPARATOR = "~"  # <run>~<key>: a run of another identity than its folder name's default
MAIN_PRESETS = ("smoke", "paper")  # a device's own presets: their batch-1 runs sit in <label>/<config>/


def run_folder(config: str, preset: str, batch: int = 1, mask_channels: int | None = None) -> str:
    """Folder name of a run under data/<label>/: the configuration for the main presets at batch 1
    (the layout every page reads), ``<config>@<preset>`` and ``-b<batch>`` otherwise, so that one
    device can hold the same configuration measured on another model or batch beside it. `mask_channels`:
    a model narrower or wider than its data's own label channels (the reference's whole-head width, 2, on
    the 3-tissue embedded data) adds ``-m<mask_channels>``."""
    if preset in MAIN_PRESETS and batch == 1 and mask_channels is None:
        return config
    return (f"{config}@{preset}" + (f"-b{batch}" if batch != 1 else "")
            + (f"-m{mask_channels}" if mask_channels is not None else ""))


def run_table(folder: str | os.PathLike, table: str) -> Path:
    """Where a run folder keeps one of its `RUN_TABLES`."""
    return Path(folder) / f"{table}.parquet"


def is_run(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a finished run."""
    return (Path(folder) / RUN_FILE).is_file()


# ------------------------------------------------------------------------------------------ hidden names


def hidden(name: str) -> bool:
    """A name a writer holds for a while (a staging folder, a replaced result, a lock): readers skip it."""
    return name.startswith(".")


def stage_folder(final: str | os.PathLike, pid: int) -> Path:
    """Where a run is measured before it takes the place of `final` in one step (`storage.publish_folder`)."""
    final = Path(final)
    return final.parent / f".{final.name}.stage-{pid}"


def old_folder(final: str | os.PathLike, pid: int) -> Path:
    """Where `final`'s previous result waits while the new one takes its place."""
    final = Path(final)
    return final.parent / f".{final.name}.old-{pid}"


def leftover_patterns(plain: str) -> tuple[str, ...]:
    """Glob patterns (beside the run) of the staging and replaced folders of the runs named `plain`
    (`plain` and `plain~<key>`) that a killed writer left."""
    return tuple(f".{glob.escape(plain)}{key}.{kind}-*" for key in ("", f"{SEPARATOR}*") for kind in ("stage", "old"))


def leftover_of(name: str) -> str:
    """('.baseline~1a2b.old-42' ->) the run folder a staging or replaced folder belongs to."""
    return name[1:].rsplit(".", 1)[0]


def run_lock_file(parent: str | os.PathLike, plain: str) -> Path:
    """The one lock of the runs named `plain` (`plain`, `plain~<key>`) under `parent`: one writer at a time."""
    return Path(parent) / f".{plain}.lock"


# ------------------------------------------------------------------------------------- beside the tree

WORK = REPO / "runs"  # what a run keeps apart from its results: reports too large for the tree, caches
NCU_REPORTS = WORK / "ncu"  # Nsight Compute's reports (tens of MB): <label>/<run>/
QUALITY_CACHE = WORK / "quality"  # the strict-FP32 side of the quality phase, reused by a sweep's runs

SNAPSHOT_PREFIX = "memory-"  # memory-<config>-<commit>.pickle[.gz], and its summary memory-<config>-<commit>.parquet
_SNAPSHOT = re.compile(r"memory-(.+?)(?:-([0-9a-f]{7}|unknown))?\.pickle(?:\.gz)?")


def snapshot_config(config: str) -> str:
    """A configuration's name as a snapshot's file name spells it: letters, digits, '_', '.' and '-'."""
    return re.sub(r"[^\w.-]", "_", config)


def snapshot_name(config: str, commit: str) -> str:
    """The bench's file name for a configuration's snapshot, e.g. ("best-ckpt+narrow_checkpoints=false",
    "0123456789ab...") -> memory-best-ckpt_narrow_checkpoints_false-0123456.pickle (`parse_snapshot_name` reads
    it back); a commit that is not one: -unknown."""
    head = commit.split("-")[0].lower()
    short = head[:7] if re.fullmatch(r"[0-9a-f]{7,40}", head) else "unknown"
    return f"{SNAPSHOT_PREFIX}{snapshot_config(config)}-{short}.pickle"


def parse_snapshot_name(name: str) -> tuple[str, str]:
    """(the configuration as `snapshot_name` wrote it, the commit's first 7 digits or '') of a snapshot's file
    name (.pickle or .pickle.gz)."""
    m = _SNAPSHOT.fullmatch(name)
    if not m:
        raise ValueError(f"{name}: not a memory snapshot's name (memory-<config>-<commit>.pickle[.gz])")
    return m.group(1), m.group(2) if m.group(2) and m.group(2) != "unknown" else ""


def snapshot_summary(path: str | os.PathLike) -> Path:
    """Where a snapshot's summary (table snapshot) lies: memory-<config>-<commit>.parquet beside
    memory-<config>-<commit>.pickle[.gz]."""
    path = Path(path)
    return path.with_name(re.sub(r"\.pickle(\.gz)?$", "", path.name) + ".parquet")


# ------------------------------------------------------------------------------------------ which table


def table_of(path: str | os.PathLike) -> str:
    """The schema table a parquet file of the tree holds, from its place: scaling/<config>.parquet is table
    scaling, convergence/<stem>.parquet convergence_<stem>, a snapshot's summary snapshot, any other
    <table>.parquet its stem (run, steps, kernels, ncu, quality, bench, roofs, partition; under levers/ repeats and
    sample_batches, and kernels and quality per variant)."""
    path = Path(path)
    if path.parent.name == SCALING_DIR:
        return "scaling"
    if path.parent.name == CONVERGENCE_DIR:
        return f"{CONVERGENCE_DIR}_{path.stem}"
    if path.name.startswith(SNAPSHOT_PREFIX):
        return "snapshot"
    return path.stem
