"""The beyond-the-paper page: what each lever of `best` buys (the ablation) and how busy the GPU is kept."""

from __future__ import annotations

import math

import pandas as pd

from medddpm.analysis.roofs import COMPUTE
from medddpm.configs import CONFIGS, PAPER, ablation
from medddpm.report.loading import Data, _sort
from medddpm.report.roofs import step_efficiency
from medddpm.report.safe import code, md
from medddpm.report.step_time import device_label
from medddpm.report.tables import cpu_rows, gpus_first

ABLATION_VERDICTS = ("buys", "not told apart", "costs", "failed")


def ablation_summary(ablation: pd.DataFrame, run: pd.DataFrame | None = None, base: str = "best") -> pd.DataFrame:
    """Per GPU and model, what each lever of `base` buys: the ablation's `base` and each `base+<switch>=<value>`
    (`configs.ablation`), with `saved_ms` = that variant's median step minus `base`'s. The noise a lever must beat
    is `noise`: the larger of the two runs' p10-p90 spreads relative to their medians and, where the main runs
    hold `base` on the same GPU and model (`run`), how far that run and the ablation's lie apart. `verdict`: "buys"
    when the variant is slower by more than the noise, "costs" when faster by more, "not told apart" otherwise,
    "failed" when the variant did not finish its timed steps."""
    cols = ["gpu_slug", "preset", "shape", "lever", "config", "status", "message", "base_ms", "train_median_ms",
            "train_p10_ms", "train_p90_ms", "saved_ms", "ratio", "noise", "rerun", "verdict"]
    rows = []
    for (slug, preset, shape), g in ablation[ablation["batch"] == 1].groupby(["gpu_slug", "preset", "shape"]):
        b = g[(g["config"] == base) & (g["status"] == "ok")]
        if b.empty:
            continue
        b = b.iloc[0]
        rerun = math.nan
        if run is not None:
            main = run[(run["gpu_slug"] == slug) & (run["config"] == base) & (run["preset"] == preset)
                       & (run["shape"] == shape) & (run["batch"] == 1) & (run["status"] == "ok")]
            if len(main):
                ms = sorted([main["train_median_ms"].iloc[0], b["train_median_ms"]])
                rerun = ms[1] / ms[0] - 1
        for v in g[g["config"].str.startswith(base + "+")].itertuples():
            ok = v.train_median_ms > 0
            ratio = v.train_median_ms / b["train_median_ms"] if ok else math.nan
            spread = max((r.train_p90_ms - r.train_p10_ms) / r.train_median_ms for r in (b, v)) if ok else math.nan
            noise = max(spread, rerun) if not math.isnan(rerun) else spread
            verdict = ("failed" if not ok else "buys" if ratio - 1 > noise else "costs" if 1 / ratio - 1 > noise
                       else "not told apart")
            rows.append({"gpu_slug": slug, "preset": preset, "shape": shape, "lever": v.config[len(base) + 1:],
                         "config": v.config, "status": v.status, "message": v.message, "base_ms": b["train_median_ms"],
                         "train_median_ms": v.train_median_ms if ok else math.nan,
                         "train_p10_ms": v.train_p10_ms if ok else math.nan,
                         "train_p90_ms": v.train_p90_ms if ok else math.nan,
                         "saved_ms": v.train_median_ms - b["train_median_ms"] if ok else math.nan, "ratio": ratio,
                         "noise": noise, "rerun": rerun, "verdict": verdict})
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["gpu_slug", "preset", "saved_ms"], ascending=[True, True, False], ignore_index=True)


def gpu_busy(data: Data) -> pd.DataFrame:
    """Per finished run with a kernel table: the device time of its kernels and copies in one step
    (torch.profiler, profiled steps) beside the step's median time; `busy` is their ratio. Near 1 the
    device never waits for the host, so a CUDA graph has no launch gap to close. The host's time to
    issue a step (`dispatch_median_ms`) cannot tell that when steps run back to back: once the launch
    queue is full the host waits for the device, and issues a step in the device's time. The kernels' summed
    time can pass the step's a little (kernels that overlap count twice, and the profiled steps are not the timed
    ones); the device cannot be busy more than the whole step, so `busy` stops at 1 (`kernel_ms` keeps the sum)."""
    cols = ["gpu_slug", "device", "config", "train_median_ms", "dispatch_median_ms", "kernel_ms", "busy"]
    k = data.kernels
    ok = data.run[(data.run["status"] == "ok") & data.run["run_id"].isin(k["run_id"])].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    per_step = k.groupby("run_id")["total_us"].sum() / k.groupby("run_id")["micro_steps"].max() / 1e3
    ok["device"], ok["kernel_ms"] = device_label(ok), ok["run_id"].map(per_step)
    return _sort(ok.assign(busy=(ok["kernel_ms"] / ok["train_median_ms"]).clip(upper=1.0))[cols])


