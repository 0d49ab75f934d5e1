"""Summarise allocator snapshots already committed (memory-*.pickle[.gz] under lab/ and tests/fixtures/) into the
table `snapshot` beside each, as `bench --memory-snapshot` now does when it writes one: `python -m medddpm peak`
then reads the summary and unpickles nothing. The pickles are read as plain data (`snapshot.load`); each peak is
printed from the pickle and from the summary read back, which must agree.

    .venv/bin/python lab/scripts/summarise-snapshots.py [FILE ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from medddpm.measure.memory import snapshot

ROOT = Path(__file__).resolve().parents[2]


def main(paths: list[str]) -> int:
    files = [Path(p) for p in paths] or sorted([*ROOT.glob("lab/**/memory-*.pickle*"),
                                                  *ROOT.glob("tests/fixtures/**/memory-*.pickle*")])
    for path in files:
        snap = snapshot.load(path)
        before = snapshot.peak(snap)
        written = snapshot.write_summary(snap, path)
        back = snapshot.read_summary(written)
        same = (int(back["peak_bytes"].iloc[0]) == before.bytes and int(back["bytes"].sum()) == before.bytes
                and back[["origin", "bytes"]].values.tolist() == before.by_origin()[["origin", "bytes"]].values.tolist())
        print(f"{path.relative_to(ROOT) if path.is_absolute() else path}: peak {before.bytes} B at event {before.event} "
              f"of {before.events}, {len(back)} origins -> {written.name}: peak {int(back['peak_bytes'].iloc[0])} B, "
              f"{'same' if same else 'DIFFERENT'}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
