"""Cards against each other, on the committed H200 data and a made-up second card: a copy of the H200's runs
relabelled as an H100 whose memory-bound kernel categories take the bandwidth ratio longer and whose compute-bound
ones take as long, with roofs to match. The side-by-side chart holds both cards, the category ratios come out as
made, and the model predicts the copy's steps; a card predicted from an unchanged copy of itself is exact."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from medddpm import report
from medddpm.report import cards, charts
from medddpm.store import schema

H200, H100 = "nvidia-h200", "nvidia-h100-80gb-hbm3"
CONFIGS = ("baseline", "opt1", "best")
MEMORY = ("elementwise", "layout", "normalization", "reduction", "memcpy", "optimizer")
BW = {H200: 4.3e12, H100: 3.0e12}  # made-up measured bandwidths: the H100 has 1/1.43 of the H200's


def roofs(slug: str, bandwidth: float) -> pd.DataFrame:
    values = {"dram": bandwidth, "fp32": 60e12, "tf32": 400e12, "bf16": 790e12, "fp16": 790e12}
    return pd.DataFrame([{"gpu_slug": slug, "gpu_name": slug, "gpu_type": slug, "host": "h", "roof": r,
                          "unit": "byte/s" if r == "dram" else "FLOP/s", "value": v, "p10": v, "p90": v,
                          "repeats": 30, "size": 8192, "method": "made up", "sm_clock_mhz": 1980.0,
                          "mem_clock_mhz": 2600.0, "driver": "", "cuda": "", "torch": "", "git_commit": "",
                          "start_time": ""} for r, v in values.items()])[list(schema.TABLES["roofs"])]


@pytest.fixture(scope="module")
def h200(committed_data) -> report.Data:
    data = committed_data
    runs = data.run[(data.run["gpu_slug"] == H200) & data.run["config"].isin(CONFIGS)]
    if len(runs) < len(CONFIGS) or data.ncu[data.ncu["run_id"].isin(runs["run_id"])].empty:
        pytest.skip("no committed H200 runs with counters")
    ids = set(runs["run_id"])
    return report.Data(run=runs, steps=schema.empty("steps"),
                   kernels=data.kernels[data.kernels["run_id"].isin(ids)],
                   ncu=data.ncu[data.ncu["run_id"].isin(ids)], quality=schema.empty("quality"),
                   roofs=roofs(H200, BW[H200]))


def copy_as(data: report.Data, slug: str, memory_factor: float) -> report.Data:
    """`data`'s runs relabelled `slug`: memory-bound categories' kernels `memory_factor` times as long, the step
    as long as its kernels say; the counters as they were (the reference card's profile is not this card's)."""
    new = {rid: rid.replace(f"{H200}/", f"{slug}/", 1) for rid in data.run["run_id"]}
    k = data.kernels.assign(run_id=data.kernels["run_id"].map(new), gpu_slug=slug)
    k["total_us"] = k["total_us"] * k["category"].map(lambda c: memory_factor if c in MEMORY else 1.0)
    k["share"] = k["total_us"] / k.groupby("run_id")["total_us"].transform("sum")
    before = data.kernels.groupby("run_id")["total_us"].sum().rename(index=new)
    grow = k.groupby("run_id")["total_us"].sum() / before
    r = data.run.assign(run_id=data.run["run_id"].map(new), gpu_slug=slug, gpu_type=slug, gpu_name=slug,
                        folder=[f"{slug}/{c}" for c in data.run["config"]])
    for col in ("train_median_ms", "train_p10_ms", "train_p90_ms"):
        r[col] = r[col] * r["run_id"].map(grow)
    n = data.ncu.assign(run_id=data.ncu["run_id"].map(new), gpu_slug=slug)
    return report.Data(run=r, steps=data.steps, kernels=k, ncu=n, quality=data.quality, roofs=roofs(slug, BW[slug]))


def both(a: report.Data, b: report.Data) -> report.Data:
    return report.Data(**{f: pd.concat([getattr(a, f), getattr(b, f)], ignore_index=True)
                      for f in ("run", "steps", "kernels", "ncu", "quality", "roofs")})


@pytest.fixture(scope="module")
def two(h200) -> report.Data:
    return both(h200, copy_as(h200, H100, BW[H200] / BW[H100]))


@pytest.fixture(scope="module")
def predicted(two):
    return cards.predictions(two)


def test_every_configuration_stands_on_both_cards_in_one_chart(two, predicted):
    steps = cards.step_times(two, predicted[0])
    measured = steps[steps["kind"] == cards.MEASURED]
    assert set(measured["gpu_slug"]) == {H200, H100}
    assert (measured.groupby("config")["gpu_slug"].nunique() == 2).all()
    assert set(measured["card"]) == {"H200", H100}, "a card's short name: its device's name without the maker"
    # a card this data does not hold is an estimate, never a measurement; a measured one is never estimated
    est = steps[steps["kind"] == cards.ESTIMATE]
    assert set(est["gpu_slug"]) == {"nvidia-a100-sxm4-80gb", "nvidia-b200"}
    assert est["card"].str.contains("estimate from").all()
    assert (est["train_p10_ms"] <= est["train_median_ms"]).all()
    assert (est["train_median_ms"] <= est["train_p90_ms"]).all()
    assert (est["train_p10_ms"] < est["train_p90_ms"]).all(), "an estimate's whisker spans the model's two readings"
    spec = charts.card_steps(steps).to_dict()
    data = next(iter(spec["datasets"].values()))
    assert {d["card"] for d in data} == set(steps["card"]) and "yOffset" in spec["layer"][0]["encoding"]
    assert not any("bind" in p and p.get("name") == "gpu" for p in spec.get("params", [])), "no GPU dropdown"
    assert spec["layer"][0]["encoding"]["x"]["title"].endswith("(ms)")


def test_the_model_predicts_the_second_card_from_the_first_card_s_profile(predicted):
    table, _ = predicted
    there = table[(table["from_card"] == H200) & (table["card"] == H100)].set_index("config")
    back = table[(table["from_card"] == H100) & (table["card"] == H200)].set_index("config")
    assert set(there.index) == set(CONFIGS) == set(back.index)
    assert (there["kind"] == cards.MEASURED).all() and there["roofs"].eq("measured").all()
    assert there["error"].map(math.isfinite).all() and there["measured_ms"].gt(there["from_ms"]).all()
    # memory-bound categories take the bandwidth ratio in the copy, so a roofline model comes close
    assert there["error"].abs().max() < 0.25, there[["predicted_ms", "measured_ms", "error"]]
    assert there["covered"].between(0.5, 1).all()
    assert (there["predicted_ms"] <= there["predicted_whole_ms"] + 1e-9).all(), \
        "moving only the time at the roof (the prediction) moves a kernel less than moving all of it"
    cards.check_predictions(table)


def test_the_model_reads_its_cards_against_the_book_s_one_basis(two, predicted):
    """Both cards measured: the model reads them measured against measured. A third card of the data without its
    own roofs puts the whole book on the datasheets, and the model with it, although the two cards it compares
    have measured theirs: a card's roofs on the cards page are those its efficiency is read against elsewhere."""
    from medddpm.analysis import roofs as ar
    from medddpm.report import card_compare

    assert predicted[0].loc[predicted[0]["kind"] == cards.MEASURED, "roofs"].eq("measured").all()
    lab = "nvidia-h200-lab3"
    third = two.run[two.run["gpu_slug"] == H200].assign(gpu_slug=lab, gpu_type=H200)
    third["run_id"] = third["run_id"].str.replace(f"{H200}/", f"{lab}/", n=1, regex=False)
    three = report.Data(**{**two.__dict__, "run": pd.concat([two.run, third], ignore_index=True)})
    assert ar.pair_of(three.roofs, (H200, H200), (H100, H100))[2] == "measured", "the pair alone: measured"
    table, kernels = cards.predictions(three)
    there = table[(table["from_card"] == H200) & (table["card"] == H100)]
    assert len(there) == len(CONFIGS) and there["roofs"].eq("datasheet").all()
    sheet = ar.DATASHEET[H200].roofs["dram"] / ar.DATASHEET[H100].roofs["dram"]
    ratios = cards.category_ratios(three, kernels)
    norm = ratios[(ratios["pair"] == f"{H200} → {H100}") & (ratios["category"] == "normalization")]
    assert norm["roofs_ratio"].to_numpy() == pytest.approx(sheet)
    assert card_compare.bandwidth_ratio(three, H100, H200) == (pytest.approx(sheet), "datasheet")
    assert set(report.step_efficiency(three)["basis"]) == {"datasheet"}


