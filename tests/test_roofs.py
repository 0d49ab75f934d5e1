"""Roofs measured per card, not typed in: the measurement on a CPU (small, seconds), its table, the sweep measuring
a label once, which source every page reads (the label's own measurement, one of its device type, the datasheet),
and tensor-core FLOPs counted from the tensor pipe, held against the committed H200 layers' own arithmetic."""

from __future__ import annotations

import math
import warnings

import pandas as pd
import pytest
import torch

from medddpm import report
from medddpm.analysis import roofs as ar
from medddpm.measure.timing import roofs as mr
from medddpm.report import counters
from medddpm.store import schema
from medddpm.store.layout import ROOFS_FILE

TINY = mr.Sizes(copy_bytes=2**20, n={"fp32": 64, "bf16": 32, "fp16": 32}, warmup=1, repeats=3)


def made_up(slug: str, kind: str, scale: float = 1.0) -> pd.DataFrame:
    """A roofs table of a card, every roof `scale` times its datasheet's (a measured card reaches less)."""
    sheet = ar.DATASHEET[kind]
    rows = [{"gpu_slug": slug, "gpu_name": kind, "gpu_type": kind, "host": "h", "roof": r, "unit": ar.UNITS[r],
             "value": v * scale, "p10": v * scale * 0.98, "p90": v * scale * 1.01, "repeats": 30, "size": 8192,
             "method": "made up", "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "driver": "", "cuda": "",
             "torch": "", "git_commit": "", "start_time": ""} for r, v in sheet.roofs.items()]
    return pd.DataFrame(rows)[list(schema.TABLES["roofs"])]


def test_a_cpu_measures_its_roofs_in_seconds_and_the_table_round_trips(tmp_path):
    df = mr.measure("cpu", label="cpu-box", sizes=TINY)
    assert set(df["roof"]) >= {"dram", "fp32"} and "tf32" not in set(df["roof"])  # no TF32 off a GPU
    assert (df["value"] > 0).all() and (df["p10"] <= df["value"]).all() and (df["value"] <= df["p90"]).all()
    assert df.set_index("roof").loc["dram", "size"] == 2**20 and df.set_index("roof").loc["fp32", "size"] == 64
    assert set(df["gpu_slug"]) == {"cpu-box"} and set(df["gpu_type"]) == {"cpu"}
    path = mr.write(df, tmp_path)
    assert path == tmp_path / "cpu-box" / ROOFS_FILE
    pd.testing.assert_frame_equal(schema.read_table(path), df)
    with pytest.raises(schema.SchemaError, match="roof"):
        schema.write_table(df.assign(roof="fp8"), tmp_path / "bad.parquet", "roofs")
    with pytest.raises(schema.SchemaError, match="duplicated"):
        schema.write_table(pd.concat([df, df]), tmp_path / "bad.parquet", "roofs")
    assert "GB/s" in mr.describe(df) and "GFLOP/s" in mr.describe(df)


def test_strict_fp32_is_restored_after_the_matmul():
    before = torch.backends.cuda.matmul.fp32_precision
    with mr._fp32_math("ieee"):
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == before
    with pytest.raises(RuntimeError), mr._fp32_math("tf32"):
        raise RuntimeError("a failing matmul")
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_the_schema_knows_every_roof():
    assert schema.ENUMS["roofs"]["roof"] == ar.ROOFS
    assert set(ar.UNITS.values()) == set(schema.ENUMS["roofs"]["unit"])


def test_ensure_measures_a_label_once(tmp_path, monkeypatch):
    calls = []

    def fake(device=None, *, label=None, sizes=None):
        calls.append(label)
        return made_up(label, "nvidia-h200", 0.9)

    monkeypatch.setattr(mr, "measure", fake)
    assert mr.ensure(tmp_path, "nvidia-h200", "cpu") == tmp_path / "nvidia-h200" / ROOFS_FILE
    assert mr.ensure(tmp_path, "nvidia-h200", "cpu") is None and calls == ["nvidia-h200"]
    assert not list((tmp_path / "nvidia-h200").glob(".*lock")), "the lock goes with its holder"


