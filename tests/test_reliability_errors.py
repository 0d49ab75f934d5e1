"""Faults that must end in one line, not a traceback, and small inputs that must be refused naming their option: the
data tree's reader failing under the command line (`claims`), a study in which no run finishes, a file-size limit
(EFBIG) in `export-data` and `sweep`, seeds out of range, a configuration name that sets a switch twice, a sweep
over masks on another grid than their images. Each runs through the command line and asserts its exit code and
exactly one line on stderr (progress aside)."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from medddpm.cli.main import main
from medddpm.configs import ConfigError, get_config
from medddpm.measure.study import convergence as conv
from medddpm.report import loading
from test_reliability import _cli, env, producer  # noqa: F401 - fixtures used below
from test_reliability_inputs import AFFINE, _small, one_line, pairs, shared_cache, shifted  # noqa: F401
from test_reliability_training import _fail_for

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ one error family, caught in one place


def test_every_error_class_of_the_product_is_one_family():
    from medddpm.errors import UserError
    from medddpm.measure.profile.counters import CountersError
    from medddpm.store.lock import FolderInUse
    from medddpm.store.schema import SchemaError
    from medddpm.store.storage import NotRegularFile, StorageError
    from medddpm.train.budget import TooLarge
    from medddpm.train.checkpoint import CheckpointError
    from medddpm.train.loop import Diverged
    from medddpm.train.nifti import DataError

    for cls in (ConfigError, DataError, loading.DataError, StorageError, NotRegularFile, FolderInUse, SchemaError,
                CountersError, conv.StudyError, Diverged, CheckpointError, TooLarge):
        assert issubclass(cls, UserError), cls
    assert str(UserError("two\nlines")) == "two lines"


def test_claims_on_a_missing_data_tree_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDDDPM_DATA", str(tmp_path / "nowhere"))
    assert main(["claims"]) == 2
    one_line(capsys, "error: no data tree at ", str(tmp_path / "nowhere"))


def test_claims_in_the_strict_mode_names_the_folder_left_out_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "cpu" / "baseline").mkdir(parents=True)
    (tmp_path / "cpu" / "baseline" / "steps.parquet").write_bytes(b"")  # a run without its run.parquet
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")
    assert main(["claims", "--data", str(tmp_path)]) == 2
    one_line(capsys, "error: incomplete run ", str(tmp_path / "cpu" / "baseline"))


# ------------------------------------------------------------------------ a study in which no run finishes

STUDY = ["study", "--configs", "opt1,bf16", "--seeds", "1", "--size", "16", "--base-channels", "32", "--pairs", "1",
         "--samples", "1", "--label-maps", "1", "--sample-steps", "2", "--steps", "2", "--device", "cpu"]


def test_a_study_in_which_every_run_diverged_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    def diverged(job):
        return conv._result(job, conv._row(job, status="diverged", message="training diverged: loss nan at step 1"))

    monkeypatch.setattr(conv, "run_one", diverged)
    argv = [*STUDY, "--out", str(tmp_path / "data"), "--work", str(tmp_path / "work")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out.strip().splitlines()[-1].startswith("no run finished (2 diverged)"), out
    assert conv.summary({"runs": conv.store.read(tmp_path / "data" / "cpu" / "convergence", "runs"),
                         "samples": conv.store.read(tmp_path / "data" / "cpu" / "convergence", "samples")}).empty


@pytest.mark.parametrize("lr", ["inf", "1e400"])
def test_a_study_with_an_infinite_learning_rate_is_refused_before_any_work(tmp_path, capsys, monkeypatch, lr):
    monkeypatch.setattr(conv, "run_one", lambda job: pytest.fail("a run started"))
    assert main([*STUDY, "--lr", lr, "--out", str(tmp_path / "data"), "--work", str(tmp_path / "work")]) == 2
    one_line(capsys, "error: lr must be a positive finite number")
    assert not list(tmp_path.iterdir()), "no table, no error row"


# ------------------------------------------------------------------------ a file-size limit


def test_a_file_size_limit_in_export_data_is_one_line_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    _fail_for(monkeypatch, ".mask_001.nii.gz.", errno.EFBIG)
    assert main(["export-data", "--out", str(out), "--pairs", "3", "--size", "16"]) == 2
    one_line(capsys, "error: cannot write ", "mask_001.nii.gz", "the largest file allowed", "ulimit -f")
    assert not list(tmp_path.iterdir())


def test_a_file_size_limit_in_a_sweep_stops_it_in_one_line_and_leaves_nothing(tmp_path, capsys, producer):
    """The notebook cannot write its run table, then the sweep cannot write the failed run's row either: the sweep
    stops there, saying why, with no folder, staging folder or lock left; without the limit it measures the run."""
    root = tmp_path / "data" / "cpu"
    argv = ["sweep", "--configs", "baseline", "--out", str(tmp_path / "data"), "--device", "cpu", "--gpu-label", "cpu"]
    with pytest.MonkeyPatch.context() as mp:
        _fail_for(mp, ".run.parquet.", errno.EFBIG)
        rc, lines = _cli(capsys, *argv)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: cannot write ") and "run.parquet" in lines[0] and "ulimit -f" in lines[0]
    assert not [p for p in root.iterdir() if p.is_dir() or p.name.startswith(".")], "no run, stage or lock"
    assert _cli(capsys, *argv) == (0, ["1 of 1 configuration(s) measured"])


def test_a_real_file_size_limit_ends_export_data_in_one_line(tmp_path):
    """The kernel's own limit (RLIMIT_FSIZE, `ulimit -f`): Python ignores SIGXFSZ, so the write fails with EFBIG."""
    out = tmp_path / "out"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # noqa: E731 - bytes a file may take
    proc = subprocess.run([sys.executable, "-m", "medddpm", "export-data", "--out", str(out), "--pairs", "2",
                           "--size", "64"], cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: cannot write ") and "ulimit -f" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ arguments


TINY = ["--size", "16", "--base-channels", "32", "--device", "cpu"]


@pytest.mark.parametrize("command", [
    ["train", "--out", "{tmp}/run", "--steps", "1", "--pairs", "1", "--grad-accum", "1", *TINY],
    ["sample", "--checkpoint", "{tmp}/run", "--out", "{tmp}/gen"],
    ["bench", "--configs", "baseline", "--micro-steps", "1", "--warmup", "1", *TINY],
    ["export-data", "--out", "{tmp}/out", "--pairs", "1", "--size", "16"]], ids=lambda c: c[0])
@pytest.mark.parametrize("seed", ["-7", str(2**64), "99999999999999999999999"])
def test_a_seed_out_of_range_is_refused_naming_the_option(tmp_path, capsys, command, seed):
    argv = [a.format(tmp=tmp_path) for a in command]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--seed", seed])
    assert e.value.code == 2
    one_line(capsys, "error: argument --seed: expected an integer seed from 0 to 4294967295")
    assert not list(tmp_path.iterdir())


def test_the_largest_seed_trains(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--pairs", "1", "--grad-accum", "1", *TINY,
                 "--seed", str(2**32 - 1)]) == 0


def test_a_configuration_name_that_sets_a_switch_twice_is_refused():
    with pytest.raises(ConfigError, match=r"switch precision is set twice in 'baseline\+precision=bf16\+precision=fp32'"):
        get_config("baseline+precision=bf16+precision=fp32")
    assert get_config("baseline+precision=bf16+channels_last=true").flags["precision"] == "bf16"


def test_a_sweep_takes_resample_mask_for_masks_on_another_grid(tmp_path, capsys, producer):
    data = pairs(tmp_path / "folder", mask_affine=shifted(0.5))
    argv = ["sweep", "--configs", "baseline", "--out", str(tmp_path / "data"), "--device", "cpu", "--gpu-label",
            "cpu", "--data", str(data), "--phases", ""]
    rc, lines = _cli(capsys, *argv)
    assert rc == 2 and len(lines) == 1 and "--resample-mask" in lines[0], lines
    assert not (tmp_path / "data").exists()
    rc, lines = _cli(capsys, *argv, "--resample-mask")
    assert rc == 0, lines
    from medddpm.store.schema import read_table

    (path,) = (tmp_path / "data" / "cpu").glob("baseline*/run.parquet")
    assert '"resample_mask":"nearest"' in read_table(path).loc[0, "identity"]
