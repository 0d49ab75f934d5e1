"""The convergence study (`python -m medddpm study`): does a faster configuration train as good a model?

Each configuration trains from each seed with the command line's training loop (`medddpm.train.loop.train`):
the seed fixes the initial weights (every configuration builds the same ones from it), the order of the
training pairs and, with `fixed_noise`, the diffusion timesteps and noise of every step, so that two runs of
one seed differ by their configuration's numerics alone. Each trained model's EMA weights then draw samples,
in the configuration's own precision, for label maps of subjects not among the training pairs, from one
fixed noise (the same for every configuration and seed). Each sample is scored (`sample_metrics`): whether
its tissues lie where its label map says (`label_dice`), how far its intensities lie from the real training
images' (`hist_w1`), and how alike two samples of one label map are (`ms_ssim`). The held-out subjects' real
images are scored the same way (configuration ``real``): the ceiling.

Runs may train in parallel processes (`jobs`), on one device or spread over several (`devices`); only this
process writes the tables (`medddpm.store.convergence`). A finished run (its row in runs.parquet with status
ok) is not run again; an unfinished one resumes from its last checkpoint in the work folder.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm  # text bars: tqdm.auto draws ipywidgets bars, a message per update under papermill

from medddpm.progress import progress_bar
from medddpm.errors import UserError
from medddpm.configs import get_config
from medddpm.measure.study import sample_metrics as sm
from medddpm.measure.env import device_type, environment, gpu_slug, pick_device
from medddpm.measure.validate import check_label, check_label_device, known_device_types
from medddpm.model.diffusion import TIMESTEPS
from medddpm.model.unet import ModelSpec
from medddpm.store import convergence as store
from medddpm.store import schema
from medddpm.store.layout import CONVERGENCE_TABLES, SLICES_DIR, convergence_folder
from medddpm.store.storage import atomic_write

LABEL_SEED = 100_000  # the held-out subjects are mni:100000, mni:100001, ...: far from any training pair's seed
SAMPLE_SEED = 1_000_003  # the sampling noise: one draw for every configuration and seed
SAVE_EVERY = 500  # steps between checkpoints: what a killed run loses at most
LOG_EVERY = 50  # steps between reads of the loss from the device
# what runs.parquet records of the study's settings: a re-run with other settings needs another folder
SETTINGS = ("size", "base_channels", "data", "pairs", "steps", "grad_accum", "lr", "samples", "label_maps",
            "sample_steps")


class StudyError(UserError):
    """Settings that cannot run, or that differ from those of the results already in the folder (one line)."""


@dataclass(frozen=True)
class Settings:
    """What every run of one study shares."""

    size: int = 64
    base_channels: int = 64
    steps: int = 4000
    pairs: int = 32
    lr: float = 1e-4
    grad_accum: int = 1
    samples: int = 4  # samples per run, spread evenly over the label maps
    label_maps: int = 2
    sample_steps: int = TIMESTEPS  # denoising steps of a sample: the training schedule's T, or fewer (respaced)
    data: str = "mni"  # the tissue scores need the embedded data's labels (CSF, grey and white matter)

    def __post_init__(self):
        for name in ("size", "base_channels", "steps", "pairs", "grad_accum", "samples", "label_maps", "sample_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StudyError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise StudyError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.data != "mni":
            raise StudyError(f"the study trains on the embedded data ('mni'), not {self.data!r}: its scores name "
                             "CSF, grey and white matter")
        if self.sample_steps > TIMESTEPS:
            raise StudyError(f"sample_steps must be at most the training schedule's {TIMESTEPS}, got {self.sample_steps}")
        if self.samples % self.label_maps:
            raise StudyError(f"{self.samples} samples do not spread evenly over {self.label_maps} label maps")
        ModelSpec(size=self.size, mask_channels=3, base_channels=self.base_channels)  # raises on a bad size

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(size=self.size, mask_channels=3, base_channels=self.base_channels)

    @property
    def per_map(self) -> int:
        return self.samples // self.label_maps

    @property
    def label_sources(self) -> list[str]:
        return [f"mni:{LABEL_SEED + i}" for i in range(self.label_maps)]

    def record(self) -> dict:
        return {"size": self.size, "base_channels": self.base_channels, "data": self.data, "pairs": self.pairs,
                "steps": self.steps, "grad_accum": self.grad_accum, "lr": float(self.lr), "samples": self.samples,
                "label_maps": json.dumps(self.label_sources), "sample_steps": self.sample_steps}


# ------------------------------------------------------------------------------------------- scores


def score(images: np.ndarray, labels: list[np.ndarray], maps: list[int], reference: dict[int, np.ndarray], *,
          config: str, seed: int, sources: list[str], pairs: bool = True) -> pd.DataFrame:
    """samples.parquet rows for `images` (N, D, H, W), image i drawn for label map `labels[maps[i]]`:
    label_dice and hist_w1 per tissue and their mean, and with `pairs` ms_ssim of every two images of one
    label map (on the brain's bounding box: the background, the same in every sample, would add likeness)."""
    rows = []
    for i, image in enumerate(images):
        lab = labels[maps[i]]
        base = {"config": config, "seed": seed, "sample": i, "label_map": sources[maps[i]], "other": -1}
        for metric, values in (("label_dice", sm.label_dice(image, lab)),
                               ("hist_w1", sm.intensity_w1(image, lab, reference))):
            rows += [base | {"metric": metric, "tissue": tissue, "value": value} for tissue, value in values.items()]
    if pairs:
        for i in range(len(images)):
            for j in range(i + 1, len(images)):
                if maps[i] == maps[j]:
                    box = sm.brain_box(labels[maps[i]])
                    rows.append({"config": config, "seed": seed, "sample": i, "label_map": sources[maps[i]],
                                 "other": j, "metric": "ms_ssim", "tissue": "brain",
                                 "value": sm.ms_ssim(images[i][box], images[j][box])})
    return pd.DataFrame(rows, columns=["config", "seed", "sample", "label_map", "other", "metric", "tissue", "value"])


def labels_of(cond: torch.Tensor) -> np.ndarray:
    """The integer label map of a one-hot condition (K, D, H, W) in {-1, +1} (0 where no channel is set)."""
    on = (cond > 0).numpy()
    return (on * np.arange(1, on.shape[0] + 1)[:, None, None, None]).max(0).astype(np.uint8)


# ---------------------------------------------------------------------------------------- one run


@dataclass
class Job:
    config: str
    seed: int
    settings: Settings
    device: str
    work: str  # this run's folder: checkpoint, loss log, result
    out: str  # the study's folder (for the PNGs)
    env: dict
    reference: dict  # tissue -> quantiles of the training images
    labels: list  # the held-out label maps (uint8 arrays)
    progress: bool = True
    threads: int = 0  # torch CPU threads in a worker process (0: leave as is)

    def result_path(self, table: str) -> Path:
        """Where a worker process leaves one of its result tables for the parent (parquet: data, never code)."""
        return Path(self.work) / f"result-{table}.parquet"


def _row(job: Job, **values) -> dict:
    """A runs.parquet row of `job`, every measured column at its missing value unless given."""
    return {"config": job.config, "seed": job.seed, "status": "ok", "message": "",
            "switches": json.dumps(get_config(job.config).flags), "precision_used": "", "not_applicable": "{}",
            **job.settings.record(), "skipped_steps": -1, "final_loss": math.nan, "ema_decay": math.nan,
            "ema_start": -1, "sample_precision": "", "train_s": math.nan,
            "sample_s": math.nan, **{k: job.env.get(k, "") for k in ("gpu_name", "torch", "cuda", "cudnn", "git_commit")},
            "gpu_slug": gpu_slug(job.env["gpu_name"]),
            "start_time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")} | values


