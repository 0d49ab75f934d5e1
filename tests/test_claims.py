"""The claims as rules: each can come out every way it has (holds; direction holds but magnitude differs; does not
hold), CPU rows never judge one, and the matched-layer and step-weighted figures compare what they say they
compare. The data are built here, small and by hand: a GPU of the smoke model (16^3) whose counters are made to
agree with every claim, to agree in direction but not in size, or to contradict every one."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from medddpm import report
from medddpm.analysis import layers
from medddpm.analysis import ncu_table
from medddpm.store import schema
from medddpm.report import claims
from medddpm.cli.main import main

GPU = "nvidia-test-gpu"
TENSOR = ncu_table.TENSOR_PIPE_METRICS[-1]
RAW = {"duration_ns": "gpu__time_duration.sum", "sm_active_cycles": "sm__cycles_active.avg",
       "inst_executed": "sm__inst_executed.sum", "tensor_pipe_pct": TENSOR,
       "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
       "l1_hit_pct": "l1tex__t_sector_hit_rate.pct", "l2_hit_pct": "lts__t_sector_hit_rate.pct",
       "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
       "stall_long_scoreboard": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
       "stall_math_pipe_throttle": "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
       "inst_fp32": "smsp__sass_thread_inst_executed_op_fp32_pred_on.sum"}
LAYER = "conv3d 32>32 k3 s1 @16x16x16"  # a layer of the smoke model (4 instances a step)
CONV = {"baseline": "sm80_xmma_wgrad_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_kernel",
        "opt1": "sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_kernel__5x_cudnn"}
NORM = "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*)"
LAYOUT = "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>(params, float const*)"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >(int)"
TF32_ROOF = 400e12  # the made-up card's TF32 roof (FLOP/s)
AGREE, SIZE, CONTRADICT = "agree", "direction only", "contradict"
BANDED = {c.id for c in claims.CLAIMS if c.band is not None}


def launch(kernel_id: int, kernel: str, *, layer: str = "", rules: dict | None = None, **metrics) -> list[dict]:
    """Long-table rows of one profiled launch: metrics by raw name, optional layer range and global rules."""
    rows = [{"kernel": kernel, "kernel_id": kernel_id, "kind": "metric", "section": "Raw", "metric": RAW[m],
             "value": v, "unit": "", "text": str(v), "speedup_type": ""} for m, v in metrics.items()]
    if layer:
        rows.append({"kernel": kernel, "kernel_id": kernel_id, "kind": "metric", "section": ncu_table.LAYER_SECTION,
                     "metric": ncu_table.LAYER_METRIC, "value": float("nan"), "unit": "", "text": layer, "speedup_type": ""})
    for (section, rule), speedup in (rules or {}).items():
        rows.append({"kernel": kernel, "kernel_id": kernel_id, "kind": "rule", "section": section, "metric": rule,
                     "value": speedup, "unit": "%", "text": "", "speedup_type": "global"})
    return rows


def roofs_of(slug: str) -> pd.DataFrame:
    """The made-up card's measured roofs."""
    values = {"dram": 3e12, "fp32": 60e12, "tf32": TF32_ROOF, "bf16": 800e12, "fp16": 800e12}
    return pd.DataFrame([{"gpu_slug": slug, "gpu_name": "NVIDIA Test", "gpu_type": slug, "host": "h", "roof": r,
                          "unit": "byte/s" if r == "dram" else "FLOP/s", "value": v, "p10": v, "p90": v,
                          "repeats": 3, "size": 1, "method": "made up", "sm_clock_mhz": 1.0, "mem_clock_mhz": 1.0,
                          "driver": "", "cuda": "", "torch": "", "git_commit": "", "start_time": ""}
                         for r, v in values.items()])


