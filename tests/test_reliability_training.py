"""Faults of training, sampling and reading checkpoints and snapshots, run through the command line: each ends
with exit code 2 and exactly one line naming the problem, runs nothing a file asks to run, and loses nothing
(the folder's files are compared before and after)."""

import dataclasses
import errno
import gzip
import hashlib
import json
import os
import pickle
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

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "16", "--base-channels", "32", "--pairs", "2", "--grad-accum", "1", "--device", "cpu",
        "--log-every", "1"]


def train_cli(out, *extra, steps=2):
    return main(["train", "--out", str(out), "--steps", str(steps), *TINY, *extra])


def two_levels(mp: pytest.MonkeyPatch) -> None:
    """The command line's model with two levels (as `tiny_spec`): a step in a few tenths of a second."""
    from medddpm.cli import commands

    real = commands.spec_from
    mp.setattr(commands, "spec_from", lambda *a, **kw: dataclasses.replace(real(*a, **kw), channel_mult=(1, 2),
                                                                           attention_ds=(2,)))


@pytest.fixture(autouse=True)
def _small_model(monkeypatch):
    two_levels(monkeypatch)


def files(folder: Path) -> dict:
    """Every file under `folder` (the lock file aside: its text names the last holder) with its digest."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


PROGRESS = re.compile(r"^train \S+: +\d+%\|")  # the training's progress bar, also on stderr


def one_error(capsys, *needles) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not PROGRESS.match(line)]
    assert len(err) == 1, err
    assert err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


class Payload:
    """What a crafted file would run on loading: it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished two-step training folder (checkpoint and loss log)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as mp:
        two_levels(mp)
        assert train_cli(out) == 0
    return out


def copy_run(trained, tmp_path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    for name in (checkpoint.CHECKPOINT, loop.LOSS_LOG):
        (out / name).write_bytes((trained / name).read_bytes())
    return out


# ------------------------------------------------------------------------ nothing executed


def test_a_crafted_checkpoint_runs_nothing_on_resume_or_sample(tmp_path, capsys):
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"model": Payload(marker), "opt": {}, "step": 0, "spec": {}, "config": {}}, out / checkpoint.CHECKPOINT)
    before = files(out)
    assert train_cli(out) == 2
    one_error(capsys, str(out / checkpoint.CHECKPOINT), "refused", "asks to call io.open")
    assert main(["sample", "--checkpoint", str(out), "--out", str(tmp_path / "samples"), "--device", "cpu"]) == 2
    one_error(capsys, str(out / checkpoint.CHECKPOINT), "refused", "asks to call io.open")
    assert not marker.exists(), "the checkpoint's payload ran"
    assert files(out) == before
    assert not (tmp_path / "samples").exists()


@pytest.mark.parametrize("gz", [False, True])
def test_a_crafted_snapshot_runs_nothing(tmp_path, capsys, gz):
    marker = tmp_path / "ran"
    raw = pickle.dumps({"segments": [], "device_traces": [[Payload(marker)]]})
    path = tmp_path / ("memory-x-0123456.pickle" + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(raw) if gz else raw)
    assert main(["peak", str(path)]) == 2  # no summary beside it: the pickle is read only on request
    one_error(capsys, str(path), "--trust-pickle")
    assert main(["peak", str(path), "--trust-pickle"]) == 2  # and then as plain data
    one_error(capsys, str(path), "refused", "open")
    assert not marker.exists(), "the snapshot's payload ran"


def test_checkpoints_load_as_plain_weights(trained):
    state = torch.load(trained / checkpoint.CHECKPOINT, weights_only=True)  # raises on anything but plain data
    assert state["step"] == 2 and state["cpu_rng"].dtype == torch.uint8
    assert {"seed", "lr", "grad_accum", "spec", "config", "ema", "opt"} <= set(state)


# ------------------------------------------------------------------------ corrupt files


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "a tensor"])
def test_a_damaged_checkpoint_is_one_line(trained, tmp_path, capsys, damage):
    out = copy_run(trained, tmp_path)
    ckpt = out / checkpoint.CHECKPOINT
    raw = ckpt.read_bytes()
    if damage == "truncated":
        ckpt.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        ckpt.write_bytes(os.urandom(4096))
    elif damage == "empty":
        ckpt.write_bytes(b"")
    else:
        torch.save(torch.zeros(3), ckpt)
    before = files(out)
    assert train_cli(out, steps=3) == 2
    one_error(capsys, str(ckpt))
    assert main(["sample", "--checkpoint", str(ckpt), "--out", str(tmp_path / "s"), "--device", "cpu"]) == 2
    one_error(capsys, str(ckpt))
    assert files(out) == before