def _result(job: Job, row: dict, losses: pd.DataFrame | None = None, samples: pd.DataFrame | None = None) -> dict:
    empty = score(np.zeros((0, 1, 1, 1)), [], [], {}, config=job.config, seed=job.seed, sources=[])
    return {"runs": pd.DataFrame([row]),
            "losses": losses if losses is not None else pd.DataFrame(columns=["config", "seed", "step", "loss"]),
            "samples": samples if samples is not None else empty}


def _losses(job: Job) -> pd.DataFrame:
    from medddpm.train.loop import read_loss_log

    log = read_loss_log(job.work)
    return pd.DataFrame({"config": job.config, "seed": job.seed, "step": [int(r["step"]) for r in log],
                         "loss": [float(r["loss"]) for r in log]})


def run_one(job: Job) -> dict:
    """Train, sample and score one (configuration, seed); returns its rows for the three tables. A run whose loss
    went non-finite (`Diverged`) is recorded with status diverged and its losses up to that step, unsampled; an
    error is recorded in the run row (status error, one line), not raised."""
    from medddpm.train.data import MNIPairs, one_hot_condition
    from medddpm.train.loop import CHECKPOINT, Diverged, train
    from medddpm.train.sampling import load_checkpoint

    s, device, work = job.settings, torch.device(job.device), Path(job.work)
    row, losses, samples = _row(job), None, None
    phase = "train"
    try:
        t0 = time.perf_counter()
        data = MNIPairs(s.pairs, size=s.size, progress=False)
        engine = train(s.spec, get_config(job.config), data, out_dir=work, steps=s.steps, device=device,
                       grad_accum=s.grad_accum, lr=s.lr, seed=job.seed, save_every=SAVE_EVERY, log_every=LOG_EVERY,
                       progress=job.progress, fixed_noise=True)
        row |= {"train_s": time.perf_counter() - t0, "skipped_steps": engine.skipped_steps,
                "precision_used": engine.run.precision, "not_applicable": json.dumps(engine.run.not_applicable),
                "ema_decay": engine.ema.decay, "ema_start": engine.ema.start}
        del engine
        losses = _losses(job)
        row["final_loss"] = float(losses["loss"].tail(100).mean())
        if device.type == "cuda":
            torch.cuda.empty_cache()

        phase = "sample"
        t0 = time.perf_counter()
        sampler = load_checkpoint(work / CHECKPOINT, device=device, use_ema=True)
        sampler.diffusion = sampler.diffusion.respaced(s.sample_steps)
        maps = [i for i in range(s.label_maps) for _ in range(s.per_map)]
        cond = torch.stack([one_hot_condition(job.labels[m], num_classes=3) for m in maps])
        g = torch.Generator(device).manual_seed(SAMPLE_SEED)
        x = sampler.sample(sampler.prepare(cond), image_channels=1, generator=g, progress=job.progress)
        images = x[:, 0].float().cpu().numpy()
        row |= {"sample_s": time.perf_counter() - t0, "sample_precision": sampler.run.precision}
        del sampler, x

        phase = "score"
        samples = score(images, job.labels, maps, job.reference, config=job.config, seed=job.seed,
                        sources=s.label_sources)
        for i, image in enumerate(images):
            png = sm.slices_png(image)
            atomic_write(Path(job.out) / SLICES_DIR / store.slice_file("sample", job.config, job.seed, i),
                         lambda f: f.write(png))
    except Diverged as e:  # a result, not a fault: the configuration's numerics failed from this seed
        row |= {"status": "diverged", "message": str(e), "train_s": time.perf_counter() - t0}
        losses = _losses(job)
    except Exception as e:  # noqa: BLE001 - recorded in runs.parquet; the other runs go on
        traceback.print_exc()
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row |= {"status": "error", "message": f"{phase}: {type(e).__name__}: {text}"}
    return _result(job, row, losses, samples)


