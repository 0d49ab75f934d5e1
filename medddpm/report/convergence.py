"""The convergence page: does a faster configuration train as good a model? (`python -m medddpm study`)

Reads ``data/<gpu-slug>/convergence/`` (`medddpm.store.convergence`), summarises the runs per configuration,
compares configurations seed by seed (`COMPARISONS`: runs of one seed share their initial weights, data order and
noise, so their difference is the configurations' alone) with an equivalence test against a stated margin per
score (`MARGINS`, `medddpm.report.equivalence`), and draws the page's figures (Altair) and its sample gallery
(small PNGs inlined, each with alt text). A run fails when its loss went non-finite or its samples' mean
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

from medddpm.report import equivalence
from medddpm.store import convergence as store
from medddpm.store import schema
from medddpm.store.layout import CONVERGENCE_DIR, CONVERGENCE_TABLES, SLICES_DIR
from medddpm.report.loading import DataError, _sort, config_order, data_root, labels
from medddpm.report.safe import code, md

FAIL_DICE = 0.6  # a run whose samples' mean label_dice is below this drew tissue in the wrong places
METRICS = {  # metric -> (tissue of its summary row, what a reader is told, higher is better)
    "label_dice": ("mean", "tissue agreement with the label map (label_dice, mean of CSF, GM, WM)", True),
    "hist_w1": ("mean", "intensity distance to the real images (hist_w1, mean over tissues)", False),
    # two samples of one label map alike: a model collapsing towards one volume whatever its noise
    "ms_ssim": ("brain", "likeness of two samples of one label map (MS-SSIM; higher: less varied)", False),
}
# Each seed's runs share initial weights, data order and noise: the configurations are compared seed by seed.
COMPARISONS = (("opt1", "baseline"), ("best", "opt1"), ("bf16", "opt1"), ("fp16", "opt1"), ("fp16", "bf16"))
# The smallest paired difference that matters (`equivalence.judge`):
MARGINS = {
    # a twentieth of the score's [0, 1] scale; real subjects' own scores lie within about 0.02 of each other
    "label_dice": 0.05,
    # in the images' [-1, 1] units: a seventh of the gap between the grey- and white-matter medians of the
    # embedded data (0.31 and 0.67), and under the spread of real subjects' own hist_w1 (0.04 to 0.12), whose
    # intensity augmentation already moves them that far
    "hist_w1": 0.05,
    # a twentieth of its [0, 1] scale, as label_dice's; two unrelated real subjects score about 0.75
    "ms_ssim": 0.05,
}
PAIRED_COLUMNS = ["gpu_slug", "candidate", "reference", "metric", "seeds", "mean", "sd", "low", "high", "margin",
                  "verdict", "seeds_needed", "differences"]


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
    frames = {t: [] for t in CONVERGENCE_TABLES}
    folders = {}
    for folder in (gpu / CONVERGENCE_DIR for gpu in labels(root) if (gpu / CONVERGENCE_DIR).is_dir()):
        slug = folder.parent.name
        if not os.path.lexists(folder / "runs.parquet"):  # one that is there is read, or refused naming what it is
            if any(folder.glob("*.parquet")):
                raise DataError(f"incomplete study {folder}: parquet files but no runs.parquet")
            continue
        try:
            tables = {t: store.read(folder, t) for t in CONVERGENCE_TABLES}
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
                     "denoising steps per sample": str(first["sample_steps"]),
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


def scores(study: Study) -> pd.DataFrame:
    """Per (GPU, configuration): seeds scored, failed runs (`failures`), fp16's skipped steps, and each metric's mean
    over seeds with its standard deviation between seeds (the held-out subjects' real images as 'real')."""
    ps = per_seed(study)
    failed = failures(study)
    rows = []
    for (slug, config), d in ps.groupby(["gpu_slug", "config"]):
        row = {"gpu_slug": slug, "config": config, "seeds": len(d),
               "failed": 0 if config == store.REAL else int(failed.get((slug, config), pd.Series(dtype=bool)).sum()),
               "skipped_steps": d["skipped_steps"].sum(min_count=1)}
        for metric in METRICS:
            row[metric] = d[metric].mean()
            row[f"{metric}_sd"] = d[metric].std() if len(d) > 1 else np.nan
        rows.append(row)
    cols = ["gpu_slug", "config", "seeds", "failed", "skipped_steps"] + [f"{m}{x}" for m in METRICS for x in ("", "_sd")]
    return _sort(pd.DataFrame(rows, columns=cols)) if rows else pd.DataFrame(columns=cols)


def failures(study: Study) -> dict:
    """(GPU, configuration) -> a boolean Series by seed: whether that run failed. A run fails when its loss went
    non-finite (status diverged) or its samples' mean label_dice is below `FAIL_DICE`; a run that ended in an
    error is a fault of the machine, not a result, and is left out."""
    runs = study.runs[study.runs["status"].isin(store.DONE)]
    ps = per_seed(study).set_index(["gpu_slug", "config", "seed"])["label_dice"]
    out = {}
    for (slug, config), r in runs.groupby(["gpu_slug", "config"]):
        dice = [ps.get((slug, config, seed), np.nan) for seed in r["seed"]]
        out[(slug, config)] = pd.Series([status == "diverged" or (not np.isnan(d) and d < FAIL_DICE)
                                         for status, d in zip(r["status"], dice)], index=r["seed"].to_numpy())
    return out


def paired(study: Study, comparisons=COMPARISONS) -> pd.DataFrame:
    """Per (GPU, comparison, metric): the seed-by-seed differences candidate minus reference over the seeds where
    both runs were scored, their mean with its `equivalence.CONFIDENCE` t-interval, the margin, the verdict
    (`equivalence.judge`) and the seeds an undecided one would need."""
    ps = per_seed(study)
    rows = []
    for slug, g in ps.groupby("gpu_slug"):
        for cand, ref in comparisons:
            a, b = (g[g["config"] == c].set_index("seed") for c in (cand, ref))
            if a.empty or b.empty:
                continue
            seeds = sorted(set(a.index) & set(b.index))
            for metric, (_, _, higher) in METRICS.items():
                diffs = (a.loc[seeds, metric] - b.loc[seeds, metric]).to_numpy()
                j = equivalence.judge(diffs, MARGINS[metric], higher_is_better=higher)
                rows.append({"gpu_slug": slug, "candidate": cand, "reference": ref, "metric": metric,
                             "seeds": j.n, "mean": j.mean, "sd": j.sd, "low": j.low, "high": j.high,
                             "margin": j.margin, "verdict": j.verdict, "seeds_needed": j.seeds_needed,
                             "differences": json.dumps([round(float(x), 6) for x in diffs])})
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS)


