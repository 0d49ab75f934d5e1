"""The first page: the headline speedups with the claims' tally, the work of one training run counted, what it
costs at the efficiency strict FP32 reaches, and what the data tree holds.

Every figure comes from the data and the model's shapes: nothing here names a GPU or types a peak in, so a card
added under ``data/`` joins the headline and the efficiency table with no page edited.
"""

from __future__ import annotations

import pandas as pd

from medddpm.analysis.roofs import datasheet_roofs
from medddpm.configs import CONFIGS
from medddpm.model.flops import count
from medddpm.model.unet import ModelSpec
from medddpm.report import convergence, equivalence, tables
from medddpm.report.claims import CLAIMS, tally_text
from medddpm.report.loading import Data, cpu_slugs, gpu_types
from medddpm.report.roofs import DATASHEET_FP32, gpu_labels, step_efficiency
from medddpm.report.safe import code, md
from medddpm.report.step_time import HEADLINE_ROLES, REFERENCE_ACCUM, REFERENCE_STEPS, headline

# The claims whose figures the paper gives as counters of the same work before and after TF32 (matched layers).
PAPER_TF32 = (("tf32-cycles", "SM cycles, strict FP32 / TF32 (largest over the matched layers)"),
              ("tf32-instructions", "executed instructions, strict FP32 / TF32 (largest over the matched layers)"),
              ("tf32-tensor", "tensor-pipe use, TF32 / strict FP32 (the layer carrying the most of the step)"))


def headline_devices(data: Data) -> tuple[pd.DataFrame, bool]:
    """`step_time.headline` of the GPUs, and whether they are GPUs: a data tree of CPU runs only shows those (and
    the page says so), since a CPU's smoke runs are all there is to show."""
    head = headline(data.run)
    gpu = head[~tables.cpu_rows(head, cpu_slugs(data.run))]
    return (gpu, True) if len(gpu) else (head, False)


def check_headline(head: pd.DataFrame) -> None:
    """A device with a strict-FP32 baseline exists, and every speedup is positive and lies in its own spread."""
    assert len(head), "no device with a strict-FP32 baseline under data/"
    assert (head["lo"] <= head["speedup"] + 1e-9).all() and (head["speedup"] <= head["hi"] + 1e-9).all(), head
    assert (head["speedup"] > 0).all(), head


def result_text(head: pd.DataFrame, tally: pd.DataFrame, on_gpu: bool) -> str:
    """The headline in words: per device, strict FP32's micro-step, each of the paper's configurations against it
    (one slower than it says so), the fastest measured, and the claims' tally on that device."""
    lines = []
    for slug, g in head.groupby("gpu_slug", sort=False):
        base = g[g["config"] == "baseline"].iloc[0]
        paper = g[(g["role"] == HEADLINE_ROLES[0]) & (g["config"] != "baseline")]
        line = (f"- **{md(slug)}** ({md(base['preset'])} preset, {base['size']}³): strict FP32 takes "
                f"{base['base_ms']:.4g} ms a training micro-step. The paper's configurations: " + "; ".join(
                    f"{code(r.config)} {r.train_median_ms:.4g} ms, **{r.speedup:.2f}x**"
                    + (" (slower than strict FP32)" if r.hi < 1 else "") for r in paper.itertuples()) + ".")
        fast = g[g["role"] == HEADLINE_ROLES[1]]
        if len(fast):
            f = fast.iloc[0]
            line += (f" The fastest configuration measured, {code(f['config'])}, takes {f['train_median_ms']:.4g} ms: "
                     f"**{f['speedup']:.1f}x** ({f['lo']:.1f}-{f['hi']:.1f}x over the runs' 10th-90th percentiles).")
        if slug in tally.index:
            line += f" Of the paper's claims judged here ([claims](claims.md)): {tally_text(tally.loc[slug])}."
        lines.append(line)
    intro = ("One training micro-step of the whole-head model (forward, backward and Adam, one volume), against "
             "strict FP32 on the same GPU:" if on_gpu else
             "**No GPU run in the data yet**: the rows below are a CPU's smoke runs (the model's shape at a tiny "
             "size), which check the pipeline and say nothing about GPUs. Against strict FP32 on the same CPU:")
    return intro + "\n\n" + "\n".join(lines)


