"""What a CUDA allocator snapshot (`python -m medddpm bench --memory-snapshot`) holds at its peak.

`torch.cuda.memory._dump_snapshot` writes the allocator's segments as they are at the end, and the trace of
its events since the history was switched on (one training step here). `peak` replays the trace as
`torch.cuda.max_memory_allocated` counts: an allocation adds its block's size, a free request takes it
away. A block freed in the trace but never allocated in it, or allocated at the end and absent from it, was
already held when the step began: the weights, their gradients, Adam's state and the batch.

Each block is named by the innermost frame of this package that allocated it (Inductor keeps the model's
source lines in a compiled graph's frames). The frames hold a function's name and line only, so the bench adds
`SOURCES` to the file: for each of this package's lines in it, the function's qualified name and the statement,
as they were when it ran, e.g. ``ResBlock.forward (model.py:382)``. https://pytorch.org/memory_viz draws the
same file.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import os
import pickle
import re
from pathlib import Path
from typing import Callable

import pandas as pd
from medddpm import PACKAGE
from medddpm.store.layout import parse_snapshot_name, snapshot_summary
from medddpm.store.storage import atomic_write

HELD = "held before the step"  # the origin of blocks allocated before the history began
NO_FRAME = "inside torch"  # the origin of blocks allocated with no frame of this package
PACKAGE_FRAME = re.compile(r"[/\\]medddpm[/\\]((?:\w+[/\\])?\w+\.py)$")
SOURCES = "medddpm_sources"  # the key the bench adds: {"model.py:382": {"qualname": ..., "code": ...}}
COLUMNS = ["address", "bytes", "origin", "code", "callers", "phase", "alloc_event", "free_event"]


@dataclasses.dataclass(frozen=True)
class Peak:
    """The largest allocated total of a snapshot's trace, and the blocks live then (`COLUMNS`, largest first;
    `free_event` is NaN for a block still live at the end)."""

    bytes: int
    event: int  # index in the trace of the event that reached it
    events: int  # events in the trace
    held_bytes: int  # allocated before the trace began
    phase: str  # the annotated phase (forward, backward, optimizer) the peak fell in, or ""
    live: pd.DataFrame

    def by_origin(self) -> pd.DataFrame:
        """Live bytes at the peak by origin: origin, code, blocks, bytes, largest (one block's bytes)."""
        g = self.live.groupby("origin", sort=False)
        out = pd.DataFrame({"code": g["code"].first(), "blocks": g.size(), "bytes": g["bytes"].sum(),
                            "largest": g["bytes"].max()}).reset_index()
        return out.sort_values(["bytes", "origin"], ascending=[False, True], ignore_index=True)


class _PlainData(pickle.Unpickler):
    """An unpickler of plain data only. An allocator snapshot is dicts, lists, strings, numbers, booleans and
    None, which pickle builds without naming a class or a function; a pickle that names one (the way a
    crafted file calls `os.system`) is refused before anything is called ('Restricting Globals' in the
    documentation of `pickle`)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a memory snapshot names no class or function")


def load(path: str | os.PathLike) -> dict:
    """A snapshot pickle, gzipped or not, read as plain data (`_PlainData`); a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no memory snapshot at {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            snap = _PlainData(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, TypeError,
            AttributeError, MemoryError) as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"{path}: not a memory snapshot pickle, refused ({reason[:200]})") from None
    if not isinstance(snap, dict) or not {"segments", "device_traces"} <= set(snap):
        raise ValueError(f"{path}: not a memory snapshot (no 'segments' and 'device_traces'; "
                         "written by torch.cuda.memory._dump_snapshot?)")
    return snap


def _ours(frames: list[dict]) -> list[tuple[str, dict]]:
    """This package's frames, innermost first, each with its 'file.py:line' key."""
    out = []
    for f in frames:
        m = PACKAGE_FRAME.search(f.get("filename", ""))
        if m:
            out.append((f"{m.group(1)}:{f['line']}", f))
    return out


def origin(frames: list[dict], sources: dict | None = None) -> tuple[str, str, str]:
    """(the innermost frame of this package as 'function (file:line)', its statement, the package's callers
    outward as 'f < g < h'); a function is given its qualified name where `sources` (`SOURCES`) knows it.
    ('', '', '') for a block allocated by torch alone."""
    ours = _ours(frames)
    if not ours:
        return "", "", ""
    sources = sources or {}

    def name(key, f):
        return sources.get(key, {}).get("qualname") or f["name"]

    key, f = ours[0]
    return (f"{name(key, f)} ({key})", sources.get(key, {}).get("code", ""),
            " < ".join(name(k, g) for k, g in ours[1:5]))


def sources(snap: dict, read: Callable[[str], str | None]) -> dict:
    """`SOURCES` for a snapshot: each of this package's lines its frames name, with the enclosing function's
    qualified name and the statement; `read(file_name)` gives a module's text (None: unknown)."""
    keys = {k for t in snap["device_traces"] for e in t for k, _ in _ours(e.get("frames") or [])}
    out, parsed = {}, {}
    for key in sorted(keys):
        file, line = key.rsplit(":", 1)
        if file not in parsed:
            text = read(file)
            parsed[file] = (text.splitlines(), _functions(ast.parse(text))) if text is not None else None
        if parsed[file] is None:
            continue
        lines, functions = parsed[file]
        line = int(line)
        inner = [(q, a, b) for q, a, b in functions if a <= line <= b]
        out[key] = {"qualname": max(inner, key=lambda f: f[1])[0] if inner else "",
                    "code": lines[line - 1].strip() if 0 < line <= len(lines) else ""}
    return out


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int, int]]:
    """(qualified name, first line, last line) of every function and method in a module."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                out.append((name, node.lineno, node.end_lineno))
            out += _functions(node, name + ".")
    return out


def package_source(file: str) -> str | None:
    """This package's module `file` as it is now (what `sources` reads when the bench writes a snapshot)."""
    path = PACKAGE / file
    return path.read_text() if path.is_file() else None


