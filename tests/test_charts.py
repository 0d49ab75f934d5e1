"""The book's data layer and charts on CPU, fast: the real data/cpu tables plus a synthetic second GPU.

The synthetic GPU is a copy of the CPU's frames with another gpu_slug, CUDA kernel rows, TF32 that
really ran, and hand-made Nsight Compute rows, so that every chart and every claim has a GPU path.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import altair as alt
import numpy as np
import pandas as pd
import pytest

from medddpm import report
from medddpm.store import schema
from medddpm.report import card_compare, cards, charts, claims
from medddpm.configs import CONFIGS

REAL = Path(__file__).resolve().parent.parent / "data"
GPU = "nvidia-test-gpu"


@pytest.fixture(scope="module")
def real(committed_data) -> report.Data:
    if not (REAL / "cpu" / "baseline" / "run.parquet").is_file():
        pytest.skip("no data/cpu/baseline run yet")
    return committed_data


def _ncu_rows(run_id: str, names: list[str], config: str) -> pd.DataFrame:
    """Hand-made ncu rows: one launch per kernel, the headline metrics by raw name, one global rule."""
    from medddpm.analysis import ncu_table

    tc = {"baseline": 0.0, "opt1": 30.0, "opt2": 0.5, "opt12": 12.0}.get(config, 20.0)
    rows = []
    for i, name in enumerate(names):
        metrics = {
            "gpu__time_duration.sum": 1e6 / (i + 1),
            "sm__throughput.avg.pct_of_peak_sustained_elapsed": 60.0 if config != "opt2" else 25.0,
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": {"baseline": 20.0, "opt1": 45.0, "opt2": 5.0}.get(config, 30.0),
            "dram__bytes.sum.per_second": 2e12,
            "l1tex__t_sector_hit_rate.pct": {"baseline": 60.0, "opt1": 40.0}.get(config, 50.0),
            "lts__t_sector_hit_rate.pct": {"baseline": 60.0, "opt2": 85.0}.get(config, 70.0),
            ncu_table.TENSOR_PIPE_METRICS[0]: tc,
            "smsp__sass_thread_inst_executed_op_fp32_pred_on.sum": 1e9 if config == "baseline" else 1e8,
            "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 4e8,
            "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum": 1e8,
            "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum": 1e8,
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": 2.0 if config == "opt1" else 1.0,
        }
        for metric, value in metrics.items():
            rows.append({"kernel": name, "kernel_id": i, "kind": "metric", "section": "Raw", "metric": metric,
                         "value": value, "unit": "", "text": str(value), "speedup_type": ""})
        rows.append({"kernel": name, "kernel_id": i, "kind": "rule", "section": "Memory Workload Analysis",
                     "metric": "MemoryCacheAccessPattern", "value": 30.0, "unit": "%", "text": "uncoalesced",
                     "speedup_type": "global"})
    return pd.DataFrame(rows).assign(run_id=run_id)


def with_gpu(data: report.Data, slug: str = GPU, tf32_speedup: float = 4.0) -> report.Data:
    """The real data plus a synthetic GPU with every configuration (copied from the CPU baseline)."""
    base_run = data.run[(data.run["gpu_slug"] == "cpu") & (data.run["config"] == "baseline")].iloc[0]
    base_id = base_run["run_id"]
    runs, kern, qual, steps, ncu_ = [], [], [], [], []
    for i, name in enumerate(CONFIGS):
        rid = f"{slug}/{name}/20260101T000000Z"
        r = base_run.copy()
        factor = {"baseline": 1.0, "opt1": 1 / tf32_speedup, "opt2": 1.2, "opt12": 0.4}.get(name, 0.2)
        r[["run_id", "gpu_name", "gpu_slug", "config", "folder"]] = [rid, "NVIDIA Test GPU", slug, name, f"{slug}/{name}"]
        r["precision_used"] = CONFIGS[name].precision
        r["backend_flags"] = json.dumps({"cudnn_conv_fp32_precision": "ieee" if name in ("baseline", "opt2") else "tf32"})
        for c in ("train_median_ms", "train_p10_ms", "train_p90_ms", "gpu_hours_100k", "epoch_s"):
            r[c] = base_run[c] * factor
        r["energy_100k_kwh"] = r["gpu_hours_100k"] * 0.7
        r["peak_mem_bytes"] = 2**34
        runs.append(r)
        k = data.kernels[data.kernels["run_id"] == base_id].copy()
        k["run_id"], k["gpu_slug"], k["config"], k["device_type"] = rid, slug, name, "cuda"
        k["tensor_cores"] = name != "baseline" and name != "opt2"
        if name in ("opt2", "opt12"):  # channels-last: more layout time
            k.loc[k["category"] == "layout", "total_us"] *= 50
            k["share"] = k["total_us"] / k["total_us"].sum()
        kern.append(k)
        q = data.quality[data.quality["run_id"] == base_id].copy()
        q["run_id"], q["gpu_slug"], q["config"] = rid, slug, name
        q["loss"] = q["baseline_loss"] * (1 + 1e-3 * i)
        q["rel_err"] = 0.0 if name == "baseline" else 1e-3 * (i + 1)
        qual.append(q)
        s = data.steps[data.steps["run_id"] == base_id].copy()
        s["run_id"], s["gpu_slug"], s["config"] = rid, slug, name
        s.loc[s["phase"] == "train", "step_ms"] *= factor
        steps.append(s)
        top = k.sort_values("total_us", ascending=False)["kernel"].drop_duplicates().head(5).tolist()
        ncu_.append(_ncu_rows(rid, top, name).assign(gpu_slug=slug, config=name))
    measured = {"dram": 2e12, "fp32": 40e12, "tf32": 300e12, "bf16": 600e12, "fp16": 600e12}  # made-up roofs
    roofs = pd.DataFrame([{"gpu_slug": slug, "gpu_name": "NVIDIA Test GPU", "gpu_type": slug, "host": "h", "roof": r,
                           "unit": "byte/s" if r == "dram" else "FLOP/s", "value": v, "p10": v, "p90": v,
                           "repeats": 3, "size": 1, "method": "made up", "sm_clock_mhz": np.nan,
                           "mem_clock_mhz": np.nan, "driver": "", "cuda": "", "torch": "", "git_commit": "",
                           "start_time": ""} for r, v in measured.items()])
    return report.Data(run=pd.concat([data.run, pd.DataFrame(runs)], ignore_index=True),
                   steps=pd.concat([data.steps, *steps], ignore_index=True),
                   kernels=pd.concat([data.kernels, *kern], ignore_index=True),
                   ncu=pd.concat([data.ncu, *ncu_], ignore_index=True),
                   quality=pd.concat([data.quality, *qual], ignore_index=True), bench=data.bench,
                   roofs=pd.concat([data.roofs, roofs], ignore_index=True))


@pytest.fixture(scope="module")
def two(real) -> report.Data:
    return with_gpu(real)


def chart_inputs(data: report.Data) -> dict[str, tuple]:
    """What each chart of the book's pages draws from `data` (the pages' summaries), by chart: computed once for
    `draw`, which makes the charts of them with and without the CPU's rows."""
    summary = report.step_summary(data.run)
    counters = report.ncu_by_run(data.ncu, data.kernels)
    run = data.run[data.run["status"] == "ok"]
    mem = report.memory_runs(run)
    predicted, kernels = cards.predictions(data)
    comparison = card_compare.comparison(data)
    return {
        "step_time": (summary, report.beyond.floors(data)),
        "speedup": (summary,),
        "cost": (summary,),
        "bench": (data.bench,),
        "category_shares": (report.category_shares(data.kernels),),
        "top_kernels": (report.top_kernels(data.kernels),),
        "pass_split": (report.pass_split(data.kernels),),
        "tensor_pipe": (counters,),
        "instruction_mix": (counters,),
        "memory": (counters,),
        "stalls": (counters,),
        "priorities": (report.ncu_priorities(data),),
        "roofline": (report.roofline_points(data.ncu, data.run, data.roofs), report.roofs_view(data)),
        "gpu_busy": (report.gpu_busy(data),),
        "loss_curves": (data.quality,),
        "loss_difference": (data.quality,),
        "rel_err": (report.quality_summary(data), report.QUALITY_REL_ERR),
        "claims": (claims.verdicts(data),),
        "memory_peaks": (mem,),
        "memory_fits": (report.fits(report.memory_model(mem)),),
        "switch_costs": (report.switch_costs(run),),
        "card_steps": (cards.step_times(data, predicted),),
        "category_ratios": (cards.category_ratios(data, kernels),),
        "card_compare": (comparison,),
        "ratio_by_share": (card_compare.why(comparison),),
    }