def gpu_data(mode: str | bool, slug: str = GPU) -> report.Data:
    """One GPU with the paper's four configurations, sdpa and compile: every claim holds (`AGREE`, or True); every
    claim goes the paper's way but each magnitude the paper gives lies outside its band (`SIZE`); or every claim
    fails (`CONTRADICT`, or False)."""
    mode = {True: AGREE, False: CONTRADICT}.get(mode, mode)

    def pick(yes, no, size=None):
        return no if mode == CONTRADICT else size if mode == SIZE and size is not None else yes

    ms = {"baseline": 1000.0, "opt1": pick(200.0, 990.0), "opt2": 1000.0, "opt12": pick(400.0, 1100.0),
          "sdpa": 300.0, "compile": pick(100.0, 290.0)}
    conv_share = {c: pick(0.9, 0.3) for c in ms} | {"opt12": pick(0.3, 0.9)}
    layout_share = {"opt2": pick(0.3, 0.02), "opt12": pick(0.3, 0.02)}
    add_share = {"opt12": pick(0.3, 0.01)}  # element-wise: outweighs the convolutions in opt12, or not
    rate = {  # step-weighted rates, per configuration
        "tensor_pipe_pct": {"baseline": 1.0, "opt1": 20.0, "opt2": pick(1.5, 30.0, 0.4), "opt12": pick(10.0, 25.0)},
        "sm_throughput_pct": {"baseline": 60.0, "opt1": 40.0, "opt2": pick(30.0, 60.0, 48.0), "opt12": 35.0},
        "l1_hit_pct": {"baseline": pick(40.0, 80.0), "opt1": 20.0, "opt2": 40.0, "opt12": 20.0},
        "l2_hit_pct": {"baseline": pick(70.0, 70.0, 40.0), "opt1": 60.0, "opt2": pick(85.0, 50.0, 50.0), "opt12": 60.0},
        "dram_throughput_pct": {"baseline": 20.0, "opt1": 30.0, "opt2": pick(5.0, 40.0), "opt12": 30.0},
        "inst_fp32": {"baseline": 1e9, "opt1": 1e8, "opt2": 1e9, "opt12": 1e8},  # a count: per launch
    }
    rate["tensor_pipe_pct"]["opt1"] = pick(20.0, 80.0)  # "low tensor-core use": under 50% or not
    # the matched layer's counters (a: baseline, b: opt1), kernel against kernel
    layer = {"sm_active_cycles": (1e7, pick(2e6, 2e7, 1e6)), "inst_executed": (1e9, pick(1e7, 2e9, 1e8)),
             "tensor_pipe_pct": (1.0, pick(5.0, 1.05, 40.0)), "l1_hit_pct": (60.0, pick(20.0, 70.0)),
             "dram_throughput_pct": (1.0, pick(10.0, 0.5)), "stall_long_scoreboard": (0.5, pick(1.0, 0.2)),
             "stall_math_pipe_throttle": (0.4, pick(0.05, 0.6))}
    rules = {("Memory Workload Analysis Tables", "MemoryCacheAccessPattern"): pick(40.0, 1.0),
             ("Warp State Statistics", "CPIStall"): pick(40.0, 1.0)}
    # opt12 reaches 10% of the TF32 roof, or 80%
    flops = {c: 1e12 for c in ms} | {"opt12": pick(0.1, 0.8) * TF32_ROOF * ms["opt12"] / 1e3}
    runs, kernels, counters, quality = [], [], [], []
    for config, step in ms.items():
        rid = f"{slug}/{config}/20260101T000000Z"
        runs.append({**schema.empty("run").iloc[0:0].to_dict(), "run_id": rid, "status": "ok", "gpu_name": "NVIDIA Test",
                     "gpu_slug": slug, "gpu_type": slug, "config": config, "train_median_ms": step, "preset": "smoke",
                     "shape": "16x16x16", "mask_channels": 3, "image_channels": 1, "num_res_blocks": 1,
                     "flops_per_step": flops[config],
                     "precision_used": "tf32" if config in ("opt1", "opt12") else "fp32"})
        conv = CONV["opt1" if config in ("opt1", "opt12") else "baseline"]
        lay, add = layout_share.get(config, 0.01), add_share.get(config, 0.01)
        shares = {conv: conv_share[config], LAYOUT: lay, NORM: 1 - conv_share[config] - lay - add, ADD: add}
        kernels.append(pd.DataFrame({"run_id": rid, "kernel": list(shares), "share": list(shares.values()),
                                     "category": ["convolution", "layout", "normalization", "elementwise"],
                                     "total_us": [s * step * 1e3 for s in shares.values()], "calls": 2, "micro_steps": 1,
                                     "pass": "backward", "gpu_slug": slug, "config": config}))
        if config in ("sdpa", "compile"):
            continue
        r = {m: v[config] for m, v in rate.items()}
        rows = []
        for i, (name, dur) in enumerate(((conv, 5e6), (LAYOUT, 1e5), (NORM, 1e5), (ADD, 1e4))):
            rows += launch(i, name, duration_ns=dur, sm_active_cycles=1e6, inst_executed=1e8, rules=rules,
                           stall_long_scoreboard=1.0, **r)
        if config in ("baseline", "opt1"):  # the matched layer's wgrad, and a helper that must not stand for it
            side = 0 if config == "baseline" else 1
            rows += launch(10, conv, layer=f"{LAYER} backward", duration_ns=4e6 / (1 + 4 * side),
                           sm_throughput_pct=50.0, l2_hit_pct=60.0, **{m: v[side] for m, v in layer.items()})
            rows += launch(11, "void cudnn::reduce_wgrad_nchw_helper<float, float>(void*, void const*)",
                           layer=f"{LAYER} backward", duration_ns=2e3, sm_active_cycles=1.0, inst_executed=1.0,
                           tensor_pipe_pct=0.0)
        counters.append(pd.DataFrame(rows).assign(run_id=rid, gpu_slug=slug, config=config))
        if config == "opt1":
            quality.append(pd.DataFrame({"run_id": rid, "step": [1, 2], "loss": [0.5, 0.4],
                                         "baseline_loss": [0.5, pick(0.4, 0.2)], "rel_err": pick(1e-3, 0.1),
                                         "gpu_slug": slug, "config": config}))
    return report.Data(run=pd.DataFrame(runs), steps=schema.empty("steps"), kernels=pd.concat(kernels, ignore_index=True),
                   ncu=pd.concat(counters, ignore_index=True), quality=pd.concat(quality, ignore_index=True),
                   roofs=roofs_of(slug))