def test_the_sweep_measures_its_label_s_roofs_before_its_first_configuration(tmp_path, monkeypatch):
    import papermill

    from medddpm.configs import get_config
    from medddpm.measure import sweep as sw
    from medddpm.measure.env import environment
    from medddpm.measure.run import run_row

    order, env = [], environment(torch.device("cpu"))
    monkeypatch.setattr(mr, "measure", lambda device=None, *, label=None, sizes=None:
                        order.append("roofs") or made_up(label, "nvidia-h200"))

    def execute(notebook, output, parameters, **kw):
        order.append(parameters["config"])
        config = get_config(parameters["config"])
        row = run_row(config, parameters["preset"], env=env, gpu_name="cpu", label=parameters["gpu_label"],
                      status="ok", message="") | {"run_id": f"lab/{config.name}/1", "train_median_ms": 2.0}
        schema.write_table(pd.DataFrame([row]), f"{parameters['stage']}/run.parquet", "run")

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    sw.sweep("baseline,opt1", preset="smoke", out=tmp_path, device="cpu", gpu_label="lab")
    sw.sweep("baseline", preset="smoke", out=tmp_path, device="cpu", gpu_label="lab", force=True)
    assert order == ["roofs", "baseline", "opt1", "baseline"], "measured once, before the first configuration"
    assert (tmp_path / "lab" / ROOFS_FILE).is_file()
    sw.sweep("baseline", preset="smoke", out=tmp_path, device="cpu", gpu_label="other", force=True, roofs=False)
    assert not (tmp_path / "other" / ROOFS_FILE).exists()


def test_a_card_s_roofs_are_its_own_measurement_else_its_datasheet_never_another_machine_s():
    h200 = made_up("nvidia-h200", "nvidia-h200", 0.9)
    mine = made_up("nvidia-h200-box", "nvidia-h200", 0.8).query("roof != 'fp16'")
    both = pd.concat([h200, mine], ignore_index=True)
    own = ar.card_roofs(both, "nvidia-h200-box", "nvidia-h200")
    assert own["dram"].source == ar.MEASURED and own["dram"].value == pytest.approx(0.8 * 4.8e12)
    assert own["fp16"].source == ar.DATASHEET_SOURCE, "a roof the measurement lacks is the datasheet's"
    beside = ar.card_roofs(h200, "nvidia-h200-node7", "nvidia-h200")  # another host of the type, not measured
    assert {r.source for r in beside.values()} == {ar.DATASHEET_SOURCE}, "another machine's roofs are never lent"
    cpu = made_up("cpu-vm", "nvidia-h200", 1e-3).assign(gpu_type="cpu")
    assert ar.card_roofs(cpu, "cpu", "cpu") == {}, "a CPU without its own roofs has none (no datasheet)"
    assert ar.card_roofs(cpu, "cpu-vm", "cpu")["fp32"].source == ar.MEASURED
    sheet = ar.card_roofs(schema.empty("roofs"), "nvidia-h200", "nvidia-h200")
    assert {r.source for r in sheet.values()} == {ar.DATASHEET_SOURCE} and set(sheet) == set(ar.ROOFS)
    assert ar.card_roofs(h200, "nvidia-x", "nvidia-x") == {}, "no measurement and no datasheet: no roofs"
    a, b, used = ar.pair_of(both, ("nvidia-h200", "nvidia-h200"), ("nvidia-b200", "nvidia-b200"))
    assert used == "datasheet" and b["dram"] / a["dram"] == pytest.approx(7.7 / 4.8), \
        "a card with no measurement is compared datasheet against datasheet"
    a, b, used = ar.pair_of(both, ("nvidia-h200", "nvidia-h200"), ("nvidia-h200-box", "nvidia-h200"))
    assert used == "mixed" and b["dram"] / a["dram"] == pytest.approx(0.8 / 0.9) and b["fp16"] == a["fp16"]


def test_the_book_reads_every_card_against_one_source_measured_only_once_all_are():
    """One card measured and the other not: both on their datasheets; both measured: both on their measurements.
    A card without a datasheet is read against its own measurement either way."""
    h100 = made_up("nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3", 0.8)
    h200 = made_up("nvidia-h200", "nvidia-h200", 0.9)
    other = made_up("nvidia-x", "nvidia-h200", 0.5).assign(gpu_type="nvidia-x")
    cards = {"nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3", "nvidia-h200": "nvidia-h200", "nvidia-x": "nvidia-x"}
    one = pd.concat([h100, other], ignore_index=True)
    assert set(ar.basis(one, cards).values()) == {ar.DATASHEET_SOURCE}
    read = ar.on_basis(one, "nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3", ar.basis(one, cards))
    assert {r.source for r in read.values()} == {ar.DATASHEET_SOURCE} and read["dram"].value == 3.35e12
    alone = ar.on_basis(one, "nvidia-x", "nvidia-x", ar.basis(one, cards))
    assert {r.source for r in alone.values()} == {ar.MEASURED}, "no datasheet: its own measurement"
    every = pd.concat([h100, h200, other], ignore_index=True)
    assert set(ar.basis(every, cards).values()) == {ar.MEASURED}
    read = ar.on_basis(every, "nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3", ar.basis(every, cards))
    assert read["dram"].source == ar.MEASURED and read["dram"].value == pytest.approx(0.8 * 3.35e12)


