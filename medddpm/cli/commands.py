"""What each subcommand of `python -m medddpm` does: one `cmd_<name>(args)` per subcommand, its options parsed
by `medddpm.cli.parser`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from medddpm.configs import CONFIGS, ConfigError, parse_config_list, resolve
from medddpm.model.unet import format_size
from medddpm.store.storage import atomic_write
from medddpm.cli.args import WIDTH, config_from, open_data, spec_from


def check_memory(args, spec, configs, device, *, sampling: int = 0, training: bool = True, batch: int = 1,
                 advice: str | None = None) -> None:
    """Refuse in one line, before any work, what cannot fit `device` (`train.budget`): a training step of `batch`
    volumes under each configuration where `training`, a denoising step of `sampling` volumes at once where
    given; with --force-memory, print the estimate and go on."""
    from medddpm.train.budget import SAMPLING, TRAIN_ADVICE, TRAINING, check_fits

    for kind, volumes in ((TRAINING, batch if training else 0), (SAMPLING, sampling)):
        if volumes:
            note = check_fits(spec, configs, device, force=args.force_memory, kind=kind, batch=volumes,
                              advice=TRAIN_ADVICE if advice is None else advice)
            if note:
                print(note, file=sys.stderr)


def cmd_info(args) -> None:
    from medddpm.model.flops import count

    spec = spec_from(args)
    info = {"size": spec.size, "shape": list(spec.shape), "in_channels": spec.in_channels,
            "out_channels": spec.image_channels, "num_res_blocks": spec.num_res_blocks,
            "channel_mult": list(spec.mult), "channels": [m * spec.base_channels for m in spec.mult],
            "attention_tokens": max(spec.attention_tokens())} | count(spec)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    where = "encoder, decoder and middle" if spec.attention_ds else "the middle block only"
    print(f"Med-DDPM 3D U-Net, {format_size(spec.size)}{'^3' if isinstance(spec.size, int) else ''}, "
          f"{spec.in_channels} channels in, {spec.image_channels} out, {spec.num_res_blocks} residual block(s) a level")
    print(f"  channels per level   {info['channels']}, attention in {where} (at most {info['attention_tokens']} tokens)")
    print(f"  parameters           {info['parameters']:,}")
    print(f"  forward FLOPs        {info['forward_flops'] / 1e12:.3f} T per micro-step (batch 1)")
    for op, flops in info["forward_flops_by_op"].items():
        print(f"    {op:<18} {flops / 1e9:,.1f} G")
    print(f"  forward+backward     {info['train_flops'] / 1e12:.2f} T per micro-step")


def cmd_saved(args) -> None:
    from medddpm.measure.env import git_commit
    from medddpm.measure.memory.partition import activation_bytes, partition_row, record, saved_tensors, summary

    spec = spec_from(args)
    configs = parse_config_list(args.configs)
    eager = [c.name for c in configs if not c.compile]
    if eager:  # every name checked before the first trace
        raise ConfigError(f"not compiled, so no partition to read: {', '.join(eager)}")
    if args.write and (args.preset is None or args.size or args.base_channels or args.mask_channels):
        raise ValueError("--write records a preset's model: give --preset alone, without --size, --base-channels "
                         "or --mask-channels")
    # taken before the first row is written: the table is in the repository, so writing it dirties the tree
    commit = git_commit()
    for config in configs:
        saved = saved_tensors(spec, config)
        print(f"{config.name}: {(~saved['input']).sum()} activations saved for the backward, "
              f"{activation_bytes(saved) / 2**30:.3f} GiB")
        for row in summary(saved, min_bytes=int(args.min_mib * 2**20)).itertuples():
            print(f"  {row.count:3d} x {'x'.join(map(str, row.shape)):<22} {row.dtype:<9} {row.gib:7.3f} GiB")
        if args.write:
            record(args.write, partition_row(spec, args.preset, config, commit=commit))
            print(f"  recorded in {args.write}")


def cmd_peak(args) -> None:
    from medddpm.measure.memory.snapshot import describe

    print("\n\n".join(describe(path, top=args.top, trust_pickle=args.trust_pickle) for path in args.snapshots))


def cmd_configs(args) -> None:
    from medddpm.measure.env import pick_device

    device = pick_device(args.device)
    rows = []
    for c in CONFIGS.values():
        rows.append({"name": c.name, **c.flags, "description": c.description,
                     "not_applicable_here": resolve(c, device).not_applicable})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    if args.wide:  # every switch a column: wider than a terminal, for a pager or a file
        keys = list(CONFIGS["baseline"].flags)
        print(f"{'name':<12}" + "".join(f"{k:<20}" for k in keys))
        for r in rows:
            print(f"{r['name']:<12}" + "".join(f"{str(r[k]):<20}" for k in keys))
            print(f"{'':<12}{r['description']}")
            for flag, why in r["not_applicable_here"].items():
                print(f"{'':<12}not applicable on {device.type}: {flag}: {why}")
        return
    import textwrap

    name_w = max(len(r["name"]) for r in rows) + 2
    indent = " " * (name_w + 11)
    print(f"{'name':<{name_w}}{'precision':<11}what it is")
    for r in rows:
        lines = textwrap.wrap(r["description"], WIDTH - len(indent), max_lines=2, placeholder=" ...")
        if r["not_applicable_here"]:
            lines.append(f"(not applicable on {device.type}: {', '.join(r['not_applicable_here'])})")
        print(f"{r['name']:<{name_w}}{r['precision']:<11}{lines[0]}")
        for line in lines[1:]:
            print(indent + line)
    print("\nEvery switch of each: configs --wide (or --json); one switch changed: NAME+switch=value")


def cmd_claims(args) -> None:
    import textwrap
    from pathlib import Path

    from medddpm import report
    from medddpm.report import claims
    from medddpm.report.convergence import load_study

    if args.data is not None and not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data}: no such folder (a data tree such as data/)")
    data = report.load_all(args.data)
    table = claims.verdicts(data, study=load_study(args.data))
    if args.json:
        print(claims.as_json(table))
        return
    cpus = set(data.run.loc[data.run["gpu_type"] == "cpu", "gpu_slug"])  # every CPU label: cpu, cpu-<host>
    for slug, rows in table.groupby("gpu_slug", sort=False):
        counts, judged = rows["verdict"].value_counts(), rows["judged"].value_counts()
        print(f"{slug}: " + ", ".join(f"{counts.get(v, 0)} {v}" for v in claims.VERDICTS)
              + f"; {len(rows) - counts.get(report.NA, 0)} judged, {judged.get(claims.IN_PART, 0)} of them in part")
    if cpus & set(table["gpu_slug"]):
        print(f"  {', '.join(sorted(cpus & set(table['gpu_slug'])))}: {claims.ON_CPU}")
    gpus = table[~table["gpu_slug"].isin(cpus)]
    said = claims.settle_text(gpus).replace("**", "").replace("`", "")
    # a command's paths keep their hyphens on one line (nvidia-h100-80gb-hbm3), so that they copy whole
    print("\n" + "\n".join(textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False)
                            for line in said.split("\n") if line))
    width = max((len(s) for s in gpus["gpu_slug"]), default=0) + 2
    for _, rows in gpus.groupby("claim_id", sort=False):  # each card's verdict side by side
        r = rows.iloc[0]
        about = ", ".join(filter(None, [r["scope"], f"paper: {r['paper']}" if r["paper"] else "",
                                        f"the paper's card: {r['paper_card']}" if r["paper_card"] else ""]))
        print(f"\n{r['short']} [{about}]")
        for d in rows.itertuples():
            print(f"  {d.gpu_slug:<{width}}{d.verdict}" + (f" ({d.judged})" if d.judged == claims.IN_PART else ""))
            print(textwrap.fill(d.evidence, 100, initial_indent=" " * (width + 2),
                                subsequent_indent=" " * (width + 2), break_on_hyphens=False))


def cmd_train(args) -> None:
    from medddpm.measure.env import pick_device
    from medddpm.store.lock import output_lock
    from medddpm.train.loop import check_lr, train

    check_lr(args.lr)
    config = config_from(args)
    device = pick_device(args.device)
    # before the data is read or generated: a step that cannot fit is refused while nothing has been done (the
    # data's label channels are not known yet: a preset's own, else one, the least, so the estimate stays a lower
    # bound)
    check_memory(args, spec_from(args, None if args.preset else args.mask_channels or 1), [config], device)
    with output_lock(args.out, what="training"):  # before the data is read: a second training fails at once
        data = open_data(args)
        spec = spec_from(args, data.mask_channels, getattr(data, "image_channels", 1))
        engine = train(spec, config, data, out_dir=args.out, steps=args.steps, device=device, grad_accum=args.grad_accum,
                       lr=args.lr, seed=args.seed, save_every=args.save_every, log_every=args.log_every,
                       allow_changed=args.allow_changed)
    for flag, why in engine.run.not_applicable.items():
        print(f"note: {flag} not applicable on {device.type}: {why}", file=sys.stderr)
    print(f"trained {engine.step_count} steps; checkpoint in {Path(args.out) / 'checkpoint.pt'}")


def cmd_sample(args) -> None:
    from medddpm.measure.env import pick_device
    from medddpm.train.sampling import generate, label_volume, load_checkpoint, write_nifti

    device = pick_device(args.device)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a folder")
    engine = load_checkpoint(args.checkpoint, device=device, use_ema=not args.no_ema, compiled=args.compiled)
    # the checkpoint's model, at the size it says: refused before a label map is read or made at that size
    check_memory(args, engine.spec, [engine.config], device, training=False, sampling=1, advice="")
    # every label map checked against the model's shape and width before the first sample: none is refused later
    volumes = [label_volume(source, size=engine.spec.size, mask_channels=engine.spec.mask_channels)
               for source in args.labels]
    for i, labels in enumerate(volumes):
        image = generate(engine, labels, seed=args.seed + i)
        stem = f"sample_{i:03d}"
        write_nifti(out / "image" / f"{stem}.nii.gz", image[0] if image.shape[0] == 1 else image)
        write_nifti(out / "mask" / f"{stem}.nii.gz", labels)
        print(f"wrote {out / 'image' / stem}.nii.gz")


def cmd_bench(args) -> None:
    from medddpm.measure.timing.bench import bench_sample, bench_train, write_bench
    from medddpm.measure.env import environment, pick_device
    from medddpm.store.layout import BENCH_FILE, snapshot_name

    if args.reference and args.phase == "sample":
        raise ValueError("--reference times training steps only; drop it or use --phase train")
    configs = parse_config_list(args.configs)
    if args.memory_snapshot:
        if args.phase != "train":
            raise ValueError("--memory-snapshot records a training step; drop it or use --phase train")
        graphed = [c.name for c in configs if c.cuda_graphs]
        if graphed:
            raise ValueError(f"--memory-snapshot: {', '.join(graphed)} replay a CUDA graph, which allocates nothing; "
                             f"add +cuda_graphs=false to the name")
    device = pick_device(args.device)
    if args.memory_snapshot:
        if device.type != "cuda":
            raise ValueError(f"--memory-snapshot records the CUDA caching allocator; {device} has none")
        Path(args.memory_snapshot).mkdir(parents=True, exist_ok=True)
    spec = spec_from(args)
    if args.reference and not (Path(args.reference) / "diffusion_model" / "unet.py").is_file():
        raise FileNotFoundError(f"{args.reference}: not a clone of mobaidoctor/med-ddpm (no diffusion_model/unet.py)")
    sampling = args.phase == "sample"
    check_memory(args, spec, configs, device, training=not sampling, sampling=int(sampling))
    results = {"environment": environment(device), "spec": spec.__dict__ | {"mult": list(spec.mult)},
               "phase": args.phase, "runs": []}
    bench = bench_sample if args.phase == "sample" else bench_train
    timed = {"steps" if args.phase == "sample" else "micro_steps": args.micro_steps}  # denoising steps or micro-steps

    def snapshot(c):  # memory-<config as letters, digits, '_', '.', '-'>-<commit>.pickle (`python -m medddpm peak` reads it)
        return Path(args.memory_snapshot) / snapshot_name(c.name, results["environment"]["git_commit"])

    jobs = [lambda c=c: bench(spec, c, device=device, warmup=args.warmup, **timed, seed=args.seed,
                              kernels=args.kernels or 0, **({"snapshot": snapshot(c)} if args.memory_snapshot else {}))
            for c in configs]
    if args.reference:
        from medddpm.measure.timing.reference import bench_reference

        jobs += [lambda p=p: bench_reference(args.reference, spec, precision=p, device=device, warmup=args.warmup,
                                             micro_steps=args.micro_steps, seed=args.seed)
                 for p in args.reference_precisions.split(",")]
    source = args.source or f"bench {results['environment']['time_utc']}"
    for job in jobs:
        results["runs"].append(job())
        # after every run, atomically: a later failure keeps what was measured
        if args.json:
            atomic_write(args.json, lambda f: f.write(json.dumps(results, indent=1).encode()))
        if args.out:
            write_bench(args.out, results, source=source)
    stats = (("train_median_ms", "train_p10_ms", "train_p90_ms") if args.phase == "train" else
             ("sample_step_median_ms", "sample_step_p10_ms", "sample_step_p90_ms"))
    print(f"{args.phase} steps")
    print(f"{'run':<40}{'median ms':>10}{'p10':>9}{'p90':>9}{'peak GiB':>10}{'first warm-up s':>17}")
    for r in results["runs"]:
        mem = r["peak_mem_bytes"] / 2**30 if r["peak_mem_bytes"] else float("nan")
        median, p10, p90 = (r[k] for k in stats)
        print(f"{r['config']:<40}{median:>10.1f}{p10:>9.1f}{p90:>9.1f}{mem:>10.2f}"
              f"{(r['warmup_ms'] or [float('nan')])[0] / 1e3:>17.1f}")
    if args.out:
        print(f"wrote {Path(args.out) / BENCH_FILE} (source {source!r})")
    for r in results["runs"]:
        if "category_us" in r:
            cats = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in r["category_us"].items())
            print(f"{r['config']}: kernels {r['kernel_us'] / 1e3:.2f} ms a step ({cats})")
            for k in r["top_kernels"]:
                print(f"  {k['total_us'] / 1e3:8.3f} ms {k['calls']:6.0f}x  {k['category']:<13} {k['short_name']}")


def cmd_study(args) -> None:
    from medddpm.measure.env import pick_device
    from medddpm.measure.study.convergence import Settings, study, summary, unfinished

    settings = Settings(size=args.size, base_channels=args.base_channels, steps=args.steps, pairs=args.pairs,
                        lr=args.lr, grad_accum=args.grad_accum, samples=args.samples, label_maps=args.label_maps,
                        sample_steps=args.sample_steps)
    configs = parse_config_list(args.configs)  # every name checked before any work
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    for device in devices or [args.device]:  # a run trains, then samples `samples` volumes at once
        check_memory(args, settings.spec, configs, pick_device(device), sampling=settings.samples,
                     advice="choose a smaller --size or --samples, or")
    configs = [c.name for c in configs]
    tables = study(configs, args.seeds, settings, out=args.out, work=args.work, device=args.device, devices=devices,
                   gpu_label=args.gpu_label, jobs=args.jobs, force=args.force, time_limit=args.time_limit,
                   keep_checkpoints=args.keep_checkpoints)
    table, left = summary(tables), unfinished(tables)
    if table.empty:
        print(f"no run finished ({left}); the study's runs.parquet under {args.out} records each one's status and "
              "message" if left else "no finished runs yet")
        exit_if_errors(tables)
        return
    print(f"{'configuration':<16}{'runs':>5}{'label_dice':>12}{'seed sd':>9}{'hist_w1':>9}{'ms_ssim':>9}"
          f"{'skipped':>9}{'train s':>9}")
    for r in table.itertuples():
        print(f"{r.config:<16}{r.runs:>5}{r.label_dice:>12.3f}{r.label_dice_sd:>9.3f}{r.hist_w1:>9.3f}"
              f"{r.ms_ssim:>9.3f}{r.skipped_steps:>9.0f}{r.train_s:>9.0f}")
    if left:
        print(f"not finished: {left}")
    exit_if_errors(tables)


def exit_if_errors(tables: dict) -> None:
    """Exit 1 where a run of the study ended in an error (a diverged run is a result: its configuration's numerics
    failed from that seed); the same command runs it again."""
    if (tables["runs"]["status"] == "error").any():
        sys.exit(1)


def cmd_scale(args) -> None:
    from medddpm.measure.scaling import scale

    path = scale(args.config, args.world_sizes, preset=args.preset, out=args.out, device=args.device,
                 micro_steps=args.micro_steps, warmup=args.warmup)
    print(f"wrote {path}")


def cmd_sweep(args) -> None:
    from medddpm.measure.sweep import sweep

    configs = parse_config_list(args.configs)  # every name checked before any work
    params = {k: getattr(args, k) for k in ("micro_steps", "warmup", "sample_steps", "size", "batch", "mask_channels", "data",
                                            "ncu_timeout", "time_limit") if getattr(args, k) is not None}
    if args.resample_mask:
        params["resample_mask"] = True
    if "size" in params:  # as text: a papermill parameter and a command-line argument alike
        params["size"] = format_size(params["size"])
    params["phases"] = args.phases
    if args.backend == "slurm":
        from medddpm.measure.cluster import SlurmOptions, print_scripts, submit_slurm

        opts = SlurmOptions(partition=args.partition, time_min=args.time_min, cpus_per_task=args.cpus_per_task,
                            mem_gb=args.mem_gb or None, account=args.account, qos=args.qos,
                            constraint=args.constraint, python=args.python, folder=args.slurm_folder,
                            gpu_types=[t.strip() for t in (args.gpu_type or "").split(",") if t.strip()] or [None])
        jobs = submit_slurm(configs, preset=args.preset, out=args.out, opts=opts, params=params, force=args.force,
                            device=args.device, gpu_label=args.gpu_label, dry_run=args.dry_run,
                            force_memory=args.force_memory)
        if args.dry_run:
            print_scripts(jobs)
        else:
            for job in jobs:
                print(f"submitted {job.job_id}  logs: {job.paths.stdout}")
        return
    if args.dry_run:
        raise ValueError("--dry-run prints sbatch scripts: it goes with --backend slurm")
    if args.backend == "local":
        from medddpm.measure.cluster import run_local

        results = run_local(configs, preset=args.preset, out=args.out, params=params, force=args.force,
                            gpu_label=args.gpu_label, force_memory=args.force_memory)
    else:
        results = sweep(configs, preset=args.preset, out=args.out, device=args.device, gpu_label=args.gpu_label,
                        force=args.force, params=params, replace_committed=names(args.replace_committed),
                        force_memory=args.force_memory)
    for r in results:
        print(f"{r['config']:<12}{r['status']:<14}{r['seconds']:>8.0f} s  {r['folder']}")
    exit_if_failed(results)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, as given."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def exit_if_failed(results: list[dict]) -> None:
    """Exit 1 where a configuration failed: the sweep's last line on stderr said which."""
    from medddpm.measure.sweep import failed

    if failed(results):
        sys.exit(1)