def test_category_ratios_are_measured_as_made_and_set_beside_the_roofs(two, predicted):
    ratios = cards.category_ratios(two, predicted[1])
    mine = ratios[(ratios["pair"] == f"{H200} → {H100}") & (ratios["config"] == "baseline")].set_index("category")
    assert mine.loc["convolution", "measured_ratio"] == pytest.approx(1.0)
    assert mine.loc["normalization", "measured_ratio"] == pytest.approx(BW[H200] / BW[H100])
    assert mine.loc["normalization", "bound_a"] == "memory"
    assert mine.loc["normalization", "roofs_ratio"] == pytest.approx(BW[H200] / BW[H100])
    assert mine.loc["convolution", "bound_a"] == "compute" and mine.loc["convolution", "roofs_ratio"] == pytest.approx(1.0)
    spec = charts.category_ratios(ratios).to_dict()
    pairs = next(p for p in spec["params"] if p["name"] == "pair")["bind"]["options"]
    assert pairs[:2] == sorted([f"{H200} → {H100}", f"{H100} → {H200}"]) or set(pairs) >= {f"{H200} → {H100}"}
    assert "log scale" in spec["layer"][1]["encoding"]["x"]["axis"]["title"]


def test_a_card_predicted_from_an_unchanged_copy_of_itself_is_exact(h200):
    same = both(h200, copy_as(h200, H100, 1.0))
    same = report.Data(**{**same.__dict__, "roofs": pd.concat([roofs(H200, 1e12), roofs(H100, 1e12)], ignore_index=True)})
    table, _ = cards.predictions(same)
    t = table[table["kind"] == cards.MEASURED]
    assert len(t) == 2 * len(CONFIGS) and t["error"].abs().max() < 1e-9
    assert t["error_whole"].abs().max() < 1e-9


