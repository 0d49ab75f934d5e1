import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from medddpm.model.diffusion import GaussianDiffusion, cosine_betas
from medddpm.model.flops import count
from medddpm.model.blocks import UPSAMPLE_KINDS, Attention, Upsample
from medddpm.model.group_norm import GroupNorm32, _GroupNormSiLU, group_norm_chunked
from medddpm.model.unet import ModelSpec, UNet3D, count_parameters, format_size, parse_size


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


# ------------------------------------------------------------------------ the BraTS setting

BRATS = dict(size=(192, 192, 144), mask_channels=4, image_channels=4, num_res_blocks=2, channel_mult=(1, 1, 2, 3, 4),
             attention_ds=())


def test_brats_parameter_count_and_flops():
    """The reference's BraTS model (train_brats.py): 57,562,564 parameters, 21.26 TFLOP forward.
    Counted here: 21.2582 T (convolutions 21,256.5 G); the tolerance is 0.1%."""
    info = count(ModelSpec(**BRATS))
    assert info["parameters"] == 57_562_564
    assert abs(info["forward_flops"] / 21.26e12 - 1) < 1e-3, info["forward_flops"]
    assert info["output_shape"] == [1, 4, 192, 192, 144]
    from medddpm.presets import PRESETS

    assert PRESETS["brats"].spec() == ModelSpec(**BRATS)


def test_size_forms_and_shape():
    assert ModelSpec(size=(16, 16, 16)) == ModelSpec(size=16) and ModelSpec(size=[16, 16, 16]).size == 16
    spec = ModelSpec(size=[32, 32, 16], channel_mult=(1, 2), attention_ds=[2])
    assert spec.size == (32, 32, 16) and spec.shape == (32, 32, 16) and spec.voxels == 32 * 32 * 16
    assert spec.attention_ds == (2,) and spec.attention_tokens() == [16 * 16 * 8, 16 * 16 * 8]
    assert parse_size("192x192x144") == (192, 192, 144) and parse_size("128") == 128 and format_size((8, 8, 4)) == "8x8x4"
    for bad in ("12x3", "0", "axb", "-4x4x4"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


@pytest.mark.parametrize("bad, message", [
    (dict(size=(16, 16)), "size"),
    (dict(size=(16, 16, 0)), "size"),
    (dict(size=(16, 16, 12), channel_mult=(1, 2, 4, 8)), "12 is not"),
    (dict(size="16"), "size"),
])
def test_bad_non_cubic_spec(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(**bad)


def test_non_cubic_forward_and_backward(tiny_spec):
    spec = ModelSpec(size=(16, 8, 24), mask_channels=4, image_channels=4, base_channels=32, channel_mult=(1, 2),
                     attention_ds=(2,), num_res_blocks=2)
    model = UNet3D(spec)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 8, 16, 8, 24)
    out = model(x, torch.tensor([1, 200]))
    assert out.shape == (2, 4, 16, 8, 24)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------ activation checkpointing


def _pair(spec, **kw):
    """A plain and a checkpointed model with the same (random, non-zero) weights, in float64."""
    torch.manual_seed(0)
    plain = UNet3D(spec, **kw).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ckpt = UNet3D(spec, checkpointing=True, **kw).double()
    ckpt.load_state_dict(plain.state_dict())
    return plain, ckpt


@pytest.mark.parametrize("kw", [dict(), dict(attention="sdpa", recompute_attention=False, upsample="separable")])
def test_checkpointing_gives_the_same_gradients(kw):
    spec = ModelSpec(size=(16, 16, 8), mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,),
                     num_res_blocks=2)
    plain, ckpt = _pair(spec, **kw)
    x, t = torch.randn(2, 4, 16, 16, 8, dtype=torch.float64), torch.tensor([3, 180])
    ya, yb = plain(x, t), ckpt(x, t)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)  # the forward pass is the same computation
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (name, pa), pb in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.slow
def test_compiled_checkpointing_with_the_fused_group_norm_has_the_plain_gradients():
    """Checkpointed blocks holding the fused GroupNorm's autograd.Function, compiled (AOTAutograd's partition, no
    Inductor code generation): the same gradients as the plain model in float64."""
    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    plain, ckpt = _pair(spec, group_norm="fused")
    x, t = torch.randn(1, 4, 8, 8, 8, dtype=torch.float64), torch.tensor([7])
    plain(x, t).square().sum().backward()
    torch._dynamo.reset()
    try:
        torch.compile(ckpt, backend="aot_eager", fullgraph=True)(x, t).square().sum().backward()
    finally:
        torch._dynamo.reset()
    for (name, pa), pb in zip(plain.named_parameters(), ckpt.parameters()):
        assert pa.grad.abs().sum() > 0, name
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-10, atol=1e-12, msg=name)


