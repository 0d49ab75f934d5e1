"""The roofs every page reads, and the one efficiency figure of each card's step.

A card's roofs are its DRAM bandwidth and dense matmul rates: measured on it where its own label has a
``roofs.parquet`` (`medddpm.measure.timing.roofs`), else its datasheet's. Another machine's measurement never
stands in for a card's own, even one of the same device type.

The book sets its cards side by side, so it reads all of them against one source per roof (`book_basis`): their
measured roofs once every card with a datasheet has measured its own, their datasheets until then. Every figure
that divides by a roof (the first page's strict-FP32 efficiency, Beyond's floors, the workshop's efficiencies, the
cards page's model, the roofline) reads `card_roofs`, `pair_roofs` or `step_efficiency` here, so a card's
efficiency has one value wherever the book prints it, and `basis_text` says which roofs it is read against. The
measured values stay beside the datasheet's in `roofs_view`, as a measurement a reader checks against the
datasheet.
"""

from __future__ import annotations

import functools
import math

import pandas as pd

from medddpm.analysis import roofs as ar
from medddpm.configs import CONFIGS
from medddpm.report.loading import Data, gpu_types, is_cpu

ROOF_LABELS = {"dram": "DRAM bandwidth", "fp32": "FP32 (CUDA cores, strict)", "tf32": "TF32 tensor cores",
               "bf16": "bf16 tensor cores", "fp16": "fp16 tensor cores"}
# FP32 peaks of the paper's three GPUs, from their datasheets: what the first page counts training time with.
DATASHEET_FP32 = {ar.DATASHEET[t].name: ar.DATASHEET[t].roofs["fp32"] for t in ar.PAPER_CARDS}
SOURCE_WORDS = {ar.MEASURED: "measured on each card", ar.DATASHEET_SOURCE: "the datasheet's"}


def cards_of(run: pd.DataFrame | None, roofs: pd.DataFrame | None = None,
             bench: pd.DataFrame | None = None) -> dict[str, str]:
    """Every device label of the data (runs, measured roofs, bench timings) with its device type."""
    run = run if run is not None else pd.DataFrame()
    types = gpu_types(run, roofs)
    labels = set(types) | (set(bench["gpu_slug"]) if bench is not None and not bench.empty else set())
    return {slug: types.get(slug, slug) for slug in sorted(labels)}


def book_basis(run: pd.DataFrame | None, roofs: pd.DataFrame | None = None,
               bench: pd.DataFrame | None = None) -> dict[str, str]:
    """Per roof, the source every card of the data is read against (`analysis.roofs.basis`)."""
    return ar.basis(roofs, cards_of(run, roofs, bench))


def card_roofs(slug: str, run: pd.DataFrame | None = None, roofs: pd.DataFrame | None = None,
               bench: pd.DataFrame | None = None) -> dict[str, ar.Roof]:
    """The roofs of the card behind a label on the book's basis (`book_basis`): its device type read from its
    runs (a label `nvidia-h200-<host>` is an H200), each roof measured or the datasheet's as the basis says, the
    other source only where the card lacks that one (a card with no datasheet: its own measurement, or none)."""
    cards = cards_of(run, roofs, bench)
    kind = cards.get(slug, slug)
    return ar.on_basis(roofs, slug, kind, ar.basis(roofs, cards | {slug: kind}))


def pair_roofs(data: Data, a: str, b: str) -> tuple[dict, dict, str]:
    """Two cards' roofs (byte/s, FLOP/s) as a page that sets them side by side reads them: on the book's basis, that
    of every card of the data with the two among them (`analysis.roofs.pair_of`), and the source used. A card the
    data holds no run of (one estimated from its datasheet) has no measured roofs, so that its pair is read
    datasheet against datasheet."""
    cards = cards_of(data.run, data.roofs, data.bench)
    ka, kb = cards.get(a, a), cards.get(b, b)
    return ar.pair_of(data.roofs, (a, ka), (b, kb), ar.basis(data.roofs, cards | {a: ka, b: kb}))