def study(agree: bool, slug: str = GPU):
    """A convergence study of baseline and opt1, three seeds each: opt1's samples as good as strict FP32's, or
    far worse."""
    from medddpm.report.convergence import Study

    dice = {"baseline": [0.80, 0.82, 0.84], "opt1": [0.81, 0.83, 0.82] if agree else [0.50, 0.52, 0.51]}
    runs = pd.DataFrame([{"gpu_slug": slug, "config": c, "seed": s, "status": "ok", "skipped_steps": 0,
                          "final_loss": 0.1} for c in dice for s in range(3)])
    samples = pd.DataFrame([{"gpu_slug": slug, "config": c, "seed": s, "metric": m, "tissue": t, "value": v}
                            for c, values in dice.items() for s, v in enumerate(values)
                            for m, t in (("label_dice", "mean"), ("hist_w1", "mean"), ("ms_ssim", "brain"))])
    return Study(runs, pd.DataFrame(), samples, {slug: None})


def verdicts(data: report.Data, slug: str = GPU) -> dict[str, str]:
    agree = data.quality["rel_err"].max() < 0.01  # gpu_data's opt1 parity: 1e-3 where the data agrees, else 0.1
    t = claims.verdicts(data, study=study(agree, slug))
    return t[t["gpu_slug"] == slug].set_index("claim_id")["verdict"].to_dict()


def test_every_claim_comes_out_each_way_it_has():
    """Data that agrees: every claim holds. Data that goes the paper's way at another size: every claim with a
    magnitude says so, the others hold. Data that contradicts: every claim fails."""
    agree, size, contradict = (verdicts(gpu_data(m)) for m in (AGREE, SIZE, CONTRADICT))
    assert set(agree) == {c.id for c in claims.CLAIMS}
    assert {c: v for c, v in agree.items() if v != report.HOLDS} == {}
    assert {c for c, v in size.items() if v == report.MAGNITUDE} == BANDED
    assert {c: v for c, v in size.items() if c not in BANDED and v != report.HOLDS} == {}
    assert {c: v for c, v in contradict.items() if v != report.FAILS} == {}
    assert BANDED == {"tf32-cycles", "tf32-instructions", "tf32-tensor", "cl-tensor", "cl-sm", "cl-cache"}


