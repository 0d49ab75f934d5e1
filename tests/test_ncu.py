"""medddpm.ncu on real Nsight Compute output captured on an H200 (no GPU or ncu needed)."""

import gzip
import io
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from medddpm.analysis import ncu_names
from medddpm.analysis import ncu_table
from medddpm.measure.profile import ncu, ncu_layers

FIX = Path(__file__).parent / "fixtures"
DETAILS = {name: FIX / f"h200/ncu-{name}-size32-details.csv.gz" for name in ("opt1", "bf16-cl")}
ROWS = {"opt1": 1228, "bf16-cl": 1234}
PAIRS = json.loads((FIX / "ncu/kernel-names-h200.json").read_text())["pairs"]


@pytest.fixture(scope="module", params=list(DETAILS))
def details(request) -> tuple[str, pd.DataFrame]:
    return request.param, ncu_table.parse_details_csv(DETAILS[request.param])


def expected_dtypes() -> dict:
    return {c: pd.Series([], dtype=t).dtype for c, t in ncu_table.COLUMNS.items()}


# ------------------------------------------------------------------------------------------ parsing

def test_parse_shape_and_dtypes(details):
    name, df = details
    assert len(df) == ROWS[name]
    assert list(df.columns) == list(ncu_table.COLUMNS)
    assert df.dtypes.to_dict() == expected_dtypes()
    assert df["kernel_id"].nunique() == 12 and sorted(df["kernel_id"].unique()) == list(range(12))
    assert set(df["kind"]) == {"metric", "rule"}


def test_thousands_separators_and_na(details):
    _, df = details
    freq = df[(df["section"] == "GPU Speed Of Light Throughput") & (df["metric"] == "SM Frequency")]
    assert len(freq) == 12 and freq["unit"].eq("hz").all()
    assert freq["value"].between(1.8e9, 2.1e9).all()  # "1,946,234,809.03"-style strings
    row = freq[freq["text"].str.contains(",")].iloc[0]
    assert row["value"] == float(row["text"].replace(",", ""))
    na = df[df["text"] == "n/a"]
    assert len(na) > 0 and na["value"].isna().all()
    text = df[(df["kind"] == "metric") & (df["text"] == "PolicySpread")]  # a non-numeric metric value
    assert len(text) > 0 and text["value"].isna().all()


def test_exact_value_opt1():
    df = ncu_table.parse_details_csv(DETAILS["opt1"])
    first = df[(df["kernel_id"] == 0) & (df["metric"] == "SM Frequency")].iloc[0]
    assert first["text"] == "1,946,234,809.03" and first["value"] == pytest.approx(1946234809.03)


def test_rules(details):
    _, df = details
    rules = df[df["kind"] == "rule"]
    assert len(rules) > 100
    assert set(rules["speedup_type"]) == {"local", "global", ""}
    assert rules["unit"].eq("%").all() and rules["text"].str.len().gt(0).all()
    with_speedup = rules[rules["value"].notna()]
    assert len(with_speedup) > 50 and with_speedup["value"].between(0, 100).all()
    assert (rules["speedup_type"] == "").eq(rules["value"].isna()).all()
    assert df.loc[df["kind"] == "metric", "speedup_type"].eq("").all()
    assert {"CPIStall", "AchievedOccupancy", "LaunchConfiguration"} <= set(rules["metric"])


def test_section_names_are_display_names(details):
    # metric rows say "Compute Workload Analysis", rule rows the section file's "ComputeWorkloadAnalysis"
    _, df = details
    assert not set(df["section"]) & (set(ncu_table.SECTION_NAMES) - set(ncu_table.SECTION_NAMES.values()))
    cwa = df[df["section"] == "Compute Workload Analysis"]
    assert set(cwa["kind"]) == {"metric", "rule"}
    assert "HighPipeUtilization" in set(cwa["metric"])


def test_parse_buffer_with_preamble():
    raw = gzip.decompress(DETAILS["opt1"].read_bytes())
    noisy = b"==PROF== Connected to process 1\n==WARNING== something\n" + raw
    from_buffer = ncu_table.parse_details_csv(io.BytesIO(gzip.compress(noisy)))
    pd.testing.assert_frame_equal(from_buffer, ncu_table.parse_details_csv(DETAILS["opt1"]))
    assert ncu_table.parse_details_csv(io.StringIO("==ERROR== no report\n")).dtypes.to_dict() == expected_dtypes()


# ------------------------------------------------------------------------------------------ summary