def peaks_of(slug: str, run: pd.DataFrame | None = None, roofs: pd.DataFrame | None = None,
             bench: pd.DataFrame | None = None) -> dict[str, tuple[float, str]]:
    """The card's compute roofs (FLOP/s) per precision on the book's basis, each with its source in words
    ("measured under ..." or "datasheet: ...")."""
    return {r: (roof.value, source_text(roof)) for r, roof in card_roofs(slug, run, roofs, bench).items()
            if r in ar.COMPUTE}


def bandwidth_of(slug: str, run: pd.DataFrame | None = None, roofs: pd.DataFrame | None = None,
                 bench: pd.DataFrame | None = None) -> tuple[float, str] | None:
    roof = card_roofs(slug, run, roofs, bench).get("dram")
    return (roof.value, source_text(roof)) if roof else None


def source_text(roof: ar.Roof) -> str:
    return roof.detail if roof.source == ar.MEASURED else f"datasheet: {roof.detail}"


def gpu_labels(data: Data) -> list[str]:
    """Every GPU label of the data: labels with runs or bench timings, and labels with measured roofs only."""
    found = set(data.run["gpu_slug"]) | set(data.roofs["gpu_slug"])
    found |= set(data.bench["gpu_slug"]) if not data.bench.empty else set()
    cpu = set(data.run.loc[data.run["gpu_name"] == "cpu", "gpu_slug"]) if not data.run.empty else set()
    return sorted(s for s in found if not is_cpu(s) and s not in cpu)


def roofs_view(data: Data) -> pd.DataFrame:
    """A row per GPU label and roof: the value the book reads (`value`, on its basis, with its `source`), the
    card's own measurement (`measured`, with its p10-p90 spread) and its datasheet's value (`datasheet`) beside
    it, and the measured share of the datasheet."""
    cols = ["gpu_slug", "gpu_type", "roof", "what", "unit", "value", "source", "measured", "p10", "p90", "datasheet",
            "of_datasheet", "detail"]
    cards = cards_of(data.run, data.roofs, data.bench)
    chosen = ar.basis(data.roofs, cards)
    rows = []
    for slug in gpu_labels(data):
        kind = cards.get(slug, slug)
        own, sheet = ar.own_roofs(data.roofs, slug), ar.datasheet_roofs(kind)
        for r, roof in ar.on_basis(data.roofs, slug, kind, chosen).items():
            m, ds = own.get(r), sheet.get(r)
            rows.append({"gpu_slug": slug, "gpu_type": kind, "roof": r, "what": ROOF_LABELS[r], "unit": ar.UNITS[r],
                         "value": roof.value, "source": roof.source, "measured": m.value if m else math.nan,
                         "p10": m.p10 if m else math.nan, "p90": m.p90 if m else math.nan,
                         "datasheet": ds.value if ds else math.nan,
                         "of_datasheet": m.value / ds.value if m and ds else math.nan, "detail": roof.detail})
    out = pd.DataFrame(rows, columns=cols)
    if out.empty:
        return out
    out["order"] = out["roof"].map({r: i for i, r in enumerate(ar.ROOFS)})
    return out.sort_values(["gpu_slug", "order"]).drop(columns="order").reset_index(drop=True)


def check_roofs(view: pd.DataFrame) -> None:
    """Roofs are positive, a measurement's median lies within its spread, and no measured roof exceeds its
    datasheet's by more than a tenth (a measurement above the silicon's limit is a timing error)."""
    assert (view["value"] > 0).all(), view[view["value"] <= 0]
    m = view.dropna(subset=["measured"])
    assert ((m["p10"] <= m["measured"] * (1 + 1e-9)) & (m["measured"] <= m["p90"] * (1 + 1e-9))).all(), m
    over = m[m["of_datasheet"] > 1.1]
    assert over.empty, f"measured above the datasheet: {over[['gpu_slug', 'roof', 'of_datasheet']].to_dict('records')}"


