"""The published claims of Ryoo et al. (2026) as a table of small rules (`CLAIMS`), each judged on every GPU in
the data; what the claims page and ``python -m medddpm claims`` print of them.

A rule (`medddpm.report.claim_rules`) reads the measurements of one GPU and returns a `Verdict` in one of five
states: it *holds*; its *direction holds but its magnitude differs* (the effect goes the paper's way, but its size
lies outside the band the paper's own figure sets: "up to 5x", "~1.5%"); it *does not hold*; it is *undecided*
(measured, but the spread cannot tell); or it is *not measurable* (and why, naming what is missing). A claim whose
paper gives no figure holds or does not. A claim of several parts judges each part its data can, and says it is
judged *in part* and what would judge the rest (`settle`). Every rule can come out every way it has; the
thresholds and bands are the constants of `claim_rules`. The claims are about GPU kernels, so a CPU's rows never
judge one: on a CPU every claim is "not measurable", and the headline counts GPUs only.

Each claim is judged in one **scope** (`SCOPES`), and each figure of its evidence names the scope it is of:

- *matched layer*: the TF32 claims compare the same convolution layer and direction in baseline and opt1, kernel
  against kernel (`medddpm.analysis.layers`), and judge the matched layer that carries the most of baseline's step;
  a band "up to X" is held against the largest value over the matched layers;
- *step-weighted*: the channels-last claims, and the claims about the whole step, weight each kernel's counters by
  its share of the step (torch.profiler), not by the launches that happened to be profiled; kernel-time shares
  and step times are of this scope too;
- *model output*: the quality claims compare what the trained or stepped model computes.

A figure of another scope may stand beside the deciding one as context ("the whole step 3.9x faster"), named so;
it never decides. Claims the paper makes about one card (`Claim.paper_card`, e.g. the H100's stalls) are still
judged on every card, side by side (`side_by_side`).

    python -m medddpm claims [--data DIR] [--json]
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from medddpm.report import claim_rules as rules, equivalence
from medddpm.report.claim_rules import (  # noqa: F401 - the rules, as the claims page calls them
    BAND_CL_L2, BAND_CL_SM, BAND_CL_TENSOR, BAND_CYCLES, BAND_INSTRUCTIONS, BAND_TENSOR, CONV_DOMINANT, FAIL_DICE,
    IN_FULL, IN_PART, L1_LOW, LAYOUT_MIN, MARGINS, NEEDS, PEAK_FAR, QUALITY_LOSS, QUALITY_REL_ERR, SHIFT_MIN, SM_DROP,
    SOURCE_RULES_MIN, SPEEDUP_MIN, TENSOR_LOW, TENSOR_NEAR, VERDICTS, Band, Verdict, cl_cache, cl_shift, cl_sm,
    cl_tensor, conv_dominates, fusion_needed, inefficiency_sources, opt12_partial, opt12_peak, tf32_cycles,
    tf32_instructions, tf32_memory, tf32_quality, tf32_samples, tf32_stalls, tf32_tensor)
# The page's matched-layer tables are evidence of one GPU: read here, the claims page has one module to call.
from medddpm.report.claim_evidence import GPU, MATCHED_FORMATS, check_matched, matched_tables  # noqa: F401
from medddpm.report.convergence import Study
from medddpm.report.loading import FAILS, HOLDS, MAGNITUDE, NA, UNDECIDED, Data, config_order, is_cpu

MATCHED, STEP, OUTPUT = "matched layer", "step-weighted", "model output"
SCOPES = {
    MATCHED: "the same convolution layer and direction in both configurations, kernel against kernel (the NVTX "
             "range of each layer); the matched layer that carries the most of baseline's step decides",
    STEP: "the whole step: each kernel weighted by its share of the step's kernel time (torch.profiler), its "
          "counters from the launches that stand for it; kernel-time shares and median step times",
    "duration-weighted": "the profiled launches, each weighted by its own duration (the roofline; no claim)",
    OUTPUT: "what the model computes: one forward pass and the losses from the same weights, or the samples of "
            "trained models",
}


# ------------------------------------------------------------------------------------------- table

@dataclass(frozen=True)
class Claim:
    id: str
    short: str  # a chart label
    text: str  # as published
    rule: str  # how the verdict is computed
    judge: Callable[[GPU], Verdict]
    scope: str = STEP  # one of SCOPES: where every deciding figure comes from
    band: Band | None = None  # the paper's magnitude, where it gives one
    paper_card: str = ""  # the card the paper makes the claim about, where it names one


def _band_rule(band: Band) -> str:
    return (f" Magnitude: {band.of} within {band.low:.3g}-{band.high:.3g}{band.unit} (the paper: {band.said}), else "
            "direction holds, magnitude differs.")


CLAIMS = [
    Claim("conv-dominates", "Convolutions dominate", "Training is dominated by cuDNN convolution / implicit-GEMM kernels.",
          f"Convolution kernels take more than {CONV_DOMINANT:.0%} of baseline's kernel time (kernels.parquet).",
          conv_dominates),
    Claim("inefficiency-sources", "Five sources of inefficiency",
          "Inefficiencies come from memory access, layout conversion, warp scheduling, cache residency and low "
          "tensor-core use.",
          f"Each source shown: memory-access and warp-scheduling rules of ncu estimate at least "
          f"{SOURCE_RULES_MIN:.0%} of baseline's step recoverable; layout-conversion kernels take at least "
          f"{LAYOUT_MIN:.0%} of one paper configuration's step; baseline's L1 hit rate is under {L1_LOW:.0f}%; opt1's "
          f"tensor pipe is under {TENSOR_LOW:.0f}% of peak. Each source is a part: the layout source reads kernel "
          "tables, the other four Nsight Compute counters; a source whose data are missing is not judged yet.",
          inefficiency_sources),
    Claim("tf32-cycles", "TF32 cuts SM cycles (up to 5x)", "TF32 cuts SM cycles (up to 5x).",
          f"SM active cycles of the same layer, baseline / opt1 >= {SPEEDUP_MIN}, on the matched layer carrying the "
          "most of baseline's step." + _band_rule(BAND_CYCLES), tf32_cycles, MATCHED, BAND_CYCLES),
    Claim("tf32-instructions", "TF32 cuts instructions (up to 100x)", "TF32 cuts dynamic instructions (up to 100x).",
          f"Executed instructions of the same layer, baseline / opt1 >= {SPEEDUP_MIN}, on the matched layer carrying "
          "the most of baseline's step." + _band_rule(BAND_INSTRUCTIONS), tf32_instructions, MATCHED,
          BAND_INSTRUCTIONS),
    Claim("tf32-tensor", "TF32 raises tensor-core use 1.45-9.98x", "TF32 raises tensor-core utilization 1.45x-9.98x (A100).",
          f"Tensor-pipe use of the same layer, opt1 / baseline >= {SPEEDUP_MIN}, on the matched layer carrying the "
          "most of baseline's step." + _band_rule(BAND_TENSOR), tf32_tensor, MATCHED, BAND_TENSOR, "A100"),
    Claim("tf32-memory", "TF32: L1 hit falls, DRAM use rises", "Under TF32 the L1 hit rate falls and DRAM bandwidth use rises.",
          "L1 hit rate lower and DRAM throughput higher in opt1 than in baseline, on the matched layer carrying the "
          "most of baseline's step.", tf32_memory, MATCHED),
    Claim("tf32-stalls", "TF32 on H100: pipe stalls fall, scoreboard rise",
          "With TF32 on the H100, math-pipe-throttle stalls fall but long-scoreboard stalls rise.",
          "Math-pipe-throttle stall cycles per issued instruction lower and long-scoreboard ones higher in opt1 than "
          "in baseline, on the matched layer carrying the most of baseline's step; judged on every card.",
          tf32_stalls, MATCHED, paper_card="H100"),
    Claim("cl-shift", "Channels-last: element-wise + layout kernels",
          "Channels-last shifts the workload to small element-wise and layout-conversion kernels.",
          f"Share of element-wise + layout kernel time, opt2 minus baseline (where opt2 is missing, opt12 minus opt1) "
          f"> {SHIFT_MIN:.0%} points (kernels.parquet).", cl_shift),
    Claim("cl-tensor", "Channels-last: tensor cores near baseline (~1.5%)",
          "Under channels-last tensor-core use stays near baseline (~1.5%).",
          f"Step-weighted tensor-pipe use of opt2 within {TENSOR_NEAR} points of baseline's."
          + _band_rule(BAND_CL_TENSOR), cl_tensor, STEP, BAND_CL_TENSOR),
    Claim("cl-sm", "Channels-last: SM throughput drops (~50%)", "Under channels-last SM throughput drops (~50%).",
          f"Step-weighted SM throughput, opt2 / baseline <= {SM_DROP}." + _band_rule(BAND_CL_SM), cl_sm, STEP,
          BAND_CL_SM),
    Claim("cl-cache", "Channels-last: L2 hit rises (to 85%), DRAM falls",
          "Under channels-last the L2 hit rate rises (up to 85%) and DRAM use collapses.",
          "Step-weighted L2 hit rate higher and DRAM throughput lower in opt2 than in baseline."
          + _band_rule(BAND_CL_L2), cl_cache, STEP, BAND_CL_L2),
    Claim("opt12-partial", "OPT12 only partly restores", "Combined (OPT12) only partly restores tensor-core use.",
          "Both orderings opt2 < opt12 < opt1: in step speed (median step time, from the runs), and in step-weighted "
          "tensor-pipe use (from Nsight Compute counters); each judged where its data are.", opt12_partial),
    Claim("opt12-peak", "OPT12 on H100: far from peak, element-wise bound",
          "OPT12 does not reach peak on the H100 and stays dominated by element-wise and layout kernels.",
          f"opt12's achieved FLOP/s (FLOPs per step / median step time) under {PEAK_FAR:.0%} of the card's roof in "
          "its precision (on the book's basis: measured once every card has measured its own, else the datasheet's), and element-wise + layout kernels a larger share of its "
          "step's kernel time than convolutions; judged on every card.", opt12_peak, paper_card="H100"),
    Claim("fusion-needed", "Fusion is needed", "Further kernel fusion is needed.",
          f"Fusing the same model with torch.compile: sdpa / compile median step time >= {SPEEDUP_MIN}.", fusion_needed),
    Claim("tf32-quality", "TF32 keeps quality", "TF32 does not degrade synthesis quality.",
          f"opt1 against strict FP32 from the same weights: forward relative error <= {QUALITY_REL_ERR:g} and mean "
          f"relative loss difference <= {QUALITY_LOSS:.0%}, where TF32 really ran (quality.parquet).", tf32_quality,
          OUTPUT),
    Claim("tf32-samples", "TF32 trains as good a model", "TF32 does not degrade synthesis quality.",
          "Convergence study, paired seeds: opt1 minus strict FP32, seed by seed, judged by an equivalence test "
          f"({equivalence.CONFIDENCE:.0%} t-interval of the mean difference within ±{MARGINS['label_dice']:g} label_dice, "
          f"±{MARGINS['hist_w1']:g} hist_w1 and ±{MARGINS['ms_ssim']:g} MS-SSIM), and no more of opt1's runs fail "
          f"(diverged, or mean label_dice < {FAIL_DICE}). Holds when equivalent or better; does not hold when worse; "
          "undecided otherwise.",
          tf32_samples, OUTPUT),
]
COLUMNS = ["claim_id", "short", "claim", "gpu_slug", "verdict", "judged", "scope", "paper", "paper_card", "rule",
           "evidence", "figures", "needs"]
ON_CPU = "a claim about GPU kernels: not measurable on a CPU (the CPU run checks the pipeline, not the paper)"


def devices(data: Data) -> list[str]:
    """Every device in the data: swept ones, and GPUs known from bench timings only."""
    bench = set(data.bench["gpu_slug"]) if not data.bench.empty else set()
    return sorted(set(data.run["gpu_slug"]) | bench, key=lambda s: (is_cpu(s), s))  # GPUs first


def example_device(data: Data) -> str | None:
    """The device the claims page works its example on: the first GPU whose counters judge "TF32 cuts SM cycles"
    (a matched layer in baseline and opt1), else the first device."""
    found = devices(data)
    for slug in found:
        g = GPU(data, slug)
        if g.is_gpu and tf32_cycles(g).verdict != NA:
            return slug
    return found[0] if found else None


def _needs_text(needs: frozenset) -> str:
    """(kind, configuration) pairs as the table keeps them: "counters:baseline counters:opt1 study:"."""
    return " ".join(sorted(f"{kind}:{config}" for kind, config in needs))


def verdicts(data: Data, claims=CLAIMS, study: Study | None = None) -> pd.DataFrame:
    """Every claim against every device in the data (`COLUMNS`; `figures` a dict of the numbers judged; `judged`
    "in full", "in part" or "" for not measurable; `needs` what would judge it or its other parts, as
    "kind:configuration" words, `NEEDS`); the convergence study (`convergence.load_study`), where given, judges
    the trained models' samples."""
    rows = []
    for slug in devices(data):
        g = GPU(data, slug, study)
        for c in claims:
            v = c.judge(g) if g.is_gpu else Verdict(NA, ON_CPU)
            rows.append({"claim_id": c.id, "short": c.short, "claim": c.text, "gpu_slug": slug, "verdict": v.verdict,
                         "judged": v.judged, "scope": c.scope, "paper": c.band.said if c.band else "",
                         "paper_card": c.paper_card, "rule": c.rule, "evidence": v.evidence, "figures": v.figures,
                         "needs": _needs_text(v.needs)})
    return pd.DataFrame(rows, columns=COLUMNS)