# ------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("lr", ["inf", "nan", "-inf", "0", "-1e-4"])
def test_a_bad_learning_rate_is_refused_before_any_work(tmp_path, capsys, lr):
    assert train_cli(tmp_path / "run", f"--lr={lr}") == 2
    one_error(capsys, "lr must be a positive finite number")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "meta", "cuda:99"])
def test_a_bad_device_is_one_line(tmp_path, capsys, device):
    argv = ["--out", str(tmp_path / "run"), "--steps", "1", "--size", "16", "--device", device]
    assert main(["train", *argv]) == 2
    one_error(capsys, repr(device))
    assert main(["sample", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "s"), "--device", device]) == 2
    one_error(capsys, repr(device))
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()


def test_out_that_is_a_file(tmp_path, capsys, trained):
    target = tmp_path / "taken"
    target.write_text("keep me")
    assert train_cli(target) == 2
    one_error(capsys, str(target), "file")
    assert main(["sample", "--checkpoint", str(trained), "--out", str(target), "--device", "cpu"]) == 2
    one_error(capsys, str(target), "file")
    assert target.read_text() == "keep me"


# ------------------------------------------------------------------------ the file system refuses


def test_a_read_only_folder(tmp_path, capsys, monkeypatch):
    """The folder cannot be written (EROFS, as on a read-only mount: tests that run as root pass chmod)."""
    out = tmp_path / "run"
    real_open = os.open

    def read_only(path, *a, **kw):
        if str(path).startswith(str(out)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", read_only)
    assert train_cli(out) == 2
    one_error(capsys, str(out), "read-only")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder whose mode forbids it")
def test_a_folder_without_write_permission(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert train_cli(out) == 2
        one_error(capsys, str(out), "permission denied")
    finally:
        out.chmod(0o755)


def _fail_for(monkeypatch, name_prefix: str, err: int = errno.ENOSPC):
    """os.fsync raises `err` for files whose name starts with `name_prefix` (atomic_write's temporary files)."""
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(name_prefix):
            raise OSError(err, os.strerror(err))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_while_writing_the_checkpoint(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    before = files(out)
    with pytest.MonkeyPatch.context() as mp:
        _fail_for(mp, f".{checkpoint.CHECKPOINT}.")
        assert train_cli(out, steps=4) == 2
    line = one_error(capsys, str(out / checkpoint.CHECKPOINT))
    assert "disk" in line and "full" in line, line
    assert files(out)[checkpoint.CHECKPOINT] == before[checkpoint.CHECKPOINT], "the last checkpoint is kept whole"
    assert not list(out.glob(".*.tmp"))
    # nothing lost: resuming after the fault ends where an uninterrupted run ends
    assert train_cli(out, steps=4) == 0
    whole = tmp_path / "whole"
    assert train_cli(whole, steps=4) == 0
    capsys.readouterr()
    assert loop.read_loss_log(out) == loop.read_loss_log(whole)
    a, b = (torch.load(d / checkpoint.CHECKPOINT, weights_only=True) for d in (out, whole))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_full_disk_while_writing_a_loss_line(trained, tmp_path, capsys, monkeypatch):
    """The write fails half-way (ENOSPC): the half line is cut back off, the log stays whole lines."""
    out = copy_run(trained, tmp_path)
    log = out / loop.LOSS_LOG
    before = log.read_text()
    real_open = open

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def tell(self):
            return self.f.tell()

        def truncate(self, size):
            return self.f.truncate(size)

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(loop, "open", lambda path, mode="r", *a, **kw: HalfWritten(real_open(path, mode, *a, **kw)),
                        raising=False)
    assert train_cli(out, steps=3) == 2
    line = one_error(capsys, str(log), "the disk is full")
    assert log.read_text() == before, line
    assert torch.load(out / checkpoint.CHECKPOINT, weights_only=True)["step"] == 2


# ------------------------------------------------------------------------ resuming another run


@pytest.mark.parametrize("change", [["--seed", "1"], ["--lr", "1e-4"], ["--grad-accum", "2"],
                                    ["--config", "bf16"], ["--base-channels", "64"]])
def test_resuming_with_other_values_is_refused(trained, tmp_path, capsys, change):
    out = copy_run(trained, tmp_path)
    before = files(out)
    argv = ["train", "--out", str(out), "--steps", "3", *TINY]
    i = argv.index(change[0]) if change[0] in argv else None
    if i is not None:
        del argv[i:i + 2]
    assert main(argv + change) == 2
    name = change[0].removeprefix("--").replace("-", "_")
    one_error(capsys, "--allow-changed", {"config": "precision", "base_channels": "base_channels"}.get(name, name))
    assert files(out) == before


def test_resuming_with_allow_changed_takes_the_new_learning_rate(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    assert train_cli(out, "--lr", "1e-3", "--allow-changed", steps=3) == 0
    state = torch.load(out / checkpoint.CHECKPOINT, weights_only=True)
    assert state["step"] == 3 and state["lr"] == 1e-3
    assert [g["lr"] for g in state["opt"]["param_groups"]] == [1e-3]
    assert [r["step"] for r in loop.read_loss_log(out)] == [1, 2, 3]


# ------------------------------------------------------------------------ RNG states on another device


def test_rng_states_restore_whatever_map_location(trained):
    """`torch.set_rng_state` takes a CPU uint8 tensor only (a GPU one fails with 'RNG state must be a
    torch.ByteTensor'): the resume path reads them to the CPU, and restoring moves them there."""
    from medddpm.model.unet import ModelSpec
    from medddpm.train.engine import Engine

    state = checkpoint.read(trained / checkpoint.CHECKPOINT)  # as the resume path reads it
    assert state["cpu_rng"].device.type == "cpu" and state["cpu_rng"].dtype == torch.uint8
    spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["spec"].items()})
    engine = Engine(spec, "baseline", device="cpu")
    torch.manual_seed(123)
    engine.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), state["cpu_rng"])
    assert checkpoint.cpu_rng_state(state["cpu_rng"]).device.type == "cpu"
    for bad in (state["cpu_rng"].float(), state["cpu_rng"].to("meta"), state["cpu_rng"][None]):
        with pytest.raises(ValueError, match="RNG state"):
            engine.load_state_dict(state | {"cpu_rng": bad})


