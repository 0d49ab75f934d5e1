import io
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from medddpm.cli.main import main
from medddpm.store import schema

ROOT = Path(__file__).resolve().parent.parent


def run(*args, **kw):
    """`python -m medddpm ARGS` in a process of its own (what only a real interpreter shows)."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "medddpm", *args], capture_output=True, text=True, env=env, **kw)


def cli(capsys, *args) -> tuple[int, str, str]:
    """The command line in this process (a Python process importing torch costs 8-13 CPU seconds): its exit
    status, stdout and stderr."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # the parser's errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_info_json_reports_the_reference_figures(capsys):
    rc, out, err = cli(capsys, "info", "--size", "128", "--mask-channels", "2", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["parameters"] == 40_226_433
    assert abs(info["forward_flops"] / 5.537e12 - 1) < 0.01
    assert info["channels"] == [64, 64, 128, 192, 256] and info["attention_tokens"] == 4096


def test_one_model_width_everywhere(capsys):
    """info, bench and saved build the whole-head model at the book's width, 3 label channels, by default."""
    from medddpm.cli.args import spec_from
    from medddpm.cli.parser import build_parser

    info = json.loads(cli(capsys, "info", "--size", "128", "--json")[1])
    assert info["parameters"] == 40_228_161 and info["in_channels"] == 4
    parser = build_parser()
    for argv in (["info"], ["bench"], ["saved", "--configs", "best"]):
        assert spec_from(parser.parse_args(argv)).mask_channels == 3, argv


def test_the_reference_width_has_embedded_data(tmp_path):
    """2 label channels, the reference's whole-head width: the embedded MNI pairs with grey and white matter as
    one label, for bench's batch and the sweep's and train's data alike; other widths are refused in one line."""
    import torch

    from medddpm.train.data import real_batch
    from medddpm.model.unet import ModelSpec
    from medddpm.train.data import DataError, open_dataset

    three = open_dataset("mni", size=16, n=1, cache_dir=tmp_path)
    two = open_dataset("mni", size=16, n=1, cache_dir=tmp_path, mask_channels=2)
    (_, c3), (_, c2) = three[0], two[0]
    assert (three.mask_channels, two.mask_channels, c3.shape[0], c2.shape[0]) == (3, 2, 3, 2)
    assert torch.equal(c2[0], c3[0]), "CSF as it was"
    assert torch.equal(c2[1], torch.maximum(c3[1], c3[2])), "grey and white matter as one label"
    image, cond = real_batch(ModelSpec(size=16, mask_channels=2))
    assert image.shape == (1, 1, 16, 16, 16) and cond.shape == (1, 2, 16, 16, 16) and (cond[:, 1] > 0).any()
    with pytest.raises(DataError, match="2 or 3 label channels, not 5"):
        open_dataset("mni", size=16, mask_channels=5)
    with pytest.raises(ValueError, match="no embedded data for 1 image and 5 label channels"):
        real_batch(ModelSpec(size=16, mask_channels=5))


@pytest.mark.slow
def test_bench_times_the_reference_width(capsys):
    assert main(["bench", "--mask-channels", "2", "--configs", "baseline", "--size", "16", "--base-channels", "32",
                 "--device", "cpu", "--warmup", "1", "--micro-steps", "1"]) == 0
    assert "baseline" in capsys.readouterr().out


def _subcommands():
    import argparse

    from medddpm.cli.parser import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_option_of_every_subcommand_has_help():
    import argparse

    missing = [f"{name} {' '.join(a.option_strings) or a.dest}" for name, p in _subcommands().items()
               for a in p._actions if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


def test_train_help_sets_the_expert_switches_apart():
    text = _subcommands()["train"].format_help()
    common, expert = text.split("expert: one switch of --config at a time")
    assert "--steps" in common and "--out" in common and "--precision" not in common
    assert "--precision" in expert and "--tap-gemm" in expert and "--steps" not in expert


def test_configs_fits_100_columns(capsys):
    assert main(["configs", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    from medddpm.configs import CONFIGS

    assert {line.split()[0] for line in lines if line and not line[0].isspace()} >= set(CONFIGS)
    assert main(["configs", "--device", "cpu", "--wide"]) == 0
    assert "tap_gemm" in capsys.readouterr().out.splitlines()[0], "--wide: every switch a column"


def test_a_command_exits_once_its_work_is_done(tmp_path):
    """A thread that never ends (here one asleep for 900 s) does not keep a finished command alive: it exits
    EXIT_WAIT_S after its work, with its output and status (a hang would run into the timeout)."""
    script = tmp_path / "hang.py"
    script.write_text("import runpy, sys, threading, time\n"
                      "threading.Thread(target=time.sleep, args=(900,)).start()\n"
                      "sys.argv = ['medddpm', 'configs', '--json']\n"
                      "runpy.run_module('medddpm', run_name='__main__')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=450,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and json.loads(out.stdout), out.stderr


def test_info_shows_the_brats_model(capsys):
    rc, out, err = cli(capsys, "info", "--preset", "brats", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["parameters"] == 57_562_564 and info["shape"] == [192, 192, 144]
    assert (info["in_channels"], info["out_channels"], info["num_res_blocks"]) == (8, 4, 2)
    assert abs(info["forward_flops"] / 21.26e12 - 1) < 1e-3
    assert info["attention_tokens"] == 12 * 12 * 9  # the middle block only
    text = cli(capsys, "info", "--preset", "brats")[1]
    assert "57,562,564" in text and "192x192x144" in text and "middle block only" in text


def test_preset_names_match_the_presets():
    from medddpm.cli.args import PRESET_NAMES
    from medddpm.presets import PRESETS

    assert PRESET_NAMES == tuple(PRESETS)


def test_configs_lists_every_configuration_and_what_does_not_apply(capsys):
    assert main(["configs", "--device", "cpu", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"baseline", "opt1", "opt2", "opt12", "bf16", "compile", "graphs", "best"} <= set(rows)
    assert "precision" in rows["opt1"]["not_applicable_here"]
    assert rows["baseline"]["not_applicable_here"] == {}


@pytest.mark.slow
def test_train_then_sample_on_embedded_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    args = ["train", "--size", "8", "--base-channels", "32", "--pairs", "2", "--steps", "2", "--device", "cpu",
            "--config", "opt1", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "trained 2 steps" in captured.out and "precision not applicable on cpu" in captured.err
    assert len((tmp_path / "run" / "loss.jsonl").read_text().splitlines()) == 2
    assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--labels", "mni:3", "--device", "cpu",
                 "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "image" / "sample_000.nii.gz").exists()
    assert (tmp_path / "gen" / "mask" / "sample_000.nii.gz").exists()


@pytest.mark.slow
def test_bench_times_denoising_steps_with_a_kernel_breakdown(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # at 8^3: an AVX2-only CPU runs sdpa's bfloat16 3-D convolutions about 70x slower than float32 ones
    assert main(["bench", "--phase", "sample", "--configs", "sdpa", "--size", "8", "--base-channels", "32",
                 "--device", "cpu", "--warmup", "1", "--micro-steps", "2", "--kernels", "3", "--json", str(out),
                 "--out", str(tmp_path / "table"), "--source", "smoke sample"]) == 0
    (run_,) = json.loads(out.read_text())["runs"]
    assert run_["config"] == "sdpa" and len(run_["step_ms"]) == 2
    assert run_["sample_s"] == pytest.approx(run_["sample_step_median_ms"] * 250 / 1e3)
    assert len(run_["top_kernels"]) == 3 and "convolution" in run_["category_us"]
    assert sum(run_["category_us"].values()) == pytest.approx(run_["kernel_us"])
    assert "sample steps" in capsys.readouterr().out
    (row,) = schema.read_table(tmp_path / "table" / "bench.parquet", "bench").itertuples()
    assert (row.gpu_slug, row.source, row.phase, row.config, row.timed_steps) == ("cpu", "smoke sample", "sample", "sdpa", 2)
    assert row.sample_step_median_ms == run_["sample_step_median_ms"] and math.isnan(row.train_median_ms)


@pytest.mark.parametrize("args, message", [
    (["train", "--config", "opt3", "--out", "x"], "unknown configuration 'opt3'"),
    (["train", "--steps", "-5", "--out", "x"], "expected a positive integer, got -5"),
    (["train", "--steps", "ten", "--out", "x"], "expected a positive integer, got 'ten'"),
    (["train", "--compile", "maybe", "--out", "x"], "expected true or false"),
    (["train", "--data", "/nonexistent/folder", "--out", "x"], "/nonexistent/folder"),
    (["bench", "--configs", "baseline,nope"], "unknown configuration 'nope'"),
    (["sample", "--checkpoint", "/nonexistent/ckpt.pt", "--out", "x"], "no checkpoint"),
    (["bench", "--reference", "/nonexistent/med-ddpm"], "not a clone of mobaidoctor/med-ddpm"),
    (["info", "--size", "12x3"], "expected N or DxHxW"),
    (["info", "--size", "100"], "100 is not"),
    (["info", "--preset", "brats", "--mask-channels", "3"], "preset brats is a model of 4 label channels"),
    (["train", "--checkpointing", "maybe", "--out", "x"], "expected true or false"),
    (["train", "--group-norm", "welford", "--out", "x"], "invalid choice: 'welford'"),
    (["train", "--pad-channels", "8", "--out", "x"], "expected true or false"),
    (["bench", "--configs", "best+group_norm=welford"], "group_norm must be one of ('aten', 'chunked', 'fused', 'triton')"),
    (["bench", "--phase", "sample", "--reference", "/some/med-ddpm"], "--reference times training steps only"),
    (["bench", "--phase", "sample", "--kernels", "0"], "expected a positive integer, got 0"),
    (["counters", "data/x", "--coverage", "1.5"], "expected a number from 0 to 1, got 1.5"),
    (["train", "--nd-tiling", "true", "--out", "x"], "unrecognized arguments: --nd-tiling true"),
    (["bench", "--configs", "best+split_skip=true"], "unknown config flag(s) ['split_skip']"),
    (["train", "--recompute-pointwise", "always", "--out", "x"], "expected true or false"),
    (["bench", "--configs", "best", "--memory-snapshot", "snaps"], "best replay a CUDA graph, which allocates nothing"),
    (["bench", "--phase", "sample", "--configs", "compile", "--memory-snapshot", "snaps"], "records a training step"),
    (["bench", "--configs", "compile", "--memory-snapshot", "snaps", "--device", "cpu"], "cpu has none"),
    (["bench", "--mask-channels", "5", "--size", "16"], "no embedded data for 1 image and 5 label channels"),
    (["train", "--mask-channels", "5", "--out", "x"], "2 or 3 label channels, not 5"),
    (["sweep", "--mask-channels", "2", "--preset", "brats"], "has 4 label channels, not 2"),
])
def test_bad_input_fails_with_one_clear_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli(capsys, *args)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert message in last, err
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_bad_input_ends_the_interpreter_with_status_2_and_one_clear_line(tmp_path):
    """What test_bad_input_fails_with_one_clear_line checks in this process, from `python -m medddpm` itself: the
    interpreter's exit status and its stderr, for an error of the parser (a command's own error, returned by main:
    tests/test_reliability_errors.py's real file-size limit)."""
    out = run("train", "--steps", "-5", "--out", "x", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "expected a positive integer, got -5" in out.stderr.strip().splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_device_bench_script_carries_tuned_block_sizes(tmp_path):
    """lab/leases/tools/device-bench.sh (a lease helper): the block sizes carried in reach Inductor's cache and
    go out again with the bench's JSON, also when the bench fails (here on the CPU, where no Triton kernel is
    tuned)."""
    carried = tmp_path / "autotune-in.tgz"
    with tarfile.open(carried, "w:gz") as tar:
        body = b'{"XBLOCK": 1024, "num_warps": 4, "found_by_coordesc": true}'
        info = tarfile.TarInfo("./ab/abcdef.best_config")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    script = Path(__file__).parent.parent / "lab" / "leases" / "tools" / "device-bench.sh"
    env = os.environ | {"OUT": str(tmp_path / "out"), "BENCH_CACHE": str(tmp_path / "cache"),
                        "AUTOTUNE_IN": str(carried), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def bench(*args):
        return subprocess.run(["bash", str(script), "300", "b", *args], env=env, capture_output=True, text=True,
                              timeout=280)

    proc = bench("--size", "16", "--configs", "baseline", "--warmup", "1", "--micro-steps", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 tuned kernels carried in" in proc.stdout and "1 tuned kernels packed" in proc.stdout
    assert (tmp_path / "cache" / "ab" / "abcdef.best_config").read_bytes() == body
    runs = json.loads((tmp_path / "out" / "b.json").read_text())["runs"]
    assert [r["config"] for r in runs] == ["baseline"] and len(runs[0]["step_ms"]) == 2
    (tmp_path / "out" / "autotune.tgz").unlink()
    proc = bench("--size", "16", "--configs", "nope", "--device", "cpu")
    assert proc.returncode != 0 and "nope" in proc.stderr
    with tarfile.open(tmp_path / "out" / "autotune.tgz") as tar:
        assert [m.name for m in tar.getmembers() if m.isfile()] == ["./ab/abcdef.best_config"]


@pytest.mark.parametrize("argv, names", [
    (["sweep", "--phases", "bogus"], "--phases"),
    (["train", "--out", "x", "--steps", "zero"], "--steps"),
    (["bogus"], "bogus"),
    (["bench", "--steps", "3"], "bench times micro-steps: use --micro-steps N"),
    (["sweep", "--configs", "baseline", "--steps", "3"], "sweep times micro-steps: use --micro-steps N"),
    (["ablation", "--steps", "3"], "ablation times micro-steps: use --micro-steps N"),
    (["scale", "--steps", "3"], "scale times micro-steps: use --micro-steps N"),
])
def test_a_wrong_option_is_one_line_naming_it(capsys, argv, names):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and names in err, err
    assert err.rstrip().endswith("--help)")


def test_steps_count_optimizer_steps_and_micro_steps_what_the_timing_loop_times():
    from medddpm.cli.parser import build_parser

    parse = build_parser().parse_args
    assert parse(["train", "--out", "x", "--steps", "7"]).steps == 7
    assert parse(["study", "--steps", "7"]).steps == 7
    for command in (["bench"], ["sweep"], ["ablation"], ["scale"]):
        args = parse([*command, "--micro-steps", "7"])
        assert args.micro_steps == 7 and not hasattr(args, "steps"), command
    for command in ("bench", "sweep", "ablation", "scale"):  # the hidden --steps is in no help
        assert "--steps" not in _subcommands()[command].format_help()
