import pytest
import torch

from medddpm.configs import (CONFIGS, PAPER, Config, ConfigError, get_config, parse_config_list, resolve,
                             set_precision_flags)
from medddpm.engine import Engine

from conftest import random_batch


def test_paper_configurations_have_the_papers_switches():
    assert PAPER == ("baseline", "opt1", "opt2", "opt12")
    assert (CONFIGS["baseline"].precision, CONFIGS["baseline"].channels_last) == ("fp32", False)
    assert (CONFIGS["opt1"].precision, CONFIGS["opt1"].channels_last) == ("tf32", False)
    assert (CONFIGS["opt2"].precision, CONFIGS["opt2"].channels_last) == ("fp32", True)
    assert (CONFIGS["opt12"].precision, CONFIGS["opt12"].channels_last) == ("tf32", True)
    for name in ("bf16", "compile", "graphs", "best"):
        assert name in CONFIGS
    assert CONFIGS["compile"].compile and CONFIGS["graphs"].cuda_graphs


def test_checkpointed_configurations_are_their_twins_plus_checkpointing():
    # best-ckpt keeps the chunked GroupNorm: the fused one raised its peak (data/nvidia-h200/NOTES.md, session 13);
    # its other switches lower its peak: on the H200 4.64 -> 4.23 GiB, 68.1 -> 70.8 ms (session 23)
    ckpt_only = {"group_norm": "chunked", "store_skip_grad": True, "narrow_checkpoints": True, "cuda_graphs": False}
    for name, twin, also in (("opt1-ckpt", "opt1", {}), ("best-ckpt", "best", ckpt_only)):
        assert CONFIGS[name].checkpointing and not CONFIGS[twin].checkpointing
        assert CONFIGS[name].flags == CONFIGS[twin].flags | {"checkpointing": True} | also
    assert get_config("bf16+checkpointing=true").checkpointing
    assert not any(c.checkpointing for n, c in CONFIGS.items() if not n.endswith("-ckpt"))


@pytest.mark.parametrize("bad, message", [
    (dict(precision="fp16"), "precision must be one of"),
    (dict(checkpointing="on"), "checkpointing must be a bool"),
    (dict(channels_last="yes"), "channels_last must be a bool"),
    (dict(compile=1), "compile must be a bool"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(memory_budget=1.5), "memory_budget must be a number from 0 to 1"),
    (dict(memory_budget=True), "memory_budget must be a number from 0 to 1"),
    (dict(memory_budget="half"), "memory_budget must be a number from 0 to 1"),
])
def test_wrong_flag_types_are_refused(bad, message):
    with pytest.raises(ConfigError, match=message):
        Config("x", **bad)


def test_unknown_names_are_refused_before_any_work():
    with pytest.raises(ConfigError, match="unknown configuration 'opt3'"):
        parse_config_list("baseline,opt3")
    with pytest.raises(ConfigError, match="must be a str"):
        get_config(3)
    with pytest.raises(ConfigError, match="unknown config flag"):
        CONFIGS["baseline"].with_flags(turbo=True)
    assert [c.name for c in parse_config_list("paper")] == list(PAPER)
    assert len(parse_config_list("all")) == len(CONFIGS)


def test_aot_cse_is_a_switch_of_compiled_graphs():
    c = get_config("best-ckpt+split_skip=true+aot_cse=false")
    assert not c.aot_cse and c.split_skip and c.checkpointing and CONFIGS["best"].aot_cse
    assert not resolve(c, "cpu").aot_cse and "aot_cse" not in resolve(c, "cpu").not_applicable
    r = resolve(get_config("opt1+aot_cse=false"), "cpu")
    assert r.aot_cse and "needs compile" in r.not_applicable["aot_cse"]


def test_memory_budget_is_a_number_in_a_name_and_needs_compile():
    c = get_config("best+memory_budget=0.25")
    assert c.memory_budget == 0.25 and c.name == "best+memory_budget=0.25"
    with pytest.raises(ConfigError, match="memory_budget must be a number from 0 to 1, got 'most'"):
        get_config("best+memory_budget=most")
    assert resolve(c, "cpu").memory_budget == 0.25
    r = resolve(get_config("opt1+memory_budget=0.5"), "cpu")
    assert r.memory_budget == 1.0 and "needs compile" in r.not_applicable["memory_budget"]


@pytest.mark.parametrize("switch", ["recompute_pointwise", "recompute_reads", "store_norm_grad"])
def test_inductor_fusion_switches_need_compile(switch):
    assert getattr(resolve(get_config(f"best+{switch}=true"), "cpu"), switch)
    r = resolve(get_config(f"opt1+{switch}=true"), "cpu")
    assert not getattr(r, switch) and "needs compile" in r.not_applicable[switch]
    with pytest.raises(ConfigError, match=f"{switch} must be a bool"):
        CONFIGS["best"].with_flags(**{switch: "yes"})


