"""The cards page's model: a roofline model that predicts a configuration's step on card B from card A's profile,
the card-to-card time of each kernel category beside what the two cards' roofs predict for its arithmetic
intensity, and each configuration's step on every card, measured or estimated (the measured comparison is
`report.card_compare`).

**The model** (`predictions`, kernel by kernel in `predict_kernels`). Card A's profile is its step's kernels
(torch.profiler: each kernel's time a step) with their Nsight Compute counters (`kernel_rates`: DRAM bytes and
FLOPs, CUDA-core and tensor-core, per second of the kernel). On card A each kernel is nearest one of its roofs: its
DRAM traffic is a share `u_mem` of A's bandwidth, its FLOPs a share `u_comp` of A's rate in the kernel's precision,
and the larger share is its bound. The prediction (`PREDICTION`, the `roof_part` reading) moves the share of the
kernel's time its roof accounts for by the ratio of the two cards' roofs (bandwidth A/B for a memory-bound kernel,
compute rate A/B in its precision for a compute-bound one) and keeps the rest, latency, launches and low occupancy,
which the same SMs at the same clocks do not change. The `whole` reading moves each kernel's whole time, an upper
bound of the change that overshoots wherever kernels run far below their roofs. A kernel without counters takes
the time-weighted factor of its category's kernels that have them, in its run or else in the card's other runs.
The step scales as its kernel time: B's step = A's step x (B's kernel time / A's).

The two cards' roofs are those the whole book reads them against (`roofs.pair_roofs`, on the book's basis): measured
against measured once every card of the data has measured its own, datasheet against datasheet until then, so that
a card's roofs here are the ones its efficiency is read against on every other page. A card nobody measured
(`ESTIMATE_CARDS`: an A100, a B200) has only its datasheet, so that its estimate reads both cards against their
datasheets; every such row says "estimate" and cites it.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from medddpm.analysis import roofs as ar
from medddpm.analysis.kernels import short_name
from medddpm.analysis.ncu_names import match_kernel
from medddpm.report.card_compare import gpu_runs
from medddpm.report.counters import kernel_flops, ncu_kernels
from medddpm.report.loading import Data, _sort, config_order, gpu_types
from medddpm.report.roofs import ROOF_LABELS, pair_roofs
from medddpm.report.tables import card_names

TARGET = 0.10  # a prediction within 10% of the measured step
ESTIMATE_CARDS = ar.ESTIMATE_CARDS
MEASURED, ESTIMATE = "measured", "estimate"
MODELS = {"whole": "each kernel's whole time moves with its nearest roof",
          "roof_part": "only the time at its nearest roof moves; the rest stays"}
# The model's prediction is its roof-part reading. A kernel at a share u of its roof spends that share of its time
# moving bytes (or FLOPs) at the roof's rate: that time scales with the roof. The rest is latency, launches and
# too few blocks in flight, set by the SMs and their clocks, which an H100 and an H200 share (132 SMs, the same
# clocks): it stays. The whole reading moves a kernel at a tenth of its roof as if it were at it, and overshoots
# wherever kernels run far below their roofs (GroupNorm's statistics, small element-wise kernels). Between cards
# of other SMs or clocks the rest would move too, so the estimates of such cards give both readings.
PREDICTION, ALTERNATIVE = "roof_part", "whole"


def card_name(slug: str, kind: str | None = None) -> str:
    card = ar.DATASHEET.get(kind or slug)
    return card.name if card else slug


def kernel_rates(data: Data, run_id: str) -> pd.DataFrame:
    """A run's step kernel by kernel (torch.profiler, passes added up): `ms` a step, `category`, and where Nsight
    Compute profiled it (the ncu kernels that stand for it, `analysis.ncu_names.match_kernel`, taken together):
    `flops_per_s`, `bytes_per_s` (DRAM) and `precision`, the math its time was mostly in (fp32 on the CUDA
    cores, or a tensor precision)."""
    cols = ["kernel", "category", "ms", "covered", "flops_per_s", "bytes_per_s", "precision"]
    k = data.kernels[data.kernels["run_id"] == run_id]
    if k.empty:
        return pd.DataFrame(columns=cols)
    k = k.assign(ms=k["total_us"] / k["micro_steps"].clip(lower=1) / 1e3)
    per = k.groupby("kernel", as_index=False).agg(category=("category", "first"), ms=("ms", "sum"))
    ncu = data.ncu[data.ncu["run_id"] == run_id] if not data.ncu.empty else data.ncu
    summary = ncu_kernels(ncu) if not ncu.empty else pd.DataFrame()
    if summary.empty or "flop_fp32" not in summary:
        return per.assign(covered=False, flops_per_s=np.nan, bytes_per_s=np.nan, precision="")[cols]
    f = kernel_flops(summary, data.run, data.roofs)
    f = f[f["duration_ns"] > 0].assign(precision=f["tensor_precision"].where(f["tensor_precision"].notna(), "fp32"))
    names = per["kernel"].tolist()
    sums = f.groupby("kernel")[["duration_ns", "flops", "dram_bytes"]].sum()
    by_precision = f.groupby(["kernel", "precision"])["duration_ns"].sum()
    main = by_precision.loc[by_precision.groupby(level=0).idxmax()].reset_index(level=1)["precision"]
    rows = []
    for name, ns, flops, bytes_ in sums.itertuples():
        for p in match_kernel(name, names):
            rows.append({"kernel": p, "ns": ns, "flops": flops, "bytes": bytes_, "precision": main[name],
                         "precision_ns": ns})
    if not rows:
        return per.assign(covered=False, flops_per_s=np.nan, bytes_per_s=np.nan, precision="")[cols]
    m = pd.DataFrame(rows)
    top = m.sort_values("precision_ns", ascending=False).drop_duplicates("kernel").set_index("kernel")["precision"]
    m = m.groupby("kernel")[["ns", "flops", "bytes"]].sum()
    m["flops_per_s"], m["bytes_per_s"] = m["flops"] / (m["ns"] / 1e9), m["bytes"] / (m["ns"] / 1e9)
    out = per.join(m[["flops_per_s", "bytes_per_s"]], on="kernel").join(top, on="kernel")
    out["covered"] = out["bytes_per_s"].notna() & (out["bytes_per_s"] > 0)
    out["precision"] = out["precision"].fillna("")
    return out[cols]


def _factors(k: pd.DataFrame, a: dict, b: dict) -> pd.DataFrame:
    """Per kernel with counters: its bound on card A and its time factor on card B in both readings (`MODELS`)."""
    k = k.copy()
    peak_a = k["precision"].map(lambda p: a.get(p, math.nan))
    peak_b = k["precision"].map(lambda p: b.get(p, math.nan))
    k["u_mem"] = k["bytes_per_s"] / a["dram"]
    k["u_comp"] = k["flops_per_s"] / peak_a
    k["bound"] = np.where(k["u_mem"] >= k["u_comp"].fillna(0), "memory", "compute")
    mem, comp = a["dram"] / b["dram"], peak_a / peak_b
    k["roof_factor"] = np.where(k["bound"] == "memory", mem, comp)
    k["u_roof"] = np.where(k["bound"] == "memory", k["u_mem"], k["u_comp"]).clip(0, 1)
    at_roof_b = np.maximum(k["u_mem"] * mem, (k["u_comp"] * comp).fillna(0))
    # the roof's share of A's time moves to B's roofs, the rest (latency, launches, occupancy) stays
    scale = k["u_roof"] / np.maximum(k["u_mem"], k["u_comp"].fillna(0)).replace(0, np.nan)
    k["factor_whole"] = k["roof_factor"]
    k["factor_roof_part"] = (1 - k["u_roof"]) + at_roof_b * scale.fillna(0)
    return k


def _by_category(cov: pd.DataFrame, model: str) -> pd.Series:
    """The time-weighted factor of each category's kernels with counters."""
    col = f"factor_{model}"
    return (cov["ms"] * cov[col]).groupby(cov["category"]).sum() / cov.groupby("category")["ms"].sum()


