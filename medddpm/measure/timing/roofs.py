"""A device's roofs, measured on it: the DRAM bandwidth and the dense matmul rate in each precision it runs.

- **Bandwidth**: a device-to-device copy of a buffer far larger than the last-level cache (1 GiB on a GPU, 64 MiB
  on a CPU), counted as the bytes read plus the bytes written over its time.
- **Matmul**: an n x n by n x n product of random normal values (never zeros: a tensor core's power, and so its
  clock, depends on the data) in strict FP32 (TF32 off), TF32, bf16 and fp16; 2 n^3 FLOP over its time. The
  math-mode flags are set for the measurement and restored after it, whatever happens.

Each roof warms up, then times its repeats one by one (CUDA events on a GPU, the host clock on a CPU) and keeps
the median with the 10th and 90th percentiles; NVML's SM and memory clocks are sampled meanwhile. On a CPU the
sizes are small, so that all of it takes seconds, and a precision the CPU does not run is left out.

The sweep measures a label's roofs once, before its first configuration, when ``data/<label>/roofs.parquet``
does not exist (`ensure`); ``python -m medddpm roofs`` measures them again. Every figure that uses a peak reads
this table (`medddpm.analysis.roofs.card_roofs`), so a new card gets its roofs with no code edited.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from medddpm.analysis.roofs import COMPUTE, UNITS
from medddpm.measure.timing.clocks import ClockMonitor
from medddpm.measure.env import device_name, device_type, environment, host_name, pick_device
from medddpm.store import schema
from medddpm.store.layout import ROOFS_FILE
from medddpm.store.lock import FolderInUse, output_lock


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    n: dict[str, int]  # matmul side per precision
    warmup: int
    repeats: int


# A GPU: a copy 20x its L2 and matmuls long enough (milliseconds) that launch costs vanish. A CPU: seconds in all.
GPU_SIZES = Sizes(copy_bytes=2**30, n={"fp32": 8192, "tf32": 16384, "bf16": 16384, "fp16": 16384}, warmup=5,
                  repeats=30)
CPU_SIZES = Sizes(copy_bytes=2**26, n={"fp32": 768, "bf16": 384, "fp16": 256}, warmup=1, repeats=5)
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def path(out: str | Path, label: str) -> Path:
    return Path(out) / label / ROOFS_FILE


def _times_ms(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """`fn` run `warmup` times untimed, then `repeats` times, each timed alone (ms)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in pairs]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


@contextlib.contextmanager
def _fp32_math(mode: str):
    """cuBLAS's FP32 math mode for the block ("ieee": strict FP32, "tf32"), restored after it."""
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = mode
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def _row(roof: str, per_s: list[float], size: int, method: str, clocks: dict) -> dict:
    p10, p90 = np.percentile(per_s, [10, 90])
    return {"roof": roof, "unit": UNITS[roof], "value": float(statistics.median(per_s)), "p10": float(p10),
            "p90": float(p90), "repeats": len(per_s), "size": int(size), "method": method,
            "sm_clock_mhz": float(clocks.get("sm_clock_mhz", math.nan)),
            "mem_clock_mhz": float(clocks.get("mem_clock_mhz", math.nan))}


def _timed(fn, device, sizes: Sizes) -> tuple[list[float], dict]:
    monitor = ClockMonitor(device)
    monitor.start()
    try:
        ms = _times_ms(fn, device, sizes.warmup, sizes.repeats)
    finally:
        monitor.stop()
    return ms, monitor.summary()


def bandwidth(device: torch.device, sizes: Sizes) -> dict:
    n = sizes.copy_bytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms, clocks = _timed(lambda: dst.copy_(src), device, sizes)
    moved = 2 * n * 4  # read once, written once
    what = "device-to-device" if device.type == "cuda" else "host memory"
    return _row("dram", [moved / (t / 1e3) for t in ms], n * 4, f"{what} copy of {n * 4 / 2**30:.3g} GiB, bytes "
                f"read + written over the time ({'CUDA events' if device.type == 'cuda' else 'host clock'})", clocks)


