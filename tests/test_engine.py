import pytest
import torch

from medddpm.configs import CONFIGS
from medddpm.train.engine import EMA, Engine

from budgets import shared_budget
from conftest import ONE_LEVEL, TWO_LEVELS, random_batch


def _randomized(spec, config, **kw):
    """An engine whose zero-initialised layers are filled too, so every path carries signal."""
    engine = Engine(spec, config, device="cpu", ema=False, seed=0, **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return engine


def _cpu_convolution_keeps_channels_last(dtype):
    """Whether this CPU's 3-D convolution writes channels-last from channels-last operands in `dtype`, as
    cuDNN does on the GPU. On an AVX2-only CPU (torch 2.13, no oneDNN bfloat16) it writes NCDHW whatever its
    operands' layout, in float32 too, and then a compiled graph's convolution strides show nothing of the layout
    pass."""
    x = torch.randn(1, 8, 4, 4, 4, dtype=dtype).to(memory_format=torch.channels_last_3d)
    w = torch.randn(8, 8, 3, 3, 3, dtype=dtype).to(memory_format=torch.channels_last_3d)
    return torch.nn.functional.conv3d(x, w, padding=1).is_contiguous(memory_format=torch.channels_last_3d)


needs_native_bf16_convolution = pytest.mark.skipif(
    not _cpu_convolution_keeps_channels_last(torch.bfloat16),
    reason="this CPU's bfloat16 3-D convolution writes NCDHW from channels-last operands, "
           "unlike cuDNN, so the compiled graph's layout cannot show")


def _loss_and_grads(engine, spec):
    x, c = random_batch(spec, seed=3)
    t = torch.tensor([37])
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    loss = engine.loss(engine.prepare(x), engine.prepare(c), t=t, noise=noise)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in engine.model.parameters()])


@pytest.mark.budget(40)  # bf16 convolutions on an AVX2-only CPU: 13 CPU seconds each
@pytest.mark.parametrize("name, tol", [("opt2", 1e-5), ("sdpa", 3e-2), ("bf16", 3e-2)])
def test_configurations_agree_with_the_fp32_baseline(name, tol, tiny_spec):
    ref_loss, ref_grad = _loss_and_grads(_randomized(tiny_spec, "baseline"), tiny_spec)
    loss, grad = _loss_and_grads(_randomized(tiny_spec, name), tiny_spec)
    assert abs(float(loss - ref_loss)) / float(ref_loss) < tol
    rel = float((grad.float() - ref_grad).norm() / ref_grad.norm())
    assert rel < tol * 4, f"{name}: relative gradient error {rel:.2e}"