def predict_kernels(k: pd.DataFrame, a: dict, b: dict, pooled: dict[str, pd.Series] | None = None) -> pd.DataFrame:
    """`kernel_rates` of a run on card A with each kernel's predicted time on card B (`ms_whole`, `ms_roof_part`).
    A kernel without counters takes the time-weighted factor of its category's kernels with counters: in its run,
    else in the reference card's other runs (`pooled`, per model), else in its run as a whole."""
    cov = _factors(k[k["covered"]], a, b) if k["covered"].any() else pd.DataFrame(columns=[*k.columns, "bound"])
    out = k.join(cov[[c for c in cov.columns if c not in k.columns]], how="left")
    for model in MODELS:
        col = f"factor_{model}"
        if cov.empty:
            out[col], out[f"ms_{model}"] = np.nan, np.nan
            continue
        overall = (cov["ms"] * cov[col]).sum() / cov["ms"].sum()
        fill = out["category"].map(_by_category(cov, model))
        if pooled is not None:
            fill = fill.fillna(out["category"].map(pooled[model]))
        out[col] = out[col].fillna(fill).fillna(overall)
        out[f"ms_{model}"] = out["ms"] * out[col]
    return out


def _pairs(data: Data) -> list[tuple[str, str, str]]:
    """(reference card, other card, measured or estimate): every measured GPU with counters against every other
    measured GPU, and against each `ESTIMATE_CARDS` type no label of the data measured."""
    runs = gpu_runs(data)
    profiled = runs[runs["run_id"].isin(set(data.ncu["run_id"]))] if not data.ncu.empty else runs.iloc[0:0]
    counted = sorted(set(profiled["gpu_slug"]))
    cards = sorted(set(runs["gpu_slug"]))
    types = set(gpu_types(data.run, data.roofs).values())
    pairs = [(a, b, MEASURED) for a in counted for b in cards if b != a]
    pairs += [(a, t, ESTIMATE) for a in counted for t in ESTIMATE_CARDS if t not in types]
    return pairs


