"""Requests that cannot fit and commands stopped or refused half-way: a training step larger than the device, Ctrl-C
in a training, a sweep or an export, a sweep over committed runs, a device label too long for a folder, a label map
the checkpoint's model cannot take (wrong data is `test_reliability_inputs`'s).

Each case runs through the command line and asserts its exit code, exactly one line on stderr naming the problem,
and files left as they were (no half-written folder); the cases handled rather than refused assert what was made
of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch

from medddpm.cli.main import main
from medddpm.configs import get_config
from medddpm.measure import sweep as sw
from medddpm.measure.run import get_preset
from medddpm.measure.validate import MAX_LABEL, check_label
from medddpm.model.unet import ModelSpec, parse_size
from medddpm.report import loading
from medddpm.store.schema import write_table
from medddpm.train import budget, checkpoint, loop
from medddpm.train.engine import Engine
from test_reliability import _cli, _same, _tables, env, producer  # noqa: F401 - fixtures used below
# the data helpers, and the fixtures every test here takes (a small model, a volume cache)
from test_reliability_inputs import SHAPE, _save, _small, inflating, one_line, own_cache, shared_cache  # noqa: F401
from test_reliability_training import _fail_for, files, train_cli, two_levels

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ 4. requests that cannot fit


GIB = 2**30


@pytest.mark.parametrize("extra, have", [(["--size", "1024"], 24 * GIB), (["--size", "512", "--config", "best-ckpt"],
                                                                           24 * GIB),
                                         (["--size", "1024"], None), (["--preset", "brats"], 24 * GIB)],
                         ids=["1024^3 on 24 GiB", "512^3 best-ckpt on 24 GiB", "1024^3 on this machine",
                              "the BraTS model on 24 GiB"])
def test_a_step_that_cannot_fit_is_refused_before_any_work(tmp_path, capsys, monkeypatch, own_cache, extra, have):
    if have is not None:
        monkeypatch.setattr(budget, "device_memory", lambda device: (have, "the RAM available on this machine"))
    t0 = time.monotonic()
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu", *extra]) == 2
    line = one_line(capsys, "error: a training step of the ", "needs at least", "more than the RAM available",
                    "--force-memory")
    if have is not None:
        assert "(24.0 GiB)" in line, line
    assert time.monotonic() - t0 < 20
    assert not (tmp_path / "run").exists() and not own_cache.exists(), "no data made, no folder"


def test_force_memory_says_the_estimate_and_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(budget, "device_memory", lambda device: (2**20, "the RAM available on this machine"))
    assert train_cli(tmp_path / "refused") == 2
    one_line(capsys, "error: ", "(0.0 GiB)", "--force-memory")
    assert not (tmp_path / "refused").exists()
    assert train_cli(tmp_path / "run", "--force-memory", steps=1) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: a training step")]
    assert len(err) == 1 and "starting all the same (--force-memory)" in err[0], err
    assert torch.load(tmp_path / "run" / checkpoint.CHECKPOINT, weights_only=True)["step"] == 1


def test_a_gpu_s_total_memory_bounds_the_step(monkeypatch):
    class Properties:
        total_memory = 16 * GIB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    paper = get_preset("paper").spec(mask_channels=3)
    with pytest.raises(ValueError, match=r"128x128x128 model under baseline needs at least 17\.6 GiB .*more than "
                                         r"the total memory of cuda:0 \(16\.0 GiB\)"):
        budget.check_fits(paper, get_config("baseline"), torch.device("cuda:0"))
    assert budget.check_fits(paper, get_config("best"), torch.device("cuda:0")) is None


def test_the_estimate_is_under_every_committed_peak():
    """A refusal never stops a run that would have fitted: every committed GPU run's measured peak is above the
    estimate for its model and configuration."""
    run = loading.runs(ROOT / "data", variants=True)
    run = run[(run["status"] == "ok") & (run["peak_mem_bytes"] > 0)]
    assert len(run) >= 5
    for r in run.itertuples():
        spec = get_preset(r.preset).spec(mask_channels=int(r.mask_channels), image_channels=int(r.image_channels))
        spec = ModelSpec(**spec.__dict__ | {"size": parse_size(r.shape)})
        need = budget.estimate(spec, get_config(r.config)).total
        assert need <= r.peak_mem_bytes, (r.folder, need / GIB, r.peak_mem_bytes / GIB)


# ------------------------------------------------------------------------ 5. stopped and refused commands


def _interrupted_at(call: int):
    """Engine.step, stopped by Ctrl-C at its `call`-th call."""
    real, calls = Engine.step, []

    def step(self, batches):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(self, batches)

    return step


def test_ctrl_c_in_training_says_which_checkpoint_is_kept(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "step", _interrupted_at(2))
        assert train_cli(out, "--save-every", "1", steps=3) == 130
    one_line(capsys, "interrupted: ", f"the checkpoint of step 1 in {out} is kept", "the same command resumes")
    assert torch.load(out / checkpoint.CHECKPOINT, weights_only=True)["step"] == 1
    assert [r["step"] for r in loop.read_loss_log(out)] == [1]
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.CHECKPOINT, loop.LOSS_LOG]


@pytest.mark.slow
def test_ctrl_c_in_training_resumes_to_the_same_end(tmp_path, capsys):
    out, whole = tmp_path / "run", tmp_path / "whole"
    at_8 = ("--save-every", "2", "--size", "8")  # 8^3: ten steps in all
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "step", _interrupted_at(3))
        assert train_cli(out, *at_8, steps=4) == 130
    one_line(capsys, "interrupted: ", f"the checkpoint of step 2 in {out} is kept")
    assert train_cli(out, *at_8, steps=4) == 0
    assert train_cli(whole, *at_8, steps=4) == 0
    assert loop.read_loss_log(out) == loop.read_loss_log(whole)
    a, b = (torch.load(d / checkpoint.CHECKPOINT, weights_only=True) for d in (out, whole))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_ctrl_c_before_the_first_checkpoint_says_there_is_none(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Engine, "step", lambda self, batches: (_ for _ in ()).throw(KeyboardInterrupt))
    assert train_cli(tmp_path / "run") == 130
    one_line(capsys, "interrupted: ", "no checkpoint had been written", "the same command starts again")
    assert not (tmp_path / "run" / checkpoint.CHECKPOINT).exists()


def test_ctrl_c_while_the_data_is_read_is_one_line(tmp_path, capsys, monkeypatch):
    from medddpm.cli import commands

    monkeypatch.setattr(commands, "open_data", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert train_cli(tmp_path / "run") == 130
    one_line(capsys, "interrupted: ", str(tmp_path / "run"), "the same command resumes")


def _interrupting(monkeypatch, config: str) -> None:
    """The producer stops with Ctrl-C in `config`'s notebook, after its steps table."""
    import papermill

    real = papermill.execute_notebook

    def execute(notebook, output, parameters, **kw):
        if parameters["config"] == config:
            write_table(pd.DataFrame({"run_id": "x", "phase": "train", "micro_step": [0], "timed": [True], "step_ms": [1.0],
                                      "dispatch_ms": [0.1], "loss": [0.5], "peak_mem_bytes": -1}),
                        Path(parameters["stage"]) / "steps.parquet", "steps")
            raise KeyboardInterrupt
        return real(notebook, output, parameters, **kw)

    monkeypatch.setattr(papermill, "execute_notebook", execute)


