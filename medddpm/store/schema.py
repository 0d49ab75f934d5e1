"""The tables every measurement writes, documented in one place and checked on write and on read.

Each table is a parquet file whose place in the data tree `medddpm.store.layout` names: a run folder's
``run``, ``steps``, ``kernels``, ``ncu`` and ``quality``; a label's ``roofs``, ``scaling`` and ``bench``, and its
lever calls' ``repeats`` and ``sample_batches``; the study's ``convergence_*``; the data root's ``partition``; and
the ``snapshot`` summary beside an allocator snapshot. A column renamed (`RENAMED`), retired (`RETIRED`) or added
(`ADDED`) since a committed table was written is read under today's schema, so that every table of the tree reads,
whenever it was written.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from medddpm.errors import UserError
from medddpm.configs import Config, switch_kind, switches
from medddpm.store.layout import table_of
from medddpm.store.storage import atomic_write, open_regular

S, I, F, B = pa.string(), pa.int64(), pa.float64(), pa.bool_()


def switch_columns(config_class: type = Config) -> dict[str, tuple[pa.DataType, str]]:
    """The run table's column of each configuration switch: bool or text, described by its declaration."""
    return {f.name: (B if switch_kind(f, config_class) is bool else S, f.metadata["column"])
            for f in switches(config_class)}


# The switches of the first run tables: every run table has them, and one without them is broken, not old.
FIRST_SWITCHES = ("precision", "channels_last", "compile", "cuda_graphs", "fused_adam", "attention",
                  "recompute_attention")


def switch_defaults(config_class: type = Config) -> dict[str, object]:
    """What older run tables imply for a switch added since the first ones: its default, the behaviour before it
    existed."""
    return {f.name: f.default for f in switches(config_class) if f.name not in FIRST_SWITCHES}


