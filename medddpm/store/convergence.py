"""The convergence study's folder, ``data/<gpu-slug>/convergence/`` (`python -m medddpm study`; its names are
`medddpm.store.layout`'s):

- ``runs.parquet`` (table ``convergence_runs``): one row per (configuration, seed), written last for it: a row
  with status ok marks that run finished, and a re-run skips it;
- ``losses.parquet`` (``convergence_losses``): the training loss of every step of every run;
- ``samples.parquet`` (``convergence_samples``): every score of every sample, and of the held-out subjects'
  real images (configuration ``real``);
- ``slices/``: the middle slices of each sample, label map and real image as small PNGs (`slice_file`).

Only the study's parent process writes the tables (each whole, atomically), so runs that train in parallel
processes never write one file at once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd

from medddpm.store import schema
from medddpm.store.layout import CONVERGENCE_DIR, CONVERGENCE_TABLES

DONE = ("ok", "diverged")  # run statuses that are results: a re-run skips them (an error is measured again)
REAL = "real"  # the configuration name of the held-out subjects' own images in samples.parquet


def table_name(path: str | os.PathLike) -> str:
    """The schema table of data/<gpu-slug>/convergence/<stem>.parquet."""
    stem = Path(path).name.removesuffix(".parquet")
    if stem not in CONVERGENCE_TABLES:
        raise schema.SchemaError(f"{path}: not a convergence table (one of {', '.join(CONVERGENCE_TABLES)})")
    return f"{CONVERGENCE_DIR}_{stem}"


def read(folder: str | os.PathLike, stem: str) -> pd.DataFrame:
    """One table of a study folder, validated; an empty table where the file is missing."""
    path = Path(folder) / f"{stem}.parquet"
    return schema.read_table(path, table_name(path)) if path.is_file() else schema.empty(table_name(path))


def write(folder: str | os.PathLike, stem: str, df: pd.DataFrame) -> Path:
    path = Path(folder) / f"{stem}.parquet"
    return schema.write_table(df.reset_index(drop=True), path, table_name(path))


def run_name(config: str, seed: int) -> str:
    """'best-s0': a run's name in file names. A configuration's name may hold '+' and '='; the file name keeps
    letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{config}-s{seed}")


def slice_file(kind: str, *parts) -> str:
    """File name under slices/: ('sample', config, seed, index), ('label', index) or ('real', index)."""
    if kind == "sample":
        config, seed, index = parts
        return f"{run_name(config, seed)}-{index}.png"
    if kind in ("label", "real"):
        (index,) = parts
        return f"{kind}-{index}.png"
    raise ValueError(f"unknown slice kind {kind!r}")
