"""Paths that are not the regular files they are named as, and a data tree with parts missing: a checkpoint, a loss
log, a run table or a volume that is a named pipe (FIFO) or a folder; a finished run whose table was deleted or
became a symlink loop; a device folder with a name no label has. Nothing blocks (a named pipe is never opened in
a way that waits for a writer), each is named in one line, and the data tree's reader leaves the folder out with
a warning, or, in the strict mode the published book builds under, fails naming it."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medddpm.cli.main import main
from medddpm.configs import get_config
from medddpm.measure.run import run_row
from medddpm.report import loading
from medddpm.store.schema import write_table
from medddpm.train import checkpoint, loop
from test_reliability import env  # noqa: F401 - the environment of the run rows written below
from test_reliability_inputs import SHAPE, _save, pairs
from test_reliability_training import copy_run, files, one_error, train_cli, trained, two_levels  # noqa: F401

WAIT_S = 120  # far beyond what any of these takes; a command still running then is blocked on a named pipe


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _small_model(monkeypatch, tmp_path):
    two_levels(monkeypatch)
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))


def finishes(call, *fifos: Path):
    """call()'s result; a failure where it is still running after WAIT_S seconds (blocked on one of `fifos`,
    which are then opened for writing and closed, so that the blocked reader reads an end and the thread ends)."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", call()), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(30)
        pytest.fail(f"blocked on a named pipe: {', '.join(map(str, fifos))}")
    return box.get("result")


# ------------------------------------------------------------------------ the training folder


@pytest.mark.parametrize("name", [checkpoint.CHECKPOINT, loop.LOSS_LOG])
def test_a_named_pipe_in_the_training_folder_is_refused_at_once(trained, tmp_path, capsys, name):
    out = copy_run(trained, tmp_path)
    (out / name).unlink()
    os.mkfifo(out / name)
    assert finishes(lambda: train_cli(out, steps=3), out / name) == 2
    one_error(capsys, str(out / name), "a named pipe (FIFO), not a regular file")
    assert (out / name).exists() and not (out / name).is_file(), "left as it was"


def test_sample_refuses_a_checkpoint_that_is_a_named_pipe_or_a_folder(tmp_path, capsys):
    fifo, folder = tmp_path / "fifo.pt", tmp_path / "folder.pt"
    os.mkfifo(fifo)
    folder.mkdir()
    (folder / checkpoint.CHECKPOINT).mkdir()
    argv = ["sample", "--out", str(tmp_path / "gen"), "--device", "cpu", "--checkpoint"]
    assert finishes(lambda: main([*argv, str(fifo)]), fifo) == 2
    one_error(capsys, str(fifo), "a named pipe (FIFO), not a regular file")
    assert main([*argv, str(folder)]) == 2
    one_error(capsys, str(folder / checkpoint.CHECKPOINT), "a folder, not a regular file")