def _sweep_cli(capsys, out, configs, *extra):
    return _cli(capsys, "sweep", "--configs", configs, "--out", str(out), "--device", "cpu", "--gpu-label", "cpu",
                *extra)


def test_ctrl_c_in_a_sweep_keeps_the_finished_runs_and_the_same_command_measures_the_rest(tmp_path, capsys, producer,
                                                                                            monkeypatch):
    data, root = tmp_path / "data", tmp_path / "data" / "cpu"
    assert _sweep_cli(capsys, data, "baseline")[0] == 0
    before = _tables(root / "baseline")
    with pytest.MonkeyPatch.context() as mp:
        _interrupting(mp, "opt1")
        rc, lines = _sweep_cli(capsys, data, "opt2,opt1")
    assert rc == 130 and len(lines) == 1, lines
    assert lines[0].startswith("interrupted: the runs finished so far are kept in") and "(opt1)" in lines[0]
    # the label's roofs table lies beside its runs (the sweep measures it first): the folders are the runs
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["baseline", "opt2"], "no stage, no half run of opt1"
    assert _same(_tables(root / "baseline"), before)
    with pytest.MonkeyPatch.context() as mp:  # over a finished run, with --force: the old one stays whole
        _interrupting(mp, "baseline")
        assert _sweep_cli(capsys, data, "baseline", "--force")[0] == 130
    assert _same(_tables(root / "baseline"), before) and not list(root.glob(".*"))
    rc, lines = _sweep_cli(capsys, data, "opt2,opt1")
    assert rc == 0 and lines == ["2 of 2 configuration(s) measured"]


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=medddpm", "-c", "user.email=medddpm@localhost", *args], cwd=cwd,
                   check=True, capture_output=True)