# table -> {column: (type, description)}
TABLES: dict[str, dict[str, tuple[pa.DataType, str]]] = {
    "run": {
        "run_id": (S, "unique id of this measurement: <gpu-slug>/<config>/<start time>"),
        "status": (S, "ok | oom | error | skipped"),
        "message": (S, "why, when status is not ok; notes otherwise"),
        "gpu_name": (S, "torch.cuda.get_device_name, or 'cpu'"),
        "gpu_slug": (S, "the label of the folder data/<gpu-slug>/: gpu_type, or <gpu_type>-<host> where the device "
                        "type's rows in data/ were measured on another machine, or the sweep's --gpu-label"),
        "gpu_type": (S, "the device type: gpu_name lower-cased, other characters as hyphens"),
        "host": (S, "short host name of the machine that measured ('' where not recorded)"),
        "gpu_count": (I, "visible CUDA devices"),
        "driver": (S, "NVIDIA driver version (NVML)"),
        "cuda": (S, "CUDA version torch was built with"),
        "cudnn": (S, "cuDNN version in use"),
        "torch": (S, "torch.__version__"),
        "python": (S, "Python version"),
        "cpu": (S, "host processor"),
        "host_threads": (I, "torch CPU threads"),
        "git_commit": (S, "commit of this repository (-dirty if modified)"),
        "container": (S, "docker | apptainer | '' (bare metal)"),
        "config": (S, "configuration name"),
        **switch_columns(),  # one column per configuration switch (medddpm.configs.switch)
        "precision_used": (S, "precision that ran on this device"),
        "not_applicable": (S, "JSON: switches that could not apply on this device, with why"),
        "backend_flags": (S, "JSON: fp32 math modes read back after setting them"),
        "preset": (S, "smoke | paper | brats"),
        "size": (I, "input size: voxels per side of a cube; the largest side otherwise (see shape)"),
        "shape": (S, "input D x H x W in voxels, e.g. 192x192x144"),
        "batch": (I, "volumes per micro-step"),
        "image_channels": (I, "image channels predicted (1 whole-head; 4 BraTS: T1, T1ce, T2, FLAIR)"),
        "mask_channels": (I, "label channels (conditioning)"),
        "num_res_blocks": (I, "residual blocks per U-Net level"),
        "parameters": (I, "model parameters"),
        "forward_flops": (F, "FLOPs of one forward micro-step (2 per multiply-add)"),
        "flops_per_step": (F, "FLOPs of one training micro-step (forward + backward)"),
        "warmup_steps": (I, "untimed warm-up micro-steps"),
        "timed_steps": (I, "timed micro-steps"),
        "warmup_s": (F, "wall time of all warm-up steps (compilation, cuDNN autotuning)"),
        "first_step_s": (F, "wall time of the first step alone"),
        "compile_cache": (S, "JSON: hits, misses and bypasses of the on-disk compile caches (Inductor's FX graph "
                             "cache, AOTAutograd's) in the training phase; {} without compile, '' not recorded"),
        "train_median_ms": (F, "median micro-step time (forward + backward + Adam)"),
        "train_p10_ms": (F, "10th percentile micro-step time"),
        "train_p90_ms": (F, "90th percentile micro-step time"),
        "train_mean_ms": (F, "mean micro-step time"),
        "train_std_ms": (F, "standard deviation of the micro-step time"),
        "dispatch_median_ms": (F, "median host time to issue one micro-step"),
        "skipped_steps": (I, "optimizer steps of the training phase (warm-up included) that fp16's loss scaler skipped "
                             "for an inf or NaN gradient; 0 without a loss scaler"),
        "achieved_tflops": (F, "flops_per_step / median time"),
        "voxels_per_s": (F, "training throughput in input voxels per second"),
        "samples_per_s": (F, "training throughput in volumes per second"),
        "peak_mem_bytes": (I, "peak allocated device memory of a training micro-step: over the timed steps, and with a "
                              "CUDA graph over its capture, since replays allocate nothing (-1 on a CPU)"),
        "peak_reserved_bytes": (I, "peak memory reserved by the caching allocator, warm-up included (-1 on a CPU)"),
        "gpu_total_bytes": (I, "device memory as the driver reports it (-1 on a CPU)"),
        "gpu_other_bytes": (I, "device memory in use outside PyTorch's allocator after the timed steps: CUDA "
                               "context, libraries, other processes (-1 on a CPU)"),
        "epoch_size": (I, "training pairs in one epoch"),
        "epoch_s": (F, "time of one epoch: epoch_size volumes at the median micro-step time"),
        "gpu_hours_100k": (F, "projected device hours for the reference's 100k steps x 2 micro-steps"),
        "mean_power_w": (F, "mean board power over the timed steps (NVML; NaN if unavailable)"),
        "energy_per_step_j": (F, "energy per micro-step (NVML energy counter; NaN if unavailable)"),
        "energy_100k_kwh": (F, "projected energy for 100k steps x 2 micro-steps"),
        "sample_steps": (I, "denoising steps in one sample (T)"),
        "sample_step_median_ms": (F, "median time of one denoising step"),
        "sample_total_s": (F, "wall time of the timed sample, the first in its process (compilation included)"),
        "sample_peak_mem_bytes": (I, "peak allocated device memory while sampling (-1 on a CPU)"),
        "profilers": (S, "JSON: phase after training (sample, torch, quality, ncu) -> status and message"),
        "data_source": (S, "the training data: mni, mni-brats (embedded) or folder:<name> (a NIfTI folder)"),
        "cache_build_s": (F, "a NIfTI folder: time its first pass took to decode, check and cache every item "
                             "(NaN for embedded data)"),
        "e2e_median_ms": (F, "a NIfTI folder: median micro-step of the training loop with its data loader (worker "
                             "processes, copy to the device, one-hot there), timed as train_median_ms; NaN if not timed"),
        "e2e_drift": (F, "median of the last 50 end-to-end micro-steps over the first 50 (a quarter each if fewer), "
                         "minus 1: the step's slowdown over the run"),
        "loader_items_per_s": (F, "items a second the data loader delivers to the device with no step to feed"),
        "sm_clock_mhz": (F, "median SM clock while the steps were timed (NVML; NaN without)"),
        "mem_clock_mhz": (F, "median memory clock while the steps were timed (NVML; NaN without)"),
        "gpu_temp_max_c": (F, "highest GPU temperature while the steps were timed (NVML; NaN without)"),
        "power_limit_w": (F, "enforced board power limit (NVML; NaN without)"),
        "throttle_reasons": (S, "clock slowdown reasons NVML gave while the steps were timed (power cap, thermal, "
                                "hardware slowdown), comma-separated; '' for none or no NVML"),
        "throttled_share": (F, "share of the samples (every 0.1 s) with a slowdown reason; NaN without NVML"),
        "start_time": (S, "UTC start, ISO 8601"),
        "duration_s": (F, "wall time of the whole measurement"),
        "identity": (S, "JSON: what defines the run (store.identity: configuration and switches, preset, shape, "
                        "batch, steps, data and its fingerprint, label); '' where not recorded: the default "
                        "identity of its folder name"),
    },
    "steps": {
        "run_id": (S, "run"),
        "phase": (S, "train | sample"),
        "micro_step": (I, "index within the phase, from 0, warm-up included: a training micro-step (forward + "
                          "backward + Adam of one micro-batch) or a denoising step"),
        "timed": (B, "false for warm-up steps"),
        "step_ms": (F, "device time of the step (CUDA events; host clock on a CPU)"),
        "dispatch_ms": (F, "host time to issue the step"),
        "loss": (F, "training loss of the step (NaN for sampling)"),
        "peak_mem_bytes": (I, "peak allocated memory of the phase (-1 on a CPU)"),
    },
    "kernels": {
        "run_id": (S, "run"),
        "kernel": (S, "full kernel name (operator name on a CPU)"),
        "short_name": (S, "readable label"),
        "category": (S, "convolution | gemm | attention | elementwise | normalization | reduction | layout | fused | memcpy | optimizer | other"),
        "pass": (S, "forward | backward | optimizer | graph | other"),
        "op": (S, "operator that launched it: the outermost aten op around the launch (aten::convolution_backward "
                  "for the copy cuDNN makes inside it), else the innermost CPU range; '' in a graph replay"),
        "calls": (I, "launches over the profiled steps"),
        "total_us": (F, "device time over the profiled steps"),
        "micro_steps": (I, "profiled micro-steps"),
        "share": (F, "fraction of all profiled kernel time"),
        "tensor_cores": (B, "kernel name says it runs on tensor cores"),
        "device_type": (S, "cuda | cpu"),
    },
    "ncu": {
        "run_id": (S, "run"),
        "kernel": (S, "full kernel name"),
        "kernel_id": (I, "Nsight Compute result id"),
        "kind": (S, "metric | rule"),
        "section": (S, "Nsight Compute section; NVTX for the layer range a launch ran in"),
        "metric": (S, "metric name, or rule name; layer for an NVTX row"),
        "value": (F, "numeric value; a rule's estimated speedup in %"),
        "unit": (S, "unit"),
        "text": (S, "raw value, the rule's description, or the layer's name (e.g. conv3d 64>64 k3 s1 @128x128x128)"),
        "speedup_type": (S, "local | global for rules"),
    },
    "quality": {
        "run_id": (S, "run"),
        "step": (I, "optimizer step of the fixed-seed run, from 1"),
        "loss": (F, "loss under this configuration"),
        "baseline_loss": (F, "loss under strict FP32 from the same weights, data, timesteps and noise"),
        "rel_err": (F, "relative L2 error of one fixed forward pass against strict FP32"),
    },
    "scaling": {
        "run_id": (S, "<gpu-slug>/<config>/scaling-<world size>/<start time>"),
        "gpu_name": (S, "device name of the ranks"),
        "gpu_slug": (S, "gpu_name lower-cased, other characters as hyphens"),
        "config": (S, "configuration name"),
        "preset": (S, "smoke | paper"),
        "backend": (S, "torch.distributed backend: nccl | gloo"),
        "world_size": (I, "ranks (one GPU each, or CPU processes)"),
        "rank": (I, "this row's rank"),
        "micro_step": (I, "micro-step index on this rank, warm-up included"),
        "timed": (B, "false for warm-up steps"),
        "step_ms": (F, "this rank's time for the step (CUDA events; host clock on a CPU)"),
        "batch": (I, "volumes per rank and micro-step (global batch = world_size x batch)"),
        "size": (I, "cubic input size"),
        "threads_per_rank": (I, "torch CPU threads of each rank (a CPU run splits the cores among the ranks)"),
        "torch": (S, "torch.__version__"),
        "git_commit": (S, "commit of this repository"),
        "start_time": (S, "UTC start of this world size's run"),
    },
    "bench": {
        "gpu_slug": (S, "device the bench ran on: its name lower-cased, other characters as hyphens"),
        "source": (S, "which bench invocation the row comes from, named for a reader (e.g. compare run 1)"),
        "phase": (S, "train (a training micro-step: forward + backward + Adam) | sample (a denoising step)"),
        "config": (S, "configuration name; a reference run under the configuration whose math it matches "
                      "(baseline: strict FP32, opt1: TF32)"),
        "implementation": (S, "ours | reference (mobaidoctor/med-ddpm)"),
        "train_median_ms": (F, "median micro-step time, as in the run table (NaN in a sample row)"),
        "train_p10_ms": (F, "10th percentile micro-step time (NaN in a sample row)"),
        "train_p90_ms": (F, "90th percentile micro-step time (NaN in a sample row)"),
        "sample_step_median_ms": (F, "median time of one denoising step, as in the run table (NaN in a train row)"),
        "sample_step_p10_ms": (F, "10th percentile time of one denoising step (NaN in a train row)"),
        "sample_step_p90_ms": (F, "90th percentile time of one denoising step (NaN in a train row)"),
        "timed_steps": (I, "timed micro-steps, or denoising steps in a sample row (after the warm-up)"),
        "peak_mem_bytes": (I, "peak allocated device memory over the timed steps, and with a CUDA graph over its "
                              "capture (-1 on a CPU)"),
        "fp32_math": (S, "FP32 math mode of cuDNN convolutions, read back: ieee | tf32 ('' where not recorded)"),
        "git_commit": (S, "commit of this repository"),
        "torch": (S, "torch.__version__"),
        "cudnn": (S, "cuDNN version in use"),
        "time_utc": (S, "UTC start of the bench invocation, ISO 8601"),
        "size": (I, "input size: voxels per side of a cube; the largest side otherwise"),
        "mask_channels": (I, "label channels (conditioning)"),
        "base_channels": (I, "U-Net base width"),
    },
    # data/<gpu-slug>/roofs.parquet: the label's roofs, measured once by the sweep (`medddpm.measure.timing.roofs`), a row
    # per roof; the roofline, the efficiency figures and the cross-card model read them
    "roofs": {
        "gpu_slug": (S, "the label of the folder data/<gpu-slug>/ the roofs belong to"),
        "gpu_name": (S, "torch.cuda.get_device_name, or 'cpu'"),
        "gpu_type": (S, "the device type: gpu_name lower-cased, other characters as hyphens"),
        "host": (S, "short host name of the machine that measured"),
        "roof": (S, "dram (DRAM bandwidth) | fp32 (dense matmul, strict FP32: TF32 off) | tf32 | bf16 | fp16"),
        "unit": (S, "byte/s for dram, FLOP/s for a matmul"),
        "value": (F, "median over the timed repeats: bytes read plus bytes written per second of a device-to-device "
                     "copy; 2 n^3 FLOP per second of an n x n by n x n matmul of random normal values"),
        "p10": (F, "10th percentile over the repeats, same unit"),
        "p90": (F, "90th percentile over the repeats, same unit"),
        "repeats": (I, "timed repeats, after the untimed warm-up"),
        "size": (I, "bytes of the copy's source (dram), or n, the matmul's side"),
        "method": (S, "what was timed and how, in words"),
        "sm_clock_mhz": (F, "median SM clock while the repeats ran (NVML; NaN without)"),
        "mem_clock_mhz": (F, "median memory clock while the repeats ran (NVML; NaN without)"),
        "driver": (S, "NVIDIA driver version (NVML; '' on a CPU)"),
        "cuda": (S, "CUDA version torch was built with ('' on a CPU)"),
        "torch": (S, "torch.__version__"),
        "git_commit": (S, "commit of this repository (-dirty if modified)"),
        "start_time": (S, "UTC start of the measurement, ISO 8601"),
    },
    # data/<gpu-slug>/levers/repeats.parquet: one process times best and its variants in interleaved blocks of
    # steps (A, B, C, A, B, C, ...), a row per block; a variant is judged against the blocks of best beside it
    # (`medddpm.analysis.levers.paired_verdict`)
    "repeats": {
        "call_id": (S, "the process that timed the blocks: <gpu-slug>/levers/<UTC start>"),
        "gpu_slug": (S, "the label of the folder data/<gpu-slug>/"),
        "gpu_name": (S, "torch.cuda.get_device_name, or 'cpu'"),
        "config": (S, "configuration name"),
        "phase": (S, "train (training micro-steps: forward + backward + Adam) | sample (denoising steps)"),
        "batch": (I, "volumes per step"),
        "size": (I, "input size: voxels per side of a cube"),
        "position": (I, "the block's place in the call's order of blocks, from 0 (both phases counted)"),
        "repeat": (I, "the round of the interleaving the block belongs to, from 0"),
        "steps": (I, "timed steps in the block, back to back after the variant's warm-up"),
        "block_ms": (F, "median step time of the block (CUDA events; host clock on a CPU)"),
        "block_p10_ms": (F, "10th percentile step time of the block"),
        "block_p90_ms": (F, "90th percentile step time of the block"),
        "peak_mem_bytes": (I, "peak allocated device memory of the variant's steps, a CUDA graph's capture included "
                              "(-1 on a CPU)"),
        "first_step_s": (F, "wall time of the variant's first step in the call (compilation, or loading it from "
                            "Inductor's cache, and autotuning)"),
        "git_commit": (S, "commit of this repository"),
        "torch": (S, "torch.__version__"),
        "cudnn": (S, "cuDNN version in use"),
        "start_time": (S, "UTC start of the call, ISO 8601"),
    },
    # data/<gpu-slug>/levers/sample_batches.parquet: seconds per generated volume over batch sizes
    # (`medddpm.measure.timing.sampling`)
    "sample_batches": {
        "call_id": (S, "the process that measured: <gpu-slug>/levers/<UTC start>, or the command's own"),
        "gpu_slug": (S, "the label of the folder data/<gpu-slug>/"),
        "gpu_name": (S, "torch.cuda.get_device_name, or 'cpu'"),
        "config": (S, "configuration name"),
        "size": (I, "input size: voxels per side of a cube"),
        "batch": (I, "volumes generated at once (one label map each)"),
        "status": (S, "ok | oom (this batch does not fit; larger ones are not tried) | error"),
        "message": (S, "why, when status is not ok"),
        "timesteps": (I, "denoising steps of a full sample (T)"),
        "steps": (I, "timed denoising steps, after the warm-up"),
        "step_median_ms": (F, "median time of one denoising step of the whole batch"),
        "step_p10_ms": (F, "10th percentile time of one denoising step"),
        "step_p90_ms": (F, "90th percentile time of one denoising step"),
        "volume_s": (F, "seconds per generated volume: timesteps x the median step / batch"),
        "peak_mem_bytes": (I, "peak allocated device memory while sampling, a CUDA graph's capture included (-1 on a "
                              "CPU)"),
        "git_commit": (S, "commit of this repository"),
        "torch": (S, "torch.__version__"),
        "start_time": (S, "UTC start of the measurement, ISO 8601"),
    },
    "partition": {
        "preset": (S, "the model: smoke | paper | brats"),
        "shape": (S, "input D x H x W in voxels"),
        "config": (S, "configuration name (compiled)"),
        "switches": (S, "JSON: the configuration's switches when traced"),
        "torch": (S, "torch.__version__ that traced it (its Dynamo, AOTAutograd and CPU graph)"),
        "git_commit": (S, "commit of this repository"),
        "traced_utc": (S, "when it was traced (UTC)"),
        "tensors": (I, "activations the forward graph saves for the backward (step inputs not counted)"),
        "inputs": (I, "step inputs (parameters, data) the backward reads, held anyway"),
        "activation_bytes": (I, "bytes of those activations, batch 1"),
        "float32_bytes": (I, "of which float32"),
        "largest": (S, "the three largest shape and dtype groups: 'count x CxDxHxW dtype'"),
    },
    # memory-<config>-<commit>.parquet beside each allocator snapshot (`bench --memory-snapshot`): what is live at
    # the peak of its trace, one row per allocating line (`medddpm.measure.memory.snapshot`), read without unpickling
    "snapshot": {
        "snapshot": (S, "the snapshot pickle's file name"),
        "config": (S, "configuration, as the file name spells it"),
        "commit": (S, "the commit's first 7 digits ('' where unknown)"),
        "peak_bytes": (I, "the largest allocated total of the trace"),
        "peak_event": (I, "index of the trace's event that reached it"),
        "events": (I, "events in the trace"),
        "held_bytes": (I, "allocated before the trace began (weights, gradients, Adam's state, the batch)"),
        "peak_phase": (S, "forward | backward | optimizer: the annotated phase of the peak, or ''"),
        "origin": (S, "the package's innermost frame that allocated, 'function (file:line)', or a kind of block"),
        "code": (S, "that line's statement"),
        "blocks": (I, "blocks of this origin live at the peak"),
        "bytes": (I, "their bytes"),
        "largest": (I, "the largest block's bytes"),
    },
    # data/<gpu-slug>/convergence/{runs,losses,samples}.parquet: `python -m medddpm study`, one training run per
    # configuration and seed from the same weights, data order and noise, then scored samples of its EMA weights
    "convergence_runs": {
        "config": (S, "configuration name"),
        "seed": (I, "seed of the initial weights, the data order and the training noise"),
        "status": (S, "ok | diverged (a non-finite loss that fp16's scaler did not skip: stopped, unsampled) | error"),
        "message": (S, "why, when status is diverged or error"),
        "switches": (S, "JSON: the configuration's switches"),
        "precision_used": (S, "precision that ran on this device"),
        "not_applicable": (S, "JSON: switches that could not apply on this device, with why"),
        "size": (I, "input size: voxels per side of a cube"),
        "base_channels": (I, "U-Net base width"),
        "data": (S, "training data: mni (the embedded templates) or a folder"),
        "pairs": (I, "training pairs"),
        "steps": (I, "optimizer steps"),
        "grad_accum": (I, "micro-batches of one volume per optimizer step"),
        "lr": (F, "Adam learning rate"),
        "skipped_steps": (I, "optimizer steps fp16's loss scaler skipped (0 without one)"),
        "final_loss": (F, "mean loss of the last 100 steps"),
        "ema_decay": (F, "EMA decay per update"),
        "ema_start": (I, "optimizer step from which the EMA averages (before it, a copy of the weights)"),
        "sample_steps": (I, "denoising steps of each sample (the training schedule's T: full ancestral sampling)"),
        "sample_precision": (S, "precision the samples were drawn in (the configuration's)"),
        "label_maps": (S, "JSON list: the label maps sampled (mni:SEED, subjects not among the training pairs)"),
        "samples": (I, "samples drawn: samples per label map x label maps"),
        "train_s": (F, "wall time of training, compilation included"),
        "sample_s": (F, "wall time of sampling"),
        "gpu_name": (S, "torch.cuda.get_device_name, or 'cpu'"),
        "gpu_slug": (S, "gpu_name lower-cased, other characters as hyphens"),
        "torch": (S, "torch.__version__"),
        "cuda": (S, "CUDA version torch was built with"),
        "cudnn": (S, "cuDNN version in use"),
        "git_commit": (S, "commit of this repository (-dirty if modified)"),
        "start_time": (S, "UTC start, ISO 8601"),
    },
    "convergence_losses": {
        "config": (S, "configuration name"),
        "seed": (I, "seed of the run"),
        "step": (I, "optimizer step, from 1"),
        "loss": (F, "training loss of the step (mean over its micro-batches)"),
    },
    "convergence_samples": {
        "config": (S, "configuration name; 'real' for the held-out subjects' own images, scored the same way"),
        "seed": (I, "seed of the run (0 for 'real')"),
        "sample": (I, "sample index within the run, from 0"),
        "label_map": (S, "the label map it was conditioned on (mni:SEED)"),
        "other": (I, "for a pair metric (ms_ssim), the other sample of the same label map; -1 otherwise"),
        "metric": (S, "label_dice (3-cluster k-means of the intensities inside the brain against the label map) | "
                      "hist_w1 (1-Wasserstein distance of the intensities to the real training images', on the "
                      "[-1, 1] scale) | ms_ssim (3D multi-scale SSIM between two samples of one label map)"),
        "tissue": (S, "csf | gm | wm | mean (label_dice, hist_w1); brain for ms_ssim"),
        "value": (F, "the metric's value"),
    },
}