def test_kernel_summary(details):
    _, df = details
    s = ncu_table.kernel_summary(df)
    assert len(s) == 12 and s["kernel_id"].is_unique and s["kernel_id"].dtype == "int64"
    for col in ["duration_ns", "sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct", "l1_hit_pct",
                "l2_hit_pct", "achieved_occupancy_pct", "tensor_pipe_pct", "ipc", "warp_cycles_per_inst",
                "registers_per_thread", "inst_fp32", "stall_long_scoreboard", "flop_fp32"]:
        assert col in s.columns and s[col].dtype == "float64", col
    for col in [c for c in s.columns if c.endswith("_pct")]:
        values = s[col].dropna()
        assert values.between(0, 100).all(), col
    for col in ["duration_ns", "sm_throughput_pct", "l2_hit_pct", "achieved_occupancy_pct", "tensor_pipe_pct",
                "ipc", "warp_cycles_per_inst", "registers_per_thread"]:
        assert s[col].notna().all(), col
    assert s["duration_ns"].between(1e3, 1e5).all() and s["ipc"].gt(0).all()
    assert (s["registers_per_thread"] % 1 == 0).all()
    assert s["inst_fp32"].isna().all()  # not requested in these captures


def test_kernel_summary_from_raw_metric_names():
    # a capture with --metrics only: values come from "Command line profiler metrics" by raw name
    raw = {"gpu__time_duration.sum": 5000.0, "sm__warps_active.avg.pct_of_peak_sustained_active": 40.0,
           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": 12.0,
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": 30.0,
           ncu_table._inst_metric("fp32"): 100.0, ncu_table._stall_metric("long_scoreboard"): 7.5,
           ncu_table._inst_metric("fadd"): 10.0, ncu_table._inst_metric("fmul"): 20.0, ncu_table._inst_metric("ffma"): 30.0}
    df = pd.DataFrame({"kernel": "k", "kernel_id": 3, "kind": "metric", "section": "Command line profiler metrics",
                       "metric": list(raw), "value": list(raw.values()), "unit": "", "text": "", "speedup_type": ""})
    s = ncu_table.kernel_summary(df.astype(ncu_table.COLUMNS)).iloc[0]
    assert s["duration_ns"] == 5000 and s["achieved_occupancy_pct"] == 40 and s["tensor_pipe_pct"] == 30
    assert s["inst_fp32"] == 100 and s["stall_long_scoreboard"] == 7.5 and s["flop_fp32"] == 10 + 20 + 60
    assert math.isnan(s["l2_hit_pct"])
    assert ncu_table.kernel_summary(ncu_table.empty_table()).empty


# ---------------------------------------------------------------------------------------- selection

