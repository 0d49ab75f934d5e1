import pytest
import torch

from medddpm.diffusion import GaussianDiffusion, cosine_betas
from medddpm.flops import count
from medddpm.model import Attention, ModelSpec, UNet3D, count_parameters


def test_reference_parameter_count_and_flops():
    info = count(ModelSpec(size=128, mask_channels=2))
    assert info["parameters"] == 40_226_433
    assert abs(info["forward_flops"] / 5.537e12 - 1) < 0.01
    assert abs(info["forward_flops_by_op"]["convolution"] / 5497.7e9 - 1) < 0.001
    assert abs(info["forward_flops_by_op"]["bmm"] / 38.9e9 - 1) < 0.01
    assert abs(info["train_flops"] / 16.63e12 - 1) < 0.01


@pytest.mark.parametrize("mask_channels", [1, 3, 4])
def test_each_mask_channel_adds_a_stem_filter(mask_channels):
    base = count(ModelSpec(size=128, mask_channels=2))["parameters"]
    assert count(ModelSpec(size=128, mask_channels=mask_channels))["parameters"] == base + (mask_channels - 2) * 64 * 27


def test_forward_shape_and_zero_init_output(tiny_spec):
    model = UNet3D(tiny_spec)
    x = torch.randn(2, tiny_spec.in_channels, 16, 16, 16)
    out = model(x, torch.tensor([0, 249]))
    assert out.shape == (2, 1, 16, 16, 16)
    assert torch.count_nonzero(out) == 0, "the output convolution starts at zero, as in guided diffusion"


def test_wrong_input_channels_is_a_clear_error(tiny_spec):
    with pytest.raises(AssertionError, match=r"expected \(B, 4, D, H, W\)"):
        UNet3D(tiny_spec)(torch.randn(1, 3, 16, 16, 16), torch.tensor([1]))


@pytest.mark.parametrize("bad", [dict(size=0), dict(size=20, channel_mult=(1, 2, 4, 8)), dict(base_channels=48),
                                 dict(mask_channels=2.0)])
def test_bad_spec(bad):
    with pytest.raises(ValueError):
        ModelSpec(**bad)


def test_sdpa_attention_matches_math():
    torch.manual_seed(0)
    a, b = Attention(64, kind="math"), Attention(64, kind="sdpa")
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.1)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 64, 4, 4, 4, requires_grad=True)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ga, = torch.autograd.grad(ya.square().sum(), x)
    gb, = torch.autograd.grad(yb.square().sum(), x)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


def test_recomputed_attention_gives_the_same_gradients(tiny_spec):
    torch.manual_seed(0)
    a = UNet3D(tiny_spec, recompute_attention=True)
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.05)
    b = UNet3D(tiny_spec, recompute_attention=False)
    b.load_state_dict(a.state_dict())
    x, t = torch.randn(1, 4, 16, 16, 16), torch.tensor([10])
    a(x, t).square().sum().backward()
    b(x, t).square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=name)


def test_cosine_schedule():
    betas = cosine_betas(250)
    assert betas.shape == (250,) and float(betas.max()) <= 0.999 and float(betas.min()) > 0
    alpha_bar = torch.cumprod(1 - betas, 0)
    assert float(alpha_bar[0]) > 0.999 and float(alpha_bar[-1]) < 1e-3
    assert bool((betas[1:] >= betas[:-1]).all()), "cosine betas grow with t"


def test_q_sample_and_posterior_step_recover_x0_with_perfect_noise_prediction():
    d = GaussianDiffusion(timesteps=250)
    x0 = torch.rand(1, 1, 4, 4, 4) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([0])
    x_t = d.q_sample(x0, t, noise)

    class Oracle(torch.nn.Module):  # returns the true noise: the step must land on x0 at t=0
        def forward(self, x, t):
            return noise

    out = d.p_step(Oracle(), x_t, torch.zeros(1, 0, 4, 4, 4), t, torch.randn_like(x0))
    torch.testing.assert_close(out, x0, rtol=1e-4, atol=1e-4)


def test_sampler_output_shape_and_range(tiny_spec):
    d = GaussianDiffusion(timesteps=5)
    model = UNet3D(tiny_spec)
    cond = torch.ones(1, 3, 16, 16, 16)
    out = d.sample(model, cond, generator=torch.Generator().manual_seed(0), progress=False)
    assert out.shape == (1, 1, 16, 16, 16) and torch.isfinite(out).all()


def test_parameter_count_helper(tiny_spec):
    assert count_parameters(UNet3D(tiny_spec)) == count(tiny_spec)["parameters"]
