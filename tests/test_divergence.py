"""Training stops at a non-finite loss that fp16's loss scaler did not skip: one line, the last good checkpoint
kept, the log ending at the bad step; a step the scaler skipped is not a divergence."""

import math

import pytest
import torch

from medddpm.train import checkpoint
from medddpm.train.engine import Engine
from medddpm.train.loop import Diverged, read_loss_log, train

from conftest import Pairs


def poisoned_step(at: int, *, skip: bool):
    """Engine.step whose loss is NaN at optimizer step `at` (from 1); with `skip`, as a scaler would, that step also
    counts as skipped."""
    real = Engine.step

    def step(self, batches):
        loss = real(self, batches)
        if self.step_count == at:
            if skip:
                self._skipped += 1
            return torch.full_like(loss, math.nan)
        return loss
    return step


def test_a_nan_loss_stops_training_keeps_the_last_checkpoint_and_ends_the_log(tiny_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(Engine, "step", poisoned_step(7, skip=False))
    with pytest.raises(Diverged, match=r"training diverged: loss nan at step 7 \(the checkpoint of step 5 is kept\)"):
        train(tiny_spec, "baseline", Pairs(tiny_spec), out_dir=tmp_path, steps=12, grad_accum=1, save_every=5,
              log_every=4, progress=False)
    log = read_loss_log(tmp_path)
    assert [r["step"] for r in log] == list(range(1, 8)) and math.isnan(log[-1]["loss"])
    assert all(math.isfinite(r["loss"]) for r in log[:-1])
    assert checkpoint.read(tmp_path / checkpoint.CHECKPOINT, map_location="cpu")["step"] == 5


def test_a_nan_before_any_checkpoint_says_none_was_written(tiny_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(Engine, "step", poisoned_step(2, skip=False))
    with pytest.raises(Diverged, match="no checkpoint had been written"):
        train(tiny_spec, "baseline", Pairs(tiny_spec), out_dir=tmp_path, steps=6, grad_accum=1, save_every=5,
              log_every=1, progress=False)
    assert not (tmp_path / checkpoint.CHECKPOINT).exists()


def test_a_step_the_loss_scaler_skipped_is_not_a_divergence(small_spec, tmp_path, monkeypatch):
    """fp16 at 8^3: the CPU runs fp16 3-D convolutions in a reference kernel."""
    monkeypatch.setattr(Engine, "step", poisoned_step(3, skip=True))
    engine = train(small_spec, "fp16", Pairs(small_spec), out_dir=tmp_path, steps=6, grad_accum=1, save_every=5,
                   log_every=2, progress=False)
    assert engine.scaler is not None and engine.step_count == 6 and engine.skipped_steps == 1
    assert len(read_loss_log(tmp_path)) == 6