def test_a_magnitude_is_held_against_the_paper_s_band_in_the_claim_s_own_scope():
    t = claims.verdicts(gpu_data(SIZE)).set_index("claim_id")
    f = t.loc["tf32-cycles", "figures"]
    assert f["magnitude"] == pytest.approx(10.0) and f["band"] == pytest.approx([5 / 1.5, 7.5])
    assert "outside 3.33-7.5x" in t.loc["tf32-cycles", "evidence"] and t.loc["tf32-cycles", "paper"] == "up to 5x"
    assert t.loc["cl-tensor", "figures"]["magnitude"] == pytest.approx(0.4) and t.loc["cl-tensor", "scope"] == claims.STEP
    assert set(t["scope"]) <= set(claims.SCOPES) and t.loc["tf32-memory", "scope"] == claims.MATCHED
    assert {c.scope for c in claims.CLAIMS if c.id.startswith("tf32-") and c.id not in
            ("tf32-quality", "tf32-samples")} == {claims.MATCHED}
    holds = claims.verdicts(gpu_data(AGREE)).set_index("claim_id")
    assert "inside" in holds.loc["tf32-cycles", "evidence"]


def test_figures_of_another_scope_stand_beside_as_context_and_name_their_scope():
    """The L1 hit rate of the matched layer and of the whole step differ; each claim says which it judged, and the
    TF32 instruction cut shows the per-step figure beside the per-layer one."""
    t = claims.verdicts(gpu_data(AGREE)).set_index("claim_id")
    assert "over its whole step" in t.loc["inefficiency-sources", "evidence"]
    memory = t.loc["tf32-memory", "evidence"]
    assert memory.startswith("matched layer") and "(context, step-weighted: the whole step's L1 hit rate" in memory
    assert "(context, step-weighted: the thread instructions of a whole step" in t.loc["tf32-instructions", "evidence"]
    assert "(context, step time: the whole step" in t.loc["tf32-cycles", "evidence"]


@pytest.mark.parametrize("part, change", [
    ("math-pipe-throttle stalls fall", {"stall_math_pipe_throttle": (0.4, 0.6)}),
    ("long-scoreboard stalls rise", {"stall_long_scoreboard": (0.5, 0.3)}),
])
def test_the_h100_stall_claim_needs_both_of_its_parts(part, change):
    data = gpu_data(AGREE)
    ncu = data.ncu.copy()
    for metric, (a, b) in change.items():
        at = (ncu["metric"] == RAW[metric]) & (ncu["kernel_id"] == 10)
        ncu.loc[at & (ncu["config"] == "baseline"), "value"] = a
        ncu.loc[at & (ncu["config"] == "opt1"), "value"] = b
    row = claims.verdicts(report.Data(**{**data.__dict__, "ncu": ncu})).set_index("claim_id").loc["tf32-stalls"]
    assert row["verdict"] == report.FAILS and row["evidence"].endswith(f"(not so: {part})")
    assert row["paper_card"] == "H100"


def test_opt12_against_the_card_s_roof_reads_the_measured_roofs_else_says_what_is_missing():
    data = gpu_data(AGREE)
    row = claims.verdicts(data).set_index("claim_id").loc["opt12-peak"]
    assert row["verdict"] == report.HOLDS and row["figures"]["fraction_of_peak"] == pytest.approx(0.1)
    assert "TF32 roof (400 TFLOP/s, measured under nvidia-test-gpu" in row["evidence"]
    no_roofs = report.Data(**{**data.__dict__, "roofs": schema.empty("roofs")})
    row = claims.verdicts(no_roofs).set_index("claim_id").loc["opt12-peak"]
    assert row["verdict"] == report.NA and "no roof" in row["evidence"]