def predictions(data: Data) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every (reference card, other card, configuration) the model can reach: the step predicted on the other card
    in both readings, beside the measured one where the other card has a run, with the error; and the kernel
    table behind each prediction (`predict_kernels` plus the pair). Cards in `ESTIMATE_CARDS` that nobody
    measured are estimates from their datasheet."""
    cols = ["from_card", "card", "kind", "config", "from_ms", "predicted_ms", "predicted_whole_ms", "measured_ms",
            "error", "error_whole", "covered", "roofs", "source"]
    runs = gpu_runs(data)
    rows, kernels, rates = [], [], {}
    for a, b, kind in _pairs(data):
        av, bv, used = pair_roofs(data, a, b)
        if "dram" not in av:
            continue
        source = (f"{ar.DATASHEET[b].source}" if kind == ESTIMATE else
                  f"{used} roofs of both cards")
        theirs = runs[runs["gpu_slug"] == b].set_index("config")["train_median_ms"]
        mine = list(runs[runs["gpu_slug"] == a].itertuples())
        for r in mine:
            if r.run_id not in rates:  # a reference run serves every other card
                rates[r.run_id] = kernel_rates(data, r.run_id)
        covered = [_factors(k[k["covered"]], av, bv) for r in mine if (k := rates[r.run_id])["covered"].any()]
        if not covered:
            continue
        pooled = {m: _by_category(pd.concat(covered, ignore_index=True), m) for m in MODELS}
        for r in mine:
            k = rates[r.run_id]
            if k.empty or not k["covered"].any():
                continue
            p = predict_kernels(k, av, bv, pooled)
            if p["ms_whole"].isna().any():
                continue
            total = p["ms"].sum()
            pred = {m: r.train_median_ms * p[f"ms_{m}"].sum() / total for m in MODELS}
            measured = float(theirs.get(r.config, math.nan))
            rows.append({"from_card": a, "card": b, "kind": kind, "config": r.config, "from_ms": r.train_median_ms,
                         "predicted_ms": pred[PREDICTION], "predicted_whole_ms": pred[ALTERNATIVE],
                         "measured_ms": measured, "error": pred[PREDICTION] / measured - 1,
                         "error_whole": pred[ALTERNATIVE] / measured - 1,
                         "covered": p.loc[p["covered"], "ms"].sum() / total, "roofs": used, "source": source})
            kernels.append(p.assign(from_card=a, card=b, kind=kind, config=r.config))
    table = pd.DataFrame(rows, columns=cols)
    if len(table):
        table = _sort(table.rename(columns={"from_card": "gpu_slug"}), "card").rename(columns={"gpu_slug": "from_card"})
    return table, (pd.concat(kernels, ignore_index=True) if kernels else pd.DataFrame())


def step_times(data: Data, predicted: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each configuration's median step on every card: measured (with its p10-p90 spread) and estimated for the
    cards nobody measured (`predictions`: the prediction, with the two readings as its spread), a row each,
    labelled by the cards' short names (`tables.card_names`) for a chart where the cards stand side by side."""
    cols = ["card", "gpu_slug", "config", "kind", "train_median_ms", "train_p10_ms", "train_p90_ms", "source"]
    runs = gpu_runs(data)
    names = card_names(data.run)
    m = runs.assign(card=runs["gpu_slug"].map(lambda s: names.get(s, s)), kind=MEASURED, source="sweep")
    parts = [m[cols]]
    if predicted is not None and len(predicted):
        e = predicted[predicted["kind"] == ESTIMATE]
        # one reference card per estimated card: the one whose counters cover the most of its steps
        best = e.groupby(["card", "from_card"])["covered"].mean().reset_index().sort_values(
            "covered", ascending=False, kind="stable").drop_duplicates("card")
        e = e.merge(best[["card", "from_card"]], on=["card", "from_card"])
        parts.append(pd.DataFrame({
            "card": [f"{card_name(c).removeprefix('NVIDIA ')}, estimate from {names.get(f, f)}"
                     for c, f in zip(e["card"], e["from_card"])],
            "gpu_slug": e["card"], "config": e["config"], "kind": ESTIMATE, "train_median_ms": e["predicted_ms"],
            "train_p10_ms": np.minimum(e["predicted_ms"], e["predicted_whole_ms"]),
            "train_p90_ms": np.maximum(e["predicted_ms"], e["predicted_whole_ms"]), "source": e["source"]}))
    out = pd.concat(parts, ignore_index=True)
    return _sort(out, "kind", "card") if len(out) else pd.DataFrame(columns=cols)