def test_fused_adam_matches_foreach_adam(tiny_spec):
    """One thread: with several, the CPU's convolution backward sums in an order that varies between runs, and
    Adam's normalised update turns a rounding-level gradient into a difference of the order of its step size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = [_randomized(tiny_spec, CONFIGS["baseline"].with_flags(fused_adam=f)) for f in (False, True)]
        x, c = random_batch(tiny_spec)
        for e in engines:
            torch.manual_seed(5)
            for _ in range(3):
                e.step((x, c))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*(e.model.parameters() for e in engines)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_same_seed_gives_identical_training(tiny_spec):
    runs = []
    for _ in range(2):
        e = Engine(tiny_spec, "baseline", device="cpu", seed=7)
        x, c = random_batch(tiny_spec)
        losses = [float(e.step((x, c))) for _ in range(3)]
        runs.append((losses, [p.detach().clone() for p in e.model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    other = Engine(tiny_spec, "baseline", device="cpu", seed=8)
    assert not all(torch.equal(a, b) for a, b in zip(runs[0][1], other.model.parameters()))


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tiny_spec):
    e = Engine(tiny_spec, "baseline", device="cpu", lr=2e-3, ema=False)
    x, c = random_batch(tiny_spec)
    t = torch.tensor([60])
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def fixed():
        with torch.no_grad():
            return float(e.loss(x, c, t=t, noise=noise))

    before = fixed()
    for _ in range(15):
        e.step((x, c))
    after = fixed()
    assert after < 0.9 * before, f"loss {before:.4f} -> {after:.4f}"


def test_gradient_accumulation_averages_micro_batches(tiny_spec):
    a, b = _randomized(tiny_spec, "baseline"), _randomized(tiny_spec, "baseline")
    x1, c1 = random_batch(tiny_spec, seed=1)
    x2, c2 = random_batch(tiny_spec, seed=2)
    torch.manual_seed(0)
    la = a.step([(x1, c1), (x2, c2)])
    torch.manual_seed(0)
    l1, l2 = (b.loss(x, c) for x, c in ((x1, c1), (x2, c2)))
    torch.testing.assert_close(la, (l1.detach() + l2.detach()) / 2)


def test_ema_copies_before_start_and_averages_after(tiny_spec):
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.5, every=2, start=4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model, 1)  # not an update step
    assert not torch.equal(ema.params[0], model.weight)
    ema.update(model, 2)  # before start: copy
    assert torch.equal(ema.params[0], model.weight)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model, 4)  # decay 0.5: halfway
    assert torch.allclose(ema.params[0], torch.full_like(model.weight, 2.0))


@pytest.mark.parametrize("name", ["baseline", "sdpa"])
def test_checkpointed_training_follows_the_same_trajectory(name, small_spec):
    """Three Adam steps with and without activation checkpointing: the same losses and weights
    (fp32 and bf16 autocast + channels-last alike: the recomputation repeats the same operations)."""
    engines = [_randomized(small_spec, CONFIGS[name].with_flags(checkpointing=c)) for c in (False, True)]
    assert [e.model.checkpointing for e in engines] == [False, True]
    g = torch.Generator().manual_seed(9)
    batches = []
    for i in range(3):
        x, c = random_batch(small_spec, seed=10 + i)
        batches.append((x, c, torch.randint(0, 250, (1,), generator=g), torch.randn(x.shape, generator=g)))
    losses = [[float(e.step(tuple(e.prepare(v) for v in b))) for b in batches] for e in engines]
    tol = dict(rtol=1e-6, atol=1e-7) if name == "baseline" else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(losses[0], losses[1], **tol)
    for a, b in zip(*(e.model.parameters() for e in engines)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.slow
@pytest.mark.budget(160)  # 46 CPU seconds measured
def test_checkpointing_composes_with_torch_compile():
    """torch.compile traces the checkpointed blocks (Dynamo's checkpoint operator): same gradients as eager."""
    torch._dynamo.reset()  # independent of what other tests compiled in this process
    spec = ONE_LEVEL
    eager = _randomized(spec, CONFIGS["baseline"])
    compiled = _randomized(spec, CONFIGS["baseline"].with_flags(compile=True, checkpointing=True))
    assert compiled.denoiser is not compiled.model  # really compiled
    ref_loss, ref_grad = _loss_and_grads(eager, spec)
    loss, grad = _loss_and_grads(compiled, spec)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-4


@pytest.mark.slow
@pytest.mark.budget(320)  # 107-151 CPU seconds measured: fresh graph caches, six compiled steps
def test_pin_layout_pins_every_convolution_input_and_keeps_the_values(monkeypatch, fresh_inductor):
    """The post-grad pass (medddpm.model.layout) leaves no 5-D convolution input of the forward or backward
    graph without channels-last strides, and the step computes the same loss and gradients. The step has the
    chunked GroupNorm, best's first lever: with the pass, it is also test_best_levers_compile_to_the_same_step's
    case for that lever, the same loss and gradients as the plain step run eagerly."""
    from medddpm.model import layout

    torch._dynamo.reset()
    seen = []

    class Checked(layout.ConvolutionInputs):
        def __call__(self, graph):
            super().__call__(graph)
            if not self.channels_last:
                return
            convs = [n for n in graph.nodes if n.target in layout.CONV_INPUTS]
            seen.append((len(convs), sum(layout._needs_pin(n.args[i]) for n in convs for i in layout.CONV_INPUTS[n.target]),
                         self.pinned))

    monkeypatch.setattr(layout, "ConvolutionInputs", Checked)
    spec = ONE_LEVEL
    base = CONFIGS["compile"].with_flags(precision="fp32", group_norm="chunked")
    plain = _randomized(spec, base)
    pinned = _randomized(spec, base.with_flags(pin_layout=True))
    assert pinned.run.pin_layout and not plain.run.pin_layout
    ref_loss, ref_grad = _loss_and_grads(plain, spec)
    loss, grad = _loss_and_grads(pinned, spec)
    assert len(seen) >= 2, "the pass runs on the forward and on the backward graph"
    assert all(n > 0 and left == 0 for n, left, _ in seen), seen
    assert seen[-1][2] > 0, "the graphs had inputs to pin (the stem's input, slices of skip gradients)"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    _assert_the_plain_step(spec, loss, grad, "group_norm=chunked+pin_layout=True")


@pytest.mark.slow
@needs_native_bf16_convolution
def test_pin_layout_holds_in_the_compiled_denoising_step(fresh_inductor):
    """Without gradients Inductor may turn its layout optimization on, which drops the pinned strides
    of 3-D convolutions (layout.compile_options): every convolution of the compiled denoising step
    must still write channels-last, with the values of the unpinned step."""
    import re

    from torch._inductor.utils import run_and_get_code

    from medddpm.model.unet import ModelSpec

    torch._dynamo.reset()
    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    # bf16 as in best (on this CPU an fp32 graph copies the weights NCDHW before Inductor's lowering)
    plain, pinned = (_randomized(spec, CONFIGS["compile"].with_flags(pin_layout=p)) for p in (False, True))
    _, c = random_batch(spec, seed=3)
    x, noise = torch.randn((2, 1, *spec.shape), generator=torch.Generator().manual_seed(4))
    inputs = (x[None], plain.prepare(c), torch.tensor([37]), noise[None])
    ref = plain._denoise(*inputs)
    out, code = run_and_get_code(pinned._denoise, *inputs)
    strides = re.findall(r"extern_kernels\.convolution\(.*\n.*assert_size_stride\(\w+, \([\d, ]+\), \(([\d, ]+)\)",
                         "\n".join(code))
    assert len(strides) == sum(isinstance(m, torch.nn.Conv3d) for m in pinned.model.modules()), strides
    assert all(s.split(", ")[1] == "1" for s in strides), f"convolutions writing NCDHW: {strides}"
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)  # bf16 convolutions of other layouts