def test_each_card_s_verdicts_stand_side_by_side():
    a, b = gpu_data(AGREE), gpu_data(SIZE, slug="nvidia-h100-test")
    both = report.Data(**{k: pd.concat([getattr(a, k), getattr(b, k)], ignore_index=True)
                      for k in ("run", "steps", "kernels", "ncu", "quality", "roofs")})
    table = claims.verdicts(both)
    wide = claims.side_by_side(table).set_index("claim_id")
    assert list(wide.columns) == ["short", "scope", "paper", "paper_card", "nvidia-h100-test", GPU]
    assert wide.loc["tf32-cycles", GPU] == report.HOLDS and wide.loc["tf32-cycles", "nvidia-h100-test"] == report.MAGNITUDE
    assert wide.loc["opt12-peak", "paper_card"] == "H100"
    doc = {c["claim"]: c for c in json.loads(claims.as_json(table))}
    assert set(doc["tf32-cycles"]["verdicts"]) == {GPU, "nvidia-h100-test"}
    assert doc["tf32-cycles"]["verdicts"]["nvidia-h100-test"]["verdict"] == report.MAGNITUDE
    assert doc["tf32-cycles"]["paper"] == "up to 5x" and doc["conv-dominates"]["paper"] is None


def test_inefficiency_sources_names_each_source_it_could_not_show():
    data = gpu_data(True)
    row = claims.verdicts(data).query("claim_id == 'inefficiency-sources'").iloc[0]
    assert row["verdict"] == report.HOLDS and set(row["figures"]) >= {"memory_rules_share", "layout_share",
                                                                   "scheduling_rules_share", "l1_hit_pct"}
    high_l1 = data.ncu.copy()
    is_l1 = (high_l1["config"] == "baseline") & (high_l1["metric"] == RAW["l1_hit_pct"])
    high_l1.loc[is_l1, "value"] = 90.0
    row = claims.verdicts(report.Data(**{**data.__dict__, "ncu": high_l1})).query("claim_id == 'inefficiency-sources'").iloc[0]
    assert row["verdict"] == report.FAILS and row["evidence"].endswith("(not shown: cache residency)")


def test_cpu_rows_never_judge_a_claim_and_the_headline_counts_gpus_only():
    gpu = gpu_data(True)
    cpu = gpu_data(True, slug="cpu")
    cpu.run["gpu_name"] = "cpu"
    both = report.Data(run=pd.concat([gpu.run, cpu.run]), steps=gpu.steps, kernels=pd.concat([gpu.kernels, cpu.kernels]),
                   ncu=pd.concat([gpu.ncu, cpu.ncu]), quality=pd.concat([gpu.quality, cpu.quality]), roofs=gpu.roofs)
    table = claims.verdicts(both, study=study(True))
    assert list(dict.fromkeys(table["gpu_slug"])) == [GPU, "cpu"]  # GPUs first
    on_cpu = table[table["gpu_slug"] == "cpu"]
    assert (on_cpu["verdict"] == report.NA).all() and (on_cpu["evidence"] == claims.ON_CPU).all()
    head = claims.headline(table)
    assert list(head.index) == [GPU] and head.loc[GPU, report.HOLDS] == len(claims.CLAIMS)
    assert list(head.columns) == [*claims.VERDICTS, claims.IN_PART] and head.loc[GPU, claims.IN_PART] == 0


def test_tf32_claims_are_not_measurable_without_a_matched_layer_and_say_what_to_run():
    data = gpu_data(True)
    no_layers = data.ncu[data.ncu["section"] != ncu_table.LAYER_SECTION]
    v = claims.verdicts(report.Data(**{**data.__dict__, "ncu": no_layers})).set_index("claim_id")
    for cid in ("tf32-cycles", "tf32-instructions", "tf32-tensor", "tf32-memory", "tf32-stalls"):
        assert v.loc[cid, "verdict"] == report.NA and "layer ranges" in v.loc[cid, "evidence"], cid
    assert v.loc["cl-tensor", "verdict"] == report.HOLDS  # step-weighted claims need no layers
    no_opt1 = data.ncu[data.ncu["config"] != "opt1"]
    v = claims.verdicts(report.Data(**{**data.__dict__, "ncu": no_opt1})).set_index("claim_id")
    assert v.loc["tf32-cycles", "evidence"] == f"no counters for opt1 (`python -m medddpm counters data/{GPU}/opt1`)"