# Columns added after data was committed, with the value every older table implies: such a table is
# read with the column filled in (the files themselves stay as measured).
# A value may be a function of the old table (arrow), returning one value per row.
ADDED: dict[str, dict[str, object]] = {
    "run": {
        **switch_defaults(),  # a switch's default is how rows written before it existed ran
        # rows written before the memory columns existed were all whole-head, cubic, one residual block a level,
        # and without the device's memory size
        "shape": lambda t: [f"{s}x{s}x{s}" for s in t.column("size").to_pylist()],
        "image_channels": 1,
        "num_res_blocks": 1,
        "gpu_total_bytes": -1,
        "gpu_other_bytes": -1,
        "compile_cache": "",  # rows written before it was recorded: unknown
        # rows written before the data source was recorded trained on their preset's embedded data
        "data_source": lambda t: ["mni-brats" if p == "brats" else "mni" for p in t.column("preset").to_pylist()],
        **dict.fromkeys(("cache_build_s", "e2e_median_ms", "e2e_drift", "loader_items_per_s", "sm_clock_mhz",
                         "mem_clock_mhz", "gpu_temp_max_c", "power_limit_w", "throttled_share"), float("nan")),
        "throttle_reasons": "",  # not recorded
        "skipped_steps": 0,  # rows written before it was recorded: no configuration had a loss scaler
        # rows written before labels existed sit in the folder of their device type; their host is unknown
        "gpu_type": lambda t: t.column("gpu_slug").to_pylist(),
        "host": "",
        "identity": "",  # rows written before identities were recorded: their folder's default (store.identity)
    },
    "kernels": {"op": ""},  # which operator launched a kernel: unknown in tables written before it was recorded
}