CHART_OF = {"claims": charts.claims_grid}  # a chart drawn by another name than its key


def draw(inputs: dict[str, tuple], **kw) -> dict[str, alt.TopLevelMixin]:
    """Every chart of the book's pages from `chart_inputs` (each drawn from its own copy of them); `kw`
    (cpu=True) goes to each of them."""
    return {name: (CHART_OF.get(name) or getattr(charts, name))(
                *(a.copy() if isinstance(a, pd.DataFrame) else a for a in args), **kw)
            for name, args in inputs.items()}


NCU_CHARTS = {"tensor_pipe", "instruction_mix", "memory", "stalls", "priorities", "roofline", "category_ratios"}


def _datasets(spec: dict) -> list[dict]:
    rows = [r for values in spec.get("datasets", {}).values() for r in values]
    return rows + list(spec.get("data", {}).get("values", []))


def _params(spec) -> list[dict]:
    out = list(spec.get("params", []))
    for layer in spec.get("layer", []) + ([spec["spec"]] if isinstance(spec.get("spec"), dict) else []):
        out += _params(layer)
    return out


def _scales(spec, channel: str) -> list[dict]:
    found = []
    if isinstance(spec, dict):
        enc = spec.get("encoding", {}).get(channel)
        if isinstance(enc, dict) and "scale" in enc and enc.get("field") == "config":
            found.append(enc["scale"])
        for v in spec.values():
            found += _scales(v, channel)
    elif isinstance(spec, list):
        for v in spec:
            found += _scales(v, channel)
    return found


def test_charts_validate_and_hold_every_gpu(two, specs):
    for name, spec in specs.items():  # `specs`: each chart's to_dict(), which validates it against the schema
        assert spec["$schema"].startswith("https://vega.github.io/schema/vega-lite/v6"), name
        rows = _datasets(spec)
        if name in ("bench", "memory_peaks", "memory_fits", "switch_costs"):
            continue  # bench timings and peak memory exist for the committed H200 only, by construction
        # a CPU has no hardware counters; committed GPU data (data/nvidia-h200) comes along
        have = set(two.ncu["gpu_slug"]) if name in NCU_CHARTS else set(two.run["gpu_slug"])
        if name == "speedup":  # a speedup needs the device's baseline run
            have = set(two.ok.loc[two.ok["config"] == "baseline", "gpu_slug"])
        want = {GPU} | (have - {"cpu"})
        slugs = {r.get("gpu_slug") for r in rows}
        if name == "ratio_by_share":  # a point per card against the reference card, which stands in each point
            slugs |= {r.get("reference") for r in rows}
        assert want <= slugs and "cpu" not in slugs, f"{name}: GPUs in chart data {slugs}"
        gpu_params = [p for p in _params(spec) if p.get("name") == "gpu"]
        for p in gpu_params:  # the dropdown offers every GPU of the data, a GPU first
            assert set(p["bind"]["options"]) == want and p["value"] != "cpu", name
        assert len(json.dumps(spec)) < 400_000, f"{name}: chart too heavy"


def test_config_colour_is_fixed_and_covers_every_config(specs):
    scale = charts.config_color().to_dict()
    assert scale["domain"][:len(CONFIGS)] == list(CONFIGS)
    assert len(set(scale["range"])) == len(scale["domain"])
    for name, spec in specs.items():
        for s in _scales(spec, "color"):
            assert set(CONFIGS) <= set(s["domain"]), name
            assert s["range"][:len(CONFIGS)] == scale["range"][:len(CONFIGS)], name
    extra = charts.config_color(["baseline", "mine"]).to_dict()
    assert extra["domain"][-1] == "mine" and extra["range"][:len(CONFIGS)] == scale["range"][:len(CONFIGS)]