@pytest.mark.parametrize("flag", ["nd_tiling", "coordinate_descent", "combo_kernels"])
def test_triton_kernel_switches_need_compile_and_a_gpu(flag):
    assert getattr(resolve(get_config(f"best+{flag}=true"), "cuda"), flag)
    for name, device, why in ((f"best+{flag}=true", "cpu", "CUDA device"), (f"sdpa+{flag}=true", "cuda", "compile")):
        r = resolve(get_config(name), device)
        assert not getattr(r, flag) and why in r.not_applicable[flag], (name, device)
    with pytest.raises(ConfigError, match=f"{flag} must be a bool"):
        CONFIGS["best"].with_flags(**{flag: 1})


def test_with_flags_composes_and_names_the_change():
    c = CONFIGS["opt1"].with_flags(channels_last=True)
    assert c.flags == CONFIGS["opt12"].flags and c.name == "opt1+channels_last=True"
    assert CONFIGS["opt1"].with_flags(precision="tf32") is CONFIGS["opt1"]


def test_gpu_only_switches_are_not_applicable_on_cpu():
    r = resolve(CONFIGS["opt1"], "cpu")
    assert r.precision == "fp32" and "precision" in r.not_applicable
    r = resolve(CONFIGS["best"], "cpu")
    assert not r.cuda_graphs and "cuda_graphs" in r.not_applicable and r.compile
    assert resolve(CONFIGS["baseline"], "cpu").not_applicable == {}
    assert resolve(CONFIGS["best"], "cuda").not_applicable == {}


MATH_MODES = ("cudnn_conv_fp32_precision", "matmul_fp32_precision")


def test_strict_fp32_turns_both_tf32_switches_off_and_tf32_on():
    assert {set_precision_flags("fp32")[k] for k in MATH_MODES} == {"ieee"}
    assert torch.backends.cudnn.conv.fp32_precision == "ieee" and torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert {set_precision_flags("tf32")[k] for k in MATH_MODES} == {"tf32"}
    set_precision_flags("fp32")


def test_cudnn_try_all_lifts_the_autotuning_limit_and_puts_it_back(monkeypatch):
    from medddpm import configs

    assert "cudnn_try_all" in resolve(get_config("best+cudnn_try_all=true"), "cpu").not_applicable
    assert resolve(get_config("best+cudnn_try_all=true"), "cuda").cudnn_try_all
    before = torch.backends.cudnn.benchmark_limit
    monkeypatch.setattr(configs, "DEFAULT_BENCHMARK_LIMIT", 10)  # a CUDA build's default (None without cuDNN)
    try:
        assert set_precision_flags("tf32", cudnn_try_all=True)["cudnn_benchmark_limit"] == "0"
        assert torch.backends.cudnn.benchmark_limit == 0
        assert set_precision_flags("tf32")["cudnn_benchmark_limit"] == "10"  # the next engine's default again
    finally:
        if before is not None:
            torch.backends.cudnn.benchmark_limit = before
        set_precision_flags("fp32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_named_configuration_runs_one_cpu_step(name, tiny_spec):
    engine = Engine(tiny_spec, name, device="cpu", ema=False)
    x, c = random_batch(tiny_spec)
    before = [p.detach().clone() for p in engine.model.parameters()]
    loss = engine.step((engine.prepare(x), engine.prepare(c)))
    assert loss.shape == () and torch.isfinite(loss)
    changed = sum(not torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    assert changed > 0, "an optimizer step must move some weights"
    expected_na = {k for k in ("precision", "cuda_graphs")
                   if (k == "precision" and CONFIGS[name].precision == "tf32") or (k == "cuda_graphs" and CONFIGS[name].cuda_graphs)}
    assert set(engine.run.not_applicable) == expected_na
    if engine.run.channels_last:
        assert next(p for p in engine.model.parameters() if p.ndim == 5).is_contiguous(memory_format=torch.channels_last_3d)


def test_config_choices_are_the_model_s():
    """A kind the configuration accepts is one the model builds (the command line offers the configuration's)."""
    from typing import get_args

    from medddpm.configs import AttentionKind, GroupNormKind, UpsampleKind
    from medddpm.model import ATTENTION_KINDS, GROUP_NORM_KINDS, UPSAMPLE_KINDS

    assert get_args(UpsampleKind) == UPSAMPLE_KINDS and get_args(GroupNormKind) == GROUP_NORM_KINDS
    assert get_args(AttentionKind) == ATTENTION_KINDS
    assert get_config("best+upsample=separable_ndhwc").upsample == "separable_ndhwc"
    with pytest.raises(ConfigError, match="must be one of"):
        get_config("best+upsample=nearest")
