"""SIGTERM, which a cluster's scheduler sends before it kills a job (and `kill` sends by default), handled as Ctrl-C
is: one line saying what was kept, exit status 143 (128 + 15, what a shell reports for it), no lock file and no
hidden staging folder left behind, and the same command resumes. Delivered to this process while a command runs
in it (the signal handler is the command line's own), and once for real to a training in a process of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from medddpm.cli.main import main
from medddpm.train import checkpoint, loop
from medddpm.train.engine import Engine
from test_reliability import _cli, _same, _tables, env, producer  # noqa: F401 - fixtures used below
from test_reliability_inputs import _small, one_line, shared_cache  # noqa: F401 - the small model, one cache
from test_reliability_training import PROGRESS, TINY, train_cli

ROOT = Path(__file__).resolve().parents[1]
TERMINATED = 128 + signal.SIGTERM


class Unhandled(Exception):
    pass


@pytest.fixture(autouse=True)
def _sigterm_fails_the_test_unless_handled():
    """Outside a command, SIGTERM raises here instead of ending the test run: a command that does not handle it
    fails its test."""
    def unhandled(signum, frame):
        raise Unhandled("SIGTERM reached the process without the command handling it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # the handler runs in the main thread, at once


def leftovers(folder: Path) -> list[str]:
    """Lock files and hidden staging folders under (and beside) `folder`."""
    return sorted(str(p) for p in folder.rglob(".*"))


def test_sigterm_in_training_keeps_the_last_checkpoint_and_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real, calls = Engine.step, []

    def step(self, batches):
        calls.append(1)
        if len(calls) == 2:
            sigterm()
        return real(self, batches)

    monkeypatch.setattr(Engine, "step", step)
    assert train_cli(out, "--save-every", "1", steps=2) == TERMINATED
    one_line(capsys, "terminated (SIGTERM): ", f"the checkpoint of step 1 in {out} is kept", "the same command resumes")
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.CHECKPOINT, loop.LOSS_LOG]
    assert not leftovers(tmp_path), "no lock file"
    monkeypatch.setattr(Engine, "step", real)
    assert train_cli(out, "--save-every", "1", steps=2) == 0
    assert torch.load(out / checkpoint.CHECKPOINT, weights_only=True)["step"] == 2
    assert [r["step"] for r in loop.read_loss_log(out)] == [1, 2]


def test_sigterm_in_a_sweep_keeps_the_finished_runs_and_the_same_command_measures_the_rest(tmp_path, capsys,
                                                                                           producer, monkeypatch):
    import papermill

    data, root = tmp_path / "data", tmp_path / "data" / "cpu"
    argv = ["sweep", "--configs", "opt2,opt1", "--out", str(data), "--device", "cpu", "--gpu-label", "cpu"]
    real = papermill.execute_notebook

    def execute(notebook, output, parameters, **kw):
        if parameters["config"] == "opt1":
            (Path(parameters["stage"]) / "steps.parquet").write_bytes(b"half")
            sigterm()
        return real(notebook, output, parameters, **kw)

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    rc, lines = _cli(capsys, *argv)
    assert rc == TERMINATED and len(lines) == 1, lines
    assert lines[0].startswith("terminated (SIGTERM): the runs finished so far are kept in") and "(opt1)" in lines[0]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["opt2"] and not leftovers(data), \
        "no staging folder, no lock"
    before = _tables(root / "opt2")
    monkeypatch.setattr(papermill, "execute_notebook", real)
    rc, lines = _cli(capsys, *argv)
    assert rc == 0 and lines == ["2 of 2 configuration(s) measured"], lines
    assert _same(_tables(root / "opt2"), before)


def test_sigterm_in_export_data_leaves_no_folder_and_the_same_command_writes_it(tmp_path, capsys, monkeypatch):
    from medddpm.train import export

    real, calls = export._save, []

    def save(img, path):
        calls.append(path)
        if len(calls) == 3:
            sigterm()
        return real(img, path)

    monkeypatch.setattr(export, "_save", save)
    out = tmp_path / "out"
    argv = ["export-data", "--out", str(out), "--pairs", "2", "--size", "16"]
    assert main(argv) == TERMINATED
    one_line(capsys, "terminated (SIGTERM): ", f"nothing was written to {out}; the same command starts again")
    assert not list(tmp_path.iterdir()), "no folder, no stage, no lock"
    assert main(argv) == 0 and len(list(out.rglob("*.nii.gz"))) == 4


def test_the_handler_is_the_command_s_only(tmp_path):
    """After a command, SIGTERM is handled as before it (here: this module's handler)."""
    assert main(["export-data", "--out", str(tmp_path / "out"), "--pairs", "1", "--size", "16"]) == 0
    with pytest.raises(Unhandled):
        sigterm()


@pytest.mark.slow
def test_a_training_sent_sigterm_for_real_ends_in_one_line_and_resumes(tmp_path, monkeypatch):
    """The whole process, with its data-loader workers, as a scheduler ends a job: SIGTERM to its process group.
    The same command resumes it (here, in this process)."""
    from medddpm.cli import args, commands

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "medddpm", "train", "--out", str(out), "--steps", "3", "--save-every", "1", *TINY]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (out / checkpoint.CHECKPOINT).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in re.split(r"[\r\n]+", err.strip()) if line and not PROGRESS.match(line)]
    assert proc.returncode == TERMINATED and len(lines) == 1, (proc.returncode, err)
    assert lines[0].startswith("terminated (SIGTERM): the checkpoint of step ") and str(out) in lines[0], lines
    assert not leftovers(tmp_path), "no lock file"
    monkeypatch.setattr(commands, "spec_from", args.spec_from)  # the command line's own model, as the process's
    assert main(argv[3:]) == 0
    assert torch.load(out / checkpoint.CHECKPOINT, weights_only=True)["step"] == 3
    assert [r["step"] for r in loop.read_loss_log(out)] == [1, 2, 3]
