"""Run the producer notebook once per configuration on this machine's device, through papermill.

Each configuration is measured into a staging folder that takes the place of `data/<gpu-slug>/<run>/` in
one atomic step once the notebook has ended (`storage.publish_folder`), so a killed sweep leaves either the
old result or the new one, never a mixture, and the folder is never missing; the next sweep of that
configuration removes what a killed one left (it holds the configuration's lock, so no one else stages it).
A notebook whose kernel dies leaves no table of its own: the sweep removes them and records an `error` row.

A configuration whose folder holds a run of the same identity (`store.identity`: the configuration and its
switches, preset, shape, batch, steps, data and its fingerprint, label) is skipped unless `force` or that run
failed with `error`; a run of another identity is measured beside it, in `<run>~<key>`, never over it. A
failing configuration (out of memory, compile error, a killed kernel) is recorded with its status and the
sweep goes on; the last line says which failed. `<run>` is the configuration's name for the smoke and paper
presets at batch 1, and `<config>@<preset>[-b<batch>][-m<label channels>]` otherwise (`schema.run_folder`).

`<gpu-slug>` is a label: the device type (`nvidia-h200`, `cpu`) while the data tree holds no runs of that
type measured on another machine, else `<device-type>-<host>` (`machine_label`), so that a machine of a
type already in the data is measured beside those rows, never over them; `gpu_label` names it instead.
Each run records its device type (`gpu_type`) and host apart from the label.

A label's roofs (its DRAM bandwidth and dense matmul rates, `medddpm.measure.timing.roofs`) are measured once, before
its first configuration, into ``data/<gpu-slug>/roofs.parquet``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from medddpm import REPO
from medddpm.configs import Config, parse_config_list
from medddpm.measure.env import device_type, gpu_slug, host_name, pick_device, tracked_by_git
from medddpm.train.data import open_dataset
from medddpm.measure.timing import roofs as measure_roofs
from medddpm.measure.run import write_failed_run
from medddpm.presets import get_preset
from medddpm.train.budget import SAMPLING, TRAINING, check_fits
from medddpm.model.unet import ModelSpec, parse_size
from medddpm.measure.validate import check_label, check_label_device, check_text, known_device_types
from medddpm.store.identity import encode, folder_name, key, run_identity, same
from medddpm.store.layout import (KERNEL_LOG, NOTEBOOK_FILE, RUN_FILE, SEPARATOR, is_run, leftover_of, leftover_patterns,
                                   old_folder, run_folder, run_lock_file, run_table, stage_folder)
from medddpm.store.lock import output_lock
from medddpm.store.schema import PHASES, read_table, write_table
from medddpm.store.storage import Interrupted, open_regular, publish_folder, recover_folder, storage_error

ROOT = REPO
NOTEBOOK = ROOT / "notebooks" / NOTEBOOK_FILE


def _run_host(path: Path) -> str:
    """The host recorded in a run.parquet; '' for rows written before hosts were recorded (committed ones)."""
    try:
        with open_regular(path, "a run table") as f:  # never a named pipe, which would block the sweep
            if "host" not in pq.read_schema(f).names:
                return ""
            f.seek(0)
            return str(pq.read_table(f, columns=["host"]).column("host")[0])
    except (OSError, ValueError, IndexError):
        return ""


def machine_label(out: str | os.PathLike, device) -> str:
    """The folder name under `out` for this machine's runs: its device type while `out/<type>/` holds no run
    measured elsewhere (a first run of a type, or this machine's own), else `<type>-<host>`: the committed
    rows of the type stay as measured and this machine's sit beside them, found again by a later sweep here."""
    kind, here = device_type(device), host_name()
    folder = Path(out) / kind
    runs = [*folder.glob(f"*/{RUN_FILE}"), *folder.glob(f"*/*/{RUN_FILE}")]  # main runs, and groups (ablation/)
    return f"{kind}-{here}" if any(_run_host(p) != here for p in runs) else kind


def label_for(out: str | os.PathLike, device, gpu_label: str | None) -> str:
    """The label of this machine's rows under `out`: `gpu_label` where given (checked: it may not name another
    device type than this one), else `machine_label`."""
    if gpu_label is None:
        return machine_label(out, device)
    check_label(gpu_label)
    check_label_device(gpu_label, device_type(device), known_device_types(out))
    return gpu_label


def _kernel_manager():
    """The producer notebook's kernel manager: the kernel talks to papermill over local sockets (IPC) in a
    private folder, not over TCP ports, so it warns of no unencrypted transport and no other user can reach it.
    The kernel process's own output (what native libraries print, such as the profiler's "USDT ... profiler_start"
    lines, and a crash's last words) goes to the `output_log` file set before each run, not to the sweep's terminal."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    sockets = tempfile.mkdtemp(prefix="medddpm-kernel-")

    class LocalKernelManager(AsyncKernelManager):
        output_log: Path | None = None

        @default("transport")
        def _default_transport(self):
            return "ipc"

        @default("ip")
        def _default_ip(self):
            return os.path.join(sockets, "kernel")

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            if self.output_log is None:
                return await super()._async_launch_kernel(kernel_cmd, **kw)
            with open(self.output_log, "ab") as f:  # the kernel holds its own copy of the descriptor
                return await super()._async_launch_kernel(kernel_cmd, **kw | {"stdout": f, "stderr": f})

    return LocalKernelManager, sockets


FAILED = ("error", "oom")  # statuses of a configuration that did not give its measurement


def recorded(final: Path) -> tuple[str, str] | None:
    """(identity, status) of the run in `final`, None where it holds none or an unreadable one."""
    try:
        row = read_table(run_table(final, "run")).iloc[0]
    except (OSError, ValueError, IndexError):
        return None
    return str(row["identity"]), str(row["status"])


def _leftovers(root: Path, plain: str) -> list[Path]:
    """Staging and replaced folders of the runs named `plain` (`plain`, `plain~<key>`) left by a killed sweep."""
    return sorted(p for pattern in leftover_patterns(plain) for p in root.glob(pattern) if p.is_dir())


def _clean(root: Path, plain: str) -> None:
    """Put back a result a crash took out of place, then remove every leftover: the caller holds the lock of
    `plain`, so no other sweep stages these folders now, whatever process or host left them."""
    leftovers = _leftovers(root, plain)
    for final in {leftover_of(p.name) for p in leftovers if ".old-" in p.name}:
        recover_folder(root / final, [p for p in leftovers if p.name.startswith(f".{final}.old-")])
    for p in _leftovers(root, plain):
        shutil.rmtree(p, ignore_errors=True)


def _stamp(path: Path, identity: str) -> None:
    """Record the sweep's identity of the run in its row."""
    df = read_table(path)
    write_table(df.assign(identity=identity), path, "run")


def _discard_partial(stage: Path) -> None:
    """A measurement that died before its run.parquet (its kernel killed) leaves the tables it had written
    under its own run id: removed, so that the error row the sweep writes stands alone."""
    for p in stage.glob("*.parquet"):
        p.unlink()


def run_lock(folder: str | os.PathLike, what: str):
    """The lock of a run folder and of every run of its name (`<config>~<key>` too), held beside them: one
    writer at a time, a sweep or `counters` (`store.lock.output_lock`)."""
    folder = Path(folder)
    plain = folder.name.split(SEPARATOR)[0]
    return output_lock(folder.parent / plain, what=what, lock_file=run_lock_file(folder.parent, plain))


def _last_words(stage: Path) -> str:
    """'; the kernel last wrote: <line>' from a dead kernel's log (a native library's error), or ''."""
    log = stage / KERNEL_LOG
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return f"; the kernel last wrote: {lines[-1][:200]}" if lines else ""


def _make_stage(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir(parents=True)
    except OSError as e:
        raise storage_error(stage, e) from None


def _run_notebook(pm, notebook: Path, stage: Path, parameters: dict, *, env: dict, manager,
                  timeout_s: int | None) -> Exception | None:
    """Run the producer notebook into `stage`; the exception that stopped it (an error in a cell, a dead
    kernel), or None where it ran to its end."""
    old_env = {k: os.environ.get(k) for k in env}
    manager.output_log = stage / KERNEL_LOG
    try:
        os.environ.update(env)
        pm.execute_notebook(str(notebook), str(stage / NOTEBOOK_FILE), parameters=parameters,
                            kernel_name="python3", progress_bar=False, cwd=str(ROOT), execution_timeout=timeout_s,
                            kernel_manager_class=manager)
    except Exception as e:  # noqa: BLE001 - one configuration's failure must not stop the sweep
        return e
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        log = stage / KERNEL_LOG
        if log.exists() and log.stat().st_size == 0:
            log.unlink()
    return None



@dataclasses.dataclass(frozen=True)
class Plan:
    """A configuration as a sweep measures it: its run folder's plain name (`layout.run_folder`), the identity it
    measures, and the default identity of that folder name (`store.identity.folder_name`)."""

    config: Config
    plain: str
    identity: str
    default: str


@dataclasses.dataclass(frozen=True)
class _Settings:
    """A sweep's parameters, checked, and what they make of the preset's model and data."""

    preset: str
    params: dict
    batch: int
    mask_variant: int | None
    source: str
    shape: tuple
    default_shape: tuple
    spec: ModelSpec  # the model each configuration trains: the preset's, at the sweep's size, for its data


def _settings(preset: str, params: dict | None, gpu_label: str | None = None) -> _Settings:
    """Check a sweep's parameters (one-line ValueErrors, before any work) and open its data."""
    spec_preset = get_preset(preset)
    params = dict(params or {})
    if "steps" in params:  # a step is an optimizer step; the timing loop times micro-steps
        raise ValueError("parameter steps: a sweep times micro-steps; name the count micro_steps")
    size = parse_size(params.get("size") or spec_preset.size)
    batch = params.get("batch", 1)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"parameter batch must be a positive int, got {batch!r}")
    sample_steps = params.get("sample_steps")
    if sample_steps is not None and (not isinstance(sample_steps, int) or isinstance(sample_steps, bool)
                                     or sample_steps < 2):
        raise ValueError(f"parameter sample_steps must be an int of at least 2 (the first step is untimed), "
                         f"got {sample_steps!r}")
    unknown = {p.strip() for p in str(params.get("phases", "")).split(",") if p.strip()} - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}")
    if gpu_label is not None:  # before the data is opened or a folder made: the label names them
        check_label(gpu_label)
    # an empty name is refused by open_dataset, never taken for the preset's embedded data
    source = spec_preset.data if params.get("data") is None else params["data"]
    resample = bool(params.get("resample_mask"))
    data = open_dataset(source, size=size, resample_mask=resample)
    mask = params.get("mask_channels")
    mask_variant = mask if mask not in (None, data.mask_channels) else None  # the data's own width: no variant
    if mask_variant is not None:
        data = open_dataset(source, size=size, mask_channels=mask_variant, resample_mask=resample)
    # the preset's model, at this size, must take this data (a BraTS model needs four modalities and labels)
    image_channels = getattr(data, "image_channels", 1)
    spec = dataclasses.replace(spec_preset, size=size).spec(mask_channels=data.mask_channels,
                                                            image_channels=image_channels)
    default_shape = spec_preset.spec(mask_channels=data.mask_channels, image_channels=image_channels).shape
    return _Settings(preset, params, batch, mask_variant, source, spec.shape, default_shape, spec)


