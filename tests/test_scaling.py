"""Data-parallel scaling (medddpm/scaling.py): real torchrun launches of gloo ranks on the CPU."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from medddpm import report
from medddpm.store import schema
from medddpm.report import charts
from medddpm.cli.main import main
from medddpm.measure.scaling import merge_rows, parse_world_sizes, scale


# sdpa's switches in float32 (channels-last, SDPA, fused Adam; no bf16 autocast): an AVX2-only CPU runs a bfloat16
# 3-D convolution about 70x slower than a float32 one, and the ranks' bf16 steps were most of this test's time.
FP32_SDPA = "sdpa+precision=fp32"


@pytest.mark.slow
@pytest.mark.budget(200)  # 92-100 CPU seconds measured: launches of one and two gloo ranks, then one again
def test_two_cpu_ranks_write_every_ranks_steps_and_a_rerun_keeps_other_world_sizes(tmp_path):
    path = scale(FP32_SDPA, "1,2", preset="smoke", out=str(tmp_path), device="cpu", micro_steps=2, warmup=1)
    assert path == tmp_path / "cpu" / "scaling" / f"{FP32_SDPA}.parquet"
    df = schema.read_table(path, "scaling")
    assert df.groupby(["world_size", "rank"]).size().to_dict() == {(1, 0): 3, (2, 0): 3, (2, 1): 3}
    assert (df.groupby(["world_size", "rank"])["timed"].sum() == 2).all() and (df["step_ms"] > 0).all()
    assert set(df["backend"]) == {"gloo"} and df["run_id"].nunique() == 2
    two = df[df["world_size"] == 2]
    # the rerun at one rank: a launch of two processes where one of two ranks takes three
    scale(FP32_SDPA, [1], preset="smoke", out=str(tmp_path), device="cpu", micro_steps=2, warmup=0)
    again = schema.read_table(path, "scaling")
    pd.testing.assert_frame_equal(again[again["world_size"] == 2].reset_index(drop=True), two.reset_index(drop=True))
    assert again.groupby(["world_size", "rank"]).size().to_dict() == {(1, 0): 2, (2, 0): 3, (2, 1): 3}
    summary = report.scaling_summary(report.scaling_runs(tmp_path))
    assert list(summary["world_size"]) == [1, 2] and summary["efficiency"].iloc[0] == pytest.approx(1.0)
    assert summary["samples_per_s"].gt(0).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(config="sdpa", world_sizes="0"), "positive integers"),
    (dict(config="sdpa", world_sizes="1,x"), "positive integers"),
    (dict(config="sdpa", world_sizes="2,2"), "without repeats"),
    (dict(config="graphs", world_sizes="1"), "CUDA graphs"),
    (dict(config="nope", world_sizes="1"), "unknown configuration"),
    (dict(config="sdpa", world_sizes="1", device="tpu"), "device must be"),
    (dict(config="sdpa", world_sizes="1", device="cpu", micro_steps=0), "micro_steps must be"),
])
def test_bad_input_fails_before_any_launch(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        scale(out=str(tmp_path), **kwargs)
    assert not any(tmp_path.iterdir()), "nothing launched, nothing written"


def test_cli_errors_in_one_line(capsys):
    assert main(["scale", "--config", "sdpa", "--world-sizes", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def _rows(world: int, times: dict[int, list[float]], slug: str = "gpu-x", config: str = "sdpa") -> pd.DataFrame:
    return pd.DataFrame([{"run_id": f"{slug}/{config}/scaling-{world}/t", "gpu_name": slug, "gpu_slug": slug,
                          "config": config, "preset": "paper", "backend": "nccl", "world_size": world, "rank": r,
                          "micro_step": i, "timed": True, "step_ms": t, "batch": 1, "size": 128, "threads_per_rank": 4,
                          "torch": "2", "git_commit": "abc", "start_time": "t"}
                         for r, ts in times.items() for i, t in enumerate(ts)])


def test_summary_takes_the_slowest_rank_of_each_step():
    df = pd.concat([_rows(1, {0: [100, 100, 100]}), _rows(2, {0: [100, 130, 100], 1: [120, 100, 110]})])
    s = report.scaling_summary(df).set_index("world_size")
    assert s.loc[2, "step_median_ms"] == 120  # steps last 120, 130, 110 (slowest rank each): median 120
    assert s.loc[2, "samples_per_s"] == pytest.approx(2 / 0.120)
    assert s.loc[2, "efficiency"] == pytest.approx((2 / 0.120) / (2 / 0.100))
    assert (s.loc[2, "rank_min_ms"], s.loc[2, "rank_max_ms"]) == (100, 110)
    no_one = report.scaling_summary(_rows(2, {0: [100], 1: [100]}))
    assert no_one["efficiency"].isna().all()  # no one-rank run: no efficiency claimed


def test_merge_replaces_only_its_world_size(tmp_path):
    path = tmp_path / "x.parquet"
    schema.write_table(pd.concat([_rows(1, {0: [1.0]}), _rows(2, {0: [2.0], 1: [2.0]})]), path, "scaling")
    merged = merge_rows(path, _rows(2, {0: [3.0], 1: [3.0]}))
    assert merged.groupby("world_size")["step_ms"].max().to_dict() == {1: 1.0, 2: 3.0}


def test_scaling_tables_are_found_validated_and_charted(tmp_path):
    assert parse_world_sizes("1, 2,4") == [1, 2, 4]
    folder = tmp_path / "gpu-x" / "scaling"
    schema.write_table(pd.concat([_rows(1, {0: [100.0]}), _rows(2, {0: [110.0], 1: [105.0]})]), folder / "sdpa.parquet",
                       "scaling")
    assert report.scan(tmp_path).runs == [] and report.scan(tmp_path).not_runs == []  # not a run folder, not an error
    spec = charts.scaling(report.scaling_summary(report.scaling_runs(tmp_path))).to_dict()
    assert {r["world_size"] for d in spec["datasets"].values() for r in d} == {1, 2}
    assert "no data-parallel scaling" in json.dumps(charts.scaling(report.scaling_summary(schema.empty("scaling"))).to_dict())
    schema.write_table(_rows(1, {0: [1.0]}, config="opt1"), folder / "sdpa.parquet", "scaling")
    with pytest.warns(report.DataWarning, match="another GPU or configuration"):
        report.scaling_runs(tmp_path)
