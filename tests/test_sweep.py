import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medddpm.store.layout import RUN_TABLES
from medddpm.store.schema import read_table
from test_cli import cli

ROOT = Path(__file__).resolve().parent.parent


def _folder(parent: Path, name: str) -> Path:
    """The folder of configuration `name`'s run under `parent`: `name` for the preset's own steps, size and data,
    `name~<key>` for a run of others (a tiny one of a test)."""
    found = [p for p in parent.glob(f"{name}*") if p.name == name or p.name.startswith(f"{name}~")]
    assert len(found) == 1, found
    return found[0]


def sweep(*args, **kw):
    env = kw.pop("env", os.environ) | {"PYTHONPATH": str(ROOT), "MEDDDPM_CACHE": str(kw.pop("cache"))}
    return subprocess.Popen([sys.executable, "-m", "medddpm", "sweep", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def sweep_here(capsys, *args) -> tuple[int, str]:
    """`sweep ARGS` in this process (a Python process importing torch costs 8-13 CPU seconds): its exit status, and
    what it wrote to stdout and stderr."""
    rc, out, err = cli(capsys, "sweep", *args)
    return rc, out + err


@pytest.mark.slow
@pytest.mark.budget(160)  # 55-72 CPU seconds measured: four configurations' notebooks
def test_smoke_sweep_writes_every_table_for_the_paper_configurations(tmp_path, capsys, monkeypatch):
    """Every phase at the preset's steps but the sample's: 3 denoising steps, not the preset's 250, which took 80% of
    a run (the preset's own count reaching the run: test_brats_preset_and_batch_reach_the_producer_notebook; its
    run landing in the configuration's own folder: tests/test_reliability.py's identity tests); at 8^3, as every
    sweep here but the BraTS one: nothing checked depends on the size."""
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, "--preset", "smoke", "--configs", "paper", "--out", str(tmp_path / "data"),
                         "--device", "cpu", "--sample-steps", "3", "--size", "8")
    assert rc == 0, out[-3000:]
    for name in ("baseline", "opt1", "opt2", "opt12"):
        folder = _folder(tmp_path / "data" / "cpu", name)
        run = read_table(folder / "run.parquet")
        assert run.loc[0, "status"] == "ok", run.loc[0, "message"]
        assert run.loc[0, "gpu_slug"] == "cpu" and run.loc[0, "config"] == name
        steps = read_table(folder / "steps.parquet")
        assert (steps.query("phase == 'train'")["timed"].sum(), (~steps.query("phase == 'train'")["timed"]).sum()) == (3, 1)
        assert (steps["phase"] == "sample").sum() == 3
        kernels = read_table(folder / "kernels.parquet")
        assert abs(kernels["share"].sum() - 1) < 1e-6 and "convolution" in set(kernels["category"])
        quality = read_table(folder / "quality.parquet")
        assert len(quality) == 3 and quality["rel_err"].notna().all()
        assert (folder / "produce.ipynb").exists(), "the executed notebook is stored next to its data"
        assert "?it/s]" not in (folder / "produce.ipynb").read_text(), "the stored notebook keeps no progress bars"
        assert not (folder / "ncu.parquet").exists(), "no GPU, no counters"
        assert set(RUN_TABLES) - {"ncu"} <= {f.stem for f in folder.glob("*.parquet")}
    opt1 = read_table(_folder(tmp_path / "data" / "cpu", "opt1") / "run.parquet")
    assert "precision" in opt1.loc[0, "not_applicable"] and opt1.loc[0, "precision_used"] == "fp32"


@pytest.mark.slow
@pytest.mark.budget(150)  # 37 CPU seconds measured
def test_a_killed_sweep_resumes_without_duplicated_or_lost_rows(tmp_path, capsys, monkeypatch):
    """The sweep killed (SIGKILL to it and its notebook kernel) in a process of its own; the same command, run again
    here, resumes it."""
    args = ("--preset", "smoke", "--configs", "baseline,opt2", "--out", str(tmp_path / "data"), "--device", "cpu",
            "--phases", "sample,quality", "--micro-steps", "2", "--sample-steps", "3", "--size", "8")
    cpu = tmp_path / "data" / "cpu"
    p = sweep(*args, cache=tmp_path / "cache")
    deadline = time.time() + 600
    while not list(cpu.glob("baseline~*/run.parquet")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # the sweep and its notebook kernel, mid-way through opt2
    p.wait()
    (first,) = cpu.glob("baseline~*/run.parquet")  # --micro-steps 2: not the preset's own steps
    assert not list(cpu.glob("opt2*/run.parquet"))
    run_id = read_table(first).loc[0, "run_id"]

    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, *args)
    assert rc == 0, out[-3000:]
    assert "done before" in out
    assert read_table(first).loc[0, "run_id"] == run_id, "a finished configuration is not measured again"
    for name in ("baseline", "opt2"):
        steps = read_table(_folder(cpu, name) / "steps.parquet")
        train = steps.query("phase == 'train'")
        assert list(train["micro_step"]) == [0, 1, 2] and train["micro_step"].is_unique
        assert list(steps.query("phase == 'sample'")["timed"]) == [False, True, True], "--sample-steps reached it"
    assert not list((tmp_path / "data" / "cpu").glob(".*")), "no staging folders left behind"


@pytest.mark.parametrize("args, message", [
    (["--configs", "baseline,turbo"], "unknown configuration 'turbo'"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--micro-steps", "-1"], "expected a positive integer, got -1"),
    (["--micro-steps", "1.5"], "expected a positive integer, got '1.5'"),
    (["--batch", "0"], "expected a positive integer, got 0"),
    (["--size", "32x32"], "expected N or DxHxW"),
    (["--preset", "brats", "--size", "32x32x24"], "24 is not"),
    (["--preset", "brats", "--data", "mni"], "preset brats is a model of 4 label channels; the data has 3"),
    (["--configs", "best-ckpt+checkpointing=maybe"], "checkpointing must be a bool"),
    (["--time-limit", "0"], "expected a positive integer, got 0"),
    (["--sample-steps", "1"], "sample_steps must be an int of at least 2"),
])
def test_bad_sweep_parameters_fail_before_any_work(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, *args, "--out", str(tmp_path / "data"))
    assert rc == 2 and message in out
    assert not (tmp_path / "data").exists()


def test_a_count_of_steps_given_to_the_sweep_is_refused_naming_micro_steps(tmp_path):
    """The producer notebook times micro-steps: a `steps` parameter (an optimizer step's name) would be ignored."""
    from medddpm.measure.sweep import sweep as run_sweep

    with pytest.raises(ValueError, match="name the count micro_steps"):
        run_sweep("baseline", out=tmp_path / "data", device="cpu", params={"steps": 2})
    assert not (tmp_path / "data").exists()


def test_a_wrong_data_path_fails_before_any_configuration_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, "--preset", "smoke", "--configs", "baseline", "--out", str(tmp_path / "data"),
                         "--device", "cpu", "--data", str(tmp_path / "missing"))
    assert rc == 2 and str(tmp_path / "missing") in out.strip().splitlines()[-1]
    assert not (tmp_path / "data" / "cpu" / "baseline").exists()


@pytest.mark.slow
@pytest.mark.budget(150)  # 43-63 CPU seconds measured
def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(tmp_path, capsys, monkeypatch):
    # A real compile error: Inductor finds no C++ compiler for the CPU kernels of `compile` (the notebook kernels
    # take this process's environment).
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, "--preset", "smoke", "--configs", "compile,baseline", "--out", str(tmp_path / "data"),
                         "--device", "cpu", "--phases", "sample,quality", "--micro-steps", "1", "--sample-steps", "2",
                         "--size", "8")
    assert rc == 1, out[-3000:]
    assert "1 of 2 configuration(s) measured; failed: compile (error)" in out
    failed = read_table(_folder(tmp_path / "data" / "cpu", "compile") / "run.parquet")
    assert failed.loc[0, "status"] == "error" and "compiler" in failed.loc[0, "message"].lower()
    assert read_table(_folder(tmp_path / "data" / "cpu", "baseline") / "run.parquet").loc[0, "status"] == "ok"


