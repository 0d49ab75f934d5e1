"""best against its new levers in one process: every variant compiled once, then blocks of steps interleaved.

    python lab/leases/tools/levers.py --variants best,best+tap_major=true,... --out runs/levers-data --deadline 540

Phases, in order of what the decision needs (each skipped where OUT already holds it, so a second call resumes):
  train    every variant's training engine built and warmed up (compiled, or loaded from Inductor's cache; CUDA
           graph captured), then ROUNDS rounds of one block of STEPS micro-steps per variant, in the variants'
           order (best, A, B, best, A, B, ...): OUT/<label>/levers/repeats.parquet, phase train. At most GROUP
           engines are alive at once: more variants are interleaved in groups, each with the base.
  kernels  two more micro-steps of each variant under torch.profiler: OUT/<label>/levers/<config>/kernels.parquet.
  sample   the same interleaving for the denoising step (a sampler engine per variant, batch 1): phase sample.
  quality  each variant's quality phase against strict FP32 (as a sweep's, `Measurement.quality`; the strict-FP32
           side computed once): OUT/<label>/levers/<config>/quality.parquet.
  batches  seconds per volume over batch sizes (--batch-configs, the base by default):
           OUT/<label>/levers/sample_batches.parquet.
A phase starts only with its estimated time left before --deadline (seconds since this process started); a
variant that fails or runs out of memory is recorded on stderr and left out, the others go on. The base (the first
variant) is in every interleaved call: a variant is judged against the base blocks beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from medddpm.configs import get_config
from medddpm.measure.env import environment, gpu_slug, pick_device
from medddpm.measure.run import Measurement
from medddpm.measure.timing.sampling import parse_batches, sample_batches, write_sample_batches
from medddpm.presets import get_preset
from medddpm.store import schema
from medddpm.store.layout import levers_table
from medddpm.train.data import real_batch
from medddpm.train.engine import Engine
from medddpm.train.profiling import profile_kernels
from medddpm.train.timing import summarize, time_steps

T0 = time.perf_counter()


def left(args) -> float:
    return args.deadline - (time.perf_counter() - T0)


def say(*parts) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s]", *parts, flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def read(path: Path, table: str) -> pd.DataFrame:
    return schema.read_table(path, table) if path.is_file() else schema.empty(table)


def append(path: Path, table: str, rows: pd.DataFrame) -> None:
    """Add rows to a table, atomically and checked (a killed call keeps every block written before)."""
    old = read(path, table)
    schema.write_table(pd.concat([old, rows], ignore_index=True) if len(old) else rows, path, table)


class Call:
    """What every row of this process shares."""

    def __init__(self, args):
        self.device = pick_device(args.device)
        self.env = environment(self.device)
        self.label = gpu_slug(args.gpu_label or self.env["gpu_name"])
        self.start = dt.datetime.now(dt.timezone.utc)
        self.id = f"{self.label}/levers/{self.start.strftime('%Y%m%dT%H%M%SZ')}"
        self.preset = get_preset(args.preset)
        self.spec = self.preset.spec(mask_channels=args.mask_channels)
        self.out = Path(args.out)
        self.position = 0

    def table(self, table: str, config: str | None = None) -> Path:
        return levers_table(self.out, self.label, table, config)

    def block_row(self, config: str, phase: str, repeat: int, step_ms: list[float], engine_info: dict) -> dict:
        s = summarize(step_ms)
        row = {"call_id": self.id, "gpu_slug": self.label, "gpu_name": self.env["gpu_name"], "config": config,
               "phase": phase, "batch": 1, "size": max(self.spec.shape), "position": self.position, "repeat": repeat,
               "steps": len(step_ms), "block_ms": s["median"], "block_p10_ms": s["p10"], "block_p90_ms": s["p90"],
               **engine_info, "git_commit": self.env["git_commit"], "torch": self.env["torch"],
               "cudnn": self.env["cudnn"], "start_time": self.start.isoformat(timespec="seconds")}
        self.position += 1
        return row


def measured(call: Call, phase: str, variants: list[str], rounds: int) -> list[str]:
    """The variants with `rounds` blocks of `phase` in one earlier call that also timed the base."""
    rep = read(call.table("repeats"), "repeats")
    rep = rep[(rep["phase"] == phase) & (rep["size"] == max(call.spec.shape))]
    done = set()
    for _, g in rep.groupby("call_id"):
        n = g.groupby("config").size()
        if n.get(variants[0], 0) >= rounds:
            done |= {c for c, k in n.items() if k >= rounds}
    return [v for v in variants if v in done]


def build(call: Call, config: str, make) -> tuple[object, dict] | None:
    """An engine for `config` warmed up by `make` (which returns the engine and its step); its first step's wall
    time and its own peak memory (what was allocated beyond the engines built before it). None if it fails."""
    cuda = call.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        t = time.perf_counter()
        engine, step = make()
        step()
        if cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t
        for _ in range(2):  # a CUDA graph is captured on the first step; cuDNN settles
            step()
        peak = max(torch.cuda.max_memory_allocated(), engine.capture_peak_bytes or 0) - before if cuda else -1
        say(f"{config}: first step {first:.1f} s" + (f", peak {peak / 2**30:.2f} GiB" if cuda else ""))
        return (engine, step), {"peak_mem_bytes": int(peak), "first_step_s": first}
    except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
        traceback.print_exc()
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        say(f"{config}: left out ({type(e).__name__}: {why})")
        free()
        return None


def interleave(call: Call, phase: str, built: dict, rounds: int, steps: int, args) -> None:
    """ROUNDS rounds of one block per variant, in order; each block's row is written as the round ends."""
    say(f"{phase}: {rounds} rounds of {steps} steps over {len(built)} variants")
    for r in range(rounds):
        if left(args) < 2 * max(info.get("block_s", 1) for _, info in built.values()) * len(built):
            say(f"{phase}: deadline near, stopped after {r} rounds")
            return
        rows = []
        for config, ((engine, step), info) in built.items():
            engine.activate()
            res = time_steps(step, device=call.device, warmup=1, steps=steps, progress=False)
            info["block_s"] = res["wall_ms"] / 1e3
            rows.append(call.block_row(config, phase, r, res["step_ms"], {k: info[k] for k in ("peak_mem_bytes",
                                                                                              "first_step_s")}))
        append(call.table("repeats"), "repeats", pd.DataFrame(rows))
        say(f"{phase} round {r}: " + ", ".join(f"{x['config']} {x['block_ms']:.2f}" for x in rows))