def _plans(configs: list[Config], s: _Settings, slug: str, group: str) -> list[Plan]:
    spec_preset = get_preset(s.preset)

    def identity(config: Config, given: dict, size_shape, data_source) -> str:
        return encode(run_identity(
            config=config.name, switches=config.flags, preset=s.preset, shape="x".join(map(str, size_shape)),
            batch=s.batch, warmup=given.get("warmup", spec_preset.warmup),
            steps=given.get("micro_steps") or spec_preset.micro_steps,
            sample_steps=given.get("sample_steps") or spec_preset.sample_steps, data=data_source,
            mask_channels=s.mask_variant, label=slug, group=group,
            resample_mask=bool(s.params.get("resample_mask"))))

    return [Plan(c, run_folder(c.name, s.preset, s.batch, s.mask_variant), identity(c, s.params, s.shape, s.source),
                 identity(c, {}, s.default_shape, spec_preset.data)) for c in configs]


def plan_runs(configs: str | list[Config], *, preset: str, gpu_label: str, params: dict | None = None,
          group: str = "") -> list[Plan]:
    """What a sweep of `configs` under `gpu_label` (with the sweep's `params`) would measure, configuration by
    configuration; nothing is measured or written."""
    configs = parse_config_list(configs) if isinstance(configs, str) else configs
    return _plans(configs, _settings(preset, params, gpu_label), gpu_slug(gpu_label), group)


