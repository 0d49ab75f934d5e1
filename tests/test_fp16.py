"""fp16 with a dynamic loss scale: the configuration trains on a CPU, and a step whose gradients overflow is
skipped by the scaler and counted."""

import pytest
import torch

from medddpm.configs import CONFIGS, get_config, resolve
from medddpm.train.engine import Engine

from medddpm.model.unet import ModelSpec

from conftest import random_batch


@pytest.fixture
def spec8() -> ModelSpec:
    """8^3: PyTorch's CPU runs fp16 3D convolutions in its reference kernel (slow_conv3d), some 200x bf16's time
    at 16^3; at 8^3 a step takes a fraction of a second."""
    return ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))


def test_fp16_is_a_named_configuration_like_bf16():
    fp16, bf16 = CONFIGS["fp16"], CONFIGS["bf16"]
    assert fp16.flags == bf16.flags | {"precision": "fp16"}
    assert CONFIGS["fp16-best"].flags == CONFIGS["best"].flags | {"precision": "fp16"}
    run = resolve(fp16, "cpu")
    assert run.autocast_dtype == torch.float16 and run.loss_scaling and run.not_applicable == {}
    assert not resolve(bf16, "cpu").loss_scaling and resolve(bf16, "cpu").autocast_dtype == torch.bfloat16


def test_fp16_step_scales_the_loss_and_keeps_fp32_weights(spec8):
    engine = Engine(spec8, "fp16", device="cpu", ema=False, seed=0)
    assert engine.scaler is not None and engine.scaler.is_enabled()
    x, c = random_batch(spec8)
    before = [p.detach().clone() for p in engine.model.parameters()]
    loss = engine.step((engine.prepare(x), engine.prepare(c)))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    moved = sum(not torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    assert moved > 0 and engine.skipped_steps == 0
    with engine.autocast():
        out = engine.model(torch.cat([x, c], 1), torch.tensor([3]))
    assert out.dtype == torch.float16


def _poison_first_gradient(engine):
    """An inf in one gradient, as an fp16 overflow in backward leaves it."""
    param = next(engine.model.parameters())
    return param.register_hook(lambda g: torch.full_like(g, float("inf")))


@pytest.mark.parametrize("fused", [False, True])
def test_an_inf_gradient_makes_the_scaler_skip_the_step_and_it_is_counted(spec8, fused):
    engine = Engine(spec8, get_config("fp16").with_flags(fused_adam=fused), device="cpu", ema=False, seed=0)
    x, c = (engine.prepare(t) for t in random_batch(spec8))
    engine.step((x, c))  # a clean step first: Adam's state exists, the scale is set
    scale = engine.scaler.get_scale()
    weights = [p.detach().clone() for p in engine.model.parameters()]
    adam_steps = [float(s["step"]) for s in engine.opt.state.values()]
    hook = _poison_first_gradient(engine)
    engine.step((x, c))
    hook.remove()
    assert engine.skipped_steps == 1
    assert engine.scaler.get_scale() == scale / 2, "an overflow halves the loss scale"
    assert all(torch.equal(a, p) for a, p in zip(weights, engine.model.parameters())), "a skipped step moves nothing"
    assert [float(s["step"]) for s in engine.opt.state.values()] == adam_steps
    engine.step((x, c))
    assert engine.skipped_steps == 1, "a clean step after it is not skipped"
    assert not all(torch.equal(a, p) for a, p in zip(weights, engine.model.parameters()))


def test_the_count_and_the_scale_survive_a_checkpoint(spec8):
    engine = Engine(spec8, "fp16", device="cpu", ema=False, seed=0)
    x, c = (engine.prepare(t) for t in random_batch(spec8))
    hook = _poison_first_gradient(engine)
    engine.step((x, c))
    hook.remove()
    state = engine.state_dict()
    assert state["skipped_steps"] == 1 and state["scaler"]["scale"] == engine.scaler.get_scale()
    resumed = Engine(spec8, "fp16", device="cpu", ema=False, seed=1)
    resumed.load_state_dict(state)
    assert resumed.skipped_steps == 1 and resumed.scaler.get_scale() == engine.scaler.get_scale()


def test_without_a_scaler_nothing_is_skipped(spec8):
    engine = Engine(spec8, "bf16", device="cpu", ema=False, seed=0)
    assert engine.scaler is None
    x, c = (engine.prepare(t) for t in random_batch(spec8))
    engine.step((x, c))
    assert engine.skipped_steps == 0 and "scaler" not in engine.state_dict()
