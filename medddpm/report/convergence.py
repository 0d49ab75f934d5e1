"""The convergence page: does a faster configuration train as good a model? (`python -m medddpm study`)

Reads ``data/<gpu-slug>/convergence/`` (`medddpm.store.convergence`), summarises the runs per configuration
with the spread between seeds, weighs each configuration against the reference one, and draws the page's
figures (Altair) and its sample gallery (small PNGs inlined, each with alt text).

A difference between two configurations counts only when it exceeds the spread between seeds: the larger of
the two configurations' standard deviations of their seeds' mean scores. A run fails when its samples' mean
label_dice falls below `FAIL_DICE`.
"""

from __future__ import annotations

import base64
import html
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medddpm.store import convergence as store
from medddpm.store import schema
from medddpm.report.loading import DataError, _sort, config_order, data_root

REFERENCES = ("opt1", "baseline")  # the reference configuration: TF32 where it ran, else strict FP32
FAIL_DICE = 0.6  # a run whose samples' mean label_dice is below this drew tissue in the wrong places
NEAR_DICE = 0.05  # the bar: the fastest configuration's mean label_dice within this of the reference's
METRICS = {  # metric -> (tissue of its summary row, what a reader is told, higher is better)
    "label_dice": ("mean", "tissue agreement with the label map (label_dice, mean of CSF, GM, WM)", True),
    "hist_w1": ("mean", "intensity distance to the real images (hist_w1, mean over tissues)", False),
    "ms_ssim": ("brain", "likeness of two samples of one label map (MS-SSIM; lower: more varied)", None),
}
LOSES, GAINS, WITHIN, ONE_SEED = "loses quality", "better", "within the spread", "one seed: no spread"


@dataclass(frozen=True)
class Study:
    """Every GPU's convergence tables, each with gpu_slug; `folders` maps a GPU to its study folder."""

    runs: pd.DataFrame
    losses: pd.DataFrame
    samples: pd.DataFrame
    folders: dict

    @property
    def gpus(self) -> list[str]:
        return sorted(self.folders)

    @property
    def empty(self) -> bool:
        return self.runs.empty


def load_study(root: str | os.PathLike | None = None) -> Study:
    """Every ``<root>/<gpu-slug>/convergence/`` with a runs table, validated: each row names its folder's GPU."""
    root = Path(root) if root is not None else data_root()
    frames = {t: [] for t in store.TABLES}
    folders = {}
    for folder in sorted(root.glob(f"*/{store.CONVERGENCE_DIR}")):
        slug = folder.parent.name
        if not (folder / "runs.parquet").is_file():
            if any(folder.glob("*.parquet")):
                raise DataError(f"incomplete study {folder}: parquet files but no runs.parquet")
            continue
        try:
            tables = {t: store.read(folder, t) for t in store.TABLES}
        except (schema.SchemaError, OSError, ValueError) as e:
            raise DataError(f"{folder}: {str(e).splitlines()[0]}") from None
        if (tables["runs"]["gpu_slug"] != slug).any():
            raise DataError(f"{folder}: runs.parquet holds rows of another GPU than {slug}")
        for t, df in tables.items():
            frames[t].append(df.assign(gpu_slug=slug) if t != "runs" else df)
        folders[slug] = folder
    out = {t: pd.concat(v, ignore_index=True) if v else
           schema.empty(store.table_name(t)).assign(**({} if t == "runs" else {"gpu_slug": pd.Series(dtype="str")}))
           for t, v in frames.items()}
    return Study(out["runs"], out["losses"], out["samples"], folders)


def gpus_without_study(study: Study, run: pd.DataFrame) -> list[str]:
    """GPUs measured elsewhere in the book (main runs) that have no convergence study."""
    measured = sorted(set(run["gpu_slug"]) - {"cpu"}) if len(run) else []
    return [g for g in measured if g not in study.folders]


def reference_config(configs) -> str | None:
    present = set(configs)
    return next((c for c in REFERENCES if c in present), next(iter(config_order(present)), None) if present else None)


# ------------------------------------------------------------------------------------------ summaries