def test_a_card_s_efficiency_has_one_value_and_one_basis_wherever_a_page_reads_it(committed_data):
    """The committed H100 has measured roofs and the H200 none: every page reads both against their datasheets
    and says so (best reaches 31% and 33% of the bf16 peak, not 42% against 33%); with the H200's roofs measured
    too, every page reads both against their measurements. The first page, Beyond's floors, the workshop and the
    claims read one figure."""
    from medddpm.report import beyond, claims, intro, workshop

    data = committed_data
    h100, h200 = "nvidia-h100-80gb-hbm3", "nvidia-h200"
    if not {h100, h200} <= set(data.run["gpu_slug"]):
        pytest.skip("needs the committed H100 and H200 rows")
    h100_roofs = data.roofs[data.roofs["gpu_slug"] == h100]
    h100_roofs = h100_roofs if len(h100_roofs) else made_up(h100, h100, 0.77)
    cases = {ar.DATASHEET_SOURCE: h100_roofs,
             ar.MEASURED: pd.concat([h100_roofs, made_up(h200, h200, 0.8)], ignore_index=True)}
    for basis, roofs in cases.items():
        d = report.Data(**{**data.__dict__, "roofs": roofs})
        e = report.step_efficiency(d).set_index(["gpu_slug", "config"])
        assert set(e["basis"]) == {basis}, (basis, e["basis"])
        for s in (h100, h200):
            peak = (ar.DATASHEET[s].roofs["fp32"] if basis == ar.DATASHEET_SOURCE else
                    float(roofs.query("gpu_slug == @s and roof == 'fp32'")["value"].iloc[0]))
            assert e.loc[(s, "baseline"), "efficiency"] == pytest.approx(
                e.loc[(s, "baseline"), "achieved_tflops"] * 1e12 / peak)
        fp32 = e.xs("baseline", level="config")["efficiency"]
        first = intro.fp32_efficiency(d).set_index("gpu_slug")["efficiency"]
        floors = beyond.floors(d).set_index(["gpu_slug", "precision"])
        shop = workshop.efficiencies(d).set_index(["gpu_slug", "precision"])
        assert set(shop["basis"]) == {basis}
        peak_claim = [c for c in claims.CLAIMS if c.id == "opt12-peak"]
        verdicts = claims.verdicts(d, claims=peak_claim).set_index(["gpu_slug", "claim_id"])
        for s in (h100, h200):
            assert first[s] == pytest.approx(fp32[s]) and shop.loc[(s, "fp32"), "efficiency"] == pytest.approx(fp32[s])
            assert shop.loc[(s, "bf16"), "efficiency"] == pytest.approx(e.loc[(s, "bf16"), "efficiency"])
            assert floors.loc[(s, "fp32"), "fraction_of_peak"] == pytest.approx(fp32[s]), (basis, s)
            assert floors.loc[(s, "bf16"), "fraction_of_peak"] == pytest.approx(e.loc[(s, "best"), "efficiency"])
            assert floors.loc[(s, "bf16"), "basis"] == basis
            assert verdicts.loc[(s, "opt12-peak"), "figures"]["fraction_of_peak"] == pytest.approx(
                e.loc[(s, "opt12"), "efficiency"])
        said = report.basis_text(d)
        if basis == ar.DATASHEET_SOURCE:
            assert "read against its datasheet's roofs" in said and f"**{h200}** has not yet" in said, said
            assert e.loc[(h100, "best"), "efficiency"] == pytest.approx(0.31, abs=0.01)
            view = report.roofs_view(d).set_index(["gpu_slug", "roof"])
            assert view.loc[(h100, "dram"), "source"] == ar.DATASHEET_SOURCE and view.loc[(h100, "dram"), "measured"] > 0
            assert view.loc[(h200, "dram"), "value"] / view.loc[(h100, "dram"), "value"] == pytest.approx(4.8 / 3.35)
        else:
            assert "against its own measured roofs" in said, said