def category_ratios(data: Data, kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (reference card, other card, configuration, kernel category): the other card's time over the
    reference's, measured (both cards' kernel tables) where both ran it, as the model predicts it, and as the two
    cards' roofs predict it for the category's arithmetic intensity (its kernels' FLOPs over their DRAM bytes,
    in the precision most of its time ran in): the ratio of the attainable FLOP/s, A's over B's."""
    cols = ["from_card", "card", "kind", "pair", "config", "category", "ms", "measured_ratio", "model_ratio",
            "roofs_ratio", "intensity", "bound_a"]
    if kernels.empty:
        return pd.DataFrame(columns=cols)
    runs = gpu_runs(data)
    rows = []
    for (a, b, kind, config), k in kernels.groupby(["from_card", "card", "kind", "config"], sort=False):
        av, bv, _ = pair_roofs(data, a, b)
        other = runs[(runs["gpu_slug"] == b) & (runs["config"] == config)]
        theirs = pd.Series(dtype=float)
        if len(other):
            kb = data.kernels[data.kernels["run_id"] == other["run_id"].iloc[0]]
            theirs = (kb["total_us"] / kb["micro_steps"].clip(lower=1) / 1e3).groupby(kb["category"]).sum()
        for cat, g in k.groupby("category"):
            cov = g[g["covered"]]
            flops = (cov["flops_per_s"] * cov["ms"]).sum()
            bytes_ = (cov["bytes_per_s"] * cov["ms"]).sum()
            intensity = flops / bytes_ if bytes_ > 0 else math.nan
            precision = cov.groupby("precision")["ms"].sum().idxmax() if len(cov) else "fp32"
            roofs_ratio, bound = math.nan, ""
            if math.isfinite(intensity) and precision in av and precision in bv:
                at_a = ar.attainable(intensity, av["dram"], av[precision])
                roofs_ratio = at_a / ar.attainable(intensity, bv["dram"], bv[precision])
                bound = "memory" if intensity * av["dram"] < av[precision] else "compute"
            rows.append({"from_card": a, "card": b, "kind": kind, "pair": f"{a} → {b}", "config": config,
                         "category": cat, "ms": g["ms"].sum(),
                         "measured_ratio": theirs.get(cat, math.nan) / g["ms"].sum() if len(theirs) else math.nan,
                         "model_ratio": g[f"ms_{PREDICTION}"].sum() / g["ms"].sum(), "roofs_ratio": roofs_ratio,
                         "intensity": intensity, "bound_a": bound})
    return pd.DataFrame(rows, columns=cols)


def misses(kernels: pd.DataFrame, data: Data, table: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """For each measured prediction outside `TARGET`: the kernels whose predicted time on the other card is
    furthest from their measured time there (the same kernel name in both kernel tables), largest first, with
    their bound on the reference card, how close to that roof they ran, and both time factors."""
    cols = ["from_card", "card", "config", "kernel", "category", "bound", "u_roof", "ms", "measured_factor",
            "predicted_factor", "error_ms"]
    off = held_against_measured(table)
    off = off[off["error"].abs() > TARGET] if len(off) else off
    runs = gpu_runs(data)
    parts = []
    for r in off.itertuples():
        k = kernels[(kernels["from_card"] == r.from_card) & (kernels["card"] == r.card)
                    & (kernels["config"] == r.config)]
        other = runs[(runs["gpu_slug"] == r.card) & (runs["config"] == r.config)]
        kb = data.kernels[data.kernels["run_id"] == other["run_id"].iloc[0]]
        theirs = (kb["total_us"] / kb["micro_steps"].clip(lower=1) / 1e3).groupby(kb["kernel"]).sum()
        k = k.assign(measured_ms=k["kernel"].map(theirs)).dropna(subset=["measured_ms"])
        k = k.assign(measured_factor=k["measured_ms"] / k["ms"], predicted_factor=k[f"factor_{PREDICTION}"],
                     error_ms=k[f"ms_{PREDICTION}"] - k["measured_ms"], from_card=r.from_card, card=r.card,
                     config=r.config)
        parts.append(k.reindex(k["error_ms"].abs().sort_values(ascending=False).index).head(n))
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True)
    out["bound"] = out["bound"].fillna("no counters")
    return out[cols]


def why(row: pd.Series) -> str:
    """One line on a kernel the model gets wrong, from what the counters say of it."""
    if row["bound"] == "no counters":
        return "no counters: it took its category's factor"
    roof = "DRAM" if row["bound"] == "memory" else "compute"
    said = (f"{row['bound']}-bound at {row['u_roof']:.0%} of card A's {roof} roof; the model moves it "
            f"x{row['predicted_factor']:.2f}, it moved x{row['measured_factor']:.2f}")
    if row["bound"] == "memory" and row["u_roof"] < 0.5 and abs(row["measured_factor"] - 1) < abs(
            row["predicted_factor"] - 1):
        said += ": far below the bandwidth roof, its time is latency and occupancy, which the bandwidth does not move"
    return said


def check_predictions(table: pd.DataFrame) -> None:
    """Predictions are positive and the share of the step with counters is a share."""
    if table.empty:
        return
    assert (table["predicted_ms"] > 0).all() and (table["predicted_whole_ms"] > 0).all(), table
    assert table["covered"].between(0, 1 + 1e-9).all(), table


# ------------------------------------------------------------------------------------------ the page

PREDICTION_COLUMNS = {"from_card": "A", "card": "B", "config": "configuration", "from_ms": "A, measured ms",
                      "predicted_ms": "B, predicted ms", "measured_ms": "B, measured ms", "error": "error",
                      "predicted_whole_ms": "B, whole reading ms", "error_whole": "its error",
                      "covered": "A's step with counters"}
PREDICTION_FORMATS = {"error": "{:+.1%}", "its error": "{:+.1%}", "A's step with counters": "{:.0%}"}
PENDING_COLUMNS = {"from_card": "A", "card": "B", "config": "configuration", "from_ms": "A, measured ms",
                   "predicted_ms": "B, predicted ms", "predicted_whole_ms": "B, whole reading ms",
                   "covered": "A's step with counters"}


def _shown(table: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """`table` in the page's column names; the cards' columns only where it holds more than one pair of cards
    (one pair is named in the text above the table, and two columns repeating it would crowd the page)."""
    if table[["from_card", "card"]].drop_duplicates().shape[0] <= 1:
        columns = {k: v for k, v in columns.items() if k not in ("from_card", "card")}
    return table[list(columns)].rename(columns=columns)


def roofs_wide(view: pd.DataFrame) -> pd.DataFrame:
    """`roofs.roofs_view` as a roof per row and a card per column: the value the book reads with its unit and its
    source, and the card's own measurement beside it where the book reads its datasheet ("3.35 TB/s (datasheet;
    measured 2.9)"), so that a reader sees how far a card falls below its datasheet."""
    def cell(v, u, s, m):
        said = f"{v / 1e12:.3g} {'TB/s' if u == 'byte/s' else 'TFLOP/s'} ({s}"
        return said + (f"; measured {m / 1e12:.3g})" if s != ar.MEASURED and pd.notna(m) else ")")

    shown = view.assign(shown=[cell(*r) for r in zip(view["value"], view["unit"], view["source"], view["measured"])])
    wide = shown.pivot(index="what", columns="gpu_slug", values="shown").reindex(
        [ROOF_LABELS[r] for r in ("dram", "fp32", "tf32", "bf16", "fp16")]).dropna(how="all").reset_index()
    return wide.rename(columns={"what": "roof"})