def test_charts_without_ncu_say_so(real):
    data = report.Data(run=real.run, steps=real.steps, kernels=real.kernels, ncu=real.ncu.iloc[0:0], quality=real.quality)
    for build in (charts.tensor_pipe, charts.memory, charts.stalls, charts.instruction_mix):
        spec = build(report.ncu_by_run(data.ncu, data.kernels)).to_dict()
        assert "no Nsight Compute" in json.dumps(spec)


def test_summaries_and_checks(two):
    s = report.step_summary(two.run)
    report.check_speedups(report.speedups(two.run))
    assert np.isclose(s.loc[(s["gpu_slug"] == GPU) & (s["config"] == "opt1"), "speedup"].iloc[0], 4.0)
    report.check_strict_baseline(two)
    report.check_shares(two.kernels)
    report.check_medians(two)
    sh = report.category_shares(two.kernels)
    assert np.allclose(sh.groupby(["gpu_slug", "config"])["share"].sum(), 1.0)
    bad = two.kernels.copy()
    bad.loc[(bad["config"] == "baseline") & (bad["gpu_slug"] == GPU), "tensor_cores"] = True
    with pytest.raises(AssertionError, match="tensor-core"):
        report.check_strict_baseline(report.Data(two.run, two.steps, bad, two.ncu, two.quality))
    with pytest.raises(AssertionError, match="positive"):
        report.check_speedups(pd.DataFrame({"gpu_slug": ["x"], "config": ["opt1"], "speedup": [np.inf]}))


# ------------------------------------------------------------------------------------ loading


def _tree(tmp_path: Path, real_root: Path = REAL) -> Path:
    root = tmp_path / "data"
    shutil.copytree(real_root / "cpu" / "baseline", root / "cpu" / "baseline")
    (root / "cpu" / "notes").mkdir()
    (root / "cpu" / "notes" / "README.md").write_text("not a run")
    return root


def test_load_adds_keys_and_ignores_non_runs(real, tmp_path, monkeypatch):
    root = _tree(tmp_path)
    monkeypatch.setenv("MEDDDPM_DATA", str(root))
    assert report.data_root() == root
    k = report.load("kernels")
    assert {"gpu_slug", "config"} <= set(k.columns) and set(k["config"]) == {"baseline"}
    assert report.load("ncu").empty and "gpu_slug" in report.load("ncu")
    assert [p.name for p in report.scan().not_runs] == ["notes"]


def test_load_errors_name_the_folder(real, tmp_path):
    with pytest.raises(report.DataError, match="no data tree"):
        report.load("run", tmp_path / "nowhere")
    root = _tree(tmp_path)
    half = root / "cpu" / "opt1"
    half.mkdir()
    shutil.copy(root / "cpu" / "baseline" / "steps.parquet", half / "steps.parquet")
    with pytest.warns(report.DataWarning, match=r"incomplete run .*cpu/opt1"):
        report.load("steps", root)
    shutil.rmtree(half)
    shutil.copytree(root / "cpu" / "baseline", root / "cpu" / "moved")
    with pytest.warns(report.DataWarning, match="folder says cpu/moved"):
        report.runs(root)
    shutil.rmtree(root / "cpu" / "moved")
    schema.write_table(pd.DataFrame({"x": [1]}).pipe(lambda d: schema.empty("quality")), root / "cpu" / "baseline" /
                       "quality.parquet", "quality")
    assert report.load("quality", root).empty
    pd.DataFrame({"run_id": ["x"]}).to_parquet(root / "cpu" / "baseline" / "quality.parquet")
    with pytest.warns(report.DataWarning, match="quality.parquet"):
        report.load("quality", root)


def test_roofline_points_take_a_kernel_s_launches_together(monkeypatch):
    # two launches of one kernel (a layer profiled twice by the library pass) and one of another; FLOPs over
    # bytes and time of the two together, tensor pipe weighted by the launches ncu gave it for
    per_launch = pd.DataFrame({
        "gpu_slug": "g", "config": "bf16", "kernel_id": [0, 1, 2, 3], "kernel": ["conv", "conv", "add", "x" * 200],
        "duration_ns": [1e6, 3e6, 1e5, 1e5], "flop_fp32": [4e9, 4e9, 1e6, 1e6], "flop_fp16": 0.0, "flop_fp64": 0.0,
        "dram_bytes_per_s": [1e12, 1e12, 2e12, 2e12], "tensor_pipe_pct": [40.0, np.nan, 0.0, 0.0]})
    per_launch = pd.concat([per_launch, per_launch.iloc[[3]].assign(kernel_id=4, kernel="x" * 199 + "y")])
    monkeypatch.setattr(report.counters, "ncu_kernels", lambda ncu_df: per_launch)
    p = report.roofline_points(pd.DataFrame())
    assert (p["kernel"] == "x" * 160).sum() == 2 and p["launches"].sum() == 5  # alike in their labels, apart
    p = p.set_index("kernel").drop("x" * 160)
    assert p.loc["conv", "launches"] == 2 and p.loc["add", "launches"] == 1
    assert p.loc["conv", "intensity"] == pytest.approx(8e9 / 4e9)  # 8 GFLOP over 1 GB + 3 GB (1 TB/s, 4 ms)
    assert p.loc["conv", "flops_per_s"] == pytest.approx(8e9 / 4e-3)
    assert p.loc["conv", "tensor_pipe_pct"] == pytest.approx(40.0)
    assert p.loc["add", "intensity"] == pytest.approx(1e6 / 2e8)


def _bench_doc(phase: str | None = "train", **run) -> dict:
    """What `python -m medddpm bench --json` records, for two runs: ours and the reference's in strict FP32."""
    runs = [{"config": "opt1", "step_ms": [2.0, 1.9, 2.1, 2.0, 2.0], "peak_mem_bytes": 2**30,
             "backend_flags": {"cudnn_conv_fp32_precision": "tf32"}} | run,
            {"config": "reference-fp32", "step_ms": [3.0] * 4, "peak_mem_bytes": None}]
    return {"environment": {"gpu_name": "cpu", "torch": "x", "git_commit": "abc", "time_utc": "t"},
            "spec": {"size": 128, "mask_channels": 3, "base_channels": 64}, "runs": runs} | (
        {"phase": phase} if phase else {})