def _worker(job: Job) -> None:
    """A process's entry: one run, its tables written beside its checkpoint as parquet for the parent to read
    (the runs table last: its file says the result is whole)."""
    if job.threads:
        torch.set_num_threads(job.threads)
    result = run_one(job)
    for table in ("losses", "samples", "runs"):
        atomic_write(job.result_path(table), lambda f, df=result[table]: df.to_parquet(f, index=False))


def _read_result(job: Job) -> dict | None:
    """A worker's tables, checked against the schema; None where it left no whole result."""
    if not job.result_path("runs").is_file():
        return None
    result = {}
    for table in ("losses", "samples", "runs"):
        path = job.result_path(table)
        result[table] = schema.read_table(path, store.table_name(f"{table}.parquet"))
        path.unlink()
    return result


# -------------------------------------------------------------------------------------- the study


def _make_pair(seed: int, size: int) -> None:
    from medddpm.train.data import MNIPairs

    MNIPairs(1, size=size, seed=seed, progress=False).prepare()


def prepare_data(settings: Settings, *, processes: int = 1, progress: bool = True):
    """The training pairs (generated into the cache once, in parallel processes), the per-tissue intensity
    quantiles of their images, and the held-out subjects' label maps and real images."""
    from medddpm.train.data import MNIPairs
    from medddpm.train.synthetic import make_mni_pair

    data = MNIPairs(settings.pairs, size=settings.size, progress=progress)
    missing = [i for i in range(settings.pairs) if not data.path(i).exists()]
    if len(missing) > 4 and processes > 1:  # about a second a pair at 64^3: worth the processes' start
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(processes, len(missing)), mp_context=mp.get_context("spawn")) as pool:
            list(progress_bar(pool.map(_make_pair, missing, [settings.size] * len(missing)), total=len(missing),
                              desc=f"MNI pairs {settings.size}", progress=progress))
    data.prepare()
    items = [data[i] for i in range(len(data))]
    reference = sm.tissue_quantiles([x[0].numpy() for x, _ in items], [labels_of(c) for _, c in items])
    held = [make_mni_pair(LABEL_SEED + i, size=settings.size) for i in range(settings.label_maps)]
    return reference, [lab for _, lab in held], [img for img, _ in held]


