"""Every page right with two real cards: the committed H100 and H200 rows, read together as the book reads them.

Each test catches a way two cards went wrong on a page: a chart that opens on a GPU and model with no rows, a score
that counts the configurations one card never ran as misses, an estimate read against one kind of peak and applied
to another, a second efficiency figure of a card, one card's points hidden under the other's, a power-capped run
compared without a word, a long label that breaks over a column, a switch that saves nothing listed as saving
memory, floor labels printed over each other, a zero where a card never ran a configuration. And the cards
compared: the ratio with its spread beside the share of memory-bound kernels, and the model's prediction within 10%
of every configuration both cards ran.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from medddpm import report
from medddpm.analysis import roofs as ar
from medddpm.report import card_compare, cards, charts, tables, workshop
from medddpm.report.charts import timing
from test_charts import _units

DATA = Path(__file__).resolve().parent.parent / "data"
H100, H200 = "nvidia-h100-80gb-hbm3", "nvidia-h200"
BOTH = ("baseline", "opt1", "opt2", "opt12", "bf16", "best")  # the configurations the committed cards both ran


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A data tree of the two committed cards alone (their folders linked, not copied)."""
    if not all((DATA / s / "baseline" / "run.parquet").is_file() for s in (H100, H200)):
        pytest.skip("the committed H100 and H200 rows are not in data/")
    tree = tmp_path_factory.mktemp("two-cards")
    for slug in (H100, H200):
        (tree / slug).symlink_to(DATA / slug, target_is_directory=True)
    return tree


@pytest.fixture(scope="module")
def data(root) -> report.Data:
    return report.load_all(root)


@pytest.fixture(scope="module")
def predicted(data):
    return cards.predictions(data)


@pytest.fixture(scope="module")
def names(data) -> dict[str, str]:
    return tables.card_names(data.run)


def _param(spec: dict, name: str):
    return next(p["value"] for p in spec["params"] if p["name"] == name)


def _rows(spec: dict) -> list[dict]:
    return [r for rows in spec["datasets"].values() for r in rows]


def test_the_memory_charts_open_on_a_gpu_and_model_with_rows(root):
    run = report.runs(root, variants=True)
    mem = report.memory_runs(run)
    assert {"brats 192x192x144", "paper 128x128x128"} <= set(mem["model"]), "both models, one card ran only one"
    table = report.memory.card_memory(run)
    fit = report.fits(report.memory_model(mem), table)
    for chart in (charts.memory_peaks(mem, table), charts.memory_fits(fit)):
        spec = chart.to_dict()
        gpu, model = _param(spec, "gpu"), _param(spec, "model")
        shown = [r for r in _rows(spec) if r.get("gpu_slug") == gpu and r.get("model") == model and "config" in r]
        assert shown, f"opens on {gpu} / {model}, which has no rows"
    # seven cards under the columns of what fits where, the H100 among them: their names never run into each other
    labels = _x_labels(charts.memory_fits(fit).to_dict(), 688)
    assert len(labels) == len(table) >= 7
    spans = sorted((x - 2.8 * max(map(len, lines)), x + 2.8 * max(map(len, lines))) for x, lines in labels)
    assert all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:])), labels


def _x_labels(spec: dict, width: int) -> list[tuple[float, list[str]]]:
    """The x-axis labels of a chart drawn `width` px wide (vl-convert, as the book's bundle draws it): each
    label's centre and its lines."""
    import json
    import xml.etree.ElementTree as ET

    import vl_convert

    spec = json.loads(json.dumps(spec).replace('"width": "container"', f'"width": {width}'))
    ns = {"s": "http://www.w3.org/2000/svg"}
    out = []
    for axis in ET.fromstring(vl_convert.vegalite_to_svg(spec)).iterfind(".//s:g[@aria-roledescription='axis']", ns):
        if not axis.get("aria-label", "").startswith("X-axis"):
            continue
        for g in axis.iterfind(".//s:g", ns):
            if "role-axis-label" in g.get("class", ""):
                for t in g.iterfind("s:text", ns):
                    x = float(re.match(r"translate\(([-\d.]+)", t.get("transform")).group(1))
                    lines = [ts.text or "" for ts in t.iterfind("s:tspan", ns)] or [t.text or ""]
                    out.append((x, lines))
    return out