def test_bench_tables_are_read_from_non_run_folders(real, tmp_path):
    from medddpm.measure.timing.bench import write_bench

    root = _tree(tmp_path)
    notes = root / "cpu" / "notes"
    write_bench(notes, _bench_doc(), source="run 1")
    write_bench(notes, _bench_doc("sample", config="best"), source="denoising")
    assert [p.name for p in report.scan(root).not_runs] == ["notes"]  # bench.parquet alone: not a run
    b = report.bench_runs(root)
    cols = ["gpu_slug", "phase", "config", "implementation", "train_median_ms", "train_p10_ms", "timed_steps"]
    assert b[cols].values.tolist() == [
        ["cpu", "train", "baseline", "reference (mobaidoctor/med-ddpm)", 3.0, 3.0, 4],  # in configuration order
        ["cpu", "train", "opt1", "ours", 2.0, pytest.approx(1.94), 5]]
    assert list(b["peak_mem_bytes"]) == [-1, 2**30] and list(b["fp32_math"]) == ["", "tf32"]
    assert b["sample_step_median_ms"].isna().all() and set(b["source"]) == {"run 1"}
    s = report.bench_runs(root, phase="sample")
    assert list(s["source"]) == ["denoising"] * 2 and s["train_median_ms"].isna().all()
    assert list(s["sample_step_median_ms"]) == [3.0, 2.0]
    assert len(report.bench_runs(root, phase=None)) == 4
    with pytest.raises(AssertionError, match="not a micro-step"):
        charts.bench(report.bench_runs(root, phase=None))
    with pytest.raises(ValueError, match="phase must be one of"):
        report.bench_runs(root, phase="training")
    write_bench(root / "gpu-x" / "reference", _bench_doc(), source="run 1")  # rows of "cpu" under gpu-x
    with pytest.warns(report.DataWarning, match="bench.parquet: rows of another GPU than its path says"):
        report.bench_runs(root)


def test_the_bench_writes_its_table_beside_the_json(tmp_path):
    """`bench --out DIR`: DIR/bench.parquet, validated; a second invocation replaces the rows of its own source and
    keeps the others'; the summaries are those of the recorded steps under the run table's names."""
    from medddpm.measure.timing.bench import bench_rows, write_bench

    doc = _bench_doc()
    path = write_bench(tmp_path, doc, source="a")
    assert path == tmp_path / "bench.parquet" and not list(tmp_path.glob(".*tmp"))
    write_bench(tmp_path, doc, source="b")
    write_bench(tmp_path, _bench_doc(config="opt12"), source="a")
    back = schema.read_table(path, "bench")
    assert list(back.columns) == list(schema.TABLES["bench"])
    assert sorted(zip(back["source"], back["config"])) == [("a", "baseline"), ("a", "opt12"), ("b", "baseline"),
                                                           ("b", "opt1")]
    rows = bench_rows(doc, source="a")
    assert rows.loc[0, "train_median_ms"] == 2.0 and rows.loc[0, "train_p90_ms"] == pytest.approx(2.06)
    with pytest.raises(ValueError, match="train or sample"):
        bench_rows(doc | {"phase": "both"}, source="a")


def _ablated(root: Path, config: str, ms: float, spread: float = 0.02, **row) -> None:
    """A copy of cpu/best as the ablation's run of `config` (its switches as the name defines them), median `ms`."""
    from medddpm.configs import get_config

    dest = root / "cpu" / "ablation" / config
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(root / "cpu" / "best", dest)
    df = schema.read_table(dest / "run.parquet", "run")
    flags = get_config(config).flags
    df[list(flags)] = list(flags.values())
    p10 = ms * max(0.0, 1 - spread / 2)  # a time is never negative: a wider spread lies above the median
    df[["config", "run_id", "train_median_ms", "train_p10_ms", "train_p90_ms"]] = [
        config, f"cpu/ablation/{config}/x", ms, p10, p10 + ms * spread]
    for k, v in row.items():
        df[k] = v
    schema.write_table(df, dest / "run.parquet", "run")


def test_the_ablation_says_what_each_lever_buys_beyond_the_noise(real, tmp_path):
    if not (REAL / "cpu" / "best" / "run.parquet").is_file():
        pytest.skip("no data/cpu/best run")
    root = _tree(tmp_path)
    shutil.copytree(REAL / "cpu" / "best", root / "cpu" / "best")
    t = report.runs(root).set_index("config").loc["best", "train_median_ms"]
    _ablated(root, "best", 1.01 * t)  # the main run and the ablation's lie 1% apart
    _ablated(root, "best+compile=false", 3 * t)
    _ablated(root, "best+tap_gemm=false", 1.015 * t)  # within the runs' own 2% spread
    _ablated(root, "best+pad_channels=false", 0.8 * t)  # faster without: the lever costs
    _ablated(root, "best+fused_adam=false", math.nan, status="oom", message="train: OutOfMemoryError")
    abl = report.ablation_runs(root)
    assert sorted(abl["config"]) == sorted(["best", "best+compile=false", "best+tap_gemm=false",
                                            "best+pad_channels=false", "best+fused_adam=false"])
    assert sorted(report.runs(root)["config"]) == ["baseline", "best"], "the ablation's runs are not main runs"
    s = report.ablation_summary(abl, report.runs(root)).set_index("lever")
    assert s["verdict"].to_dict() == {"compile=false": "buys", "tap_gemm=false": "not told apart",
                                      "pad_channels=false": "costs", "fused_adam=false": "failed"}
    assert s.loc["compile=false", "saved_ms"] == pytest.approx(3 * t - 1.01 * t)
    assert s.loc["compile=false", "rerun"] == pytest.approx(0.01)
    assert s.loc["tap_gemm=false", "noise"] == pytest.approx(0.02)
    # without the main run, the noise is the runs' own spread; a wider one turns a lever into noise
    s2 = report.ablation_summary(abl).set_index("lever")
    assert s2["rerun"].isna().all() and s2.loc["tap_gemm=false", "verdict"] == "not told apart"
    _ablated(root, "best+compile=false", 3 * t, spread=5.0)
    assert report.ablation_summary(report.ablation_runs(root)).set_index("lever").loc["compile=false", "verdict"] \
        == "not told apart"
    spec = charts.ablation(s.reset_index(), cpu=True).to_dict()
    drawn = {r["lever"] for d in spec["datasets"].values() for r in d}
    assert drawn == {"compile=false", "tap_gemm=false", "pad_channels=false"}, "a failed variant has no bar"
    assert "No ablation" in json.dumps(charts.ablation(s.reset_index().iloc[:0]).to_dict())
    shutil.copytree(root / "cpu" / "ablation" / "best", root / "cpu" / "ablation" / "opt1")
    with pytest.warns(report.DataWarning, match="run.parquet says cpu/ablation/best"):
        report.ablation_runs(root)