def settings(study: Study) -> pd.DataFrame:
    """Per GPU, what the study's runs shared (one row each): a reader's 'how was this run'."""
    ok = study.runs[study.runs["status"] == "ok"]
    rows = []
    for slug, r in ok.groupby("gpu_slug"):
        first = r.iloc[0]
        rows.append({"gpu_slug": slug, "configurations": ", ".join(c for c in config_order(r["config"])
                                                                    if c in set(r["config"])),
                     "seeds": ", ".join(map(str, sorted(r["seed"].unique()))),
                     "input": f"{first['size']}³ voxels", "base channels": str(first["base_channels"]),
                     "training pairs": str(first["pairs"]), "optimizer steps": f"{int(first['steps']):,}",
                     "learning rate": f"{float(first['lr']):g}", "gradient accumulation": str(first["grad_accum"]),
                     "EMA": f"decay {first['ema_decay']:g} every 10 steps from step {int(first['ema_start'])}",
                     "samples per run": str(first["samples"]),
                     "label maps": ", ".join(json.loads(first["label_maps"])),
                     "denoising steps per sample": str(first["sample_timesteps"]),
                     "torch": first["torch"], "commit": str(first["git_commit"])[:12]})
    return pd.DataFrame(rows)


def ema_note(study: Study) -> str:
    """Whether the sampled EMA weights averaged anything (the reference's EMA starts at step 2000)."""
    ok = study.runs[study.runs["status"] == "ok"]
    if ok.empty:
        return ""
    steps, start = int(ok["steps"].max()), int(ok["ema_start"].min())
    if steps <= start:
        return (f"The EMA follows the reference (decay 0.995 every 10 steps, averaging from step {start:,}): at "
                f"{steps:,} steps it has only begun, so the samples come from the weights at the end of training.")
    return f"The samples come from the EMA of the weights (averaging from step {start:,} of {steps:,})."


def per_seed(study: Study) -> pd.DataFrame:
    """Per (GPU, configuration, seed): each metric's mean over the run's samples (or sample pairs), the run's
    skipped steps and final loss. The held-out subjects' real images appear as configuration 'real'."""
    s = study.samples
    rows = []
    for metric, (tissue, _, _) in METRICS.items():
        part = s[(s["metric"] == metric) & (s["tissue"] == tissue)]
        rows.append(part.groupby(["gpu_slug", "config", "seed"])["value"].mean().rename(metric))
    df = pd.concat(rows, axis=1).reset_index() if rows and len(s) else \
        pd.DataFrame(columns=["gpu_slug", "config", "seed", *METRICS])
    ok = study.runs[study.runs["status"] == "ok"][["gpu_slug", "config", "seed", "skipped_steps", "final_loss"]]
    df = df.merge(ok, on=["gpu_slug", "config", "seed"], how="left")
    df["failed"] = df["label_dice"] < FAIL_DICE
    return _sort(df, "seed")


def tissue_dice(study: Study) -> pd.DataFrame:
    """Per (GPU, configuration, tissue): mean label_dice over seeds and its standard deviation between seeds."""
    s = study.samples[(study.samples["metric"] == "label_dice") & (study.samples["tissue"] != "mean")]
    seeds = s.groupby(["gpu_slug", "config", "tissue", "seed"])["value"].mean().reset_index()
    out = seeds.groupby(["gpu_slug", "config", "tissue"])["value"].agg(["mean", "std", "count"]).reset_index()
    return _sort(out, "tissue")


def comparison(study: Study) -> pd.DataFrame:
    """Per (GPU, configuration): seeds, failed runs, each metric's mean over seeds and standard deviation between
    seeds, and against the GPU's reference configuration: the difference, the spread it must exceed, and a
    verdict per metric (label_dice and hist_w1; MS-SSIM measures diversity, which has no better direction)."""
    ps = per_seed(study)
    rows = []
    for slug, g in ps.groupby("gpu_slug"):
        trained = g[g["config"] != store.REAL]
        ref = reference_config(trained["config"])
        stats = {c: d for c, d in g.groupby("config")}
        for config in [c for c in config_order(g["config"]) if c in stats]:
            d = stats[config]
            row = {"gpu_slug": slug, "config": config, "reference": ref, "seeds": len(d),
                   "failed": int(d["failed"].sum()) if config != store.REAL else 0,
                   "skipped_steps": d["skipped_steps"].sum(min_count=1)}
            for metric, (_, _, higher) in METRICS.items():
                row[metric] = d[metric].mean()
                row[f"{metric}_sd"] = d[metric].std() if len(d) > 1 else np.nan
            if config != store.REAL and ref is not None:
                r = stats[ref]
                for metric in ("label_dice", "hist_w1"):
                    higher = METRICS[metric][2]
                    diff = row[metric] - r[metric].mean()
                    spread = np.nanmax([row[f"{metric}_sd"], r[metric].std() if len(r) > 1 else np.nan]) \
                        if len(d) > 1 or len(r) > 1 else np.nan
                    row[f"{metric}_diff"], row[f"{metric}_spread"] = diff, spread
                    if config == ref:
                        verdict = "reference"
                    elif len(d) < 2 or len(r) < 2 or np.isnan(spread):
                        verdict = ONE_SEED
                    elif abs(diff) <= spread:
                        verdict = WITHIN
                    else:
                        verdict = GAINS if (diff > 0) == higher else LOSES
                    row[f"{metric}_verdict"] = verdict
            rows.append(row)
    cols = ["gpu_slug", "config", "reference", "seeds", "failed", "skipped_steps"] + \
        [f"{m}{x}" for m in METRICS for x in ("", "_sd")] + \
        [f"{m}_{x}" for m in ("label_dice", "hist_w1") for x in ("diff", "spread", "verdict")]
    return pd.DataFrame(rows).reindex(columns=cols)


