#!/usr/bin/env python3
"""Lab count of 2026-12-07: each book page's code cells, hidden (remove-input, remove-cell: the reader never sees
the code), folded (hide-input, hide-cell: one click away) or visible, with their code lines, the functions defined
in a page, the imports of the project's modules outside `medddpm.report`, and uses of the `bd` alias.
    python lab/scripts/2026-12-07-page-cells.py [--rev REV] [BOOK_DIR]   (default: book/ of the working tree)
With --rev, the pages are read from that git revision (before/after counts from one script).
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

HIDDEN = {"remove-input", "remove-cell"}
FOLDED = {"hide-input", "hide-cell"}
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(?P<body>.*?)^```\s*$", re.M | re.S)
TAGS = re.compile(r"^:tags:\s*\[(?P<tags>[^\]]*)\]", re.M)


def past_report(code: str) -> int:
    """Imports of the project's modules outside `medddpm.report` (the package a page may read)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a cell of shell commands or magics
        return 0
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "medddpm":
            n += any(a.name != "report" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("medddpm."):
            n += not (node.module + ".").startswith("medddpm.report.")
        elif isinstance(node, ast.Import):
            n += any(a.name.startswith("medddpm") and not (a.name + ".").startswith("medddpm.report.")
                     for a in node.names)
    return n


def pages(rev: str | None, folder: str) -> dict[str, str]:
    if rev is None:
        return {p.name: p.read_text() for p in sorted(Path(folder).glob("*.md"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{folder}/"], check=True, capture_output=True,
                           text=True).stdout.split()
    return {Path(n).name: subprocess.run(["git", "show", f"{rev}:{n}"], check=True, capture_output=True,
                                         text=True).stdout for n in names if n.endswith(".md")}


def count(text: str) -> dict[str, int]:
    row = dict.fromkeys(["cells", "hidden", "folded", "visible", "hidden_lines", "folded_lines", "visible_lines",
                         "defs", "past_report", "bd_alias"], 0)
    for m in CELL.finditer(text):
        body = m["body"]
        tags = {t.strip() for t in (TAGS.search(body)["tags"].split(",") if TAGS.search(body) else [])}
        code = [ln for ln in body.split("\n") if ln.strip() and not ln.startswith(":")]
        kind = "hidden" if tags & HIDDEN else "folded" if tags & FOLDED else "visible"
        row["cells"] += 1
        row[kind] += 1
        row[f"{kind}_lines"] += len(code)
        row["defs"] += sum(1 for ln in code if re.match(r"\s*(def|class)\s", ln))
        row["past_report"] += past_report("\n".join(ln for ln in body.split("\n") if not ln.startswith(":")))
        row["bd_alias"] += len(re.findall(r"\bas bd\b|\bbd\.", body))
    return row


def main() -> None:
    args = sys.argv[1:]
    rev = None
    if args[:1] == ["--rev"]:
        rev, args = args[1], args[2:]
    folder = args[0] if args else "book"
    rows = {name: count(text) for name, text in pages(rev, folder).items()}
    rows = {k: v for k, v in rows.items() if v["cells"]}
    cols = ["cells", "hidden", "folded", "visible", "hidden_lines", "folded_lines", "visible_lines", "defs",
            "past_report", "bd_alias"]
    heads = ["cells", "hidden", "folded", "visible", "hid.lines", "fold.lines", "vis.lines", "defs", "past-rep",
             "bd"]
    print(f"{'page':<16}" + "".join(f"{c:>11}" for c in heads))
    for name, row in rows.items():
        print(f"{name:<16}" + "".join(f"{row[c]:>11}" for c in cols))
    total = {c: sum(r[c] for r in rows.values()) for c in cols}
    print(f"{'total':<16}" + "".join(f"{total[c]:>11}" for c in cols))


if __name__ == "__main__":
    main()