def test_matched_layers_compare_the_main_kernel_of_one_layer_and_direction():
    data = gpu_data(True)
    a, b = (data.ncu[data.ncu["config"] == c].drop(columns=["gpu_slug", "config"]) for c in ("baseline", "opt1"))
    counts = layers.layer_counts(data.run.set_index("config").loc["baseline"])
    assert counts[LAYER] == 4 and counts.sum() == 25  # the smoke model's 25 convolutions
    m = layers.matched_layers(a, b, counts)
    assert m[["layer", "direction", "instances"]].values.tolist() == [[LAYER, "wgrad", 4]]
    row = m.iloc[0]
    assert "reduce_wgrad" not in row["kernel_a"] + row["kernel_b"]  # a helper never stands for the layer
    assert row["sm_cycles_ratio"] == pytest.approx(5.0) and row["instructions_ratio"] == pytest.approx(100.0)
    assert row["step_ms_a"] == pytest.approx(4 * 4e6 / 1e6)
    assert m.loc[0, "tensor_pipe_pct_a"] == 1.0 and m.loc[0, "tensor_pipe_pct_b"] == 5.0


def test_step_weighted_rates_weight_kernels_by_their_step_share_not_by_profiled_duration():
    kernels = pd.DataFrame({"kernel": ["long", "short"], "share": [0.2, 0.8], "calls": [2, 60], "micro_steps": 2})
    table = pd.DataFrame(launch(0, "long", duration_ns=1e9, tensor_pipe_pct=90.0, inst_executed=5e6)
                         + launch(1, "short", duration_ns=1e3, tensor_pipe_pct=10.0, inst_executed=1e3)
                         + launch(2, "short", duration_ns=3e3, tensor_pipe_pct=30.0, inst_executed=3e3)
                         ).astype(ncu_table.COLUMNS)
    s = layers.step_weighted(kernels, table, counts=("inst_executed",))
    assert s["tensor_pipe_pct"] == pytest.approx(0.2 * 90 + 0.8 * (10 * 1 + 30 * 3) / 4)
    assert s["covered"] == pytest.approx(1.0)
    assert s["inst_executed_per_step"] == pytest.approx(1 * 5e6 + 30 * 2e3)  # per launch x launches a step
    s = layers.step_weighted(kernels, table[table["kernel_id"] == 0])
    assert s["tensor_pipe_pct"] == pytest.approx(90.0) and s["covered"] == pytest.approx(0.2)