def measured_before(configs: str | list[Config], *, preset: str, gpu_label: str, out: str | os.PathLike = "data",
                    params: dict | None = None, group: str = "") -> dict[str, Path | None]:
    """Each configuration's folder under ``out/<label>/<group>/`` that holds a run the same sweep would skip (one of
    its identity, or a row recorded before identities were, that did not fail with `error`); None for those it
    would measure."""
    root = Path(out) / gpu_slug(gpu_label) / group
    found = {}
    for p in plan_runs(configs, preset=preset, gpu_label=gpu_label, params=params, group=group):
        final = final_folder(root, p.plain, p.identity, p.default)
        found[p.config.name] = final if stands(recorded(final), p.identity) else None
    return found


def sweep(configs: str | list[Config], *, preset: str = "smoke", out: str | os.PathLike = "data",
          device: str | None = None, gpu_label: str | None = None, force: bool = False,
          params: dict | None = None, notebook: Path = NOTEBOOK, timeout_s: int | None = None,
          group: str = "", roofs: bool = True, replace_committed: tuple[str, ...] = (),
          force_memory: bool = False) -> list[dict]:
    """Measure each configuration; returns one {config, status, seconds, folder} per configuration.

    A configuration whose training step (or sample, where that phase runs) is estimated to exceed the device's
    memory (`train.budget`) is refused in one line before any work, unless `force_memory`.

    `group`: runs that belong together apart from the main ones, in ``data/<gpu-slug>/<group>/<run>/``
    (the ablation's). Each configuration's folder is locked for the whole sweep (`store.lock`): a second
    sweep of one of them fails at once, before any work, naming the first. `roofs`: measure the label's
    bandwidth and matmul rates first where ``out/<label>/roofs.parquet`` does not exist (`measure.timing.roofs.ensure`),
    while the device is idle.

    A run that git tracks (a committed row of `data/`) is replaced, by `force` or as a failed run measured again,
    only where `replace_committed` names its configuration: otherwise the sweep is refused before any work, in one
    line naming the committed runs it would replace."""
    import papermill as pm  # imported here: the package itself does not need the Jupyter stack

    # Everything that can be checked is checked before any configuration runs.
    configs = parse_config_list(configs) if isinstance(configs, str) else configs
    settings = _settings(preset, params, gpu_label)
    params = dict(settings.params)
    batch, mask_variant = settings.batch, settings.mask_variant
    for option, text in (("--out", str(out)), ("--data", settings.source), ("--device", device)):
        check_text(option, text)
    dev = pick_device(device)
    # what cannot fit the device is refused here, not recorded as a failed run after the attempt
    sampled = "sample" in str(params.get("phases", ",".join(PHASES))).split(",")
    for kind, volumes in ((TRAINING, batch), (SAMPLING, batch if sampled else 0)):
        if volumes and (note := check_fits(settings.spec, configs, dev, force=force_memory, kind=kind, batch=volumes)):
            print(note, file=sys.stderr)
    out = Path(out)
    gpu_label = label_for(out, dev, gpu_label)
    slug = gpu_slug(gpu_label)
    root = out / slug / group
    plans = [(p.config, p.plain, p.identity, p.default) for p in _plans(configs, settings, slug, group)]
    params |= {"preset": preset, "out": str(out), "gpu_label": gpu_label, "device": device, "group": group}
    # TQDM_DISABLE: the producer's progress bars, streamed into the stored notebook, would be kept there as hundreds
    # of redraws a run (the appendix renders every stored notebook); the sweep shows its own progress
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "TQDM_DISABLE": "1"}
    results = []
    with contextlib.ExitStack() as held:
        for plain in dict.fromkeys(plain for _, plain, _, _ in plans):
            held.enter_context(run_lock(root / plain, "sweep"))
            _clean(root, plain)
        finals = [final_folder(root, plain, ident, default) for _, plain, ident, default in plans]
        committed = _committed(root, [c for c, *_ in plans], finals, [ident for _, _, ident, _ in plans], force,
                               replace_committed)
        if roofs:  # once per label: every figure that uses a card's peaks reads them
            measure_roofs.ensure(out, slug, dev)
        manager, sockets = _kernel_manager()
        held.callback(shutil.rmtree, sockets, ignore_errors=True)
        try:  # Ctrl-C: one line saying what is kept
            for i, ((config, plain, ident, default), final) in enumerate(zip(plans, finals), 1):
                before = recorded(final)
                if stands(before, ident, force):
                    results.append({"config": config.name, "status": "done before", "seconds": 0.0,
                                    "folder": str(final)})
                    done, again = (("committed", f"--force --replace-committed {config.name}") if final in committed
                                   else ("measured before", "--force"))
                    print(f"[{i}/{len(plans)}] {config.name}: {done} in {final} ({again} measures it again)",
                          file=sys.stderr)
                    continue
                print(f"[{i}/{len(plans)}] {config.name}: measuring into {final} ...", file=sys.stderr, flush=True)
                stage, old = stage_folder(final, os.getpid()), old_folder(final, os.getpid())
                t0 = time.perf_counter()
                try:
                    _make_stage(stage)
                    error = _run_notebook(pm, notebook, stage, params | {"config": config.name, "stage": str(stage)},
                                          env=env, manager=manager, timeout_s=timeout_s)
                    if error is not None and not is_run(stage):
                        _discard_partial(stage)
                        why = f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[-1] \
                            + _last_words(stage)
                        if before is not None:  # a finished run is there: it stays as it was, nothing is lost
                            shutil.rmtree(stage, ignore_errors=True)
                            results.append({"config": config.name, "status": "error",
                                            "seconds": time.perf_counter() - t0, "folder": str(final)})
                            print(f"[{i}/{len(plans)}] {config.name}: error: {why}; {final} kept as it was",
                                  file=sys.stderr)
                            continue
                        write_failed_run(config, preset, stage, device=dev, gpu_label=gpu_label, message=why,
                                         batch=batch, group=group, mask_variant=mask_variant)
                    _stamp(run_table(stage, "run"), ident)
                    publish_folder(stage, final, old)
                except BaseException:  # a full disk, an interrupt: the folder as it was, and no stage taking space
                    with contextlib.suppress(OSError):
                        recover_folder(final, [old])
                    shutil.rmtree(stage, ignore_errors=True)
                    raise
                for p in _leftovers(root, plain):
                    shutil.rmtree(p, ignore_errors=True)
                run = read_table(run_table(final, "run")).iloc[0]
                results.append({"config": config.name, "status": run["status"], "seconds": time.perf_counter() - t0,
                                "folder": str(final)})
                took = (f"{run['train_median_ms']:.1f} ms a training micro-step" if run["status"] == "ok"
                        else run["message"])
                print(f"[{i}/{len(plans)}] {config.name}: {run['status']} in {results[-1]['seconds']:.0f} s: {took}",
                      file=sys.stderr)
        except KeyboardInterrupt:
            name = plans[len(results)][0].name if len(results) < len(plans) else "none"
            raise Interrupted(f"the runs finished so far are kept in {root}, the one being measured ({name}) is as "
                              "it was before; the same command measures the rest") from None
    print(outcome(results), file=sys.stderr)
    return results


