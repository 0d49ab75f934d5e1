"""`group_norm="triton"` on the CPU, through Triton's interpreter: the kernels against float64 references, the kind
in the U-Net against the fused kind, under torch.compile and autocast, and where it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from medddpm.configs import get_config, resolve
from medddpm.model.blocks import ResBlock
from medddpm.model.group_norm import GroupNorm32
from medddpm.model.unet import ModelSpec, UNet3D

pytest.importorskip("triton")  # group_norm="triton" needs the triton package (Linux x86-64 wheels)
from medddpm.model import group_norm_triton as T  # noqa: E402 -- in the interpreter: tests/conftest.py sets it

CL = torch.channels_last_3d


@pytest.fixture(autouse=True)
def _interpreted():
    assert T.interpreted(), "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)"


@pytest.fixture
def poisoned(monkeypatch):
    """Every new floating-point tensor starts as NaN, so an element the kernels leave unwritten (an output, a
    partial sum, a per-channel coefficient) shows in the result."""
    for name in ("empty", "empty_like"):
        original = getattr(torch, name)

        def filled(*args, _original=original, **kwargs):
            t = _original(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, name, filled)


def _reference(x, weight, bias, shift, dy, groups, silu):
    """Output and gradients (x, weight, bias, shift) of silu(group_norm(x + shift)) in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias) + ((shift,) if shift is not None else ())]
    h = leaves[0] + leaves[3][:, :, None, None, None] if shift is not None else leaves[0]
    y = F.group_norm(h, groups, leaves[1], leaves[2], 1e-5)
    y = F.silu(y) if silu else y
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def _close(got, want, rtol, what):
    """Within rtol of each element, or of the largest one's rtol / 10 near zero; NaN never passes."""
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol / 10 * want.abs().max().item(), msg=what)


# One rounding to bfloat16: within 2^-8 of the value when rounded to nearest (the GPU), 2^-7 when cut, as the
# interpreter converts float32 to bfloat16. Float32 outputs: float32 sums over a few hundred elements.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, layout, groups, shift, silu", [
    ((2, 32, 5, 7, 3), CL, 8, True, True),  # 105 voxels: the last tile part-filled, the timestep shift
    ((1, 48, 6, 5, 4), torch.contiguous_format, 16, False, False),  # 3 channels a group, padded to 64 in a tile
])
def test_kernels_match_float64(poisoned, monkeypatch, dtype, shape, layout, groups, shift, silu):
    """Forward and backward of the Triton kernels against F.group_norm (then F.silu) in float64, on random inputs
    with a mean far from zero, in tiles small enough that every reduction is split over several programs."""
    monkeypatch.setattr(T, "INTERPRETER_TILE", 1024)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 5).to(dtype).to(memory_format=layout).requires_grad_()
    weight, bias = (torch.randn(shape[1], generator=g).requires_grad_() for _ in range(2))
    e = torch.randn(shape[:2], generator=g).to(dtype).requires_grad_() if shift else None
    dy = torch.randn(shape, generator=g).to(dtype)
    assert T._splits(x, T._blocks(x)[0])[0] > 1, "the statistics must be split"

    y = T.group_norm_silu(x, weight, bias, groups, 1e-5, silu=silu, shift=e)
    leaves = (x, weight, bias) + ((e,) if shift else ())
    grads = torch.autograd.grad(y, leaves, dy)
    want_y, want_grads = _reference(x, weight, bias, e, dy, groups, silu)

    assert y.dtype == dtype and y.is_contiguous(memory_format=layout)
    _close(y, want_y, RTOL[dtype], "y")
    for name, got, want in zip(("dx", "dweight", "dbias", "dshift"), grads, want_grads):
        assert got.dtype == (torch.float32 if name in ("dweight", "dbias") else dtype), name
        _close(got, want, RTOL[got.dtype], name)


def test_kernels_keep_large_means(poisoned):
    """Statistics from sums shifted by one voxel of each channel: an input of mean 100 and std 0.01 keeps its
    variance (plain sums of x and x^2 in float32 would lose it), as float32 rounding of x itself allows."""
    x = torch.randn(1, 32, 8, 8, 8, generator=torch.Generator().manual_seed(1)) * 0.01 + 100.0
    weight, bias = torch.ones(32), torch.zeros(32)
    want, _ = _reference(x, weight, bias, None, torch.ones_like(x), 32, False)
    got = T.group_norm_silu(x, weight, bias, 32, 1e-5, silu=False)
    aten = F.group_norm(x, 32, eps=1e-5).double()
    assert (got.double() - want).abs().max() < 3 * (aten - want).abs().max()