def verdicts(study: Study, comparisons=COMPARISONS) -> pd.DataFrame:
    """Per (GPU, comparison): one verdict from its metrics' and its failed runs'. Worse when a metric is worse or
    the candidate failed on more seeds than the reference; undecided when a metric is; better when one is better
    and none worse or undecided; equivalent when every metric is."""
    p = paired(study, comparisons)
    failed = failures(study)
    rows = []
    for (slug, cand, ref), g in p.groupby(["gpu_slug", "candidate", "reference"], sort=False):
        fa, fb = (failed.get((slug, c), pd.Series(dtype=bool)) for c in (cand, ref))
        both = sorted(set(fa.index) & set(fb.index))
        more_failed = int(fa.loc[both].sum()) > int(fb.loc[both].sum())
        by = dict(zip(g["metric"], g["verdict"]))
        if more_failed or equivalence.WORSE in by.values():
            verdict = equivalence.WORSE
        elif equivalence.UNDECIDED in by.values():
            verdict = equivalence.UNDECIDED
        elif equivalence.BETTER in by.values():
            verdict = equivalence.BETTER
        else:
            verdict = equivalence.EQUIVALENT
        rows.append({"gpu_slug": slug, "candidate": cand, "reference": ref, "verdict": verdict,
                     "seeds": int(g["seeds"].min()), "candidate_failed": int(fa.loc[both].sum()),
                     "reference_failed": int(fb.loc[both].sum()), **{f"{m}_verdict": v for m, v in by.items()}})
    return pd.DataFrame(rows, columns=["gpu_slug", "candidate", "reference", "verdict", "seeds", "candidate_failed",
                                       "reference_failed", *(f"{m}_verdict" for m in METRICS)])


