"""Requests that cannot fit the device, refused by every command that trains or samples before any work: a
checkpoint whose model says 1024^3 (`sample`), a sweep, an ablation, a bench and a study too large for the
device. Each is one line with the estimate and `--force-memory`, and nothing is written (no error run recorded
after an attempt); `--force-memory` starts the work with a note instead. The estimates stay under every peak
measured, so that a refusal never stops a run that would have fitted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from medddpm.cli.main import main
from medddpm.configs import get_config
from medddpm.measure.study import convergence as conv
from medddpm.model.unet import ModelSpec, parse_size
from medddpm.presets import get_preset
from medddpm.report import loading
from medddpm.train import budget, checkpoint, sampling
from test_reliability import _cli, env, producer  # noqa: F401 - fixtures used below
from test_reliability_inputs import _small, one_line, shared_cache  # noqa: F401 - the small model, one cache
from test_reliability_training import copy_run, trained  # noqa: F401

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def _ram(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(budget, "device_memory", lambda device: (int(gib * GIB), "the RAM available on this machine"))


def _checkpoint_of_size(trained, tmp_path, size: int):
    """The trained checkpoint with its model's size changed (the weights of a U-Net fit any size), written whole."""
    out = copy_run(trained, tmp_path)
    state = checkpoint.read(out / checkpoint.CHECKPOINT)
    state["spec"]["size"] = size
    checkpoint.save(state, out / checkpoint.CHECKPOINT)
    return out


def test_sample_refuses_a_checkpoint_whose_model_cannot_fit_before_making_a_label_map(trained, tmp_path, capsys,
                                                                                      monkeypatch):
    out = _checkpoint_of_size(trained, tmp_path, 1024)
    monkeypatch.setattr(sampling, "label_volume", lambda *a, **k: pytest.fail("a 1024^3 label map was made"))
    assert main(["sample", "--checkpoint", str(out), "--out", str(tmp_path / "gen"), "--device", "cpu"]) == 2
    one_line(capsys, "error: sampling of the 1024x1024x1024 model under checkpoint needs at least ",
             "more than the RAM available", "pass --force-memory to start anyway")
    assert not (tmp_path / "gen").exists()


def test_sample_with_force_memory_says_the_estimate_and_samples(trained, tmp_path, capsys, monkeypatch):
    _ram(monkeypatch, 0)
    monkeypatch.setattr(sampling, "generate", lambda engine, labels, **kw: np.zeros((1, *labels.shape), np.float32))
    argv = ["sample", "--checkpoint", str(trained), "--out", str(tmp_path / "gen"), "--device", "cpu"]
    assert main(argv) == 2
    one_line(capsys, "error: sampling of the 16x16x16 model", "(0.0 GiB)", "--force-memory")
    assert main([*argv, "--force-memory"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "starting all the same (--force-memory)" in notes[0], notes
    assert (tmp_path / "gen" / "image" / "sample_000.nii.gz").is_file()


def test_a_sweep_too_large_for_the_device_is_refused_before_any_folder(tmp_path, capsys, producer):
    argv = ["sweep", "--configs", "baseline,best-ckpt", "--out", str(tmp_path / "data"), "--device", "cpu",
            "--gpu-label", "cpu", "--size", "1024"]
    rc, lines = _cli(capsys, *argv)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: a training step of the 1024x1024x1024 model needs more than the RAM available")
    assert "baseline (at least " in lines[0] and "best-ckpt (at least " in lines[0] and "--force-memory" in lines[0]
    assert not (tmp_path / "data").exists(), "no folder, no error run recorded after an attempt"


def test_an_ablation_too_large_for_the_device_is_refused_before_any_folder(tmp_path, capsys, producer, monkeypatch):
    _ram(monkeypatch, 1)
    rc, lines = _cli(capsys, "ablation", "--out", str(tmp_path / "data"), "--device", "cpu", "--gpu-label", "cpu")
    assert rc == 2 and len(lines) == 1 and "128x128x128 model" in lines[0] and "--force-memory" in lines[0], lines
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("phase", ["train", "sample"])
def test_a_bench_too_large_for_the_device_is_refused_before_any_step(tmp_path, capsys, monkeypatch, phase):
    from medddpm.measure.timing import bench

    for name in ("bench_train", "bench_sample"):
        monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("a step was timed"))
    assert main(["bench", "--configs", "baseline", "--size", "1024", "--device", "cpu", "--phase", phase]) == 2
    kind = "a training step" if phase == "train" else "sampling"
    one_line(capsys, f"error: {kind} of the 1024x1024x1024 model under baseline needs at least ", "--force-memory")


def test_a_study_too_large_for_the_device_is_refused_before_any_data_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(conv, "prepare_data", lambda *a, **k: pytest.fail("the study's data was made"))
    monkeypatch.setattr(conv, "run_one", lambda *a, **k: pytest.fail("a run started"))
    assert main(["study", "--configs", "bf16", "--seeds", "1", "--size", "512", "--device", "cpu", "--out",
                 str(tmp_path / "data"), "--work", str(tmp_path / "work")]) == 2
    one_line(capsys, "error: a training step of the 512x512x512 model under bf16 needs at least ", "--samples",
             "--force-memory")
    assert not list(tmp_path.iterdir())


def test_the_sampling_estimate_comes_out_both_ways(monkeypatch):
    paper = get_preset("paper").spec(mask_channels=3)
    need = budget.sampling_estimate(paper, get_config("baseline"))
    assert 1 * GIB < need.total < 2 * GIB
    assert budget.sampling_estimate(paper, get_config("bf16")).total < need.total, "16-bit activations"
    assert budget.sampling_estimate(paper, get_config("baseline"), batch=4).activation_bytes == 4 * need.activation_bytes
    _ram(monkeypatch, need.total / GIB)
    assert budget.check_fits(paper, get_config("baseline"), torch.device("cpu"), kind=budget.SAMPLING) is None
    _ram(monkeypatch, need.total / GIB - 0.01)
    with pytest.raises(budget.TooLarge, match="sampling of the 128x128x128 model under baseline"):
        budget.check_fits(paper, get_config("baseline"), torch.device("cpu"), kind=budget.SAMPLING)


def test_the_sampling_estimate_is_under_every_committed_sampling_peak():
    """A refusal never stops a sample that would have fitted: every committed GPU run's sampling peak is above the
    estimate for its model, configuration and batch."""
    run = loading.runs(ROOT / "data", variants=True)
    run = run[(run["status"] == "ok") & (run["sample_peak_mem_bytes"] > 0)]
    assert len(run) >= 5
    for r in run.itertuples():
        spec = get_preset(r.preset).spec(mask_channels=int(r.mask_channels), image_channels=int(r.image_channels))
        spec = ModelSpec(**spec.__dict__ | {"size": parse_size(r.shape)})
        need = budget.sampling_estimate(spec, get_config(r.config), batch=int(r.batch)).total
        assert need <= r.sample_peak_mem_bytes, (r.folder, need / GIB, r.sample_peak_mem_bytes / GIB)
