"""One-off rewrite of the stored producer notebooks without their progress bars (2026-12-05); run again on
2026-12-06 when the book's filter also took out the profiler's "USDT:" notes and narrowed the padding of the
transposed run row that older notebooks printed (31 KB of spaces in one output; the appendix was 1.2 MB).

Every ``produce.ipynb`` under DATA_DIR (``<gpu>/<run>/`` and ``<gpu>/ablation/<run>/``) kept tqdm's text bars
as the kernel streamed them: one stderr message per redraw, some 3,300 in all, which the appendix drew as
as many grey boxes (1.9 MB of page). Each cell's outputs go through the book's own filter
(`book/_ext/medddpm_book.py`'s `strip_progress`: a cell's consecutive messages of one stream joined, the bars
and tqdm's "IProgress not found" warning taken out, streams left empty dropped); every other output, the
cells and the metadata stay as they are. A notebook without bars is left untouched, so running it twice
changes nothing.

Usage: python lab/scripts/strip-progress.py [--write] [DATA_DIR]   (without --write: what it would do)
"""

import importlib.util
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("medddpm_book", REPO / "book" / "_ext" / "medddpm_book.py")
book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(book)


def strip(path: Path) -> tuple[str, str]:
    """The notebook's text as stored and without progress bars (nbformat's own layout)."""
    before = path.read_text(encoding="utf-8")
    nb = nbformat.reads(before, as_version=nbformat.NO_CONVERT)
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            cell.outputs = [nbformat.from_dict(o) for o in book.strip_progress(cell.get("outputs", []))]
    return before, nbformat.writes(nb)


def main(argv: list[str]) -> int:
    write = "--write" in argv
    args = [a for a in argv if a != "--write"]
    root = Path(args[0]) if args else REPO / "data"
    paths = sorted(set(root.glob("*/*/produce.ipynb")) | set(root.glob("*/*/*/produce.ipynb")))
    total_before = total_after = changed = 0
    for path in paths:
        before, after = strip(path)
        total_before, total_after = total_before + len(before.encode()), total_after + len(after.encode())
        if after == before:
            continue
        changed += 1
        print(f"{path.relative_to(root)}: {len(before.encode()):,} -> {len(after.encode()):,} bytes")
        if write:
            path.write_text(after, encoding="utf-8")
    print(f"{changed} of {len(paths)} notebooks {'rewritten' if write else 'to rewrite (--write)'}: "
          f"{total_before:,} -> {total_after:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