def matmul(device: torch.device, precision: str, sizes: Sizes) -> dict | None:
    """The dense rate of one precision, or None where the device does not run it (TF32 off a GPU, a dtype a
    CPU's matmul lacks)."""
    cuda = device.type == "cuda"
    if precision == "tf32" and not cuda:
        return None
    n = sizes.n[precision]
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=DTYPES[precision], generator=gen)
    b = torch.randn(n, n, device=device, dtype=DTYPES[precision], generator=gen)
    mode = {"fp32": "ieee", "tf32": "tf32"}.get(precision)
    with _fp32_math(mode) if cuda and mode else contextlib.nullcontext():
        try:
            ms, clocks = _timed(lambda: a @ b, device, sizes)
        except (RuntimeError, NotImplementedError):  # e.g. fp16 matmul on an older CPU build
            return None
    math_mode = {"fp32": ", strict FP32 (TF32 off)", "tf32": ", TF32 on"}.get(precision, "")
    return _row(precision, [2 * n**3 / (t / 1e3) for t in ms], n,
                f"{n} x {n} by {n} x {n} matmul of random normal {precision} values{math_mode}, 2 n^3 FLOP over the "
                f"time ({'CUDA events' if cuda else 'host clock'})", clocks)


def measure(device: str | torch.device | None = None, *, label: str | None = None,
            sizes: Sizes | None = None) -> pd.DataFrame:
    """Every roof of `device` as the ``roofs`` table (a row per roof), labelled `label` (default: its type)."""
    device = pick_device(device) if not isinstance(device, torch.device) else device
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    env = environment(device)
    start = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rows = [bandwidth(device, sizes)]
    rows += [r for p in COMPUTE if (r := matmul(device, p, sizes)) is not None]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the buffers above are gigabytes: leave the device as the sweep found it
    kind = device_type(device)
    df = pd.DataFrame(rows).assign(
        gpu_slug=label or kind, gpu_name=device_name(device), gpu_type=kind, host=host_name(),
        driver=env["driver"], cuda=env["cuda"], torch=env["torch"], git_commit=env["git_commit"], start_time=start)
    return df[list(schema.TABLES["roofs"])]


def write(df: pd.DataFrame, out: str | Path) -> Path:
    (label,) = df["gpu_slug"].unique()
    return schema.write_table(df, path(out, label), "roofs")


def ensure(out: str | Path, label: str, device: str | torch.device | None = None) -> Path | None:
    """Measure and write the roofs of `label` where ``out/<label>/roofs.parquet`` does not exist yet; None where it
    does, or where another process holds its lock (it is measuring them now)."""
    target = path(out, label)
    if target.is_file():
        return None
    try:
        with output_lock(target, what="roofs"):
            if target.is_file():
                return None
            # a progress line, as the sweep's own "[i/n] config: ..." lines
            print(f"[roofs] {label}: measuring the bandwidth and matmul rates once, into {target}", file=sys.stderr,
                  flush=True)
            return write(measure(device, label=label), out)
    except FolderInUse as e:
        print(f"[roofs] {label}: not measured here ({e})", file=sys.stderr)
        return None


def describe(df: pd.DataFrame) -> str:
    """The roofs as lines for a terminal, each beside its datasheet value where the device type has one."""
    from medddpm.analysis.roofs import DATASHEET

    lines = []
    for r in df.itertuples():
        scale, prefix = (1e12, "T") if r.value >= 1e12 else (1e9, "G")
        unit = f"{prefix}B/s" if r.roof == "dram" else f"{prefix}FLOP/s"
        line = (f"{r.gpu_slug:<24}{r.roof:<6}{r.value / scale:9.3f} {unit:<8}(p10-p90 {r.p10 / scale:.3f}-"
                f"{r.p90 / scale:.3f}, {r.repeats} repeats)")
        sheet = DATASHEET.get(r.gpu_type)
        if sheet is not None and r.roof in sheet.roofs:
            line += f"  {r.value / sheet.roofs[r.roof]:.0%} of the datasheet's {sheet.roofs[r.roof] / scale:.4g} {unit}"
        lines.append(line)
    return "\n".join(lines)