@pytest.mark.slow
@pytest.mark.budget(150)  # 43-57 CPU seconds measured
def test_brats_preset_and_batch_reach_the_producer_notebook(tmp_path, capsys, monkeypatch):
    """--preset brats --batch 2 (at a CPU-sized input, the smallest its five levels take): the run lands in
    <config>@brats-b2 with the BraTS model's shape, channels and parameters, read back by the book's loader as a
    variant run."""
    from medddpm import report

    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, "--preset", "brats", "--size", "16x16x16", "--configs", "opt1-ckpt", "--batch", "2",
                         "--micro-steps", "1", "--warmup", "1", "--phases", "sample,quality", "--out",
                         str(tmp_path / "data"), "--device", "cpu")
    assert rc == 0, out[-3000:]
    folder = _folder(tmp_path / "data" / "cpu", "opt1-ckpt@brats-b2")
    run = read_table(folder / "run.parquet").iloc[0]
    assert run["status"] == "ok", run["message"]
    assert (run["preset"], run["shape"], run["batch"], run["checkpointing"]) == ("brats", "16x16x16", 2, True)
    assert (run["image_channels"], run["mask_channels"], run["num_res_blocks"], run["parameters"]) == (4, 4, 2, 57_562_564)
    assert run["sample_steps"] == 20 and len(read_table(folder / "quality.parquet")) == 3
    assert report.runs(tmp_path / "data", variants=True)["folder"].tolist() == [f"cpu/{folder.name}"]
    assert report.runs(tmp_path / "data").empty, "the main pages read the main preset at batch 1 only"