def measured_cards(steps: pd.DataFrame) -> list[str]:
    """The cards of `step_times` that were measured (not estimated), sorted."""
    return sorted(set(steps.loc[steps["kind"] == MEASURED, "gpu_slug"])) if len(steps) else []


def one_card_text(steps: pd.DataFrame) -> str:
    """With one measured card: that every other bar is an estimate, and how a second card's sweep adds its own;
    "" with two or more (`card_compare.ratio_text` sets them against each other)."""
    gpus = measured_cards(steps)
    if len(gpus) >= 2:
        return ""
    return (f"Only {', '.join(f'**{g}**' for g in gpus) or 'no GPU'} is measured in these data, so every other bar "
            "is an estimate. A second card's sweep (`python -m medddpm sweep --preset paper` on it) adds its bars, "
            "its measured ratios below and the model's errors, with no page edited.")


def held_against_measured(predicted: pd.DataFrame) -> pd.DataFrame:
    """The predictions a measured step can judge: of a measured card, for a configuration it ran. A configuration
    the card has not run is a prediction still to be held against its measurement (`pending`), never a miss."""
    if predicted.empty:
        return predicted
    return predicted[(predicted["kind"] == MEASURED) & predicted["measured_ms"].notna()]


def pending(predicted: pd.DataFrame) -> pd.DataFrame:
    """The predictions of a measured card for the configurations it has not run yet: they stand until its sweep
    measures them, and are then judged with the others."""
    if predicted.empty:
        return predicted
    return predicted[(predicted["kind"] == MEASURED) & predicted["measured_ms"].isna()]


