"""The command line's parser: every subcommand of `python -m medddpm`, its options and their help."""

from __future__ import annotations

import argparse
from pathlib import Path

from medddpm.analysis.ncu_table import COVERAGE
from medddpm.measure.profile.ncu import BOTH, PASSES
from medddpm.store.layout import PARTITION_FILE
from medddpm.store.schema import PHASES
from medddpm.cli.args import (DEVICE_HELP, PRESET_NAMES, WIDTH, add_config_args, add_device_arg, add_force_memory,
                              add_model_args, fraction, phases_arg, positive, seed_arg, seeds_arg, size_arg)
from medddpm.cli.commands import (cmd_ablation, cmd_bench, cmd_claims, cmd_configs, cmd_counters, cmd_info, cmd_roofs, cmd_peak, cmd_sample, cmd_saved, cmd_scale, cmd_study, cmd_summary, cmd_sweep, cmd_train)
from medddpm.cli.commands import cmd_add_runs, cmd_export_data, cmd_sample_batches


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


class MicroStepsOnly(argparse.Action):
    """`--steps` given to a command that times micro-steps: one line naming `--micro-steps` (a step is an optimizer
    step, as `train` and `study` count them; a timing loop times micro-steps, one micro-batch's forward, backward
    and Adam each)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, **kw | {"help": argparse.SUPPRESS})

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{parser.prog.split()[-1]} times micro-steps: use --micro-steps N in place of {option_string}")


def add_micro_steps(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """`--micro-steps N` (dest micro_steps), and a hidden `--steps` that says to use it."""
    p.add_argument("--micro-steps", type=positive, default=default, metavar="N", help=help)
    p.add_argument("--steps", action=MicroStepsOnly, dest="_steps", metavar="N")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        super().__init__(*args, **{"formatter_class": HelpFormatter} | kw)

    def error(self, message: str):
        """A wrong option is one line that names it, as every other bad input is; --help gives the usage."""
        self.exit(2, f"error: {message} ({self.prog} --help)\n")


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
    p.add_argument("--resample-mask", action="store_true",
                   help="a folder whose masks lie on another grid than their images (another affine or shape): "
                        "resample each mask onto its image's grid, nearest neighbour (refused without it)")
    p.add_argument("--grad-accum", type=positive, default=2, metavar="N",
                   help="micro-steps per optimizer step (default 2)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (default 1e-5, the reference's)")
    p.add_argument("--seed", type=seed_arg, default=0, metavar="N", help="seed of the weights, the data and the noise")
    p.add_argument("--save-every", type=positive, default=500, metavar="N", help="optimizer steps between checkpoints")
    p.add_argument("--log-every", type=positive, default=10, metavar="N", help="optimizer steps between loss lines")
    add_force_memory(p)
    p.add_argument("--allow-changed", action="store_true",
                   help="resume a checkpoint of another seed, lr, grad-accum, configuration or size with the values "
                        "given here (refused without it)")
    add_device_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate volumes for label maps and write NIfTI files")
    p.add_argument("--checkpoint", required=True, help="checkpoint.pt or the training folder holding it")
    p.add_argument("--labels", nargs="+", default=["mni:0"], help="label maps: mni:SEED, mni-brats:SEED or NIfTI files")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--compiled", action="store_true",
                   help="keep the checkpoint's torch.compile and CUDA-graph switches: the first sample waits for "
                        "compilation (tens of seconds at 128^3), later ones run at the compiled speed")
    p.add_argument("--seed", type=seed_arg, default=0, metavar="N",
                   help="noise seed of the first sample; the next ones count up")
    add_device_arg(p)
    p.add_argument("--out", required=True, help="writes OUT/image/sample_NNN.nii.gz and OUT/mask/sample_NNN.nii.gz")
    add_force_memory(p, "a denoising step's")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("bench", help="time training micro-steps (fwd + bwd + Adam) or denoising steps "
                                     "per configuration")
    add_model_args(p)
    p.add_argument("--configs", default="paper", help="paper, all, or comma-separated names")
    p.add_argument("--warmup", type=positive, default=5, help="untimed micro-steps (or denoising steps) first "
                                                               "(default 5)")
    add_micro_steps(p, 30, "timed micro-steps, or denoising steps with --phase sample (default 30)")
    p.add_argument("--seed", type=seed_arg, default=0, metavar="N",
                   help="seed of the weights and the embedded batch (default 0)")
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
    add_force_memory(p, "a step's")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("saved", help="what a compiled configuration's training step saves for its backward "
                                     "(AOTAutograd's partition), traced at full size on the CPU: no GPU")
    add_model_args(p)
    p.add_argument("--configs", required=True, help="compiled configurations, e.g. best,best-ckpt+group_norm=fused")
    p.add_argument("--min-mib", type=float, default=64.0, help="list tensors of at least this size (MiB)")
    p.add_argument("--write", nargs="?", const=str(Path("data") / PARTITION_FILE), metavar="FILE",
                   help="also record each in the partition table the memory page reads (default "
                        "data/partition.parquet), replacing its row for this torch version; needs --preset")
    p.set_defaults(func=cmd_saved)

    p = sub.add_parser("peak", help="what a memory snapshot (bench --memory-snapshot) holds at its peak, by the "
                                    "model's line that allocated it: no GPU")
    p.add_argument("snapshots", nargs="+", metavar="SNAPSHOT",
                   help="memory-*.parquet summaries, or memory-*.pickle[.gz] files (their summary beside them is read)")
    p.add_argument("--top", type=positive, default=12, help="origins to list, largest first")
    p.add_argument("--trust-pickle", action="store_true",
                   help="read a snapshot's pickle itself (plain data only), where no summary lies beside it")
    p.set_defaults(func=cmd_peak)

    p = sub.add_parser("sweep", help="run the producer notebook for each configuration into data/<label>/<config>/")
    p.add_argument("--configs", default="paper", help="paper, all, or comma-separated names")
    p.add_argument("--preset", choices=PRESET_NAMES, default="smoke",
                   help="smoke (tiny, CPU), paper (whole-head 128^3) or brats (192x192x144, four modalities)")
    p.add_argument("--out", default="data", help="the data tree (default data): writes OUT/<label>/<config>/")
    p.add_argument("--force", action="store_true", help="redo configurations already measured under the label")
    p.add_argument("--replace-committed", metavar="NAMES", default="",
                   help="comma-separated configurations whose runs git tracks that this sweep may replace "
                        "(refused, naming them, without it)")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    p.add_argument("--size", type=size_arg, help="override the preset's input size: N or DxHxW")
    p.add_argument("--batch", type=positive, help="volumes per micro-step (default 1; other batches are kept in "
                                                     "data/<gpu>/<config>@<preset>-b<batch>/)")
    p.add_argument("--mask-channels", type=positive, metavar="N",
                   help="label channels (default: the data's own, 3 on the embedded data; 2, the reference's "
                        "whole-head width, is kept in data/<gpu>/<config>@<preset>-m2/)")
    add_micro_steps(p, None, "timed micro-steps (default: the preset's)")
    p.add_argument("--warmup", type=positive, help="untimed micro-steps first (default: the preset's)")
    p.add_argument("--sample-steps", type=positive, metavar="N",
                   help="denoising steps of the timed sample (default: the preset's; the book takes a full sample as "
                        "250 times their median)")
    p.add_argument("--data", help="'mni', 'mni-brats', or a folder with mask/ and image/ (or seg/, t1/, t1ce/, t2/, "
                                  "flair/); default: the preset's embedded data")
    p.add_argument("--resample-mask", action="store_true",
                   help="a folder whose masks lie on another grid than their images (another affine or shape): "
                        "resample each mask onto its image's grid, nearest neighbour (refused without it)")
    p.add_argument("--phases", default=",".join(PHASES), type=phases_arg,
                   help="what runs after the timed training steps, comma-separated: sample (one timed sample), "
                        "torch (the kernel breakdown), quality (parity with strict FP32), ncu (hardware counters); "
                        "'' for none")
    p.add_argument("--ncu-timeout", type=positive, help="seconds Nsight Compute may take per configuration "
                                                          "(default 420; on timeout it is recorded, the run goes on)")
    p.add_argument("--time-limit", type=positive, metavar="S",
                   help="seconds one configuration's run may take: Nsight Compute, the last phase, gets what the "
                        "others left (at most --ncu-timeout), and keeps what it profiled when it runs out")
    add_force_memory(p, "a configuration's training step's (or sample's)")
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
    p.add_argument("--replace-committed", metavar="NAMES", default="",
                   help="comma-separated configurations whose runs git tracks that this ablation may replace")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    add_micro_steps(p, None, "timed micro-steps (default: the preset's)")
    p.add_argument("--warmup", type=positive, help="untimed micro-steps first (default: the preset's)")
    add_force_memory(p, "a configuration's training step's")
    p.set_defaults(func=cmd_ablation)

    p = sub.add_parser("add-runs", help="check runs a sweep made on another machine (schema, identity, spread, status) "
                                        "and add those that pass under data/<label>/, by the sweep's rules")
    p.add_argument("path", metavar="PATH", help="a sweep's --out folder (<label>/<run>/), a .tgz of one, or a folder of "
                                                "such .tgz files")
    p.add_argument("--out", default="data", help="the data tree to add them to (default data)")
    p.set_defaults(func=cmd_add_runs)

    p = sub.add_parser("summary", help="what a label measured (this machine's, or --gpu-label's), its fastest "
                                       "configuration against the committed rows of its device type, else the "
                                       "nearest other card in the data, and where the book is")
    p.add_argument("--out", default="data", help="the data tree (default data)")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help="the label to summarise, read as the device type its rows "
                                                        "recorded (default: this machine's, as the sweep derives it)")
    p.add_argument("--book", metavar="HTML", help="the built book's first page, to say where it is")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("study", help="convergence study: train configurations from the same seeds, weights, data "
                                     "and noise, sample their EMA weights and score the samples into "
                                     "OUT/<gpu>/convergence/; resumes")
    p.add_argument("--configs", default="baseline,opt1,bf16,fp16,best",
                   help="comma-separated names (the book pairs each seed's runs: opt1 against baseline, best, bf16 "
                        "and fp16 against opt1, fp16 against bf16)")
    p.add_argument("--seeds", type=seeds_arg, default=[0, 1, 2, 3, 4],
                   help="a count (5: seeds 0 to 4) or a list (0,4,7)")
    p.add_argument("--steps", type=positive, default=4000, help="optimizer steps per run")
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
    add_force_memory(p, "a training step's or a sample's")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser("scale", help="data-parallel scaling: time one configuration on 1, 2, ... ranks (torchrun)")
    p.add_argument("--config", default="sdpa", help="a configuration without CUDA graphs (DDP cannot capture them)")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated rank counts, e.g. 1,2,4")
    p.add_argument("--preset", choices=["smoke", "paper"], default="smoke", help="the model and sizes (default smoke)")
    p.add_argument("--out", default="data", help="writes OUT/<gpu-slug>/scaling/<config>.parquet")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if present (one GPU per rank)")
    add_micro_steps(p, None, "timed micro-steps per rank (default: the preset's)")
    p.add_argument("--warmup", type=int, help="untimed warm-up micro-steps (default: the preset's)")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("claims", help="the paper's claims judged on the measurements, per device (no book build)")
    p.add_argument("--data", metavar="DIR", help="the data tree to read (default: the repository's data/)")
    p.add_argument("--json", action="store_true",
                   help="a JSON list, a claim each: {claim, text, scope, paper, paper_card, rule, verdicts: {device: "
                        "{verdict, evidence, figures}}}")
    p.set_defaults(func=cmd_claims)

    p = sub.add_parser("roofs", help="measure this device's roofs: DRAM bandwidth (a device-to-device copy) and "
                                     "dense matmul rates in FP32, TF32, bf16 and fp16, into OUT/<label>/roofs.parquet "
                                     "(the sweep measures them once per label)")
    p.add_argument("--out", default="data", help="the data tree (default data)")
    add_device_arg(p)
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    p.add_argument("--force", action="store_true", help="measure again where the label has roofs (else: show them)")
    p.set_defaults(func=cmd_roofs)

    p = sub.add_parser("sample-batches", help="seconds per generated volume over batch sizes: each configuration's "
                                              "denoising step timed at each batch, until one does not fit, into "
                                              "OUT/<label>/levers/sample_batches.parquet")
    add_model_args(p)
    p.add_argument("--configs", default="best", help="comma-separated names (default best)")
    p.add_argument("--batches", default="1,2,4,8", help="increasing batch sizes, comma-separated (default 1,2,4,8)")
    p.add_argument("--warmup", type=positive, default=3, help="untimed denoising steps at each batch (default 3)")
    add_micro_steps(p, 20, "timed denoising steps at each batch (default 20)")
    p.add_argument("--seed", type=seed_arg, default=0, metavar="N",
                   help="seed of the weights and the embedded label maps (default 0)")
    add_device_arg(p)
    p.add_argument("--out", default="data", help="the data tree (default data)")
    p.add_argument("--gpu-label", metavar="LABEL", help=LABEL_HELP)
    p.set_defaults(func=cmd_sample_batches)

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

    p = sub.add_parser("export-data", help="write the embedded synthetic subjects as a NIfTI folder (gzip, int16 or "
                                           "float64, scanner orientation): a data set for --data")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder")
    p.add_argument("--pairs", type=positive, required=True, metavar="N", help="subjects to write")
    p.add_argument("--layout", choices=["reference", "brats", "brats2023"], default="reference",
                   help="reference: image/ and mask/; brats: seg/, t1/, t1ce/, t2/, flair/; brats2023: the same with "
                        "t1n, t1c, t2w, t2f (default reference)")
    p.add_argument("--size", type=size_arg, metavar="N|DxHxW",
                   help="voxels on disk (default 128 for reference, 240x240x155 for brats)")
    p.add_argument("--seed", type=seed_arg, default=0, metavar="N", help="the first subject's seed")
    p.set_defaults(func=cmd_export_data)

    return parser
