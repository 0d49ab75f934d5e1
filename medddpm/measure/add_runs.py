"""Runs measured elsewhere, checked and added to the data tree: `python -m medddpm add-runs PATH`.

PATH is what a sweep (or the ablation) wrote under its ``--out`` on another machine: a folder holding
``<label>/<run>/`` and ``<label>/ablation/<run>/`` folders and a label's ``roofs.parquet``, or a .tgz of one; a
folder's .tgz files are read too. Every run is checked as the project checks its own, before anything is copied:

- schema: each table reads under today's schema (`store.schema.read_table`), the run table holds one row, every
  other table holds that run's rows, and the folder holds only the files a run folder holds (`store.layout`);
- identity: the row's switches are its configuration's today (`configs.mismatch`); its recorded identity names the
  row's configuration, switches, preset, shape, batch, steps and label, and its folder is the one the sweep gives
  that identity (`measure.sweep.plan_runs`, `store.identity.folder_name`); a row written before identities were
  recorded counts as the default identity of its folder name, as the sweep reads it;
- status: ok, oom or skipped (a run that ended in ``error`` measured nothing; the sweep measures it again);
- spread: an ok run's timed steps are in steps.parquet, their median and deciles are the row's, and
  p10 <= median <= p90.

A run that passes is copied under ``data/<label>/`` in one step (a staging folder published by
`storage.publish_folder`, under the run's lock), by the sweep's rules: a run of the same identity already there stays
as it is, one of another identity goes beside it in ``<run>~<key>``, never over it, and a failed run is replaced only
where git does not track it. A label's roofs are added where it has none. Each refusal is one line naming the file
and the reason; the other runs are added.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from medddpm.configs import ConfigError, get_config, mismatch
from medddpm.measure.env import gpu_slug, tracked_by_git
from medddpm.measure.sweep import final_folder, plan_runs, recorded, run_lock, stands
from medddpm.measure.timing.bench import train_summary
from medddpm.store import schema
from medddpm.store.lock import FolderInUse
from medddpm.store.identity import canonical, encode, folder_name, key, split_folder, switches_on
from medddpm.store.layout import (ABLATION_DIR, KERNEL_LOG, NOTEBOOK_FILE, ROOFS_FILE, RUN_FILE, RUN_TABLES, SEPARATOR,
                                  hidden, old_folder, run_table, stage_folder)
from medddpm.store.storage import NotRegularFile, atomic_write, open_regular, publish_folder

FILES = {f"{t}.parquet" for t in RUN_TABLES} | {NOTEBOOK_FILE, KERNEL_LOG}  # what a run folder may hold
TIMES = ("train_p10_ms", "train_median_ms", "train_p90_ms")
TOLERANCE = 1e-9  # relative: the row's step statistics are computed from the same values as steps.parquet's


class Refused(ValueError):
    """A run or file that is not added, with why (one line naming the file)."""


@dataclass(frozen=True)
class Checked:
    """A run that passed every check, and where the sweep's rules put it."""

    source: Path
    label: str
    group: str
    plain: str
    identity: str  # as the sweep compares it: '' (recorded before identities) counts as `default`
    default: str


def _identity_of(row, label: str, group: str, name: str, where: Path) -> tuple[str, str, str]:
    """(plain folder name, the run's identity, the default identity of that name) of a run folder named `name`."""
    text = str(row["identity"])
    try:
        recorded_fields = json.loads(text) if text else None
    except ValueError:
        recorded_fields = []
    if recorded_fields is not None and (not isinstance(recorded_fields, dict) or encode(recorded_fields) != text):
        raise Refused(f"{where}: column identity is not the sweep's JSON object of the run's identity")
    fields = json.loads(canonical(text)) if recorded_fields else {}
    mask = fields.get("mask_channels")
    try:
        params = {"batch": int(row["batch"])} | ({"mask_channels": int(mask)} if mask is not None else {})
        plan = plan_runs([get_config(row["config"])], preset=str(row["preset"]), gpu_label=label, params=params,
                         group=group)[0]
    except (TypeError, ValueError) as e:
        raise Refused(f"{where}: {str(e).splitlines()[0]}") from None
    plain, suffix = split_folder(name)
    if recorded_fields is None:  # a row of before identities: the default identity of its folder's name
        if suffix:
            raise Refused(f"{where}: no identity recorded, so it must be its folder's default run, not one in {name}")
        text = plan.default
        fields = json.loads(text)
    expected = {"config": row["config"], "switches": switches_on(get_config(row["config"]).flags),
                "preset": row["preset"], "shape": row["shape"], "batch": int(row["batch"]), "label": label,
                "group": group}
    if row["status"] == "ok":
        expected |= {"warmup": int(row["warmup_steps"]), "steps": int(row["timed_steps"])}
    wrong = [k for k, v in expected.items() if fields.get(k) != v]
    if wrong:
        raise Refused(f"{where}: the identity's {wrong[0]} is {fields.get(wrong[0])!r}, the run's {expected[wrong[0]]!r}")
    if plain != plan.plain:
        raise Refused(f"{where}: a run of {row['config']} ({row['preset']} preset, batch {row['batch']}) belongs in "
                      f"{plan.plain}, not {name}")
    if name not in (folder_name(plain, text, plan.default), f"{plain}{SEPARATOR}{key(text)}"):
        raise Refused(f"{where}: {name} is not the folder of its identity (the sweep writes it in "
                      f"{folder_name(plain, text, plan.default)})")
    return plain, text, plan.default