def cmd_add_runs(args) -> None:
    from medddpm.measure.add_runs import add_runs

    said = add_runs(args.path, args.out)
    for line in said["added"] + said["kept"]:
        print(line)
    for line in said["refused"]:
        print(f"refused: {line}", file=sys.stderr)
    print(f"{len(said['added'])} added, {len(said['kept'])} already in {args.out} (kept as they were), "
          f"{len(said['refused'])} refused")
    if said["refused"]:
        sys.exit(1)


def cmd_summary(args) -> None:
    from medddpm.measure.summary import summary

    print(summary(args.out, device=args.device, gpu_label=args.gpu_label, book=args.book))


def cmd_ablation(args) -> None:
    from medddpm.configs import ablation
    from medddpm.measure.sweep import sweep

    configs = ablation(args.base)
    params = {k: getattr(args, k) for k in ("micro_steps", "warmup") if getattr(args, k) is not None} | {"phases": ""}
    results = sweep(configs, preset=args.preset, out=args.out, device=args.device, gpu_label=args.gpu_label,
                    force=args.force, params=params, group="ablation",
                    replace_committed=names(args.replace_committed), force_memory=args.force_memory)
    for r in results:
        print(f"{r['config']:<34}{r['status']:<14}{r['seconds']:>8.0f} s  {r['folder']}")
    exit_if_failed(results)