def prediction_table(measured: pd.DataFrame) -> pd.DataFrame:
    """`held_against_measured` with the page's column names (`PREDICTION_COLUMNS`, `_shown`)."""
    return _shown(measured, PREDICTION_COLUMNS)


def pending_table(waiting: pd.DataFrame) -> pd.DataFrame:
    """`pending` with the page's column names (`PENDING_COLUMNS`, `_shown`)."""
    return _shown(waiting, PENDING_COLUMNS)


def pending_text(waiting: pd.DataFrame, names: dict[str, str] | None = None) -> str:
    """Whose predictions `pending` holds: for which card, from which card's profile, how many configurations."""
    names = names or {}
    return " ".join(f"From the **{names.get(a, a)}**'s profile, for the **{names.get(b, b)}**, which has not run "
                    f"these {len(g)} configurations yet:" for (a, b), g in waiting.groupby(["from_card", "card"]))


def score(measured: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Per reading: how many of the judged predictions lie within `TARGET` of the measured step, of how many."""
    n = len(measured)
    return {PREDICTION: (int((measured["error"].abs() <= TARGET).sum()), n),
            ALTERNATIVE: (int((measured["error_whole"].abs() <= TARGET).sum()), n)}


def prediction_text(measured: pd.DataFrame, names: dict[str, str] | None = None) -> str:
    """The score of the prediction over the configurations measured on both cards, its errors' range, and the
    whole reading's score beside it."""
    names = names or {}
    (hit, n), (whole, _) = score(measured).values()
    pairs = ", ".join(f"{names.get(a, a)} → {names.get(b, b)}" for a, b in
                      dict.fromkeys(zip(measured["from_card"], measured["card"])))
    return (f"**{hit} of {n}** predictions lie within {TARGET:.0%} of the measured step ({pairs}: every "
            f"configuration measured on both cards), with errors from {measured['error'].min():+.1%} to "
            f"{measured['error'].max():+.1%}. The whole reading, which moves every kernel's whole time, gets "
            f"{whole} of {n} (errors {measured['error_whole'].min():+.1%} to {measured['error_whole'].max():+.1%}): "
            "it overshoots, as a kernel far below its roof does not slow down by the roofs' ratio.")


def misses_table(kernels: pd.DataFrame, data: Data, measured: pd.DataFrame) -> pd.DataFrame:
    """`misses` of the judged predictions with a line each on why (`why`), the kernels by their short names
    (`analysis.kernels.short_name`), in the page's column names."""
    miss = misses(kernels, data, measured) if len(measured) else pd.DataFrame()
    if miss.empty:
        return miss
    shown = miss.assign(why=miss.apply(why, axis=1), kernel=miss["kernel"].map(short_name))
    return shown[["from_card", "card", "config", "kernel", "category", "ms", "error_ms", "why"]].rename(
        columns={"from_card": "A", "card": "B", "config": "configuration", "ms": "ms on A",
                 "error_ms": "predicted - measured on B (ms)"})


def estimates_table(predicted: pd.DataFrame, names: dict[str, str] | None = None) -> tuple[pd.DataFrame, str]:
    """The estimates of cards nobody measured: a configuration per row and, per (reference card, estimated card),
    the two readings in ms (their SMs and clocks differ from the reference's, so that the rest of a kernel's time
    need not stay: the step lies between them, or past them where the SMs differ most); and the sources of the
    estimated cards' datasheets, in words."""
    names = names or {}
    est = predicted[predicted["kind"] == ESTIMATE] if len(predicted) else predicted
    if est.empty:
        return pd.DataFrame(), ""
    t = est.assign(card_name=est["card"].map(card_name))
    parts = {}
    for (src, name), g in t.groupby(["from_card", "card_name"], sort=False):
        g = g.set_index("config")
        head = f"{name.removeprefix('NVIDIA ')} from {names.get(src, src)}"
        parts[f"{head}: roof part (ms)"] = g["predicted_ms"]
        parts[f"{head}: whole (ms)"] = g["predicted_whole_ms"]
    wide = pd.DataFrame(parts)
    wide = wide.reindex([c for c in config_order(wide.index) if c in wide.index]).rename_axis("config").reset_index()
    sources = t.drop_duplicates("card")[["card_name", "source"]]
    said = "Sources: " + "; ".join(f"{r.card_name}: {r.source}" for r in sources.itertuples()) + "."
    return wide.rename(columns={"config": "configuration"}), said


__all__ = ["ALTERNATIVE", "ESTIMATE", "MEASURED", "MODELS", "PENDING_COLUMNS", "PREDICTION", "PREDICTION_COLUMNS",
           "PREDICTION_FORMATS", "TARGET", "card_name", "category_ratios", "check_predictions", "estimates_table",
           "held_against_measured", "kernel_rates", "measured_cards", "misses", "misses_table", "one_card_text",
           "pending", "pending_table", "pending_text", "predict_kernels", "prediction_table", "prediction_text",
           "predictions", "roofs_wide", "score", "step_times", "why"]