def test_a_symlink_loop_for_a_checkpoint_is_refused_not_taken_for_a_new_run(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(out / "b.pt", out / checkpoint.CHECKPOINT)
    os.symlink(out / checkpoint.CHECKPOINT, out / "b.pt")
    assert train_cli(out, steps=1) == 2
    one_error(capsys, str(out / checkpoint.CHECKPOINT), "symlink loop")
    assert sorted(p.name for p in out.iterdir()) == ["b.pt", checkpoint.CHECKPOINT]


def test_a_volume_that_is_a_named_pipe_is_refused_naming_it(tmp_path, capsys):
    data = pairs(tmp_path / "folder")
    mask = sorted((data / "mask").iterdir())[0]
    mask.unlink()
    os.mkfifo(mask)
    assert finishes(lambda: train_cli(tmp_path / "run", "--data", str(data), steps=1), mask) == 2
    one_error(capsys, str(mask), "a named pipe (FIFO), not a regular file")


# ------------------------------------------------------------------------ the data tree


PHASES = json.dumps({"sample": {"status": "ok"}, "torch": {"status": "ok"}, "ncu": {"status": "skipped"}})


def run_tree(root: Path, env: dict, label: str = "cpu", configs=("baseline", "opt1"), profilers: str = PHASES,
             slug: str | None = None) -> Path:
    """<root>/<label>/<config>/ for each configuration: a finished run as the producer notebook leaves it (its
    row's `profilers` say the torch phase ran and quality was not skipped: steps, kernels and quality tables).
    `slug`: the device label its row names (default: the label's slug)."""
    for config in configs:
        folder = root / label / config
        row = run_row(get_config(config), "smoke", env=env, gpu_name="cpu", label=label, status="ok", message="")
        slug = slug or row["gpu_slug"]
        row |= {"gpu_slug": slug, "run_id": f"{slug}/{config}/0", "train_median_ms": 2.0, "timed_steps": 1,
                "profilers": profilers}
        write_table(pd.DataFrame([row]), folder / "run.parquet", "run")
        rid = {"run_id": row["run_id"]}
        write_table(pd.DataFrame(rid | {"phase": "train", "micro_step": [0, 1], "timed": [False, True],
                                        "step_ms": [3.0, 2.0], "dispatch_ms": 0.1, "loss": 0.5, "peak_mem_bytes": -1}),
                    folder / "steps.parquet", "steps")
        write_table(loading.schema.empty("kernels"), folder / "kernels.parquet", "kernels")
        write_table(pd.DataFrame(rid | {"step": [1], "loss": 0.5, "baseline_loss": 0.5, "rel_err": 0.0}),
                    folder / "quality.parquet", "quality")
    return root


def _strict_fails(monkeypatch, root: Path, *needles: str) -> None:
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")
    with pytest.raises(loading.DataError) as e:
        loading.load_all(root)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    monkeypatch.delenv("MEDDDPM_STRICT_DATA")


def _left_out(root: Path, read=loading.load_all):
    """What `read` returns, and the distinct warnings of what it left out (each reader of the tree says it again:
    once a page, as warnings are shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = read(root)
    return data, sorted({str(w.message) for w in caught if issubclass(w.category, loading.DataWarning)})


DAMAGE = {  # case -> (what is done to opt1's steps.parquet, what the one line names)
    "deleted": (lambda p: p.unlink(), "a finished run without its steps.parquet"),
    "a symlink loop": (lambda p: (p.unlink(), os.symlink(p, p)), "symlink loop"),
    "a symlink to nothing": (lambda p: (p.unlink(), os.symlink(p.parent / "gone.parquet", p)), "a symlink to nothing"),
    "a folder": (lambda p: (p.unlink(), p.mkdir()), "a folder, not a regular file"),
    "a named pipe": (lambda p: (p.unlink(), os.mkfifo(p)), "a named pipe (FIFO), not a regular file"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_finished_run_without_a_table_it_wrote_is_left_out_and_fails_the_strict_build(tmp_path, env, monkeypatch,
                                                                                        case):
    damage, needle = DAMAGE[case]
    root = run_tree(tmp_path / "data", env)
    steps = root / "cpu" / "opt1" / "steps.parquet"
    damage(steps)
    data, messages = finishes(lambda: _left_out(root), steps)
    assert list(data.run["config"]) == ["baseline"], "the run is left out, the other shown"
    assert len(messages) == 1 and str(root / "cpu" / "opt1") in messages[0] and needle in messages[0], messages
    _strict_fails(monkeypatch, root, str(root / "cpu" / "opt1"), needle)


def test_a_table_a_run_did_not_write_is_not_asked_for(tmp_path, env, monkeypatch):
    """The rule can come out both ways: a run whose row says its torch phase was skipped needs no kernels table,
    one whose row says it ran does."""
    skipped = json.dumps({"torch": {"status": "skipped", "message": "not requested"}, "quality": {"status": "skipped"}})
    root = run_tree(tmp_path / "data", env, profilers=skipped)
    for config in ("baseline", "opt1"):
        (root / "cpu" / config / "kernels.parquet").unlink()
        (root / "cpu" / config / "quality.parquet").unlink()
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")
    assert list(loading.load_all(root).run["config"]) == ["baseline", "opt1"]
    monkeypatch.delenv("MEDDDPM_STRICT_DATA")
    root = run_tree(tmp_path / "other", env)
    (root / "cpu" / "opt1" / "kernels.parquet").unlink()
    _strict_fails(monkeypatch, root, "without its kernels.parquet")


@pytest.mark.parametrize("kind", ["folder", "named pipe"])
def test_a_run_table_that_is_not_a_file_is_named_not_taken_for_a_missing_run(tmp_path, env, monkeypatch, kind):
    root = run_tree(tmp_path / "data", env)
    run = root / "cpu" / "opt1" / "run.parquet"
    run.unlink()
    run.mkdir() if kind == "folder" else os.mkfifo(run)
    data, messages = finishes(lambda: _left_out(root), run)
    assert list(data.run["config"]) == ["baseline"]
    assert len(messages) == 1 and f"{run}: a " in messages[0] and "not a regular file" in messages[0], messages
    _strict_fails(monkeypatch, root, str(run), "not a regular file")


def test_hidden_and_unlabelled_device_folders_are_never_read_as_a_card(tmp_path, env, monkeypatch):
    """A folder named `..cpu` (hidden: a writer's name) is skipped by every reader alike, the roofs' and the
    ablation's too; a folder whose name is no label is left out, named."""
    root = run_tree(tmp_path / "data", env)
    roofs = pd.read_parquet(ROOT / "data" / "nvidia-h100-80gb-hbm3" / "roofs.parquet")
    for label in ("..cpu", "My GPU"):  # each folder's rows name it, as a hand-made folder's would
        run_tree(root, env, label=label, configs=("baseline",), slug=label)
        write_table(roofs.assign(gpu_slug=label), root / label / "roofs.parquet", "roofs")
        run_tree(root / label, env, label="ablation", configs=("best",), slug=label)
    data, messages = _left_out(root)
    assert set(data.run["gpu_slug"]) == {"cpu"} and data.roofs.empty
    assert _left_out(root, loading.ablation_runs)[0].empty
    assert len(messages) == 1, messages
    assert str(root / "My GPU") in messages[0] and "not a device label" in messages[0], messages
    _strict_fails(monkeypatch, root, "My GPU")


def test_claims_names_a_run_table_that_is_a_folder_in_one_line(tmp_path, env, capsys, monkeypatch):
    root = run_tree(tmp_path / "data", env)
    run = root / "cpu" / "opt1" / "run.parquet"
    run.unlink()
    run.mkdir()
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")
    assert main(["claims", "--data", str(root)]) == 2
    one_error(capsys, str(run), "a folder, not a regular file")


def test_a_label_file_for_sampling_that_is_a_named_pipe_is_refused(trained, tmp_path, capsys):
    fifo = tmp_path / "labels.nii.gz"
    os.mkfifo(fifo)
    argv = ["sample", "--checkpoint", str(trained), "--out", str(tmp_path / "gen"), "--device", "cpu",
            "--labels", str(fifo)]
    assert finishes(lambda: main(argv), fifo) == 2
    one_error(capsys, str(fifo), "a named pipe (FIFO), not a regular file")


def test_a_label_file_that_is_a_regular_file_reads_as_before(tmp_path):
    """The check lets the ordinary case through: a NIfTI label map reads as before."""
    from medddpm.train.sampling import label_volume

    labels = np.zeros(SHAPE, np.uint8)
    labels[4:8, 4:8, 4:8] = 2
    _save(tmp_path / "labels.nii.gz", labels)
    assert label_volume(str(tmp_path / "labels.nii.gz"), size=16, mask_channels=3).max() == 2
