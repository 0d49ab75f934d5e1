"""Loading the data tree: every run under ``data/``, validated, one frame per table.

A *run* is a folder ``data/<gpu-slug>/<run>/`` holding ``run.parquet`` (written last by the
producer, so its presence marks a finished measurement). ``<run>`` is the configuration's name for
the device's main preset at batch 1 (what every page compares), and ``<config>@<preset>[-b<batch>]``
for a *variant* (another model, such as the BraTS one, or another batch; `layout.run_folder`): only
the memory page reads those (``variants=True``). Two folders of a GPU hold runs that belong together
apart from the main ones: ``ablation/`` (`python -m medddpm ablation`) and ``scaling/`` (data-parallel
tables). Folders that hold no parquet but a ``bench.parquet`` (``reference/`` with the bench timings of ours
and the reference implementation, table ``bench``) or none at all (a sweep's hidden staging folders) are
not runs. A run of another identity than its folder name's default sits in ``<run>~<key>`` (`store.identity`),
a variant like those above.

One bad folder never takes the tree down with it: a folder with other parquet but no ``run.parquet`` (an
incomplete run), a finished run without a table its row says it wrote (`expected_tables`), a table that is not
a regular file, does not read or holds another run's rows, a row in another folder than it names, a device
folder whose name is no label, is left out with a `DataWarning` naming it (one line), and every other folder is
shown; a page never drops a measurement silently. Hidden names (a writer's staging folders and locks) are
skipped by every reader alike (`labels`). A missing tree is a `DataError`, and so is a folder left out where
``MEDDDPM_STRICT_DATA=1`` (the published book's build, `scripts/book.sh`: every committed folder must read).

Nothing here names a GPU: every summary is grouped by the ``gpu_slug`` found in the data, so a GPU added
under ``data/`` appears on every page without an edit.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa

from medddpm.errors import Notice, UserError
from medddpm.store import identity, schema
from medddpm.store.storage import NotRegularFile, check_regular
from medddpm.store.layout import (ABLATION_DIR, BENCH_FILE, NOT_RUNS, ROOFS_FILE, RUN_FILE, RUN_TABLES, SCALING_DIR,
                                  data_root, hidden, run_folder, run_table)
from medddpm.configs import CONFIGS

HOLDS, FAILS, NA = "holds", "does not hold", "not measurable"
MAGNITUDE = "direction holds, magnitude differs"  # the effect goes the paper's way, its size lies outside the paper's
UNDECIDED = "undecided"  # measured, but the spread of the measurements cannot tell (more seeds would)
IN_FULL, IN_PART = "in full", "in part"  # how much of a claim a verdict judged: all its halves, or some not yet
NOT_MEASURED = "not measured yet"
_GIB = 2**30
NOT_YET = "not met by the runs so far"  # a memory target none of the measured runs meets, while others are unmeasured


class DataError(UserError):
    """The data tree is missing or malformed (one line naming the folder or file)."""


class DataWarning(Notice):
    """A folder or table of the data tree is left out (one line naming it and why); the rest is shown."""


def _leave_out(why: str) -> None:
    if os.environ.get("MEDDDPM_STRICT_DATA") == "1":
        raise DataError(why)
    warnings.warn(f"left out of the data: {why}", DataWarning, stacklevel=3)


def config_order(names=()) -> list[str]:
    """CONFIGS order first, then any other configuration names found in the data, sorted."""
    extra = sorted({str(n) for n in names} - set(CONFIGS))
    return list(CONFIGS) + extra


def is_cpu(slug: str) -> bool:
    """Whether a device label names a CPU: `cpu`, or `cpu-<host>` for a CPU measured beside the committed rows.
    A CPU runs the smoke preset, which checks the pipeline: the pages show GPUs first and a CPU's rows apart."""
    return slug == "cpu" or slug.startswith("cpu-")


def cpu_slugs(run: pd.DataFrame) -> set[str]:
    """The device labels of `run` whose rows ran on a CPU (by the device's name, whatever the label)."""
    if run.empty:
        return set()
    return set(run.loc[run["gpu_name"] == "cpu", "gpu_slug"]) | {s for s in run["gpu_slug"] if is_cpu(s)}