def test_ncu_coverage_says_what_the_counters_stand_for(real):
    cov = report.ncu_coverage(real)
    if cov.empty:
        pytest.skip("no GPU run with Nsight Compute in data/")
    assert (cov["selected"] >= 0.8 - 1e-9).all() and cov["profiled"].between(0, 1).all()
    # keep one profiled kernel: the coverage becomes that kernel's share of the step, nothing more
    run_id = real.ncu["run_id"].iloc[0]
    ncu_df = real.ncu[real.ncu["run_id"] == run_id]
    one = ncu_df[ncu_df["kernel"] == ncu_df["kernel"].iloc[0]]
    k = real.kernels[real.kernels["run_id"] == run_id]
    from medddpm.analysis import ncu_names, ncu_table

    share = ncu_table.covered(k, ncu_names.match_kernel(one["kernel"].iloc[0], k["kernel"].unique().tolist()))
    less = report.ncu_coverage(report.Data(run=real.run, steps=real.steps, kernels=real.kernels, ncu=one, quality=real.quality))
    assert 0 < share < 1 and less["profiled"].iloc[0] == pytest.approx(share)
    assert less["profiled"].iloc[0] <= cov.loc[cov["config"] == one["config"].iloc[0], "profiled"].iloc[0]


def test_uncounted_runs_are_the_gpu_runs_without_counters(real):
    none = report.uncounted_runs(real)
    gpu = real.run[(real.run["gpu_name"] != "cpu") & (real.run["status"] == "ok")]
    listed = set(report.ncu_coverage(real)["config"] + "@" + report.ncu_coverage(real)["gpu_slug"])
    assert set(none["config"] + "@" + none["gpu_slug"]) == set(gpu["config"] + "@" + gpu["gpu_slug"]) - listed
    # drop one run's counters: it is listed, and no CPU run ever is
    run_id = real.ncu["run_id"].iloc[0] if not real.ncu.empty else pytest.skip("no GPU run with Nsight Compute")
    fewer = report.uncounted_runs(report.Data(run=real.run, steps=real.steps, kernels=real.kernels,
                                      ncu=real.ncu[real.ncu["run_id"] != run_id], quality=real.quality))
    assert len(fewer) == len(none) + 1 and (fewer["gpu_slug"] != "cpu").all()


def test_launching_ops_says_who_makes_the_copies():
    k = pd.DataFrame({"gpu_slug": "g", "config": ["a"] * 4 + ["b"], "category": ["layout"] * 3 + ["convolution", "layout"],
                      "op": ["aten::convolution_backward", "aten::convolution_backward", "aten::contiguous", "aten::conv3d", ""],
                      "calls": [10, 4, 2, 8, 6], "total_us": [60.0, 20.0, 20.0, 500.0, 30.0], "micro_steps": 2})
    got = report.launching_ops(k)
    a = got[got["config"] == "a"]
    assert a["op"].tolist() == ["aten::convolution_backward", "aten::contiguous"]  # the convolution is not layout
    assert a["calls_per_step"].tolist() == [7.0, 1.0] and a["us_per_step"].tolist() == [40.0, 10.0]
    assert a["share"].tolist() == pytest.approx([0.8, 0.2])
    assert got.loc[got["config"] == "b", "op"].tolist() == [report.UNRECORDED_OP]
    assert report.launching_ops(k, n=1)["rank"].max() == 1 and report.launching_ops(k.iloc[:0]).empty


def test_gpu_busy_is_kernel_time_over_step_time(real):
    run = real.run[real.run["status"] == "ok"].iloc[[0]].assign(train_median_ms=0.25, dispatch_median_ms=0.25)
    k = real.kernels[real.kernels["run_id"] == run["run_id"].iloc[0]].iloc[:2].assign(total_us=[300.0, 100.0], micro_steps=2)
    data = report.Data(run=run, steps=real.steps, kernels=k, ncu=real.ncu, quality=real.quality)
    busy = report.gpu_busy(data)
    assert len(busy) == 1 and busy.loc[0, "kernel_ms"] == pytest.approx(0.2) and busy.loc[0, "busy"] == pytest.approx(0.8)
    assert report.gpu_busy(report.Data(run=run, steps=real.steps, kernels=k.iloc[:0], ncu=real.ncu, quality=real.quality)).empty
    # kernels that overlap sum to more than the step: the device is busy the whole step, not more
    over = report.gpu_busy(report.Data(run=run.assign(train_median_ms=0.15), steps=real.steps, kernels=k, ncu=real.ncu,
                               quality=real.quality))
    assert over.loc[0, "kernel_ms"] == pytest.approx(0.2) and over.loc[0, "busy"] == 1.0
    # every real run: the kernel time stands beside its own step time, as a share of at most all of it
    b = report.gpu_busy(real)
    np.testing.assert_allclose(b["busy"] * b["train_median_ms"], b["kernel_ms"].clip(upper=b["train_median_ms"]))
    assert b["busy"].between(0.3, 1.0).all(), b


# ------------------------------------------------------------------------- what an expert checks first