# Columns that tables written while a switch existed carry and the schema no longer has: switches removed from
# the product after runs recorded them (each measured a loss or was never kept), with the value that meant "off"
# (what every run the product can still make measured). A table is read without them (the files themselves stay as
# measured); writing rejects them like any column not in the schema. A recorded identity compares them at that value
# (`store.identity.canonical`).
RETIRED_SWITCHES: dict[str, object] = {
    "split_skip": False, "store_norm_grad": False, "cudnn_try_all": False, "memory_budget": 1.0, "aot_cse": True,
    "recompute_reads": False, "nd_tiling": False, "coordinate_descent": False, "combo_kernels": False,
    "conv": "cudnn", "condition_once": False,
}
RETIRED: dict[str, tuple[str, ...]] = {"run": tuple(RETIRED_SWITCHES)}

# Columns renamed after data was committed: table -> {old name: new name}. A table written under the old name
# reads under the new one; writing takes the new name only.
RENAMED: dict[str, dict[str, str]] = {
    # one step's time is step_ms everywhere; a micro-step's index or count is micro_step(s), a step an optimizer step
    "steps": {"time_ms": "step_ms", "step": "micro_step"},
    "scaling": {"time_ms": "step_ms", "step": "micro_step"},
    "kernels": {"steps": "micro_steps"},
    "bench": {"steps": "timed_steps"},  # as the run table says
}