def quality_text(study) -> str:
    """The convergence study's answer in one paragraph, or that it has not run on a GPU."""
    said = convergence.headline_text(study)
    if not said:
        return ("**Does the speed cost quality?** The [convergence study](convergence.md) has not been run on a GPU "
                "in these data yet.")
    return ("**Does the speed cost quality?** The [convergence study](convergence.md) trains each configuration from "
            "the same seeds (a small model, 64³, a few thousand steps) and compares their samples seed by seed, as an "
            f"equivalence test against a stated margin ({equivalence.CONFIDENCE:.0%} intervals):\n\n" + said)


def tf32_beside_paper(verdicts: pd.DataFrame, cpus: set[str], names: dict[str, str] | None = None) -> pd.DataFrame:
    """The paper's TF32 figures (`PAPER_TF32`), each with its band and every GPU's measured magnitude and verdict,
    a column per GPU headed by its short name (`names`, `tables.card_names`); the frame has no measured column when
    no GPU judged them."""
    names = names or {}
    rows = []
    for claim_id, what in PAPER_TF32:
        band = next(c.band for c in CLAIMS if c.id == claim_id)
        row = {"TF32 against strict FP32": what, "paper (V100, A100, H100)": band.said}
        for r in verdicts[(verdicts["claim_id"] == claim_id) & ~verdicts["gpu_slug"].isin(cpus)].itertuples():
            f = r.figures
            shown = f"{f['magnitude']:.1f}x ({r.verdict})" if "magnitude" in f else "not measured"
            row[f"measured here, {names.get(r.gpu_slug, r.gpu_slug)}"] = shown
        rows.append(row)
    return pd.DataFrame(rows)


def counted_step(size: int = 128, mask_channels: int = 3) -> dict:
    """The work of one training micro-step of the whole-head model (the paper preset on the embedded MNI data: CSF,
    GM and WM labels), counted on PyTorch's meta device, which runs the shapes with no memory and no arithmetic:
    parameters, forward FLOPs (and by operator), training FLOPs (forward + backward)."""
    return count(ModelSpec(size=size, mask_channels=mask_channels))


def check_counted(step: dict, total: float) -> None:
    """The count is of the model the paper trains: some 40 million parameters, tens of TFLOP a micro-step, and a
    training run of the order of 10^18 FLOP (the text writes it in those units)."""
    assert 1e13 < step["train_flops"] < 1e14 and 3.9e7 < step["parameters"] < 4.1e7, step
    assert 1e18 <= total < 1e19, total


def count_text(step: dict, total: float) -> str:
    """The count in words: parameters, the forward pass and its convolutions' share, the micro-step, the run."""
    flops = step["train_flops"]
    return (f"- **{step['parameters']:,} parameters**, {step['forward_flops'] / 1e12:.2f} TFLOP in the forward pass "
            f"(convolutions {step['forward_flops_by_op']['convolution'] / step['forward_flops']:.1%} of it);\n"
            f"- **{flops / 1e12:.2f} TFLOP per micro-step** (forward + backward);\n"
            f"- the reference trains for {REFERENCE_STEPS:,} optimizer steps of {REFERENCE_ACCUM} micro-steps: "
            f"{flops / 1e12:.2f} TFLOP × {REFERENCE_ACCUM} × {REFERENCE_STEPS:,} = "
            f"**{total / 1e18:.2f} × 10¹⁸ FLOP** for one training run.")


def fp32_efficiency(data: Data) -> pd.DataFrame:
    """Per GPU label: the efficiency of strict FP32 (the baseline's step against the card's FP32 roof), as
    `roofs.step_efficiency` gives it to every page: the paper preset's sweep where there is one, else the bench
    timings; the roof on the book's basis, with the card's FP32 datasheet peak beside it (`datasheet_tflops`), by
    which the cost table scales the step to the paper's GPUs."""
    e = step_efficiency(data, config="baseline")
    e = e[e["gpu_slug"].isin(gpu_labels(data)) & ((e["preset"] == "paper") | (e["timing"] != "sweep"))]
    types = gpu_types(data.run, data.roofs)
    sheet = [datasheet_roofs(types.get(s, s)).get("fp32") for s in e["gpu_slug"]]
    return e.assign(datasheet_tflops=[r.value / 1e12 if r else float("nan") for r in sheet]).reset_index(drop=True)