def test_pages_read_the_measured_roofs_and_say_the_datasheet_where_there_are_none(committed_data):
    data = committed_data
    assert data.roofs.empty or set(data.roofs["gpu_slug"]) <= set(data.run["gpu_slug"])
    peaks = report.peaks_of("nvidia-h200", data.run, data.roofs)
    if data.roofs[data.roofs["gpu_slug"] == "nvidia-h200"].empty:
        assert all(src.startswith("datasheet") for _, src in peaks.values()), peaks
    measured = report.Data(**{**data.__dict__, "roofs": made_up("nvidia-h200", "nvidia-h200", 0.85)})
    view = report.roofs_view(measured)
    report.check_roofs(view)
    h200 = view[view["gpu_slug"] == "nvidia-h200"].set_index("roof")
    assert (h200["measured"] > 0).all() and h200["of_datasheet"].astype(float).round(2).eq(0.85).all()
    every = report.Data(**{**data.__dict__, "roofs": pd.concat(
        [measured.roofs] + [made_up(s, s, 0.8) for s in sorted(set(data.run["gpu_slug"]) & set(ar.DATASHEET) - {"nvidia-h200"})],
        ignore_index=True)})
    floors = report.beyond.floors(every).set_index(["gpu_slug", "precision"])
    assert floors.loc[("nvidia-h200", "bf16"), "source"].startswith("measured under nvidia-h200")
    with pytest.raises(AssertionError, match="above the datasheet"):
        report.check_roofs(report.roofs_view(report.Data(**{**data.__dict__, "roofs": made_up("nvidia-h200", "nvidia-h200",
                                                                                         1.3)})))


