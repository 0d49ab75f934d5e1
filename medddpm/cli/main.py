"""Command line: `python -m medddpm {info,configs,train,sample,bench,sweep,study}`; `--help` on each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medddpm.configs import (CONFIGS, ConfigError, parse_config_list, resolve)
from medddpm.train.data import DataError
from medddpm.model.unet import format_size
from medddpm.measure.ncu import BOTH, COVERAGE, PASSES
from medddpm.store.schema import PHASES
from medddpm.store.storage import atomic_write
from medddpm.cli.args import (DEVICE_HELP, PRESET_NAMES, add_config_args, add_device_arg, add_model_args, config_from,
                              fraction, open_data, phases_arg, positive, size_arg, spec_from)

WIDTH = 100  # terminal columns the plain listings fit


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
    from medddpm.measure.partition import activation_bytes, partition_row, record, saved_tensors, summary

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
    from medddpm.measure.snapshot import describe

    print("\n\n".join(describe(path, top=args.top) for path in args.snapshots))


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
    print(f"\nEvery switch of each: configs --wide (or --json); one switch changed: NAME+switch=value")


def cmd_claims(args) -> None:
    import textwrap
    from pathlib import Path

    from medddpm import report
    from medddpm.report import claims

    if args.data is not None and not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data}: no such folder (a data tree such as data/)")
    data = report.load_all(args.data)
    table = claims.verdicts(data)
    if args.json:
        print(claims.as_json(table))
        return
    cpus = set(data.run.loc[data.run["gpu_type"] == "cpu", "gpu_slug"])  # every CPU label: cpu, cpu-<host>
    for slug, rows in table.groupby("gpu_slug", sort=False):
        counts = rows["verdict"].value_counts()
        print(f"{slug}: " + ", ".join(f"{counts.get(v, 0)} {v}" for v in claims.VERDICTS))
        if slug in cpus:
            print(f"  {claims.ON_CPU}")
            continue
        for r in rows.itertuples():
            print(f"  {r.verdict:<15} {r.short}")
            print(textwrap.fill(r.evidence, 100, initial_indent=" " * 18, subsequent_indent=" " * 18))


def cmd_train(args) -> None:
    from medddpm.measure.env import pick_device
    from medddpm.train.loop import train

    config = config_from(args)
    device = pick_device(args.device)
    data = open_data(args)
    spec = spec_from(args, data.mask_channels, getattr(data, "image_channels", 1))
    engine = train(spec, config, data, out_dir=args.out, steps=args.steps, device=device, grad_accum=args.grad_accum,
                   lr=args.lr, seed=args.seed, save_every=args.save_every, log_every=args.log_every)
    for flag, why in engine.run.not_applicable.items():
        print(f"note: {flag} not applicable on {device.type}: {why}", file=sys.stderr)
    print(f"trained {engine.step_count} steps; checkpoint in {Path(args.out) / 'checkpoint.pt'}")


def cmd_sample(args) -> None:
    from medddpm.measure.env import pick_device
    from medddpm.train.sampling import generate, label_volume, load_checkpoint, write_nifti

    device = pick_device(args.device)
    engine = load_checkpoint(args.checkpoint, device=device, use_ema=not args.no_ema, compiled=args.compiled)
    out = Path(args.out)
    for i, source in enumerate(args.labels):
        labels = label_volume(source, size=engine.spec.size)
        image = generate(engine, labels, seed=args.seed + i)
        stem = f"sample_{i:03d}"
        write_nifti(out / "image" / f"{stem}.nii.gz", image[0] if image.shape[0] == 1 else image)
        write_nifti(out / "mask" / f"{stem}.nii.gz", labels)
        print(f"wrote {out / 'image' / stem}.nii.gz")


def cmd_bench(args) -> None:
    from medddpm.measure.bench import bench_sample, bench_train, write_bench
    from medddpm.measure.env import environment, pick_device
    from medddpm.measure.snapshot import snapshot_name

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
    results = {"environment": environment(device), "spec": spec.__dict__ | {"mult": list(spec.mult)},
               "phase": args.phase, "runs": []}
    bench = bench_sample if args.phase == "sample" else bench_train

    def snapshot(c):  # memory-<config as letters, digits, '_', '.', '-'>-<commit>.pickle (`python -m medddpm peak` reads it)
        return Path(args.memory_snapshot) / snapshot_name(c.name, results["environment"]["git_commit"])

    jobs = [lambda c=c: bench(spec, c, device=device, warmup=args.warmup, steps=args.steps, seed=args.seed,
                              kernels=args.kernels or 0, **({"snapshot": snapshot(c)} if args.memory_snapshot else {}))
            for c in configs]
    if args.reference:
        from medddpm.measure.reference import bench_reference

        jobs += [lambda p=p: bench_reference(args.reference, spec, precision=p, device=device, warmup=args.warmup,
                                             steps=args.steps, seed=args.seed)
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
        print(f"wrote {Path(args.out) / 'bench.parquet'} (source {source!r})")
    for r in results["runs"]:
        if "category_us" in r:
            cats = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in r["category_us"].items())
            print(f"{r['config']}: kernels {r['kernel_us'] / 1e3:.2f} ms a step ({cats})")
            for k in r["top_kernels"]:
                print(f"  {k['total_us'] / 1e3:8.3f} ms {k['calls']:6.0f}x  {k['category']:<13} {k['short_name']}")


def cmd_study(args) -> None:
    from medddpm.measure.convergence import Settings, study, summary

    settings = Settings(size=args.size, base_channels=args.base_channels, steps=args.steps, pairs=args.pairs,
                        lr=args.lr, grad_accum=args.grad_accum, samples=args.samples, label_maps=args.label_maps,
                        sample_steps=args.sample_steps)
    configs = [c.name for c in parse_config_list(args.configs)]  # every name checked before any work
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    tables = study(configs, args.seeds, settings, out=args.out, work=args.work, device=args.device, devices=devices,
                   gpu_label=args.gpu_label, jobs=args.jobs, force=args.force, time_limit=args.time_limit,
                   keep_checkpoints=args.keep_checkpoints)
    table = summary(tables)
    if table.empty:
        print("no finished runs yet")
        return
    print(f"{'configuration':<16}{'runs':>5}{'label_dice':>12}{'seed sd':>9}{'hist_w1':>9}{'ms_ssim':>9}"
          f"{'skipped':>9}{'train s':>9}")
    for r in table.itertuples():
        print(f"{r.config:<16}{r.runs:>5}{r.label_dice:>12.3f}{r.label_dice_sd:>9.3f}{r.hist_w1:>9.3f}"
              f"{r.ms_ssim:>9.3f}{r.skipped_steps:>9.0f}{r.train_s:>9.0f}")


def seeds_arg(text: str) -> list[int]:
    """'3': seeds 0, 1, 2; '0,4,7': those seeds."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count (3) or a list of seeds (0,4,7), got {text!r}") from None
    if len(values) == 1 and "," not in text:
        values = list(range(values[0]))
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected a positive count or distinct non-negative seeds, got {text!r}")
    return values