def kernels_frame(rows: list[tuple[str, float, str]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["kernel", "total_us", "category"])
    return df.assign(share=df["total_us"] / df["total_us"].sum())


def test_select_kernels_coverage():
    k = kernels_frame([("a", 50, "convolution"), ("b", 30, "gemm"), ("c", 15, "elementwise"), ("d", 5, "other"),
                       ("Memcpy HtoD (Pageable -> Device)", 1000, "memcpy")])
    assert ncu_table.select_kernels(k, coverage=0.8) == ["a", "b"]  # exactly 80%: the boundary counts
    assert ncu_table.select_kernels(k, coverage=0.81) == ["a", "b", "c"]
    assert ncu_table.select_kernels(k, coverage=0.5) == ["a"]
    assert ncu_table.select_kernels(k, coverage=1.0) == ["a", "b", "c", "d"]
    assert ncu_table.covered(k, ["a", "b"]) == pytest.approx(0.8)


def test_select_kernels_sums_passes():
    # "c" appears in forward and backward: 25 + 25 outranks "a" (40)
    k = kernels_frame([("a", 40, "convolution"), ("c", 25, "elementwise"), ("c", 25, "elementwise"),
                       ("b", 10, "gemm")])
    assert ncu_table.select_kernels(k, coverage=0.5) == ["c"]
    assert ncu_table.select_kernels(k, coverage=0.9) == ["c", "a"]
    assert ncu_table.select_kernels(kernels_frame([("m", 5, "memcpy")]), coverage=0.8) == []


def test_select_kernels_by_time_per_launch():
    # ncu replays every launch: "many" (300 launches, 45%) comes after the long-launch kernels
    k = kernels_frame([("many", 45, "layout"), ("conv", 35, "convolution"), ("norm", 20, "normalization")])
    k["calls"] = [300, 5, 2]
    assert ncu_table.select_kernels(k, coverage=0.5) == ["norm", "conv"]
    assert ncu_table.select_kernels(k, coverage=0.8) == ["norm", "conv", "many"]
    assert ncu_table.select_kernels(k.drop(columns="calls"), coverage=0.4) == ["many"]


# ------------------------------------------------------------------------------------------ command

SPECIAL = [
    "void at::native::(anonymous namespace)::foo_kernel<float, (c10::ScalarType)5>(float const*, int*)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    "(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
    "triton_per_fused_native_group_norm_silu_0",
    "weird.kernel$name+with?specials|[x]*^{2}",
]
OTHERS = [
    "void at::native::(anonymous namespace)::foo_kernel_v2<float, (c10::ScalarType)5>(float const*, int*)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_sub<float>, std::array<char*, 3ul> >"
    "(int, at::native::CUDAFunctor_sub<float>, std::array<char*, 3ul>)",
    "triton_per_fused_native_group_norm_silu_1",
    "weirdXkernel$name",
]


def test_ncu_command(tmp_path):
    report = tmp_path / "r.ncu-rep"
    cmd = ncu.ncu_command(name_regex=ncu_names.kernel_regex(SPECIAL), config="opt1", preset="paper", size=64, report=report,
                          metrics=["a__b.sum", "c__d.ratio"], python="/usr/bin/python3")
    joined = " ".join(cmd)
    assert cmd[0] == "ncu" and "--clock-control none" in joined
    assert "--target-processes application-only" in joined  # not into Inductor's compile workers
    assert "--nvtx --nvtx-include medddpm_step/" in joined
    assert "--set" not in cmd and "full" not in cmd
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu_table.SECTIONS)
    assert cmd[cmd.index("--metrics") + 1] == "a__b.sum,c__d.ratio"
    assert cmd[cmd.index("--kernel-name-base") + 1] == "demangled"
    assert cmd[cmd.index("-o") + 1:cmd.index("-o") + 3] == [str(report), "-f"]
    assert cmd[-9:] == ["/usr/bin/python3", "-m", "medddpm.measure.profile.capture", "--config", "opt1", "--preset", "paper",
                        "--size", "64"]
    # a layer repeated with the same launch configuration is profiled once
    assert "--filter-mode per-launch-config --launch-count 1" in joined
    regex = re.compile(cmd[cmd.index("--kernel-name") + 1].removeprefix("regex:"))
    assert all(regex.search(n) for n in SPECIAL)
    assert not any(regex.search(n) for n in OTHERS)
    # the library pass: every launch its regex admits
    library = ncu.ncu_command(name_regex=ncu.LIBRARY_LAUNCH, launches_per_config=None, config="c", preset="smoke",
                              report=report, metrics=[])
    assert "--filter-mode" not in library and "--launch-count" not in library
    assert library[library.index("--kernel-name") + 1] == f"regex:{ncu.LIBRARY_LAUNCH}"
    assert "--metrics" not in library and "--launch-skip" not in library
    # ... going on after the first 97 launches an earlier library pass profiled
    later = ncu.ncu_command(name_regex=ncu.LIBRARY_LAUNCH, launches_per_config=None, launch_skip=97, config="c",
                            preset="smoke", report=report, metrics=[])
    assert later[later.index("--launch-skip") + 1] == "97" and later.index("--launch-skip") < later.index("-o")
    brats = ncu.ncu_command(name_regex="x", config="best", preset="brats", size="192x192x144", batch=2,
                            report=report, metrics=[])
    assert brats[-6:] == ["--preset", "brats", "--size", "192x192x144", "--batch", "2"]
    stopping = ncu.ncu_command(name_regex="x", config="c", preset="smoke", report=report, metrics=[], stop_after_s=90)
    assert stopping[-2:] == ["--stop-after", "90"]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: ncu_names.skeleton(p["profiler"])[0])
def test_regex_matches_ncu_demangling_h200(pair):
    # the profiler's name selects the same kernel under ncu's demangler (both names from the H200)
    assert re.search(ncu_names.kernel_regex([pair["profiler"]]), pair["ncu"])
    assert ncu_names.match_kernel(pair["ncu"], [p["profiler"] for p in PAIRS]) == [pair["profiler"]]


LAUNCHES = json.loads(gzip.decompress((FIX / "ncu/launch-names-opt12-h200.json.gz").read_bytes()))["launches"]


def test_cudnn_family():
    profiled = "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32_warpgroupsize1x1x1_" \
               "g1_execute_segment_k_off_kernel__5x_cudnn"
    under_ncu = "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_" \
                "warpsize2x2x1_g1_tensor16x8x8_execute_kernel__5x_cudnn"
    # the report's names are matched back by direction
    assert ncu_names.match_kernel(under_ncu, [profiled]) == [profiled]
    assert ncu_names.match_kernel(under_ncu.replace("fprop", "wgrad"), [profiled]) == []