def test_pin_layout_needs_compile_and_channels_last():
    from medddpm.configs import get_config, resolve

    assert resolve(get_config("best+pin_layout=true"), "cpu").pin_layout
    r = resolve(get_config("opt1+pin_layout=true"), "cpu")
    assert not r.pin_layout and "compile" in r.not_applicable["pin_layout"]


def _assert_the_plain_step(spec, loss, grad, what):
    """loss and gradients are the plain step's (`compile`'s switches in fp32), run eagerly."""
    plain = CONFIGS["compile"].with_flags(precision="fp32", compile=False)
    ref_loss, ref_grad = _loss_and_grads(_randomized(spec, plain), spec)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=what)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-5, what


@pytest.mark.parametrize("flags", [dict(pad_channels=True, pin_layout=True),
                                   dict(tap_gemm=True, pin_layout=True), dict(group_norm="fused", pin_layout=True),
                                   dict(tap_gemm=True, tap_major=True, pin_layout=True),
                                   dict(conv_autotune=True, pin_layout=True),
                                   dict(group_norm="fused", checkpointing=True)],
                         ids=lambda flags: "+".join(f"{k}={v}" for k, v in flags.items()))
@pytest.mark.slow
@pytest.mark.budget(160)  # 33-67 CPU seconds measured a lever
def test_best_levers_compile_to_the_same_step(flags):
    """best's model-side levers (chunked and fused GroupNorm, padded stem and output channels, the output as a
    tap GEMM), compiled with the layout pass: the same loss and gradients as the plain step run eagerly (fp32,
    so the comparison is tight). The fp32 fused GroupNorm is what torch 2.11's Dynamo got wrong (test_model.py).
    One level: each lever acts on blocks it has. The chunked GroupNorm's step is compiled by
    test_pin_layout_pins_every_convolution_input_and_keeps_the_values, which checks it so; best-ckpt's, with the
    stem and upsampling inside the checkpoints after them (narrow_checkpoints), by
    test_narrow_checkpoints_write_out_the_recomputed_upsampling."""
    torch._dynamo.reset()
    spec = ONE_LEVEL
    engine = _randomized(spec, CONFIGS["compile"].with_flags(precision="fp32", **flags))
    assert engine.denoiser is not engine.model, "really compiled"
    loss, grad = _loss_and_grads(engine, spec)
    _assert_the_plain_step(spec, loss, grad, str(flags))