def _check_settings(done: pd.DataFrame, settings: Settings, folder: Path) -> None:
    if done.empty:
        return
    mine = settings.record()
    for col in SETTINGS:
        theirs = set(done[col].tolist())
        if theirs != {mine[col]}:
            raise StudyError(f"{folder} holds a study run with {col} {sorted(map(str, theirs))}, not {mine[col]}: "
                             "use another --out, or move that folder away")


def _seconds_left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


def study(configs: list[str], seeds: list[int], settings: Settings = Settings(), *, out: str | os.PathLike = "data",
          work: str | os.PathLike = "runs/convergence", device: str | None = None, devices: list[str] | None = None,
          gpu_label: str | None = None, jobs: int = 1, force: bool = False, time_limit: float | None = None,
          keep_checkpoints: bool = False, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Run every (configuration, seed) not yet done into OUT/<gpu-slug>/convergence/; returns the tables.

    `jobs` > 1 trains that many runs at once in worker processes, spread over `devices` (default: `device`).
    `time_limit` (seconds): no run starts after it, and runs still going are stopped (they resume from their
    last checkpoint next time). `force`: run again those already done."""
    names = [get_config(c).name for c in configs]  # every name checked before any work
    if len(set(names)) != len(names) or not names:
        raise StudyError(f"configurations must be distinct and at least one: {configs}")
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise StudyError(f"seeds must be distinct non-negative integers: {seeds}")
    if not isinstance(jobs, int) or jobs < 1:
        raise StudyError(f"jobs must be a positive integer, got {jobs!r}")
    if gpu_label is not None:  # it names the study's folder
        check_label(gpu_label)
    devices = [str(pick_device(d)) for d in (devices or [device])]
    deadline = None if time_limit is None else time.monotonic() + time_limit
    env = environment(torch.device(devices[0]))
    if gpu_label is not None:  # a label of another device type would file this device's study as that card's
        check_label_device(gpu_label, device_type(torch.device(devices[0])), known_device_types(out))
    slug = gpu_slug(gpu_label or env["gpu_name"])
    env["gpu_name"] = gpu_label or env["gpu_name"]
    folder = convergence_folder(out, slug)
    tables = {t: store.read(folder, t) for t in CONVERGENCE_TABLES}
    done = tables["runs"][tables["runs"]["status"].isin(store.DONE)]
    _check_settings(done, settings, folder)
    todo = [(c, s) for s in seeds for c in names if force or not ((done["config"] == c) & (done["seed"] == s)).any()]
    # longest first, by the training time of the configuration's runs already done (parallel runs then end
    # together, and a time limit stops fewer long runs); configurations not yet timed keep the order given
    took = done.groupby("config")["train_s"].median().dropna().to_dict()
    todo.sort(key=lambda cs: -took.get(cs[0], math.inf))

    reference, labels, real = prepare_data(settings, processes=os.cpu_count() or 1, progress=progress)
    real_rows = score(np.stack(real), labels, list(range(len(real))), reference, config=store.REAL, seed=0,
                      sources=settings.label_sources, pairs=False)
    slices = folder / SLICES_DIR
    for i, (lab, img) in enumerate(zip(labels, real)):
        for kind, png in (("label", sm.slices_png(lab, labels=True)), ("real", sm.slices_png(img))):
            atomic_write(slices / store.slice_file(kind, i), lambda f, png=png: f.write(png))
    tables["samples"] = pd.concat([tables["samples"][tables["samples"]["config"] != store.REAL], real_rows],
                                  ignore_index=True)
    store.write(folder, "samples", tables["samples"])

    run_root = Path(work) / slug
    if force:  # from scratch: a checkpoint left by an earlier run of the same name would be resumed
        for config, seed in todo:
            shutil.rmtree(run_root / store.run_name(config, seed), ignore_errors=True)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    todo_jobs = [Job(config, seed, settings, devices[0], str(run_root / store.run_name(config, seed)), str(folder),
                     env, reference, labels, progress=progress and jobs == 1, threads=threads)
                 for config, seed in todo]

    def record(job: Job, result: dict) -> None:
        """Replace the run's rows in every table (runs.parquet last: its row marks the run done)."""
        for t in ("losses", "samples", "runs"):
            old = tables[t]
            mine = (old["config"] == job.config) & (old["seed"] == job.seed)
            tables[t] = pd.concat([df for df in (old[~mine], result[t]) if len(df)] or [old.iloc[:0]],
                                  ignore_index=True)
            store.write(folder, t, tables[t])
        run = result["runs"].iloc[0]
        if run["status"] in store.DONE and not keep_checkpoints:
            from medddpm.train.loop import CHECKPOINT

            (Path(job.work) / CHECKPOINT).unlink(missing_ok=True)
        if run["status"] == "ok":
            tqdm.write(f"{job.config} seed {job.seed}: mean label_dice {_mean_dice(result['samples']):.3f}, "
                       f"{run['skipped_steps']} skipped steps, final loss {run['final_loss']:.4f}, "
                       f"train {run['train_s']:.0f} s, sample {run['sample_s']:.0f} s")
        else:
            tqdm.write(f"{job.config} seed {job.seed}: {run['status']}: {run['message']}")

    bar = progress_bar(total=len(todo_jobs), desc="study", unit="run", progress=progress)
    if jobs == 1:
        stopped = []
        for i, job in enumerate(todo_jobs):
            if _seconds_left(deadline) <= 0:
                stopped = todo_jobs[i:]
                break
            record(job, run_one(job))
            bar.update()
    else:
        stopped = _run_parallel(todo_jobs, jobs, devices, deadline, record, bar)
    bar.close()
    if stopped:
        tqdm.write(f"time limit: {len(stopped)} run(s) not finished "
                   f"({', '.join(f'{j.config} seed {j.seed}' for j in stopped)}); the same command resumes them")
    return tables


def _mean_dice(samples: pd.DataFrame) -> float:
    d = samples[(samples["metric"] == "label_dice") & (samples["tissue"] == "mean")]["value"]
    return float(d.mean()) if len(d) else math.nan


def _run_parallel(jobs: list[Job], n: int, devices: list[str], deadline: float | None, record, bar) -> list[Job]:
    """Each job in a spawned process of its own, `n` at a time, slot k on device k mod len(devices); returns the
    jobs the deadline stopped or kept from starting (a stopped one keeps its last checkpoint)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    pending, running = list(jobs), {}  # slot -> (process, job)

    def stop_running():  # each keeps its last checkpoint; the same command resumes it
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()

    try:  # Ctrl-C, SIGTERM, an error recording a result: no run goes on without this process
        while pending or running:
            if _seconds_left(deadline) <= 0:
                stop_running()
                return [job for _, job in running.values()] + pending
            for slot in range(n):
                if slot not in running and pending:
                    job = dataclasses.replace(pending.pop(0), device=devices[slot % len(devices)])
                    Path(job.work).mkdir(parents=True, exist_ok=True)
                    for table in ("losses", "samples", "runs"):
                        job.result_path(table).unlink(missing_ok=True)
                    proc = ctx.Process(target=_worker, args=(job,), name=f"study {job.config} seed {job.seed}")
                    proc.start()
                    running[slot] = (proc, job)
            time.sleep(0.5)
            for slot, (proc, job) in list(running.items()):
                if proc.is_alive():
                    continue
                proc.join()
                try:
                    result = _read_result(job)
                except (schema.SchemaError, OSError, ValueError) as e:
                    result = _result(job, _row(job, status="error", message=f"unreadable result: {e}".splitlines()[0]))
                if result is None:  # killed for memory, or a crash inside a library
                    result = _result(job, _row(job, status="error",
                                               message=f"worker exited with code {proc.exitcode} before its result"))
                record(job, result)
                bar.update()
                del running[slot]
        return []
    except BaseException:
        stop_running()
        raise


def summary(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per configuration: runs, mean label_dice over the seeds' means with its spread between seeds, hist_w1,
    ms_ssim, skipped steps and training time (what the command prints at its end)."""
    runs, samples = tables["runs"], tables["samples"]
    ok = runs[runs["status"] == "ok"]
    rows = []
    for config in list(dict.fromkeys(ok["config"])):
        s = samples[samples["config"] == config]
        per_seed = {m: s[(s["metric"] == m) & (s["tissue"] == t)].groupby("seed")["value"].mean()
                    for m, t in (("label_dice", "mean"), ("hist_w1", "mean"), ("ms_ssim", "brain"))}
        r = ok[ok["config"] == config]
        rows.append({"config": config, "runs": len(r),
                     "label_dice": per_seed["label_dice"].mean(), "label_dice_sd": per_seed["label_dice"].std(),
                     "hist_w1": per_seed["hist_w1"].mean(), "ms_ssim": per_seed["ms_ssim"].mean(),
                     "skipped_steps": int(r["skipped_steps"].sum()), "final_loss": r["final_loss"].mean(),
                     "train_s": r["train_s"].mean()})
    real = samples[(samples["config"] == store.REAL) & (samples["metric"] == "label_dice") & (samples["tissue"] == "mean")]
    if rows and len(real):  # the ceiling, beside the configurations' scores
        rows.append({"config": store.REAL, "runs": 0, "label_dice": real["value"].mean(),
                     "hist_w1": samples[(samples["config"] == store.REAL) & (samples["metric"] == "hist_w1")
                                        & (samples["tissue"] == "mean")]["value"].mean()})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


SUMMARY_COLUMNS = ("config", "runs", "label_dice", "label_dice_sd", "hist_w1", "ms_ssim", "skipped_steps", "final_loss",
                   "train_s")


def unfinished(tables: dict[str, pd.DataFrame]) -> str:
    """One line: how many runs of the study did not finish, by status ('' where every one did)."""
    counts = tables["runs"]["status"].value_counts()
    counts = counts[counts.index != "ok"]
    return ", ".join(f"{n} {status}" for status, n in counts.items())
