"""Run the sweep elsewhere than in this process: on a SLURM cluster, or on several local GPUs at once.

Both backends go through `submitit`. Each job calls `medddpm.sweep.sweep` on its share of the
configurations, so the results land in the same `data/<gpu-slug>/<config>/` layout as a plain
sweep, with the same skip / resume / one-failure-does-not-stop-the-rest behaviour; the label is derived
by each job from the device it actually ran on (`sweep.machine_label`). Jobs on several hosts of a device type
that the data already holds rows of would each take their own host's label: name one with `gpu_label`.

- `slurm`: one job per (GPU type, configuration), each asking for one GPU (`--gres=gpu:TYPE:1`,
  or `--gpus-per-node=1` when no type is named). `dry_run` renders the sbatch scripts exactly as
  submitit writes them, without submitting anything. The same submission code also runs on
  submitit's local executor (`cluster="local"`), which is how the tests exercise it on a CPU.
- `local`: one worker per visible GPU (submitit's `LocalExecutor`, `CUDA_VISIBLE_DEVICES` set to
  that GPU), the configurations dealt out round-robin; without a GPU they run one after another in
  this process.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from medddpm import REPO
from medddpm.configs import Config
from medddpm.measure.validate import check_label, check_text

ROOT = REPO


def run_configs(configs: list[str], *, preset: str, out: str, device: str | None = None,
                gpu_label: str | None = None, force: bool = False, params: dict | None = None,
                force_memory: bool = False) -> list[dict]:
    """The body of one job: the producer notebook for each configuration (`medddpm.sweep.sweep`); what cannot fit
    the job's device is refused there, unless `force_memory`."""
    from medddpm.configs import parse_config_list
    from medddpm.measure.sweep import sweep

    return sweep(parse_config_list(",".join(configs)), preset=preset, out=out, device=device,
                 gpu_label=gpu_label, force=force, params=params, force_memory=force_memory)


@dataclass
class SlurmOptions:
    partition: str | None = None
    gpu_types: list[str | None] = field(default_factory=lambda: [None])
    time_min: int = 120
    cpus_per_task: int = 8
    mem_gb: int | None = 64
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    python: str | None = None  # e.g. "apptainer exec --nv image.sif python"; default: this interpreter
    folder: str = "runs/slurm"  # submitit's pickles and the jobs' logs


def _sweep_command(configs: list[str], preset: str, out: str, params: dict, force: bool, device: str | None,
                   gpu_label: str | None, force_memory: bool = False) -> str:
    """The equivalent command line, written into each script so that a reader sees what the job does."""
    argv = ["python", "-m", "medddpm", "sweep", "--configs", ",".join(configs), "--preset", preset, "--out", out]
    for k, v in sorted(params.items()):
        if isinstance(v, bool):  # a switch: named where on
            argv += [f"--{k.replace('_', '-')}"] if v else []
        else:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    if force:
        argv.append("--force")
    if force_memory:
        argv.append("--force-memory")
    if device:
        argv += ["--device", device]
    if gpu_label:
        argv += ["--gpu-label", gpu_label]
    return shlex.join(argv)


def slurm_job_parameters(opts: SlurmOptions, gpu_type: str | None, config: str, command: str) -> dict:
    """sbatch parameters of one job, in `SlurmExecutor`'s names (see submitit.slurm.slurm._make_sbatch_string)."""
    params = {
        "job_name": f"medddpm-{gpu_type + '-' if gpu_type else ''}{config}",
        "time": opts.time_min,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": opts.cpus_per_task,
        "partition": opts.partition,
        "account": opts.account,
        "qos": opts.qos,
        "constraint": opts.constraint,
        "mem": f"{opts.mem_gb}GB" if opts.mem_gb else None,
        "stderr_to_stdout": True,
        "setup": [
            f"# medddpm: {command}",
            # The job unpickles medddpm.cluster.run_configs: the package must be importable there.
            f"export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}",
        ],
    }
    if gpu_type:
        params["gres"] = f"gpu:{gpu_type}:1"
    else:
        params["gpus_per_node"] = 1
    return {k: v for k, v in params.items() if v is not None}