@pytest.fixture(scope="module")
@shared_budget(320)  # 86 CPU seconds measured: best-ckpt compiled in float32
def best_ckpt_fp32_step():
    """best-ckpt's switches (narrow_checkpoints and store_skip_grad among them) in fp32 at 8^3, compiled for real
    once for the two tests below (Inductor's caches off, as `fresh_inductor`): the eager and the compiled loss
    and gradients, the compiled graphs' code, and how many views the layout pass wrote out in each graph. Two
    levels: the upsampling is what narrow_checkpoints moves; attention in the middle block, under a checkpoint."""
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    from medddpm.model import layout

    written = []

    class Counted(layout.ConvolutionInputs):
        def __call__(self, graph):
            super().__call__(graph)
            written.append(self.written)

    torch._dynamo.reset()
    spec = TWO_LEVELS
    config = CONFIGS["best-ckpt"].with_flags(precision="fp32", store_skip_grad=True, narrow_checkpoints=True)
    with pytest.MonkeyPatch.context() as m, torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        m.setattr(layout, "ConvolutionInputs", Counted)
        ref = _loss_and_grads(_randomized(spec, config.with_flags(compile=False)), spec)
        compiled, code = run_and_get_code(_loss_and_grads, _randomized(spec, config), spec)
    return {"spec": spec, "ref": ref, "compiled": compiled, "code": code, "written": written}


@pytest.mark.slow
def test_narrow_checkpoints_write_out_the_recomputed_upsampling(best_ckpt_fp32_step):
    """With narrow_checkpoints the backward graph recomputes each upsampling and hands the view it ends in to
    convolution_backward, which on the H200 (torch 2.11) got it with stride 0 at the batch dimension and
    returned a weight gradient in the wrong layout (medddpm.model.layout): the pass writes the view out, and the
    compiled step (best-ckpt's switches, fp32) still gives the eager loss and gradients, and the plain step's
    (best's levers off, checkpoints and all: the levers test_best_levers_compile_to_the_same_step checks one at a
    time, with narrow_checkpoints, store_skip_grad and the separable upsampling besides)."""
    written = best_ckpt_fp32_step["written"]
    (ref_loss, ref_grad), (loss, grad) = best_ckpt_fp32_step["ref"], best_ckpt_fp32_step["compiled"]
    assert len(written) == 2 and written[0] == 0 and written[1] >= 1, f"views written out per graph: {written}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-5
    _assert_the_plain_step(best_ckpt_fp32_step["spec"], loss, grad, "best-ckpt's switches")


@pytest.mark.slow
def test_checkpointed_graphs_save_attention_instead_of_recomputing_it(best_ckpt_fp32_step):
    """A recomputed SDPA (a seeded operator) made AOTAutograd wrap it in an RNG-state operator, which on CUDA
    kept torch 2.11's FX graph cache off every graph of a checkpointed configuration (medddpm.model.recompute). With
    `SaveRandomOps` the compiled step (best-ckpt's switches, fp32) holds no RNG-state operator, its backward runs
    no attention forward, and it gives the eager loss and gradients."""
    import re

    from medddpm.configs import resolve
    from medddpm.train.engine import inductor_options
    from medddpm.model.recompute import SaveRandomOps

    ckpt, plain = (resolve(CONFIGS[name], "cpu") for name in ("best-ckpt", "best"))
    assert isinstance(inductor_options(ckpt).get("joint_custom_pre_pass"), SaveRandomOps)
    assert "joint_custom_pre_pass" not in inductor_options(plain)  # nothing is recomputed there
    assert "joint_custom_pre_pass" not in inductor_options(ckpt, training=False)  # sampling: no backward
    # best-ckpt in fp32 (the fixture's step: best-ckpt has narrow_checkpoints and store_skip_grad on)
    assert CONFIGS["best-ckpt"].with_flags(precision="fp32", store_skip_grad=True, narrow_checkpoints=True) == \
        CONFIGS["best-ckpt"].with_flags(precision="fp32")
    (ref_loss, ref_grad), (loss, grad) = best_ckpt_fp32_step["ref"], best_ckpt_fp32_step["compiled"]
    code = best_ckpt_fp32_step["code"]
    backward = next(c for c in code if "tangents_1" in c)
    assert not any("rng_state" in c for c in code), "a random operator is still recomputed under a checkpoint"
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in backward
    assert not re.search(r"_scaled_dot_product_flash_attention_for_cpu\b", backward), "the backward recomputes SDPA"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-5