def test_the_score_counts_only_the_configurations_both_cards_ran(predicted, names):
    table, _ = predicted
    judged = cards.held_against_measured(table)
    assert set(judged["config"]) == set(BOTH) and judged["measured_ms"].notna().all()
    waiting = cards.pending(table)
    assert set(waiting["config"]) == {"bf16-cl", "sdpa", "compile", "graphs", "opt1-ckpt", "best-ckpt"}
    assert waiting["measured_ms"].isna().all() and (waiting["predicted_ms"] > 0).all()
    text = cards.prediction_text(judged, names)
    assert re.search(rf"\*\*(\d) of {len(BOTH)}\*\*", text), text
    assert "of 12" not in text, "a configuration a card never ran is no miss"


def test_the_prediction_is_within_ten_percent_of_every_configuration_both_cards_ran(predicted):
    judged = cards.held_against_measured(predicted[0])
    judged = judged[(judged["from_card"] == H200) & (judged["card"] == H100)].set_index("config")
    assert set(judged.index) == set(BOTH)
    assert judged["error"].abs().max() <= cards.TARGET, judged[["predicted_ms", "measured_ms", "error"]]
    assert cards.score(cards.held_against_measured(predicted[0]))[cards.PREDICTION] == (len(BOTH), len(BOTH))
    # the whole reading moves every kernel's whole time: an upper bound, which overshoots
    assert (judged["predicted_whole_ms"] >= judged["predicted_ms"]).all()
    assert (judged["error_whole"] > judged["error"]).all()


def test_a_step_carries_over_by_peaks_of_one_source_and_the_workshop_prints_the_book_s_efficiency(data):
    """The workshop prints each card's efficiency as every page does (on the book's basis), and carries a step to
    another card by the ratio of two datasheet peaks: the paper's cards are known by their datasheets. Whichever
    roofs the book reads the cards against, the estimates stay, and the H100's own step gives its 48.3 h back."""
    from test_roofs import made_up

    cases = {ar.DATASHEET_SOURCE: data,
             ar.MEASURED: report.Data(**{**data.__dict__, "roofs": pd.concat(
                 [data.roofs, made_up(H200, H200, 0.8)], ignore_index=True)})}
    estimates = {}
    for basis, d in cases.items():
        eff = workshop.efficiencies(d)
        book = report.step_efficiency(d).set_index(["gpu_slug", "config"])["efficiency"]
        assert (eff["basis"] == basis).all()
        assert [book[(r.gpu_slug, r.config)] for r in eff.itertuples()] == pytest.approx(eff["efficiency"].tolist())
        est = workshop.cost_estimates(eff, d)
        workshop.check_estimates(est)
        assert "efficiency" not in " ".join(est.columns), "no second efficiency figure beside the book's"
        estimates[basis] = est
    pd.testing.assert_frame_equal(estimates[ar.DATASHEET_SOURCE], estimates[ar.MEASURED])
    est = estimates[ar.DATASHEET_SOURCE]
    own = est[(est["from"] == H100) & (est["gpu_type"] == H100)].iloc[0]
    run = data.ok[(data.ok["gpu_slug"] == H100) & (data.ok["config"] == "baseline")].iloc[0]
    assert own["own"] and own["estimated hours"] == pytest.approx(run["gpu_hours_100k"], rel=1e-3)
    assert own["estimated hours"] == pytest.approx(48.3, abs=0.1), "its own step gives it back"
    other = est[(est["from"] == H200) & (est["gpu_type"] == H100)].iloc[0]
    h200 = data.ok[(data.ok["gpu_slug"] == H200) & (data.ok["config"] == "baseline")].iloc[0]
    assert other["estimated hours"] == pytest.approx(h200["gpu_hours_100k"], rel=1e-3), "equal FP32 datasheet peaks"
    text = workshop.estimates_text(est, tables.card_names(data.run))
    assert "48.3 h its own measured step gives" in text
    # this machine: a card's step carried by its own measured roof over the matmul measured here; a card without
    # measured roofs carries nothing, and a machine as fast as the H100's measured matmul gets its step back
    eff = workshop.efficiencies(data)
    fp32 = data.roofs.query("gpu_slug == @H100 and roof == 'fp32'")["value"].iloc[0] / 1e12
    here = workshop.here_estimates(eff, data, {"fp32": fp32})
    assert list(here["from"]) == [H100] and "efficiency" not in " ".join(here.columns)
    assert here["estimated hours here"].iloc[0] == pytest.approx(own["measured hours"])
    slower = workshop.here_estimates(eff, data, {"fp32": fp32 / 100})
    assert slower["estimated hours here"].iloc[0] == pytest.approx(100 * own["measured hours"])
    assert "100,000 optimizer steps would take about 4,831 hours here" in workshop.here_text(slower, "cpu")