def test_library_launches_are_named_after_the_launch_before():
    # opt12's H200 step under ncu: a cuDNN xmma launch is logged under the name of the launch before it
    misnamed = [(b, a) for b, a in zip(LAUNCHES, LAUNCHES[1:]) if a["logged"] != a["reported"]]
    dgrads = [a for a in LAUNCHES if "_dgrad_" in a["reported"]]
    assert len(dgrads) == 37 and sum(a["logged"] == a["reported"] for a in dgrads) == 0
    assert len(misnamed) > 100
    # ... in its mangled spelling where it was a C++ kernel (`_ZN7cutlass7Kernel2I42cutlass_80_simt_sgemm_...`)
    previous = [(b, a) for b, a in misnamed if a["logged"].startswith("_Z")]
    assert len(previous) > 50 and all(ncu_names.skeleton(b["reported"])[0] in a["logged"] for b, a in previous)


def test_library_pass_admits_library_launches_under_any_name():
    assert ncu.split_library(SPECIAL + [LAUNCHES[0]["reported"], "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_splitK_NTT"]) == \
        (SPECIAL, [LAUNCHES[0]["reported"], "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_splitK_NTT"])
    regex = re.compile(ncu.LIBRARY_LAUNCH)
    assert all(regex.search(a["logged"]) for a in LAUNCHES)
    # after a PyTorch kernel, a cuDNN launch carries that kernel's mangled name; the kernel itself its demangled one
    assert regex.search("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_15CUDAFunctor_addIfEESt5arrayIPcLm3EEEEviT0_T1_")
    assert not any(regex.search(n) for n in OTHERS)
    # the own pass's filter stays clear of them (ncu's replay costs about 1.3 s a launch)
    own = re.compile(ncu_names.kernel_regex(SPECIAL))
    assert not any(own.search(a["logged"]) for a in LAUNCHES)


def test_metric_availability():
    available = ncu.parse_metric_list(gzip.decompress((FIX / "ncu/query-metrics-h200.csv.gz").read_bytes()).decode())
    assert len(available) > 3000 and "dram__bytes" in available
    assert not any(n.startswith("FBSP") or "." in n for n in available)
    table = ncu.parse_metric_list((FIX / "ncu/query-metrics-h200-head.txt").read_text())
    assert table == {"gpu__time_duration", "sm__pipe_tensor_cycles_active",
                     "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active"}
    kept, dropped = ncu.split_available(ncu_table.EXTRA_METRICS, available)
    assert dropped == [] and kept == ncu_table.EXTRA_METRICS  # every requested metric exists on the H200
    kept, dropped = ncu.split_available(["dram__bytes.sum.per_second", "nope__x.sum"], available)
    assert kept == ["dram__bytes.sum.per_second"] and dropped == ["nope__x.sum"]
    assert ncu.split_available(["nope__x.sum"], set()) == (["nope__x.sum"], [])  # unknown list: keep all


# ------------------------------------------------------------------------------------------- runner

def test_run_ncu_skipped_without_ncu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    k = kernels_frame([("a", 86, "convolution"), ("b", 14, "gemm")])
    df, status = ncu.run_ncu(kernels_df=k, config="opt1", preset="smoke", out_dir=tmp_path)
    assert df.empty and df.dtypes.to_dict() == expected_dtypes()
    assert status["status"] == "skipped" and "PATH" in status["message"]
    assert status["selected_kernels"] == 1 and status["coverage"] == pytest.approx(0.86)
    assert status["dropped_metrics"] == [] and status["passes"]["own"]["report"].endswith("-own.ncu-rep")
    assert list(status["passes"]) == ["own"]  # no cuDNN or cuBLAS kernel among those selected


@pytest.mark.parametrize("script,timeout,expect", [
    ("echo boom >&2; exit 3", 30, ["exited 3: boom"]),
    # the profiled program never stops itself: it is killed before the timeout, and ncu ends without a report
    # (whether sh then reports "Killed" depends on the shell and on when the kill lands, so only the parts around
    # it are asserted)
    ("echo compiling; /bin/sleep 30", 2, ["exited 137: compiling | ", "medddpm.ncu: the profiled program was killed at 1 s"]),
    # ncu itself does not end: killed at the timeout
    ("echo compiling; while :; do /bin/sleep 1; done", 2,
     ["timed out after 2 s (ncu-opt1-smoke-own.log: ", "medddpm.ncu: the profiled program was killed at 1 s"])])