def headline(table: pd.DataFrame) -> pd.DataFrame:
    """Verdict counts per GPU (CPU rows left out), and how many of its verdicts are judged in part."""
    t = table[~table["gpu_slug"].map(is_cpu).astype(bool)]
    counts = t.groupby("gpu_slug")["verdict"].value_counts().unstack(fill_value=0).reindex(columns=list(VERDICTS),
                                                                                            fill_value=0)
    return counts.assign(**{IN_PART: t.groupby("gpu_slug")["judged"].apply(lambda j: int((j == IN_PART).sum()))})


def _shown(verdict: str, judged: str) -> str:
    return f"{verdict} ({IN_PART})" if judged == IN_PART else verdict


def side_by_side(table: pd.DataFrame) -> pd.DataFrame:
    """A row per claim, a verdict column per GPU (CPU rows left out; "(in part)" where some of the claim's parts
    are not judged yet), with the claim's scope, the paper's magnitude and the card the paper made it about."""
    t = table[~table["gpu_slug"].map(is_cpu).astype(bool)]
    if t.empty:
        return pd.DataFrame(columns=["claim_id", "short", "scope", "paper", "paper_card"])
    t = t.assign(shown=[_shown(v, j) for v, j in zip(t["verdict"], t["judged"])])
    wide = t.pivot(index="claim_id", columns="gpu_slug", values="shown")
    meta = t.drop_duplicates("claim_id").set_index("claim_id")[["short", "scope", "paper", "paper_card"]]
    order = list(dict.fromkeys(t["claim_id"]))
    gpus = list(dict.fromkeys(t["gpu_slug"]))
    return meta.join(wide[gpus]).loc[order].reset_index()