def _saved_bytes(model, x, t) -> int:
    """Bytes of the tensors autograd keeps for backward (each tensor once)."""
    seen: dict[int, int] = {}

    def pack(tensor):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x, t)
    return sum(seen.values()), out


def test_checkpointing_keeps_far_fewer_activations(tiny_spec):
    plain, ckpt = _pair(tiny_spec)
    x, t = torch.randn(1, 4, 16, 16, 16, dtype=torch.float64), torch.tensor([5])
    a, _ = _saved_bytes(plain, x, t)
    b, _ = _saved_bytes(ckpt, x, t)
    assert b < 0.3 * a, f"checkpointed model keeps {b} of {a} bytes"
    with torch.no_grad():  # no backward to come: nothing is checkpointed, nothing recomputed
        torch.testing.assert_close(plain(x, t), ckpt(x, t), rtol=0, atol=0)


def test_saved_activations_match_the_known_figures():
    """FP32 activations kept for backward: about 17.0 GiB for the whole-head model (strict FP32 peaks at
    18.45 GiB on the H200, training state included), about 65 GiB for the BraTS one (the reference's users'
    OOM reports); checkpointing keeps a fraction."""
    from medddpm.model.flops import saved_activation_bytes
    from medddpm.presets import PRESETS

    head = saved_activation_bytes(ModelSpec(size=128, mask_channels=2)) / 2**30
    brats = saved_activation_bytes(PRESETS["brats"].spec()) / 2**30
    assert abs(head / 17.0 - 1) < 0.01, head
    assert abs(brats / 65.0 - 1) < 0.01, brats
    assert saved_activation_bytes(PRESETS["brats"].spec(), checkpointing=True) / 2**30 < 0.2 * brats


# ------------------------------------------------------------------------------ chunked GroupNorm


@pytest.mark.parametrize("shape, layout", [((2, 64, 8, 12, 10), torch.channels_last_3d),
                                           ((1, 96, 5, 7, 3), torch.contiguous_format),  # 105 voxels: 1 chunk
                                           ((2, 32, 16, 16, 16), torch.channels_last_3d)])  # 256 chunks of 16
