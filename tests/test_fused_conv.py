"""The fused GroupNorm-SiLU-convolution (`conv="triton"`, `medddpm.model.fused_conv`) under Triton's interpreter:
its output against the float64 reference for each operand type, its epilogue's statistics against the output's,
its gradients against eager autograd, and where it runs. Tiny volumes with odd sides: the interpreter runs each
program's loop in Python (about 2 s a call on a 2-core machine)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_batch

from medddpm.configs import get_config, resolve
from medddpm.model import fused_conv
from medddpm.model.blocks import ResBlock
from medddpm.model.group_norm import group_stats_from_parts
from medddpm.model.unet import ModelSpec, UNet3D
from medddpm.train.engine import Engine

CL = torch.channels_last_3d


def _layer(c_in, c_out, groups, seed):
    """A GroupNorm and a convolution with random (not default) parameters."""
    torch.manual_seed(seed)
    norm, conv = torch.nn.GroupNorm(groups, c_in), torch.nn.Conv3d(c_in, c_out, 3, padding=1)
    for p in (*norm.parameters(), *conv.parameters()):
        torch.nn.init.normal_(p, mean=0.5 if p is norm.weight else 0.0, std=0.5 if p.ndim == 1 else 0.1)
    return norm, conv


def _reference(x, norm, conv, bias, *, operand=None, scales=(1.0, 1.0)):
    """conv3d(silu(group_norm(x))) + bias in float64; `operand`: both operands rounded to that type first, the
    activation times scales[0] and the weights times scales[1] (FP8's per-tensor scaling), then divided back."""
    a = F.silu(F.group_norm(x.double(), norm.num_groups, norm.weight.double(), norm.bias.double(), norm.eps))
    w = conv.weight.double()
    if operand is not None:
        a = (a * scales[0]).to(operand).double() / scales[0]
        w = (w * scales[1]).to(operand).double() / scales[1]
    return F.conv3d(a, w, padding=1) + bias.double()[:, :, None, None, None]


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("operands, tol_exact, tol_rounded", [
    ("float32", 1e-5, None),  # measured 1.5e-7
    ("bfloat16", 1e-2, 2e-3),  # measured 3e-3 against the exact value, 1.1e-3 against bf16 operands
    ("fp8", 8e-2, 2e-3),  # measured 3.8e-2 against the exact value
])
def test_fused_conv_matches_the_float64_reference(operands, tol_exact, tol_rounded):
    """y = conv3d(silu(group_norm(x))) + bias (per-sample bias, 2 samples, 2 voxel tiles, 4 groups of 4 channels)
    against float64: within float32's error for float32 operands, within the operands' rounding for bf16 and FP8,
    and close to float64 on operands rounded as the kernel rounds them (FP8: scaled by 448 / amax)."""
    norm, conv = _layer(16, 32, 4, seed=1)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 16, 7, 6, 7, generator=g) * 2 + 1).to(memory_format=CL)  # 294 voxels: tiles of 256 and 38
    bias = torch.randn(2, 32, generator=g)
    kind = "triton_fp8" if operands == "fp8" else "triton"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=operands == "bfloat16"):
        assert fused_conv.operands_for(x, kind)[0] == operands
        y, _ = fused_conv.norm_silu_conv(x, norm, conv, kind=kind, bias=bias)
    assert y.dtype == (torch.bfloat16 if operands == "bfloat16" else torch.float32)
    assert y.is_contiguous(memory_format=CL) and y.shape == (2, 32, 7, 6, 7)
    want = _reference(x, norm, conv, bias)
    assert torch.isfinite(y).all()
    assert _rel(y, want) < tol_exact, _rel(y, want)
    if operands == "bfloat16":
        assert _rel(y, _reference(x, norm, conv, bias, operand=torch.bfloat16)) < tol_rounded
    if operands == "fp8":
        with torch.no_grad():
            a = F.silu(F.group_norm(x.double(), 4, norm.weight.double(), norm.bias.double(), norm.eps))
        scales = (448 / float(a.abs().max()), 448 / float(conv.weight.detach().abs().max()))
        rounded = _reference(x, norm, conv, bias, operand=torch.float8_e4m3fn, scales=scales)
        assert _rel(y, rounded) < tol_rounded, _rel(y, rounded)


