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


def test_a_card_s_roofs_come_from_its_own_measurement_then_its_type_s_then_its_datasheet():
    h200 = made_up("nvidia-h200", "nvidia-h200", 0.9)
    mine = made_up("nvidia-h200-box", "nvidia-h200", 0.8).query("roof != 'fp16'")
    both = pd.concat([h200, mine], ignore_index=True)
    own = ar.card_roofs(both, "nvidia-h200-box", "nvidia-h200")
    assert own["dram"].source == ar.MEASURED and own["dram"].value == pytest.approx(0.8 * 4.8e12)
    assert own["fp16"].source == ar.DATASHEET_SOURCE, "a roof the measurement lacks is the datasheet's"
    beside = ar.card_roofs(h200, "nvidia-h200-node7", "nvidia-h200")  # measured under another label of its type
    assert beside["bf16"].source == ar.MEASURED and "nvidia-h200" in beside["bf16"].detail
    sheet = ar.card_roofs(schema.empty("roofs"), "nvidia-h200", "nvidia-h200")
    assert {r.source for r in sheet.values()} == {ar.DATASHEET_SOURCE} and set(sheet) == set(ar.ROOFS)
    assert ar.card_roofs(h200, "nvidia-x", "nvidia-x") == {}, "no measurement and no datasheet: no roofs"
    a, b, used = ar.pair_of(both, ("nvidia-h200", "nvidia-h200"), ("nvidia-b200", "nvidia-b200"))
    assert used == "datasheet" and b["dram"] / a["dram"] == pytest.approx(7.7 / 4.8), \
        "a card with no measurement is compared datasheet against datasheet"
    a, b, used = ar.pair_of(both, ("nvidia-h200", "nvidia-h200"), ("nvidia-h200-box", "nvidia-h200"))
    assert used == "mixed" and b["dram"] / a["dram"] == pytest.approx(0.8 / 0.9) and b["fp16"] == a["fp16"]


def test_pages_read_the_measured_roofs_and_say_the_datasheet_where_there_are_none():
    data = report.load_all()
    assert data.roofs.empty or set(data.roofs["gpu_slug"]) <= set(data.run["gpu_slug"])
    peaks = report.peaks_of("nvidia-h200", data.run, data.roofs)
    if data.roofs[data.roofs["gpu_slug"] == "nvidia-h200"].empty:
        assert all(src.startswith("datasheet") for _, src in peaks.values()), peaks
    measured = report.Data(**{**data.__dict__, "roofs": made_up("nvidia-h200", "nvidia-h200", 0.85)})
    view = report.roofs_view(measured)
    report.check_roofs(view)
    h200 = view[view["gpu_slug"] == "nvidia-h200"].set_index("roof")
    assert (h200["source"] == ar.MEASURED).all() and h200["of_datasheet"].astype(float).round(2).eq(0.85).all()
    floors = report.floors(data.run, roofs=measured.roofs).set_index(["gpu_slug", "precision"])
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


def test_tensor_core_flops_match_the_layer_s_own_arithmetic_on_the_committed_h200():
    """TF32's 64-channel full-size convolutions, whose tensor pipe is their whole arithmetic: the count from the
    pipe's active cycles is the layer's 2 x 64 x 64 x 27 x 128^3 FLOPs to within a percent, in all three
    directions; and strict FP32's forward, counted from its FFMA instructions, too."""
    data = report.load_all()
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


def test_the_roofline_puts_tf32_convolutions_on_the_tensor_cores():
    data = report.load_all()
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