def test_cards_stand_side_by_side_told_apart_by_colour(data):
    summary = report.step_summary(data.run)
    for chart in (charts.speedup(summary), charts.rel_err(report.quality_summary(data), report.QUALITY_REL_ERR)):
        spec = chart.to_dict()
        points = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "point")
        enc = points["encoding"]
        assert enc["color"]["field"] == "gpu_slug" and enc["yOffset"]["field"] == "gpu_slug"
        assert "shape" not in enc, "a card told apart by a shape hides under the other card's"
        colours = enc["color"]["scale"]["range"]
        assert len(set(colours)) == len(colours) == 2


def test_the_claims_grid_frames_a_verdict_judged_in_part_and_names_the_cards_apart(data, names):
    """A verdict judged in part (the H100's step-time halves) is a frame of its colour round a white cell, never
    filled like one judged in full; the cards head their columns by their short names, apart."""
    import vl_convert

    from medddpm.report import claims

    table = claims.verdicts(data)
    spec = charts.claims_grid(table, names=names).to_dict()
    svg = vl_convert.vegalite_to_svg({**spec, "width": 450})
    rects = re.findall(r'<g class="mark-rect role-mark[^"]*"[^>]*>(.*?)</g>', svg, re.S)
    filled, framed = (re.findall(r'<path[^>]*fill="([^"]+)"[^>]*stroke="([^"]+)"', body) for body in rects)
    part = table[table["judged"] == claims.IN_PART]
    assert len(part) >= 2 and set(part["gpu_slug"]) == {H100}
    assert len(framed) == len(part) and {f for f, _ in framed} == {"white"}
    assert {s for _, s in framed} == {charts.theme.VERDICT_COLORS[v] for v in part["verdict"]}
    assert len(filled) == len(table) - len(part), "a verdict judged in part is not a filled cell too"
    labels = _x_labels(spec, 450)
    assert sorted(lines[0] for _, lines in labels) == sorted(names.values())
    (x0, a), (x1, b) = sorted(labels)
    assert x1 - x0 > 3.2 * (len(a[0]) + len(b[0])), labels


def test_a_power_capped_run_is_named_where_the_cards_are_compared(data, names):
    notes = " ".join(card_compare.clock_notes(data, names))
    assert "`best` on the **H100 80GB HBM3** ran held down (sw power cap) in 100% of its samples" in notes
    assert "1,890 MHz against 1,980 MHz" in notes and "672 W mean against its 700 W limit" in notes
    assert "The **H200**'s runs recorded no clocks" in notes
    comp = card_compare.comparison(data)
    shown = card_compare.comparison_table(comp, card_compare.POWER_COLUMNS).set_index(["configuration", "card"])
    assert shown.loc[("best", H100), "clocks while timed"].startswith("held down")
    assert shown.loc[("baseline", H100), "clocks while timed"] == "free"
    assert (shown.xs(H200, level="card")["clocks while timed"] == card_compare.NOT_RECORDED).all()
    spec = charts.card_compare(comp).to_dict()
    assert {r["config"] for r in _rows(spec) if r.get("mark") == "capped"} == {"best"}


def test_tables_show_cards_by_short_names_and_kernels_by_theirs(data, predicted, names):
    assert names == {H100: "H100 80GB HBM3", H200: "H200"}
    judged = cards.held_against_measured(predicted[0])
    one = cards.prediction_table(judged)
    assert "A" not in one and "B" not in one, "one pair of cards is named in the text, not in every row"
    assert "H200 → H100 80GB HBM3" in cards.prediction_text(judged, names)
    back = judged.assign(from_card=H100, card=H200)  # two pairs: the cards in their own columns
    out = tables.table_html(cards.prediction_table(pd.concat([judged, back])), names=names, devices=("A", "B"))
    assert ">H100 80GB HBM3<" in out and f">{H100}<" not in out, "the long label is not a cell's text"
    assert f'title="{H100}"' in out, "the label stays a hover away"
    assert "for the **H100 80GB HBM3**, which has not run these 6" in cards.pending_text(cards.pending(predicted[0]),
                                                                                           names)
    wide = tables.table_html(cards.roofs_wide(report.roofs_view(data)), names=names)
    assert ">H100 80GB HBM3</th>" in wide and f">{H100}</th>" not in wide
    # a kernel named by the model's misses is its short name, never its C++ signature
    miss = cards.misses_table(predicted[1], data, judged.assign(error=1.0))  # every prediction taken as a miss
    assert len(miss) and miss["kernel"].str.len().max() <= 60 and not miss["kernel"].str.contains(r"\(").any()