def _units(spec):
    """Every unit view (a dict with a mark) of a spec, layered, faceted or not."""
    if isinstance(spec, dict):
        if "mark" in spec:
            yield spec
        for v in spec.values():
            yield from _units(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from _units(v)


def _mark(unit: dict) -> str:
    return unit["mark"] if isinstance(unit["mark"], str) else unit["mark"]["type"]


def _tooltips(unit: dict) -> list[dict]:
    tip = unit.get("encoding", {}).get("tooltip", [])
    return tip if isinstance(tip, list) else [tip]


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """sRGB hex -> CIELAB (D65)."""
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz]
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _closest(colours: list[str]) -> float:
    """The smallest CIELAB distance between two of `colours` (about 10 or less: a reader mixes them up)."""
    import itertools
    import math

    return min(math.dist(_lab(a), _lab(b)) for a, b in itertools.combinations(colours, 2))


@pytest.fixture(scope="module")
def inputs(two) -> dict[str, tuple]:
    """What every chart of `two` draws (`chart_inputs`), computed once for the module: the pages' summaries are
    its most expensive step."""
    return chart_inputs(two)


@pytest.fixture(scope="module")
def specs(inputs) -> dict[str, dict]:
    """Every chart of `two` as its Vega-Lite dict (to_dict() validates it against the schema), made once for the
    tests that read them."""
    assert charts.setup() is None
    return {name: chart.to_dict() for name, chart in draw(inputs).items()}


def test_gpu_views_leave_cpu_rows_out_unless_asked(two, inputs, specs):
    for name, spec in specs.items():
        assert '"cpu"' not in json.dumps(spec), f"{name}: a CPU row, option or legend entry in a GPU view"
    assert charts.is_cpu("cpu") and charts.is_cpu("cpu-my-laptop") and not charts.is_cpu("nvidia-h200")
    asked = {name: chart.to_dict() for name, chart in draw(inputs, cpu=True).items()}
    for name, spec in specs.items():
        # no CPU rows exist: counters, bench timings and peak memory are a GPU's, and cards are GPUs
        if name not in NCU_CHARTS | {"bench", "memory_peaks", "memory_fits", "switch_costs", "card_steps",
                                     "category_ratios", "card_compare", "ratio_by_share"}:
            assert "cpu" in {r.get("gpu_slug") for r in _datasets(asked[name])}, f"{name}: cpu=True drops the CPU"
    # data of a CPU only: the chart says why it is empty instead of drawing the CPU
    cpu_only = report.step_summary(two.run[two.run["gpu_slug"] == "cpu"])

    def said(chart) -> str:  # a message's lines joined
        return json.dumps(chart.to_dict()).replace("\\n", " ")

    assert "CPU runs only" in said(charts.step_time(cpu_only))
    assert "cpu" in json.dumps(charts.step_time(cpu_only, cpu=True).to_dict())
    scaling = pd.DataFrame({"gpu_slug": ["cpu"] * 2, "config": "sdpa", "backend": "gloo", "world_size": [1, 2],
                            "samples_per_s": [20.0, 25.0], "ideal_samples_per_s": [20.0, 40.0], "efficiency": [1, 0.6],
                            "step_median_ms": 50.0, "rank_min_ms": 49.0, "rank_max_ms": 51.0})
    assert "CPU runs only" in said(charts.scaling(scaling))
    assert {r["world_size"] for r in _datasets(charts.scaling(scaling, cpu=True).to_dict())} == {1, 2}


def test_bar_lengths_are_drawn_on_linear_axes_from_zero(specs):
    bars = 0
    for name, spec in specs.items():
        for unit in _units(spec):
            if _mark(unit) != "bar":
                continue
            for channel in ("x", "y"):
                enc = unit.get("encoding", {}).get(channel, {})
                if enc.get("type") != "quantitative":
                    continue
                bars += 1
                scale = enc.get("scale", {})
                assert scale.get("type", "linear") == "linear", f"{name}: bar lengths on a {scale['type']} axis"
                assert scale.get("zero", True) is not False, f"{name}: bars that do not start at zero"
                assert "domain" not in scale or scale["domain"][0] == 0, f"{name}: bars from {scale['domain'][0]}"
    assert bars >= 10


def test_memory_is_in_gib_with_the_cards_on_the_axis(specs):
    for name in ("memory_peaks", "memory_fits"):
        text = json.dumps(specs[name])
        assert " GB" not in text and "GiB" in text, f"{name}: card sizes in GB beside GiB"
    cards = [r for r in _datasets(specs["memory_peaks"]) if "card_gib" in r]
    peaks = [r for r in _datasets(specs["memory_peaks"]) if "peak_gib" in r]
    top = max(max(r["peak_gib"], r["reserved_gib"] or 0) for r in peaks)
    assert cards and max(c["card_gib"] for c in cards) >= top, "the axis ends before the largest peak"
    # a card is drawn at the memory its driver reports, labelled with it in GiB, never at its sold size in GB
    assert all(c["card"].endswith(f"{c['card_gib']:.1f} GiB") for c in cards), cards
    assert not {c["card_gib"] for c in cards} & {c.sold_gb for c in report.memory.CARDS}, "a card at its sold size"
    assert sorted(c["card_gib"] for c in cards if c["card_gib"] >= top)[:1] == [max(c["card_gib"] for c in cards)], \
        "cards far beyond every peak squeeze the bars"


def test_where_to_optimize_first_ranks_the_largest_saving_first(inputs, specs):
    prio = inputs["priorities"][0].sort_values("priority")  # smallest first, as a table may well be ordered
    rows = pd.DataFrame(_datasets(charts.priorities(prio).to_dict()))
    assert len(rows) > 3
    for _, g in rows.groupby(["gpu_slug", "config"]):
        g = g.sort_values("rank")
        assert list(g["rank"]) == list(range(1, len(g) + 1))
        assert g["priority_pct"].is_monotonic_decreasing, "rank 1 is not the largest estimated saving"
        assert g["label"].iloc[0].startswith(" 1. ")
    y = next(u for u in _units(specs["priorities"]) if _mark(u) == "bar")["encoding"]["y"]
    assert y["sort"] == {"field": "rank", "order": "ascending"}


