"""Two CPU ranks (gloo, loopback only) train data-parallel and agree with one process."""

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from medddpm.train.engine import Engine
from medddpm.model.unet import ModelSpec
from medddpm.train.loop import read_loss_log, train

from conftest import Pairs, random_batch

WORLD, ACCUM, STEPS, LR = 2, 2, 3, 1e-3
SPEC = dict(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))  # small_spec


def _micro(spec, step, micro):
    """Global micro-batch `micro` of step `step`, with its own timestep and noise: identical in any run."""
    x0, cond = random_batch(spec, seed=step * 100 + micro)
    g = torch.Generator().manual_seed(10_000 + step * 100 + micro)
    return x0, cond, torch.randint(0, 250, (1,), generator=g), torch.randn(x0.shape, generator=g)


def _record_grads(engine):
    """Keep the (all-reduced) gradients each optimizer step sees."""
    grads, real = [], engine.opt.step

    def step(*a, **kw):
        grads.append([p.grad.detach().clone() for p in engine.model.parameters()])
        return real(*a, **kw)

    engine.opt.step = step
    return grads


def _worker(rank, port, out):
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    from medddpm.train import distributed

    r, world, _, device = distributed.init_from_env()
    assert (r, world, device.type) == (rank, WORLD, "cpu") and distributed.is_main() == (rank == 0)
    try:
        spec = ModelSpec(**SPEC)
        # (1) the engine, with fixed (x0, cond, t, noise): rank r takes micro-batches r*ACCUM .. r*ACCUM+ACCUM-1
        engine = Engine(spec, "baseline", lr=LR, ddp=True)
        grads = _record_grads(engine)
        losses = []
        for step in range(STEPS):
            batches = [_micro(spec, step, rank * ACCUM + m) for m in range(ACCUM)]
            losses.append(engine.step(batches))
        torch.save({"weights": [p.detach() for p in engine.model.parameters()],
                    "ema": engine.ema.params, "loss": torch.stack(losses),
                    "grads": grads}, f"{out}/engine{rank}.pt")
        # (2) the trainer: sharded data, rank 0 alone writes
        trained = train(spec, "baseline", Pairs(spec), out_dir=f"{out}/run", steps=2, grad_accum=1, lr=LR,
                        log_every=1, progress=False, ddp=True)
        torch.save([p.detach() for p in trained.model.parameters()], f"{out}/train{rank}.pt")
        # (3) a folder another training holds (the test's process): rank 0 alone takes its lock, and every rank
        # stops with its message instead of waiting at a collective for rank 0
        try:
            train(spec, "baseline", Pairs(spec), out_dir=f"{out}/held", steps=1, grad_accum=1, lr=LR, progress=False,
                  ddp=True)
        except ValueError as e:
            Path(out, f"refused{rank}").write_text(str(e))
    finally:
        distributed.cleanup()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(small_spec, tmp_path):
    """Two ranks' engine steps and training agree with one process's; then, with the folder held by another
    training, every rank stops with its message (none waits at a collective for rank 0)."""
    from medddpm.store.lock import output_lock

    assert small_spec == ModelSpec(**SPEC)
    with output_lock(tmp_path / "held", what="training"):
        ctx = mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
        try:
            deadline = time.monotonic() + 900
            while not ctx.join(timeout=5):
                assert time.monotonic() < deadline, "a rank still waits"
        finally:
            for p in ctx.processes:
                p.kill()
    for rank in range(WORLD):
        assert "is in use by training" in (tmp_path / f"refused{rank}").read_text()

    ranks = [torch.load(tmp_path / f"engine{r}.pt") for r in range(WORLD)]
    # (a) DDP keeps the replicas bit-identical: the same all-reduced gradient, the same Adam step.
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)
    for a, b in zip(ranks[0]["ema"], ranks[1]["ema"]):
        assert torch.equal(a, b)

    # (b) one process over the global batch (WORLD x ACCUM micro-batches) computes the same gradients
    # and weights, up to float summation order: DDP sums each rank's (sum of ACCUM grads / ACCUM) and
    # divides by WORLD, one process sums all WORLD x ACCUM grads / (WORLD x ACCUM).
    single = Engine(small_spec, "baseline", lr=LR)
    single_grads = _record_grads(single)
    start = [p.detach().clone() for p in single.model.parameters()]
    single_losses = []
    for step in range(STEPS):
        single_losses.append(single.step([_micro(small_spec, step, m) for m in range(WORLD * ACCUM)]))
    for step in range(STEPS):
        # atol: rounding noise on the scale of the step's largest gradient (some gradients are ~0
        # exactly, e.g. biases ahead of a GroupNorm, and hold nothing but rounding noise).
        scale = max(g.abs().max().item() for g in single_grads[step])
        for a, b in zip(ranks[0]["grads"][step], single_grads[step]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)
    # Adam divides each gradient by its running RMS, so where a gradient holds little but rounding
    # noise (|g| ~ eps, or a sign that flips between steps) a rounding-level difference moves that
    # element's update by a visible fraction of lr. Weights: all within 10% of lr, 99.9% within 0.1% of it.
    moved, loose = 0.0, 0
    for a, b, s0 in zip(ranks[0]["weights"], single.model.parameters(), start):
        b = b.detach()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.1 * LR)
        loose += int(((a - b).abs() > 1e-3 * LR).sum())
        moved = max(moved, (b - s0).abs().max().item())
    n = sum(p.numel() for p in start)
    assert loose <= 1e-3 * n, f"{loose} of {n} weights differ by more than 0.1% of lr"
    assert moved > 0.5 * LR, "training must move the weights well beyond the tolerance"
    # The global loss is the mean of the ranks' losses.
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, torch.stack(single_losses),
                               rtol=1e-5, atol=1e-7)

    # Trainer: replicas equal, one checkpoint and log written by rank 0, per-rank step times recorded.
    for a, b in zip(torch.load(tmp_path / "train0.pt"), torch.load(tmp_path / "train1.pt")):
        assert torch.equal(a, b)
    run = tmp_path / "run"
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and state["world_size"] == WORLD
    assert [r["step"] for r in read_loss_log(run)] == [1, 2]
    rows = [json.loads(line) for line in (run / "ranks.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rank"], r["world_size"]) for r in rows] == [(1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    assert all(r["step_ms"] > 0 for r in rows)
    assert not list(run.glob("*.tmp"))


@pytest.mark.slow
def test_torchrun_entry_point_and_world_size_on_resume(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from medddpm.train.data import open_dataset

    torchrun = Path(sys.executable).with_name("torchrun")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "medddpm.cli.distributed", "--steps", "2", "--log-every", "1", "--out", str(tmp_path),
           "--size", "16", "--base-channels", "32", "--pairs", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 2 steps on 2 ranks (gloo)" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # The data shards depend on the world size: a single process must not continue this run.
    data = open_dataset("mni", size=16, n=2)
    spec = ModelSpec(size=16, mask_channels=data.mask_channels, base_channels=32)
    with pytest.raises(ValueError, match="written by 2 ranks"):
        train(spec, "baseline", data, out_dir=tmp_path, steps=3, grad_accum=1, progress=False)


def test_ddp_refuses_cuda_graphs_and_a_missing_process_group(tiny_spec):
    import dataclasses

    import pytest

    engine = Engine(tiny_spec, "baseline", ema=False)
    with pytest.raises(RuntimeError, match="initialised process group"):
        engine.wrap_ddp()
    engine.run = dataclasses.replace(engine.run, cuda_graphs=True)  # as "graphs" resolves on a GPU
    with pytest.raises(ValueError, match="CUDA graphs are not supported with DDP"):
        engine.wrap_ddp()