# ------------------------------------------------------------------------------------------ the page

# Each step of the ladder past the paper: (from, to, what the step adds).
LADDER = (("opt1", "bf16", "bf16 autocast over TF32"), ("bf16", "bf16-cl", "channels-last under bf16"),
          ("bf16-cl", "sdpa", "SDPA attention, fused Adam, no recompute"),
          ("sdpa", "compile", "fusion (torch.compile)"), ("sdpa", "graphs", "one CUDA graph per step"))
CHANNELS_LAST = (("baseline", "opt2"), ("opt1", "opt12"), ("bf16", "bf16-cl"))  # (plain, channels-last) pairs


def _cpu_note(slug: str, cpus: set[str]) -> str:
    return " (CPU smoke runs)" if slug in cpus else ""


def beyond_paper() -> pd.DataFrame:
    """The configurations past the paper's four, with what each adds."""
    return pd.DataFrame([{"configuration": c, "what it adds": CONFIGS[c].description} for c in CONFIGS
                         if c not in PAPER])


FLOOR_COLUMNS_ALL = ["gpu_slug", "precision", "roof", "peak_tflops", "source", "basis", "floor_ms", "best_config",
                     "best_ms", "fraction_of_peak", "timing_source"]


def floors(data: Data) -> pd.DataFrame:
    """Per card and precision with a roof for it: the shortest micro-step the roof allows (the step's FLOPs over
    the roof) beside the fastest configuration that ran in that precision. Its share, floor over fastest, is that
    configuration's efficiency as `roofs.step_efficiency` gives it to every page (the roof on the book's basis,
    the sweep's timing, else the bench's)."""
    e = step_efficiency(data)
    if e.empty:
        return pd.DataFrame(columns=FLOOR_COLUMNS_ALL)
    best = e.loc[e.groupby(["gpu_slug", "precision"], sort=False)["train_median_ms"].idxmin()]
    out = best.assign(floor_ms=best["flops_per_step"] / (best["peak_tflops"] * 1e12) * 1e3, source=best["peak_source"],
                      best_config=best["config"], best_ms=best["train_median_ms"], fraction_of_peak=best["efficiency"],
                      timing_source=best["timing"])
    order = out["precision"].map({r: i for i, r in enumerate(COMPUTE)})
    return out.assign(_order=order).sort_values(["gpu_slug", "_order"], ignore_index=True)[FLOOR_COLUMNS_ALL]


def check_floors(floors: pd.DataFrame) -> None:
    """A floor is a share of the fastest step: the roof's time can only be shorter than a measured one."""
    assert floors["fraction_of_peak"].between(0, 1).all(), floors


def _step_times(summary: pd.DataFrame, bench: pd.DataFrame) -> dict[str, tuple[pd.Series, str]]:
    """Per device: each configuration's median micro-step and where it comes from (the sweep's, else the bench
    timings' of a GPU that has no sweep yet)."""
    out = {slug: (g.set_index("config")["train_median_ms"], f"{g['preset'].iloc[0]} {g['size'].iloc[0]}³")
           for slug, g in summary.groupby("gpu_slug", sort=False)}
    b = bench[bench["implementation"] == "ours"] if not bench.empty else bench
    for slug, g in b.groupby("gpu_slug"):
        out.setdefault(slug, (g.groupby("config")["train_median_ms"].median(), "bench timings"))
    return out


def ladder() -> tuple[tuple[str, str, str], ...]:
    """`LADDER`, with best's last step over compile: the switches where best differs from compile."""
    levers = ", ".join(f for f, v in CONFIGS["best"].flags.items() if CONFIGS["compile"].flags[f] != v)
    return (*LADDER, ("compile", "best", "on top of fusion, " + levers))