def cmd_roofs(args) -> None:
    from medddpm.measure.timing import roofs
    from medddpm.measure.env import gpu_slug, pick_device
    from medddpm.measure.sweep import label_for
    from medddpm.store.lock import output_lock
    from medddpm.store.schema import read_table

    dev = pick_device(args.device)
    label = gpu_slug(label_for(args.out, dev, args.gpu_label))
    target = roofs.path(args.out, label)
    if target.is_file() and not args.force:
        print(roofs.describe(read_table(target, "roofs")))
        print(f"measured before, in {target} (--force measures them again)")
        return
    with output_lock(target, what="roofs"):  # one measurement of a label at a time
        df = roofs.measure(dev, label=label)
        path = roofs.write(df, args.out)
    print(roofs.describe(df))
    print(f"wrote {path}")


def cmd_sample_batches(args) -> None:
    from medddpm.measure.env import gpu_slug, pick_device
    from medddpm.measure.sweep import machine_label
    from medddpm.measure.timing.sampling import best_batch, parse_batches, sample_batches, write_sample_batches
    from medddpm.measure.validate import check_label
    from medddpm.store.layout import levers_table

    configs = parse_config_list(args.configs)  # every name and batch checked before any work
    batches = parse_batches(args.batches)
    if args.gpu_label is not None:
        check_label(args.gpu_label)
    device = pick_device(args.device)
    spec = spec_from(args)
    label = gpu_slug(args.gpu_label or machine_label(args.out, device))
    path = levers_table(args.out, label, "sample_batches")
    for c in configs:
        rows = sample_batches(spec, c, batches, device=device, warmup=args.warmup, steps=args.micro_steps,
                              seed=args.seed, label=label)
        write_sample_batches(path, rows)  # after each configuration: a later failure keeps what was measured
        for r in rows.itertuples():
            what = f"{r.step_median_ms:8.2f} ms a step, {r.volume_s:7.2f} s a volume" if r.status == "ok" else \
                f"{r.status}: {r.message}"
            print(f"{c.name:<36} batch {r.batch:>3}: {what}")
        for r in best_batch(rows).itertuples():
            print(f"{c.name}: best batch {r.batch}, {r.volume_s:.2f} s a volume ({r.timesteps} steps)")
    print(f"wrote {path}")


