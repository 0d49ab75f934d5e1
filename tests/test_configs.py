import pytest
import torch

from medddpm.configs import (CONFIGS, PAPER, Config, ConfigError, get_config, parse_config_list, resolve,
                             set_precision_flags)
from medddpm.train.engine import Engine
from medddpm.store.schema import RETIRED

from conftest import TWO_LEVELS, random_batch


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
    # best-ckpt keeps the chunked GroupNorm: the fused one raised its peak (on the H200 4.64 -> 5.74 GiB);
    # its other switches lower its peak: on the H200 4.64 -> 4.23 GiB, 68.1 -> 70.8 ms
    ckpt_only = {"group_norm": "chunked", "store_skip_grad": True, "narrow_checkpoints": True, "cuda_graphs": False}
    for name, twin, also in (("opt1-ckpt", "opt1", {}), ("best-ckpt", "best", ckpt_only)):
        assert CONFIGS[name].checkpointing and not CONFIGS[twin].checkpointing
        assert CONFIGS[name].flags == CONFIGS[twin].flags | {"checkpointing": True} | also
    assert get_config("bf16+checkpointing=true").checkpointing
    assert not any(c.checkpointing for n, c in CONFIGS.items() if not n.endswith("-ckpt"))


@pytest.mark.parametrize("bad, message", [
    (dict(precision="fp8"), "precision must be one of"),
    (dict(checkpointing="on"), "checkpointing must be a bool"),
    (dict(channels_last="yes"), "channels_last must be a bool"),
    (dict(compile=1), "compile must be a bool"),
    (dict(attention="flash"), "attention must be one of"),
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


def test_recompute_pointwise_needs_compile():
    assert resolve(get_config("best+recompute_pointwise=true"), "cpu").recompute_pointwise
    r = resolve(get_config("opt1+recompute_pointwise=true"), "cpu")
    assert not r.recompute_pointwise and "needs compile" in r.not_applicable["recompute_pointwise"]
    with pytest.raises(ConfigError, match="recompute_pointwise must be a bool"):
        CONFIGS["best"].with_flags(recompute_pointwise="yes")


@pytest.mark.parametrize("lever", RETIRED["run"])
def test_a_retired_lever_is_an_unknown_flag(lever):
    """The levers that measured a loss left the product: a name that sets one fails in one line, as any
    unknown flag does, and no configuration has the switch."""
    with pytest.raises(ConfigError, match=rf"^unknown config flag\(s\) \['{lever}'\]; known: [^\n]*$"):
        get_config(f"best+{lever}=true")
    assert all(lever not in c.flags for c in CONFIGS.values())


def test_with_flags_composes_and_names_the_change():
    c = CONFIGS["opt1"].with_flags(channels_last=True)
    assert c.flags == CONFIGS["opt12"].flags and c.name == "opt1+channels_last=true"
    assert get_config(c.name).flags == c.flags  # the label reads back as the same configuration
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


# A compiled configuration compiles its step (a minute or two on the CPU): slow. So is fp16, whose 3D convolutions
# run in PyTorch's reference CPU kernel (tests/test_fp16.py trains it at 8^3). At 8^3 (`small_spec`): a step of
# fp16-best took 1,120 s at 16^3 on a loaded 2-core machine. A compiled one on TWO_LEVELS, every layer the
# configuration runs with attention in the middle block only: the compile costs by the graph's operations.
# Budget: 76-104 CPU seconds measured for a compiled one.
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow, pytest.mark.budget(240)])
                                  if c.compile or c.precision == "fp16" else n for n, c in CONFIGS.items()])
def test_every_named_configuration_runs_one_cpu_step(name, small_spec):
    spec = TWO_LEVELS if CONFIGS[name].compile else small_spec
    engine = Engine(spec, name, device="cpu", ema=False)
    x, c = random_batch(spec)
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
    from medddpm.model.blocks import ATTENTION_KINDS, UPSAMPLE_KINDS
    from medddpm.model.group_norm import GROUP_NORM_KINDS

    assert get_args(UpsampleKind) == UPSAMPLE_KINDS and get_args(GroupNormKind) == GROUP_NORM_KINDS
    assert get_args(AttentionKind) == ATTENTION_KINDS
    assert get_config("best+upsample=separable_ndhwc").upsample == "separable_ndhwc"
    with pytest.raises(ConfigError, match="must be one of"):
        get_config("best+upsample=nearest")


def test_a_switch_is_declared_once(tmp_path, monkeypatch):
    """A switch added to a configuration class in a module of its own gets its command-line flag, its help and
    values, its run-table column and the value older rows imply, with nothing else edited."""
    import argparse
    import importlib
    import sys

    from medddpm.cli.args import add_config_args, config_from
    from medddpm.store import schema

    (tmp_path / "dummy_lever.py").write_text(
        "from dataclasses import dataclass\n"
        "from typing import Literal\n"
        "from medddpm.configs import Config, switch\n\n"
        "@dataclass(frozen=True)\n"
        "class DummyConfig(Config):\n"
        "    dummy_lever: bool = switch(False, 'a dummy lever for the test', 'whether the dummy lever was on')\n"
        "    dummy_kind: Literal['a', 'b'] = switch('a', 'a dummy choice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dummy = importlib.import_module("dummy_lever")
    try:
        parser = argparse.ArgumentParser()
        add_config_args(parser, dummy.DummyConfig)
        assert "a dummy lever for the test" in parser.format_help() and "{a,b}" in parser.format_help()
        config = config_from(parser.parse_args(["--config", "opt1", "--dummy-lever", "true", "--dummy-kind", "b"]))
        assert isinstance(config, dummy.DummyConfig) and config.dummy_lever and config.dummy_kind == "b"
        assert config.precision == "tf32" and config.flags["dummy_lever"] is True  # opt1's switches kept
        with pytest.raises(SystemExit):
            parser.parse_args(["--dummy-kind", "c"])
        columns = schema.switch_columns(dummy.DummyConfig)
        assert columns["dummy_lever"] == (schema.B, "whether the dummy lever was on")
        assert columns["dummy_kind"] == (schema.S, "a dummy choice")
        defaults = schema.switch_defaults(dummy.DummyConfig)
        assert defaults["dummy_lever"] is False and defaults["dummy_kind"] == "a" and "precision" not in defaults
    finally:
        sys.modules.pop("dummy_lever", None)


def test_the_run_table_has_a_column_and_the_command_line_a_flag_for_every_switch():
    import argparse

    from medddpm.cli.args import add_config_args
    from medddpm.configs import switches
    from medddpm.store import schema

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    flags = {a.dest for a in parser._actions}
    for f in switches():
        assert f.name in schema.TABLES["run"] and f.name in flags, f.name
        assert f.metadata["help"] and f.metadata["column"]
