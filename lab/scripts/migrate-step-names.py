"""One-off migration of the committed data tree to the step names (2026-12-05).

1. Every table under DATA_DIR written with a column the schema has since renamed (`schema.RENAMED`: the per-step
   `time_ms` of `steps` and `scaling`, now `step_ms`) is read through the schema, which renames it, and written
   back through it: the same rows and values under the new name.
2. The bench JSON files kept in DATA_DIR/<gpu>/reference/ become that folder's `bench.parquet` (table `bench`,
   `measure.timing.bench.bench_rows`: each summary recomputed from the run's recorded step times and checked against the
   JSON's own median, p10 and p90), each file under a source a reader can name. With --write, the JSON files
   move to lab/tuning/<gpu>/reference/, where their every step stays on record.

Usage: python lab/scripts/migrate-step-names.py [--write] [DATA_DIR]   (without --write: what it would do)
"""

import json
import math
import shutil
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from medddpm import REPO  # noqa: E402
from medddpm.measure.timing.bench import bench_rows  # noqa: E402
from medddpm.store import schema  # noqa: E402

# bench JSON file -> the source a reader sees (lab/notebook/reference.md tells what each run was)
SOURCES = {"compare-run1.json": "compare run 1", "compare-run2.json": "compare run 2",
           "more-configs-partial.json": "more configs run 1", "more-configs-2.json": "more configs run 2"}
# the summaries the JSON files recorded, under the names the bench table gives them
OLD_SUMMARY = {"median_ms": "train_median_ms", "p10_ms": "train_p10_ms", "p90_ms": "train_p90_ms"}


def table_of(path: Path) -> str:
    return "scaling" if path.parent.name == "scaling" else path.stem


def migrate_renamed(root: Path, write: bool) -> None:
    for path in sorted(root.rglob("*.parquet")):
        table = table_of(path)
        # the renames of this migration only: later ones (a micro-step's micro_step, micro_steps, timed_steps) read
        # under their new names through the schema, the files staying as measured
        old = set(schema.RENAMED.get(table, {})) & {"time_ms"} & set(pq.read_schema(path).names)
        if not old:
            continue
        df = schema.read_table(path, table)
        print(f"{path}: {', '.join(f'{o} -> {schema.RENAMED[table][o]}' for o in sorted(old))} ({len(df)} rows)")
        if write:
            schema.write_table(df, path, table)
            back = schema.read_table(path, table)
            assert back.equals(df), f"{path}: rows changed in the rewrite"


def migrate_bench(root: Path, write: bool) -> None:
    for folder in sorted({p.parent for p in root.glob("*/reference/*.json")}):
        files = sorted(folder.glob("*.json"))
        unknown = [p.name for p in files if p.name not in SOURCES]
        assert not unknown, f"{folder}: no source name for {unknown}"
        frames = []
        for path in files:
            doc = json.loads(path.read_text())
            rows = bench_rows(doc, source=SOURCES[path.name])
            for r, row in zip(doc["runs"], rows.itertuples()):
                for old, new in OLD_SUMMARY.items():
                    assert math.isclose(r[old], getattr(row, new), rel_tol=1e-12), (path.name, r["config"], old)
            assert (rows["gpu_slug"] == folder.parent.name).all(), f"{path}: rows of another GPU"
            frames.append(rows)
            print(f"{path}: {len(rows)} rows, source {SOURCES[path.name]!r}")
        if not write:
            continue
        rows = pd.concat(frames, ignore_index=True).sort_values("time_utc", kind="stable", ignore_index=True)
        out = schema.write_table(rows, folder / schema.BENCH_FILE, "bench")
        print(f"wrote {out}")
        keep = REPO / "lab" / "tuning" / folder.parent.name / folder.name
        keep.mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.move(path, keep / path.name)
            print(f"moved {path.name} to {keep}")


def main() -> None:
    write = "--write" in sys.argv
    root = Path(next((a for a in sys.argv[1:] if not a.startswith("--")), REPO / "data"))
    migrate_renamed(root, write)
    migrate_bench(root, write)


if __name__ == "__main__":
    main()