def verdict_text(comp: pd.DataFrame, slug: str, step_ms: dict | None = None) -> str:
    """The page's verdict for one GPU, in sentences computed from `comparison` (Markdown)."""
    g = comp[(comp["gpu_slug"] == slug) & (comp["config"] != store.REAL)]
    if g.empty:
        return f"No finished run on `{slug}` yet."
    ref = g["reference"].iloc[0]
    r = g[g["config"] == ref].iloc[0]
    out = [f"Reference: `{ref}`, mean label_dice {r.label_dice:.3f}"
           + (f" (± {r.label_dice_sd:.3f} between {r.seeds} seeds)" if r.seeds > 1 else " (one seed)") + "."]
    real = comp[(comp["gpu_slug"] == slug) & (comp["config"] == store.REAL)]
    if len(real):
        out.append(f"The held-out subjects' real images score {real['label_dice'].iloc[0]:.3f}.")
    losers, within, better, unsure = [], [], [], []
    for row in g[g["config"] != ref].itertuples():
        verdicts = {m: getattr(row, f"{m}_verdict") for m in ("label_dice", "hist_w1")}
        desc = (f"`{row.config}` ({row.label_dice:.3f}, {row.label_dice_diff:+.3f} against a spread of "
                f"{row.label_dice_spread:.3f}" if not np.isnan(row.label_dice_spread) else
                f"`{row.config}` ({row.label_dice:.3f}, {row.label_dice_diff:+.3f}")
        desc += f"; hist_w1 {row.hist_w1_diff:+.3f})" if not np.isnan(row.hist_w1_diff) else ")"
        if LOSES in verdicts.values():
            what = " and ".join(m for m, v in verdicts.items() if v == LOSES)
            losers.append(f"{desc} on {what}")
        elif ONE_SEED in verdicts.values():
            unsure.append(desc)
        elif GAINS in verdicts.values():
            better.append(desc)
        else:
            within.append(desc)
    if losers:
        out.append("**Loses quality** beyond the spread between seeds: " + "; ".join(losers) + ".")
    if within:
        out.append("Within the spread between seeds (no difference to tell): " + "; ".join(within) + ".")
    if better:
        out.append("Better than the reference beyond the spread: " + "; ".join(better) + ".")
    if unsure:
        out.append("Too few seeds to weigh (a spread needs two): " + "; ".join(unsure) + ".")
    failed = g[g["failed"] > 0]
    if len(failed):
        out.append(f"Runs whose samples' mean label_dice is below {FAIL_DICE}: " +
                   ", ".join(f"`{r.config}` {int(r.failed)} of {int(r.seeds)}" for r in failed.itertuples()) + ".")
    else:
        out.append(f"No run's samples fall below a mean label_dice of {FAIL_DICE}.")
    if step_ms:
        timed = g[g["config"].isin(step_ms)]
        if len(timed):
            fastest = min(timed["config"], key=lambda c: step_ms[c])
            f = g[g["config"] == fastest].iloc[0]
            gap = f.label_dice - r.label_dice
            near = "within" if gap >= -NEAR_DICE else "not within"
            out.append(f"The fastest configuration measured on this device, `{fastest}` ({step_ms[fastest]:.1f} ms a "
                       f"micro-step in its main run), is {near} {NEAR_DICE} of the reference's mean label_dice "
                       f"({gap:+.3f}).")
    if r.label_dice < 0.7:
        out.append(f"The reference's mean label_dice is below 0.7: at this length of training its samples have not "
                   "learned the tissue contrast well, so every comparison here is between weak models.")
    return " ".join(out)