def cmd_scale(args) -> None:
    from medddpm.measure.scaling import scale

    path = scale(args.config, args.world_sizes, preset=args.preset, out=args.out, device=args.device,
                 steps=args.steps, warmup=args.warmup)
    print(f"wrote {path}")


def cmd_sweep(args) -> None:
    from medddpm.measure.sweep import sweep

    configs = parse_config_list(args.configs)  # every name checked before any work
    params = {k: getattr(args, k) for k in ("steps", "warmup", "sample_steps", "size", "batch", "mask_channels", "data",
                                            "ncu_timeout", "time_limit") if getattr(args, k) is not None}
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
                            device=args.device, gpu_label=args.gpu_label, dry_run=args.dry_run)
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
                            gpu_label=args.gpu_label)
    else:
        results = sweep(configs, preset=args.preset, out=args.out, device=args.device, gpu_label=args.gpu_label,
                        force=args.force, params=params)
    for r in results:
        print(f"{r['config']:<12}{r['status']:<14}{r['seconds']:>8.0f} s  {r['folder']}")


def cmd_summary(args) -> None:
    from medddpm.measure.sweep import summary

    print(summary(args.out, device=args.device, gpu_label=args.gpu_label, book=args.book))


def cmd_ablation(args) -> None:
    from medddpm.configs import ablation
    from medddpm.measure.sweep import sweep

    configs = ablation(args.base)
    params = {k: getattr(args, k) for k in ("steps", "warmup") if getattr(args, k) is not None} | {"phases": ""}
    results = sweep(configs, preset=args.preset, out=args.out, device=args.device, gpu_label=args.gpu_label,
                    force=args.force, params=params, group="ablation")
    for r in results:
        print(f"{r['config']:<34}{r['status']:<14}{r['seconds']:>8.0f} s  {r['folder']}")