def test_the_epilogue_gives_the_next_norms_statistics():
    """The epilogue's per-channel mean and variance are those of y as stored (bf16), over tiles of unequal size,
    and the group statistics made from them are the next GroupNorm's; FP8's min and max are y's."""
    norm, conv = _layer(16, 32, 4, seed=3)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 16, 5, 9, 7, generator=g) * 3 - 2).to(memory_format=CL)  # 315 voxels
    bias = torch.randn(2, 32, generator=g) * 4  # means far from zero: the tiles' deviations keep the variance
    for kind, autocast in (("triton", True), ("triton_fp8", False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, st = fused_conv.norm_silu_conv(x, norm, conv, kind=kind, bias=bias, want_stats=True)
        yd = y.double()
        torch.testing.assert_close(st.mean.double(), yd.mean(dim=(2, 3, 4)), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st.var.double(), yd.var(dim=(2, 3, 4), correction=0), rtol=1e-5, atol=1e-6)
        mean, rstd = group_stats_from_parts(st.mean, st.var, 8, 1e-5)
        groups = yd.reshape(2, 8, -1)
        want_mean = groups.mean(-1).repeat_interleave(4, dim=1)
        want_rstd = (groups.var(-1, correction=0) + 1e-5).rsqrt().repeat_interleave(4, dim=1)
        torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-5, atol=0)
        if kind == "triton_fp8":
            assert torch.equal(st.min, y.amin(dim=(2, 3, 4))) and torch.equal(st.max, y.amax(dim=(2, 3, 4)))
        else:
            assert st.min.shape == st.max.shape == (2, 0)


def test_every_output_and_partial_is_written():
    """The kernel alone on a NaN-poisoned output: every voxel and channel written (three output-channel tiles, the
    last one partial), the convolution of silu(x * scale + shift) plus bias, and each tile's partial sums the sums
    of its own voxels."""
    g = torch.Generator().manual_seed(5)
    b, d, h, w, c_in, c_out = 1, 3, 5, 7, 32, 40
    x = torch.randn(b, d, h, w, c_in, generator=g)
    weight = torch.randn(27, c_out, c_in, generator=g) * 0.1
    scale, shift = torch.randn(b, c_in, generator=g), torch.randn(b, c_in, generator=g)
    bias = torch.randn(b, c_out, generator=g)
    y = torch.full((b, d, h, w, c_out), float("nan"))
    one = torch.ones(1)
    config = {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 32}
    parts, block_m = fused_conv._launch(x, weight, scale, shift, bias, one, one, y, silu=fused_conv.SILU_EXACT,
                                        ieee=True, stats=True, minmax=False, config=config)
    assert block_m == 64 and torch.isfinite(y).all()
    rows = y.reshape(b, -1, c_out)
    pad = -rows.shape[1] % 64
    tiles = F.pad(rows, (0, 0, 0, pad), value=0.0).reshape(b, -1, 64, c_out)  # 105 voxels: tiles of 64 and 41
    torch.testing.assert_close(parts[0], tiles.sum(2), rtol=1e-5, atol=1e-5)
    a = F.silu(x * scale[:, None, None, None] + shift[:, None, None, None]).permute(0, 4, 1, 2, 3)
    w5 = weight.reshape(3, 3, 3, c_out, c_in).permute(3, 4, 0, 1, 2)  # (C_out, C_in, kd, kh, kw)
    want = F.conv3d(a, w5, padding=1) + bias[..., None, None, None]
    torch.testing.assert_close(y.permute(0, 4, 1, 2, 3), want, rtol=1e-5, atol=1e-5)


def test_training_function_has_eager_gradients():
    """The operator's backward (cuDNN's convolution backward on the recomputed input, then GroupNorm-SiLU's closed
    form) against autograd through F.group_norm, F.silu and F.conv3d in float64: x, gamma, beta, weight and the
    per-sample bias, for two samples with different statistics."""
    norm, conv = _layer(16, 32, 4, seed=6)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 16, 4, 5, 3, generator=g) * torch.tensor([1.0, 3.0]).view(2, 1, 1, 1, 1) + 2)
    x = x.to(memory_format=CL).requires_grad_()
    bias = torch.randn(2, 32, generator=g, requires_grad=True)
    up = torch.randn(2, 32, 4, 5, 3, generator=g)
    y, _ = fused_conv.norm_silu_conv(x, norm, conv, kind="triton", bias=bias)
    params = (x, norm.weight, norm.bias, conv.weight, bias)
    got = torch.autograd.grad((y * up).sum(), params)
    ref = [p.detach().double().requires_grad_() for p in params]
    a = F.silu(F.group_norm(ref[0], 4, ref[1], ref[2], norm.eps))
    want = torch.autograd.grad(((F.conv3d(a, ref[3], padding=1) + ref[4][..., None, None, None]) * up).sum(), ref)
    for name, a, e in zip(("x", "gamma", "beta", "weight", "bias"), got, want):
        assert a.dtype == torch.float32 and a.abs().max() > 0, name
        assert _rel(a, e) < 1e-5, (name, _rel(a, e))  # float32 arithmetic: measured below 1e-6
    assert conv.bias.grad is None, "the convolution's own bias is replaced by the per-sample one"


