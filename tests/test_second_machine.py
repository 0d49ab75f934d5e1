"""The main command on a second machine of a device type the data already holds: `scripts/main.sh` labels it
`<type>-<host>`, measures its roofs and its runs beside the committed rows, builds the book and prints the
summary. Here the committed data tree is copied, this machine's runs are the committed CPU's paper four as a
machine four times slower would have measured them (re-labelled, every time scaled), and its roofs are written
as the sweep writes a measurement: fast enough for its own steps, too slow for the committed CPU's. The pages'
computations of the first page, the step-time page and Beyond, and the summary, then run on that tree as the book
build and main.sh run them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import REPO
from medddpm import report
from medddpm.analysis import roofs as ar
from medddpm.cli.main import main
from medddpm.configs import PAPER
from medddpm.measure.env import host_name
from medddpm.measure.sweep import machine_label
from medddpm.measure.timing import roofs as mr
from medddpm.report import beyond, intro
from medddpm.store import schema

SLOWER = 4.0  # the second machine takes this many times the committed CPU's time for each step
TIMES = {"run": ["train_median_ms", "train_p10_ms", "train_p90_ms", "train_mean_ms", "train_std_ms",
                 "dispatch_median_ms", "sample_step_median_ms", "gpu_hours_100k"],
         "steps": ["step_ms", "dispatch_ms"]}


def measured_elsewhere(source: Path, target: Path, label: str) -> None:
    """The run of `source` as the machine `label` (this host) measured it: every table re-labelled, its times
    `SLOWER` times the committed ones."""
    target.mkdir(parents=True)
    for path in source.glob("*.parquet"):
        table = path.stem
        df = schema.read_table(path)
        df["run_id"] = df["run_id"].str.replace("cpu/", f"{label}/", n=1, regex=False)
        if "gpu_slug" in df:
            df["gpu_slug"] = label
        if table == "run":
            df = df.assign(host=host_name(), gpu_type="cpu", achieved_tflops=df["achieved_tflops"] / SLOWER)
        for col in TIMES.get(table, []):
            df[col] = df[col] * SLOWER
        schema.write_table(df, target / path.name, table)


def its_roofs(label: str, fp32: float) -> pd.DataFrame:
    """This machine's roofs as `measure.timing.roofs` writes them: an AVX2 CPU's, whose bf16 and fp16 matmuls are
    far slower than its FP32."""
    values = {"dram": 10e9, "fp32": fp32, "bf16": fp32 / 7, "fp16": fp32 / 10}
    return pd.DataFrame([{"gpu_slug": label, "gpu_name": "cpu", "gpu_type": "cpu", "host": host_name(), "roof": r,
                          "unit": ar.UNITS[r], "value": v, "p10": v * 0.95, "p90": v * 1.02, "repeats": 5,
                          "size": 768, "method": "as measured on a CPU", "sm_clock_mhz": float("nan"),
                          "mem_clock_mhz": float("nan"), "driver": "", "cuda": "", "torch": torch.__version__,
                          "git_commit": "", "start_time": ""} for r, v in values.items()])[list(schema.TABLES["roofs"])]


@pytest.mark.slow
def test_a_second_machine_of_a_committed_type_passes_the_main_command_s_pages(tmp_path, capsys):
    committed = REPO / "data"
    if not (committed / "cpu" / "baseline" / "run.parquet").is_file():
        pytest.skip("no committed CPU rows")
    root = tmp_path / "data"
    shutil.copytree(committed, root)
    label = machine_label(root, torch.device("cpu"))
    assert label == f"cpu-{host_name()}", "beside the committed CPU rows, never over them"
    for config in PAPER:
        measured_elsewhere(committed / "cpu" / config, root / label / config, label)
    base = schema.read_table(committed / "cpu" / "baseline" / "run.parquet").iloc[0]
    theirs = base["flops_per_step"] / (base["train_median_ms"] / 1e3)  # the committed CPU's strict-FP32 rate
    fp32 = 2.0 * theirs / SLOWER  # twice this machine's own rate, half the committed one's
    mr.write(its_roofs(label, fp32), root)

    data = report.load_all(root)
    assert {label, "cpu"} <= set(data.run["gpu_slug"]) and set(data.roofs["gpu_slug"]) >= {label}
    # Beyond: every floor under its step; the committed CPU, with no roofs of its own and no datasheet, has none,
    # where the new machine's roofs lent to it would put its strict-FP32 step at twice their rate.
    summary = report.step_summary(data.run)
    report.check_speedups(report.speedups(data.run))
    floors = beyond.floors(data)
    beyond.check_floors(floors)
    assert "cpu" not in set(floors["gpu_slug"]) and theirs > fp32
    mine = floors[floors["gpu_slug"] == label].set_index("precision")
    fastest = min(schema.read_table(committed / "cpu" / c / "run.parquet").loc[0, "train_median_ms"] for c in PAPER)
    assert mine.loc["fp32", "basis"] == ar.MEASURED
    assert mine.loc["fp32", "fraction_of_peak"] == pytest.approx(0.5 * base["train_median_ms"] / fastest)
    said = report.basis_text(data)
    assert f"**{label}** has no datasheet here: read against its own measured roofs" in said, said
    assert "**cpu** has neither measured roofs nor a datasheet" in said, said
    cpus = report.cpu_slugs(data.run)
    assert {label, "cpu"} <= cpus
    beyond.ladder_text(summary, data.bench, cpus), beyond.channels_last_text(summary, data.bench, cpus)
    beyond.check_busy(report.gpu_busy(data), cpus)
    beyond.sampling_text(beyond.sampling(summary, cpus), cpus)
    # The first page and the step-time page.
    head, on_gpu = intro.headline_devices(data)
    intro.check_headline(head)
    step = intro.counted_step()
    eff = intro.fp32_efficiency(data)
    assert label not in set(eff["gpu_slug"]), "the first page's efficiency is of GPUs"
    total = step["train_flops"] * report.REFERENCE_STEPS * report.REFERENCE_ACCUM
    intro.check_cost(intro.training_cost(eff, total))
    assert f"**{label}** (a CPU: smoke runs)" in intro.measured_text(data)
    report.step_time.check(data, summary)
    report.check_roofs(report.roofs_view(data))
    # The summary main.sh prints last: this machine against the committed rows of its type.
    assert main(["summary", "--out", str(root), "--device", "cpu"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"labelled {label}" in text and "Compared with the committed rows of its device type: cpu," in text, text
    assert f"this machine takes {SLOWER:.2f}x its time" in text, text