def _interval(row) -> str:
    if pd.isna(row["low"]):
        return f"{row['mean']:+.3f} (one seed: no interval)" if not pd.isna(row["mean"]) else "no pair"
    return f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def verdict_text(study: Study, slug: str, step_ms: dict | None = None) -> str:
    """The page's verdict for one GPU, in sentences computed from `verdicts` and `paired` (Markdown)."""
    sc = scores(study)
    sc = sc[sc["gpu_slug"] == slug]
    trained = sc[sc["config"] != store.REAL]
    if trained.empty:
        return f"No finished run on {code(slug)} yet."
    v = verdicts(study)
    v = v[v["gpu_slug"] == slug]
    p = paired(study)
    p = p[p["gpu_slug"] == slug].set_index(["candidate", "reference", "metric"])
    out = []
    real = sc[sc["config"] == store.REAL]
    if len(real):
        ceiling = float(real["label_dice"].iloc[0])
        best = trained.loc[trained["label_dice"].idxmax()]
        out.append(f"The held-out subjects' real images score a mean label_dice of {ceiling:.3f}; the trained models "
                   f"reach {trained['label_dice'].min():.3f} to {trained['label_dice'].max():.3f} (mean over seeds; "
                   f"{code(best['config'])} highest, {best['label_dice'] - ceiling:+.3f} from the real images).")
    for r in v.itertuples():
        d = p.loc[(r.candidate, r.reference, "label_dice")]
        what = {equivalence.EQUIVALENT: "is **equivalent** to", equivalence.BETTER: "is **better** than",
                equivalence.WORSE: "is **worse** than", equivalence.UNDECIDED: "is **undecided** against"}[r.verdict]
        line = (f"{code(r.candidate)} {what} {code(r.reference)} over {r.seeds} paired seeds: label_dice "
                f"{_interval(d)} (margin ±{d['margin']:g})")
        others = [f"{m} {p.loc[(r.candidate, r.reference, m), 'verdict']}" for m in METRICS if m != "label_dice"]
        line += "; " + ", ".join(others)
        if r.candidate_failed or r.reference_failed:
            line += f"; failed runs {r.candidate_failed} against {r.reference_failed}"
        undecided = [(m, p.loc[(r.candidate, r.reference, m), "seeds_needed"]) for m in METRICS
                     if p.loc[(r.candidate, r.reference, m), "verdict"] == equivalence.UNDECIDED]
        if undecided:
            line += " (" + ", ".join(f"{m}: {'about ' + str(int(n)) + ' seeds would decide' if pd.notna(n) else 'no number of seeds would decide at this spread'}"
                                     for m, n in undecided) + ")"
        out.append(line + ".")
    failed = trained[trained["failed"] > 0]
    if len(failed):
        out.append(f"Failed runs (diverged, or samples' mean label_dice below {FAIL_DICE}): " +
                   ", ".join(f"{code(r.config)} {int(r.failed)} of {int(r.seeds)}" for r in failed.itertuples()) + ".")
    else:
        out.append(f"No run diverged, and none's samples fall below a mean label_dice of {FAIL_DICE}.")
    if step_ms:
        timed = [c for c in trained["config"] if c in step_ms]
        if timed:
            fastest = min(timed, key=lambda c: step_ms[c])
            mine = v[v["candidate"] == fastest]
            said = (f"judged {mine['verdict'].iloc[0]} against {code(mine['reference'].iloc[0])} above" if len(mine)
                    else "not paired with another configuration here")
            out.append(f"The fastest configuration measured on this device is {code(fastest)} "
                       f"({step_ms[fastest]:.1f} ms a micro-step in its main run): {said}.")
    return " ".join(out)