def test_claims_command_prints_json_with_every_card_s_verdict_and_the_figures_it_used(capsys):
    assert main(["claims", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["claim"] for r in rows] == [c.id for c in claims.CLAIMS]
    assert all(set(r) == {"claim", "text", "scope", "paper", "paper_card", "rule", "verdicts"} for r in rows)
    assert all(set(v) == {"verdict", "judged", "evidence", "figures", "needs"} for r in rows for v in r["verdicts"].values())
    assert {v["verdict"] for r in rows for v in r["verdicts"].values()} <= set(claims.VERDICTS)
    gpu = {r["claim"]: v for r in rows for d, v in r["verdicts"].items() if d == "nvidia-h200"}
    judged = (report.HOLDS, report.MAGNITUDE, report.FAILS)
    for cid, key in (("tf32-cycles", "sm_cycles_ratio"), ("tf32-instructions", "instructions_ratio")):
        if gpu.get(cid, {}).get("verdict") in judged:
            assert isinstance(gpu[cid]["figures"][key], float) and isinstance(gpu[cid]["figures"]["magnitude"], float)
    if gpu.get("tf32-tensor", {}).get("verdict") in judged:
        assert [type(x) for x in gpu["tf32-tensor"]["figures"]["tensor_pipe_pct"]] == [float, float]
    # The committed H100's sweep has runs, kernel tables and a quality table but no counters: it is judged on what
    # those show, OPT12's ordering on its step times (1062 > 370 > 237 ms), and the rest waits for its counters.
    h100 = {r["claim"]: v for r in rows for d, v in r["verdicts"].items() if d == "nvidia-h100-80gb-hbm3"}
    if h100:
        assert sum(v["verdict"] != report.NA for v in h100.values()) >= 5, h100
        assert h100["opt12-partial"]["judged"] == claims.IN_PART and h100["opt12-partial"]["figures"]["step_ms"]
        assert ["counters", "opt2"] in h100["opt12-partial"]["needs"]
    assert main(["claims", "--data", "/nonexistent"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_claims_command_prints_each_card_s_verdict_under_each_claim(capsys, monkeypatch):
    from medddpm import report
    from medddpm.report import convergence

    a, b = gpu_data(AGREE), gpu_data(SIZE, slug="nvidia-h100-test")
    both = report.Data(**{k: pd.concat([getattr(a, k), getattr(b, k)], ignore_index=True)
                      for k in ("run", "steps", "kernels", "ncu", "quality", "roofs")})
    monkeypatch.setattr(report, "load_all", lambda root=None: both)
    monkeypatch.setattr(convergence, "load_study", lambda root=None: study(True))
    assert main(["claims"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("nvidia-h100-test: 9 holds, 6 direction holds, magnitude differs")
    block = out.split("TF32 cuts SM cycles (up to 5x) [matched layer, paper: up to 5x]\n")[1].split("\n\n")[0]
    assert [line.split()[0] for line in block.splitlines() if not line.startswith(" " * 5)] == [
        "nvidia-h100-test", GPU]
    assert "direction holds, magnitude differs" in block and "holds" in block
    assert "[step-weighted, the paper's card: H100]" in out


def test_channels_last_shift_falls_back_to_the_tf32_pair_and_then_says_what_is_missing():
    data = gpu_data(True)
    k = data.kernels[data.kernels["config"] != "opt2"]
    row = claims.verdicts(report.Data(**{**data.__dict__, "kernels": k})).query("claim_id == 'cl-shift'").iloc[0]
    assert row["verdict"] == report.HOLDS and "(opt1)" in row["evidence"] and "(opt12)" in row["evidence"]
    no_pair = report.Data(**{**data.__dict__, "kernels": k[k["config"] != "opt12"]})
    assert claims.verdicts(no_pair).query("claim_id == 'cl-shift'").iloc[0]["verdict"] == report.NA


def test_a_claim_without_its_run_names_the_sweep_that_gives_it():
    data = gpu_data(True)
    no_run = report.Data(**{**data.__dict__, "run": data.run[data.run["config"] != "opt2"]})
    row = claims.verdicts(no_run).query("claim_id == 'opt12-partial'").iloc[0]
    assert row["verdict"] == report.NA
    assert row["evidence"] == "no run of opt2 (`python -m medddpm sweep --preset paper --configs opt2`)"


def test_timing_claims_fall_back_to_bench_timings_where_no_sweep():
    data = gpu_data(True)
    bench = pd.DataFrame({"gpu_slug": GPU, "implementation": "ours", "config": ["sdpa", "sdpa", "compile"],
                          "train_median_ms": [300.0, 310.0, 100.0], "fp32_math": "tf32"})
    unswept = report.Data(**{**data.__dict__, "bench": bench,
                         "run": data.run[~data.run["config"].isin(["sdpa", "compile"])]})
    row = claims.verdicts(unswept).query("claim_id == 'fusion-needed'").iloc[0]
    assert row["verdict"] == report.HOLDS and row["evidence"].endswith("ms, bench timings)")
    assert row["figures"]["speedup"] == pytest.approx(305.0 / 100.0)


def _without_counters(data: report.Data, *configs: str) -> report.Data:
    return report.Data(**{**data.__dict__, "ncu": data.ncu[~data.ncu["config"].isin(configs)]})


@pytest.mark.parametrize("mode, verdict", [(AGREE, report.HOLDS), (CONTRADICT, report.FAILS)])
def test_a_claim_judges_its_step_time_half_where_the_counters_are_missing(mode, verdict):
    """A card with runs and kernel tables but no counters (the H100's sweep without its ncu phase): OPT12's
    step-time ordering is judged, either way, and the tensor-pipe half waits for the counters; the five sources
    are judged on the layout source alone. Both say so, and what would judge the rest."""
    data = _without_counters(gpu_data(mode), "baseline", "opt1", "opt2", "opt12")
    t = claims.verdicts(data).set_index("claim_id")
    row = t.loc["opt12-partial"]
    assert (row["verdict"], row["judged"]) == (verdict, claims.IN_PART)
    assert row["evidence"].startswith("step time opt2 1000 > opt12") and "not judged yet: tensor-pipe use: no " \
        "counters for opt2, opt12, opt1" in row["evidence"]
    assert set(row["needs"].split()) == {"counters:opt2", "counters:opt12", "counters:opt1"}
    sources = t.loc["inefficiency-sources"]
    assert (sources["verdict"], sources["judged"]) == (verdict, claims.IN_PART)
    assert sources["evidence"].startswith("layout conversion: layout kernels") and set(sources["figures"]) == {
        "layout_share"}
    assert "memory access, warp scheduling, cache residency: no counters for baseline" in sources["evidence"]
    assert t.loc["tf32-cycles", "verdict"] == report.NA and t.loc["tf32-cycles", "judged"] == ""
    claims.check_verdicts(t.reset_index(), set())
    whole = claims.verdicts(gpu_data(mode)).set_index("claim_id")
    assert whole.loc["opt12-partial", "judged"] == claims.IN_FULL and whole.loc["opt12-partial", "needs"] == ""


def test_the_page_says_which_runs_would_settle_the_rest():
    data = _without_counters(gpu_data(AGREE), "baseline", "opt1", "opt2", "opt12")
    data = report.Data(**{**data.__dict__, "run": data.run[~data.run["config"].isin(["sdpa", "compile"])]})
    table = claims.verdicts(data)
    left = claims.settle(table).set_index("kind")
    assert left.loc["counters", "configs"] == ["baseline", "opt1", "opt2", "opt12"]
    assert left.loc["counters", "parts"] == 2 and left.loc["counters", "claims"] == (
        (table["verdict"] == report.NA) & table["needs"].str.contains("counters:")).sum() > 5
    assert left.loc["run", "configs"] == ["sdpa", "compile"] and left.loc["run", "claims"] == 1
    said = claims.settle_text(table)
    assert f"`python -m medddpm counters data/{GPU}/baseline data/{GPU}/opt1 data/{GPU}/opt2 data/{GPU}/opt12`" in said
    assert "would judge 1 claim" in said and "complete 2 claims judged in part" in said
    assert claims.settle_text(claims.verdicts(gpu_data(AGREE), study=study(True))).startswith("Every claim is judged")
    head = claims.headline(table)
    assert head.loc[GPU, claims.IN_PART] == 2 and "judged in part" in claims.tally_text(head.loc[GPU])
    wide = claims.side_by_side(table).set_index("claim_id")
    assert wide.loc["opt12-partial", GPU] == f"{report.HOLDS} (in part)" and wide.loc["conv-dominates", GPU] == report.HOLDS


def test_the_worked_example_takes_a_card_with_counters():
    a, b = gpu_data(AGREE), _without_counters(gpu_data(AGREE, slug="nvidia-a-first"), "baseline", "opt1", "opt2",
                                                          "opt12")
    both = report.Data(**{k: pd.concat([getattr(a, k), getattr(b, k)], ignore_index=True)
                          for k in ("run", "steps", "kernels", "ncu", "quality", "roofs")})
    assert claims.devices(both)[0] == "nvidia-a-first" and claims.example_device(both) == GPU
    assert claims.example_device(b) == "nvidia-a-first", "with no card that has counters, the first"