def test_a_missed_prediction_names_the_kernels_it_gets_wrong_and_why(h200):
    # the copy's memory-bound kernels ran twice as fast on the slower memory: the model predicts them slower
    fast = copy_as(h200, H100, 0.5)
    two = both(h200, fast)
    table, kernels = cards.predictions(two)
    off = table[(table["from_card"] == H200) & (table["kind"] == cards.MEASURED)]
    assert (off["error"] > 0).all(), "the model predicts the memory-bound kernels slower"
    miss = cards.misses(kernels, two, cards.held_against_measured(table))
    assert len(miss) and set(miss["config"]) <= set(off.loc[off["error"].abs() > cards.TARGET, "config"])
    top = miss[miss["from_card"] == H200].iloc[0]
    assert top["error_ms"] > 0 and top["measured_factor"] == pytest.approx(0.5)
    assert f"the model moves it x{top['predicted_factor']:.2f}, it moved x0.50" in cards.why(top)
    shown = cards.misses_table(kernels, two, cards.held_against_measured(table))
    assert shown["kernel"].str.len().max() <= 60, "a kernel by its short name, never its C++ signature"


def test_the_committed_data_gets_estimates_of_the_cards_nobody_measured(committed_data):
    data = committed_data
    table, _ = cards.predictions(data)
    counted = set(data.ncu["run_id"]) & set(data.ok.loc[data.ok["gpu_slug"] == H200, "run_id"])
    if not counted:
        pytest.skip("no committed H200 counters")
    est = table[(table["from_card"] == H200) & (table["kind"] == cards.ESTIMATE)]
    assert set(est["card"]) == {"nvidia-a100-sxm4-80gb", "nvidia-b200"}
    assert (est["roofs"] == "datasheet").all() and est["source"].str.contains("datasheet").all()
    assert est["measured_ms"].isna().all() and (est["predicted_ms"] > 0).all()
    b200 = est[est["card"] == "nvidia-b200"].set_index("config")
    assert (b200["predicted_ms"] < b200["from_ms"]).all(), "a B200 beats an H200 on every roof"
