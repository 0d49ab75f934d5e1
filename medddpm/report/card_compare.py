"""The cards page's measured comparison: every configuration measured on two cards, side by side (time and its
spread, energy, power, clocks, sampling, memory), why the ratio differs from one configuration to the next (the
share of the step in memory-bound kernels, and each kernel category's own ratio), and the facts of each card.

One card is the reference (`reference_card`: the one with the most configurations measured, the model's card A
where it has counters) and every other measured card is set against it, configuration by configuration, over the
configurations both ran. A ratio is the other card's median micro-step over the reference's; its spread runs from
the other card's 10th percentile over the reference's 90th to its 90th over the reference's 10th (`run.parquet`'s
p10 and p90 of the timed training steps, those of ``steps.parquet``): the widest ratio the two runs' middle 80%
allow.

A run's clocks are read from NVML while its steps were timed (`sm_clock_mhz`, `power_limit_w`,
`throttle_reasons`, `throttled_share`). A run held down by a power cap is slower than its card's best, and its
ratio says so beside it (`clock_state`, `clock_notes`); a card whose runs recorded no clocks is named too, since
nobody can tell whether its runs were capped.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from medddpm.analysis import roofs as ar
from medddpm.model.diffusion import TIMESTEPS
from medddpm.report.loading import Data, _GIB, config_order, gpu_types, is_cpu
from medddpm.report.roofs import pair_roofs

# Kernel categories (`analysis.kernels.CATEGORIES`) whose kernels run on the tensor cores or FMA pipes at a high
# arithmetic intensity: what the two cards' equal SMs and clocks set. Every other category but "other" moves data
# more than it computes (element-wise, normalization, reductions, layout conversions, copies, Adam, and Inductor's
# fusions of them): the memory-bound share of a step.
COMPUTE_CATEGORIES = ("convolution", "gemm", "attention")
MEMORY_CATEGORIES = ("elementwise", "normalization", "reduction", "layout", "fused", "memcpy", "optimizer")
SHARE_SHOWN = 0.01  # a category under this share of the reference's step is left out of the category ratios
NOT_RECORDED = "not recorded"


def gpu_runs(data: Data) -> pd.DataFrame:
    """The finished main runs of GPUs at batch 1: what cards are compared on."""
    ok = data.ok
    return ok[(ok["gpu_name"] != "cpu") & ~ok["gpu_slug"].map(is_cpu) & (ok["batch"] == 1)]


def reference_card(data: Data) -> str | None:
    """The card every other is set against: the one with counters (the model's card A) and, among those, the one
    with the most configurations measured; without counters, the one with the most configurations. None with
    fewer than two measured cards."""
    runs = gpu_runs(data)
    if runs["gpu_slug"].nunique() < 2:
        return None
    counted = set(runs.loc[runs["run_id"].isin(set(data.ncu["run_id"])), "gpu_slug"]) if len(data.ncu) else set()
    n = runs.groupby("gpu_slug")["config"].nunique()
    return sorted(n.index, key=lambda s: (s not in counted, -n[s], s))[0]


def memory_bound_share(kernels: pd.DataFrame) -> pd.Series:
    """Per run: the share of its profiled kernel time in `MEMORY_CATEGORIES`."""
    if kernels.empty:
        return pd.Series(dtype=float)
    t = kernels.groupby(["run_id", "category"])["total_us"].sum().unstack(fill_value=0.0)
    mem = t[[c for c in MEMORY_CATEGORIES if c in t.columns]].sum(axis=1)
    return mem / t.sum(axis=1)


def clock_state(r) -> str:
    """A run's clock state while timed, in words: held down (its reasons and share of samples), free, or not
    recorded (a run made before the sweep read NVML's clocks, or without NVML)."""
    if pd.isna(r["sm_clock_mhz"]) and pd.isna(r["throttled_share"]):
        return NOT_RECORDED
    if r["throttle_reasons"]:
        return f"held down ({r['throttle_reasons'].replace('_', ' ')}) in {r['throttled_share']:.0%} of samples"
    return "free"


def comparison(data: Data) -> pd.DataFrame:
    """A row per configuration and measured card, over the configurations the reference card and that card
    both ran: the median micro-step and its p10-p90, the ratio to the reference with its spread (module
    docstring), energy per step, mean power, SM clock, power limit and clock state, one full sample's time (250
    denoising steps), peak memory, and the share of the step in memory-bound kernels."""
    cols = ["config", "gpu_slug", "reference", "train_median_ms", "train_p10_ms", "train_p90_ms", "ratio", "ratio_lo",
            "ratio_hi", "energy_per_step_j", "mean_power_w", "sm_clock_mhz", "power_limit_w", "clock_state",
            "throttled", "sample_s", "peak_gib", "memory_share"]
    ref = reference_card(data)
    if ref is None:
        return pd.DataFrame(columns=cols)
    runs = gpu_runs(data).copy()
    runs["memory_share"] = runs["run_id"].map(memory_bound_share(data.kernels))
    runs["clock_state"] = [clock_state(r) for _, r in runs.iterrows()]
    runs["throttled"] = runs["throttle_reasons"].fillna("") != ""
    runs["sample_s"] = runs["sample_step_median_ms"] * TIMESTEPS / 1e3
    runs["peak_gib"] = runs["peak_mem_bytes"].where(runs["peak_mem_bytes"] >= 0) / _GIB
    a = runs[runs["gpu_slug"] == ref].set_index("config")
    parts = []
    for slug, g in runs[runs["gpu_slug"] != ref].groupby("gpu_slug"):
        both = [c for c in config_order(g["config"]) if c in set(g["config"]) and c in a.index]
        if not both:
            continue
        b = g.set_index("config").loc[both]
        ratio = b["train_median_ms"] / a.loc[both, "train_median_ms"]
        lo = b["train_p10_ms"] / a.loc[both, "train_p90_ms"]
        hi = b["train_p90_ms"] / a.loc[both, "train_p10_ms"]
        parts.append(a.loc[both].assign(ratio=1.0, ratio_lo=np.nan, ratio_hi=np.nan).reset_index())
        parts.append(b.assign(ratio=ratio, ratio_lo=lo, ratio_hi=hi).reset_index())
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True).drop_duplicates(["config", "gpu_slug"]).assign(reference=ref)
    rank = {c: i for i, c in enumerate(config_order(out["config"]))}
    out = out.assign(_c=out["config"].map(rank), _r=out["gpu_slug"] != ref).sort_values(["_c", "_r", "gpu_slug"])
    return out[cols].reset_index(drop=True)


def check_comparison(comp: pd.DataFrame) -> None:
    """Every time positive, each ratio inside its spread, each share a share."""
    if comp.empty:
        return
    assert (comp["train_median_ms"] > 0).all(), comp
    other = comp[comp["gpu_slug"] != comp["reference"]]
    assert ((other["ratio_lo"] <= other["ratio"] + 1e-12) & (other["ratio"] <= other["ratio_hi"] + 1e-12)).all(), other
    assert comp["memory_share"].dropna().between(0, 1).all(), comp


# The comparison in two tables that fit the page's column: time and memory, then energy, power and clocks.
TIME_COLUMNS = {"config": "configuration", "gpu_slug": "card", "train_median_ms": "median ms",
                "ratio_text": "× the reference (spread)", "sample_s": "one sample (s)", "peak_gib": "peak GiB"}
POWER_COLUMNS = {"config": "configuration", "gpu_slug": "card", "energy_per_step_j": "J a micro-step",
                 "mean_power_w": "mean W", "clock_text": "SM clock", "limit_text": "power limit",
                 "clock_state": "clocks while timed"}
COMPARISON_FORMATS = {"median ms": "{:.4g}", "J a micro-step": "{:.3g}", "mean W": "{:.0f}", "one sample (s)": "{:.3g}",
                      "peak GiB": "{:.2f}"}


def comparison_table(comp: pd.DataFrame, columns: dict[str, str] = TIME_COLUMNS) -> pd.DataFrame:
    """`comparison` as the page shows it, in `columns` (`TIME_COLUMNS` or `POWER_COLUMNS`): the ratio with its
    spread in one cell ("1.148x (1.147-1.150)", the reference's own row "1"), the SM clock and the power limit
    as NVML reported them, or "not recorded"."""
    ratio = ["1 (the reference)" if s == ref else f"{r:.3f}x ({lo:.3f}-{hi:.3f})"
             for s, ref, r, lo, hi in zip(comp["gpu_slug"], comp["reference"], comp["ratio"], comp["ratio_lo"],
                                          comp["ratio_hi"])]
    clock = [NOT_RECORDED if pd.isna(c) else f"{c:,.0f} MHz" for c in comp["sm_clock_mhz"]]
    limit = [NOT_RECORDED if pd.isna(w) else f"{w:,.0f} W" for w in comp["power_limit_w"]]
    shown = comp.assign(ratio_text=ratio, clock_text=clock, limit_text=limit)
    return shown[list(columns)].rename(columns=columns)


def ratio_text(comp: pd.DataFrame, names: dict[str, str] | None = None) -> str:
    """Each card against the reference, over the configurations both ran: the range of the ratio, and the
    configuration at each end."""
    names = names or {}
    lines = []
    for slug, g in comp[comp["gpu_slug"] != comp["reference"]].groupby("gpu_slug", sort=False):
        ref = names.get(g["reference"].iloc[0], g["reference"].iloc[0])
        lo, hi = g.loc[g["ratio"].idxmin()], g.loc[g["ratio"].idxmax()]
        lines.append(f"- **{names.get(slug, slug)}** takes {lo['ratio']:.2f}x (`{lo['config']}`) to {hi['ratio']:.2f}x "
                     f"(`{hi['config']}`) the time of the **{ref}**, over the {len(g)} configurations both ran.")
    return "\n".join(lines)


def clock_notes(data: Data, names: dict[str, str] | None = None) -> list[str]:
    """What a reader must know of the clocks before comparing two cards: each GPU run held down while it was
    timed (its reason and share of samples, its mean power against its limit, its SM clock against the card's
    other runs', and how much faster its step could be at that clock), and each card whose runs recorded no
    clocks at all."""
    names = names or {}
    runs = gpu_runs(data)
    notes = []
    for slug, g in runs.groupby("gpu_slug"):
        name = names.get(slug, slug)
        if g["sm_clock_mhz"].isna().all() and g["throttled_share"].isna().all():
            notes.append(f"The **{name}**'s runs recorded no clocks, power limit or slowdown reasons: whether any of "
                         "them ran held down is not known, and their mean power ran from "
                         f"{g['mean_power_w'].min():.0f} to {g['mean_power_w'].max():.0f} W.")
            continue
        free = g.loc[g["throttle_reasons"].fillna("") == "", "sm_clock_mhz"].median()
        for r in g[g["throttle_reasons"].fillna("") != ""].itertuples():
            line = (f"`{r.config}` on the **{name}** ran held down ({r.throttle_reasons.replace('_', ' ')}) in "
                    f"{r.throttled_share:.0%} of its samples: {r.mean_power_w:.0f} W mean against its "
                    f"{r.power_limit_w:.0f} W limit")
            if pd.notna(r.sm_clock_mhz) and pd.notna(free) and r.sm_clock_mhz < free:
                line += (f", its SM clock {r.sm_clock_mhz:,.0f} MHz against {free:,.0f} MHz in the card's other runs. "
                         f"Its {r.train_median_ms:.4g} ms is the capped card's: were the whole step to scale with the "
                         f"SM clock it would take {r.train_median_ms * r.sm_clock_mhz / free:.4g} ms free, and any "
                         "ratio to it is the capped card's too")
            notes.append(line + ".")
    return notes


def why(comp: pd.DataFrame) -> pd.DataFrame:
    """A row per configuration and non-reference card: the ratio with its spread beside the share of the
    reference's step in memory-bound kernels (and the card's own share)."""
    ref = comp[comp["gpu_slug"] == comp["reference"]].set_index("config")["memory_share"]
    other = comp[comp["gpu_slug"] != comp["reference"]]
    return other.assign(reference_share=other["config"].map(ref))[
        ["config", "gpu_slug", "reference", "ratio", "ratio_lo", "ratio_hi", "reference_share", "memory_share"]
    ].reset_index(drop=True)


def why_text(w: pd.DataFrame, cat: pd.DataFrame, data: Data, names: dict[str, str] | None = None) -> str:
    """The ratio against the memory-bound share in words: the configurations at the two ends and the correlation;
    the ratio a step wholly at the bandwidth roof would take (the two cards' bandwidths, `bandwidth_ratio`); the
    kernel categories that follow the compute (about 1) and the bandwidth; and the memory-bound category that
    moves least, where it weighs most."""
    names = names or {}
    lines = []
    for slug, g in w.groupby("gpu_slug", sort=False):
        ref = g["reference"].iloc[0]
        card, refname = names.get(slug, slug), names.get(ref, ref)
        lo, hi = g.loc[g["reference_share"].idxmin()], g.loc[g["reference_share"].idxmax()]
        line = (f"On the **{refname}**, `{lo['config']}` spends {lo['reference_share']:.0%} of its kernel time in "
                f"memory-bound kernels and takes {lo['ratio']:.2f}x as long on the **{card}**; `{hi['config']}` "
                f"spends {hi['reference_share']:.0%} there and takes {hi['ratio']:.2f}x.")
        if len(g) > 2 and g["reference_share"].notna().all():
            line += (f" Over the {len(g)} configurations, ratio and share correlate at "
                     f"r = {np.corrcoef(g['reference_share'], g['ratio'])[0, 1]:.2f}.")
        bw = bandwidth_ratio(data, slug, ref)
        if bw:
            line += (f" A step wholly at the bandwidth roof would take {bw[0]:.2f}x as long (the two cards' "
                     f"{bw[1]} bandwidths).")
        c = cat[cat["gpu_slug"] == slug]
        comp, mem = c[c["kind"] == "compute"], c[c["kind"] == "memory"]
        if len(comp) and len(mem):
            conv = comp.iloc[0]
            line += (f" Kernel by kernel category (the table below), the {conv['category']}s take {conv['lo']:.2f}x "
                     f"to {conv['hi']:.2f}x, and the memory-bound categories {mem['lo'].min():.2f}x to "
                     f"{mem['hi'].max():.2f}x.")
            least = mem.loc[mem["pooled"].idxmin()]
            k = data.kernels[(data.kernels["gpu_slug"] == ref) & data.kernels["run_id"].isin(
                set(gpu_runs(data)["run_id"]))]
            shares = k[k["category"] == least["category"]].groupby("config")["share"].sum()
            if len(shares):
                top = shares.idxmax()
                line += (f" Not every memory-bound kernel follows the bandwidth: {least['category']} takes only "
                         f"{least['pooled']:.2f}x, and it is "
                         f"{shares.max():.0%} of `{top}`'s step, which therefore slows less than its memory-bound "
                         "share says.")
        lines.append(line)
    return "\n\n".join(lines)


def category_range(data: Data) -> pd.DataFrame:
    """Per non-reference card and kernel category: the card's time over the reference's in each configuration
    both profiled where the category holds at least `SHARE_SHOWN` of the reference's kernel time, as a range
    (lowest and highest, with their configurations) and over those configurations' time together."""
    cols = ["gpu_slug", "reference", "category", "kind", "configs", "lo", "lo_config", "hi", "hi_config", "pooled",
            "share_lo", "share_hi"]
    ref = reference_card(data)
    if ref is None or data.kernels.empty:
        return pd.DataFrame(columns=cols)
    runs = gpu_runs(data)
    k = data.kernels[data.kernels["run_id"].isin(set(runs["run_id"]))]
    t = (k["total_us"] / k["micro_steps"].clip(lower=1)).groupby([k["gpu_slug"], k["config"], k["category"]]).sum()
    total = t.groupby(level=[0, 1]).transform("sum")
    rows = []
    for slug in sorted(set(runs["gpu_slug"]) - {ref}):
        if slug not in t.index.get_level_values(0) or ref not in t.index.get_level_values(0):
            continue
        a, b = t.xs(ref, level=0), t.xs(slug, level=0)
        share = (t / total).xs(ref, level=0)
        both = a.index.intersection(b.index)
        both = [i for i in both if share[i] >= SHARE_SHOWN]
        for cat in dict.fromkeys(i[1] for i in both):
            idx = [i for i in both if i[1] == cat]
            r = (b[idx] / a[idx]).droplevel(1)
            kind = ("compute" if cat in COMPUTE_CATEGORIES else "memory" if cat in MEMORY_CATEGORIES else "other")
            s = share[idx].droplevel(1)
            rows.append({"gpu_slug": slug, "reference": ref, "category": cat, "kind": kind, "configs": len(r),
                         "lo": r.min(), "lo_config": r.idxmin(), "hi": r.max(), "hi_config": r.idxmax(),
                         "pooled": b[idx].sum() / a[idx].sum(), "share_lo": s.min(), "share_hi": s.max()})
    out = pd.DataFrame(rows, columns=cols)
    order = {c: i for i, c in enumerate(COMPUTE_CATEGORIES + MEMORY_CATEGORIES)}
    return out.assign(_o=out["category"].map(order).fillna(99)).sort_values(["gpu_slug", "_o"]).drop(
        columns="_o").reset_index(drop=True)


CATEGORY_COLUMNS = {"category": "kernel category", "kind": "bound", "configs": "configurations",
                    "range": "ratio, lowest-highest", "pooled": "ratio of the summed time",
                    "share": "share of the reference's step"}


def category_table(cat: pd.DataFrame) -> pd.DataFrame:
    """`category_range` as the page shows it: the range with the configurations at its ends."""
    shown = cat.assign(
        range=[f"{lo:.2f}x ({lc}) - {hi:.2f}x ({hc})" if lc != hc else f"{lo:.2f}x ({lc})"
               for lo, lc, hi, hc in zip(cat["lo"], cat["lo_config"], cat["hi"], cat["hi_config"])],
        share=[f"{a:.0%}-{b:.0%}" if round(a, 2) != round(b, 2) else f"{a:.0%}"
               for a, b in zip(cat["share_lo"], cat["share_hi"])])
    return shown[list(CATEGORY_COLUMNS)].rename(columns=CATEGORY_COLUMNS)


def bandwidth_ratio(data: Data, slug: str, ref: str) -> tuple[float, str] | None:
    """The reference's DRAM bandwidth over the card's, on the book's basis (`roofs.pair_roofs`), and which source:
    what a step wholly at the bandwidth roof would take longer."""
    a, b, used = pair_roofs(data, ref, slug)
    return (a["dram"] / b["dram"], used) if "dram" in a and "dram" in b else None


def card_facts(data: Data, roofs_view: pd.DataFrame) -> pd.DataFrame:
    """A row per fact and a column per measured GPU: SMs and the tensor clock from its datasheet, the SM and
    memory clocks its runs recorded while timed, the memory its driver reports, its DRAM bandwidth measured and
    on its datasheet, its power limit, and the software its runs used. Nothing typed in: the runs, the measured
    roofs (`roofs.roofs_view`) and `analysis.roofs.DATASHEET`."""
    runs = gpu_runs(data)
    types = gpu_types(data.run, data.roofs)
    out = {}
    for slug, g in runs.groupby("gpu_slug"):
        sheet = ar.DATASHEET.get(types.get(slug, slug))
        view = roofs_view[(roofs_view["gpu_slug"] == slug) & (roofs_view["roof"] == "dram")] if len(
            roofs_view) else roofs_view
        measured = view.dropna(subset=["measured"])  # its own measurement, whichever source the book reads
        clocks = g["sm_clock_mhz"].dropna()
        free = g.loc[g["throttle_reasons"].fillna("") == "", "sm_clock_mhz"].dropna()
        sm_clock = NOT_RECORDED if clocks.empty else (
            f"{free.median():,.0f} MHz" + (f" ({clocks.min():,.0f} in a capped run)" if clocks.min() < free.median()
                                           else ""))
        mem_clock = g["mem_clock_mhz"].dropna()
        limit = g["power_limit_w"].dropna()
        cudnn = int(g["cudnn"].mode().iloc[0]) if g["cudnn"].notna().any() else None
        out[slug] = {
            "device name (driver)": g["gpu_name"].mode().iloc[0],
            "SMs (datasheet)": f"{sheet.sms}" if sheet and sheet.sms else "-",
            "tensor boost clock (datasheet)": f"{sheet.tensor_clock_mhz:,.0f} MHz" if sheet and sheet.tensor_clock_mhz
            else "-",
            "SM clock while timed (median)": sm_clock,
            "memory clock while timed": NOT_RECORDED if mem_clock.empty else f"{mem_clock.median():,.0f} MHz",
            "memory its driver reports": f"{g['gpu_total_bytes'].max() / _GIB:.1f} GiB",
            "DRAM bandwidth, measured": ("not measured yet" if measured.empty else
                                         f"{measured['measured'].iloc[0] / 1e12:.2f} TB/s (device copy)"),
            "DRAM bandwidth, datasheet": f"{sheet.roofs['dram'] / 1e12:.2f} TB/s" if sheet else "-",
            "power limit (enforced)": NOT_RECORDED if limit.empty else f"{limit.max():,.0f} W",
            "software": (f"driver {g['driver'].mode().iloc[0]}, CUDA {g['cuda'].mode().iloc[0]}, "
                         + (f"cuDNN {cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}, " if cudnn else "")
                         + f"torch {g['torch'].mode().iloc[0]}"),
        }
    if not out:
        return pd.DataFrame()
    return pd.DataFrame(out).rename_axis("").reset_index()


__all__ = ["COMPARISON_FORMATS", "COMPUTE_CATEGORIES", "MEMORY_CATEGORIES", "NOT_RECORDED", "POWER_COLUMNS",
           "TIME_COLUMNS", "bandwidth_ratio", "card_facts", "category_range", "category_table", "check_comparison",
           "clock_notes", "clock_state", "comparison", "comparison_table", "gpu_runs", "memory_bound_share",
           "ratio_text", "reference_card", "why", "why_text"]
