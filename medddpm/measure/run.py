"""Measure one (device, configuration, preset): timing, sampling, kernels, counters, quality.

The producer notebook (notebooks/produce.ipynb) drives a `Measurement` phase by phase; each phase
writes its table at once (atomically), and `finish()` writes `run.parquet` last. A phase that runs
out of memory or fails is recorded with its status and message, and the phases after it are
skipped: nothing is left half-written and nothing is silently missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import re
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from medddpm.store import schema
from medddpm.store.layout import NCU_REPORTS, QUALITY_CACHE, RUN_FILE, run_folder, run_table
from medddpm.store.schema import PHASES
from medddpm.measure.timing.bench import sample_step_summary, train_summary
from medddpm.configs import Config, get_config
from medddpm.presets import REFERENCE_ACCUM, REFERENCE_STEPS, Preset, get_preset
from medddpm.train.data import EMBEDDED, open_dataset
from medddpm.measure.timing.clocks import ClockMonitor
from medddpm.measure.timing.end_to_end import drift, loader_rate, time_end_to_end
from medddpm.train.engine import Engine
from medddpm.measure.env import compile_cache_counts, environment, gpu_slug, host_name, pick_device
from medddpm.model.flops import count
from medddpm.model.unet import ModelSpec, format_size, parse_size
from medddpm.store.storage import atomic_write
from medddpm.train.timing import StepTimer, summarize, time_steps


def _check(name: str, value, kind: type, *, minimum: int | None = None) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"parameter {name} must be {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"parameter {name} must be >= {minimum}, got {value!r}")


def randomize_(model: torch.nn.Module, *, seed: int, std: float = 0.02) -> None:
    """Fill the zero-initialised output layers too, so that a forward pass carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * std)


FINISH_S = 15  # what a run needs after Nsight Compute: run.parquet, the notebook, the move into place
NCU_MIN_S = 90  # less is not worth starting: the profiled program builds the model and warms up first