def test_the_first_page_and_the_roofs_name_the_cards_by_their_short_names(data, names):
    """A column headed by a card, a chart's rows and legend, and the roofs' source in words: the short names, so
    that nvidia-h100-80gb-hbm3 never breaks over a header's lines."""
    import vl_convert

    from medddpm.report import claims, intro

    eff = intro.fp32_efficiency(data)
    cost = intro.training_cost(eff, 3.3e18, names)
    assert {"hours at strict FP32's pace on H100 80GB HBM3", "hours at strict FP32's pace on H200"} <= set(cost)
    assert intro.cost_text(eff, cost, names).startswith("Strict FP32 on the H100 80GB HBM3 takes 870 ms")
    beside = intro.tf32_beside_paper(claims.verdicts(data), set(), names)
    assert "measured here, H100 80GB HBM3" in beside and f"measured here, {H100}" not in beside
    head, _ = intro.headline_devices(data)
    rows = {r["row"] for r in _rows(charts.headline(head, names=names).to_dict()) if "row" in r}
    assert "H100 80GB HBM3 · best" in rows and not any(r.startswith(H100) for r in rows)
    svg = vl_convert.vegalite_to_svg({**charts.card_compare(card_compare.comparison(data), names=names).to_dict(),
                                      "width": 500})
    assert ">H100 80GB HBM3</text>" in svg and f">{H100}</text>" not in svg, "the legend names the cards"
    said = report.basis_text(data, names)
    assert "**H100 80GB HBM3** has measured its own: **H200** has not yet" in said and "[cards page]" in said
    assert "[cards page]" not in report.basis_text(data, names, here=True)
    facts = card_compare.card_facts(data, report.roofs_view(data)).set_index("")
    assert facts.loc["DRAM bandwidth, measured", H100] != "not measured yet", "measured, though read on the datasheet"


def test_a_switch_that_saves_nothing_is_not_a_memory_saving_switch(root):
    run = report.runs(root, variants=True)
    costs = report.switch_costs(run)
    precision = costs[costs["switch"] == "precision"]
    assert not ((precision["config_off"] == "fp16") & (precision["config_on"] == "bf16")).any()
    assert (costs.dropna(subset=["saved_gib"])["saved_gib"] > 0.5).all(), costs
    assert {"baseline", "opt1"} <= set(precision.loc[precision["config_on"] == "fp16", "config_off"])
    cards_ = report.memory.card_memory(run).set_index("gpu_type")
    assert cards_.loc[H100, "sold_gb"] == 80 and cards_.loc[H200, "sold_gb"] == 141
    assert math.isnan(report.memory.sold_size("NVIDIA H200")) and report.memory.sold_size("A100-SXM4-40GB") == 40


def test_floor_labels_never_print_over_each_other(data):
    floors = report.floors(data)
    spans = report.step_summary(data.run).groupby("gpu_slug")["train_p90_ms"].max().to_dict()
    placed = timing.floor_labels(floors, spans)
    h100 = placed[placed["gpu_slug"] == H100].sort_values("floor_ms")
    assert h100["floor_label"].str.contains("bf16").sum() == 1 and h100["floor_label"].str.contains("fp16").sum() == 1
    for _, g in placed.groupby(["gpu_slug", "line"]):
        gaps = g["floor_ms"].sort_values().diff().dropna() / spans[g["gpu_slug"].iloc[0]]
        assert (gaps >= timing.FLOOR_LABEL).all(), g
    assert h100["line"].nunique() > 1, "the H100's tf32 floor lies close to its bf16 and fp16 ones"
    spec = charts.step_time(report.step_summary(data.run), floors).to_dict()
    assert spec["title"]["offset"] > 6, "room above the plot for the stacked labels"


def test_a_configuration_a_card_never_ran_is_not_a_zero(data):
    counts = workshop.profiled_counts(data).set_index("configuration")
    assert counts.loc["sdpa", H100] == "not run" and counts.loc["fp16", H200] == "not run"
    assert counts.loc["baseline", H100].isdigit() and int(counts.loc["baseline", H100]) > 0
    assert not (counts == "0").any().any()
    ncu = workshop.profiled_counts(data, "ncu").set_index("configuration")
    assert ncu.loc["baseline", H100] == "none" and ncu.loc["sdpa", H100] == "not run"
    assert int(ncu.loc["opt1", H200]) > 0