def test_run_ncu_failure_is_recorded(monkeypatch, tmp_path, script, timeout, expect):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text(f"#!/bin/sh\ncase \"$1\" in --query-metrics) exit 1;; esac\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    df, status = ncu.run_ncu(kernels_df=kernels_frame([("a", 1, "gemm")]), config="opt1", preset="smoke",
                             out_dir=tmp_path / "out", timeout_s=timeout)
    assert df.empty and status["status"] == "error", status
    assert all(part in status["message"] for part in expect), status["message"]
    # what ncu said before it stopped or was killed stays in its log
    logged = "boom" if "boom" in script else "compiling"
    assert (tmp_path / "out/ncu-opt1-smoke-own.log").read_text().startswith(f"{logged}\n")


def _fake_ncu_writing_the_report(tmp_path: Path, program: str) -> None:
    """An ncu that writes its report (the opt1 fixture) however the profiled `program` ends."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text("#!/bin/sh\ncase \"$1\" in --query-metrics) exit 1;; -i) gzip -dc " + str(DETAILS["opt1"]) + "; exit 0;; esac\n"
                    "for a; do [ \"$prev\" = -o ] && touch \"$a\"; prev=$a; done\n" + program)
    fake.chmod(0o755)


def test_run_ncu_keeps_a_stopped_step(monkeypatch, tmp_path):
    # the profiled program stopped itself at the deadline: ncu wrote what it had, and that is kept
    _fake_ncu_writing_the_report(tmp_path, "case \"$*\" in *'--stop-after 45 '*|*'--stop-after 45') ;; *) exit 9;; esac\n"
                                           f"echo '{ncu.STOPPED} after 45 s' >&2; exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    df, status = ncu.run_ncu(kernels_df=kernels_frame([("a", 1, "gemm")]), config="opt1", preset="smoke",
                             out_dir=tmp_path / "out", timeout_s=90)
    assert status["status"] == "ok" and "stopped at 45 s" in status["message"], status
    assert not df.empty and df["kernel_id"].nunique() == ncu_table.parse_details_csv(DETAILS["opt1"])["kernel_id"].nunique()


def test_run_ncu_keeps_what_ncu_wrote_after_the_program_was_killed(monkeypatch, tmp_path):
    # the program did not stop itself (its stop thread never ran): it is killed before the timeout, and
    # ncu, which outlives it, writes what it profiled
    _fake_ncu_writing_the_report(tmp_path, "/bin/sleep 30\nexit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    df, status = ncu.run_ncu(kernels_df=kernels_frame([("a", 1, "gemm")]), config="opt1", preset="smoke",
                             out_dir=tmp_path / "out", timeout_s=4)
    assert status["status"] == "ok" and "launches before the program was killed at 3 s" in status["message"], status
    assert df["kernel_id"].nunique() == ncu_table.parse_details_csv(DETAILS["opt1"])["kernel_id"].nunique()


def test_join_launches_keeps_every_pass_s_launches_apart():
    df = ncu_table.parse_details_csv(DETAILS["opt1"])
    later = df.assign(kernel_id=df["kernel_id"] + 40)  # a table whose ids do not start at 0
    joined = ncu_table.join_launches([df, ncu_table.empty_table(), later])
    assert len(joined) == 2 * len(df) and sorted(joined["kernel_id"].unique()) == list(range(24))
    assert joined.dtypes.to_dict() == expected_dtypes()
    assert joined.groupby("kernel_id")["kernel"].nunique().eq(1).all()
    assert ncu_table.join_launches([ncu_table.empty_table()]).empty


DGRAD = "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x64x32_warpgroupsize1x1x1_g1_" \
        "execute_segment_k_off_kernel__5x_cudnn"


def test_run_ncu_profiles_library_launches_in_a_pass_of_their_own(monkeypatch, tmp_path):
    # The own pass filters by name, one launch a configuration; the library pass takes every launch its
    # regex admits. This stand-in exports the fixture for the first, and for the second the fixture with
    # the add kernel renamed to a cuDNN dgrad kernel; it fails if a pass gets the other's filter.
    text = gzip.decompress(DETAILS["opt1"].read_bytes()).decode()
    add = ncu_table.parse_details_csv(DETAILS["opt1"]).groupby("kernel_id")["kernel"].first()[6]
    (tmp_path / "own.csv").write_text(text)
    (tmp_path / "library.csv").write_text(text.replace(f'"{add}"', f'"{DGRAD}"'))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text(f"""#!/bin/sh