def test_engine_sample_is_the_diffusion_sampler(small_spec):
    """Without CUDA graphs `Engine.sample` runs `GaussianDiffusion.sample` with the same model (a schedule of
    25 steps: the two paths are compared step for step, 250 would only take longer). sdpa's switches in float32:
    an AVX2-only CPU runs a bfloat16 3-D convolution about 70x slower than a float32 one."""
    engine = _randomized(small_spec, CONFIGS["sdpa"].with_flags(precision="fp32"), timesteps=25)
    _, c = random_batch(small_spec, seed=5)
    cond = engine.prepare(c)
    with torch.no_grad():
        ours = engine.sample(cond, image_channels=1, generator=torch.Generator().manual_seed(0), progress=False)
        with engine.autocast():
            theirs = engine.diffusion.sample(engine.denoiser, cond, generator=torch.Generator().manual_seed(0),
                                             progress=False)
    assert ours.shape == (1, 1, *small_spec.shape)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_conv_autotune_sets_inductors_convolution_autotuning_in_compiled_graphs_only():
    """`conv_autotune` adds Inductor's convolution autotuning (cuDNN against Triton templates, GEMMs left to
    cuBLAS) to every compiled graph, the sampler's too; without compile it is recorded as not applicable."""
    from medddpm.configs import get_config, resolve
    from medddpm.train.engine import CONV_AUTOTUNE, inductor_options

    run = resolve(get_config("best+conv_autotune=true"), "cpu")
    for training in (True, False):
        options = inductor_options(run, training=training)
        assert options["max_autotune"] and options["max_autotune_conv_backends"] == "ATEN,TRITON"
        assert options.items() >= CONV_AUTOTUNE.items()
    assert "max_autotune" not in inductor_options(resolve(get_config("best"), "cpu"))
    eager = resolve(get_config("sdpa+conv_autotune=true"), "cpu")
    assert "max_autotune" not in inductor_options(eager) and "compile" in eager.not_applicable["conv_autotune"]
    assert "tap_gemm" in resolve(get_config("sdpa+tap_major=true"), "cpu").not_applicable["tap_major"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_denoise_graph_replays_the_eager_step(tiny_spec):
    """A captured denoising step gives what the eager step gives, for new inputs at every replay."""
    from medddpm.measure.run import randomize_

    engine = Engine(tiny_spec, "graphs", device="cuda", ema=False, seed=0)
    randomize_(engine.model, seed=1)  # the zero-initialised output layer would hide the model
    engine.model.eval()
    _, c = random_batch(tiny_spec, seed=5)
    cond = engine.prepare(c)
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn((1, 1, *tiny_spec.shape), device="cuda", generator=g)
    for step in (200, 120, 0):  # t = 0 drops the noise term: a different branch of the same graph
        t = torch.full((1,), step, device="cuda", dtype=torch.long)
        noise = torch.randn(x.shape, device="cuda", generator=g)
        replayed = engine.denoise_step(x, cond, t, noise)
        eager = engine._denoise(x, cond, t, noise)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        assert not torch.equal(replayed, x)
        x = replayed
    assert engine._denoise_graph is not None and engine.capture_peak_bytes > 0


@pytest.fixture
def gpu_realize_rule(fresh_inductor, monkeypatch):
    """Inductor's rule for storing a reused pointwise result, as on a GPU (`should_realize_on_reuse`): on a
    CPU it also stores any reused result that calls exp or sigmoid, which would hide `recompute_pointwise`."""
    import torch._inductor.ir as ir

    rule = ir.StorageBox.should_realize_on_reuse

    def gpu_rule(self, users, **kw):
        with monkeypatch.context() as m:
            m.setattr(ir, "is_cpu", lambda node: False)
            return rule(self, users, **kw)

    monkeypatch.setattr(ir.StorageBox, "should_realize_on_reuse", gpu_rule)
    torch._dynamo.reset()


@pytest.mark.slow
@needs_native_bf16_convolution
def test_recompute_pointwise_stores_no_float32_activation_in_backward(gpu_realize_rule):
    """best's compiled backward, with the chunked GroupNorm this switch was built for, without and with
    `recompute_pointwise`: without, Inductor stores a float32 copy of a GroupNorm-SiLU chain's voxels that
    two kernels read; with, it writes no 5-D float32 buffer and computes the same loss and gradients. (The
    fused GroupNorm has its own backward: in this CPU trace it stores one decoder block's float32 input
    gradient, which under checkpointing on the H200 raised best-ckpt's peak from 4.64 to 5.74 GiB.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    from medddpm.model.unet import ModelSpec

    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    results = {}
    for recompute in (False, True):
        engine = _randomized(spec, CONFIGS["best"].with_flags(cuda_graphs=False, group_norm="chunked",
                                                              recompute_pointwise=recompute))
        assert engine.run.recompute_pointwise == recompute
        (loss, grad), code = run_and_get_code(_loss_and_grads, engine, spec)
        backward = next(c for c in code if "tangents_1" in c)
        # activations (batch 1, every voxel of a level), not weight gradients
        voxels = "|".join(f"{n}, {n}, {n}" for n in (spec.size, spec.size // 2))
        fp32 = re.findall(rf"empty_strided_\w+\(\(1, \d+, (?:{voxels})\), \([\d, ]+\), torch\.float32\)", backward)
        results[recompute] = loss, grad, fp32
    (loss, grad, stored), (loss_r, grad_r, stored_r) = results[False], results[True]
    assert stored and not stored_r, (stored, stored_r)
    torch.testing.assert_close(loss_r, loss, rtol=1e-3, atol=1e-5)
    assert float((grad_r.float() - grad.float()).norm() / grad.float().norm()) < 1e-2


@pytest.mark.slow
@pytest.mark.budget(440)  # 171-211 CPU seconds measured: three compiled variants traced
def test_store_skip_grad_frees_the_float32_input_gradient_of_the_top_decoder_block(gpu_realize_rule):
    """best-ckpt's compiled backward: without store_skip_grad it holds a top-level float32 buffer (the top
    decoder block's GroupNorm input gradient, whose skip slice the encoder's first block reads at the end)
    through much of the backward; with it, every top-level float32 buffer is freed soon after it is written.
    Both compute the same loss and gradients. (On the H200 at 128^3: 1 GiB of best-ckpt's 4.64 GiB peak, and
    with store_skip_grad a 1 GiB float32 buffer, now short-lived, still live at its 4.39 GiB peak.) bfloat16, as
    best-ckpt runs: in float32 the stored skip gradient is itself a float32 buffer. Two levels: with one, the
    backward frees that buffer soon without the switch too."""
    import re

    from torch._inductor.utils import run_and_get_code

    spec = TWO_LEVELS
    n = spec.size
    results = {}
    for stored in (False, True):
        torch._dynamo.reset()
        # narrow_checkpoints off: with it, the top decoder block makes its skip itself (the stem, recomputed in its
        # checkpoint), so under torch 2.11 even the plain backward frees that buffer at once
        engine = _randomized(spec, CONFIGS["best-ckpt"].with_flags(cuda_graphs=False, store_skip_grad=stored,
                                                                   narrow_checkpoints=False))
        (loss, grad), code = run_and_get_code(_loss_and_grads, engine, spec)
        backward = next(c for c in code if "tangents_1" in c)
        call = backward[backward.index("def call("):].splitlines()
        lifetimes = []  # share of the backward's statements through which each top-level float32 buffer lives
        for i, line in enumerate(call):
            if m := re.match(rf"\s*(buf\d+) = empty_strided_\w+\(\(1, \d+, {n}, {n}, {n}\), \([\d, ]+\), torch\.float32\)",
                             line):
                last = max(j for j, other in enumerate(call) if re.search(rf"\b{m.group(1)}\b", other))
                lifetimes.append((last - i) / len(call))
        results[stored] = loss, grad, lifetimes
    (loss, grad, held), (loss_s, grad_s, held_s) = results[False], results[True]
    assert held and max(held) >= 0.4, held  # 0.47 with torch 2.13 (0.5-0.56 with attention at the second level too)
    assert held_s and max(held_s) < 0.2, held_s
    torch.testing.assert_close(loss_s, loss, rtol=1e-3, atol=1e-5)
    assert float((grad_s.float() - grad.float()).norm() / grad.float().norm()) < 1e-2


@pytest.mark.slow
@pytest.mark.budget(160)  # 49-62 CPU seconds measured
def test_recompute_pointwise_leaves_the_denoising_step_alone(gpu_realize_rule):
    """Sampling saves nothing for a backward, where recomputing a reused result pays; in the denoising step it
    only adds work (on the H200, 20.6 ms a step against 18.8). So the switch changes the training graphs
    and the denoising step compiles to the same code with and without it. best's switches in fp32, one level:
    the step's plumbing (compiled with the training graphs' options, the step's code differs)."""
    import re

    from torch._inductor.utils import run_and_get_code

    spec = ONE_LEVEL
    g = torch.Generator().manual_seed(4)
    x, cond, noise = (torch.randn(1, c, *spec.shape, generator=g) for c in (1, spec.mask_channels, 1))
    t = torch.tensor([5])
    results = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        engine = _randomized(spec, CONFIGS["best"].with_flags(cuda_graphs=False, recompute_pointwise=recompute,
                                                              precision="fp32"))
        assert (engine.sampler is not engine.denoiser) == recompute
        results[recompute] = run_and_get_code(engine._denoise, *(engine.prepare(v) for v in (x, cond, t, noise)))
    (out, code), (out_r, code_r) = results[False], results[True]
    code, code_r = ([re.sub(r"# AOT ID: .*\n", "", c) for c in cs] for cs in (code, code_r))  # a process-wide count
    assert code_r == code
    torch.testing.assert_close(out_r, out, rtol=0, atol=0)