@pytest.mark.parametrize("affine", [True, False])
def test_chunked_group_norm_is_group_norm(shape, layout, affine):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 5).to(memory_format=layout).requires_grad_()
    w, b = (torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True) if affine else None
            for _ in range(2))
    up = torch.randn(shape, generator=g, dtype=torch.float64)
    leaves = [t for t in (x, w, b) if t is not None]
    want = F.group_norm(x, 32, w, b, 1e-5)
    got = group_norm_chunked(x, 32, w, b, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for gw, gg in zip(torch.autograd.grad((want * up).sum(), leaves), torch.autograd.grad((got * up).sum(), leaves)):
        torch.testing.assert_close(gg, gw, rtol=1e-10, atol=1e-11)
    assert got.is_contiguous(memory_format=layout), "the output keeps the input's layout"


def test_chunked_group_norm_in_float32_keeps_large_means():
    """Statistics from chunk means and variances: no E[x^2] - E[x]^2 cancellation on an offset input
    (that would lose the variance 1e-4 under float32's rounding of 1e4). Both float32 forms are limited
    by x's own rounding at 100 (7.6e-6, 7.6e-4 of the std): the chunked one stays within 3x of aten's."""
    x = torch.randn(1, 32, 16, 16, 16, generator=torch.Generator().manual_seed(1)) * 0.01 + 100.0
    want = F.group_norm(x.double(), 32, eps=1e-5)
    aten = (F.group_norm(x, 32, eps=1e-5).double() - want).abs().max()
    chunked = (group_norm_chunked(x, 32, None, None, 1e-5).double() - want).abs().max()
    assert chunked < 3 * aten and chunked < 1e-2, (chunked, aten)
    with pytest.raises(AssertionError, match="do not split into 32 groups"):
        group_norm_chunked(torch.zeros(1, 48, 2, 2, 2), 32, None, None, 1e-5)


@pytest.mark.parametrize("shape, layout", [((2, 64, 2, 3, 2), torch.channels_last_3d),  # 4 chunks of 3 voxels
                                           ((1, 32, 3, 5, 4), torch.contiguous_format)])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_group_norm_backward_is_the_gradient(shape, layout, silu, affine):
    """The hand-written backward of `group_norm="fused"` against finite differences (gradcheck, float64),
    and its output against F.group_norm (then F.silu)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 5).to(memory_format=layout).requires_grad_()
    w, b = (torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True) if affine else None
            for _ in range(2))
    fused = lambda x, w, b: _GroupNormSiLU.apply(x, w, b, 32, 1e-5, silu)  # noqa: E731
    assert torch.autograd.gradcheck(fused, (x, w, b))
    want = F.group_norm(x, 32, w, b, 1e-5)
    torch.testing.assert_close(fused(x, w, b), F.silu(want) if silu else want, rtol=1e-12, atol=1e-12)
    assert fused(x, w, b).is_contiguous(memory_format=layout), "the output keeps the input's layout"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_group_norm_traced_by_dynamo_has_the_same_gradients(dtype):
    """Dynamo's trace of the fused kind's autograd.Function gives eager's gradients, also where its output
    needs no cast: torch 2.11 (the GPU image's) gave every input a zero gradient when the Function returned
    one of its own intermediates (pytorch/pytorch#180642), as `.to(x.dtype)` of a float32 x did."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, 4, 4, 4, generator=g).to(dtype).requires_grad_()
    w, b = (torch.randn(64, generator=g, requires_grad=True) for _ in range(2))
    up = torch.randn(x.shape, generator=g)
    loss = lambda x, w, b: (_GroupNormSiLU.apply(x * 2, w, b, 32, 1e-5, True).float() * up).sum()  # noqa: E731
    want = torch.autograd.grad(loss(x, w, b), (x, w, b))
    torch._dynamo.reset()
    try:
        got = torch.autograd.grad(torch.compile(loss, backend="eager", fullgraph=True)(x, w, b), (x, w, b))
    finally:
        torch._dynamo.reset()
    for name, a, e in zip("xwb", got, want):
        assert a.abs().max() > 0, f"d{name} is zero"
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=f"d{name}")


def test_fused_group_norm_in_bf16_is_float32_rounded_once():
    """On a bf16 activation the fused kind computes in float32 and rounds its output and x's gradient to bf16
    once: both within bf16's rounding of the float64 values."""
    g = torch.Generator().manual_seed(2)
    x64 = torch.randn(1, 64, 8, 8, 8, generator=g, dtype=torch.float64) * 2 + 1
    up64 = torch.randn(x64.shape, generator=g, dtype=torch.float64)
    x = x64.to(torch.bfloat16).to(memory_format=torch.channels_last_3d).requires_grad_()
    norm = GroupNorm32(32, 64, kind="fused", silu=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    (y.float() * up64.float()).sum().backward()
    xr = x.detach().double().requires_grad_()
    want = F.silu(F.group_norm(xr, 32, norm.weight.double(), norm.bias.double(), 1e-5))
    (dx_want,) = torch.autograd.grad((want * up64.to(torch.bfloat16).double()).sum(), xr)
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(x.grad.double(), dx_want, rtol=2 ** -7, atol=2e-3)
    assert norm.weight.grad.dtype == torch.float32
    with pytest.raises(AssertionError, match="only the fused and triton group norms take their SiLU in"):
        GroupNorm32(32, 64, kind="chunked", silu=True)


@pytest.mark.budget(30)  # 9.5 CPU seconds measured: float64 models compared
def test_group_norm_kinds_give_the_same_model(tiny_spec):
    torch.manual_seed(0)
    aten = UNet3D(tiny_spec).double()
    for p in aten.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t = torch.randn(2, 4, 16, 16, 16, dtype=torch.float64), torch.tensor([3, 180])
    ya = aten(x, t)
    ya.square().sum().backward()
    for kind in ("chunked", "fused"):
        other = UNet3D(tiny_spec, group_norm=kind).double()
        other.load_state_dict(aten.state_dict())  # the same parameter names: checkpoints load either way
        yb = other(x, t)
        torch.testing.assert_close(yb, ya, rtol=1e-10, atol=1e-12, msg=kind)
        yb.square().sum().backward()
        for (name, pa), pb in zip(aten.named_parameters(), other.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-8, atol=1e-12, msg=f"{kind} {name}")
    with pytest.raises(AssertionError, match="group norm kind must be one of"):
        UNet3D(tiny_spec, group_norm="welford")


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_padded_narrow_convolutions_give_the_same_model(tiny_spec, layout):
    torch.manual_seed(0)
    plain = UNet3D(tiny_spec).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    padded = UNet3D(tiny_spec, pad_channels=True).double()
    padded.load_state_dict(plain.state_dict())  # the same parameters: checkpoints load either way
    assert count_parameters(padded) == count_parameters(plain)
    assert type(padded.stem).__name__ == "PaddedConv3d" and padded.stem.in_channels == 4
    plain, padded = plain.to(memory_format=layout), padded.to(memory_format=layout)
    x, t = torch.randn(2, 4, 16, 16, 16, dtype=torch.float64).to(memory_format=layout), torch.tensor([3, 180])
    ya, yb = plain(x, t), padded(x, t)
    assert yb.shape == ya.shape == (2, 1, 16, 16, 16)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-14)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (name, pa), pb in zip(plain.named_parameters(), padded.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.budget(30)  # 8 CPU seconds measured
@pytest.mark.parametrize("checkpointing", [False, True])
def test_store_skip_grad_gives_the_same_model_and_stores_each_skip_gradient(tiny_spec, checkpointing):
    """The switch adds an identity on each decoder block's skip connection, whose backward copies the gradient
    out (model._StoreGradient): the same outputs and gradients, one copy per decoder block."""
    torch.manual_seed(0)
    plain = UNet3D(tiny_spec, group_norm="chunked", checkpointing=checkpointing).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    stored = UNet3D(tiny_spec, group_norm="chunked", checkpointing=checkpointing, store_skip_grad=True).double()
    stored.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4, 16, 16, 16, dtype=torch.float64).to(memory_format=torch.channels_last_3d)
    t = torch.tensor([3, 180])
    ya, yb = plain(x, t), stored(x, t)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    copies = []
    with _OpCalls(torch.ops.medddpm.stored_copy.default, copies):
        yb.square().sum().backward()
    ya.square().sum().backward()
    assert len(copies) == len(stored.up)
    for (name, pa), pb in zip(plain.named_parameters(), stored.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0, msg=name)
    with torch.no_grad(), _OpCalls(torch.ops.medddpm.stored_copy.default, copies):
        stored(x, t)  # nothing to store without a backward
    assert len(copies) == len(stored.up)


@pytest.mark.budget(30)  # 9.5 CPU seconds measured
@pytest.mark.parametrize("store_skip_grad", [False, True])
def test_narrow_checkpoints_give_the_same_model_and_keep_no_stem_or_upsampled_output(tiny_spec, store_skip_grad):
    """With checkpointing, `narrow_checkpoints` runs the stem inside the two checkpoints that read its output and
    each decoder upsampling inside the next block's checkpoint: the same outputs and gradients (the stem's weight
    gradient summed from two backward passes instead of one), and after the forward no stem output or upsampled
    tensor is alive (plain checkpointing keeps both as block inputs). The stem runs four times (two forwards, two
    recomputations) instead of once, and each upsampling twice instead of once."""
    import gc
    import weakref

    torch.manual_seed(0)
    spec = ModelSpec(size=16, mask_channels=3, base_channels=32, channel_mult=(1, 2, 2), attention_ds=(4,))
    plain = UNet3D(spec, group_norm="chunked", checkpointing=True, store_skip_grad=store_skip_grad).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    narrow = UNet3D(spec, group_norm="chunked", checkpointing=True, store_skip_grad=store_skip_grad,
                    narrow_checkpoints=True).double()
    narrow.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4, 16, 16, 16, dtype=torch.float64).to(memory_format=torch.channels_last_3d)
    t = torch.tensor([3, 180])

    def watch(model):
        outputs, calls = {"stem": [], "upsample": []}, {"stem": 0, "upsample": 0}

        def hook(kind):
            def record(module, args, out):
                calls[kind] += 1
                outputs[kind].append(weakref.ref(out))
            return record
        model.stem.register_forward_hook(hook("stem"))
        for m in model.modules():
            if isinstance(m, Upsample):
                m.register_forward_hook(hook("upsample"))
        return outputs, calls

    (out_a, calls_a), (out_b, calls_b) = watch(plain), watch(narrow)
    ups = [m for m in plain.modules() if isinstance(m, Upsample)]
    assert len(ups) == len(spec.channel_mult) - 1
    ya, yb = plain(x, t), narrow(x, t)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    gc.collect()
    alive = lambda refs: sum(r() is not None for r in refs)  # noqa: E731
    assert alive(out_a["stem"]) == 1 and alive(out_a["upsample"]) == len(ups)
    assert alive(out_b["stem"]) == 0 and alive(out_b["upsample"]) == 0
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (name, pa), pb in zip(plain.named_parameters(), narrow.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-12, atol=1e-15, msg=name)
    assert (calls_a["stem"], calls_b["stem"]) == (1, 4)
    # a checkpoint's recomputation stops once it has what the backward needs (torch.utils.checkpoint's early
    # stop): plain, an upsampling's convolution is the last layer of its block and is not run again
    assert (calls_a["upsample"], calls_b["upsample"]) == (len(ups), 2 * len(ups))
    with torch.no_grad():  # sampling: no checkpoints, the plain forward
        torch.testing.assert_close(narrow(x, t), plain(x, t), rtol=0, atol=0)
    assert calls_b["stem"] == 5


def test_narrow_checkpoints_without_checkpointing_is_the_plain_model_and_recorded_as_not_applicable(tiny_spec):
    plain = UNet3D(tiny_spec, group_norm="chunked")
    narrow = UNet3D(tiny_spec, group_norm="chunked", narrow_checkpoints=True)
    narrow.load_state_dict(plain.state_dict())
    x, t = torch.randn(1, 4, 16, 16, 16), torch.tensor([7])
    torch.testing.assert_close(narrow(x, t), plain(x, t), rtol=0, atol=0)
    from medddpm.configs import CONFIGS, resolve
    assert "narrow_checkpoints" in resolve(CONFIGS["best"].with_flags(narrow_checkpoints=True), "cpu").not_applicable
    assert resolve(CONFIGS["best-ckpt"].with_flags(narrow_checkpoints=True), "cpu").not_applicable.keys() == \
        resolve(CONFIGS["best-ckpt"], "cpu").not_applicable.keys()


class _OpCalls(TorchDispatchMode):
    """Appends the shapes of every call of one operator."""

    def __init__(self, op, calls: list):
        super().__init__()
        self.op, self.calls = op, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", UPSAMPLE_KINDS)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_upsample_kinds_are_trilinear_interpolation(kind, layout):
    """Every kind computes F.interpolate's trilinear 2x (align_corners=False), forward and backward, on a
    non-cubic volume, and keeps a channels-last input channels-last."""
    up = Upsample(6, kind=kind).double()
    x = torch.randn(2, 6, 5, 4, 3, dtype=torch.float64).to(memory_format=layout).requires_grad_()
    ref = F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False)
    inner = {}
    up.conv.register_forward_pre_hook(lambda m, args: inner.update(x=args[0]))
    y = up(x)
    torch.testing.assert_close(inner["x"], ref, rtol=1e-12, atol=1e-14)
    assert inner["x"].is_contiguous(memory_format=layout)
    g = torch.randn_like(ref)
    (got,) = torch.autograd.grad(inner["x"], x, g, retain_graph=True)
    (want,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert y.shape == (2, 6, 10, 8, 6)


@pytest.mark.slow
def test_separable_ndhwc_keeps_every_compiled_buffer_channels_last(fresh_inductor):
    """The premise of `separable_ndhwc`: compiled on a channels-last input, `separable` lays some per-axis
    results out with W fastest (strided reads and writes of channels-last memory); on the NDHWC view every
    buffer has the channels fastest. Inductor decides these layouts in its IR, before generating code
    for a backend, so the CPU's code shows them."""
    import re

    from torch._inductor.utils import run_and_get_code

    x = torch.randn(1, 64, 8, 8, 8).to(memory_format=torch.channels_last_3d)
    strides = {}
    for kind in ("separable", "separable_ndhwc"):
        up = Upsample(64, kind=kind)
        up.conv = torch.nn.Identity()
        torch._dynamo.reset()
        out, (code, *_) = run_and_get_code(torch.compile(up), x)
        strides[kind] = [tuple(map(int, s.split(","))) for s in re.findall(r"empty_strided\w*\(\([^)]*\), \(([^)]*)\)", code)]
        assert out.is_contiguous(memory_format=torch.channels_last_3d) and strides[kind], kind
    # separable: some 5-D buffers in (N, C, D, H, W) order with W fastest; ndhwc: every buffer in
    # (N, D, H, W, C) order with the channels fastest. Both: last stride 1.
    assert any(len(s) == 5 and s[-1] == 1 for s in strides["separable"]), strides["separable"]
    assert all(s[-1] == 1 for s in strides["separable_ndhwc"]), strides["separable_ndhwc"]


@pytest.mark.parametrize("tap_major", [False, True], ids=["voxel-major", "tap-major"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
@pytest.mark.parametrize("c_in,c_out", [(16, 1), (16, 4), (4, 16)])
def test_tap_convolution_is_the_convolution(layout, c_in, c_out, tap_major):
    """TapConv3d (a GEMM, then shifted tap sums): nn.Conv3d's output and gradients, with the same
    parameters, in either layout, for 1 and 4 output channels (the whole-head and BraTS outputs) and
    for a wide output; its shares voxel-major or tap-major over a zero-haloed input (`tap_major`), whose input
    gradient comes back channels-last."""
    from medddpm.model.blocks import TapConv3d

    torch.manual_seed(0)
    plain = torch.nn.Conv3d(c_in, c_out, 3, padding=1).double()
    taps = TapConv3d(c_in, c_out, 3, padding=1, tap_major=tap_major).double()
    taps.load_state_dict(plain.state_dict())
    x = torch.randn(2, c_in, 5, 6, 7, dtype=torch.float64).to(memory_format=layout).requires_grad_()
    ya, yb = plain(x), taps(x)
    assert yb.shape == ya.shape == (2, c_out, 5, 6, 7) and yb.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(ya)
    grads = [torch.autograd.grad(y, (x, m.weight, m.bias), g) for y, m in ((ya, plain), (yb, taps))]
    for name, a, b in zip(("input", "weight", "bias"), *grads):
        torch.testing.assert_close(b, a, rtol=1e-11, atol=1e-12, msg=name)
    if tap_major:
        assert grads[1][0].is_contiguous(memory_format=torch.channels_last_3d)


def test_tap_major_layer_matches_under_bf16_autocast():
    """Under bf16 autocast the tap-major output layer computes what the voxel-major one computes: the same
    bf16 shares of a bf16 GEMM, summed in float32 (in another order), rounded once to bf16."""
    from medddpm.model.blocks import TapConv3d

    torch.manual_seed(0)
    voxel = TapConv3d(32, 1, 3, padding=1)
    tap = TapConv3d(32, 1, 3, padding=1, tap_major=True)
    tap.load_state_dict(voxel.state_dict())
    x = torch.randn(1, 32, 12, 12, 12).to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        exact = torch.nn.functional.conv3d(x.double(), voxel.weight.double(), voxel.bias.double(), padding=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ya, yb = voxel(x), tap(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    err = [float((y.double() - exact).norm() / exact.norm()) for y in (ya, yb)]
    assert 0 < err[1] < 1.5 * err[0] + 1e-3, err  # bf16's rounding of the shares and of the result


def test_tap_convolution_refuses_other_shapes():
    from medddpm.model.blocks import TapConv3d

    with pytest.raises(AssertionError, match="3x3x3 convolutions with padding 1 only"):
        TapConv3d(4, 16, 3, stride=2, padding=1)


@pytest.mark.budget(60)  # 23 CPU seconds measured: bf16 convolutions on an AVX2-only CPU
def test_tap_gemm_model_matches_under_bf16_autocast(tiny_spec):
    """Under bf16 autocast (what best runs) the model with tap_gemm is as close to the float32 model as
    the plain one: its output layer rounds the tap shares to bf16 but sums them in float32, once."""
    torch.manual_seed(0)
    plain = UNet3D(tiny_spec)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    taps = UNet3D(tiny_spec, tap_gemm=True)
    taps.load_state_dict(plain.state_dict())
    assert type(taps.out[-1]).__name__ == "TapConv3d" and type(taps.stem).__name__ == "Conv3d"
    x, t = torch.randn(1, 4, 16, 16, 16), torch.tensor([7])
    with torch.no_grad():
        exact = plain(x, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ya, yb = plain(x, t), taps(x, t)
    assert yb.dtype == ya.dtype == torch.bfloat16
    err = [float((y.float() - exact).norm() / exact.norm()) for y in (ya, yb)]
    assert 0 < err[1] < 1.5 * err[0], err  # measured: 4.7e-3 plain, 4.8e-3 with tap_gemm