case "$1" in --query-metrics) exit 1;; -i) case "$2" in *-own.ncu-rep) cat {tmp_path}/own.csv;;
  *) cat {tmp_path}/library.csv;; esac; exit 0;; esac
for a; do [ "$prev" = -o ] && touch "$a" && report=$a; prev=$a; done
echo "$report" >> {tmp_path}/calls
case "$report $*" in *-own.ncu-rep*per-launch-config*) ;; *-library.ncu-rep*per-launch-config*) exit 8;;
  *-library.ncu-rep*"{ncu.LIBRARY_LAUNCH}"*) ;; *) exit 9;; esac
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    k = kernels_frame([(PAIRS[2]["profiler"], 40, "elementwise"), (DGRAD, 60, "convolution")])
    df, status = ncu.run_ncu(kernels_df=k, config="opt12", preset="paper", out_dir=tmp_path / "out", timeout_s=200)
    assert status["status"] == "ok", status
    assert {p: v["launches"] for p, v in status["passes"].items()} == {"own": 12, "library": 12}
    assert sorted(df["kernel_id"].unique()) == list(range(24))  # ids stay unique across the passes
    assert status["profiled_coverage"] == pytest.approx(1.0) and "own: 12 launches; library: 12 launches" in status["message"]
    assert [Path(c).name for c in (tmp_path / "calls").read_text().split()] == \
        ["ncu-opt12-paper-own.ncu-rep", "ncu-opt12-paper-library.ncu-rep"]
    (tmp_path / "calls").unlink()
    df, status = ncu.run_ncu(kernels_df=k, config="opt12", preset="paper", out_dir=tmp_path / "out", timeout_s=200,
                             passes=("library",))
    assert list(status["passes"]) == ["library"] and status["profiled_coverage"] == pytest.approx(0.6)
    assert (tmp_path / "calls").read_text().count("\n") == 1
    # Adding to the own pass's counters: its kernel is covered, so only the library pass runs, after the
    # 97 launches that earlier library passes profiled
    commands = []
    real = ncu._profile
    monkeypatch.setattr(ncu, "_profile", lambda cmd, *a, **kw: (commands.append(cmd), real(cmd, *a, **kw))[1])
    own = ncu_table.parse_details_csv(tmp_path / "own.csv")
    df, status = ncu.run_ncu(kernels_df=k, config="opt12", preset="paper", out_dir=tmp_path / "out", timeout_s=200,
                             profiled=own, library_skip=97)
    assert list(status["passes"]) == ["library"] and status["passes"]["library"]["first_launch"] == 97
    assert len(commands) == 1 and commands[0][commands[0].index("--launch-skip") + 1] == "97"
    with pytest.raises(ValueError, match="unknown ncu pass cudnn: choose from own, library"):
        ncu.run_ncu(kernels_df=k, config="opt12", preset="paper", out_dir=tmp_path, passes=("cudnn",))