def test_inductor_options_carry_each_switch_and_inductor_accepts_them():
    """Each compiled-graph switch reaches `torch.compile(options=...)` under a name this torch knows: Inductor
    rejects an unknown option, which is how a renamed one would show."""
    import dataclasses

    from medddpm.configs import get_config, resolve
    from medddpm.train.engine import RECOMPUTE_POINTWISE, inductor_options

    run = resolve(get_config("best"), "cuda")  # nothing runs
    options = inductor_options(run)
    assert RECOMPUTE_POINTWISE.items() <= options.items()
    assert options["layout_optimization"] is False  # pin_layout's
    sampling = inductor_options(run, training=False)  # the denoising step's graph keeps Inductor's thresholds
    assert not RECOMPUTE_POINTWISE.keys() & sampling.keys()
    plain = inductor_options(dataclasses.replace(run, pin_layout=False, recompute_pointwise=False))
    # every compiled graph carries the convolution-input pass (medddpm.model.layout); channels-last only with pin_layout
    assert plain.keys() == {"post_grad_custom_post_pass"} and not plain["post_grad_custom_post_pass"].channels_last
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(lambda v: torch.nn.functional.silu(v) * 2, options=options)(x),
                               torch.nn.functional.silu(x) * 2)
    with pytest.raises(RuntimeError, match="realize_reads_thresholds"):
        torch.compile(lambda v: v, options={"realize_reads_thresholds": 100})