def _sort(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """Rows by device, GPUs before CPUs, then configuration in CONFIGS order."""
    if df.empty or "config" not in df:
        return df.reset_index(drop=True)
    rank = {c: i for i, c in enumerate(config_order(df["config"].unique()))}
    keys = [c for c in ("gpu_slug", *cols) if c in df]
    cpu = df["gpu_slug"].map(is_cpu) if "gpu_slug" in df else False
    order = ["_cpu", keys[0], "_rank", *keys[1:]] if keys else ["_rank"]
    return (df.assign(_rank=df["config"].map(rank), _cpu=cpu).sort_values(order, kind="stable")
            .drop(columns=["_rank", "_cpu"]).reset_index(drop=True))




_LABEL = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")  # a device label as the sweep names its folder (`gpu_slug`)


def labels(root: Path) -> list[Path]:
    """The device folders of the data tree, sorted: every folder but hidden ones (a writer's, `layout.hidden`);
    one whose name is not a label (lower-case letters and digits in hyphen-separated runs) is left out, named."""
    found = []
    if not root.is_dir():
        return found
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not hidden(p.name)):
        if _LABEL.fullmatch(folder.name):
            found.append(folder)
        else:
            _leave_out(f"{folder}: not a device label (lower-case letters, digits and hyphens, as a sweep names it)")
    return found


def _regular(path: Path) -> bool:
    """Whether `path` is a regular file; where something else is there (a folder, a named pipe, a symlink loop or
    one to nothing), it is left out, named."""
    try:
        check_regular(path, "a table")
    except FileNotFoundError:
        if os.path.lexists(path):
            _leave_out(f"{path}: a symlink to nothing")
        return False
    except NotRegularFile as e:
        _leave_out(str(e))
        return False
    return True


def expected_tables(r: pd.Series) -> set[str]:
    """The tables besides run.parquet that a finished run's row says it wrote: steps and quality where it ended
    ok (training and the quality phase fail the run: a failure ends it in error; a quality phase not requested is
    recorded in `profilers`), kernels and ncu where their profiler's status is ok. A row that records no phases
    (written by hand, or before they were recorded) promises its steps alone."""
    if r["status"] != "ok":
        return set()
    try:
        phases = json.loads(r["profilers"]) if r["profilers"] else None
    except ValueError:
        phases = None
    if not isinstance(phases, dict):
        return {"steps"}
    ran = {table for phase, table in (("torch", "kernels"), ("ncu", "ncu"))
           if isinstance(phases.get(phase), dict) and phases[phase].get("status") == "ok"}
    return {"steps"} | ran | ({"quality"} if "quality" not in phases else set())


@dataclass(frozen=True)
class Scan:
    runs: list[Path]  # data/<slug>/<config>/ folders with run.parquet
    not_runs: list[Path]  # folders without run.parquet whose only parquet, if any, is bench.parquet


def scan(root: str | os.PathLike | None = None) -> Scan:
    """Find the runs under the data tree; raise on a missing tree, warn of an incomplete run and leave it out."""
    root = Path(root) if root is not None else data_root()
    if not root.is_dir():
        raise DataError(f"no data tree at {root} (set MEDDDPM_DATA or run `python -m medddpm sweep`)")
    runs, not_runs = [], []
    for gpu in labels(root):
        for folder in sorted(p for p in gpu.iterdir() if p.is_dir() and not hidden(p.name)):
            if folder.name in NOT_RUNS:  # `scaling_runs`, `ablation_runs`, and the study's `report.convergence`
                continue
            if os.path.lexists(folder / RUN_FILE):
                if _regular(folder / RUN_FILE):
                    runs.append(folder)
            elif any(p.name != BENCH_FILE for p in folder.glob("*.parquet")):
                _leave_out(f"incomplete run {folder}: parquet files but no run.parquet "
                           "(re-run the sweep for it, or remove the folder)")
            else:
                not_runs.append(folder)
    return Scan(runs, not_runs)


def _read(path: Path, table: str) -> pd.DataFrame:
    try:
        return schema.read_table(path, table)
    except (schema.SchemaError, OSError, ValueError) as e:
        why = str(e).splitlines()[0]
        raise DataError(why if why.startswith(f"{path}: ") else f"{path}: {why}") from None  # the path named once


def _read_run(path: Path) -> pd.DataFrame:
    """A run.parquet, validated, with its one row and what differs from its configuration's definition."""
    df = _read(path, "run")
    if len(df) != 1:
        raise DataError(f"{path}: {len(df)} rows, expected 1")
    return df


def _run_folder(r: pd.Series, found: str) -> str:
    """The folder name a run row belongs in; `found`, the folder it is in, where that names the row's label
    channels as another width than its data's own (``-m<N>``, which the row alone cannot tell), or the key of
    the identity the row records (``~<key>``: another identity than the folder name's default)."""
    batch = int(r["batch"])  # -1: a run that failed before recording it (older rows), batch 1 then
    plain, suffix = identity.split_folder(found)
    name = run_folder(r["config"], r["preset"], batch if batch > 0 else 1)
    narrow = run_folder(r["config"], r["preset"], batch if batch > 0 else 1, int(r["mask_channels"]))
    name = narrow if plain == narrow else name
    if suffix and r["identity"] and suffix == identity.key(r["identity"]):
        return f"{name}{identity.SEPARATOR}{suffix}"
    return name