def test_run_ncu_both_filters_in_one_process(monkeypatch, tmp_path):
    # `both`: one ncu process (one warm-up) with the own kernels' names and every library launch in its filter,
    # one launch a configuration. The stand-in exports the fixture with its first kernel renamed to a cuDNN dgrad
    # kernel, so that the one report holds both; it fails unless it gets that filter.
    text = gzip.decompress(DETAILS["opt1"].read_bytes()).decode()
    first = ncu_table.parse_details_csv(DETAILS["opt1"]).groupby("kernel_id")["kernel"].first()[0]
    (tmp_path / "both.csv").write_text(text.replace(f'"{first}"', f'"{DGRAD}"'))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text(f"""#!/bin/sh
case "$1" in --query-metrics) exit 1;; -i) cat {tmp_path}/both.csv; exit 0;; esac
for a; do [ "$prev" = -o ] && touch "$a" && report=$a; [ "$prev" = --kernel-name ] && regex=$a; prev=$a; done
printf '%s %s\\n' "$report" "$regex" >> {tmp_path}/calls
case "$*" in *per-launch-config*) ;; *) exit 8;; esac
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    k = kernels_frame([(PAIRS[2]["profiler"], 40, "elementwise"), (DGRAD, 60, "convolution")])
    df, status = ncu.run_ncu(kernels_df=k, config="opt2", preset="paper", out_dir=tmp_path / "out", timeout_s=200,
                             passes=("both",))
    assert status["status"] == "ok", status
    assert list(status["passes"]) == ["both"] and status["passes"]["both"]["kernels"] == 2
    assert status["profiled_coverage"] == pytest.approx(1.0) and df["kernel_id"].nunique() == 12
    [(report, regex)] = [line.split(" ", 1) for line in (tmp_path / "calls").read_text().splitlines()]
    assert Path(report).name == "ncu-opt2-paper-both.ncu-rep"
    regex = re.compile(regex.removeprefix("regex:"))
    # the own kernel by its ncu name, and a library launch under the mangled name of the kernel before it
    assert regex.search(PAIRS[2]["ncu"]) and all(regex.search(a["logged"]) for a in LAUNCHES)
    assert not any(regex.search(n) for n in OTHERS)
    assert ncu.pass_regex("both", []) == ncu.pass_regex("library", []) == ncu.LIBRARY_LAUNCH
    for bad, why in ((("both", "own"), "the both pass profiles own and library in one process: ask for it alone"),
                     (("al",), "unknown ncu pass al: choose from own, library or both")):
        with pytest.raises(ValueError, match=re.escape(why)):
            ncu.run_ncu(kernels_df=k, config="opt2", preset="paper", out_dir=tmp_path, passes=bad)


# --------------------------------------------------------------------------------------- priorities

def test_priorities():
    df = ncu_table.parse_details_csv(DETAILS["opt1"])
    names = df.groupby("kernel_id")["kernel"].first()
    kineto_add = PAIRS[2]["profiler"]  # profiler spelling of the add kernel (id 6 in this capture)
    assert re.search(ncu_names.kernel_regex([kineto_add]), names[6])
    k = pd.DataFrame({"kernel": [kineto_add, names[3], names[3], "Memcpy HtoD"], "total_us": [10.0, 20, 10, 5],
                      "category": ["elementwise", "elementwise", "elementwise", "memcpy"],
                      "share": [0.2, 0.4, 0.2, 0.2]})
    p = ncu_table.priorities(k, df)
    assert list(p.columns) == ["kernel", "profiler_kernel", "rule", "section", "speedup_type", "share",
                               "speedup_pct", "priority"]
    assert p["speedup_type"].eq("global").all()
    matched = p[p["share"].notna()]
    assert set(matched["profiler_kernel"]) == {kineto_add, names[3]}
    assert matched.loc[matched["profiler_kernel"] == names[3], "share"].sub(0.6).abs().lt(1e-12).all()  # both passes
    assert (matched["priority"] == matched["share"] * matched["speedup_pct"] / 100).all()
    assert matched["priority"].is_monotonic_decreasing and p["priority"].isna().sum() == len(p) - len(matched)
    add = matched[(matched["profiler_kernel"] == kineto_add) & (matched["rule"] == "LaunchConfiguration")]
    launch = df[(df["kernel_id"] == 6) & (df["metric"] == "LaunchConfiguration")]["value"]
    assert add["speedup_pct"].iloc[0] == pytest.approx(launch.max())
    # ids 3 and 5 are one kernel launched twice: their speedups are averaged, weighted by duration
    assert len(ncu_table.priorities(k, df, include_local=True)) > len(p)


def test_profiled_coverage_counts_only_what_ncu_profiled():
    conv = "sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32_kernel__5x_cudnn"
    k = kernels_frame([(conv, 60, "convolution"), ("void at::native::RowwiseMomentsCUDAKernel<float>(long)", 30, "reduction"),
                       ("void at::native::other_kernel<float>(int)", 10, "elementwise")])
    only_norm = pd.DataFrame({"kernel": ["void at::<unnamed>::RowwiseMomentsCUDAKernel<float>(long, T1)"]})
    assert ncu_table.profiled_coverage(k, only_norm) == pytest.approx(0.3)
    # a different cuDNN algorithm for the same direction counts (the autotuner's choice moves under ncu)
    both = pd.DataFrame({"kernel": [only_norm.kernel[0], "cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688wgrad_optimized>"]})
    assert ncu_table.profiled_coverage(k, both) == pytest.approx(0.9)
    fprop = pd.DataFrame({"kernel": ["cudnn::detail::implicit_convolve_sgemm<float>"]})
    assert ncu_table.profiled_coverage(k, fprop) == 0.0  # forward kernels do not stand in for weight gradients


# ---------------------------------------------------------------------------- convolution directions

CONV_NAMES = json.loads((FIX / "ncu/conv-kernels-h200.json").read_text())["names"]


def test_convolution_direction_of_every_real_kernel_name():
    """Real H200 names in ncu's and the profiler's spellings: a gradient word decides before "convolve" does
    (`convolveNd_dgrad_float_engine` is a dgrad), and helpers and cuDNN's attention are no convolution."""
    assert {n: ncu_names.conv_direction(n) for n in CONV_NAMES} == CONV_NAMES
    assert {d for d in CONV_NAMES.values()} == {"fprop", "dgrad", "wgrad", None}


@pytest.mark.parametrize("family", ["fprop", "dgrad", "wgrad"])
def test_a_kernel_of_another_direction_never_stands_for_a_cudnn_family(family):
    profiler = [n for n, d in CONV_NAMES.items() if d == family and ncu_names._CUDNN_FAMILY.match(n)]
    assert profiler
    for name, direction in CONV_NAMES.items():
        hits = ncu_names.match_kernel(name, profiler)
        if direction != family:
            assert hits == [], (name, hits[:1])
        elif name not in profiler:  # another algorithm of the same direction stands for the family
            assert hits, name


def test_legacy_gradient_engines_do_not_cover_the_forward_convolutions():
    """opt1's H200 counters once held one legacy dgrad launch and no TF32 forward convolution; the forward
    kernels' share must not count as profiled."""
    fprop = "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1_" \
            "execute_segment_k_off_kernel__5x_cudnn"
    k = kernels_frame([(fprop, 40, "convolution"), ("void at::native::RowwiseMomentsCUDAKernel<float>(long)", 60,
                                                    "reduction")])
    legacy = [n for n, d in CONV_NAMES.items() if d in ("dgrad", "wgrad") and "onvolve" in n]
    assert legacy and ncu_table.profiled_coverage(k, pd.DataFrame({"kernel": legacy})) == 0.0
    helper = [n for n in CONV_NAMES if "reduce_wgrad" in n or "sdpa" in n]
    assert helper and ncu_table.profiled_coverage(k, pd.DataFrame({"kernel": helper})) == 0.0


# ------------------------------------------------------------------------------------------ layers

class FakeReport:
    """Nsight Compute's report interface (ncu_report) over a list of (function name, push/pop ranges)."""

    def __init__(self, results):
        self.results = results

    def load_report(self, path):
        results = self.results

        class Domain:
            def __init__(self, ranges):
                self.ranges = ranges

            def push_pop_ranges(self):
                return tuple(self.ranges)

        class State:
            def __init__(self, ranges):
                self.ranges = ranges

            def domains(self):
                return (0,)

            def domain_by_id(self, i):
                return Domain(self.ranges)

        class Action:
            def __init__(self, name, ranges):
                self._name, self.ranges = name, ranges

            def name(self):
                return self._name

            def nvtx_state(self):
                return State(self.ranges)

        class Range:
            def num_actions(self):
                return len(results)

            def action_by_idx(self, i):
                return Action(*results[i])

        class Context:
            def num_ranges(self):
                return 1

            def range_by_idx(self, i):
                return Range()

        return Context()


def test_layer_ranges_are_kept_per_launch_by_position_and_checked_by_name(details, monkeypatch):
    _, df = details
    ids = sorted(df["kernel_id"].unique())
    names = df.groupby("kernel_id")["kernel"].first()
    function = [re.match(r"(?:void )?(?:[\w:<>]*::)?(\w+)", ncu_names._QUALIFIER.sub("", names[i])).group(1) for i in ids]
    layer = "conv3d 64>64 k3 s1 @32x32x32"
    results = [(f, ["medddpm_step", layer + (" backward" if j % 2 else "")] if j < 4 else []) for j, f in enumerate(function)]
    monkeypatch.setattr(ncu_layers, "report_module", lambda ncu="ncu": FakeReport(results))
    out, said = ncu_layers.with_layers(df, Path("report.ncu-rep"))
    assert said == "; 4 launches inside layer ranges"
    assert ncu_table.launch_layers(out).tolist() == [layer, layer + " backward"] * 2 + [""] * (len(ids) - 4)
    s = ncu_table.kernel_summary(out)
    assert s["layer"].tolist()[:2] == [layer, layer + " backward"] and len(s) == len(ids)
    # a report whose results do not line up with the export leaves the table as it was
    monkeypatch.setattr(ncu_layers, "report_module", lambda ncu="ncu": FakeReport(results[::-1]))
    out, said = ncu_layers.with_layers(df, Path("report.ncu-rep"))
    assert out.equals(df) and "not kept" in said
    monkeypatch.setattr(ncu_layers, "report_module", lambda ncu="ncu": None)
    assert ncu_layers.with_layers(df, Path("report.ncu-rep")) == (df, "")