def cmd_counters(args) -> None:
    import time

    from tqdm import tqdm

    from medddpm.measure.profile.counters import add_counters, check_run
    from medddpm.measure.run import NCU_MIN_S
    from medddpm.measure.profile.ncu import check_passes
    from medddpm.measure.sweep import run_lock

    check_passes(tuple(args.passes))
    for run in args.runs:  # every folder checked before any GPU work
        check_run(run)
    if args.check:
        return
    start = time.monotonic()
    for run in tqdm(args.runs, desc="counters", unit="run"):
        left = int(args.deadline - (time.monotonic() - start)) if args.deadline else args.timeout
        if args.deadline and left < NCU_MIN_S:
            tqdm.write(f"{run}: not started, {left} s left of the {args.deadline} s deadline")
            continue
        with run_lock(run, "counters"):  # it rewrites the run's tables: not while a sweep measures the run
            status = add_counters(run, timeout_s=min(args.timeout, left), coverage=args.coverage, force=args.force,
                                  passes=tuple(args.passes), merge=args.merge, from_backward=args.from_backward)
        tqdm.write(f"{run}: ncu {status['status']}: {status['message']}; kept {status['kept']}")


def cmd_export_data(args) -> None:
    from medddpm.train.export import export_folder

    files = export_folder(args.out, pairs=args.pairs, layout=args.layout, size=args.size, seed=args.seed)
    print(f"wrote {len(files)} files ({args.layout} layout) under {args.out}")


def interrupted(args) -> str:
    """What Ctrl-C leaves, for a command whose work did not say more itself (`storage.Interrupted`)."""
    if args.command == "train":
        return f"{args.out} keeps its last checkpoint, if one was written; the same command resumes from it"
    if args.command in ("sweep", "ablation"):
        return ("the runs finished before are kept and the one being measured is left as it was; the same command "
                "measures the rest")
    if args.command == "export-data":
        return f"nothing was written to {args.out}; the same command starts again"
    return f"{args.command} stopped before its end"