def ladder_text(summary: pd.DataFrame, bench: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: the speedup of each step of the ladder over the one before it."""
    lines = []
    for slug, (t, source) in _step_times(summary, bench).items():
        items = [f"{label} (`{a}` → `{b}`) {t[a] / t[b]:.2f}x" for a, b, label in ladder()
                 if a in t.index and b in t.index]
        if items:
            where = f"{'CPU smoke runs, ' if slug in cpus else ''}{source}"
            lines.append(f"- **{md(slug)}** ({md(where)}): " + "; ".join(items) + ".")
    return "Speedup of each step over the one before it (above 1: faster):\n\n" + "\n".join(lines)


def channels_last_text(summary: pd.DataFrame, bench: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: each channels-last configuration's time over its plain twin's."""
    times = _step_times(summary, bench)
    lines = []
    for slug in gpus_first(times):
        t = times[slug][0]
        parts = [f"`{cl}` takes {t[cl] / t[plain]:.2f}x the time of `{plain}`" for plain, cl in CHANNELS_LAST
                 if {plain, cl} <= set(t.index)]
        if parts:
            lines.append(f"- **{md(slug)}**{_cpu_note(slug, cpus)}: " + ", ".join(parts) + ".")
    return "Channels-last on its own:\n\n" + "\n".join(lines) if lines else ""


FLOOR_COLUMNS = {"gpu_slug": "device", "precision": "precision", "peak_tflops": "roof TFLOP/s", "floor_ms": "floor ms",
                 "best_config": "fastest", "best_ms": "fastest ms", "fraction_of_peak": "floor / fastest"}


def floors_table(floors: pd.DataFrame) -> pd.DataFrame:
    """`floors` as the page shows it (`FLOOR_COLUMNS`), a precision read against another roof named beside it."""
    shown = floors.assign(precision=[p if r == p else f"{p} ({r} roof)" for p, r in zip(floors["precision"],
                                                                                        floors["roof"])])
    return shown[list(FLOOR_COLUMNS)].rename(columns=FLOOR_COLUMNS)


def floors_text(floors: pd.DataFrame) -> str:
    return "\n".join(
        f"- **{md(r.gpu_slug)}**, {md(r.precision)}: against the {md(r.roof)} roof ({r.peak_tflops:.4g} TFLOP/s, "
        f"{md(r.basis)}" + (", the higher of the two the step runs in" if r.roof != r.precision else "")
        + f") the floor is {r.floor_ms:.3g} ms; the fastest {md(r.precision)} configuration, {code(r.best_config)}, "
        f"takes {r.best_ms:.3g} ms, {r.fraction_of_peak:.0%} of that roof ({md(r.timing_source)})."
        for r in floors.itertuples())


def check_ablation(abl: pd.DataFrame) -> None:
    """Verdicts are the known ones, and every finished variant's median lies in its positive p10-p90 spread."""
    assert set(abl["verdict"]) <= set(ABLATION_VERDICTS), abl
    done = abl[abl["verdict"] != "failed"]
    assert (done["train_median_ms"] > 0).all(), done
    assert ((done["train_p10_ms"] <= done["train_median_ms"]) & (done["train_median_ms"] <= done["train_p90_ms"])).all()


def ablation_text(abl: pd.DataFrame, base: str = "best") -> str:
    """Per device: how many of `base`'s levers are measured, how many save more than the noise (the largest
    named), those that cost time, and those that did not finish."""
    n_levers = len(ablation(base)) - 1  # base, then base without each lever
    lines = []
    for slug, g in abl.groupby("gpu_slug", sort=False):
        buys = g[g["verdict"] == "buys"]
        rerun = "" if g["rerun"].isna().all() else f"; the two runs of `{base}` lie {g['rerun'].iloc[0]:.1%} apart"
        lines.append(f"- **{md(slug)}** ({md(g['shape'].iloc[0])}, `{base}` {g['base_ms'].iloc[0]:.1f} ms{rerun}): "
                     f"{len(g)} of the {n_levers} levers measured so far; {len(buys)} of them save more than the noise"
                     + (f", the most {code(buys['lever'].iloc[0])} ({buys['saved_ms'].iloc[0]:.1f} ms, "
                        f"{buys['ratio'].iloc[0]:.2f}x slower without it)" if len(buys) else "") + ".")
        for r in g[g["verdict"] == "costs"].itertuples():
            lines.append(f"  - {code(r.lever)} is faster by {-r.saved_ms:.1f} ms ({1 / r.ratio:.2f}x): on this "
                         "device the lever costs time.")
        for r in g[g["verdict"] == "failed"].itertuples():
            lines.append(f"  - {code(r.lever)} did not finish ({md(r.status)}: {md(r.message)}).")
    return "\n".join(lines) if lines else "No ablation measured yet: `python -m medddpm ablation`."


def check_busy(busy: pd.DataFrame, cpus: set[str]) -> None:
    """On a GPU the kernels keep the device busy between half of the step and all of it."""
    gpus = busy[~cpu_rows(busy, cpus)]
    assert gpus["busy"].between(0.5, 1.0).all(), gpus


def busy_text(busy: pd.DataFrame, cpus: set[str]) -> str:
    """Per GPU: the range of its busy share over the configurations, and sdpa against its CUDA-graph twin."""
    lines = []
    for slug, g in busy[~cpu_rows(busy, cpus)].groupby("gpu_slug"):
        g = g.set_index("config")
        lines.append(f"- **{md(slug)}**: kernels keep the GPU busy {g['busy'].min():.1%} to {g['busy'].max():.1%} of a "
                     f"step over {len(g)} configurations (least: {code(g['busy'].idxmin())}).")
        if {"sdpa", "graphs"} <= set(g.index):
            lines.append(f"  `sdpa` is busy {g.loc['sdpa', 'busy']:.1%} of its {g.loc['sdpa', 'train_median_ms']:.4g} "
                         f"ms; captured in one graph (`graphs`), the step takes {g.loc['graphs', 'train_median_ms']:.4g}"
                         " ms.")
    return "\n".join(lines) if lines else ("No GPU run with a kernel table in the data yet; on a CPU, CUDA graphs do "
                                           "not apply.")


SAMPLING_COLUMNS = {"gpu_slug": "device", "config": "configuration", "sample_step_median_ms": "denoising step (ms)",
                    "sample_s": "full sample (s)", "sample_total_s": "first sample of a process (s)"}


def sampling(summary: pd.DataFrame, cpus: set[str]) -> pd.DataFrame:
    """The runs that timed sampling, GPUs first, each device's fastest sample first."""
    s = summary.dropna(subset=["sample_step_median_ms"])
    assert (s["sample_step_median_ms"] > 0).all() and (s["sample_s"] > 0).all(), s
    return s.assign(_cpu=cpu_rows(s, cpus)).sort_values(["_cpu", "gpu_slug", "sample_s"]).drop(columns="_cpu")


def sampling_text(s: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: the configuration that samples a volume fastest, and how much faster than strict FP32."""
    lines = []
    for slug, g in s.groupby("gpu_slug", sort=False):
        g = g.set_index("config")
        fast = g["sample_s"].idxmin()
        line = (f"- **{md(slug)}**{_cpu_note(slug, cpus)}: {code(fast)} samples a volume in "
                f"{g.loc[fast, 'sample_s']:.3g} s")
        if "baseline" in g.index and fast != "baseline":
            line += f", {g.loc['baseline', 'sample_s'] / g.loc[fast, 'sample_s']:.3g}x faster than `baseline`"
        lines.append(line + ".")
    return "\n".join(lines) if lines else "No sampling measured yet."


# ------------------------------------------------------------------- where the remaining milliseconds are
# The ranking and the lever decision are `medddpm.analysis.levers`'; here they meet the data tree.


def lever_ranking(data: Data, base: str = "best") -> pd.DataFrame:
    """Per GPU with a kernel table of `base` (main runs): its levers ranked by what each could save at most
    (`analysis.levers.rank_step`), against the card's own roofs (measured on it where they were, else its
    datasheet's), with the work counted by Nsight Compute on the GPU itself where it has counters of `base`,
    else on another GPU that has (`counters_from`)."""
    from medddpm.analysis import levers
    from medddpm.report.roofs import card_roofs

    cols = ["gpu_slug", *levers.LEVER_COLUMNS, "counters_from", "roofs"]
    runs = data.ok[(data.ok["config"] == base) & data.ok["run_id"].isin(data.kernels["run_id"])]
    counted = runs[runs["run_id"].isin(data.ncu["run_id"])]
    if runs.empty or counted.empty:
        return pd.DataFrame(columns=cols)
    source = counted.iloc[0]
    parts = []
    for r in runs.itertuples():
        own = r.run_id in set(counted["run_id"])
        src = r if own else source
        roofs = card_roofs(r.gpu_slug, data.run, data.roofs)
        if not {"dram", r.precision_used} <= set(roofs):  # a CPU, or a card of no known roofs
            continue
        card = levers.Roofs(roofs["dram"].value, roofs[r.precision_used].value,
                            " and ".join(sorted({roofs["dram"].source, roofs[r.precision_used].source})))
        _, ranked = levers.rank_step(data.kernels[data.kernels["run_id"] == r.run_id],
                                     data.kernels[data.kernels["run_id"] == src.run_id],
                                     data.ncu[data.ncu["run_id"] == src.run_id], src.gpu_type, card, r.precision_used)
        parts.append(ranked.assign(gpu_slug=r.gpu_slug, counters_from=src.gpu_slug, roofs=card.source))
    if not parts:
        return pd.DataFrame(columns=cols)
    return _sort(pd.concat(parts, ignore_index=True)[cols], "max_saving_ms")


def check_lever_ranking(ranked: pd.DataFrame) -> None:
    """A lever's time at the roof lies between 0 and its counted time; its counted and uncounted times make its
    time; the savings are what a roof leaves, never negative. No GPU ranked (none has counters of `best`) passes:
    the page says so."""
    import numpy as np

    if ranked.empty:
        return
    assert (ranked["at_roof_ms"] >= 0).all() and (ranked["at_roof_ms"] <= ranked["counted_ms"] + 1e-9).all(), ranked
    assert np.allclose(ranked["counted_ms"] + ranked["uncounted_ms"], ranked["ms"]), ranked
    assert (ranked["max_saving_ms"] >= -1e-9).all(), ranked


LEVER_RANKING_COLUMNS = {"lever": "lever", "ms": "ms a micro-step", "at_roof_ms": "at the roof (ms)",
                         "max_saving_ms": "saves at most (ms)", "of_roof": "of the roof", "binds": "roof",
                         "uncounted_ms": "no counters (ms)"}


def lever_ranking_text(ranked: pd.DataFrame) -> str:
    """Per GPU: the step's kernel time, what the roofs would leave of it, the three largest levers, and how much of
    the saving is the convolutions'."""
    lines = []
    for slug, g in ranked.groupby("gpu_slug", sort=False):
        conv = g[g["lever"].str.startswith("convolution")]["max_saving_ms"].sum()
        top = "; ".join(f"{r.lever} {r.max_saving_ms:.1f} ms" for r in g.head(3).itertuples())
        own = g["counters_from"].iloc[0] == slug
        lines.append(f"- **{md(slug)}** ({md(g['roofs'].iloc[0])} roofs; work counted on "
                     f"{'this card' if own else md(g['counters_from'].iloc[0])}): {g['ms'].sum():.1f} ms of kernels a "
                     f"micro-step, of which {g['counted_ms'].sum():.1f} ms have counters; at the roofs those would "
                     f"take {g['at_roof_ms'].sum():.1f} ms. The largest levers: {top}. The convolutions hold "
                     f"{conv:.1f} of the {g['max_saving_ms'].sum():.1f} ms a lever could save.")
    return "\n".join(lines) if lines else "No GPU has a kernel table of `best` and Nsight Compute counters yet."


def lever_call(root=None) -> dict[str, pd.DataFrame]:
    """Every label's lever calls (``data/<label>/levers/``): `repeats` and `sample_batches` with their rows, and
    `kernels` and `quality` with each variant's table (`config` added), all validated."""
    from pathlib import Path

    from medddpm.store import schema
    from medddpm.store.layout import LEVER_RUN_TABLES, LEVERS_DIR, LEVERS_TABLES, data_root

    root = data_root() if root is None else Path(root)
    out = {}
    for table in LEVERS_TABLES:
        frames = [schema.read_table(p, table) for p in sorted(root.glob(f"*/{LEVERS_DIR}/{table}.parquet"))]
        out[table] = pd.concat(frames, ignore_index=True) if frames else schema.empty(table)
    for table in LEVER_RUN_TABLES:
        frames = [schema.read_table(p, table).assign(gpu_slug=p.parent.parent.parent.name, config=p.parent.name)
                  for p in sorted(root.glob(f"*/{LEVERS_DIR}/*/{table}.parquet"))]
        out[table] = (pd.concat(frames, ignore_index=True) if frames
                      else schema.empty(table).assign(gpu_slug=pd.Series(dtype=str), config=pd.Series(dtype=str)))
    return out


def lever_verdicts(call: dict[str, pd.DataFrame], base: str = "best") -> pd.DataFrame:
    """Per GPU, phase and variant of its latest lever call: the median of its blocks, their paired difference
    against `base` and the spread of `base`'s neighbouring blocks (`analysis.levers.paired_verdict`), whether its
    quality held against strict FP32 as `base`'s did (training only), and whether the lever `counts`."""
    from medddpm.analysis import levers

    cols = ["gpu_slug", "phase", "config", "blocks", "median_ms", "diff_ms", "spread_ms", "verdict", "parity", "counts"]
    rows = []
    rep = call["repeats"].sort_values(["gpu_slug", "phase", "call_id", "position"], ascending=[True, False, True, True])
    for (slug, phase), g in rep.groupby(["gpu_slug", "phase"], sort=False):
        last = g[g["call_id"] == g["call_id"].max()]
        quality = call["quality"][call["quality"]["gpu_slug"] == slug]
        q = {c: t for c, t in quality.groupby("config")}
        for config, v in last.groupby("config", sort=False):
            verdict = levers.paired_verdict(last, base, config) if config != base else {
                "diff_ms": 0.0, "spread_ms": levers.repeat_spread(last, base), "verdict": ""}
            judged = phase == "train" and config != base  # parity is the training step's (the quality phase)
            held = (levers.parity_held(q[config], q[base]) if config in q and base in q else None) if judged else None
            rows.append({"gpu_slug": slug, "phase": phase, "config": config, "blocks": len(v),
                         "median_ms": float(v["block_ms"].median()),
                         **{k: verdict[k] for k in ("diff_ms", "spread_ms", "verdict")},
                         "parity": {True: "held", False: "lost", None: ""}[held],
                         "counts": levers.lever_counts(verdict, held) if judged else False})
    return pd.DataFrame(rows, columns=cols)  # per GPU: training first, the base, then the variants in call order


def levers_after(data: Data, call: dict[str, pd.DataFrame], base: str = "best") -> pd.DataFrame:
    """Per GPU and lever: milliseconds a micro-step in `base`'s committed kernel table (`before`) and in each
    variant's kernel table from the latest lever call (a column per configuration, `base`'s own among them)."""
    from medddpm.analysis import levers

    parts = []
    for slug, k in call["kernels"].groupby("gpu_slug", sort=False):
        committed = data.ok[(data.ok["gpu_slug"] == slug) & (data.ok["config"] == base)]
        before = data.kernels[data.kernels["run_id"].isin(committed["run_id"])].assign(column="before")
        after = k.assign(column=k["config"])
        table = levers.by_lever(pd.concat([before, after], ignore_index=True), key="column")
        parts.append(table.reset_index(names="lever").assign(gpu_slug=slug))
    if not parts:
        return pd.DataFrame(columns=["gpu_slug", "lever", "before"])
    out = pd.concat(parts, ignore_index=True)
    return out[["gpu_slug", "lever", *[c for c in out.columns if c not in ("gpu_slug", "lever")]]]


def levers_owed_text(verdicts: pd.DataFrame, base: str = "best") -> str:
    """What the lever call decided, per GPU; or that the call is owed."""
    if verdicts.empty:
        return ("The call that measures `best` beside its new variants (interleaved blocks of steps in one process, "
                "the quality phase for each, sampling by batch) has not run on a GPU yet: the table after the levers "
                "is owed, and nothing here stands in for it.")
    lines = []
    for (slug, phase), g in verdicts.groupby(["gpu_slug", "phase"], sort=False):
        wins = g[g["counts"]]["config"].tolist() if phase == "train" else \
            g[g["verdict"] == "faster"]["config"].tolist()
        lines.append(f"- **{md(slug)}**, {'training micro-step' if phase == 'train' else 'denoising step'}: "
                     f"{len(g) - 1} variants against `{base}` "
                     f"({g.loc[g['config'] == base, 'median_ms'].iloc[0]:.2f} ms; neighbouring blocks of `{base}` "
                     f"lie up to {g['spread_ms'].iloc[0]:.2f} ms apart); "
                     + (f"faster beyond that{' with parity held' if phase == 'train' else ''}: "
                        + ", ".join(code(c) for c in wins) if wins else "none is faster beyond that") + ".")
    return "\n".join(lines)