def basis_text(data: Data, names: dict[str, str] | None = None, here: bool = False) -> str:
    """Which roofs the book reads every card against, and why: measured once every card with a datasheet has
    measured its own, the datasheet's until then (naming the cards not measured yet, by their short names
    `names`), with where the measured roofs stand beside the datasheet's (the cards page; `here` on that page);
    and the cards without a datasheet (their own measurement, or no figure that divides by a roof)."""
    def _names(slugs: list[str]) -> str:
        return ", ".join(f"**{(names or {}).get(s, s)}**" for s in slugs) + (" has" if len(slugs) == 1 else " have")

    cards = cards_of(data.run, data.roofs, data.bench)
    chosen = ar.basis(data.roofs, cards)
    sheets = {s: ar.datasheet_roofs(k) for s, k in cards.items() if ar.DATASHEET.get(k)}
    measured = [s for s in sheets if ar.own_roofs(data.roofs, s)]
    missing = [s for s, sheet in sheets.items() if any(chosen[r] == ar.DATASHEET_SOURCE and r in sheet
                                                       and r not in ar.own_roofs(data.roofs, s) for r in ar.ROOFS)]
    on_sheet = [r for r, s in chosen.items() if s == ar.DATASHEET_SOURCE]
    if not sheets:
        said = ""
    elif not on_sheet:
        said = ("Every card is read against its own measured roofs (`python -m medddpm roofs`): every card here has "
                "measured them.")
    elif not measured:
        said = ("Every card is read against its datasheet's roofs: none has measured its own yet (`python -m medddpm "
                "roofs`, which the sweep runs once per card).")
    else:
        which = "" if len(on_sheet) == len(ar.ROOFS) else " (" + ", ".join(on_sheet) + ")"
        said = (f"Every card is read against its datasheet's roofs{which}, although {_names(measured)} measured "
                f"{'its' if len(measured) == 1 else 'their'} own: {_names(missing)} not yet, and cards set side "
                "by side are read against one source. A measured roof lies below its datasheet's, so one card's "
                "measured roofs against another's datasheet would make the measured card look the more efficient. "
                + ("The measured roofs stand beside the datasheet's below." if here else
                   "The measured roofs stand beside the datasheet's on the [cards page](cards.md)."))
    own_only = [s for s in cards if s not in sheets]
    alone = [s for s in own_only if ar.own_roofs(data.roofs, s)]
    bare = [s for s in own_only if s not in alone]
    if alone:
        said += f" {_names(alone)} no datasheet here: read against {'its' if len(alone) == 1 else 'their'} own measured roofs."
    if bare:
        said += f" {_names(bare)} neither measured roofs nor a datasheet: no figure here divides by a roof of it."
    return said.strip()


# ------------------------------------------------------------------------------------ efficiency

EFFICIENCY_COLUMNS = ["gpu_slug", "gpu_type", "config", "preset", "precision", "timing", "train_median_ms",
                      "flops_per_step", "achieved_tflops", "roof", "peak_tflops", "efficiency", "basis", "peak_source"]


@functools.lru_cache(maxsize=8)
def _counted_flops(size: int, mask_channels: int, base_channels: int) -> float:
    from medddpm.model.flops import count
    from medddpm.model.unet import ModelSpec

    return count(ModelSpec(size=size, mask_channels=mask_channels, base_channels=base_channels))["train_flops"]


def _bench_steps(data: Data, swept: set[tuple[str, str]], slug: str | None, config: str | None) -> pd.DataFrame:
    """Bench timings ("ours") of (label, configuration) pairs without a finished sweep run: the median of their
    medians, the precision the configuration ran in (TF32 only where the bench recorded it), and the FLOPs of a
    sweep run of the label at the same size, else those counted on the meta device for the bench's model."""
    b = data.bench
    if b.empty:
        return pd.DataFrame()
    b = b[(b["implementation"] == "ours") & b["config"].isin(list(CONFIGS) if config is None else [config])]
    b = b if slug is None else b[b["gpu_slug"] == slug]
    b = b[pd.Series([(s, c) not in swept for s, c in zip(b["gpu_slug"], b["config"])], index=b.index, dtype=bool)]
    rows = []
    for (slug, config), g in b.groupby(["gpu_slug", "config"]):
        precision = CONFIGS[config].precision
        if precision == "tf32" and (g["fp32_math"] == "ieee").all():
            precision = "fp32"
        size = int(g["size"].iloc[0])
        same = data.ok[(data.ok["gpu_slug"] == slug) & (data.ok["size"] == size)]
        flops = (float(same["flops_per_step"].iloc[0]) if len(same) else
                 _counted_flops(size, int(g["mask_channels"].iloc[0]), int(g["base_channels"].iloc[0])))
        rows.append({"gpu_slug": slug, "config": config, "preset": "", "precision_used": precision,
                     "train_median_ms": float(g["train_median_ms"].median()), "flops_per_step": flops,
                     "timing": "bench timings"})
    return pd.DataFrame(rows)