def test_save_random_ops_marks_only_the_tensors_a_random_operator_returns():
    """cuDNN's SDPA (the H200's) returns tensors, ints and Nones: the pass marks the operator and its tensor
    outputs MUST_SAVE, never an int (the partitioner would hand it to the backward as a saved tensor), and
    leaves random operators outside checkpoints, and every other operator, as they were."""
    import operator

    from torch.utils.checkpoint import CheckpointPolicy

    from medddpm.model.recompute import SaveRandomOps

    sdpa = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    assert torch.Tag.nondeterministic_seeded in sdpa.tags
    g = torch.fx.Graph()
    q = g.placeholder("q")
    out, outside, plain = (g.call_function(f, (q,)) for f in (sdpa, sdpa, torch.ops.aten.relu.default))
    t = torch.empty(1, 1, 4, 8)
    out.meta["val"] = outside.meta["val"] = (t, t[..., :1], None, None, 4, 4, torch.empty((), dtype=torch.long))
    plain.meta["val"] = t
    items = [g.call_function(operator.getitem, (out, i)) for i in range(7)]
    for i, node in enumerate(items):
        node.meta["val"] = out.meta["val"][i]
    for node in (out, plain, *items):
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE  # inside a checkpoint
    SaveRandomOps()(g)
    must = CheckpointPolicy.MUST_SAVE
    assert out.meta["recompute"] == must and outside.meta.get("recompute") is None
    assert plain.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
    assert [n.meta["recompute"] == must for n in items] == [True, True, False, False, False, False, True]