# The phases of a run after its timed training steps, in the order they run (training always runs; a sweep
# that needs step times only, such as the ablation, runs none of them). `profilers` records each one's status.
PHASES = ("sample", "torch", "quality", "ncu")


class SchemaError(UserError):
    """A table does not match its documented schema (one line)."""


# Value checks, on write and on read, beyond the types: the values a column may take, the columns that
# identify a row (never null or empty, and unique together), and the tables of one run (one run_id).
ENUMS: dict[str, dict[str, tuple[str, ...]]] = {
    "run": {"status": ("ok", "oom", "error", "skipped"), "precision": ("fp32", "tf32", "bf16", "fp16")},
    "steps": {"phase": ("train", "sample")},
    "kernels": {"pass": ("forward", "backward", "optimizer", "graph", "other"), "device_type": ("cuda", "cpu")},
    "ncu": {"kind": ("metric", "rule")},
    "bench": {"phase": ("train", "sample")},
    "roofs": {"roof": ("dram", "fp32", "tf32", "bf16", "fp16"), "unit": ("byte/s", "FLOP/s")},
    "convergence_runs": {"status": ("ok", "diverged", "error")},
    "repeats": {"phase": ("train", "sample")},
    "sample_batches": {"status": ("ok", "oom", "error")},
}
# A measured time is never negative or infinite: such a value in a table (written by hand, or by a tool that
# parsed text) would still compare as a number, and flip a claim's verdict.
_TIME = (0, sys.float_info.max)
_TIMES = ("train_median_ms", "train_p10_ms", "train_p90_ms", "sample_step_median_ms")
RANGES: dict[str, dict[str, tuple[float, float]]] = {  # inclusive bounds; NaN passes (not measured)
    "run": dict.fromkeys((*_TIMES, "train_mean_ms", "train_std_ms", "dispatch_median_ms", "e2e_median_ms"), _TIME),
    "bench": dict.fromkeys((*_TIMES, "sample_step_p10_ms", "sample_step_p90_ms"), _TIME),
    "steps": {"micro_step": (0, math.inf), "step_ms": (0, math.inf)},
    "kernels": {"calls": (0, math.inf), "total_us": (0, math.inf), "share": (0, 1 + 1e-6),
                "micro_steps": (0, math.inf)},
    "quality": {"step": (1, math.inf)},
    "scaling": {"world_size": (1, math.inf), "rank": (0, math.inf), "micro_step": (0, math.inf)},
    "convergence_losses": {"step": (1, math.inf)},
    "roofs": {"value": (0, math.inf), "repeats": (1, math.inf), "size": (1, math.inf)},
    "repeats": {**dict.fromkeys(("block_ms", "block_p10_ms", "block_p90_ms"), _TIME), "steps": (1, math.inf),
                "batch": (1, math.inf), "position": (0, math.inf), "repeat": (0, math.inf)},
    "sample_batches": {**dict.fromkeys(("step_median_ms", "step_p10_ms", "step_p90_ms", "volume_s"), _TIME),
                       "batch": (1, math.inf)},
    "snapshot": {"peak_bytes": (0, math.inf), "held_bytes": (0, math.inf), "blocks": (0, math.inf),
                 "bytes": (0, math.inf), "largest": (0, math.inf)},
}
KEYS: dict[str, tuple[str, ...]] = {  # non-null, non-empty, and unique together
    "run": ("run_id",),
    "steps": ("run_id", "phase", "micro_step"),
    "kernels": ("run_id",),
    "ncu": ("run_id",),
    "quality": ("run_id", "step"),
    "scaling": ("run_id", "rank", "micro_step"),
    "convergence_losses": ("config", "seed", "step"),
    "roofs": ("gpu_slug", "roof"),
    "snapshot": ("origin",),
    "repeats": ("call_id", "position"),
    "sample_batches": ("call_id", "config", "batch"),
}
ONE_RUN = ("steps", "kernels", "ncu", "quality")  # a run folder's tables of many rows: all of its one run