def scores_table(comp: pd.DataFrame) -> pd.DataFrame:
    """`comparison` for a reader: each score as 'mean ± spread between seeds', each difference from the reference
    with the spread it is weighed against and its verdict."""
    def pm(mean, sd, digits=3):
        if pd.isna(mean):
            return "-"
        return f"{mean:.{digits}f}" + ("" if pd.isna(sd) else f" ± {sd:.{digits}f}")

    def against(row, metric):
        diff, spread, verdict = (row.get(f"{metric}_{x}") for x in ("diff", "spread", "verdict"))
        if not isinstance(verdict, str) or verdict == "reference":
            return verdict if isinstance(verdict, str) else ""
        return f"{diff:+.3f}" + ("" if pd.isna(spread) else f" (spread {spread:.3f})") + f": {verdict}"

    rows = []
    for _, r in comp.iterrows():
        rows.append({"device": r["gpu_slug"], "configuration": r["config"], "seeds": int(r["seeds"]),
                     "failed runs": int(r["failed"]),
                     "skipped steps": "-" if pd.isna(r["skipped_steps"]) else f"{int(r['skipped_steps']):,}",
                     "label_dice": pm(r["label_dice"], r["label_dice_sd"]), "label_dice vs reference": against(r, "label_dice"),
                     "hist_w1": pm(r["hist_w1"], r["hist_w1_sd"]), "hist_w1 vs reference": against(r, "hist_w1"),
                     "ms_ssim": pm(r["ms_ssim"], r["ms_ssim_sd"])})
    return pd.DataFrame(rows)


def tissue_table(study: Study) -> pd.DataFrame:
    """Mean label_dice per tissue and configuration (over seeds), in the book's configuration order."""
    t = tissue_dice(study)
    if t.empty:
        return pd.DataFrame(columns=["device", "configuration", "CSF", "GM", "WM"])
    wide = t.pivot_table(index=["gpu_slug", "config"], columns="tissue", values="mean").reset_index()
    wide = _sort(wide).rename(columns={"gpu_slug": "device", "config": "configuration", "csf": "CSF", "gm": "GM",
                                       "wm": "WM"})
    return wide[["device", "configuration"] + [c for c in ("CSF", "GM", "WM") if c in wide]]


def loss_curves_binned(study: Study, points: int = 100) -> pd.DataFrame:
    """The loss of every run averaged over `points` windows of its steps (a chart of every step would carry
    tens of thousands of points)."""
    df = study.losses
    if df.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "seed", "step", "loss"])
    last = df.groupby(["gpu_slug", "config", "seed"])["step"].transform("max")
    width = np.maximum(1, np.ceil(last / points))
    binned = df.assign(bin=((df["step"] - 1) // width).astype(int))
    out = binned.groupby(["gpu_slug", "config", "seed", "bin"]).agg(step=("step", "max"), loss=("loss", "mean"))
    return out.reset_index().drop(columns="bin")


# ------------------------------------------------------------------------------------------- figures


def loss_chart(study: Study):
    """Training loss of every run, averaged over windows of steps; a line per seed, a colour per configuration;
    GPU dropdown, legend picks configurations."""
    from medddpm.report import charts
    import altair as alt

    df = charts._light(loss_curves_binned(study), 5)
    if df.empty:
        return charts._empty("no convergence study in the data (python -m medddpm study)")
    gpu = charts._gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_line(strokeWidth=1.2).encode(
        x=alt.X("step:Q", title="optimizer step"),
        y=alt.Y("loss:Q", scale=alt.Scale(type="log"), title="L1 loss (window mean, log scale)"),
        color=alt.Color("config:N", scale=charts.config_color(df["config"]), legend=charts._config_legend(df)),
        detail="seed:N",
        opacity=alt.condition(pick, alt.value(0.9), alt.value(0.08)),
        tooltip=["config:N", "seed:N", alt.Tooltip("step:Q", title="up to step"),
                 alt.Tooltip("loss:Q", format=".4f")],
    ).add_params(gpu, pick).properties(width="container", height=300,
                                       title="Training loss, one line per seed")


def metrics_chart(study: Study):
    """Each seed's mean score (points) and the mean over seeds (tick) per configuration, the real images' score
    as a grey rule; GPU dropdown, metric radio buttons."""
    from medddpm.report import charts
    import altair as alt

    ps = per_seed(study)
    if ps.empty:
        return charts._empty("no convergence study in the data (python -m medddpm study)")
    labels = {m: METRICS[m][1].split(" (")[0] for m in METRICS}
    long = charts._light(ps.melt(id_vars=["gpu_slug", "config", "seed"], value_vars=list(METRICS),
                                 var_name="metric", value_name="value").dropna(subset=["value"]))
    long["what"] = long["metric"].map(labels)
    real = long[long["config"] == store.REAL]
    trained = long[long["config"] != store.REAL]
    gpu = charts._gpu_param(long)
    metric = charts._metric_param({m: m for m in METRICS})
    order = [c for c in config_order(trained["config"]) if c in set(trained["config"])]
    base = alt.Chart(trained).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric))
    y = alt.Y("config:N", sort=order, title=None)
    color = alt.Color("config:N", scale=charts.config_color(trained["config"]), legend=None)
    points = base.mark_circle(size=70, opacity=0.8).encode(
        x=alt.X("value:Q", scale=alt.Scale(zero=False), title="score (choose the metric below)"), y=y, color=color,
        tooltip=["config:N", "seed:N", "what:N", alt.Tooltip("value:Q", format=".3f")])
    means = base.mark_tick(thickness=3, size=22, color="#333").encode(
        x="mean(value):Q", y=y, tooltip=["config:N", "what:N", alt.Tooltip("mean(value):Q", title="mean over seeds",
                                                                           format=".3f")])
    layers = [points, means]
    if len(real):
        layers.append(alt.Chart(real).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric))
                      .mark_rule(color="#888", strokeDash=[4, 3]).encode(
                          x="mean(value):Q", tooltip=[alt.Tooltip("mean(value):Q", title="real images", format=".3f")]))
    return alt.layer(*layers).add_params(gpu, metric).properties(
        width="container", height=max(120, 34 * len(order)),
        title="Sample scores by seed")


