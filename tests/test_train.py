import json

import pytest
import torch

from medddpm.train import loop as train_mod
from medddpm.train.sampling import generate, load_checkpoint, write_nifti
from medddpm.train.loop import read_loss_log, train

from conftest import Pairs


def _weights(engine):
    return [p.detach().clone() for p in engine.model.parameters()]


@pytest.mark.slow
def test_interrupted_run_resumes_from_its_checkpoint(small_spec, tmp_path, monkeypatch):
    data = Pairs(small_spec)
    kw = dict(steps=6, grad_accum=2, lr=1e-3, save_every=2, log_every=1, progress=False)
    whole = train(small_spec, "baseline", data, out_dir=tmp_path / "whole", **kw)

    # Kill the second run inside step 5 (after the step-4 checkpoint was written).
    real_step = train_mod.Engine.step
    calls = {"n": 0}

    def dying_step(self, batches):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("killed")
        return real_step(self, batches)

    monkeypatch.setattr(train_mod.Engine, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        train(small_spec, "baseline", data, out_dir=tmp_path / "cut", **kw)
    monkeypatch.setattr(train_mod.Engine, "step", real_step)
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 4
    assert not list((tmp_path / "cut").glob("*.tmp")), "no half-written files"

    resumed = train(small_spec, "baseline", data, out_dir=tmp_path / "cut", **kw)
    assert resumed.step_count == whole.step_count == 6
    for a, b in zip(_weights(whole), _weights(resumed)):
        assert torch.equal(a, b), "a resumed run must continue exactly where the killed one stopped"
    assert [r["step"] for r in read_loss_log(tmp_path / "cut")] == list(range(1, 7))
    assert read_loss_log(tmp_path / "cut") == read_loss_log(tmp_path / "whole")


def test_resume_refuses_another_configuration(tiny_spec, tmp_path):
    data = Pairs(tiny_spec)
    train(tiny_spec, "baseline", data, out_dir=tmp_path, steps=1, grad_accum=1, progress=False)
    with pytest.raises(ValueError, match="another run \\(precision 'fp32' -> 'bf16'\\).*--allow-changed"):
        train(tiny_spec, "bf16", data, out_dir=tmp_path, steps=2, grad_accum=1, progress=False)
    with pytest.raises(ValueError, match="grad_accum 1 -> 2; lr 1e-05 -> 0.001"):
        train(tiny_spec, "baseline", data, out_dir=tmp_path, steps=2, grad_accum=2, lr=1e-3, progress=False)
    engine = train(tiny_spec, "baseline", data, out_dir=tmp_path, steps=2, grad_accum=1, lr=1e-3, progress=False,
                   allow_changed=True)
    assert engine.step_count == 2 and [g["lr"] for g in engine.opt.param_groups] == [1e-3]


@pytest.mark.parametrize("bad", [dict(steps=0), dict(steps=-3), dict(grad_accum=1.5), dict(steps="10"),
                                 dict(lr=float("inf")), dict(lr=float("nan")), dict(lr=0.0), dict(lr=-1e-4), dict(lr=True)])
def test_bad_training_parameters_fail_before_work(tiny_spec, tmp_path, bad):
    kw = dict(steps=2, grad_accum=1, progress=False) | bad
    with pytest.raises(ValueError, match="must be a positive"):
        train(tiny_spec, "baseline", Pairs(tiny_spec), out_dir=tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists()


def test_sample_from_checkpoint_writes_nifti(tiny_spec, tmp_path):
    import nibabel as nib

    train(tiny_spec, "baseline", Pairs(tiny_spec), out_dir=tmp_path, steps=2, grad_accum=1, progress=False)
    engine = load_checkpoint(tmp_path, device="cpu")
    engine.diffusion.__init__(timesteps=3)  # a short chain keeps the test fast
    labels = torch.randint(0, 4, (16, 16, 16)).numpy().astype("uint8")
    image = generate(engine, labels, progress=False)
    assert image.shape == (1, 16, 16, 16)
    path = write_nifti(tmp_path / "out" / "s.nii.gz", image[0])
    assert nib.load(path).shape == (16, 16, 16)
    assert json.loads((tmp_path / "loss.jsonl").read_text().splitlines()[0])["step"] == 1


@pytest.mark.slow
def test_compiled_sampling_keeps_the_trained_switches(small_spec, tmp_path):
    """`compiled=True` keeps torch.compile (and CUDA graphs where they apply) and samples what the
    eager rebuild samples (in FP32, so that the comparison is tight)."""
    import numpy as np

    from medddpm.configs import CONFIGS
    from medddpm.train.engine import Engine
    from medddpm.measure.run import randomize_
    from medddpm.train.loop import save_checkpoint

    trained = Engine(small_spec, CONFIGS["compile"].with_flags(precision="fp32"), ema=False)
    randomize_(trained.model, seed=1)  # the zero-initialised output layer would hide the model
    save_checkpoint(trained, tmp_path / "checkpoint.pt", extra={})
    eager, compiled = (load_checkpoint(tmp_path, compiled=c) for c in (False, True))
    assert not eager.run.compile and eager.denoiser is eager.model
    assert compiled.run.compile and compiled.denoiser is not compiled.model
    labels = torch.randint(0, 4, small_spec.shape, generator=torch.Generator().manual_seed(2)).numpy().astype("uint8")
    images = []
    for engine in (eager, compiled):
        engine.diffusion.__init__(timesteps=3)
        images.append(generate(engine, labels, progress=False))
    assert not np.allclose(images[0], 0)
    np.testing.assert_allclose(images[1], images[0], atol=1e-3)  # FP32 kernels of other fusions