def _plain(value):
    """A numpy scalar as the Python number it holds, for a message that reads 'inf', not 'np.float64(inf)'."""
    return value.item() if hasattr(value, "item") else value


def check_values(df: pd.DataFrame, table: str, where: str = "") -> None:
    """Raise a one-line SchemaError naming the column where a value breaks `ENUMS`, `RANGES` or `KEYS`."""
    at = f"{where}: " if where else f"{table} table: "
    for column, allowed in ENUMS.get(table, {}).items():
        bad = df[column][~df[column].isin(allowed)]
        if len(bad):
            raise SchemaError(f"{at}column {column}: {bad.iloc[0]!r} is not one of {', '.join(allowed)}")
    for column, (low, high) in RANGES.get(table, {}).items():
        values = pd.to_numeric(df[column])
        bad = values[(values < low) | (values > high)]
        if len(bad):
            bounds = f"(a finite number of at least {low})" if high == sys.float_info.max else f"[{low}, {high}]"
            raise SchemaError(f"{at}column {column}: {_plain(bad.iloc[0])!r} is out of range {bounds}")
    keys = [k for k in KEYS.get(table, ()) if k in df]
    for column in keys:
        missing = df[column].isna() | (df[column].astype(str) == "") if df[column].dtype != bool else df[column].isna()
        if missing.any():
            raise SchemaError(f"{at}column {column}: null or empty in row {int(missing.to_numpy().argmax())}")
    if table != "kernels" and table != "ncu" and keys and df.duplicated(keys).any():
        row = df[df.duplicated(keys)].iloc[0]
        which = ", ".join(f"{k}={row[k]!r}" for k in keys)
        raise SchemaError(f"{at}columns {', '.join(keys)}: duplicated row {which}")
    if table in ONE_RUN and df["run_id"].nunique() > 1:
        raise SchemaError(f"{at}column run_id: rows of {df['run_id'].nunique()} runs in one table "
                          f"({', '.join(map(str, df['run_id'].unique()[:2]))}, ...)")