class Measurement:
    def __init__(self, config: str | Config, preset: str = "smoke", *, device: str | None = None,
                 gpu_label: str | None = None, size: int | str | tuple | None = None, data: str | None = None,
                 pairs: int = 16, batch: int = 1,
                 micro_steps: int | None = None, warmup: int | None = None, sample_steps: int | None = None,
                 out: str = "data",
                 stage: str | None = None, seed: int = 0, phases: tuple[str, ...] = PHASES, group: str = "",
                 ncu_timeout: int = 420, time_limit: int | None = None, mask_channels: int | None = None,
                 resample_mask: bool = False):
        # Every parameter is checked here, before any GPU work.
        self.config = get_config(config)
        self.preset = get_preset(preset)
        if mask_channels is not None:
            _check("mask_channels", mask_channels, int, minimum=1)
        for name, value, minimum in (("pairs", pairs, 1), ("batch", batch, 1), ("seed", seed, 0)):
            _check(name, value, int, minimum=minimum)
        if micro_steps is not None:
            _check("micro_steps", micro_steps, int, minimum=1)
        if size is not None:
            size = parse_size(size)
            if min(ModelSpec(size=size).shape) < 8:
                raise ValueError(f"parameter size must be at least 8 voxels a side, got {size!r}")
            self.preset = dataclasses.replace(self.preset, size=size)
        if warmup is not None:
            _check("warmup", warmup, int, minimum=0)
        if sample_steps is not None:  # the first denoising step is untimed: two at least
            _check("sample_steps", sample_steps, int, minimum=2)
        _check("ncu_timeout", ncu_timeout, int, minimum=1)
        if time_limit is not None:
            _check("time_limit", time_limit, int, minimum=1)
        self.ncu_timeout, self.time_limit = ncu_timeout, time_limit
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)} (training always runs)")
        if group and not re.fullmatch(r"[a-z][a-z0-9-]*", group):
            raise ValueError(f"parameter group must be a lower-case folder name, got {group!r}")
        self.device = pick_device(device)
        self.micro_steps = micro_steps or self.preset.micro_steps
        self.warmup = self.preset.warmup if warmup is None else warmup
        self.sample_steps = sample_steps or self.preset.sample_steps
        self.batch, self.seed, self.phases = batch, seed, tuple(phases)
        data = self.preset.data if data is None else data  # an empty name is refused by open_dataset
        self.data = open_dataset(data, size=self.preset.size, n=pairs, seed=seed, resample_mask=resample_mask)
        # another width than the data's own label channels (2 on the 3-tissue MNI data): a variant of its own
        self.mask_variant = mask_channels if mask_channels not in (None, self.data.mask_channels) else None
        if self.mask_variant is not None:
            self.data = open_dataset(data, size=self.preset.size, n=pairs, seed=seed, mask_channels=mask_channels,
                                     resample_mask=resample_mask)
        self.data_id = f"{data}{pairs}" if data in EMBEDDED else re.sub(r"[^A-Za-z0-9]+", "_", str(Path(data).resolve()))
        self.data_id += f"-m{self.mask_variant}" if self.mask_variant is not None else ""
        self.spec = self.preset.spec(mask_channels=self.data.mask_channels,
                                     image_channels=getattr(self.data, "image_channels", 1))
        info = count(self.spec)  # meta device: no memory, no GPU work
        self.summary: dict = {"parameters": info["parameters"], "forward_flops": float(info["forward_flops"]),
                              "flops_per_step": float(info["train_flops"])}
        self.data_source = data if data in EMBEDDED else f"folder:{Path(data).resolve().name}"
        self.summary |= {"data_source": self.data_source,
                         "cache_build_s": getattr(self.data, "cache_build_s", math.nan)}
        self.env = environment(self.device)
        self.gpu_name = self.env["gpu_name"]  # the device's own name; the label names its folder only
        self.slug = gpu_slug(gpu_label or self.gpu_name)
        self.folder = run_folder(self.config.name, self.preset.name, batch, self.mask_variant)
        self.group = group
        self.final_dir = Path(out) / self.slug / group / self.folder
        self.dir = Path(stage) if stage else self.final_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start = dt.datetime.now(dt.timezone.utc)
        self.run_id = f"{self.slug}/{group + '/' if group else ''}{self.folder}/{self.start.strftime('%Y%m%dT%H%M%SZ')}"
        self.status, self.message = "ok", ""
        self.profiler_status: dict = {}
        self.tables: dict[str, pd.DataFrame] = {}
        self._t0 = time.perf_counter()

    # --------------------------------------------------------------------------------- plumbing

    @contextlib.contextmanager
    def phase(self, name: str, *, critical: bool = True):
        """Run a phase unless an earlier one failed; record out-of-memory and errors, don't raise.

        A critical phase's failure becomes the run's status; a profiler's (critical=False) is recorded
        in `profilers` and leaves the timings standing. A phase left out of `phases` is recorded as
        not requested."""
        if name != "train" and name not in self.phases:
            self.profiler_status[name] = {"status": "skipped", "message": "not requested"}
            yield False
            return
        if self.status != "ok":
            self.profiler_status.setdefault(name, {"status": "skipped", "message": f"after {self.status}"})
            yield False
            return
        try:
            yield True
        except Exception as e:  # noqa: BLE001 - recorded in run.parquet, the sweep goes on
            status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
            message = f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            traceback.print_exc()
            if critical:
                self.status, self.message = status, message
            else:
                self.profiler_status[name] = {"status": status, "message": message}
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _write(self, table: str, df: pd.DataFrame) -> pd.DataFrame:
        df = df.assign(run_id=self.run_id)
        schema.write_table(df, run_table(self.dir, table), table)
        self.tables[table] = df
        return df

    def _batch(self, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.data[(offset + i) % len(self.data)] for i in range(self.batch)]
        return torch.stack([x for x, _ in items]), torch.stack([c for _, c in items])

    def _engine(self, config: Config | None = None, *, ema: bool = False) -> Engine:
        return Engine(self.spec, config or self.config, device=self.device, seed=self.seed, ema=ema)

    def _peaks(self) -> tuple[int, int]:
        if self.device.type != "cuda":
            return -1, -1
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def _device_memory(self) -> tuple[int, int]:
        """(total, in use outside PyTorch's allocator): what a card must hold beside the allocator's own."""
        if self.device.type != "cuda":
            return -1, -1
        free, total = torch.cuda.mem_get_info(self.device)
        return total, max(0, total - free - torch.cuda.memory_reserved(self.device))

    # ----------------------------------------------------------------------------------- phases

    def train(self) -> pd.DataFrame | None:
        """Warm-up, then timed micro-steps (forward + backward + Adam), no profiler attached."""
        with self.phase("train") as go:
            if not go:
                return None
            cache_before = compile_cache_counts()
            engine = self._engine()
            self.summary["not_applicable"] = engine.run.not_applicable
            self.summary["backend_flags"] = engine.backend_flags
            self.summary["precision_used"] = engine.run.precision
            x0, cond = (engine.prepare(t) for t in self._batch())
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            losses = []
            clocks = ClockMonitor(self.device)
            with Energy(self.device) as energy:
                timing = time_steps(lambda: losses.append(engine.step((x0, cond))), device=self.device,
                                    warmup=self.warmup, steps=self.micro_steps, desc=f"train {self.config.name}",
                                    on_timed_start=lambda: (energy.start(), clocks.start()))
            clocks.stop()
            self.summary["compile_cache"] = dict(compile_cache_counts() - cache_before)
            peak, reserved = self._peaks()
            if engine.capture_peak_bytes is not None:  # CUDA graph: its memory was allocated at capture
                peak = max(peak, engine.capture_peak_bytes)
            total, other = self._device_memory()
            loss = torch.stack(losses).float().cpu().tolist()
            n_warm = len(timing["warmup_ms"])
            rows = pd.DataFrame({
                "phase": "train", "micro_step": range(n_warm + len(timing["step_ms"])),
                "timed": [False] * n_warm + [True] * len(timing["step_ms"]),
                "step_ms": timing["warmup_ms"] + timing["step_ms"],
                "dispatch_ms": [math.nan] * n_warm + timing["dispatch_ms"],
                "loss": loss, "peak_mem_bytes": peak,
            })
            train = train_summary(timing["step_ms"])
            median_s = train["train_median_ms"] / 1e3
            voxels = self.batch * self.spec.voxels
            self.summary |= {
                "warmup_s": sum(timing["warmup_ms"]) / 1e3, "first_step_s": (timing["warmup_ms"] or [math.nan])[0] / 1e3,
                **train,
                "dispatch_median_ms": summarize(timing["dispatch_ms"])["median"],
                "achieved_tflops": self.summary["flops_per_step"] * self.batch / median_s / 1e12,
                "voxels_per_s": voxels / median_s, "samples_per_s": self.batch / median_s,
                "peak_mem_bytes": peak, "peak_reserved_bytes": reserved, "skipped_steps": engine.skipped_steps,
                "gpu_total_bytes": total, "gpu_other_bytes": other,
                "epoch_size": len(self.data), "epoch_s": len(self.data) / self.batch * median_s,
                "gpu_hours_100k": REFERENCE_STEPS * REFERENCE_ACCUM * median_s / 3600,
                "mean_power_w": energy.mean_power_w(timing["wall_ms"] / 1e3),
                "energy_per_step_j": energy.joules / len(timing["step_ms"]) if energy.joules is not None else math.nan,
            }
            self.summary["energy_100k_kwh"] = self.summary["energy_per_step_j"] * REFERENCE_STEPS * REFERENCE_ACCUM / 3.6e6
            if self.data_source.startswith("folder:") and self.batch == 1:  # the step as a user trains on files
                e2e = time_end_to_end(engine, self.data, warmup=max(self.warmup, 2), steps=self.micro_steps, seed=self.seed,
                                      desc=f"end to end {self.config.name}", on_timed_start=clocks.start)
                clocks.stop()
                self.summary |= {"e2e_median_ms": summarize(e2e["step_ms"])["median"], "e2e_drift": drift(e2e["step_ms"]),
                                 "loader_items_per_s": loader_rate(self.data, device=self.device, seed=self.seed,
                                                                   items=max(8, min(self.micro_steps, 4 * len(self.data))))}
            self.summary |= clocks.summary()
            del engine
            self._steps = rows
            return self._write("steps", rows)

    def sample(self) -> pd.DataFrame | None:
        """One ancestral sample (the preset's T denoising steps, or `sample_steps`; a full one is the
        schedule's 250 times the median step), each step between device events."""
        with self.phase("sample") as go:
            if not go:
                return None
            engine = Engine(self.spec, self.config, device=self.device, seed=self.seed, ema=False,
                            timesteps=self.sample_steps)
            engine.model.eval()
            _, cond = self._batch()
            cond = engine.prepare(cond)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            timer = StepTimer(self.device)

            def step_done(i):  # after each denoising step; i counts down to 0, the last
                timer.stop()
                if i > 0:
                    timer.start()

            t0 = time.perf_counter()
            timer.start()
            engine.sample(cond, image_channels=self.spec.image_channels,  # no_grad: GaussianDiffusion.sample
                          generator=torch.Generator(self.device).manual_seed(0), step_callback=step_done)
            times, _ = timer.read()
            total_s = time.perf_counter() - t0
            peak, _ = self._peaks()
            # The first denoising step carries compilation and autotuning: it counts in the total
            # (a user waits for it) but is marked untimed, like a warm-up step.
            rows = pd.DataFrame({"phase": "sample", "micro_step": range(len(times)), "timed": [i > 0 for i in range(len(times))],
                                 "step_ms": times, "dispatch_ms": math.nan, "loss": math.nan, "peak_mem_bytes": peak})
            self.summary |= {"sample_steps": len(times),
                             "sample_step_median_ms": sample_step_summary(times[1:] or times)["sample_step_median_ms"],
                             "sample_total_s": total_s, "sample_peak_mem_bytes": peak}
            del engine
            return self._write("steps", pd.concat([self._steps, rows], ignore_index=True))

    def kernels(self) -> pd.DataFrame | None:
        """torch.profiler over a few steps (separate from the timed steps)."""
        from medddpm.train.profiling import profile_kernels

        with self.phase("torch", critical=False) as go:
            if not go:
                return None
            engine = self._engine()
            x0, cond = (engine.prepare(t) for t in self._batch())
            df = profile_kernels(lambda: engine.step((x0, cond)), device=self.device,
                                 steps=self.preset.profile_steps, warmup=max(1, min(self.warmup, 3)))
            del engine
            self.profiler_status["torch"] = {"status": "ok", "message": f"{len(df)} kernel rows"}
            return self._write("kernels", df)

    def ncu_budget(self) -> int:
        """Seconds Nsight Compute may take: `ncu_timeout`, or less under a `time_limit` for the whole run,
        of which it gets what the earlier phases left (it runs last, after quality)."""
        if self.time_limit is None:
            return self.ncu_timeout
        left = self.time_limit - (time.perf_counter() - self._t0) - FINISH_S
        return max(0, min(self.ncu_timeout, int(left)))

    def counters(self) -> pd.DataFrame | None:
        """Nsight Compute on the kernels that make up most of a step (GPU only); the last phase."""
        from medddpm.measure.profile.ncu import run_ncu

        with self.phase("ncu", critical=False) as go:
            if not go:
                return None
            if "kernels" not in self.tables:
                self.profiler_status["ncu"] = {"status": "skipped", "message": "needs the torch.profiler ranking"}
                return None
            budget = self.ncu_budget()
            if self.time_limit is not None and budget < NCU_MIN_S:
                self.profiler_status["ncu"] = {"status": "skipped", "message": f"{budget} s left of the run's "
                                               f"{self.time_limit} s time limit (Nsight Compute needs {NCU_MIN_S} s)"}
                return None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the profiled program is another process on this GPU
            # The report itself (tens of MB) stays out of the data tree (`layout.NCU_REPORTS`).
            df, status = run_ncu(kernels_df=self.tables["kernels"], config=self.config.name, preset=self.preset.name,
                                 size=format_size(self.preset.size), batch=self.batch,
                                 out_dir=NCU_REPORTS / self.slug / self.folder, timeout_s=budget)
            self.profiler_status["ncu"] = status
            if self.device.type != "cuda" and df.empty:
                return None
            return self._write("ncu", df)

    def quality(self) -> pd.DataFrame | None:
        """Same weights, data, timesteps and noise under this configuration and under strict FP32.

        The strict-FP32 side is the same for every configuration of a sweep on one device, so it is
        computed once and kept under runs/quality/ (a cache, not a result: it is recomputed when absent
        and for `baseline` itself, whose row then also shows baseline's run-to-run agreement)."""
        with self.phase("quality") as go:
            if not go:
                return None
            cache = QUALITY_CACHE / (f"{self.slug}-{self.preset.name}{format_size(self.spec.size)}-b{self.batch}-"
                                     f"seed{self.seed}-"
                                     f"{self.data_id}-q{self.preset.quality_steps}.pt")
            ref = torch.load(cache) if cache.is_file() and self.config.name != "baseline" else None
            # No cuDNN autotuning: a reference needs no speed, and strict FP32's autotuning at the BraTS size
            # takes minutes.
            if ref is None:
                ref = self._quality_side(get_config("baseline"), autotune=False)
                atomic_write(cache, lambda f: torch.save(ref, f))
            mine = self._quality_side(self.config)
            out, base = mine["out"].double(), ref["out"].double()
            rel_err = float((out - base).norm() / base.norm())
            rows = pd.DataFrame({"step": range(1, self.preset.quality_steps + 1), "loss": mine["losses"],
                                 "baseline_loss": ref["losses"], "rel_err": rel_err})
            return self._write("quality", rows)

    def _quality_side(self, config: Config, *, autotune: bool = True) -> dict:
        """One forward pass's output and `quality_steps` training losses, from fixed weights and inputs."""
        e = self._engine(config)
        randomize_(e.model, seed=self.seed + 1)
        e.activate()
        torch.backends.cudnn.benchmark = autotune
        x0, cond = self._batch()
        t = torch.full((self.batch,), self.preset.sample_steps // 2, dtype=torch.long)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(self.seed + 2))
        with e.autocast():  # grad enabled: the compiled training graph serves this call too
            x_t = e.diffusion.q_sample(*(e.prepare(v) for v in (x0, t, noise)))
            pred = e.denoiser(torch.cat([x_t, e.prepare(cond).to(x_t.dtype)], 1), e.prepare(t))
        out = pred.detach().float().cpu()
        # Free the forward's autograd graph before training: a live one makes the first backward run
        # on the default stream, which breaks a CUDA-graph capture (cudaErrorStreamCaptureImplicit).
        del pred, x_t
        g = torch.Generator().manual_seed(self.seed + 3)
        vals = []
        for step in range(self.preset.quality_steps):
            x, c = self._batch(offset=step)
            tt = torch.randint(0, e.diffusion.timesteps, (self.batch,), generator=g)
            nn_ = torch.randn(x.shape, generator=g)
            vals.append(e.step(tuple(e.prepare(v) for v in (x, c, tt, nn_))))
        losses = torch.stack(vals).float().cpu().tolist()
        del e
        return {"out": out, "losses": losses}

    # ----------------------------------------------------------------------------------- finish

    def finish(self) -> pd.DataFrame:
        """Write run.parquet (last: its presence marks the run finished)."""
        row = run_row(self.config, self.preset.name, env=self.env, gpu_name=self.gpu_name, label=self.slug,
                      status=self.status, message=self.message, batch=self.batch, group=self.group,
                      mask_variant=self.mask_variant) | {
            "run_id": self.run_id, "precision_used": self.summary.get("precision_used", ""),
            "not_applicable": json.dumps(self.summary.get("not_applicable", {})),
            "backend_flags": json.dumps(self.summary.get("backend_flags", {})),
            "compile_cache": json.dumps(self.summary["compile_cache"]) if "compile_cache" in self.summary else "",
            "size": max(self.spec.shape), "shape": "x".join(map(str, self.spec.shape)), "batch": self.batch,
            "image_channels": self.spec.image_channels, "mask_channels": self.spec.mask_channels,
            "num_res_blocks": self.spec.num_res_blocks,
            "warmup_steps": self.warmup, "timed_steps": self.micro_steps, "profilers": json.dumps(self.profiler_status),
            "start_time": self.start.isoformat(timespec="seconds"), "duration_s": time.perf_counter() - self._t0,
        } | {k: v for k, v in self.summary.items()
             if k not in ("not_applicable", "backend_flags", "precision_used", "compile_cache")}
        return self._write("run", pd.DataFrame([row]))


def run_row(config: Config, preset: str, *, env: dict, gpu_name: str, status: str, message: str,
            batch: int = 1, group: str = "", label: str | None = None, mask_variant: int | None = None) -> dict:
    """A run.parquet row with the environment and switches filled in and every measured column at its
    missing value (NaN, -1 or ''), for phases that did not run. `label`: the folder's name under data/
    (default: the device type); `mask_variant`: label channels other than the data's own (`schema.run_folder`)."""
    now = dt.datetime.now(dt.timezone.utc)
    folder = run_folder(config.name, preset, batch, mask_variant)
    slug = gpu_slug(label or gpu_name)
    row = {"run_id": f"{slug}/{group + '/' if group else ''}{folder}/{now.strftime('%Y%m%dT%H%M%SZ')}", "status": status,
           "message": message, **{k: env[k] for k in ("gpu_count", "driver", "cuda", "cudnn", "torch", "python",
                                                       "cpu", "host_threads", "git_commit", "container")},
           "gpu_name": gpu_name, "gpu_slug": slug, "gpu_type": gpu_slug(gpu_name), "host": host_name(),
           "config": config.name, **config.flags,
           "preset": preset, "batch": batch, "start_time": now.isoformat(timespec="seconds")}
    if mask_variant is not None:
        row["mask_channels"] = mask_variant
    for name, (typ, _) in schema.TABLES["run"].items():
        row.setdefault(name, -1 if typ == schema.I else math.nan if typ == schema.F else "")
    return row


def write_failed_run(config: Config, preset: str, folder: Path, *, device: torch.device, gpu_label: str | None,
                     message: str, batch: int = 1, group: str = "", mask_variant: int | None = None) -> None:
    """run.parquet for a measurement that died before writing its own (status error, and why)."""
    env = environment(device)
    row = run_row(config, preset, env=env, gpu_name=env["gpu_name"], label=gpu_label, status="error", message=message,
                  batch=batch, group=group, mask_variant=mask_variant)
    schema.write_table(pd.DataFrame([row]), Path(folder) / RUN_FILE, "run")


class Energy:
    """Board energy over the timed steps from NVML's cumulative counter (mJ); None where absent."""

    def __init__(self, device: torch.device):
        self.device, self.handle, self.joules, self._e0 = device, None, None, None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(_pci_bus_id(device))
        except Exception:  # noqa: BLE001 - no NVML (or no energy counter) means no energy figure
            self.handle = None

    def start(self) -> None:
        if self.handle is not None:
            try:
                self._e0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            except Exception:  # noqa: BLE001
                self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.handle is not None and self._e0 is not None and exc[0] is None:
            self.joules = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self._e0) / 1e3

    def mean_power_w(self, seconds: float) -> float:
        return self.joules / seconds if self.joules is not None and seconds > 0 else math.nan


def _pci_bus_id(device: torch.device) -> str:
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