COUNTS = {"optimizer step", "ranks", "rank", "timed steps", "largest batch", "batch", "profiled launches"}
UNITLESS = COUNTS | {"calls per step", "L1 loss", "instructions per step", "cycles per issued instruction",
                     "relative L2 error"}  # counts and ratios: what they count is their name


def test_axes_and_tooltips_name_their_units(specs):
    """A quantitative axis or tooltip names its unit in parentheses (ms, %, GiB, ×, TFLOP/s...), or is a count;
    a radio-chosen metric's axis title follows the choice; durations never as raw microseconds."""
    checked = 0
    for name, spec in specs.items():
        text = json.dumps(spec)
        assert "value of the chosen metric" not in text and "as chosen" not in text, name
        units = list(_units(spec))
        for channel in ("x", "y"):
            axes = [u["encoding"][channel] for u in units if u.get("encoding", {}).get(channel, {}).get("type")
                    == "quantitative" and "field" in u["encoding"][channel]]
            if not axes:
                continue
            assert not any(str(e["field"]).endswith("_us") for e in axes), f"{name}: a {channel} axis in microseconds"
            # a layer's axis title names the axis its layers share
            titles = [t for e in axes if (t := e.get("axis", {}).get("title", e.get("title"))) is not None]
            if not titles:  # a radio-chosen metric: its axis title is drawn by a text layer of the same chart
                chosen = [r["axis_title"] for r in _datasets(spec) if "axis_title" in r]
                assert chosen and all(re.search(r"\(.+\)", c) for c in chosen), f"{name}: {channel} axis {chosen}"
                continue
            for t in titles:
                checked += 1
                assert re.search(r"\(.+\)", t) or t in UNITLESS, f"{name}: {channel} axis '{t}' names no unit"
        for unit in units:
            for tip in _tooltips(unit):
                if tip.get("type") != "quantitative":
                    continue
                checked += 1
                title = tip.get("title", tip["field"])
                assert not tip["field"].endswith("_us"), f"{name}: tooltip {title!r} in raw microseconds"
                assert re.search(r"\(.+\)", title) or title in UNITLESS, f"{name}: tooltip {title!r} names no unit"
                assert "format" in tip, f"{name}: tooltip {title!r} unformatted (299.0 for a count)"
                if title in COUNTS:
                    assert tip["format"] == "d", f"{name}: the count {title!r} is not shown as an integer"
    assert checked > 80


def test_counts_use_si_prefixes_on_a_log_axis(specs):
    """Strict FP32 executes orders of magnitude more instructions than TF32: on a linear axis TF32's would be a
    sliver, so the counts sit on a log axis, labelled with SI prefixes."""
    points = next(u for u in _units(specs["instruction_mix"]) if _mark(u) == "point")["encoding"]
    assert "~s" in points["x"]["axis"]["labelExpr"], "instruction counts as raw integers (40,000,000,000,000)"
    assert points["x"]["scale"]["type"] == "log"
    assert any(t.get("format") == ".3~s" for t in points["tooltip"])
    totals = next(u for u in _units(specs["instruction_mix"]) if _mark(u) == "tick")["encoding"]
    assert any("strict FP32" in t.get("title", "") for t in totals["tooltip"])


def test_categorical_colours_do_not_repeat(specs):
    cfg = charts.config_color(list(CONFIGS) + [f"extra{i}" for i in range(16)]).to_dict()
    assert len(set(cfg["range"])) == len(cfg["range"]) == len(CONFIGS) + 16
    assert _closest(cfg["range"][:20]) > 20, "two configurations' colours are hard to tell apart"
    assert _closest(charts.CATEGORY_COLORS) > 15
    for name, spec in specs.items():
        for unit in _units(spec):
            colour = unit.get("encoding", {}).get("color", {})
            if colour.get("type") != "nominal" or "field" not in colour:
                continue
            scale = colour.get("scale", {})
            assert "range" in scale and "scheme" not in scale, f"{name}: colours from a scheme that repeats or pairs"
            assert len(set(scale["range"])) == len(scale["range"]) >= len(scale.get("domain", [])), name
            legend = colour.get("legend") or {}
            assert len(legend.get("values", scale.get("domain", []))) <= 20, f"{name}: too many colours to tell apart"
    for name in ("stalls", "instruction_mix"):  # nineteen stall reasons: nine and "other"
        rows = _datasets(specs[name])
        field = "reason" if name == "stalls" else "class"
        shown = {r[field] for r in rows if field in r}
        assert len(shown) <= 10, f"{name}: {len(shown)} colours"


def test_titles_fit_and_start_flush_left(specs):
    for name, spec in specs.items():
        t = spec.get("title")
        if t is None:
            continue  # a chart that says why it is empty
        assert isinstance(t, dict) and t.get("anchor") == "start", f"{name}: a centred title runs off a narrow chart"
        assert len(t["text"]) <= 50, f"{name}: title {t['text']!r} too long"
        for line in t.get("subtitle", []) if isinstance(t.get("subtitle"), list) else [t.get("subtitle", "")]:
            assert len(line) <= 100, f"{name}: subtitle {line!r} too long"


def test_loss_difference_draws_a_panel_per_configuration(specs):
    spec = specs["loss_difference"]
    assert spec["facet"]["field"] == "config" and spec["columns"] >= 3
    assert spec.get("resolve", {}).get("scale", {}).get("y", "shared") == "shared", "panels on different scales"
    assert [_mark(u) for u in _units(spec)] == ["rule", "line"]
    width = spec["columns"] * spec["spec"]["width"] + (spec["columns"] - 1) * spec["spacing"]["column"]
    assert width + 80 <= 700, f"{width} px of panels and their axis overflow the page's column"