def test_nsight_compute_gets_what_the_time_limit_leaves(tmp_path):
    """Nsight Compute runs last: under --time-limit it gets what the other phases left, at most
    --ncu-timeout, and is skipped (with why) when too little is left to start it."""
    import pandas as pd

    from medddpm.measure import run as measure

    def make(**kw):
        return measure.Measurement("baseline", "smoke", device="cpu", out=str(tmp_path / "data"),
                                   **{"ncu_timeout": 300} | kw)

    assert make().ncu_budget() == 300
    kernels = pd.DataFrame({"kernel": ["k"], "category": ["convolution"], "total_us": [1.0], "calls": [1]})
    short = make(ncu_timeout=30)  # a short timeout asked for, no time limit: ncu is tried, not skipped for time
    short.tables["kernels"] = kernels
    short.counters()
    assert short.ncu_budget() == 30 and "time limit" not in short.profiler_status["ncu"]["message"]
    m = make(time_limit=400)
    assert m.ncu_budget() == 300  # plenty left: ncu_timeout caps it
    m._t0 -= 200  # 200 s spent by the earlier phases
    assert 400 - 200 - measure.FINISH_S - 2 <= m.ncu_budget() <= 400 - 200 - measure.FINISH_S
    m._t0 -= 150
    m.tables["kernels"] = kernels
    assert m.counters() is None
    status = m.profiler_status["ncu"]
    assert status["status"] == "skipped" and "of the run's 400 s time limit" in status["message"], status
    with pytest.raises(ValueError, match="time_limit"):
        make(time_limit=0)


@pytest.mark.slow
@pytest.mark.budget(160)  # 66-80 CPU seconds measured: a compiled configuration twice, cold then warm
def test_a_run_records_what_the_compile_caches_did(tmp_path, monkeypatch):
    """run.parquet says whether the training phase compiled or found its graphs in the on-disk caches, so a
    slow first step says whether it compiled anew; the counts are the phase's, not the process's. The smoke
    model with one level and no attention: the counts, not the model, are under test, and its cold compile
    takes half the two-level one's CPU seconds."""
    import dataclasses
    import json

    import torch

    from medddpm import presets
    from medddpm.measure import run as measure

    monkeypatch.setitem(presets.PRESETS, "smoke", dataclasses.replace(presets.PRESETS["smoke"], channel_mult=(1,),
                                                                      attention_ds=()))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: the first run compiles
    caches = []
    try:
        for i in range(2):
            torch._dynamo.reset()
            m = measure.Measurement("compile", "smoke", device="cpu", size=8, micro_steps=1, warmup=1, phases=(),
                                    out=str(tmp_path / f"data{i}"))
            m.train()
            caches.append(json.loads(m.finish().loc[0, "compile_cache"]))
    finally:  # Inductor's pool of compile workers, which would outlive the test (a sweep's kernel ends with its run)
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    first, second = caches
    assert first.get("inductor.fxgraph_cache_miss", 0) >= 1 and "inductor.fxgraph_cache_hit" not in first, first
    assert second.get("inductor.fxgraph_cache_hit", 0) >= 1 and "inductor.fxgraph_cache_miss" not in second, second
    eager = measure.Measurement("baseline", "smoke", device="cpu", size=8, micro_steps=1, warmup=0, phases=(),
                                out=str(tmp_path / "eager"))
    assert eager.finish().loc[0, "compile_cache"] == "", "a phase that did not run recorded nothing"
    eager.train()
    assert json.loads(eager.finish().loc[0, "compile_cache"]) == {}