def _check_spread(row, folder: Path) -> None:
    """An ok run's step times: present, ordered, and those of its steps.parquet."""
    run_file = run_table(folder, "run")
    if int(row["timed_steps"]) < 1:
        raise Refused(f"{run_file}: status ok with no timed steps")
    values = [float(row[c]) for c in TIMES]
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise Refused(f"{run_file}: status ok without finite step times ({', '.join(map(str, values))})")
    if not values[0] <= values[1] <= values[2]:
        raise Refused(f"{run_file}: p10 <= median <= p90 does not hold ({values[0]:g}, {values[1]:g}, {values[2]:g} ms)")
    steps_file = run_table(folder, "steps")
    if not steps_file.is_file():
        raise Refused(f"{folder}: status ok but no steps.parquet (every timed step is kept there)")
    steps = schema.read_table(steps_file, "steps")
    timed = steps[(steps["phase"] == "train") & steps["timed"]]["step_ms"].tolist()
    if len(timed) != int(row["timed_steps"]):
        raise Refused(f"{steps_file}: {len(timed)} timed training steps, the run row says {int(row['timed_steps'])}")
    got = train_summary(timed)
    for column in TIMES:
        if not math.isclose(got[column], float(row[column]), rel_tol=TOLERANCE):
            raise Refused(f"{steps_file}: its timed steps give {column} {got[column]:g}, the run row "
                          f"{float(row[column]):g}")


def check_run(folder: str | os.PathLike, label: str, group: str = "") -> Checked:
    """Every check of a run folder found at ``<label>/[<group>/]<name>/``; Refused (one line) at the first that fails."""
    folder = Path(folder)
    run_file = run_table(folder, "run")
    try:
        run = schema.read_table(run_file, "run")
    except (schema.SchemaError, NotRegularFile, OSError) as e:
        raise Refused(f"{run_file}: {str(e).removeprefix(f'{run_file}: ').splitlines()[0]}") from None
    if len(run) != 1:
        raise Refused(f"{run_file}: {len(run)} rows, a run table holds one")
    row = run.iloc[0]
    stray = sorted(p.name for p in folder.iterdir() if p.name not in FILES)
    if stray:
        raise Refused(f"{folder / stray[0]}: not a file of a run folder ({', '.join(sorted(FILES))})")
    if not (folder / NOTEBOOK_FILE).is_file():
        raise Refused(f"{folder}: no {NOTEBOOK_FILE} (the executed notebook every run keeps beside its tables)")
    if row["status"] not in ("ok", "oom", "skipped"):
        raise Refused(f"{run_file}: status {row['status']} ({str(row['message'])[:120]}): not a measurement; the sweep "
                      "measures it again")
    if row["gpu_slug"] != label:
        raise Refused(f"{run_file}: its label is {row['gpu_slug']!r}, but it lies under {label}/")
    if gpu_slug(str(row["gpu_name"])) != row["gpu_type"]:
        raise Refused(f"{run_file}: gpu_type {row['gpu_type']!r} is not the type of gpu_name {row['gpu_name']!r}")
    try:
        changed = mismatch(row)
    except ConfigError as e:
        raise Refused(f"{run_file}: {e}") from None
    if changed:
        raise Refused(f"{run_file}: ran as {row['config']} with other switches than its definition today "
                      f"({', '.join(f'{k}={a!r}, defined {b!r}' for k, (a, b) in changed.items())})")
    plain, identity, default = _identity_of(row, label, group, folder.name, run_file)
    for table in RUN_TABLES[1:]:
        path = run_table(folder, table)
        if not path.is_file():
            continue
        try:
            df = schema.read_table(path, table)
        except (schema.SchemaError, NotRegularFile, OSError) as e:
            raise Refused(f"{path}: {str(e).removeprefix(f'{path}: ').splitlines()[0]}") from None
        if len(df) and df["run_id"].iloc[0] != row["run_id"]:
            raise Refused(f"{path}: rows of run {df['run_id'].iloc[0]}, not of {row['run_id']}")
    if row["status"] == "ok":
        _check_spread(row, folder)
    return Checked(folder, label, group, plain, identity, default)