def test_a_roofs_file_of_another_label_is_left_out_with_a_warning(tmp_path):
    (tmp_path / "nvidia-h200").mkdir()
    schema.write_table(made_up("nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3"),
                       tmp_path / "nvidia-h200" / ROOFS_FILE, "roofs")
    with pytest.warns(report.DataWarning, match="roofs of another label"):
        assert report.roofs_table(tmp_path).empty
    schema.write_table(made_up("nvidia-h200", "nvidia-h200"), tmp_path / "nvidia-h200" / ROOFS_FILE, "roofs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(report.roofs_table(tmp_path)) == 5


def test_tensor_precision_is_read_from_the_kernel_s_name_then_from_the_run():
    tp = counters.tensor_precision
    assert tp("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc", "bf16", 60.0) == "bf16"
    assert tp("sm90_xmma_dgrad_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc", "tf32", 60.0) == "tf32"
    assert tp("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "bf16", 50.0) == "bf16"
    assert tp("ampere_fp16_s16816gemm_fp16_128x128", "fp32", 50.0) == "fp16"
    assert tp("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_ffma", "fp32", 1.6) is None
    assert tp("nvjet_sm90_tst_64x384_64x3_1x2_h_bz_coopB_TNT", "bf16", 19.5) == "bf16"
    assert tp("nvjet_sm90_tst_64x384_64x3_1x2_h_bz_coopB_TNT", "bf16", 1.0) is None
    assert tp("triton_poi_fused_add_3", "fp32", 30.0) is None


def test_tensor_core_flops_match_the_layer_s_own_arithmetic_on_the_committed_h200(committed_data):
    """TF32's 64-channel full-size convolutions, whose tensor pipe is their whole arithmetic: the count from the
    pipe's active cycles is the layer's 2 x 64 x 64 x 27 x 128^3 FLOPs to within a percent, in all three
    directions; and strict FP32's forward, counted from its FFMA instructions, too."""
    data = committed_data
    check = report.flop_count_check(data)
    if check.empty or "opt1" not in set(check["config"]):
        pytest.skip("no layer-ranged counters of opt1 in the data")
    rows = check[(check["layer"] == "conv3d 64>64 k3 s1 @128x128x128")].set_index(["config", "direction"])
    assert rows.loc[("opt1", "fprop"), "math"] == "tensor cores (tf32)"
    for direction in ("fprop", "dgrad", "wgrad"):
        assert rows.loc[("opt1", direction), "ratio"] == pytest.approx(1.0, abs=0.01), direction
    assert rows.loc[("baseline", "fprop"), "math"] == "CUDA cores"
    assert rows.loc[("baseline", "fprop"), "ratio"] == pytest.approx(1.0, abs=0.01)
    assert counters.layer_flops("conv3d 64>64 k3 s2 @128x128x128") == 2.0 * 64 * 64 * 27 * 64**3
    assert math.isnan(counters.layer_flops("attention 4096 tokens"))


def test_the_roofline_puts_tf32_convolutions_on_the_tensor_cores(committed_data):
    data = committed_data
    points = report.roofline_points(data.ncu, data.run, data.roofs)
    if points.empty:
        pytest.skip("no counters in the data")
    opt1 = points[points["config"] == "opt1"]
    tf32 = opt1[opt1["math"] == "tensor cores (tf32)"]
    assert len(tf32) and (tf32["flops_tensor"] > 0).all()
    top = tf32.sort_values("duration_ns").iloc[-1]
    assert top["flops_per_s"] > 67e12, "its longest TF32 kernel runs above the CUDA cores' FP32 peak"
    assert (points.loc[points["config"] == "baseline", "flops_tensor"] == 0).all()


def test_a_label_naming_another_device_type_is_refused_before_any_measurement(tmp_path):
    """`roofs --gpu-label nvidia-h200` on another device would file that device's roofs as an H200's."""
    from medddpm.cli.main import main
    from medddpm.measure.validate import check_label_device, known_device_types

    known = known_device_types(tmp_path)
    assert {"nvidia-h200", "nvidia-h100-80gb-hbm3", "cpu"} <= known
    with pytest.raises(ValueError, match="names a nvidia-h200 but this device is a nvidia-h100-80gb-hbm3"):
        check_label_device("nvidia-h200", "nvidia-h100-80gb-hbm3", known)
    with pytest.raises(ValueError, match="names a nvidia-h200"):
        check_label_device("NVIDIA H200-node7", "nvidia-h100-80gb-hbm3", known)
    for ok in ("nvidia-h100-80gb-hbm3", "nvidia-h100-80gb-hbm3-vm", "lab-box-3", "h100-container"):
        check_label_device(ok, "nvidia-h100-80gb-hbm3", known)
    check_label_device("cpu-vm", "cpu", known)
    # the data names a type the datasheets do not: a label of it is refused on another device too
    (tmp_path / "rtx-9000" / "baseline").mkdir(parents=True)
    pd.DataFrame({"gpu_type": ["rtx-9000"]}).to_parquet(tmp_path / "rtx-9000" / "baseline" / "run.parquet")
    with pytest.raises(ValueError, match="names a rtx-9000"):
        check_label_device("rtx-9000", "cpu", known_device_types(tmp_path))
    # the command line: one line, nothing written
    assert main(["roofs", "--out", str(tmp_path), "--device", "cpu", "--gpu-label", "nvidia-h200"]) == 2
    assert not (tmp_path / "nvidia-h200").exists()


def test_a_step_is_floored_by_the_faster_of_its_precision_and_fp32():
    """Autocast leaves part of a bf16 step in FP32: on a GPU the bf16 roof is the higher and floors it; on a CPU
    without bf16 instructions FP32's is, and the page names the roof it reads."""
    gpu = ar.card_roofs(schema.empty("roofs"), "nvidia-h200", "nvidia-h200")
    assert report.step_roof(gpu, "bf16")[0] == "bf16" and report.step_roof(gpu, "fp32")[0] == "fp32"
    cpu = ar.card_roofs(made_up("cpu-vm", "nvidia-h200", 1e-3).assign(gpu_type="cpu").query("roof != 'tf32'"),
                        "cpu-vm", "cpu")
    cpu["bf16"] = ar.Roof(cpu["fp32"].value / 7, ar.MEASURED, "measured under cpu-vm")
    name, roof = report.step_roof(cpu, "bf16")
    assert name == "fp32" and roof.value == cpu["fp32"].value and report.step_roof(cpu, "tf32") is None
    floors = pd.DataFrame({"gpu_slug": "cpu-vm", "precision": ["bf16", "fp32"], "roof": ["fp32", "fp32"],
                           "peak_tflops": 0.07, "floor_ms": 1.0, "best_config": ["bf16", "baseline"], "best_ms": 2.0,
                           "fraction_of_peak": 0.5})
    assert report.beyond.floors_table(floors)["precision"].tolist() == ["bf16 (fp32 roof)", "fp32"]