def test_the_cards_compared_with_the_ratio_its_spread_and_why(data, names):
    comp = card_compare.comparison(data)
    card_compare.check_comparison(comp)
    assert card_compare.reference_card(data) == H200, "the card with counters, which the model predicts from"
    h100 = comp[comp["gpu_slug"] == H100].set_index("config")
    assert list(h100.index) == list(BOTH)
    assert h100.loc["baseline", "ratio"] == pytest.approx(1.02, abs=0.01)
    assert h100.loc["opt12", "ratio"] == pytest.approx(1.15, abs=0.01)
    assert ((h100["ratio_lo"] <= h100["ratio"]) & (h100["ratio"] <= h100["ratio_hi"])).all()
    for col in ("energy_per_step_j", "mean_power_w", "sample_s", "peak_gib"):
        assert comp[col].gt(0).all(), col
    w = card_compare.why(comp).set_index("config")
    assert w.loc["baseline", "reference_share"] == pytest.approx(0.10, abs=0.02)
    assert w.loc["opt12", "reference_share"] == pytest.approx(0.66, abs=0.02)
    cat = card_compare.category_range(data).set_index("category")
    assert 0.99 <= cat.loc["convolution", "lo"] and cat.loc["convolution", "hi"] <= 1.08
    assert cat.loc["elementwise", "lo"] >= 1.15 and cat.loc["layout", "pooled"] > 1.15
    assert cat.loc["normalization", "pooled"] == pytest.approx(1.03, abs=0.02)
    assert "normalization takes only 1.03x" in card_compare.why_text(card_compare.why(comp), cat.reset_index(), data,
                                                                     names)


def test_the_card_facts_come_from_the_rows_and_the_datasheets(data):
    facts = card_compare.card_facts(data, report.roofs_view(data)).set_index("")
    assert facts.loc["SMs (datasheet)", H100] == str(ar.DATASHEET[H100].sms)
    assert facts.loc["DRAM bandwidth, datasheet", H200] == f"{ar.DATASHEET[H200].roofs['dram'] / 1e12:.2f} TB/s"
    dram = data.roofs[(data.roofs["gpu_slug"] == H100) & (data.roofs["roof"] == "dram")]["value"].iloc[0]
    assert facts.loc["DRAM bandwidth, measured", H100].startswith(f"{dram / 1e12:.2f} TB/s")
    assert facts.loc["power limit (enforced)", H100] == "700 W"
    assert facts.loc["power limit (enforced)", H200] == card_compare.NOT_RECORDED
    assert "1,890 in a capped run" in facts.loc["SM clock while timed (median)", H100]


def test_the_estimates_of_unmeasured_cards_say_what_they_are(predicted, names):
    est, sources = cards.estimates_table(predicted[0], names)
    heads = [c for c in est.columns if c != "configuration"]
    assert heads and all(("roof part" in c) or ("whole" in c) for c in heads)
    assert any(c.startswith("A100 SXM4 80GB from H200") for c in heads)
    assert "datasheet" in sources


def test_the_comparison_charts_draw_both_cards_and_name_their_units(data):
    """The charts of the cards compared follow the book's rules (a short title flush left, every quantitative axis
    and tooltip with its unit) and draw, in vl-convert as in the book's bundle, a mark for each card."""
    import vl_convert

    comp = card_compare.comparison(data)
    built = {"card_compare": charts.card_compare(comp), "ratio_by_share": charts.ratio_by_share(card_compare.why(comp))}
    for name, chart in built.items():
        spec = chart.to_dict()
        assert spec["title"]["anchor"] == "start" and len(spec["title"]["text"]) <= 50, name
        assert all(len(line) <= 100 for line in spec["title"]["subtitle"]), name
        for unit in _units(spec):
            enc = unit.get("encoding", {})
            for channel in ("x", "y"):
                e = enc.get(channel, {})
                if e.get("type") == "quantitative" and "field" in e and e.get("title", e.get("axis", {}).get("title")):
                    assert re.search(r"\(.+\)", e.get("title") or e["axis"]["title"]), (name, e)
            tips = enc.get("tooltip", [])
            for tip in tips if isinstance(tips, list) else [tips]:
                if tip.get("type") == "quantitative":
                    assert re.search(r"\(.+\)", tip["title"]) and "format" in tip, (name, tip)
        svg = vl_convert.vegalite_to_svg({**spec, "width": 600})
        assert svg.count("<path") > 10, name
    bars = [r for r in _rows(built["card_compare"].to_dict())
            if r.get("metric") == "train_median_ms" and "gpu_slug" in r]
    assert {r["gpu_slug"] for r in bars} == {H100, H200} and len(bars) == 2 * len(BOTH)