def _runs_in(root: Path) -> tuple[list[tuple[Path, str, str]], list[Path], list[str]]:
    """(run folders with their label and group, roofs files, refusals) found under a data tree `root`."""
    runs, roofs, refused = [], [], []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(hidden(part) for part in rel.parts):
            continue
        if path.name == RUN_FILE:
            parts = rel.parent.parts
            if len(parts) == 2 or (len(parts) == 3 and parts[1] == ABLATION_DIR):
                runs.append((path.parent, parts[0], parts[1] if len(parts) == 3 else ""))
            else:
                refused.append(f"{path}: not at <label>/<run>/ or <label>/{ABLATION_DIR}/<run>/ of a data tree")
        elif path.name == ROOFS_FILE and len(rel.parts) == 2:
            roofs.append(path)
    return runs, roofs, refused


def _unpacked(path: Path, into: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """The data trees `path` holds, each with the name its refusals give it: itself (a folder), and each .tgz in it
    or that it is, unpacked under `into`; and the refusals of archives that cannot be read."""
    archives = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.name.endswith((".tgz", ".tar.gz")))
    trees, refused = ([] if path.is_file() else [(path, str(path))]), []
    for i, archive in enumerate(archives):
        target = into / str(i)
        try:
            with open_regular(archive, "an archive") as f, tarfile.open(fileobj=f) as tar:  # never a named pipe's wait
                tar.extractall(target, filter="data")  # no links out of the tree, no absolute paths
        except (tarfile.TarError, OSError, NotRegularFile) as e:
            refused.append(f"{archive}: not a readable .tgz ({str(e).splitlines()[0]})")
            continue
        trees.append((target, f"{archive}:"))
    return trees, refused


def _add_roofs(path: Path, out: Path, label: str) -> str:
    try:
        roofs = schema.read_table(path, "roofs")
    except (schema.SchemaError, NotRegularFile, OSError) as e:
        raise Refused(f"{path}: {str(e).removeprefix(f'{path}: ').splitlines()[0]}") from None
    if set(roofs["gpu_slug"]) != {label}:
        raise Refused(f"{path}: roofs of {', '.join(sorted(set(roofs['gpu_slug'])))}, but it lies under {label}/")
    final = out / label / ROOFS_FILE
    if final.exists():
        return f"kept: {final} (the label has its roofs)"
    data = path.read_bytes()
    atomic_write(final, lambda f: f.write(data))
    return f"added: {final}"


def _publish(run: Checked, out: Path) -> tuple[str, Path]:
    """Copy a checked run into the tree by the sweep's rules: ('added' | 'kept', its folder)."""
    root = out / run.label / run.group
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(run_lock(root / run.plain, "add-runs"))
        except FolderInUse as e:
            raise Refused(f"{run_table(run.source, 'run')}: {e}; add it again once that has ended") from None
        final = final_folder(root, run.plain, run.identity, run.default)
        before = recorded(final)
        if stands(before, run.identity):
            return "kept", final
        if before is not None and tracked_by_git(root, [run_table(final.absolute(), "run")]):
            raise Refused(f"{run_table(run.source, 'run')}: it would replace the committed failed run in {final}; "
                          "remove that from git first")
        stage, old = stage_folder(final, os.getpid()), old_folder(final, os.getpid())
        try:
            shutil.copytree(run.source, stage)
            publish_folder(stage, final, old)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return "added", final


def add_runs(path: str | os.PathLike, out: str | os.PathLike = "data") -> dict[str, list[str]]:
    """Check every run under `path` and add those that pass to the data tree `out`; returns the lines of what was
    added, kept (already there) and refused."""
    path, out = Path(path), Path(out)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such folder or .tgz")
    said = {"added": [], "kept": [], "refused": []}
    with tempfile.TemporaryDirectory(prefix="medddpm-add-runs-") as tmp:
        trees, said["refused"] = _unpacked(path, Path(tmp))
        for tree, name in trees:
            runs, roofs, refused = _runs_in(tree)
            said["refused"] += [line.replace(str(tree), name) for line in refused]
            for folder, label, group in runs:
                try:
                    outcome, final = _publish(check_run(folder, label, group), out)
                    said[outcome].append(f"{outcome}: {final}")
                except Refused as e:
                    said["refused"].append(str(e).replace(str(tree), name))
            for roof in roofs:
                try:
                    line = _add_roofs(roof, out, roof.parent.name)
                except Refused as e:
                    said["refused"].append(str(e).replace(str(tree), name))
                    continue
                said["added" if line.startswith("added") else "kept"].append(line)
    return said