def makers(call: Call, phase: str):
    """config -> a function that builds its engine and returns it with one step of `phase` (a training micro-step,
    or a denoising step at the middle of the schedule, batch 1)."""
    image, cond = real_batch(call.spec, seed=0)

    def train(config):
        engine = Engine(call.spec, config, device=call.device, seed=0, ema=False)
        x0, c = engine.prepare(image), engine.prepare(cond)
        return engine, lambda: engine.step((x0, c))

    def sample(config):
        engine = Engine(call.spec, config, device=call.device, seed=0, ema=False)
        engine.model.eval()
        c = engine.prepare(cond)
        g = torch.Generator(call.device).manual_seed(0)
        x, noise = (torch.randn((1, call.spec.image_channels, *call.spec.shape), device=call.device, generator=g)
                    for _ in range(2))
        t = torch.full((1,), engine.diffusion.timesteps // 2, device=call.device, dtype=torch.long)
        return engine, lambda: engine.denoise_step(x, c, t, noise)

    return {"train": train, "sample": sample}[phase]


def in_groups(call: Call, phase: str, names: list[str], args, *, interleaved: bool = True, after=None) -> None:
    """The base (names[0]) and the others, at most --group engines alive at once (each holds its step's memory, a
    CUDA graph's pool among it): per group, each engine built and warmed up, the group interleaved, then `after`
    (the kernel tables) on the group's engines, which are then freed."""
    make = makers(call, phase)
    base, rest = names[0], names[1:]
    size = max(1, args.group - 1)
    for chunk in [rest[i:i + size] for i in range(0, len(rest), size)] or [[]]:
        built = {}
        for config in [base, *chunk]:
            if left(args) < args.build_s:
                say(f"{phase}: no time left to build {config}")
                break
            got = build(call, config, lambda config=config: make(config))
            if got is not None:
                built[config] = got
        if interleaved and base in built and len(built) > 1:
            interleave(call, phase, built, args.rounds, args.steps if phase == "train" else args.sample_steps, args)
        if after is not None:
            after(call, built, args)
        built.clear()
        free()


def kernels_phase(call: Call, built: dict, args) -> None:
    for config, ((engine, step), _) in built.items():
        path = call.table("kernels", config)
        if path.is_file() or left(args) < 30:
            continue
        engine.activate()
        k = profile_kernels(step, device=call.device, steps=2, warmup=1)
        run_id = f"{call.label}/levers/{config}/{call.start.strftime('%Y%m%dT%H%M%SZ')}"
        schema.write_table(k.assign(run_id=run_id), path, "kernels")
        say(f"kernels {config}: {k['total_us'].sum() / 2e3:.2f} ms a micro-step")


def quality_phase(call: Call, variants: list[str], args) -> None:
    """Each variant's quality phase, as a sweep runs it: the same weights, data, timesteps and noise under the
    variant and under strict FP32 (computed once, then reused from the sweep's cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        for config in variants:
            path = call.table("quality", config)
            if path.is_file():
                continue
            if left(args) < args.build_s * 1.5:
                say(f"quality: no time left for {config}")
                return
            m = Measurement(config, args.preset, device=str(call.device), size=call.preset.size, pairs=4,
                            out=tmp, stage=f"{tmp}/{len(list(Path(tmp).iterdir()))}", phases=("quality",),
                            mask_channels=args.mask_channels)
            q = m.quality()
            if q is None or m.status != "ok":
                say(f"quality {config}: {m.status} {m.message}")
                continue
            run_id = f"{call.label}/levers/{config}/{call.start.strftime('%Y%m%dT%H%M%SZ')}"
            schema.write_table(q.assign(run_id=run_id), path, "quality")
            loss = (q["loss"] - q["baseline_loss"]).abs().mean() / q["baseline_loss"].abs().mean()
            say(f"quality {config}: forward error {q['rel_err'].iloc[0]:.2e}, mean loss difference {loss:.2e}")
            free()


def batches_phase(call: Call, configs: list[str], batches: list[int], args) -> None:
    path = call.table("sample_batches")
    for config in configs:
        if batches_done(call, config, batches):
            continue
        if left(args) < args.build_s * len(batches) / 2:
            say(f"batches: no time left for {config}")
            return
        rows = sample_batches(call.spec, config, batches, device=call.device, warmup=2, steps=args.sample_steps,
                              label=call.label, call_id=call.id)
        write_sample_batches(path, rows)
        say(f"batches {config}: " + ", ".join(f"b{r.batch} {r.volume_s:.2f} s/volume" if r.status == "ok"
                                              else f"b{r.batch} {r.status}" for r in rows.itertuples()))
        free()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", required=True, help="comma-separated configurations, the base first")
    p.add_argument("--preset", default="paper", help="the model (paper: 128^3; smoke: 16^3, for the CPU)")
    p.add_argument("--mask-channels", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (blocks per variant)")
    p.add_argument("--steps", type=int, default=15, help="timed micro-steps a training block")
    p.add_argument("--sample-steps", type=int, default=15, help="timed denoising steps a sampling block")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes of the batches phase")
    p.add_argument("--batch-configs", default="", help="configurations of the batches phase (default: the base)")
    p.add_argument("--phases", default="train,kernels,sample,quality,batches")
    p.add_argument("--device", default=None)
    p.add_argument("--gpu-label", default=None, help="the label under OUT (default: the device type)")
    p.add_argument("--out", default="runs/levers-data", help="a data tree: OUT/<label>/levers/")
    p.add_argument("--deadline", type=float, default=540, help="seconds this process may take")
    p.add_argument("--build-s", type=float, default=40, help="seconds a variant's engine takes to build, at most")
    p.add_argument("--group", type=int, default=4, help="engines alive at once, the base's among them")
    args = p.parse_args(argv)
    variants = [get_config(v.strip()).name for v in args.variants.split(",") if v.strip()]  # checked first
    batches = parse_batches(args.batches)
    phases = args.phases.split(",")
    import torch._dynamo.config as dynamo

    # every variant's training and sampling graphs, and a sampling graph per batch, compile one forward: more
    # than Dynamo's default of 8 recompilations of one frame, after which it would run the frame eagerly
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, 64)
    call = Call(args)
    say(f"call {call.id}: {', '.join(variants)} on {call.env['gpu_name']}, {args.preset}, "
        f"{args.deadline:.0f} s")
    if "train" in phases or "kernels" in phases:
        todo = [v for v in variants[1:] if v not in measured(call, "train", variants, args.rounds)] \
            if "train" in phases else []
        names = variants[:1] + todo if todo else []
        if "kernels" in phases:
            names += [v for v in variants if v not in names and not call.table("kernels", v).is_file()]
        if not todo:
            say("train: measured in an earlier call")
        if names:
            in_groups(call, "train", names, args, interleaved=bool(todo),
                      after=kernels_phase if "kernels" in phases else None)
    if "sample" in phases:
        todo = [v for v in variants[1:] if v not in measured(call, "sample", variants, args.rounds)]
        if todo:
            in_groups(call, "sample", variants[:1] + todo, args)
        else:
            say("sample: measured in an earlier call")
    if "quality" in phases:
        quality_phase(call, variants, args)
    if "batches" in phases:
        batches_phase(call, batch_configs(variants, args), batches, args)
    owed = still_owed(call, variants, phases, batches, args)
    say(f"done, {left(args):.0f} s left; " + (f"still owed (a second call resumes): {', '.join(owed)}" if owed
                                              else "nothing owed"))
    return 3 if owed else 0


def still_owed(call: Call, variants: list[str], phases: list[str], batches: list[int], args) -> list[str]:
    """What a later call would still measure: the phases (and variants) this one did not finish."""
    owed = []
    for phase in ("train", "sample"):
        if phase in phases and set(variants) - set(measured(call, phase, variants, args.rounds)) - {variants[0]}:
            owed.append(phase)
    owed += [f"{t} {v}" for t in ("kernels", "quality") if t in phases for v in variants
             if not call.table(t, v).is_file()]
    if "batches" in phases:
        owed += [f"batches {c}" for c in batch_configs(variants, args) if not batches_done(call, c, batches)]
    return owed


def batches_done(call: Call, config: str, batches: list[int]) -> bool:
    """Every batch measured for `config` at this size, or one that did not fit (larger ones are not tried)."""
    done = read(call.table("sample_batches"), "sample_batches")
    mine = done[(done["size"] == max(call.spec.shape)) & (done["config"] == config)]
    return set(batches) <= set(mine.loc[mine["status"] == "ok", "batch"]) or bool((mine["status"] == "oom").any())


def batch_configs(variants: list[str], args) -> list[str]:
    """The batches phase's configurations: --batch-configs, else the base (the sampling lever the default also took,
    `condition_once`, left the product on 2026-12-07: lab/notebook/retired-levers.md)."""
    return [c.strip() for c in args.batch_configs.split(",") if c.strip()] or [variants[0]]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