def _run_file(root: Path, label: str, config: str, *, host: str | None, ms: float) -> Path:
    """A run.parquet under root/label/config/: from `host`, or as committed rows were written, before the
    device type and host were recorded (host None)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from medddpm.configs import get_config
    from medddpm.measure.env import environment
    from medddpm.measure.run import run_row
    from medddpm.store import schema

    row = run_row(get_config(config), "smoke", env=environment(torch.device("cpu")), gpu_name="cpu", label=label,
                  status="ok", message="") | {"train_median_ms": ms, "timed_steps": 3, "shape": "16x16x16",
                                              "parameters": 1_778_241}
    path = root / label / config / "run.parquet"
    if host is None:
        table = schema.validate(__import__("pandas").DataFrame([row]), "run").drop_columns(["gpu_type", "host"])
        path.parent.mkdir(parents=True)
        pq.write_table(table, path)
    else:
        schema.write_table(__import__("pandas").DataFrame([row | {"host": host}]), path, "run")
    assert isinstance(schema.read_table(path).loc[0, "gpu_type"], str)
    return path


def test_a_machine_of_a_device_type_already_in_the_data_gets_its_own_label(tmp_path):
    """The device type while the data holds no rows of it from elsewhere (a first run, or this machine's own),
    <type>-<host> beside committed rows or another machine's; read back, the committed rows have their type."""
    import torch

    from medddpm.measure.env import host_name
    from medddpm.measure.sweep import machine_label
    from medddpm.store.schema import read_table

    cpu = torch.device("cpu")
    assert machine_label(tmp_path / "empty", cpu) == "cpu"
    _run_file(tmp_path / "own", "cpu", "baseline", host=host_name(), ms=10.0)
    assert machine_label(tmp_path / "own", cpu) == "cpu", "this machine's own rows: resumed under the type"
    committed = _run_file(tmp_path / "committed", "cpu", "baseline", host=None, ms=10.0)
    assert machine_label(tmp_path / "committed", cpu) == f"cpu-{host_name()}"
    assert read_table(committed).loc[0, ["gpu_type", "host"]].tolist() == ["cpu", ""]
    _run_file(tmp_path / "other", "cpu", "opt1", host="elsewhere", ms=10.0)
    assert machine_label(tmp_path / "other", cpu) == f"cpu-{host_name()}"


def test_the_summary_sets_the_fastest_configuration_beside_the_committed_row(tmp_path, capsys):
    from medddpm.cli.main import main
    from medddpm.measure.env import host_name

    label = f"cpu-{host_name()}"
    _run_file(tmp_path, "cpu", "baseline", host=None, ms=100.0)
    _run_file(tmp_path, "cpu", "opt1", host=None, ms=90.0)
    _run_file(tmp_path, label, "baseline", host=host_name(), ms=50.0)
    _run_file(tmp_path, label, "opt1", host=host_name(), ms=80.0)
    assert main(["summary", "--out", str(tmp_path), "--device", "cpu", "--book", str(tmp_path / "index.html")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"labelled {label}" in text and f"Measured 2 configuration(s) into {tmp_path / label}/" in text
    assert "Fastest here: baseline, 50.0 ms" in text and "100.0 ms" in text and "0.50x its time" in text, text
    assert "The book is not built yet" in text


def _gpu_run(root: Path, label: str, gpu_name: str, config: str, ms: float, host: str = "node1") -> Path:
    """A run.parquet of a GPU's paper preset under root/label/config/, measured on `host`."""
    import torch

    from medddpm.configs import get_config
    from medddpm.measure.env import environment
    from medddpm.measure.run import run_row
    from medddpm.store import schema

    row = run_row(get_config(config), "paper", env=environment(torch.device("cpu")), gpu_name=gpu_name, label=label,
                  status="ok", message="") | {"train_median_ms": ms, "timed_steps": 30, "shape": "128x128x128",
                                              "parameters": 40_228_161, "host": host}
    path = root / label / config / "run.parquet"
    schema.write_table(__import__("pandas").DataFrame([row]), path, "run")
    return path


def test_the_summary_of_a_labelled_card_compares_it_with_its_type_else_with_the_nearest_card(tmp_path, capsys):
    """Read on a CPU machine, a GPU label is compared as the card its rows name: with the committed rows of its
    type where the data hold them, else with the nearest other card (an H100's nearest is the H200, not the
    A100, by their datasheets), never with the CPU's smoke runs; the lines say which."""
    from medddpm.cli.main import main

    h100 = "NVIDIA H100 80GB HBM3"
    _run_file(tmp_path, "cpu", "best", host=None, ms=40.0)
    _gpu_run(tmp_path, "nvidia-h100-80gb-hbm3", h100, "best", 54.0)
    _gpu_run(tmp_path, "nvidia-h100-80gb-hbm3", h100, "baseline", 870.0)
    _gpu_run(tmp_path, "nvidia-h200", "NVIDIA H200", "best", 50.0)
    _gpu_run(tmp_path, "nvidia-a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", "best", 90.0)

    def said(*args: str) -> str:
        assert main(["summary", "--out", str(tmp_path), "--device", "cpu", *args]) == 0
        return " ".join(capsys.readouterr().out.split())

    text = said("--gpu-label", "nvidia-h100-80gb-hbm3")
    assert "The runs under nvidia-h100-80gb-hbm3: nvidia-h100-80gb-hbm3, measured on host node1" in text, text
    assert "Compared with the nearest other card in the data, by its datasheet roofs: nvidia-h200," in text, text
    assert "50.0 ms; the nvidia-h100-80gb-hbm3 runs take 1.08x its time" in text and "cpu" not in text.split(
        "Fastest here")[1], text
    _gpu_run(tmp_path, "nvidia-h100-80gb-hbm3-box", h100, "best", 60.0, host="box")
    text = said("--gpu-label", "nvidia-h100-80gb-hbm3-box")
    assert "Compared with the committed rows of its device type: nvidia-h100-80gb-hbm3," in text, text
    assert "1.11x its time" in text, text
    text = said("--gpu-label", "nvidia-h100-80gb-hbm3")
    assert "rows of its device type measured on another machine: nvidia-h100-80gb-hbm3-box" in text, text
    _gpu_run(tmp_path, "nvidia-b200", "NVIDIA B200", "baseline", 500.0)
    text = said("--gpu-label", "nvidia-b200")
    assert ("the nearest other card in the data, by its datasheet roofs (nvidia-h200 has no baseline of this "
            "size): nvidia-h100-80gb-hbm3," in text), text


@pytest.mark.slow
def test_a_sweep_beside_committed_rows_of_its_device_type_measures_the_reference_width_as_a_variant(
        tmp_path, capsys, monkeypatch):
    """A sweep on a device type that the data holds committed rows of measures it all the same, into
    <type>-<host>/, leaves the committed files as they were, and starts its kernels without the
    unencrypted-transport warning. Its --mask-channels 2 on the embedded data (3 tissues) measures the reference's
    whole-head width into <config>@<preset>-m2, which the loader reads back as a variant run, not as a main one."""
    from medddpm import report
    from medddpm.measure.env import host_name
    from medddpm.store.layout import KERNEL_LOG

    committed = _run_file(tmp_path / "data", "cpu", "baseline", host=None, ms=10.0)
    before = committed.read_bytes()
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    rc, out = sweep_here(capsys, "--preset", "smoke", "--configs", "baseline", "--mask-channels", "2", "--out",
                         str(tmp_path / "data"), "--device", "cpu", "--phases", "quality", "--micro-steps", "1",
                         "--warmup", "1", "--size", "8")
    assert rc == 0, out[-3000:]
    label = f"cpu-{host_name()}"
    folder = _folder(tmp_path / "data" / label, "baseline@smoke-m2")
    mine = read_table(folder / "run.parquet").iloc[0]
    assert mine["status"] == "ok", mine["message"]
    assert (mine["gpu_slug"], mine["gpu_type"], mine["gpu_name"], mine["host"]) == (label, "cpu", "cpu", host_name())
    assert committed.read_bytes() == before and "done before" not in out
    kernel_said = (folder / KERNEL_LOG).read_text() if (folder / KERNEL_LOG).exists() else ""
    assert "without encryption" not in out + kernel_said, (out + kernel_said)[-3000:]
    assert (mine["mask_channels"], mine["run_id"].split("/")[1]) == (2, "baseline@smoke-m2")
    shutil.rmtree(committed.parent)  # a row alone, without the tables the loader asks a run for
    assert report.runs(tmp_path / "data", variants=True)["folder"].tolist() == [f"{label}/{folder.name}"]
    assert report.runs(tmp_path / "data").empty, "the variant is no main run"