def _phases(snap: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of the annotated phases (`_record_memory_history` marks forward, backward, optimizer)."""
    starts, out = {}, []
    for a in snap.get("external_annotations") or []:
        if a.get("stage") == "START":
            starts[a["name"]] = a["time_us"]
        elif a.get("stage") == "END" and a.get("name") in starts:
            out.append((starts.pop(a["name"]), a["time_us"], a["name"]))
    return out


def _phase_at(phases, time_us) -> str:
    return next((name for start, end, name in phases if time_us is not None and start <= time_us <= end), "")


def peak(snap: dict, *, device: int | None = None) -> Peak:
    """Replay the trace of one device (the only one that has events, unless `device` says which)."""
    traces = snap["device_traces"]
    if device is None:
        busy = [i for i, t in enumerate(traces) if t]
        if len(busy) != 1:
            raise ValueError(f"the snapshot has events on {len(busy)} devices; say which (device=)")
        device = busy[0]
    trace = traces[device]
    phases, known = _phases(snap), snap.get(SOURCES)
    first = {}  # address -> the first event that names it
    for e in trace:
        first.setdefault(e["addr"], e["action"])
    live = {}  # address -> row
    for seg in snap["segments"]:
        if seg.get("device", device) != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in first:
                live[b["address"]] = _row(b["address"], b["size"], HELD, "", "", "", -1)
    for e in trace:  # freed before it was allocated: held from the start
        if first[e["addr"]] == "free_requested" and e["action"] == "free_requested" and e["addr"] not in live:
            live[e["addr"]] = _row(e["addr"], e["size"], HELD, "", "", "", -1)
    held = sum(r["bytes"] for r in live.values())
    total, best, best_event, at_best = held, held, -1, dict(live)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            name, code, callers = origin(e.get("frames") or [], known)
            live[e["addr"]] = _row(e["addr"], e["size"], name or NO_FRAME, code, callers,
                                   _phase_at(phases, e.get("time_us")), i)
            total += e["size"]
            if total > best:
                best, best_event, at_best = total, i, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["bytes"]
    freed = {}  # the free request that ended each block live at the peak
    for i, e in enumerate(trace[best_event + 1:], start=best_event + 1):
        if e["action"] == "free_requested" and e["addr"] in at_best and e["addr"] not in freed:
            freed[e["addr"]] = i
    df = pd.DataFrame(list(at_best.values()), columns=COLUMNS[:-1])
    df["free_event"] = df["address"].map(freed).astype(float)
    df = df.sort_values(["bytes", "alloc_event"], ascending=[False, True], ignore_index=True)
    at = trace[best_event].get("time_us") if best_event >= 0 else None
    return Peak(bytes=int(best), event=best_event, events=len(trace), held_bytes=int(held),
                phase=_phase_at(phases, at), live=df)


def _row(address, size, name, code, callers, phase, event) -> dict:
    return {"address": address, "bytes": int(size), "origin": name, "code": code, "callers": callers,
            "phase": phase, "alloc_event": event}


def summary(p: Peak, name: str) -> pd.DataFrame:
    """Table `snapshot` (`medddpm.store.schema`) of a peak: its live bytes by origin, the peak's figures repeated."""
    try:
        config, commit = parse_snapshot_name(name)
    except ValueError:  # a file renamed by hand
        config, commit = name, ""
    rows = p.by_origin()
    return rows.assign(snapshot=name, config=config, commit=commit, peak_bytes=p.bytes, peak_event=p.event,
                       events=p.events, held_bytes=p.held_bytes, peak_phase=p.phase)


def write_summary(snap: dict, path: str | os.PathLike) -> Path:
    """Summarise the snapshot that lies (or will lie) at `path` into its summary beside it (`layout.snapshot_summary`)."""
    from medddpm.store.schema import TABLES, write_table

    table = summary(peak(snap), Path(path).name)
    return write_table(table[list(TABLES["snapshot"])], snapshot_summary(path), "snapshot")


def read_summary(path: str | os.PathLike) -> pd.DataFrame:
    from medddpm.store.schema import read_table

    return read_table(path, "snapshot")


def describe(path: str | os.PathLike, *, top: int = 12, trust_pickle: bool = False) -> str:
    """A few lines for a terminal: the peak, then its live bytes by origin. From a summary (.parquet, or the one
    beside a snapshot); a snapshot's pickle itself only with `trust_pickle` (read as plain data all the same)."""
    path = Path(path)
    if path.suffix == ".parquet":
        table = read_summary(path)
        name = table["snapshot"].iloc[0] if len(table) else path.name
    elif trust_pickle:
        table, name = summary(peak(load(path)), path.name), path.name
    elif snapshot_summary(path).is_file():
        table, name = read_summary(snapshot_summary(path)), path.name
    elif not path.is_file():
        raise FileNotFoundError(f"no memory snapshot at {path}")
    else:
        raise ValueError(f"{path}: a pickle, and no summary beside it ({snapshot_summary(path).name}); --trust-pickle "
                         "reads the pickle itself (as plain data only)")
    first = table.iloc[0] if len(table) else None
    if first is None:
        raise ValueError(f"{path}: an empty summary")
    gib = 2 ** 30
    lines = [f"{name}: peak {first.peak_bytes / gib:.3f} GiB allocated at event {first.peak_event} of {first.events}"
             f"{f' ({first.peak_phase})' if first.peak_phase else ''}; {first.held_bytes / gib:.3f} GiB {HELD}"]
    for r in table.head(top).itertuples():
        lines.append(f"  {r.bytes / gib:7.3f} GiB  {r.blocks:4d} blocks (largest {r.largest / gib:.3f})  {r.origin}"
                     + (f"  {r.code}" if r.code else ""))
    return "\n".join(lines)


def memory_snapshot(step: Callable[[], object], *, device: torch.device, path: str | Path) -> None:
    """One more step with the CUDA caching allocator's history on, saved as a pickle that
    https://pytorch.org/memory_viz reads (`torch.cuda.memory._dump_snapshot`): which tensors are live at
    the peak, with the Python frames that allocated them, and summarised beside it (table `snapshot`,
    `write_summary`). After the timing. A step replayed from a CUDA graph allocates nothing: take it from a
    configuration with `cuda_graphs=false`."""
    import torch

    if device.type != "cuda":
        raise ValueError(f"a memory snapshot needs a CUDA device, not {device}")
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()  # what _dump_snapshot pickles
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # the frames name functions and lines only: keep what they were at this commit (`sources`, read by `peak`)
    snap[SOURCES] = sources(snap, package_source)
    atomic_write(path, lambda f: pickle.dump(snap, f))
    write_summary(snap, path)  # what `peak` and readers use, without unpickling