def test_fused_res_block_is_the_res_block():
    """A residual block with conv="triton" (time embedding in the epilogue, the second norm's statistics from the
    first kernel) computes the cuDNN block's function and gradients, with the same parameters (a widening
    block: its skip is a 1x1 convolution; 64 channels in 32 groups, so that each bias moves its group's mean)."""
    torch.manual_seed(8)
    c_in = 32
    plain = ResBlock(c_in, 64, emb_dim=16)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fused = ResBlock(c_in, 64, emb_dim=16, conv_kind="triton")
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, c_in, 3, 4, 5).to(memory_format=CL)
    emb = torch.randn(2, 16)
    up = torch.randn(2, 64, 3, 4, 5)
    outs, grads = [], []
    for block in (plain, fused):
        xi = x.clone().requires_grad_()
        y = block(xi, emb)
        outs.append(y)
        grads.append(torch.autograd.grad((y * up).sum(), (xi, *block.parameters())))
    assert _rel(outs[1], outs[0]) < 1e-5
    names = ["x"] + [n for n, _ in plain.named_parameters()]
    for name, a, e in zip(names, grads[1], grads[0]):
        assert _rel(a, e) < 1e-4, (name, _rel(a, e))


def test_the_model_takes_the_fused_kind_in_every_residual_block(tiny_spec):
    """UNet3D(conv=...) builds every residual block with it, under the same parameter names; an unknown kind is
    refused."""
    plain, fused = UNet3D(tiny_spec), UNet3D(tiny_spec, conv="triton_fp8")
    kinds = {m.conv_kind for m in fused.modules() if isinstance(m, ResBlock)}
    assert kinds == {"triton_fp8"} and {m.conv_kind for m in plain.modules() if isinstance(m, ResBlock)} == {"cudnn"}
    assert fused.state_dict().keys() == plain.state_dict().keys()
    with pytest.raises(AssertionError, match="conv kind must be one of"):
        UNet3D(tiny_spec, conv="cutlass")


def test_where_the_fused_kernel_runs(monkeypatch):
    """On the CPU the kernel runs only under the interpreter, else the configuration runs conv=cudnn and records
    why; on a GPU it needs bf16 tensor cores, and FP8 ones for triton_fp8."""
    cfg = get_config("best+conv=triton_fp8")
    run = resolve(cfg, "cpu")
    assert run.conv == "triton_fp8" and "conv" not in run.not_applicable
    monkeypatch.setattr(fused_conv, "_interpreting", lambda: False)  # as where TRITON_INTERPRET was not set
    run = resolve(cfg, "cpu")
    assert run.conv == "cudnn" and "TRITON_INTERPRET=1" in run.not_applicable["conv"]
    assert resolve(get_config("best"), "cpu").conv == "cudnn"
    for capability, why in (((9, 0), None), ((8, 0), "FP8 tensor cores"), ((7, 5), "bf16 tensor cores")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        reason = fused_conv.unavailable("cuda", fp8=True)
        assert (reason is None) if why is None else why in reason, (capability, reason)


@pytest.mark.slow
def test_compiled_fused_res_block_is_the_eager_one():
    """torch.compile (Inductor, one graph) calls the operator as an opaque kernel and differentiates it through its
    autograd formula: the same output and gradients as eager."""
    torch.manual_seed(9)
    block = ResBlock(32, 64, emb_dim=16, conv_kind="triton")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 32, 4, 3, 5).to(memory_format=CL)
    emb = torch.randn(1, 16)

    def step(fn):
        xi = x.clone().requires_grad_()
        y = fn(xi, emb)
        return (y, *torch.autograd.grad(y.square().sum(), (xi, *block.parameters())))

    want = step(block)
    torch._dynamo.reset()
    try:
        got = step(torch.compile(block, fullgraph=True, dynamic=False))
    finally:
        torch._dynamo.reset()
    for name, a, e in zip(["y", "x"] + [n for n, _ in block.named_parameters()], got, want):
        assert _rel(a, e) < 1e-5, (name, _rel(a, e))


@pytest.mark.slow
def test_a_training_step_of_the_fused_variant():
    """The engine builds `sdpa+conv=triton` (bf16 autocast, channels-last) with the fused kind on the CPU under the
    interpreter, and its first step's loss is the cuDNN variant's within bf16's rounding (8^3, two levels)."""
    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    x, c = random_batch(spec)
    t, noise = torch.tensor([100]), torch.randn(1, 1, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    losses = {}
    for name in ("sdpa", "sdpa+conv=triton"):
        engine = Engine(spec, name, device="cpu", ema=False)
        assert engine.run.conv == get_config(name).conv and "conv" not in engine.run.not_applicable
        kinds = {m.conv_kind for m in engine.model.modules() if isinstance(m, ResBlock)}
        assert kinds == {get_config(name).conv}
        losses[name] = float(engine.step([(engine.prepare(x), engine.prepare(c), t, noise)]))
    assert math.isfinite(losses["sdpa"]) and abs(losses["sdpa+conv=triton"] / losses["sdpa"] - 1) < 2e-2, losses