def _paced(slug: str, names: dict[str, str] | None) -> str:
    return f"hours at strict FP32's pace on {(names or {}).get(slug, slug)}"


def training_cost(eff: pd.DataFrame, total: float, names: dict[str, str] | None = None) -> pd.DataFrame:
    """GPU-hours of one training run (`total` FLOP) on each of the paper's GPUs: at 100% of its FP32 datasheet
    peak, and at the pace strict FP32 keeps on each measured card (a column each, headed by its short name,
    `names`), scaled to each GPU by the two datasheets' FP32 peaks (the one FP32 figure all of them have; a card
    without a datasheet is left out of that scaling)."""
    eff = eff.dropna(subset=["datasheet_tflops"])
    rows = []
    for gpu, peak in DATASHEET_FP32.items():
        row = {"GPU": gpu, "FP32 peak (TFLOP/s, datasheet)": peak / 1e12, "hours at 100% of peak": total / peak / 3600}
        for r in eff.itertuples():
            share = r.achieved_tflops / r.datasheet_tflops  # of its own datasheet peak
            row[_paced(r.gpu_slug, names)] = total / (peak * share) / 3600
        rows.append(row)
    return pd.DataFrame(rows)


def check_cost(cost: pd.DataFrame) -> None:
    assert (cost.filter(like="hours").to_numpy() > 0).all(), cost


def cost_text(eff: pd.DataFrame, cost: pd.DataFrame, names: dict[str, str] | None = None) -> str:
    """What the efficiency of the first measured card of the cost table means for a training run, in words, with
    the roof it is read against."""
    shown = [r for r in eff.dropna(subset=["datasheet_tflops"]).itertuples() if _paced(r.gpu_slug, names) in cost]
    if not shown:
        return ""
    r, paced = shown[0], cost[_paced(shown[0].gpu_slug, names)]
    roof = "datasheet peak" if r.basis == "datasheet" else "measured roof"
    return (f"Strict FP32 on the {md((names or {}).get(r.gpu_slug, r.gpu_slug))} takes {r.train_median_ms:.0f} ms a "
            f"micro-step ({r.timing} timing): {r.efficiency:.0%} of its FP32 {roof} ({r.peak_tflops:.3g} TFLOP/s). "
            f"At that pace, scaled to each GPU by its FP32 datasheet peak, one training run costs from "
            f"{paced.min():.0f} GPU-hours on the newest of these GPUs to {paced.max():.0f} on the oldest, before any "
            "hyper-parameter search or repeated run. Tensor cores, lower precision, other memory layouts and kernel "
            "fusion change that by large factors; this book measures by how much.")


def configurations() -> pd.DataFrame:
    """Every configuration with what it switches on, in the order the book shows them."""
    return pd.DataFrame([{"configuration": c.name, "what it switches on": c.description} for c in CONFIGS.values()])


def measured_text(data: Data) -> str:
    """What the data tree holds: each device's configurations with its preset and input, and the devices known
    from bench timings only."""
    runs, cpus = data.run, cpu_slugs(data.run)
    gpus = tables.gpus_first(runs["gpu_slug"])
    lines = [f"- **{md(slug)}**{' (a CPU: smoke runs)' if slug in cpus else ''}: {md(', '.join(g['config']))} "
             f"({md(g['preset'].iloc[0])} preset, {g['size'].iloc[0]}³ input)"
             for slug, g in runs.groupby("gpu_slug", sort=False)]
    bench_only = sorted(set(data.bench["gpu_slug"]) - set(gpus)) if not data.bench.empty else []
    text = f"The data tree holds {len(runs)} runs on {len(gpus)} device(s):\n\n" + "\n".join(lines)
    if bench_only:
        text += ("\n\nBench timings (`python -m medddpm bench`: step time and peak memory only) exist for: "
                 + md(", ".join(bench_only)) + ".")
    return text