def step_roof(roofs: dict[str, ar.Roof], precision: str) -> tuple[str, ar.Roof] | None:
    """The roof that bounds a step in `precision`: that precision's rate, or FP32's where it is higher (autocast
    and TF32 leave part of the step in FP32, so no step beats its work over the faster of the two; on a GPU the
    tensor rates are the higher, on a CPU without bf16 instructions FP32 is)."""
    if precision not in roofs:
        return None
    if precision != "fp32" and "fp32" in roofs and roofs["fp32"].value > roofs[precision].value:
        return "fp32", roofs["fp32"]
    return precision, roofs[precision]


def step_efficiency(data: Data, slug: str | None = None, config: str | None = None) -> pd.DataFrame:
    """The one source of every efficiency figure in the book: per card (label) and configuration with a timed
    step and a roof for the precision it ran in, the step's achieved FLOP/s (its FLOPs over its median time) over
    that roof, the roof taken on the book's basis (`book_basis`: measured once every card has measured its own,
    the datasheet's until then) from `card_roofs`. `slug` and `config` pick rows; the figure of a card does not
    depend on them, nor on the page that asks.

    The timing is the sweep's median micro-step (`timing` "sweep"), else the median of the bench timings of
    ours (`python -m medddpm bench`, "bench timings"). Columns: `EFFICIENCY_COLUMNS`; `precision` is what the
    step ran in, `roof` the roof it is read against (`step_roof`), `basis` "measured" or "datasheet", and
    `peak_source` the roof's source in words."""
    ok = data.ok
    sweep = ok[["gpu_slug", "config", "preset", "precision_used", "train_median_ms", "flops_per_step"]].assign(
        timing="sweep")
    sweep = sweep if slug is None else sweep[sweep["gpu_slug"] == slug]
    sweep = sweep if config is None else sweep[sweep["config"] == config]
    bench = _bench_steps(data, set(zip(ok["gpu_slug"], ok["config"])), slug, config)
    steps = pd.concat([sweep, bench], ignore_index=True) if len(bench) else sweep
    cards = cards_of(data.run, data.roofs, data.bench)
    chosen = ar.basis(data.roofs, cards)
    rows = []
    for s, g in steps.groupby("gpu_slug", sort=False):
        roofs = ar.on_basis(data.roofs, s, cards.get(s, s), chosen)
        for r in g.itertuples():
            got = step_roof(roofs, r.precision_used) if r.train_median_ms > 0 else None
            if got is None:
                continue
            roof_name, roof = got
            achieved = r.flops_per_step / (r.train_median_ms / 1e3)
            rows.append({"gpu_slug": s, "gpu_type": cards.get(s, s), "config": r.config, "preset": r.preset,
                         "precision": r.precision_used, "timing": r.timing, "train_median_ms": r.train_median_ms,
                         "flops_per_step": r.flops_per_step, "achieved_tflops": achieved / 1e12, "roof": roof_name,
                         "peak_tflops": roof.value / 1e12, "efficiency": achieved / roof.value, "basis": roof.source,
                         "peak_source": source_text(roof)})
    return pd.DataFrame(rows, columns=EFFICIENCY_COLUMNS)


__all__ = ["DATASHEET_FP32", "EFFICIENCY_COLUMNS", "ROOF_LABELS", "bandwidth_of", "basis_text", "book_basis",
           "card_roofs", "cards_of", "check_roofs", "gpu_labels", "pair_roofs", "peaks_of", "roofs_view",
           "source_text", "step_efficiency", "step_roof"]