def final_folder(root: Path, plain: str, ident: str, default: str) -> Path:
    """The folder a configuration's run of identity `ident` is published in."""
    final = root / folder_name(plain, ident, default)
    found = (recorded(final) or (ident,))[0]
    if final.name == plain and found and not same(found, ident):
        final = root / f"{plain}{SEPARATOR}{key(ident)}"  # the default slot holds another definition
    return final


def stands(before: tuple[str, str] | None, ident: str, force: bool = False) -> bool:
    """Whether the run found in a folder stands: one of this identity that did not fail with `error`."""
    return before is not None and (before[0] == "" or same(before[0], ident)) and before[1] != "error" and not force


def _committed(root: Path, configs: list[Config], finals: list[Path], idents: list[str], force: bool,
               named: tuple[str, ...]) -> set[Path]:
    """The folders among `finals` whose run git tracks; refuse (one line naming them) where the sweep would replace
    one whose configuration `named` does not hold."""
    tracked = tracked_by_git(root, [run_table(f.absolute(), "run") for f in finals])
    committed = {f for f in finals if run_table(f.absolute(), "run") in tracked}
    replaced = [c.name for c, f, ident in zip(configs, finals, idents)
                if f in committed and not stands(recorded(f), ident, force)]
    unnamed = [name for name in replaced if name not in named]
    if unnamed:
        raise ValueError(f"this sweep would replace committed run(s) in {root}: {', '.join(unnamed)} (tracked by "
                         f"git); measure under another --gpu-label, or name them: --replace-committed "
                         f"{','.join(replaced)}")
    return committed


def outcome(results: list[dict]) -> str:
    """One line: how many configurations gave their measurement, and which did not (with their status)."""
    failed = [r for r in results if r["status"] in FAILED]
    line = f"{len(results) - len(failed)} of {len(results)} configuration(s) measured"
    if failed:
        line += "; failed: " + ", ".join(f"{r['config']} ({r['status']})" for r in failed)
    return line


def failed(results: list[dict]) -> bool:
    """Whether a configuration of the sweep did not give its measurement (the command exits 1 then)."""
    return any(r["status"] in FAILED for r in results)


def _main_runs(folder: Path) -> list:
    """The run rows of `folder`'s main runs (`data/<label>/<config>/`, not those of another identity), in
    configuration order."""
    from medddpm.configs import CONFIGS

    rows = [read_table(p).iloc[0] for p in sorted(folder.glob(f"*/{RUN_FILE}")) if SEPARATOR not in p.parent.name]
    rows = [r for r in rows if run_folder(r["config"], r["preset"], max(int(r["batch"]), 1)) == r["config"]]
    order = {name: k for k, name in enumerate(CONFIGS)}
    return sorted(rows, key=lambda r: (order.get(r["config"], len(order)), r["config"]))
