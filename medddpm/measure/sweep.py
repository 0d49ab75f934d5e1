"""Run the producer notebook once per configuration on this machine's device, through papermill.

Each configuration is measured into a staging folder that replaces `data/<gpu-slug>/<run>/` in
one rename once the notebook has ended, so a killed sweep leaves either the old result or the new
one, never a mixture. A configuration whose folder already holds `run.parquet` is skipped unless
`force`; a failing one (out of memory, compile error) is recorded with its status and the sweep
goes on. `<run>` is the configuration's name for the smoke and paper presets at batch 1, and
`<config>@<preset>[-b<batch>][-m<label channels>]` otherwise (`schema.run_folder`).

`<gpu-slug>` is a label: the device type (`nvidia-h200`, `cpu`) while the data tree holds no runs of that
type measured on another machine, else `<device-type>-<host>` (`machine_label`), so that a machine of a
type already in the data is measured beside those rows, never over them; `gpu_label` names it instead.
Each run records its device type (`gpu_type`) and host apart from the label.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from medddpm import REPO
from medddpm.configs import Config, parse_config_list
from medddpm.measure.env import device_type, gpu_slug, host_name, pick_device
from medddpm.train.data import open_dataset
from medddpm.measure.run import get_preset, write_failed_run
from medddpm.model.unet import parse_size
from medddpm.store.schema import read_table, run_folder

ROOT = REPO
NOTEBOOK = ROOT / "notebooks" / "produce.ipynb"


_HOST = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"


def _stage_is_stale(stage: Path) -> bool:
    """A staging folder of a dead sweep on this host; another host's (shared file system) is left alone."""
    host, _, pid = stage.name.rpartition("-")
    host = host.split(".stage-", 1)[1] if ".stage-" in host else _HOST  # '.cfg.stage-PID': older, this host
    if host != _HOST or not pid.isdigit():
        return host == _HOST
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return int(pid) == os.getpid()


def _run_host(path: Path) -> str:
    """The host recorded in a run.parquet; '' for rows written before hosts were recorded (committed ones)."""
    try:
        return str(pq.read_table(path, columns=["host"]).column("host")[0]) if "host" in pq.read_schema(path).names else ""
    except (OSError, ValueError, IndexError):
        return ""


def machine_label(out: str | os.PathLike, device) -> str:
    """The folder name under `out` for this machine's runs: its device type while `out/<type>/` holds no run
    measured elsewhere (a first run of a type, or this machine's own), else `<type>-<host>`: the committed
    rows of the type stay as measured and this machine's sit beside them, found again by a later sweep here."""
    kind, here = device_type(device), host_name()
    folder = Path(out) / kind
    runs = [*folder.glob("*/run.parquet"), *folder.glob("*/*/run.parquet")]  # main runs, and groups (ablation/)
    return f"{kind}-{here}" if any(_run_host(p) != here for p in runs) else kind


def _kernel_manager():
    """The producer notebook's kernel manager: the kernel talks to papermill over local sockets (IPC) in a
    private folder, not over TCP ports, so it warns of no unencrypted transport and no other user can reach it."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    sockets = tempfile.mkdtemp(prefix="medddpm-kernel-")

    class LocalKernelManager(AsyncKernelManager):
        @default("transport")
        def _default_transport(self):
            return "ipc"

        @default("ip")
        def _default_ip(self):
            return os.path.join(sockets, "kernel")

    return LocalKernelManager, sockets


def _publish(stage: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(stage, final)
    shutil.rmtree(old, ignore_errors=True)


def sweep(configs: str | list[Config], *, preset: str = "smoke", out: str | os.PathLike = "data",
          device: str | None = None, gpu_label: str | None = None, force: bool = False,
          params: dict | None = None, notebook: Path = NOTEBOOK, timeout_s: int | None = None,
          group: str = "") -> list[dict]:
    """Measure each configuration; returns one {config, status, seconds, folder} per configuration.

    `group`: runs that belong together apart from the main ones, in ``data/<gpu-slug>/<group>/<run>/``
    (the ablation's)."""
    import papermill as pm  # imported here: the package itself does not need the Jupyter stack

    # Everything that can be checked is checked before any configuration runs.
    configs = parse_config_list(configs) if isinstance(configs, str) else configs
    spec_preset = get_preset(preset)
    size = parse_size((params or {}).get("size") or spec_preset.size)
    batch = (params or {}).get("batch", 1)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"parameter batch must be a positive int, got {batch!r}")
    sample_steps = (params or {}).get("sample_steps")
    if sample_steps is not None and (not isinstance(sample_steps, int) or isinstance(sample_steps, bool)
                                     or sample_steps < 2):
        raise ValueError(f"parameter sample_steps must be an int of at least 2 (the first step is untimed), "
                         f"got {sample_steps!r}")
    source = (params or {}).get("data") or spec_preset.data
    data = open_dataset(source, size=size)
    mask = (params or {}).get("mask_channels")
    mask_variant = mask if mask not in (None, data.mask_channels) else None  # the data's own width: no variant
    if mask_variant is not None:
        data = open_dataset(source, size=size, mask_channels=mask_variant)
    # the preset's model, at this size, must take this data (a BraTS model needs four modalities and labels)
    dataclasses.replace(spec_preset, size=size).spec(mask_channels=data.mask_channels,
                                                     image_channels=getattr(data, "image_channels", 1))
    dev = pick_device(device)
    out = Path(out)
    if gpu_label is not None and not gpu_slug(gpu_label):
        raise ValueError(f"--gpu-label {gpu_label!r}: a label needs a letter or a digit")
    gpu_label = gpu_label or machine_label(out, dev)
    slug = gpu_slug(gpu_label)
    root = out / slug / group
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*.stage-*"):  # left by a killed sweep (not by one running alongside: cluster jobs)
        if _stage_is_stale(stale):
            shutil.rmtree(stale, ignore_errors=True)
    params = dict(params or {}) | {"preset": preset, "out": str(out), "gpu_label": gpu_label, "device": device,
                                   "group": group}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results = []
    manager, sockets = _kernel_manager()
    for i, config in enumerate(configs, 1):
        final = root / run_folder(config.name, preset, batch, mask_variant)
        if (final / "run.parquet").exists() and not force:
            results.append({"config": config.name, "status": "done before", "seconds": 0.0, "folder": str(final)})
            print(f"[{i}/{len(configs)}] {config.name}: measured before in {final} (--force measures it again)",
                  file=sys.stderr)
            continue
        print(f"[{i}/{len(configs)}] {config.name}: measuring into {final} ...", file=sys.stderr, flush=True)
        stage = root / f".{final.name}.stage-{_HOST}-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        t0 = time.perf_counter()
        try:
            old_env = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            pm.execute_notebook(str(notebook), str(stage / "produce.ipynb"), parameters=params | {
                "config": config.name, "stage": str(stage)}, kernel_name="python3", progress_bar=False,
                cwd=str(ROOT), execution_timeout=timeout_s, kernel_manager_class=manager)
        except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
            if not (stage / "run.parquet").exists():
                why = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                write_failed_run(config, preset, stage, device=dev, gpu_label=gpu_label,
                                 message=f"{type(e).__name__}: {why}", batch=batch, group=group,
                                 mask_variant=mask_variant)
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _publish(stage, final)
        run = read_table(final / "run.parquet").iloc[0]
        results.append({"config": config.name, "status": run["status"], "seconds": time.perf_counter() - t0,
                        "folder": str(final)})
        took = f"{run['train_median_ms']:.1f} ms a training micro-step" if run["status"] == "ok" else run["message"]
        print(f"[{i}/{len(configs)}] {config.name}: {run['status']} in {results[-1]['seconds']:.0f} s: {took}",
              file=sys.stderr)
    shutil.rmtree(sockets, ignore_errors=True)
    return results


