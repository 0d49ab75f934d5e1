"""The environment a result was measured in: every result row carries it (TorchBench's habit)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import socket
import subprocess
from collections import Counter
from pathlib import Path

import torch
from medddpm import REPO


def pick_device(name: str | None = None) -> torch.device:
    """`name` if given (e.g. 'cpu', 'cuda:1'), else CUDA when present, else the CPU."""
    if name:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {name!r}: expected cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {name!r}: expected cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lower case, runs of other characters as one hyphen."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_type(device: torch.device) -> str:
    """The device's type as a folder name: 'nvidia-h200', 'cpu' (every CPU is one type)."""
    return gpu_slug(device_name(device))


def host_name() -> str:
    """This machine's short host name as a folder-name part: 'Node-7.cluster.org' -> 'node-7'."""
    return gpu_slug(socket.gethostname().split(".")[0]) or "host"


def git_commit() -> str:
    """HEAD of this checkout (with -dirty), or $MEDDDPM_GIT_COMMIT where the tree travels without .git."""
    if os.environ.get("MEDDDPM_GIT_COMMIT"):
        return os.environ["MEDDDPM_GIT_COMMIT"]
    root = REPO
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tracked_by_git(folder: str | os.PathLike, paths: list[Path]) -> set[Path]:
    """Those of `paths` (under `folder`) that git tracks, committed or staged, in the repository holding `folder`;
    none where `folder` is in no repository or there is no git."""
    folder = Path(folder).absolute()
    if not paths or not folder.is_dir():
        return set()
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *map(str, paths)], cwd=folder, capture_output=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    if out.returncode != 0:  # not a repository
        return set()
    return {(folder / name).absolute() for name in os.fsdecode(out.stdout).split("\0") if name}


def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, present on GPU machines

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - no NVML here is an answer, not an error
        return ""


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "gpu_name": device_name(device),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version() if cuda else "",
        "cuda": torch.version.cuda or "" if cuda else "",
        "cudnn": str(torch.backends.cudnn.version() or "") if cuda else "",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "host_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "container": os.environ.get("MEDDDPM_CONTAINER", "apptainer" if os.environ.get("APPTAINER_NAME") else
                                    "docker" if Path("/.dockerenv").exists() else ""),
        "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def compile_cache_counts() -> Counter:
    """Hits, misses and bypasses of the on-disk compile caches (Inductor's FX graph cache, AOTAutograd's)
    so far in this process, from Dynamo's counters. Subtract two of them for one phase's count: a first
    step that compiled again what the machine had compiled before shows as misses."""
    from torch._dynamo.utils import counters

    return Counter({f"{group}.{key}": n for group in ("inductor", "aot_autograd")
                    for key, n in counters[group].items() if "cache" in key})