# ------------------------------------------------------------------------------------------- gallery


ROW = '<div style="display:flex;flex-wrap:wrap;align-items:flex-end;gap:8px;margin-bottom:10px">'
LABEL = '<div style="width:7em;font-weight:bold;align-self:center">{}</div>'


def _img(path: Path, alt_text: str, *, title: str = "") -> str:
    if not path.is_file():
        return f'<span class="medddpm-missing">{html.escape(title or alt_text)}: no image</span>'
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure style="margin:0;text-align:center">'
            f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt_text, quote=True)}" '
            f'style="width:200px;image-rendering:pixelated"/>'
            f'<figcaption style="font-size:0.8em">{html.escape(title)}</figcaption></figure>')


def gallery(study: Study, slug: str, *, seeds: int | None = None) -> str:
    """HTML: per held-out label map, the map and the real image, then each configuration's first sample of it
    from each seed; every image the middle axial, coronal and sagittal slices, with alt text saying what it is."""
    if slug not in study.folders:
        return ""
    slices = study.folders[slug] / store.SLICES
    runs = study.runs[(study.runs["gpu_slug"] == slug) & (study.runs["status"] == "ok")]
    samples = study.samples[(study.samples["gpu_slug"] == slug) & (study.samples["metric"] == "label_dice")
                            & (study.samples["tissue"] == "mean")]
    if runs.empty:
        return ""
    maps = json.loads(runs["label_maps"].iloc[0])
    parts = []
    views = "middle axial, coronal and sagittal slices"
    for i, source in enumerate(maps):
        parts.append(f"<p><b>Label map {html.escape(source)}</b></p>" + ROW + LABEL.format("conditioning"))
        parts.append(_img(slices / store.slice_file("label", i),
                          f"Label map {source}, {views}: CSF blue, grey matter grey, white matter white",
                          title=f"label map {source}"))
        parts.append(_img(slices / store.slice_file("real", i), f"The real T1 image of subject {source}, {views}",
                          title="real image"))
        parts.append("</div>")
        for config in [c for c in config_order(runs["config"]) if c in set(runs["config"])]:
            row = [ROW + LABEL.format(html.escape(config))]
            for seed in sorted(runs.loc[runs["config"] == config, "seed"])[:seeds]:
                mine = samples[(samples["config"] == config) & (samples["seed"] == seed)
                               & (samples["label_map"] == source)]
                if mine.empty:
                    continue
                k = int(mine["sample"].min())
                dice = float(mine.loc[mine["sample"] == k, "value"].iloc[0])
                row.append(_img(slices / store.slice_file("sample", config, seed, k),
                                f"A T1 image generated by the {config} model trained from seed {seed} for label map "
                                f"{source}, {views}; label_dice {dice:.2f}",
                                title=f"seed {seed}: label_dice {dice:.2f}"))
            parts.append("".join(row) + "</div>")
    return "\n".join(parts)