def _checked_run(folder: Path, parent: str) -> pd.DataFrame | None:
    """The run row of `folder`, or None (with a warning naming it) where it does not read or names another
    folder than its own."""
    try:
        df = _read_run(run_table(folder, "run"))
    except DataError as e:
        _leave_out(str(e))
        return None
    r = df.iloc[0]
    name = _run_folder(r, folder.name)
    slug, *group = parent.split("/", 1)
    if (r["gpu_slug"], name) != (slug, folder.name):
        says = "/".join([r["gpu_slug"], *group, name])
        _leave_out(f"{folder}: run.parquet says {says}, the folder says {parent}/{folder.name}")
        return None
    for table in sorted(expected_tables(r)):
        path = run_table(folder, table)
        if not os.path.lexists(path):
            _leave_out(f"{folder}: a finished run without its {path.name} (its row says it wrote one; re-run the sweep "
                       "for it, or remove the folder)")
            return None
        if not _regular(path):
            return None
    return df


def runs(root: str | os.PathLike | None = None, *, variants: bool = False) -> pd.DataFrame:
    """The run table of every run (one row each), with its folder relative to the data root.

    `variants`: also the runs of other presets, batches or widths (``<config>@<preset>[-b<batch>][-m<N>]``); every
    page but the memory one compares the main runs only, one per (GPU, configuration)."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for folder in scan(root).runs:
        df = _checked_run(folder, folder.parent.name)
        if df is not None and (variants or folder.name == df.loc[0, "config"]):
            frames.append(df.assign(folder=str(folder.relative_to(root))))
    if not frames:
        return schema.empty("run").assign(folder=pd.Series(dtype="str"))
    out = pd.concat(frames, ignore_index=True)
    dup = out["run_id"].duplicated()
    for _, r in out[dup].iterrows():
        _leave_out(f"{root / r['folder']}: run_id {r['run_id']} is already the run of another folder")
    return _sort(out[~dup])


def ablation_runs(root: str | os.PathLike | None = None, *, variants: bool = False) -> pd.DataFrame:
    """The ablation's runs (``data/<gpu>/ablation/<config>/``, written by `python -m medddpm ablation`): ordinary
    runs, validated as the main ones, each in the folder its row names. `variants`: also those of another
    identity (``<config>~<key>``: other steps than the preset's), which the ablation page leaves out, as every page
    compares one identity per configuration."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for path in sorted(p for gpu in labels(root) for p in gpu.glob(f"{ABLATION_DIR}/*/{RUN_FILE}")):
        folder = path.parent
        if hidden(folder.name) or not _regular(path):
            continue
        if not variants and identity.SEPARATOR in folder.name:
            continue
        df = _checked_run(folder, f"{folder.parent.parent.name}/{ABLATION_DIR}")
        if df is not None:
            frames.append(df.assign(folder=str(folder.relative_to(root))))
    if not frames:
        return schema.empty("run").assign(folder=pd.Series(dtype="str"))
    return _sort(pd.concat(frames, ignore_index=True))


def load(table: str, root: str | os.PathLike | None = None, *, variants: bool = False) -> pd.DataFrame:
    """Every ``data/*/*/<table>.parquet`` of the runs, validated, with ``gpu_slug`` and ``config``."""
    if table not in schema.TABLES:
        raise DataError(f"unknown table {table!r}; known: {', '.join(schema.TABLES)}")
    root = Path(root) if root is not None else data_root()
    run = runs(root, variants=variants)
    return run if table == "run" else _run_tables(table, root, run)


def _run_tables(table: str, root: Path, run: pd.DataFrame) -> pd.DataFrame:
    """`table` of every run of `run` (`runs`), validated, with ``gpu_slug`` and ``config``."""
    frames = []
    for folder in run["folder"]:
        path = run_table(root / folder, table)
        if not os.path.lexists(path):
            continue  # a phase that did not run (a CPU has no ncu table; a failed run has few): `expected_tables`
        try:
            df = _read(path, table)
        except DataError as e:
            _leave_out(str(e))
            continue
        own = run.loc[run["folder"] == folder, "run_id"].iloc[0]
        if not df.empty and not (df["run_id"] == own).all():
            _leave_out(f"{path}: run_id {df.loc[df['run_id'] != own, 'run_id'].iloc[0]} is not the run of its folder")
            continue
        frames.append(df)
    df = pd.concat(frames, ignore_index=True) if frames else schema.empty(table)
    keys = run[["run_id", "gpu_slug", "config"]]
    return _one_chunk(df.merge(keys, on="run_id", how="left", validate="many_to_one"))


def _one_chunk(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with each Arrow-backed column (pandas' strings) in one piece: a table joined from many files holds a piece
    (chunk) per file, and Arrow selects rows of a column in pieces by joining all of them first, so every selection
    copies the whole column."""
    for column in df.columns:
        to_arrow = getattr(df[column].array, "__arrow_array__", None)
        chunked = to_arrow() if to_arrow is not None else None
        if isinstance(chunked, pa.ChunkedArray) and chunked.num_chunks > 1:
            df[column] = pd.Series(pd.array(chunked.combine_chunks(), dtype=df[column].dtype), index=df.index,
                                   name=column)
    return df


BENCH_PHASES = ("train", "sample")


@dataclass
class Data:
    """All tables of all runs (what `claims` and the page summaries take)."""

    run: pd.DataFrame
    steps: pd.DataFrame
    kernels: pd.DataFrame
    ncu: pd.DataFrame
    quality: pd.DataFrame
    bench: pd.DataFrame = field(default_factory=lambda: schema.empty("bench"))
    scaling: pd.DataFrame = field(default_factory=lambda: schema.empty("scaling"))
    roofs: pd.DataFrame = field(default_factory=lambda: schema.empty("roofs"))

    @property
    def ok(self) -> pd.DataFrame:
        return self.run[self.run["status"] == "ok"]


def load_all(root: str | os.PathLike | None = None) -> Data:
    """Every table of the tree; the run folders read and checked once (`runs`), not once a table."""
    root = Path(root) if root is not None else data_root()
    run = runs(root)
    return Data(run=run, **{t: _run_tables(t, root, run) for t in RUN_TABLES if t != "run"}, bench=bench_runs(root),
                scaling=scaling_runs(root), roofs=roofs_table(root))


def roofs_table(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every ``data/<gpu-slug>/roofs.parquet`` (the label's measured bandwidth and matmul rates), validated; a file
    whose rows name another label than its folder is left out with a warning."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for path in (gpu / ROOFS_FILE for gpu in labels(root) if os.path.lexists(gpu / ROOFS_FILE)):
        try:
            df = _read(path, "roofs")
        except DataError as e:
            _leave_out(str(e))
            continue
        if not (df["gpu_slug"] == path.parent.name).all():
            _leave_out(f"{path}: roofs of another label than its folder says")
            continue
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else schema.empty("roofs")


def gpu_types(run: pd.DataFrame, roofs: pd.DataFrame | None = None) -> dict[str, str]:
    """Label -> device type, from the labels' runs and roofs (a label's type is its own name where neither says)."""
    pairs = [run[["gpu_slug", "gpu_type"]]] if not run.empty else []
    if roofs is not None and not roofs.empty:
        pairs.append(roofs[["gpu_slug", "gpu_type"]])
    if not pairs:
        return {}
    both = pd.concat(pairs).dropna().drop_duplicates("gpu_slug")
    return dict(zip(both["gpu_slug"], both["gpu_type"]))


def scaling_runs(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every ``data/<gpu-slug>/scaling/<config>.parquet`` (`python -m medddpm scale`), validated."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for path in sorted(p for gpu in labels(root) for p in gpu.glob(f"{SCALING_DIR}/*.parquet") if not hidden(p.name)):
        try:
            df = _read(path, "scaling")
        except DataError as e:
            _leave_out(str(e))
            continue
        if not df.empty and not ((df["gpu_slug"] == path.parent.parent.name) & (df["config"] == path.stem)).all():
            _leave_out(f"{path}: rows of another GPU or configuration than its path says")
            continue
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else schema.empty("scaling")


def bench_runs(root: str | os.PathLike | None = None, *, phase: str | None = "train") -> pd.DataFrame:
    """`python -m medddpm bench` timings (``data/<gpu-slug>/<folder>/bench.parquet``, table ``bench``) kept in
    folders that are not runs, validated.

    These come before the measurement pipeline (no kernels, counters or quality): the book shows them
    apart and uses them for timing claims only where a GPU has no sweep yet. `phase`: "train" (a
    micro-step, the default: `train_median_ms`, ...), "sample" (a denoising step: `sample_step_median_ms`,
    ...) or None for both."""
    if phase is not None and phase not in BENCH_PHASES:
        raise ValueError(f"phase must be one of {BENCH_PHASES} or None, got {phase!r}")
    root = Path(root) if root is not None else data_root()
    frames = []
    for folder in scan(root).not_runs:
        path = folder / BENCH_FILE
        if not os.path.lexists(path):
            continue
        try:
            df = _read(path, "bench")
        except DataError as e:
            _leave_out(str(e))
            continue
        if not (df["gpu_slug"] == folder.parent.name).all():
            _leave_out(f"{path}: rows of another GPU than its path says")
            continue
        frames.append(df if phase is None else df[df["phase"] == phase])
    df = pd.concat(frames, ignore_index=True) if frames else schema.empty("bench")
    return _sort(df, "implementation", "source")