def headline_text(study: Study) -> str:
    """Per GPU, one line of every comparison's verdict with its label_dice interval (Markdown): the first page's
    summary of the convergence study."""
    v, p = verdicts(study), paired(study)
    if v.empty:
        return ""
    p = p[p["metric"] == "label_dice"].set_index(["gpu_slug", "candidate", "reference"])
    lines = []
    for slug, g in v.groupby("gpu_slug"):
        parts = [f"{code(r.candidate)} against {code(r.reference)} **{r.verdict}** (label_dice "
                 f"{_interval(p.loc[(slug, r.candidate, r.reference)])}, {r.seeds} seeds)" for r in g.itertuples()]
        lines.append(f"- **{md(slug)}**: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def scores_table(sc: pd.DataFrame) -> pd.DataFrame:
    """`scores` for a reader: each score as 'mean ± standard deviation between seeds'."""
    def pm(mean, sd, digits=3):
        if pd.isna(mean):
            return "-"
        return f"{mean:.{digits}f}" + ("" if pd.isna(sd) else f" ± {sd:.{digits}f}")

    rows = []
    for _, r in sc.iterrows():
        rows.append({"device": r["gpu_slug"], "configuration": r["config"], "seeds": int(r["seeds"]),
                     "failed runs": int(r["failed"]),
                     "skipped steps": "-" if pd.isna(r["skipped_steps"]) else f"{int(r['skipped_steps']):,}",
                     **{m: pm(r[m], r[f"{m}_sd"]) for m in METRICS}})
    return pd.DataFrame(rows)


def paired_table(p: pd.DataFrame) -> pd.DataFrame:
    """`paired` for a reader: per comparison and metric, the mean difference with its interval, the margin, the
    verdict and, when undecided, the seeds that would decide it."""
    rows = []
    for _, r in p.iterrows():
        need = "" if r["verdict"] != equivalence.UNDECIDED else (
            f"about {int(r['seeds_needed'])}" if pd.notna(r["seeds_needed"]) else "none at this spread")
        rows.append({"device": r["gpu_slug"], "comparison": f"{r['candidate']} − {r['reference']}",
                     "score": r["metric"], "seeds": int(r["seeds"]),
                     f"mean difference [{equivalence.CONFIDENCE:.0%} interval]": _interval(r),
                     "margin": f"±{r['margin']:g}", "verdict": r["verdict"], "seeds to decide": need})
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


def loss_bands(study: Study, points: int = 100) -> pd.DataFrame:
    """Per (GPU, configuration, window of steps): the median, lowest and highest window-mean loss over seeds."""
    b = loss_curves_binned(study, points)
    if b.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "step", "median", "low", "high", "seeds"])
    out = b.groupby(["gpu_slug", "config", "step"])["loss"].agg(median="median", low="min", high="max", seeds="count")
    return out.reset_index()


# ------------------------------------------------------------------------------------------- figures


def loss_chart(study: Study):
    """`charts.study_losses` of this study."""
    from medddpm.report import charts

    return charts.study_losses(loss_bands(study))


def metrics_chart(study: Study):
    """`charts.study_scores` of this study: each seed's scores, the real images' as a rule."""
    from medddpm.report import charts

    return charts.study_scores(per_seed(study), {m: METRICS[m][1].split(" (")[0] for m in METRICS}, store.REAL)