@pytest.fixture
def committed(tmp_path, capsys, producer):
    """A repository whose data/cpu/ holds two committed runs: baseline (ok) and opt1 (failed with error)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    producer["opt1"] = "fail"
    assert _sweep_cli(capsys, repo / "data", "baseline,opt1")[0] == 1
    _git(repo, "add", "data")
    _git(repo, "commit", "-qm", "runs")
    producer["opt1"] = "ok"
    return repo / "data"


def test_a_sweep_never_replaces_committed_runs_without_naming_them(committed, capsys):
    root = committed / "cpu"
    before = {name: _tables(root / name) for name in ("baseline", "opt1")}
    rc, lines = _sweep_cli(capsys, committed, "baseline,opt1,opt2", "--force")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: this sweep would replace committed run(s) in {root}: baseline, opt1 (tracked by git); "
                        "measure under another --gpu-label, or name them: --replace-committed baseline,opt1")
    rc, lines = _sweep_cli(capsys, committed, "baseline,opt1", "--force", "--replace-committed", "baseline")
    assert rc == 2 and lines[0].startswith(f"error: this sweep would replace committed run(s) in {root}: opt1 ")
    rc, lines = _sweep_cli(capsys, committed, "opt1")  # a failed committed run is measured again: named too
    assert rc == 2 and "opt1 (tracked by git)" in lines[0]
    assert all(_same(_tables(root / n), before[n]) for n in before) and not (root / "opt2").exists()
    capsys.readouterr()
    assert sw.sweep("baseline", preset="smoke", out=committed, device="cpu", gpu_label="cpu")[0]["status"] == \
        "done before"
    assert f"baseline: committed in {root / 'baseline'} (--force --replace-committed baseline measures it again)" \
        in capsys.readouterr().err


def test_naming_the_committed_runs_replaces_them(committed, capsys):
    root = committed / "cpu"
    before = _tables(root / "baseline")
    rc, lines = _sweep_cli(capsys, committed, "baseline,opt1", "--force", "--replace-committed", "baseline,opt1")
    assert rc == 0 and lines == ["2 of 2 configuration(s) measured"], lines
    assert not _same(_tables(root / "baseline"), before)


@pytest.mark.parametrize("label", ["x" * 300, "h" * (MAX_LABEL + 1)])
def test_a_long_gpu_label_is_refused_before_any_folder_is_made(tmp_path, capsys, label):
    rc, lines = _cli(capsys, "sweep", "--configs", "baseline", "--out", str(tmp_path / "data"), "--device", "cpu",
                     "--gpu-label", label)
    assert rc == 2 and len(lines) == 1 and f"({len(label)} characters)" in lines[0] and len(lines[0]) < 200, lines
    rc, lines = _cli(capsys, "study", "--configs", "baseline", "--seeds", "1", "--out", str(tmp_path / "data"),
                     "--work", str(tmp_path / "work"), "--device", "cpu", "--gpu-label", label)
    assert rc == 2 and len(lines) == 1 and f"at most {MAX_LABEL} characters" in lines[0], lines
    assert not list(tmp_path.iterdir()), "no folder made"
    assert check_label("h" * MAX_LABEL) == "h" * MAX_LABEL


# export-data


def test_ctrl_c_in_export_data_leaves_no_folder(tmp_path, capsys, monkeypatch):
    from medddpm.train import export

    real, calls = export._save, []

    def save(img, path):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(img, path)

    monkeypatch.setattr(export, "_save", save)
    out = tmp_path / "out"
    assert main(["export-data", "--out", str(out), "--pairs", "4", "--size", "16"]) == 130
    one_line(capsys, "interrupted: ", f"nothing was written to {out}; the same command starts again")
    assert not list(tmp_path.iterdir()), "no folder, no stage, no lock left"


def test_a_full_disk_in_export_data_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        _fail_for(mp, ".mask_001.nii.gz.")
        assert main(["export-data", "--out", str(out), "--pairs", "3", "--size", "16"]) == 2
    one_line(capsys, "error: cannot write ", "mask_001.nii.gz", "the disk is full")
    assert not list(tmp_path.iterdir())
    assert main(["export-data", "--out", str(out), "--pairs", "3", "--size", "16"]) == 0
    assert sorted(p.name for p in out.rglob("*.nii.gz"))[:2] == ["img_000.nii.gz", "img_001.nii.gz"]


@pytest.mark.parametrize("argv, needle", [(["--size", "1024"], "more than the 134 M voxels"),
                                          (["--layout", "brats", "--size", "600"], "600x600x600")],
                         ids=["1024^3", "BraTS at 600^3"])
def test_export_data_refuses_volumes_training_would_refuse(tmp_path, capsys, argv, needle):
    assert main(["export-data", "--out", str(tmp_path / "out"), "--pairs", "1", *argv]) == 2
    one_line(capsys, "error: size ", needle)
    assert not list(tmp_path.iterdir())


def test_export_data_into_a_folder_that_holds_files_changes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "mask").mkdir(parents=True)
    (out / "mask" / "keep.nii.gz").write_bytes(b"mine")
    before = files(out)
    assert main(["export-data", "--out", str(out), "--pairs", "1", "--size", "16"]) == 2
    one_line(capsys, "error: ", str(out), "not empty")
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (out / "mask" / "keep.nii.gz").unlink()
    (out / "mask").rmdir()
    assert main(["export-data", "--out", str(out), "--pairs", "1", "--size", "16"]) == 0, "an empty folder is taken"
    assert len(list(out.rglob("*.nii.gz"))) == 2


@pytest.mark.slow
def test_export_data_stopped_by_a_signal_leaves_no_folder_training_would_take(tmp_path):
    """Real signals: SIGINT and SIGTERM each end in one line and exit code 130 or 143, leaving nothing behind."""
    out = tmp_path / "out"
    # the export must still run when the signal comes, which this process sends once the first volume is staged: on
    # a loaded 2-core machine an export of 60 pairs had ended by then
    argv = [sys.executable, "-m", "medddpm", "export-data", "--out", str(out), "--pairs", "600", "--size", "48"]
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(argv, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.stage-*/image/*.nii.gz")) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert not out.exists(), sig
        said = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
        assert proc.returncode == 128 + sig and err.strip().splitlines() == [
            f"{said}: nothing was written to {out}; the same command starts again"], err
        assert not list(tmp_path.iterdir()), "no stage, no lock"
    assert main(["export-data", "--out", str(out), "--pairs", "1", "--size", "16"]) == 0


# sample: the label maps checked against the checkpoint's model before any sample


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    out = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as mp:
        two_levels(mp)
        mp.setenv("MEDDDPM_CACHE", str(shared_cache))
        assert train_cli(out, steps=1) == 0
    return out


def _label_file(tmp_path, shape=SHAPE, top=3) -> Path:
    labels = np.random.default_rng(7).integers(0, top + 1, shape).astype(np.uint8)
    labels.flat[0] = top
    _save(tmp_path / "labels.nii.gz", labels)
    return tmp_path / "labels.nii.gz"


SAMPLES = {  # case -> (the --labels given, what the one line names)
    "a 32x32x2 label map": (lambda t: ["mni:0", str(_label_file(t, (32, 32, 2)))], ["labels.nii.gz", "stretched 8"]),
    "a 512^3 label map": (lambda t: [str(inflating(t / "labels.nii.gz") or t / "labels.nii.gz")],
                          ["labels.nii.gz", "shrunk 32"]),
    "label 5 for a model of 3": (lambda t: ["mni:0", str(_label_file(t, top=5))],
                                 ["labels.nii.gz: label 5", "num_classes=3"]),
    "the BraTS labels for a whole-head model": (lambda t: ["mni:0", "mni-brats:0"],
                                                ["'mni-brats:0': 4 label classes", "takes 3"]),
}


@pytest.mark.parametrize("case", SAMPLES)
def test_sample_refuses_a_label_map_the_model_cannot_take_before_sampling(trained, tmp_path, capsys, monkeypatch,
                                                                          case):
    from medddpm.train import sampling

    monkeypatch.setattr(sampling, "generate", lambda *a, **k: pytest.fail("sampled before the label maps were checked"))
    labels, needles = SAMPLES[case]
    argv = ["sample", "--checkpoint", str(trained), "--out", str(tmp_path / "gen"), "--device", "cpu", "--labels",
            *labels(tmp_path)]
    assert main(argv) == 2
    one_line(capsys, "error: ", *needles)
    assert not (tmp_path / "gen").exists()


def test_sample_takes_a_label_map_of_the_model_s_shape(trained, tmp_path, capsys, monkeypatch):
    from medddpm.train import sampling

    # the denoising itself is another test's (test_cli): here, what reaches it
    monkeypatch.setattr(sampling, "generate", lambda engine, labels, **kw: np.zeros((1, *labels.shape), np.float32))
    labels = tmp_path / "labels.nii.gz"
    _label_file(tmp_path)
    assert main(["sample", "--checkpoint", str(trained), "--out", str(tmp_path / "gen"), "--device", "cpu",
                 "--labels", str(labels), "mni:1"]) == 0
    written = np.asarray(nib.load(tmp_path / "gen" / "mask" / "sample_000.nii.gz").dataobj)
    assert np.array_equal(written, np.asarray(nib.as_closest_canonical(nib.load(labels)).dataobj))
