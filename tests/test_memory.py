"""The memory page's data layer and charts, on synthetic GPU runs built from a real CPU row:
measured peaks, the batch line, what fits on which card, what a memory-saving switch costs, the targets."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from medddpm import report
from medddpm.store import layout, schema
from medddpm.report import charts
from medddpm.configs import CONFIGS

REAL = Path(__file__).resolve().parent.parent / "data"
GPU = "nvidia-test-gpu"
GIB = 2**30
HEAD, BRATS = ("paper", "128x128x128", 40_228_161), ("brats", "192x192x144", 57_562_564)
# (model, config, batch, peak GiB, reserved GiB, median ms)
RUNS = [
    (HEAD, "opt1", 1, 18.5, 24.0, 218.0), (HEAD, "opt1-ckpt", 1, 4.5, 6.0, 280.0), (HEAD, "bf16", 1, 13.5, 16.5, 149.0),
    (HEAD, "best", 1, 6.0, 7.0, 93.0), (HEAD, "best-ckpt", 1, 3.5, 4.0, 116.0), (HEAD, "baseline", 1, 18.4, 24.0, 854.0),
    (BRATS, "baseline", 1, 70.0, 80.0, 3300.0), (BRATS, "opt1", 1, 71.0, 80.0, 850.0), (BRATS, "best", 1, 30.0, 33.0, 350.0),
    (BRATS, "best", 2, 55.0, 60.0, 690.0), (BRATS, "best-ckpt", 1, 12.0, 14.0, 450.0), (BRATS, "best-ckpt", 2, 20.0, 22.0, 890.0),
]
OTHER_GIB = 0.5


@pytest.fixture(scope="module")
def template() -> pd.Series:
    run = report.runs(REAL)
    rows = run[(run["gpu_slug"] == "cpu") & (run["config"] == "baseline")]
    if rows.empty:
        pytest.skip("no data/cpu/baseline run")
    return rows.iloc[0]


def gpu_runs(template, runs=RUNS) -> pd.DataFrame:
    rows = []
    for (preset, shape, params), config, batch, peak, reserved, ms in runs:
        r = template.copy()
        folder = layout.run_folder(config, preset, batch)
        r[["run_id", "gpu_slug", "gpu_name", "config", "preset", "shape", "batch", "parameters", "folder"]] = [
            f"{GPU}/{folder}/x", GPU, "NVIDIA Test GPU", config, preset, shape, batch, params, f"{GPU}/{folder}"]
        for flag, value in CONFIGS[config].flags.items():
            r[flag] = value
        r["precision_used"] = CONFIGS[config].precision
        r[["peak_mem_bytes", "peak_reserved_bytes", "gpu_other_bytes", "gpu_total_bytes"]] = [
            int(peak * GIB), int(reserved * GIB), int(OTHER_GIB * GIB), int(141 * GIB)]
        r["sample_peak_mem_bytes"] = int(peak / 3 * GIB)
        r["train_median_ms"] = ms
        rows.append(r)
    return pd.DataFrame(rows).reset_index(drop=True)


@pytest.fixture(scope="module")
def run(template) -> pd.DataFrame:
    cpu = report.runs(REAL)
    return pd.concat([cpu[cpu["gpu_slug"] == "cpu"], gpu_runs(template)], ignore_index=True)


def test_memory_runs_keep_gpu_peaks_only(run):
    mem = report.memory_runs(run)
    assert set(mem["gpu_slug"]) == {GPU} and len(mem) == len(RUNS)
    report.check_memory(mem)
    best2 = mem[(mem["config"] == "best") & (mem["batch"] == 2)].iloc[0]
    assert best2["label"] == "best (batch 2)" and best2["model"] == "brats 192x192x144"
    assert best2["peak_gib"] == pytest.approx(55.0) and best2["other_gib"] == pytest.approx(OTHER_GIB)
    assert set(report.memory_runs(run).query("config == 'best'")["label"]) == {"best", "best (batch 2)"}
    failed = run.copy()
    failed.loc[failed["config"] == "bf16", "status"] = "oom"
    assert "bf16" not in set(report.memory_runs(failed)["config"])
    bad = mem.copy()
    bad.loc[0, "reserved_gib"] = bad.loc[0, "peak_gib"] / 2
    with pytest.raises(AssertionError, match="reserved below allocated"):
        report.check_memory(bad)


def test_memory_model_fits_a_line_or_estimates_from_batch_one(run):
    model = report.memory_model(report.memory_runs(run)).set_index(["model", "config"])
    best = model.loc[("brats 192x192x144", "best")]
    assert (best["fixed_gib"], best["per_sample_gib"]) == (pytest.approx(5.0), pytest.approx(25.0))
    assert best["batches"] == "1, 2" and best["method"].startswith("line through the peaks measured at batch 1, 2")
    opt1 = model.loc[("paper 128x128x128", "opt1")]
    state = HEAD[2] * report.STATE_BYTES_PER_PARAM / GIB
    assert opt1["fixed_gib"] == pytest.approx(state) and opt1["per_sample_gib"] == pytest.approx(18.5 - state)
    assert opt1["method"].startswith("estimate from batch 1 alone")


def test_fits_per_card(run):
    cards = report.memory.card_memory()  # the catalogue: what each card's driver reports, cited
    gib = dict(zip(cards["sold_gb"], cards["card_gib"]))
    fit = report.fits(report.memory_model(report.memory_runs(run)), cards).set_index(["model", "config", "sold_gb"])
    b = "brats 192x192x144"
    # best at BraTS size: need 30 + 0.5 GiB; line 5 + 25 per volume; 5% of what each driver reports kept free
    assert fit.loc[(b, "best", 40), "verdict"] == "fits" and fit.loc[(b, "best", 40), "largest_batch"] == 1
    assert fit.loc[(b, "best", 80), "largest_batch"] == math.floor((gib[80] * 0.95 - 0.5 - 5) / 25)
    assert fit.loc[(b, "best", 24), "verdict"] == "does not fit" and fit.loc[(b, "best", 24), "largest_batch"] == 0
    # baseline: 70.5 GiB needed leaves 5% of the 80 GB card's 79.3 GiB free; the reserved 80 GiB (+ 0.5) does not fit
    assert fit.loc[(b, "baseline", 80), "verdict"] == "tight" and fit.loc[(b, "baseline", 141), "verdict"] == "fits"
    assert fit.loc[(b, "baseline", 48), "verdict"] == "does not fit"
    # bf16 whole-head: 14.0 GiB needed leaves the headroom of the 16 GB card's 15.7 GiB; its reserved 16.5 GiB does not
    assert fit.loc[("paper 128x128x128", "bf16", 16), "verdict"] == "tight"
    assert fit.loc[("paper 128x128x128", "best-ckpt", 16), "verdict"] == "fits"
    assert list(fit.reset_index()["sold_gb"].unique()) == [16, 24, 40, 48, 80, 141]
    assert (fit["card_gib"] < fit.index.get_level_values("sold_gb")).all(), "a card taken to hold its sold size in GiB"


def test_cards_keep_gb_and_gib_apart(run):
    cited = report.memory.card_memory()
    report.memory.check_cards(cited)
    assert (cited["kind"] == report.memory.CITED_CARD).all() and cited["source"].str.len().gt(20).all()
    # every card holds less than its sold size read as GiB: the driver keeps some (ECC, firmware)
    assert (cited["card_gib"] < cited["sold_gb"]).all()
    # a run that measured its device replaces the cited figure of its type, and adds a card of a type not listed
    gpu = run[run["gpu_slug"] == GPU].copy()
    gpu["gpu_type"] = "nvidia-a100-sxm4-80gb"
    gpu["gpu_total_bytes"] = int(79.5 * GIB)
    other = gpu.head(1).assign(gpu_type="nvidia-new-card", gpu_name="NVIDIA New Card", gpu_total_bytes=int(90 * GIB))
    measured = report.memory.card_memory(pd.concat([gpu, other, run[run["gpu_slug"] == "cpu"]], ignore_index=True))
    a100 = measured.set_index("gpu_type").loc["nvidia-a100-sxm4-80gb"]
    assert a100["kind"] == report.memory.MEASURED_CARD and a100["sold_gb"] == 80
    assert a100["card_gib"] == pytest.approx(79.5)
    new = measured.set_index("gpu_type").loc["nvidia-new-card"]
    assert new["card"] == "NVIDIA New Card" and math.isnan(new["sold_gb"]) and new["card_gib"] == pytest.approx(90)
    assert len(measured) == len(cited) + 1 and measured["card_gib"].is_monotonic_increasing
    bad = cited.assign(card_gib=cited["sold_gb"])  # a card sold as C GB taken to hold C GiB
    with pytest.raises(AssertionError):
        report.memory.check_cards(bad)


def test_switch_costs_pair_runs_that_differ_in_one_switch(run):
    costs = report.switch_costs(run)
    gpu = costs[costs["gpu_slug"] == GPU]
    pairs = set(zip(gpu["model"], gpu["batch"], gpu["config_off"], gpu["config_on"], gpu["switch"]))
    h, b = "paper 128x128x128", "brats 192x192x144"
    # best-ckpt keeps the chunked GroupNorm and more (configs.py): today's best and best-ckpt differ in more than
    # checkpointing
    differ = {k for k, v in CONFIGS["best-ckpt"].flags.items() if v != CONFIGS["best"].flags[k]}
    assert "group_norm" in differ and len(differ) > 1
    assert pairs == {(h, 1, "opt1", "opt1-ckpt", "checkpointing"), (h, 1, "opt1", "bf16", "precision"),
                     (h, 1, "baseline", "bf16", "precision")}
    # runs of the two that differ in checkpointing alone (as best's and best-ckpt's BraTS-size runs, made when
    # best-ckpt was best plus checkpointing) pair, at each batch
    same = run.copy()
    for k in differ - {"checkpointing"}:
        same.loc[same["config"] == "best-ckpt", k] = CONFIGS["best"].flags[k]
    also = report.switch_costs(same)
    also = also[also["gpu_slug"] == GPU]
    assert set(zip(also["model"], also["batch"], also["config_off"], also["config_on"], also["switch"])) == pairs | {
        (h, 1, "best", "best-ckpt", "checkpointing"), (b, 1, "best", "best-ckpt", "checkpointing"),
        (b, 2, "best", "best-ckpt", "checkpointing")}
    row = gpu[(gpu["config_on"] == "opt1-ckpt")].iloc[0]
    assert row["time_ratio"] == pytest.approx(280 / 218) and row["saved_gib"] == pytest.approx(14.0)
    assert row["saved_frac"] == pytest.approx(14 / 18.5) and row["change"] == "checkpointing: False -> True"
    cpu = costs[costs["gpu_slug"] == "cpu"]
    assert cpu["saved_gib"].isna().all(), "a CPU measures the time cost, never the memory"


def test_memory_targets(run, template):
    t = report.memory_targets(report.memory_runs(run)).set_index("target_id")
    assert (t["verdict"] == report.HOLDS).all()
    assert t.loc["head-8", "config"] == "best" and "of 6 measured" in t.loc["head-8", "evidence"]
    assert t.loc["head-4-ckpt", "config"] == "best-ckpt" and t.loc["brats-40", "config"] == "best"
    few = report.memory_targets(report.memory_runs(gpu_runs(template, [r for r in RUNS if r[1] in ("opt1", "bf16")])))
    v = few.set_index("target_id")["verdict"]
    # none of the measured runs meets them, but best and the checkpointed ones were not measured
    assert v["head-8"] == report.NOT_YET and v["head-4-ckpt"] == report.NOT_MEASURED
    assert v["brats-40"] == report.NOT_YET and "71.00 GiB" in few.set_index("target_id").loc["brats-40", "evidence"]
    assert "not measured: baseline, opt2" in few.set_index("target_id").loc["head-8", "evidence"]
    # every configuration there is was measured: then the target does not hold
    only = tuple(CONFIGS[c] for c in ("opt1", "bf16"))
    v = report.memory_targets(report.memory_runs(gpu_runs(template, [r for r in RUNS if r[1] in ("opt1", "bf16")])),
                          configs=only).set_index("target_id")["verdict"]
    assert v["head-8"] == report.FAILS  # both measured on the whole-head model
    assert report.memory_targets(report.memory_runs(run[run["gpu_slug"] == "cpu"])).empty


def test_memory_charts(run):
    mem = report.memory_runs(run)
    built = {"peaks": charts.memory_peaks(mem), "fits": charts.memory_fits(report.fits(report.memory_model(mem))),
             "costs": charts.switch_costs(report.switch_costs(run))}
    for name, chart in built.items():
        spec = chart.to_dict()  # validates against the Vega-Lite schema
        text = json.dumps(spec)
        assert GPU in text, name
        params = {p["name"]: p for layer in [spec, *spec.get("layer", [])] for p in layer.get("params", [])}
        if name != "costs":
            assert set(params["model"]["bind"]["options"]) == {"paper 128x128x128", "brats 192x192x144"}, name
        assert any("legend" == p.get("bind") for p in params.values()), f"{name}: no legend selection"
    for build in (charts.memory_peaks, lambda m: charts.memory_fits(report.fits(report.memory_model(m)))):
        assert "no GPU peak memory" in json.dumps(build(mem.iloc[0:0]).to_dict())
    assert "no pair of runs" in json.dumps(charts.switch_costs(report.switch_costs(run.iloc[0:0])).to_dict())


def test_variant_runs_are_read_only_on_request(tmp_path):
    if not (REAL / "cpu" / "baseline" / "run.parquet").is_file():
        pytest.skip("no data/cpu/baseline run")
    root = tmp_path / "data"
    shutil.copytree(REAL / "cpu" / "baseline", root / "cpu" / "baseline")
    variant = root / "cpu" / "baseline@smoke-b2"
    shutil.copytree(REAL / "cpu" / "baseline", variant)
    with pytest.warns(report.DataWarning, match="run.parquet says cpu/baseline, the folder says cpu/baseline@smoke-b2"):
        report.runs(root)
    df = schema.read_table(variant / "run.parquet")
    df["batch"] = 2
    df["run_id"] = "cpu/baseline@smoke-b2/x"
    schema.write_table(df, variant / "run.parquet", "run")
    assert report.runs(root)["folder"].tolist() == ["cpu/baseline"]
    assert sorted(report.runs(root, variants=True)["folder"]) == ["cpu/baseline", "cpu/baseline@smoke-b2"]


def test_counted_models():
    c = report.counted_models().set_index("preset")
    assert c.loc["brats", "parameters"] == 57_562_564 and c.loc["paper", "parameters"] == 40_228_161
    assert c.loc["brats", "forward_tflop"] == pytest.approx(21.26, rel=1e-3)
    assert c.loc["brats", "activations_ckpt_gib"] < 0.2 * c.loc["brats", "activations_gib"]
