"""What a label's sweep measured, its fastest configuration against the closest rows in the data tree, and where
the book is: the last lines of ``bash scripts/main.sh`` and ``python -m medddpm summary``.

The label is this machine's (`sweep.machine_label`) or the one `--gpu-label` names; its device type is the one
its rows recorded (`gpu_type`), so that a label measured elsewhere (a committed card, read on a CPU) is compared
as the card it is. Its fastest configuration is set beside the same configuration, at the same size, of:

1. the committed rows of its device type (``data/<type>/``), else another label of that type;
2. else the nearest other card in the data tree: the one whose roofs lie closest to its own, read from one kind
   of source for both (`analysis.roofs.pair_of`: measured against measured, else datasheet against datasheet),
   as the mean distance of their logarithms. A CPU is never set beside a GPU.

The lines say which of these it is.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pandas as pd

from medddpm.analysis import roofs as ar
from medddpm.measure.env import device_type, gpu_slug, host_name, pick_device
from medddpm.measure.sweep import _main_runs, machine_label
from medddpm.store.layout import ROOFS_FILE, hidden
from medddpm.store.schema import read_table


def _roofs(out: Path, labels: list[str]) -> pd.DataFrame:
    frames = [read_table(p) for label in labels if (p := out / label / ROOFS_FILE).is_file()]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def roof_distance(roofs: pd.DataFrame, a: tuple[str, str], b: tuple[str, str]) -> tuple[float, str]:
    """How far apart two cards (label, device type) lie: the mean |log| of their roofs' ratios over the roofs both
    have from one kind of source, and that source; infinite where they share none."""
    av, bv, used = ar.pair_of(roofs, a, b)
    logs = [abs(math.log(av[r] / bv[r])) for r in av if r in bv and av[r] > 0 and bv[r] > 0]
    return (sum(logs) / len(logs), used) if logs else (math.inf, used)


def references(out: Path, label: str, kind: str) -> list[tuple[str, str, str]]:
    """The labels of `out` to compare `label` (of device type `kind`) with, in the order they are tried, each as
    (label, its device type, why it is chosen): the committed rows of the type, other labels of the type, then
    the other cards nearest first (GPUs with GPUs, CPUs with CPUs)."""
    labels = sorted(p.name for p in out.iterdir() if p.is_dir() and not hidden(p.name) and p.name != label)
    types = {}
    for other in labels:
        rows = _main_runs(out / other)
        if rows:
            types[other] = str(rows[0]["gpu_type"])
    same = sorted((s for s, t in types.items() if t == kind), key=lambda s: (s != kind, s))
    out_list = [(s, kind, "the committed rows of its device type" if s == kind else
                 "rows of its device type measured on another machine") for s in same]
    roofs = _roofs(out, [label, *types])
    cpu = kind == "cpu"
    others = []
    for s, t in types.items():
        if t == kind or (t == "cpu") != cpu:
            continue
        far, used = roof_distance(roofs, (label, kind), (s, t))
        if math.isfinite(far):
            others.append((far, s, t, used))
    for far, s, t, used in sorted(others):
        out_list.append((s, t, f"the nearest other card in the data, by its {used} roofs"))
    return out_list


def _wrap(lines: list[str]) -> str:
    return "\n".join(line if line.startswith("  ") else
                     textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False) for line in lines)


def summary(out: str | os.PathLike = "data", *, device: str | None = None, gpu_label: str | None = None,
            book: str | os.PathLike | None = None) -> str:
    """What `gpu_label` (default: this machine's label) measured under `out`, its fastest configuration against
    the closest rows there (`references`), and where the book is."""
    dev = pick_device(device)
    out = Path(out)
    label = gpu_slug(gpu_label or machine_label(out, dev))
    folder = out / label
    mine = _main_runs(folder)
    here = host_name()
    if not mine:
        return _wrap([f"This machine: {device_type(dev)} on host {here}, labelled {label}.",
                      f"Nothing measured yet in {folder}/ (python -m medddpm sweep measures it)."])
    first = mine[0]
    kind, host = str(first["gpu_type"]), str(first.get("host", "") or "")
    ours = host == here and kind == device_type(dev)  # a host name alone can repeat (containers, VMs)
    who = "this machine takes" if ours else f"the {label} runs take"
    lines = [f"This machine: {kind} on host {here}, labelled {label}." if ours else
             f"The runs under {label}: {kind}, measured on {f'host {host}' if host else 'a host not recorded'}; "
             f"this machine is a {device_type(dev)} on host {here}."]
    ok = [r for r in mine if r["status"] == "ok" and not math.isnan(r["train_median_ms"])]
    lines.append(f"Measured {len(mine)} configuration(s) into {folder}/ ({first['preset']} preset, "
                 f"{first['shape']} voxels, {int(first['parameters']):,} parameters), {len(ok)} ok:")
    for r in mine:
        what = (f"{r['train_median_ms']:9.1f} ms a training micro-step (median of {int(r['timed_steps'])})"
                if r["status"] == "ok" else f"{r['status']}: {r['message']}")
        lines.append(f"  {r['config']:<12} {what}")
    if ok:
        best = min(ok, key=lambda r: r["train_median_ms"])
        lines.append(f"Fastest here: {best['config']}, {best['train_median_ms']:.1f} ms. " + _compare(
            out, label, kind, best, who))
    if book is not None:
        book = Path(book)
        lines.append(f"The book: {book.resolve()} ({label} beside the committed devices)" if book.is_file()
                     else f"The book is not built yet ({book}: bash scripts/book.sh builds it).")
    return _wrap(lines)


def _compare(out: Path, label: str, kind: str, best: pd.Series, who: str) -> str:
    """The fastest configuration beside the first reference that has it at the same preset and size."""
    tried = []
    for ref_label, ref_kind, why in references(out, label, kind):
        ref = {r["config"]: r for r in _main_runs(out / ref_label)}.get(best["config"])
        if ref is None or ref["status"] != "ok" or (ref["preset"], ref["shape"]) != (best["preset"], best["shape"]):
            tried.append(ref_label)
            continue
        ratio = best["train_median_ms"] / ref["train_median_ms"]
        skipped = (f" ({', '.join(tried)} {'has' if len(tried) == 1 else 'have'} no {best['config']} of this size)"
                   if tried else "")
        card = ref_label if ref_label == ref_kind else f"{ref_label} ({ref_kind})"
        return (f"Compared with {why}{skipped}: {card}, {out / ref_label / best['config']}/, "
                f"{ref['train_median_ms']:.1f} ms; {who} {ratio:.2f}x its time ({1 / ratio:.2f}x its speed).")
    if not tried:
        return (f"No other rows of {kind} in {out}/, and no other card there with roofs to tell the nearest: "
                "these are the first of their kind.")
    return (f"No rows of {best['config']} at this size ({best['preset']}, {best['shape']}) in {', '.join(tried)} to "
            "compare with.")