def _svg_axes(spec: dict, width: int, axis: str = "X") -> tuple[list[list[tuple[float, str, str]]], str]:
    """The labels of each X or Y axis of the chart drawn `width` pixels wide (vl-convert, as the book's bundle
    draws them; a faceted chart has one per panel): position along the axis, text and text anchor, in order
    (top to bottom for Y); and the SVG."""
    import xml.etree.ElementTree as ET

    vlc = pytest.importorskip("vl_convert")
    spec = json.loads(json.dumps(spec).replace('"width": "container"', f'"width": {width}'))
    svg = vlc.vegalite_to_svg(spec)
    ns = {"s": "http://www.w3.org/2000/svg"}
    axes = []
    for g_axis in ET.fromstring(svg).iterfind(".//s:g[@aria-roledescription='axis']", ns):
        if not g_axis.get("aria-label", "").startswith(f"{axis}-axis"):
            continue
        labels = []
        for g in g_axis.iterfind(".//s:g", ns):
            if "role-axis-label" in g.get("class", ""):
                for t in g.iterfind("s:text", ns):
                    if t.get("opacity") == "0":
                        continue  # hidden by Vega's own label-overlap removal
                    x, y = map(float, re.match(r"translate\(([-\d.]+),([-\d.]+)", t.get("transform")).groups())
                    labels.append((x if axis == "X" else y, t.text or "", t.get("text-anchor", "middle")))
        axes.append(sorted(labels))
    return axes, svg


def _svg_labels(spec: dict, width: int, axis: str = "X") -> tuple[list[tuple[float, str]], str]:
    """The first X or Y axis's labels (position, text), in order, and the SVG."""
    axes, svg = _svg_axes(spec, width, axis)
    return [(pos, text) for pos, text, _ in (axes[0] if axes else [])], svg


def _extent(pos: float, text: str, anchor: str) -> tuple[float, float]:
    """Where a 10 px sans-serif label spans on its axis (about 5.6 px a character)."""
    w = 5.6 * len(text)
    return {"start": (pos, pos + w), "end": (pos - w, pos)}.get(anchor, (pos - w / 2, pos + w / 2))


def test_x_axis_labels_do_not_collide_in_a_narrow_column(specs):
    """Every chart drawn 360 px wide: no two x-axis labels overlap, the last one flush with the axis end
    included (a linear axis's ticks every 20 put '220' against a flush '240')."""
    for name, spec in specs.items():
        for labels in _svg_axes(spec, 360)[0]:
            shown = [_extent(*lab) for lab in labels if lab[1]]
            for (a0, a1), (b0, b1) in zip(shown, shown[1:]):
                assert b0 >= a1 - 1, f"{name}: x labels overlap at 360 px: {[t for _, t, _ in labels]}"


def test_rankings_read_largest_first_as_drawn(inputs):
    """What a reader sees, top to bottom: rank 1 is the largest estimated saving, the ablation's largest lever on
    top (layers that share a y scale quietly drop a sort by field)."""
    prio = inputs["priorities"][0].sort_values("priority")
    labels = [t for _, t in _svg_labels(charts.priorities(prio).to_dict(), 500, "Y")[0]]
    assert [int(t.split(".")[0]) for t in labels] == list(range(1, len(labels) + 1)), labels
    abl = pd.DataFrame({"gpu_slug": GPU, "preset": "paper", "lever": ["a", "b", "c"], "base_ms": 10.0,
                        "train_median_ms": [11.0, 30.0, 12.0], "train_p10_ms": 9.0, "train_p90_ms": 31.0,
                        "saved_ms": [1.0, 20.0, 2.0], "ratio": 1.1, "noise": 0.01, "verdict": "buys"})
    assert [t for _, t in _svg_labels(charts.ablation(abl).to_dict(), 500, "Y")[0]] == ["b", "c", "a"]


def test_roofline_names_its_roofs_and_its_x_labels_do_not_collide(specs):
    labels, svg = _svg_labels(specs["roofline"], 320)  # a phone's column
    shown = [(x, t) for x, t in labels if t]
    assert len(shown) >= 3
    for (xa, a), (xb, b) in zip(shown, shown[1:]):
        assert xb - xa >= 3.2 * (len(a) + len(b)) + 4, f"x labels {a!r} and {b!r} collide at 320 px"
    assert "memory roof" in svg and "TB/s" in svg, "the memory roof has no label"

    # the H200's roofs: no measurement committed, so its datasheet's, one label per distinct rate
    rates = {v for r, (v, _) in report.peaks_of("nvidia-h200").items()}
    # the text marks' lines: a label of one line is a <text>, of several a <tspan> each (aria labels repeat them)
    drawn = re.findall(r"<tspan[^>]*>([^<]*)</tspan>", svg) + re.findall(r"<text[^>]*>([^<]+)</text>", svg)
    assert sum(t.startswith("compute roof") for t in drawn) == len(rates) >= 3, drawn
    assert sum(t.endswith(" TFLOP/s") for t in drawn) == len(rates), drawn
    assert all("(datasheet)" in t for t in drawn if t.startswith(("compute roof", "memory roof"))), drawn


def test_a_machine_kept_beside_ours_has_the_peaks_of_its_device_type(real):
    """A run under `nvidia-h200-<host>` (measured beside the committed H200 rows) is floored by the H200's
    peaks; a label whose rows name no device type with known peaks gets none."""
    h200 = real.run[real.run["gpu_slug"] == "nvidia-h200"]
    if h200.empty:
        pytest.skip("no committed H200 rows")
    mine = h200.assign(gpu_slug="nvidia-h200-box", gpu_type="nvidia-h200",
                       run_id=h200["run_id"].str.replace("nvidia-h200/", "nvidia-h200-box/", regex=False))
    other = h200.assign(gpu_slug="nvidia-x-box", gpu_type="nvidia-x",
                        run_id=h200["run_id"].str.replace("nvidia-h200/", "nvidia-x-box/", regex=False))
    f = report.beyond.floors(report.Data(**{**real.__dict__, "run": pd.concat([real.run, mine, other], ignore_index=True)}))
    ours = f[f["gpu_slug"] == "nvidia-h200"].set_index("precision")["floor_ms"]
    theirs = f[f["gpu_slug"] == "nvidia-h200-box"].set_index("precision")["floor_ms"]
    assert not ours.empty and theirs.sort_index().tolist() == pytest.approx(ours.sort_index().tolist())
    assert f[f["gpu_slug"] == "nvidia-x-box"].empty