def _main_runs(folder: Path) -> list:
    """The run rows of `folder`'s main runs (`data/<label>/<config>/`), in configuration order."""
    from medddpm.configs import CONFIGS

    rows = [read_table(p).iloc[0] for p in sorted(folder.glob("*/run.parquet"))]
    rows = [r for r in rows if run_folder(r["config"], r["preset"], max(int(r["batch"]), 1)) == r["config"]]
    order = {name: k for k, name in enumerate(CONFIGS)}
    return sorted(rows, key=lambda r: (order.get(r["config"], len(order)), r["config"]))


def summary(out: str | os.PathLike = "data", *, device: str | None = None, gpu_label: str | None = None,
            book: str | os.PathLike | None = None) -> str:
    """What this machine measured under `out`, its fastest configuration against the committed rows of its
    device type (`out/<type>/`: the rows of the type measured elsewhere), and where the book is."""
    import textwrap

    dev = pick_device(device)
    out = Path(out)
    label = gpu_slug(gpu_label or machine_label(out, dev))
    kind = device_type(dev)
    folder = out / label
    mine = _main_runs(folder)
    lines = [f"This machine: {kind} on host {host_name()}, labelled {label}."]
    if not mine:
        lines.append(f"Nothing measured yet in {folder}/ (python -m medddpm sweep measures it).")
        return "\n".join(textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False) for line in lines)
    ok = [r for r in mine if r["status"] == "ok" and not math.isnan(r["train_median_ms"])]
    first = mine[0]
    lines.append(f"Measured {len(mine)} configuration(s) into {folder}/ ({first['preset']} preset, "
                 f"{first['shape']} voxels, {int(first['parameters']):,} parameters), {len(ok)} ok:")
    for r in mine:
        what = (f"{r['train_median_ms']:9.1f} ms a training micro-step (median of {int(r['timed_steps'])})"
                if r["status"] == "ok" else f"{r['status']}: {r['message']}")
        lines.append(f"  {r['config']:<12} {what}")
    if ok:
        best = min(ok, key=lambda r: r["train_median_ms"])
        line = f"Fastest here: {best['config']}, {best['train_median_ms']:.1f} ms."
        theirs = {r["config"]: r for r in _main_runs(out / kind)} if label != kind else {}
        ref = theirs.get(best["config"])
        if label == kind:
            line += f" No other rows of {kind} in {out}/ to compare with: these are the first."
        elif ref is None or ref["status"] != "ok":
            line += f" The committed {kind} rows ({out / kind}/) have no {best['config']} to compare with."
        elif (ref["preset"], ref["shape"]) != (best["preset"], best["shape"]):
            line += (f" The committed {kind} {best['config']} is of another size ({ref['preset']}, {ref['shape']}),"
                     f" not comparable.")
        else:
            ratio = best["train_median_ms"] / ref["train_median_ms"]
            line += (f" The committed {kind} row ({out / kind / best['config']}/): {ref['train_median_ms']:.1f} ms;"
                     f" this machine takes {ratio:.2f}x its time ({1 / ratio:.2f}x its speed).")
        lines.append(line)
    if book is not None:
        book = Path(book)
        lines.append(f"The book: {book.resolve()} ({label} beside the committed devices)" if book.is_file()
                     else f"The book is not built yet ({book}: bash scripts/book.sh builds it).")
    return "\n".join(line if line.startswith("  ") else textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False)
                     for line in lines)