def cmd_counters(args) -> None:
    import time

    from tqdm import tqdm

    from medddpm.measure.counters import add_counters, check_run
    from medddpm.measure.run import NCU_MIN_S
    from medddpm.measure.ncu import check_passes

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
        status = add_counters(run, timeout_s=min(args.timeout, left), coverage=args.coverage, force=args.force,
                              passes=tuple(args.passes), merge=args.merge, from_backward=args.from_backward)
        tqdm.write(f"{run}: ncu {status['status']}: {status['message']}; kept {status['kept']}")


LABEL_HELP = ("the folder under OUT for this machine's runs (default: the device type, e.g. nvidia-h200, or "
              "<type>-<host> where OUT holds rows of the type measured elsewhere)")


class HelpFormatter(argparse.HelpFormatter):
    """Help in at most WIDTH columns, option names in a column wide enough for most of them."""

    def __init__(self, prog, **kw):
        import shutil

        super().__init__(prog, **kw | {"width": min(WIDTH, shutil.get_terminal_size().columns),
                                        "max_help_position": 30})

    def _split_lines(self, text, width):  # names such as mni-brats and channels-last stay whole
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        super().__init__(*args, **{"formatter_class": HelpFormatter} | kw)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m medddpm", description="Med-DDPM training and profiling: python -m medddpm "
                                                          "COMMAND --help says more of each")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    p = sub.add_parser("info", help="model summary: parameters and FLOPs (meta device, no memory)")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("configs", help="list the named configurations: name, precision and what each is")
    p.add_argument("--device", help="say which switches apply on this device (default: cuda if present)")
    p.add_argument("--wide", action="store_true", help="every switch of each configuration, a column each")
    p.add_argument("--json", action="store_true", help="a JSON list: every switch, description and what does not "
                                                       "apply on the device")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("train", help="train Med-DDPM; resumes from OUT/checkpoint.pt if present",
                       usage="%(prog)s --out DIR [--config NAME] [--steps N] [options]")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for checkpoint.pt and loss.jsonl")
    add_model_args(p, mask_default=None)
    add_config_args(p)
    p.add_argument("--steps", type=positive, default=100, metavar="N", help="optimizer steps (default 100)")
    p.add_argument("--data", help="'mni' (embedded templates; the default), 'mni-brats' (synthetic BraTS-like cases; "
                                  "the default with --preset brats), or a folder with mask/ and image/, or with "
                                  "seg/, t1/, t1ce/, t2/ and flair/ (BraTS)")
    p.add_argument("--pairs", type=positive, default=8, metavar="N", help="embedded training pairs (default 8)")
    p.add_argument("--grad-accum", type=positive, default=2, metavar="N",
                   help="micro-steps per optimizer step (default 2)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (default 1e-5, the reference's)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the weights, the data and the noise")
    p.add_argument("--save-every", type=positive, default=500, metavar="N", help="optimizer steps between checkpoints")
    p.add_argument("--log-every", type=positive, default=10, metavar="N", help="optimizer steps between loss lines")
    add_device_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate volumes for label maps and write NIfTI files")
    p.add_argument("--checkpoint", required=True, help="checkpoint.pt or the training folder holding it")
    p.add_argument("--labels", nargs="+", default=["mni:0"], help="label maps: mni:SEED, mni-brats:SEED or NIfTI files")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--compiled", action="store_true",
                   help="keep the checkpoint's torch.compile and CUDA-graph switches: the first sample waits for "
                        "compilation (about 40 s at 128^3 on an H200), later ones run at the compiled speed")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the first sample; the next ones count up")
    add_device_arg(p)
    p.add_argument("--out", required=True, help="writes OUT/image/sample_NNN.nii.gz and OUT/mask/sample_NNN.nii.gz")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("bench", help="time training micro-steps (fwd + bwd + Adam) or denoising steps "
                                     "per configuration")
    add_model_args(p)
    p.add_argument("--configs", default="paper", help="paper, all, or comma-separated names")
    p.add_argument("--warmup", type=positive, default=5, help="untimed steps first (default 5)")
    p.add_argument("--steps", type=positive, default=30, help="timed steps (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the embedded batch (default 0)")
    add_device_arg(p)
    p.add_argument("--reference", help="path to a clone of the reference mobaidoctor/med-ddpm, timed alongside")
    p.add_argument("--reference-precisions", default="fp32,tf32",
                   help="the reference's runs, comma-separated: fp32 (strict), tf32 (default: both)")
    p.add_argument("--phase", choices=("train", "sample"), default="train",
                   help="train: forward + backward + Adam; sample: one denoising step (a full sample is 250)")
    p.add_argument("--kernels", type=positive, metavar="N",
                   help="after the timing, profile two more steps: device time by kernel category and the "
                        "top N kernels")
    p.add_argument("--memory-snapshot", metavar="DIR",
                   help="after the timing, one more step with the allocator's history on, saved as "
                        "DIR/memory-<config>.pickle (read it at pytorch.org/memory_viz); configurations without "
                        "CUDA graphs only")
    p.add_argument("--json", help="write all timings to this JSON file, every step's included")
    p.add_argument("--out", metavar="DIR",
                   help="write the summary of each run to DIR/bench.parquet (table bench), in place of rows of the "
                        "same --source; the book reads data/<gpu>/reference/bench.parquet")
    p.add_argument("--source", help="what these runs are, for a reader of the table (default: 'bench <UTC start>')")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("saved", help="what a compiled configuration's training step saves for its backward "
                                     "(AOTAutograd's partition), traced at full size on the CPU: no GPU")
    add_model_args(p)
    p.add_argument("--configs", required=True, help="compiled configurations, e.g. best,best-ckpt+group_norm=fused")
    p.add_argument("--min-mib", type=float, default=64.0, help="list tensors of at least this size (MiB)")
    p.add_argument("--write", nargs="?", const=str(Path("data") / "partition.parquet"), metavar="FILE",
                   help="also record each in the partition table the memory page reads (default "
                        "data/partition.parquet), replacing its row for this torch version; needs --preset")
    p.set_defaults(func=cmd_saved)

    p = sub.add_parser("peak", help="what a memory snapshot (bench --memory-snapshot) holds at its peak, by the "
                                    "model's line that allocated it: no GPU")
    p.add_argument("snapshots", nargs="+", metavar="SNAPSHOT", help="memory-*.pickle or .pickle.gz files")
    p.add_argument("--top", type=positive, default=12, help="origins to list, largest first")
    p.set_defaults(func=cmd_peak)

    p = sub.add_parser("sweep", help="run the producer notebook for each configuration into data/<label>/<config>/")
    p.add_argument("--configs", default="paper", help="paper, all, or comma-separated names")
    p.add_argument("--preset", choices=PRESET_NAMES, default="smoke",
                   help="smoke (tiny, CPU), paper (whole-head 128^3) or brats (192x192x144, four modalities)")
    p.add_argument("--out", default="data", help="the data tree (default data): writes OUT/<label>/<config>/")
    p.add_argument("--force", action="store_true", help="redo configurations already measured under the label")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    p.add_argument("--size", type=size_arg, help="override the preset's input size: N or DxHxW")
    p.add_argument("--batch", type=positive, help="volumes per micro-step (default 1; other batches are kept in "
                                                     "data/<gpu>/<config>@<preset>-b<batch>/)")
    p.add_argument("--mask-channels", type=positive, metavar="N",
                   help="label channels (default: the data's own, 3 on the embedded data; 2, the reference's "
                        "whole-head width, is kept in data/<gpu>/<config>@<preset>-m2/)")
    p.add_argument("--steps", type=positive, help="timed micro-steps (default: the preset's)")
    p.add_argument("--warmup", type=positive, help="untimed micro-steps first (default: the preset's)")
    p.add_argument("--sample-steps", type=positive, metavar="N",
                   help="denoising steps of the timed sample (default: the preset's; the book takes a full sample as "
                        "250 times their median)")
    p.add_argument("--data", help="'mni', 'mni-brats', or a folder with mask/ and image/ (or seg/, t1/, t1ce/, t2/, "
                                  "flair/); default: the preset's embedded data")
    p.add_argument("--phases", default=",".join(PHASES), type=phases_arg,
                   help="what runs after the timed training steps, comma-separated: sample (one timed sample), "
                        "torch (the kernel breakdown), quality (parity with strict FP32), ncu (hardware counters); "
                        "'' for none")
    p.add_argument("--ncu-timeout", type=positive, help="seconds Nsight Compute may take per configuration "
                                                          "(default 420; on timeout it is recorded, the run goes on)")
    p.add_argument("--time-limit", type=positive, metavar="S",
                   help="seconds one configuration's run may take: Nsight Compute, the last phase, gets what the "
                        "others left (at most --ncu-timeout), and keeps what it profiled when it runs out")
    g = p.add_argument_group("backends", "where the configurations run (default: one after another, here)")
    g.add_argument("--backend", choices=["here", "local", "slurm"], default="here",
                   help="here; local: one configuration per visible GPU at once; slurm: one job per "
                        "(GPU type, configuration), through submitit")
    g.add_argument("--dry-run", action="store_true", help="slurm: print the sbatch scripts, submit nothing")
    g.add_argument("--partition", help="slurm partition")
    g.add_argument("--gpu-type", help="slurm GPU type(s) for --gres=gpu:TYPE:1, comma-separated "
                                      "(one job per type and configuration; default: any GPU)")
    g.add_argument("--time-min", type=positive, default=120, help="slurm time limit per job, minutes")
    g.add_argument("--cpus-per-task", type=positive, default=8, help="slurm CPU cores per job (default 8)")
    g.add_argument("--mem-gb", type=int, default=64, help="slurm memory per job (0: the partition's default)")
    g.add_argument("--account", help="slurm account to charge")
    g.add_argument("--qos", help="slurm quality of service")
    g.add_argument("--constraint", help="slurm node features, e.g. 'h100|a100'")
    g.add_argument("--python", help="how a job starts Python, e.g. 'apptainer exec --nv medddpm.sif python' "
                                    "(default: this interpreter)")
    g.add_argument("--slurm-folder", default="runs/slurm", help="submitit's job files and logs")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("ablation", help="what each lever buys: a configuration and it without each of its levers, "
                                        "timed alone into data/<gpu>/ablation/<config>/")
    p.add_argument("--base", default="best", help="the configuration whose levers are taken away one at a time")
    p.add_argument("--preset", choices=PRESET_NAMES, default="paper", help="the model and sizes (default paper)")
    p.add_argument("--out", default="data", help="the data tree (default data): writes OUT/<label>/ablation/")
    p.add_argument("--force", action="store_true", help="redo configurations already measured")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    p.add_argument("--steps", type=positive, help="timed micro-steps (default: the preset's)")
    p.add_argument("--warmup", type=positive, help="untimed micro-steps first (default: the preset's)")
    p.set_defaults(func=cmd_ablation)

    p = sub.add_parser("summary", help="what this machine measured, its fastest configuration against the "
                                       "committed rows of its device type, and where the book is")
    p.add_argument("--out", default="data", help="the data tree (default data)")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help="the label the sweep wrote under (default: as the sweep "
                                                        "derives it on this machine)")
    p.add_argument("--book", metavar="HTML", help="the built book's first page, to say where it is")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("study", help="convergence study: train configurations from the same seeds, weights, data "
                                     "and noise, sample their EMA weights and score the samples into "
                                     "OUT/<gpu>/convergence/; resumes")
    p.add_argument("--configs", default="opt1,bf16,fp16,best", help="comma-separated names; the first is the "
                                                                    "reference the book weighs the others against")
    p.add_argument("--seeds", type=seeds_arg, default=[0, 1, 2], help="a count (3: seeds 0, 1, 2) or a list (0,4,7)")
    p.add_argument("--steps", type=positive, default=2000, help="optimizer steps per run")
    p.add_argument("--size", type=positive, default=64, help="voxels per side of the cubic input")
    p.add_argument("--base-channels", type=positive, default=64, help="channels of the U-Net's first level")
    p.add_argument("--pairs", type=positive, default=32, help="embedded training pairs")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-steps per optimizer step")
    p.add_argument("--samples", type=positive, default=4, help="samples per run, spread over the label maps")
    p.add_argument("--label-maps", type=positive, default=2, help="held-out subjects whose label maps are sampled")
    p.add_argument("--sample-steps", type=positive, default=250,
                   help="denoising steps of a sample: 250, the training schedule's, or fewer on a respaced schedule")
    p.add_argument("--out", default="data", help="writes OUT/<gpu-slug>/convergence/")
    p.add_argument("--work", default="runs/convergence", help="checkpoints and loss logs of the runs (resume)")
    p.add_argument("--jobs", type=positive, default=1, help="runs trained at once, each in its own process")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--devices", help="comma-separated devices the parallel runs take in turn, e.g. cuda:0,cuda:1")
    p.add_argument("--gpu-label", help="name the device differently in OUT/<gpu-slug>/")
    p.add_argument("--time-limit", type=positive, metavar="S",
                   help="no run starts after S seconds and runs still going are stopped there (parallel runs); "
                        "the same command resumes them from their last checkpoint")
    p.add_argument("--force", action="store_true", help="run again the (configuration, seed) runs already done")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's checkpoint")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser("scale", help="data-parallel scaling: time one configuration on 1, 2, ... ranks (torchrun)")
    p.add_argument("--config", default="sdpa", help="a configuration without CUDA graphs (DDP cannot capture them)")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated rank counts, e.g. 1,2,4")
    p.add_argument("--preset", choices=["smoke", "paper"], default="smoke", help="the model and sizes (default smoke)")
    p.add_argument("--out", default="data", help="writes OUT/<gpu-slug>/scaling/<config>.parquet")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if present (one GPU per rank)")
    p.add_argument("--steps", type=positive, help="timed micro-steps per rank (default: the preset's)")
    p.add_argument("--warmup", type=int, help="untimed warm-up micro-steps (default: the preset's)")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("claims", help="the paper's claims judged on the measurements, per device (no book build)")
    p.add_argument("--data", metavar="DIR", help="the data tree to read (default: the repository's data/)")
    p.add_argument("--json", action="store_true",
                   help="a JSON list of {claim, device, verdict, rule, evidence, figures}")
    p.set_defaults(func=cmd_claims)

    p = sub.add_parser("counters", help="Nsight Compute counters for runs already measured (GPU): a run's "
                                        "ncu.parquet is replaced when the new counters cover more of its step")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders, e.g. data/nvidia-h200/bf16")
    p.add_argument("--timeout", type=positive, default=420, help="seconds Nsight Compute may take per run")
    p.add_argument("--deadline", type=positive, metavar="S",
                   help="seconds for all runs: each gets what is left (at most --timeout)")
    p.add_argument("--coverage", type=fraction, default=COVERAGE,
                   help="share of the step's kernel time to select for profiling")
    p.add_argument("--force", action="store_true", help="keep the new counters even if they cover less")
    p.add_argument("--passes", nargs="+", choices=[*PASSES, BOTH], default=list(PASSES),
                   help="own: PyTorch's and Triton's kernels, by name; library: every cuDNN and cuBLAS launch; "
                        f"{BOTH}: the two filters in one process, one launch a configuration (one warm-up)")
    p.add_argument("--merge", action="store_true", help="add the new launches to the run's counters")
    p.add_argument("--from-backward", nargs="?", const="", metavar="LAYER",
                   help="profile from the first layer's backward on, or from LAYER's (a layer range's name, as in "
                        "ncu.parquet; eager configurations): with --merge, for counters that stopped before it")
    p.add_argument("--check", action="store_true", help="only check that every folder can be given counters here")
    p.set_defaults(func=cmd_counters)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        release()
    return 0


def release() -> None:
    """Stop what a command's work leaves running, so that the process ends with its work: Inductor's pool of
    compile workers (subprocesses that a compiled configuration starts and the interpreter would wait for at
    exit) and a profiler left attached by an error inside its context."""
    if "torch._inductor.async_compile" in sys.modules:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    if "torch" in sys.modules:
        import torch

        if torch.autograd.profiler._is_profiler_enabled:
            torch.autograd._disable_profiler()


if __name__ == "__main__":
    sys.exit(main())
