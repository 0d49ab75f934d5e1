"""Run the producer notebook once per configuration on this machine's device, through papermill.

Each configuration is measured into a staging folder that replaces `data/<gpu-slug>/<run>/` in
one rename once the notebook has ended, so a killed sweep leaves either the old result or the new
one, never a mixture. A configuration whose folder already holds `run.parquet` is skipped unless
`force`; a failing one (out of memory, compile error) is recorded with its status and the sweep
goes on. `<run>` is the configuration's name for the smoke and paper presets at batch 1, and
`<config>@<preset>[-b<batch>]` otherwise (`schema.run_folder`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm  # text bars: tqdm.auto draws ipywidgets bars, a message per update under papermill

from medddpm import REPO
from medddpm.configs import Config, parse_config_list
from medddpm.measure.env import device_name, gpu_slug, pick_device
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
    data = open_dataset((params or {}).get("data") or spec_preset.data, size=size)
    # the preset's model, at this size, must take this data (a BraTS model needs four modalities and labels)
    dataclasses.replace(spec_preset, size=size).spec(mask_channels=data.mask_channels,
                                                     image_channels=getattr(data, "image_channels", 1))
    dev = pick_device(device)
    out = Path(out)
    slug = gpu_slug(gpu_label or device_name(dev))
    root = out / slug / group
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*.stage-*"):  # left by a killed sweep (not by one running alongside: cluster jobs)
        if _stage_is_stale(stale):
            shutil.rmtree(stale, ignore_errors=True)
    params = dict(params or {}) | {"preset": preset, "out": str(out), "gpu_label": gpu_label, "device": device,
                                   "group": group}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results = []
    for config in tqdm(configs, desc=f"sweep {slug}"):
        final = root / run_folder(config.name, preset, batch)
        if (final / "run.parquet").exists() and not force:
            results.append({"config": config.name, "status": "done before", "seconds": 0.0, "folder": str(final)})
            continue
        stage = root / f".{final.name}.stage-{_HOST}-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        t0 = time.perf_counter()
        try:
            old_env = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            pm.execute_notebook(str(notebook), str(stage / "produce.ipynb"), parameters=params | {
                "config": config.name, "stage": str(stage)}, kernel_name="python3", progress_bar=False,
                cwd=str(ROOT), execution_timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
            if not (stage / "run.parquet").exists():
                why = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                write_failed_run(config, preset, stage, device=dev, gpu_label=gpu_label,
                                 message=f"{type(e).__name__}: {why}", batch=batch, group=group)
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _publish(stage, final)
        status = read_table(final / "run.parquet").loc[0, "status"]
        results.append({"config": config.name, "status": status, "seconds": time.perf_counter() - t0,
                        "folder": str(final)})
        print(f"{config.name}: {status} in {results[-1]['seconds']:.0f} s -> {final}", file=sys.stderr)
    return results