def test_where_the_kind_cannot_run(monkeypatch):
    """Resolved on a CPU without the interpreter, `group_norm="triton"` runs as the fused kind and says so; on a CUDA
    device, or with the interpreter, it stays. A model called there refuses in one line."""
    config = get_config("best+group_norm=triton")
    assert resolve(config, "cpu").group_norm == "triton" and "group_norm" not in resolve(config, "cpu").not_applicable
    assert resolve(config, "cuda").group_norm == "triton"
    assert resolve(get_config("best"), "cpu").group_norm == "fused"
    monkeypatch.setattr(T, "interpreted", lambda: False)
    run = resolve(config, "cpu")
    assert run.group_norm == "fused"
    assert run.not_applicable["group_norm"].endswith("a CUDA device (or TRITON_INTERPRET=1 on the CPU); ran as fused")
    with pytest.raises(RuntimeError, match="runs on a CUDA device, or on the CPU with TRITON_INTERPRET=1 set"):
        GroupNorm32(32, 64, kind="triton", silu=True)(torch.randn(1, 64, 2, 2, 2))
    monkeypatch.undo()
    with pytest.raises(TypeError, match="not torch.float64"):
        GroupNorm32(32, 64, kind="triton")(torch.randn(1, 64, 2, 2, 2, dtype=torch.float64))


def _randomized(module, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module


@pytest.mark.slow
def test_the_u_net_step_matches_the_fused_kind(poisoned):
    """One eager training step (forward, L1 loss, backward) of a tiny U-Net, channels-last in float32: the triton
    kind against the fused one, loss and every parameter's gradient (those the norms make zero, such as a bias
    right before a norm of one channel a group, compared at the scale of the others)."""
    spec = ModelSpec(size=(8, 8, 4), mask_channels=1, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, spec.in_channels, *spec.shape, generator=g).to(memory_format=CL)
    t, target = torch.tensor([3, 200]), torch.randn(2, 1, *spec.shape, generator=g)
    steps = {}
    for kind in ("fused", "triton"):
        torch.manual_seed(0)
        model = _randomized(UNet3D(spec, group_norm=kind)).to(memory_format=CL)
        loss = (model(x, t) - target).abs().mean()
        loss.backward()
        steps[kind] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    (loss_f, grads_f), (loss_t, grads_t) = steps["fused"], steps["triton"]
    torch.testing.assert_close(loss_t, loss_f, rtol=1e-6, atol=0)
    scale = max(gr.abs().max().item() for gr in grads_f.values())
    for name, want in grads_f.items():
        torch.testing.assert_close(grads_t[name], want, rtol=1e-4, atol=1e-6 * scale, msg=name)
    assert grads_f["down.2.res.emb_layers.1.weight"].abs().max() > 1e-3 * scale, "the timestep shift carries signal"


@pytest.mark.slow
def test_compiled_and_autocast_blocks_match_eager():
    """A residual block whose second norm takes the timestep features in: compiled (Dynamo and AOTAutograd through
    the operators' fake implementations and autograd formula, one graph) it gives eager's output and gradients;
    under bf16 autocast it matches the fused kind within bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 6, 5, 4, generator=g).to(memory_format=CL).requires_grad_()
    emb, up = torch.randn(2, 128, generator=g), torch.randn(2, 64, 6, 5, 4, generator=g)
    blocks = {kind: _randomized(ResBlock(32, 64, emb_dim=128, norm_kind=kind)).to(memory_format=CL)
              for kind in ("fused", "triton")}
    block = blocks["triton"]
    loss = lambda x: (block(x, emb).float() * up).sum()  # noqa: E731
    want = torch.autograd.grad(loss(x), (x, *block.parameters()))
    torch._dynamo.reset()
    try:
        got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(x), (x, *block.parameters()))
    finally:
        torch._dynamo.reset()
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)

    outputs = {}
    for kind, blk in blocks.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = blk(x, emb)
        (dx,) = torch.autograd.grad((y.float() * up).sum(), x)
        outputs[kind] = y, dx
    (y_f, dx_f), (y_t, dx_t) = outputs["fused"], outputs["triton"]
    assert y_t.dtype == torch.bfloat16
    for got, want in ((y_t, y_f), (dx_t, dx_f)):
        rel = (got.double() - want.double()).norm() / want.double().norm()
        assert rel < 1e-2, rel