@contextlib.contextmanager
def _package_on_pythonpath():
    """Local jobs inherit this process's environment: put the package on their PYTHONPATH."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _slurm_script_executor(folder: str, python: str | None):
    """A SlurmExecutor that renders scripts where no `srun` exists (for --dry-run); it never submits."""
    from submitit.slurm.slurm import SlurmExecutor

    class _ScriptOnly(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1

        def _submit_command(self, command: str):  # pragma: no cover - guarded
            raise RuntimeError("dry run: nothing is submitted")

    return _ScriptOnly(folder, python=python)


def _check_job_strings(opts: SlurmOptions, **strings) -> None:
    """Every string a job script holds, checked before any script is written."""
    for name in ("partition", "account", "qos", "constraint", "python", "folder"):
        check_text(f"--{name}", getattr(opts, name))
    for gpu_type in opts.gpu_types:
        check_text("--gpu-type", gpu_type)
    for k, v in strings.pop("params").items():
        check_text(f"--{k.replace('_', '-')}", v)
    for k, v in strings.items():
        check_text(f"--{k.replace('_', '-')}", v)
    if strings.get("gpu_label") is not None:
        check_label(strings["gpu_label"])


def submit_slurm(configs: list[Config], *, preset: str, out: str, opts: SlurmOptions, params: dict | None = None,
                 force: bool = False, device: str | None = None, gpu_label: str | None = None,
                 dry_run: bool = False, cluster: str = "slurm", force_memory: bool = False) -> list:
    """One job per (GPU type, configuration). Returns the submitit jobs, or the sbatch scripts if `dry_run`.

    `cluster="local"` sends the very same jobs to submitit's local executor (the sbatch-only
    parameters are then ignored): the tests run this path on a CPU.
    """
    import submitit

    params = dict(params or {})
    _check_job_strings(opts, out=out, params=params, device=device, gpu_label=gpu_label, preset=preset)
    out = str(Path(out).resolve())
    folder = str(Path(opts.folder).resolve() / "%j")
    if dry_run:
        ex = _slurm_script_executor(folder, opts.python)
    else:
        ex = submitit.AutoExecutor(folder=folder, cluster=cluster,
                                   **({"slurm_python": opts.python} if opts.python else {}))
    results = []
    with _package_on_pythonpath():
        for gpu_type in opts.gpu_types:
            for config in configs:
                command = _sweep_command([config.name], preset, out, params, force, device, gpu_label, force_memory)
                sb = slurm_job_parameters(opts, gpu_type, config.name, command)
                if dry_run:
                    ex.update_parameters(**sb)
                    results.append(ex._make_submission_file_text(ex._submitit_command_str, uid="dry-run"))
                    continue
                # Generic names for the local executor, slurm_* ones (which win on SLURM) for sbatch.
                ex.update_parameters(name=sb["job_name"], timeout_min=opts.time_min,
                                     **{f"slurm_{k}": v for k, v in sb.items()})
                results.append(ex.submit(run_configs, [config.name], preset=preset, out=out, device=device,
                                         gpu_label=gpu_label, force=force, params=params, force_memory=force_memory))
    return results


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_local(configs: list[Config], *, preset: str, out: str, params: dict | None = None, force: bool = False,
              gpu_label: str | None = None, folder: str = "runs/local", time_min: int = 24 * 60,
              gpus: int | None = None, force_memory: bool = False) -> list[dict]:
    """Several configurations at once, one worker per visible GPU; one after another without a GPU."""
    names = [c.name for c in configs]
    if gpu_label is not None:
        check_label(gpu_label)
    n = visible_gpu_count() if gpus is None else gpus
    n = min(n, len(names))
    if n <= 1:
        return run_configs(names, preset=preset, out=out, gpu_label=gpu_label, force=force, params=params,
                           force_memory=force_memory)
    import submitit

    out = str(Path(out).resolve())
    ex = submitit.LocalExecutor(folder=str(Path(folder).resolve() / "%j"))
    jobs = []
    with _package_on_pythonpath():
        for i in range(n):
            # Each worker sees one GPU as cuda:0 and measures its share in turn.
            ex.update_parameters(timeout_min=time_min, gpus_per_node=1, visible_gpus=(i,))
            jobs.append(ex.submit(run_configs, names[i::n], preset=preset, out=out, gpu_label=gpu_label,
                                  force=force, params=params, force_memory=force_memory))
    results = []
    for job in jobs:
        results += job.result()
    order = {name: k for k, name in enumerate(names)}
    return sorted(results, key=lambda r: order.get(r["config"], len(order)))


def print_scripts(scripts: list[str], file=None) -> None:
    file = file or sys.stdout  # looked up when called: a redirected sys.stdout gets the scripts
    for k, script in enumerate(scripts):
        if k:
            print(file=file)
        print(script, file=file, end="" if script.endswith("\n") else "\n")