# ------------------------------------------------------------------------ two trainings into one folder


def test_a_second_training_into_a_folder_in_use_fails_naming_the_first(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    before = files(out)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom medddpm.store.lock import output_lock\n"
         "with output_lock(sys.argv[1], what='training'):\n    print('held', flush=True)\n    time.sleep(60)\n", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert train_cli(out, steps=3) == 2
        one_error(capsys, str(out), f"pid {holder.pid}", "training")
    finally:
        holder.kill()
        holder.wait()
    assert files(out) == before


def test_a_killed_trainings_folder_is_free_at_once_while_its_workers_live_on(tmp_path):
    """SIGKILL ends the holder, not its forked children (data-loader workers notice seconds later): they hold no
    copy of the lock, so the next training takes the folder at once."""
    from medddpm.store.lock import output_lock

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nfrom medddpm.store.lock import output_lock\n"
         "with output_lock(sys.argv[1], what='training'):\n    r, w = os.pipe()\n    if os.fork() == 0:\n"
         "        os.write(w, b'x')\n        time.sleep(30)\n        os._exit(0)\n"
         "    os.read(r, 1)  # the child runs: its fork hook has run\n    print('held', flush=True)\n"
         "    time.sleep(60)\n", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with output_lock(out, what="training"):
            pass
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the orphaned child, in the holder's own session


# ------------------------------------------------------------------------ kill and resume


@pytest.mark.slow
def test_a_training_killed_after_a_checkpoint_resumes_bit_exact(tmp_path):
    """SIGKILL once the first checkpoint is on disk; the resumed run ends as an uninterrupted one."""
    argv = [sys.executable, "-m", "medddpm", "train", "--steps", "6", "--save-every", "2", *TINY]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    run = subprocess.Popen(argv + ["--out", str(cut)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (cut / checkpoint.CHECKPOINT).exists() and run.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    run.wait()
    cut_at = torch.load(cut / checkpoint.CHECKPOINT, weights_only=True)["step"]
    # the resumed run and the uninterrupted one, one after the other in one process of their own (a Python process
    # importing torch costs 8-13 CPU seconds), as clean as the killed one
    both = ("import sys\nfrom medddpm.cli.main import main\n"
            "for out in sys.argv[1:3]:\n    assert main(sys.argv[3:] + ['--out', out]) == 0\n")
    subprocess.run([sys.executable, "-c", both, str(cut), str(whole), *argv[3:]], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    a, b = (torch.load(d / checkpoint.CHECKPOINT, weights_only=True) for d in (cut, whole))
    assert 2 <= cut_at < 6 and a["step"] == b["step"] == 6, cut_at
    for part in ("model", "ema"):
        flat = (lambda s: s.values()) if part == "model" else (lambda s: s["params"])
        assert all(torch.equal(x, y) for x, y in zip(flat(a[part]), flat(b[part])))
    assert loop.read_loss_log(cut) == loop.read_loss_log(whole)
    assert json.dumps(a["opt"]["param_groups"]) == json.dumps(b["opt"]["param_groups"])