def arrow_schema(table: str) -> pa.Schema:
    if table not in TABLES:
        raise SchemaError(f"unknown table {table!r}; known: {', '.join(TABLES)}")
    return pa.schema([pa.field(name, typ) for name, (typ, _) in TABLES[table].items()])


def validate(df: pd.DataFrame, table: str) -> pa.Table:
    """Exactly the documented columns, each convertible to its type without loss."""
    schema = arrow_schema(table)
    missing = [n for n in schema.names if n not in df.columns]
    extra = [c for c in df.columns if c not in schema.names]
    if missing or extra:
        raise SchemaError(f"{table} table: missing columns {missing}, unexpected columns {extra}")
    try:
        arrow = pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise SchemaError(f"{table} table: {str(e).splitlines()[0]}") from None
    check_values(df, table)
    return arrow


def write_table(df: pd.DataFrame, path: str | os.PathLike, table: str) -> Path:
    """Validate, then write parquet atomically."""
    arrow = validate(df, table)
    return atomic_write(path, lambda f: pq.write_table(arrow, f))


def same_kind(got: pa.DataType, want: pa.DataType) -> bool:
    """Whether a stored column of type `got` holds values of the schema's `want` in another width or encoding
    (large_string, int32, float32, an integer in a float column): read, cast without loss. Anything else is
    refused on read though Arrow would cast it: text parsed as numbers ("12.5" in `train_median_ms`), numbers
    printed as text, booleans counted as 0/1 or floats cut to integers would each read as valid values of another
    meaning. A column of nulls alone (pandas' all-None object column) is of every kind; its nulls are checked as
    values (`check_values`)."""
    if pa.types.is_null(got) or got == want:
        return True
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or pa.types.is_integer(got)
    return False