def _plain(v):
    if isinstance(v, float):
        return None if math.isnan(v) else v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v.item() if hasattr(v, "item") else v


def as_json(table: pd.DataFrame) -> str:
    """The verdicts as a JSON list, a claim each, every device's verdict side by side: {claim, text, scope, paper,
    paper_card, rule, verdicts: {device: {verdict, judged, evidence, figures, needs}}}, `needs` as [kind,
    configuration] pairs."""
    out = []
    for claim_id, rows in table.groupby("claim_id", sort=False):
        r = rows.iloc[0]
        out.append({"claim": claim_id, "text": r["claim"], "scope": r["scope"], "paper": r["paper"] or None,
                    "paper_card": r["paper_card"] or None, "rule": r["rule"],
                    "verdicts": {d.gpu_slug: {"verdict": d.verdict, "judged": d.judged or None, "evidence": d.evidence,
                                              "figures": {k: _plain(v) for k, v in d.figures.items()},
                                              "needs": [w.split(":", 1) for w in d.needs.split()]}
                                 for d in rows.itertuples()}})
    return json.dumps(out, indent=1)


# ------------------------------------------------------------------------------------- what is left

def settle(table: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, what would judge the claims it cannot judge yet, or the parts of those it judges in part: a row
    per kind of measurement (`NEEDS`) with the configurations it is of, how many claims it would judge (`claims`,
    now not measurable) and how many it would complete (`parts`, now judged in part)."""
    cols = ["gpu_slug", "kind", "configs", "claims", "parts"]
    t = table[~table["gpu_slug"].map(is_cpu).astype(bool) & (table["needs"] != "")]
    rows = []
    for slug, g in t.groupby("gpu_slug", sort=False):
        per_kind: dict[str, dict] = {}
        for r in g.itertuples():
            kinds: dict[str, set] = {}
            for w in r.needs.split():
                kind, config = w.split(":", 1)
                kinds.setdefault(kind, set()).add(config)
            for kind, configs in kinds.items():
                k = per_kind.setdefault(kind, {"configs": set(), "claims": 0, "parts": 0})
                k["configs"] |= configs
                k["claims" if r.verdict == NA else "parts"] += 1
        for kind in NEEDS:
            if kind in per_kind:
                k = per_kind[kind]
                configs = [c for c in config_order(k["configs"]) if c in k["configs"] and c]
                rows.append({"gpu_slug": slug, "kind": kind, "configs": configs, "claims": k["claims"],
                             "parts": k["parts"]})
    return pd.DataFrame(rows, columns=cols)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _what(kind: str, slug: str, configs: list[str]) -> str:
    """A kind of measurement of some configurations, with the command that makes it."""
    names, paths = ", ".join(f"`{c}`" for c in configs), " ".join(f"data/{slug}/{c}" for c in configs)
    return {
        "run": f"runs of {names} (`python -m medddpm sweep --preset paper --configs {','.join(configs)}`)",
        "counters": f"Nsight Compute counters of {names} (the sweep's `ncu` phase; for the runs already measured, "
                    f"`python -m medddpm counters {paths}`)",
        "layers": f"counters with layer ranges of {names} (`python -m medddpm counters {paths} --force`)",
        "kernels": f"kernel tables of {names} (the sweep's `torch` phase)",
        "quality": f"the quality table of {names} (the sweep's `quality` phase)",
        "study": "the convergence study (`python -m medddpm study --configs baseline,opt1`)",
    }[kind]


def settle_text(table: pd.DataFrame) -> str:
    """Per GPU, the runs that would settle what its data cannot judge yet (`settle`), each with its command."""
    lines = []
    for slug, g in settle(table).groupby("gpu_slug", sort=False):
        items = [f"{_what(r.kind, slug, r.configs)} would "
                 + " and ".join(filter(None, [f"judge {_plural(r.claims, 'claim')}" if r.claims else "",
                                              f"complete {_plural(r.parts, 'claim')} judged in part" if r.parts
                                              else ""]))
                 for r in g.itertuples()]
        lines.append(f"- **{slug}**: " + "; ".join(items) + ".")
    return ("What would settle the rest, card by card:\n\n" + "\n".join(lines)) if lines else (
        "Every claim is judged in full on every card in these data.")


# ------------------------------------------------------------------------------------------ the page

def check_verdicts(table: pd.DataFrame, cpus: set[str]) -> None:
    """Every claim judged once on every device, with a known verdict, none on a CPU; a verdict judged in part
    names the parts not judged and what would judge them."""
    assert set(table["verdict"]) <= set(VERDICTS), set(table["verdict"])
    assert len(table) == len(CLAIMS) * table["gpu_slug"].nunique(), len(table)
    assert (table.loc[table["gpu_slug"].isin(cpus) | table["gpu_slug"].map(is_cpu), "verdict"] == NA).all()
    part = table[table["judged"] == IN_PART]
    assert part["evidence"].str.contains("not judged yet: ").all() and (part["needs"] != "").all(), part


def tally_text(t: pd.Series) -> str:
    """One device's verdict counts (a row of `headline`) in words."""
    judged = t[HOLDS] + t[MAGNITUDE] + t[FAILS] + t[UNDECIDED]
    return (f"{t[HOLDS]} hold, {t[MAGNITUDE]} hold in direction but not in magnitude, {t[FAILS]} do not hold"
            + (f", {t[UNDECIDED]} undecided" if t[UNDECIDED] else "") + f", {t[NA]} not measurable"
            + (f"; {t[IN_PART]} of the {judged} judged are judged in part" if t[IN_PART] else ""))


def headline_text(table: pd.DataFrame, on_cpu: bool) -> str:
    """The tally of every GPU, and that a CPU run judges none."""
    lines = [f"- **{slug}**: **{r[HOLDS]} hold**, **{r[MAGNITUDE]} hold in direction but not in magnitude**, "
             f"**{r[FAILS]} do not hold**" + (f", {r[UNDECIDED]} undecided" if r[UNDECIDED] else "")
             + f", {r[NA]} not measurable"
             + (f" ({r[IN_PART]} of the judged claims judged in part: some of their data are not measured yet)"
                if r[IN_PART] else "") for slug, r in headline(table).iterrows()]
    cpu = "\n\nThe CPU run (a small model, to check the pipeline) judges none of them." if on_cpu else ""
    return (f"{len(CLAIMS)} claims on each GPU:\n\n" + ("\n".join(lines) or "- no GPU measured yet") + cpu
            + "\n\nHover over a cell for the numbers; click a verdict in the legend to pick those cells out.")


def claims_text(gpu_table: pd.DataFrame) -> str:
    """Claim by claim: its text, scope, the paper's magnitude and card, its rule, every GPU's verdict and evidence."""
    parts = []
    for c in CLAIMS:
        rows = gpu_table[gpu_table["claim_id"] == c.id]
        about = f"*Scope:* {c.scope}" + (f"; *the paper's magnitude:* {c.band.said}" if c.band else "") + (
            f"; *the paper's card:* {c.paper_card}" if c.paper_card else "")
        parts.append(f"**{c.text}**\n\n{about}\n\n*Rule:* {c.rule}\n\n"
                     + ("\n".join(f"- {r.gpu_slug}: **{_shown(r.verdict, r.judged)}**: {r.evidence}"
                                  for r in rows.itertuples()) or "- no GPU measured yet"))
    return "\n\n".join(parts)


THRESHOLDS = {
    "SPEEDUP_MIN": "a ratio of times, cycles or instructions that counts as a cut",
    "CONV_DOMINANT": "convolution share of baseline's kernel time that counts as dominant",
    "SHIFT_MIN": "smallest shift of kernel-time share that counts",
    "TENSOR_NEAR": "tensor-pipe points within which use is 'near' the baseline",
    "SM_DROP": "channels-last SM throughput at most this fraction of baseline's",
    "SOURCE_RULES_MIN": "step share ncu's memory or scheduling rules must estimate recoverable",
    "LAYOUT_MIN": "layout-conversion share of a paper configuration's step that counts",
    "L1_LOW": "baseline L1 hit rate (%) under which cache residency is poor",
    "TENSOR_LOW": "opt1 tensor-pipe use (% of peak) under which it is low",
    "PEAK_FAR": "share of the card's roof under which a step 'does not reach peak'",
    "MAGNITUDE_FACTOR": "'up to X' spans X / this to X × this",
    "ABOUT_REL": "'~X' spans X within this relative difference",
    "QUALITY_REL_ERR": "forward relative error tolerated against strict FP32",
    "QUALITY_LOSS": "mean relative loss difference tolerated",
}


def thresholds() -> pd.DataFrame:
    """The constants the rules use, with their values as they are now and what each means."""
    return pd.DataFrame([{"constant": k, "value": getattr(rules, k), "meaning": v} for k, v in THRESHOLDS.items()])


def scopes() -> pd.DataFrame:
    return pd.DataFrame([{"scope": k, "what it weighs": v} for k, v in SCOPES.items()])
