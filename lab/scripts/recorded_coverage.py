"""Recompute the counter coverage each run records (run.parquet's profilers -> ncu -> profiled_coverage) with
today's kernel matcher, print what changed, and with --write store the new figures (the old one is kept beside
it as `profiled_coverage_recorded`). Usage: python lab/scripts/recorded_coverage.py [--write] [DATA_DIR]"""

import json
import sys
from pathlib import Path

from medddpm.measure.profile import ncu

from medddpm.store import schema

write = "--write" in sys.argv
root = Path(next((a for a in sys.argv[1:] if not a.startswith("--")), "data"))
for run_file in sorted(root.glob("**/run.parquet")):
    d = run_file.parent
    if not (d / "ncu.parquet").is_file() or not (d / "kernels.parquet").is_file():
        continue
    row = schema.read_table(run_file, "run")
    prof = json.loads(row.loc[0, "profilers"] or "{}")
    entry = prof.get("ncu", {})
    old = entry.get("profiled_coverage")
    now = ncu.profiled_coverage(schema.read_table(d / "kernels.parquet", "kernels"), schema.read_table(d / "ncu.parquet", "ncu"))
    same = old is not None and abs(old - now) < 5e-5
    print(f"{str(d):55s} recorded {'-' if old is None else f'{old:.2%}':>7s}  now {now:.2%}{'' if same else '  CHANGED'}")
    if write and not same and old is not None:
        entry |= {"profiled_coverage": now, **({"profiled_coverage_recorded": old} if old is not None else {})}
        row.loc[0, "profilers"] = json.dumps(prof | {"ncu": entry})
        schema.write_table(row, run_file, "run")