def read_table(path: str | os.PathLike, table: str | None = None) -> pd.DataFrame:
    """Read a table and check it against its schema (the table name defaults to the one its place in the tree
    says, `layout.table_of`): a column renamed since the file was written (`RENAMED`) reads under its new name,
    one the schema has retired (`RETIRED`) is dropped, one added since (`ADDED`) is filled in."""
    path = Path(path)
    table = table or table_of(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"missing data file {path}")
    with open_regular(path, "a table") as f:  # a folder, a named pipe or a symlink loop: one line naming it
        arrow = pq.read_table(f)
    renamed = RENAMED.get(table, {})
    if any(n in renamed for n in arrow.schema.names):  # a table written before a column's rename
        arrow = arrow.rename_columns([renamed.get(n, n) for n in arrow.schema.names])
    arrow = arrow.drop_columns([n for n in RETIRED.get(table, ()) if n in arrow.schema.names])
    want = arrow_schema(table)
    for name, value in ADDED.get(table, {}).items():  # tables written before the column existed
        if name not in arrow.schema.names and name in want.names:
            values = value(arrow) if callable(value) else [value] * arrow.num_rows
            arrow = arrow.append_column(name, pa.array(values, want.field(name).type))
    arrow = arrow.drop_columns([n for n in arrow.schema.names if n.startswith("__index_level_")])  # pandas' index
    missing = [n for n in want.names if n not in arrow.schema.names]
    extra = [n for n in arrow.schema.names if n not in want.names]
    if missing or extra:
        raise SchemaError(f"{path}: missing columns {missing}, unexpected columns {extra} "
                          f"(schema.TABLES[{table!r}])")
    arrow = arrow.select(want.names)
    for name in want.names:  # a table rewritten by pandas may hold large_string or another integer width
        got, typ = arrow.schema.field(name).type, want.field(name).type
        if got != typ:
            if not same_kind(got, typ):
                raise SchemaError(f"{path}: column {name} is {got}, expected {typ}")
            try:
                column = arrow.column(name).cast(typ, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                raise SchemaError(f"{path}: column {name} is {got}, expected {typ}") from None
            arrow = arrow.set_column(want.get_field_index(name), want.field(name), column)
    df = arrow.to_pandas()
    check_values(df, table, str(path))
    return df


def empty(table: str) -> pd.DataFrame:
    return arrow_schema(table).empty_table().to_pandas()


def markdown() -> str:
    """The schemas as Markdown tables (for the book's methodology page)."""
    parts = []
    for table, cols in TABLES.items():
        parts.append(f"**{table}.parquet**\n\n| column | type | meaning |\n|---|---|---|")
        parts += [f"| `{n}` | {t} | {d} |" for n, (t, d) in cols.items()]
        parts.append("")
    return "\n".join(parts)
