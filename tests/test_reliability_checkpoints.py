"""Checkpoints that unzip and unpickle but are not what was written: tensor bytes overwritten with finite garbage or
with NaN, a checkpoint written before checkpoints carried a digest, a checkpoint of another width. Each runs
through the command line (`train` resumes, `sample` reads) and asserts its exit code, exactly one line on stderr
naming the problem, and the folder's files as they were: a damaged checkpoint is neither sampled nor trained on
nor saved again as the new checkpoint."""

from __future__ import annotations

import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from medddpm.cli.main import main
from medddpm.train import checkpoint, loop, sampling
from test_reliability_training import copy_run, files, one_error, train_cli, trained, two_levels  # noqa: F401


@pytest.fixture(autouse=True)
def _small_model(monkeypatch):
    two_levels(monkeypatch)


def overwrite_tensors(path: Path, value: float) -> None:
    """Overwrite the bytes of every tensor record of a checkpoint's zip in place with float32 `value`: the zip's
    directory and the pickle stay valid, so the file still loads (what a disk's or a tool's fault leaves)."""
    with zipfile.ZipFile(path) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename]
    with open(path, "r+b") as f:
        for info in records:
            f.seek(info.header_offset + 26)
            name, extra = struct.unpack("<HH", f.read(4))
            f.seek(info.header_offset + 30 + name + extra)
            f.write(np.full(info.file_size // 4, value, np.float32).tobytes())


def without_digest(path: Path) -> None:
    """The checkpoint as one written before checkpoints carried a digest."""
    state = torch.load(path, weights_only=True)
    del state[checkpoint.DIGEST]
    torch.save(state, path)


def _no_sampling(monkeypatch):
    monkeypatch.setattr(sampling, "generate", lambda *a, **k: pytest.fail("a damaged checkpoint was sampled"))


@pytest.mark.parametrize("value", [0.5, float("nan")], ids=["finite garbage", "NaN"])
def test_a_checkpoint_whose_tensor_bytes_were_overwritten_is_refused(trained, tmp_path, capsys, monkeypatch, value):
    out = copy_run(trained, tmp_path)
    ckpt = out / checkpoint.CHECKPOINT
    overwrite_tensors(ckpt, value)
    torch.load(ckpt, weights_only=True)  # the damage is invisible to the zip and the unpickler
    before = files(out)
    _no_sampling(monkeypatch)
    assert main(["sample", "--checkpoint", str(out), "--out", str(tmp_path / "gen"), "--device", "cpu"]) == 2
    one_error(capsys, str(ckpt), "differ from the digest", "refused")
    assert train_cli(out, steps=3) == 2
    line = one_error(capsys, str(ckpt), "differ from the digest")
    assert "diverged" not in line
    assert files(out) == before, "the damaged checkpoint is neither trained on nor replaced"
    assert not (tmp_path / "gen").exists()


def test_the_digest_covers_every_tensor_byte_and_every_value_in_a_defined_order(trained):
    state = torch.load(trained / checkpoint.CHECKPOINT, weights_only=True)
    recorded = state.pop(checkpoint.DIGEST)
    assert recorded == checkpoint.digest(state) and recorded.startswith("sha256:")
    reordered = dict(reversed(list(state.items())))
    assert checkpoint.digest(reordered) == recorded, "the order of a dict's keys does not change it"
    weight = next(iter(state["model"].values()))
    weight.view(-1).view(torch.uint8)[-1] ^= 1  # one bit of one weight
    assert checkpoint.digest(state) != recorded
    weight.view(-1).view(torch.uint8)[-1] ^= 1
    assert checkpoint.digest(state) == recorded
    assert checkpoint.digest(state | {"step": state["step"] + 1}) != recorded, "values that are not tensors count"


def test_a_checkpoint_without_a_digest_resumes_with_a_warning_and_its_next_one_carries_one(trained, tmp_path, capsys):
    """A run written before checkpoints carried a digest (days of training) is not lost: it is read, after its
    values are checked to be finite, with one line saying that nothing more could be checked."""
    out = copy_run(trained, tmp_path)
    ckpt = out / checkpoint.CHECKPOINT
    without_digest(ckpt)
    assert train_cli(out, steps=3) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and str(ckpt) in warned[0] and "carries no digest" in warned[0], err
    assert torch.load(ckpt, weights_only=True)[checkpoint.DIGEST] == checkpoint.digest(checkpoint.read(ckpt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read again: no warning now
        assert checkpoint.read(ckpt)["step"] == 3


def test_a_checkpoint_without_a_digest_that_holds_nan_is_refused(trained, tmp_path, capsys, monkeypatch):
    out = copy_run(trained, tmp_path)
    ckpt = out / checkpoint.CHECKPOINT
    without_digest(ckpt)
    overwrite_tensors(ckpt, float("nan"))
    before = files(out)
    _no_sampling(monkeypatch)
    assert main(["sample", "--checkpoint", str(ckpt), "--out", str(tmp_path / "gen"), "--device", "cpu"]) == 2
    one_error(capsys, str(ckpt), "NaN or infinite", "no digest")
    assert train_cli(out, steps=3) == 2
    one_error(capsys, str(ckpt), "NaN or infinite")
    assert files(out) == before


def test_a_checkpoint_of_another_width_names_the_first_mismatch_whole(trained, tmp_path, capsys):
    """--allow-changed takes another width; the weights then do not fit, and the line says which and how."""
    out = copy_run(trained, tmp_path)
    before = files(out)
    assert train_cli(out, "--base-channels", "64", "--allow-changed", steps=3) == 2
    line = one_error(capsys, str(out / checkpoint.CHECKPOINT), "does not fit this model")
    assert "size mismatch for " in line and "from checkpoint, the shape in current model is" in line, line
    assert "more)" in line, "the other mismatches are counted"
    assert files(out) == before