def paired_chart(study: Study):
    """`charts.paired_differences` of this study's `paired` comparisons."""
    from medddpm.report import charts

    return charts.paired_differences(paired(study), {m: METRICS[m][1].split(" (")[0] for m in METRICS})


# ------------------------------------------------------------------------------------------ the page

MARGIN_REASONS = {
    "label_dice": "A twentieth of the score's scale; real subjects' own scores lie within about 0.02 of each other.",
    "hist_w1": "In the images' [-1, 1] units: a seventh of the gap between the grey- and white-matter medians of the "
               "embedded data, and less than real subjects' own intensity distances to the training images.",
    "ms_ssim": "A twentieth of its scale, as for label_dice; a higher MS-SSIM means two samples of one map are more "
               "alike, a model collapsing towards one volume, so higher counts as worse.",
}


def margins_text() -> str:
    """Each score's equivalence margin with the reason it was set there."""
    return "\n".join(f"- **{m}**: ±{MARGINS[m]:g}. {why}" for m, why in MARGIN_REASONS.items())


def check_study(study: Study) -> None:
    """A study's runs have known statuses, its scores lie in their ranges, a finished run skipped no negative number
    of steps and sampled, and every decided comparison's mean lies in its interval."""
    if study.empty:
        return
    assert set(study.runs["status"]) <= {"ok", "diverged", "error"}, study.runs["status"].unique()
    ps = per_seed(study)
    assert ps["label_dice"].dropna().between(0, 1).all() and (ps["hist_w1"].dropna() >= 0).all(), ps
    assert ps["ms_ssim"].dropna().between(0, 1).all(), ps
    ok = study.runs[study.runs["status"] == "ok"]
    assert (ok["skipped_steps"] >= 0).all() and (ok["sample_steps"] > 0).all(), ok
    decided = paired(study).dropna(subset=["low"])
    assert ((decided["low"] <= decided["mean"]) & (decided["mean"] <= decided["high"])).all(), decided


def status_text(study: Study, run: pd.DataFrame) -> str:
    """Whether the study has run, on which devices, and which measured GPUs still lack one."""
    missing = gpus_without_study(study, run)
    where = " or ".join(code(g) for g in missing) or "any device"
    lines = []
    if study.empty:
        lines.append(f"**The study has not been run on {where} yet**: there is no `data/<gpu>/convergence/` folder "
                     "in the data, so this page has no loss curves, scores or samples to show. "
                     "`python -m medddpm study` runs it (see [Reproduce](reproduce.md)).")
    else:
        if missing:
            lines.append(f"**The study has not been run on {where} yet**: the other pages measure it, but no "
                         "convergence study is in the data for it.")
        shown = ", ".join(code(g) for g in study.gpus)
        lines.append(f"Studies in the data: {shown}." + (" A `cpu` study is a smoke run at a tiny size and a few "
                                                         "steps: its scores say nothing about quality."
                                                         if "cpu" in study.gpus else ""))
    return "\n\n".join(lines)


def unfinished_text(study: Study) -> str:
    """The study's runs that did not finish, with why ("" when all did)."""
    failed = study.runs[study.runs["status"] != "ok"]
    if failed.empty:
        return ""
    return "Runs that did not finish: " + "; ".join(
        f"{code(f'{r.gpu_slug}/{r.config}')} seed {r.seed}: {md(r.message)}" for r in failed.itertuples()) + "."


def verdicts_text(study: Study, run: pd.DataFrame) -> str:
    """`verdict_text` of every GPU that ran the study, each with its configurations' main-run step times."""
    ok = run[run["status"] == "ok"]
    texts = [f"**{md(slug)}.** " + verdict_text(study, slug, ok[ok["gpu_slug"] == slug].set_index("config")[
        "train_median_ms"].dropna().to_dict()) for slug in study.gpus]
    return "\n\n".join(texts) if texts else "No verdict: the study has not been run."


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
    slices = study.folders[slug] / SLICES_DIR
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
