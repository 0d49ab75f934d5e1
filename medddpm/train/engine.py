"""One training step of Med-DDPM under one configuration: the single place where switches act.

`Engine.step(batches)` runs forward + backward over the micro-batches (gradient accumulation) and
one Adam step, and returns the mean loss as a device tensor: nothing inside a step waits for the
host, so steps queue back to back on a GPU. The trainer, the benchmarks and the profilers all drive
this one object.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.profiler import record_function

from medddpm.configs import Config, Resolved, get_config, resolve, set_precision_flags
from medddpm.model.diffusion import TIMESTEPS, GaussianDiffusion
from medddpm.model.layout import compile_options
from medddpm.model.unet import ModelSpec, UNet3D
from medddpm.model.recompute import SaveRandomOps
from medddpm.train.checkpoint import cpu_rng_state


class EMA:
    """Exponential moving average of the weights, as the reference keeps it: decay 0.995, updated
    every 10 optimizer steps from step 2000 on, and a plain copy of the weights before that."""

    def __init__(self, model: torch.nn.Module, *, decay: float = 0.995, every: int = 10, start: int = 2000):
        self.decay, self.every, self.start = decay, every, start
        self.params = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        if step % self.every:
            return
        live = [p.detach() for p in model.parameters()]
        if step < self.start:
            torch._foreach_copy_(self.params, live)
        else:
            torch._foreach_lerp_(self.params, live, 1 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        torch._foreach_copy_([p.detach() for p in model.parameters()], self.params)

    def state_dict(self) -> dict:
        return {"params": self.params}

    def load_state_dict(self, state: dict) -> None:
        torch._foreach_copy_(self.params, [p.to(self.params[0].device) for p in state["params"]])


# `recompute_pointwise`. Inductor stores a pointwise result that several kernels read when its expression
# reads more than `realize_reads_threshold` (4) buffers or holds more than `realize_opcount_threshold` (30)
# operations (ir.StorageBox.should_realize_on_reuse). A GroupNorm-SiLU chain in backward (x, its group
# statistics, weight and bias) is both, so each GroupNorm's backward wrote a float32 copy of the voxels and read
# it back: 1 GiB at 128 channels of 128^3. Raised, each kernel recomputes the chain from the bf16 input.
RECOMPUTE_POINTWISE = {"realize_reads_threshold": 100, "realize_opcount_threshold": 1000}


# `conv_autotune`. Inductor times each forward convolution of a graph among cuDNN (ATen's call) and its Triton
# templates, and keeps the fastest; a template takes the pointwise work after it (the bias it peels off cuDNN's
# call, a residual add) as an epilogue. GEMMs stay on cuBLAS, so that the switch is about convolutions alone.
CONV_AUTOTUNE = {"max_autotune": True, "max_autotune_conv_backends": "ATEN,TRITON",
                 "max_autotune_gemm_backends": "ATEN"}


def inductor_options(run: Resolved, *, training: bool = True) -> dict:
    """`torch.compile(options=...)` for a configuration as it runs; the training graphs' own switch
    (`recompute_pointwise`) is left out of the denoising step's (`Engine.sampler`)."""
    options = compile_options(pin_layout=run.pin_layout)
    if training and run.config.checkpointing:
        options["joint_custom_pre_pass"] = SaveRandomOps()  # a recomputed SDPA kept the graphs out of the FX cache
    if training and run.recompute_pointwise:
        options |= RECOMPUTE_POINTWISE
    if run.config.conv_autotune and run.compile:
        options |= CONV_AUTOTUNE
    return options


class Engine:
    def __init__(self, spec: ModelSpec, config: Config | str, *, device: torch.device | str = "cpu",
                 lr: float = 1e-5, timesteps: int = TIMESTEPS, seed: int = 0, ema: bool = True, ddp: bool = False):
        config = get_config(config)
        self.spec, self.config = spec, config
        self.run: Resolved = resolve(config, device)
        self.device = self.run.device
        self.backend_flags = set_precision_flags(self.run.precision)
        torch.manual_seed(seed)

        model = UNet3D(spec, attention=config.attention, recompute_attention=config.recompute_attention,
                       upsample=config.upsample, checkpointing=config.checkpointing, group_norm=self.run.group_norm,
                       pad_channels=config.pad_channels, tap_gemm=config.tap_gemm, tap_major=config.tap_major,
                       store_skip_grad=config.store_skip_grad, narrow_checkpoints=config.narrow_checkpoints)
        self.model = model.to(self.device, memory_format=self.run.memory_format)
        self.denoiser = self._compile(self.model) if self.run.compile else self.model
        # Sampling saves nothing for a backward, so `recompute_pointwise` only adds work there (a tenth of the
        # denoising step): its graph keeps Inductor's thresholds.
        separate = self.run.recompute_pointwise  # needs compile
        self._sampler = self._compile(self.model, training=False) if separate else None
        self.diffusion = GaussianDiffusion(timesteps=timesteps).to(self.device)
        # capturable keeps Adam's step counter on the device, which graph replay requires.
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, fused=True if self.run.fused_adam else None,
                                    capturable=self.run.cuda_graphs)
        self.ema = EMA(self.model) if ema else None
        # fp16: the loss is scaled before backward and the gradients unscaled before Adam; a step whose
        # gradients hold an inf or NaN is skipped and the scale halved (it grows again after 2000 clean steps)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.run.loss_scaling else None
        self._skipped = torch.zeros((), device=self.device)  # steps the scaler skipped, counted on the device
        self.step_count = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self.capture_peak_bytes: int | None = None  # allocated peak while the last CUDA graph was captured
        self._static: tuple[list[tuple[torch.Tensor, ...]], torch.Tensor] | None = None
        self._denoise_graph: tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor] | None = None
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        if ddp:
            self.wrap_ddp()

    def wrap_ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        """Data parallelism over the initialised process group (`medddpm.train.distributed.init_from_env`).

        The forward pass goes through DistributedDataParallel, which averages gradients over the ranks;
        the optimizer, the EMA and the checkpoints keep working on the underlying `self.model` (so
        state-dict keys carry no `module.` prefix). Weights are broadcast from rank 0 here."""
        import torch.distributed as dist

        if self.ddp is not None:
            return self.ddp
        if self.run.cuda_graphs:
            raise ValueError(f"configuration {self.config.name!r}: CUDA graphs are not supported with DDP; turn cuda_graphs off")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DDP needs an initialised process group: launch with torchrun, call distributed.init_from_env()")
        device_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        # torch.compile on the DDP module: Dynamo's DDPOptimizer splits graphs at bucket boundaries.
        self.denoiser = self._compile(self.ddp) if self.run.compile else self.ddp
        return self.ddp

    # ------------------------------------------------------------------------------------ helpers

    def _compile(self, module: torch.nn.Module, *, training: bool = True):
        # dynamic=False: a run trains one volume shape; after other shapes in one process, automatic
        # dynamic shapes would trace symbolic sizes, which checkpointed blocks fail to lower (torch 2.13 CPU)
        return torch.compile(module, dynamic=False, options=inductor_options(self.run, training=training))

    def autocast(self):
        dtype = self.run.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Move a tensor to the device; (B, C, D, H, W) batches in the configuration's memory layout."""
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=self.run.memory_format) if x.ndim == 5 else x

    def activate(self) -> None:
        """Re-apply this configuration's process-wide math modes (another Engine may have changed them)."""
        self.backend_flags = set_precision_flags(self.run.precision)

    def loss(self, x0: torch.Tensor, cond: torch.Tensor, **kw) -> torch.Tensor:
        with self.autocast():
            return self.diffusion.loss(self.denoiser, x0, cond, **kw)

    # ------------------------------------------------------------------------------------- steps

    def _step(self, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        # Named ranges let the profiler attribute each kernel to its pass (kernels.py).
        total = None
        for i, (x0, cond, *fixed) in enumerate(batches):  # fixed: optional (t, noise), for runs that must match
            # Under DDP, gradients are all-reduced only after the last micro-batch's backward.
            sync = self.ddp is None or i == len(batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with record_function("forward"):
                    loss = self.loss(x0, cond, **dict(zip(("t", "noise"), fixed))) / len(batches)
                with record_function("backward"):
                    (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        with record_function("optimizer"):
            if self.scaler is None:
                self.opt.step()
            else:
                self.scaler.step(self.opt)
                # the overflow flag the step was skipped on, read before `update` clears it; added on the
                # device, so counting waits for nothing (and is replayed with a CUDA graph)
                self._skipped += sum(self.scaler._found_inf_per_device(self.opt).values())
                self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
        return total

    def skipped_counter(self) -> torch.Tensor:
        """The count of skipped steps so far, copied on the device (no host sync): a step's own reading."""
        return self._skipped.clone()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the fp16 loss scaler skipped for an inf or NaN gradient (0 without one); waits for
        the device."""
        return int(self._skipped.item())

    def _graphed(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`fn` warmed up three times on a side stream (cuDNN autotuning and compilation happen there,
        outside the graph), then captured; its output is the graph's static output. Replays allocate
        nothing (the graph's memory pool is set aside at capture), so the allocated peak during the
        capture is the step's memory need: kept as `capture_peak_bytes`."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        # The graph gets a private memory pool: hand the warm-up's cached blocks back first, so that
        # the reserved memory is the graph's pool plus what stays live, not that twice over.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        self.capture_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return graph, out

    def _capture(self, batches):
        """Record one whole step (`_graphed`: PyTorch's recipe for whole-network capture, docs 'CUDA
        semantics' > 'CUDA Graphs'). Weights, optimizer state and RNG are put back afterwards, in place,
        so capturing does not change the training trajectory."""
        # Host copies: device ones would sit beside the live weights and inflate the captured peak.
        weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        opt_state = {p: {k: v.detach().to("cpu", copy=True) for k, v in s.items()} for p, s in self.opt.state.items()}
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        skipped = self._skipped.clone()
        rng = torch.cuda.get_rng_state(self.device)
        static = [tuple(t.clone() for t in batch) for batch in batches]
        graph, loss = self._graphed(lambda: self._step(static))
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(weights[k])
            for p, s in self.opt.state.items():
                for k, v in s.items():
                    v.copy_(opt_state[p][k]) if p in opt_state else v.zero_()
            if scaler is not None:  # in place: the graph reads the scale and growth tracker it captured
                self.scaler._scale.fill_(scaler["scale"])
                self.scaler._growth_tracker.fill_(scaler["_growth_tracker"])
            self._skipped.copy_(skipped)
        torch.cuda.set_rng_state(rng, self.device)
        self._graph, self._static = graph, (static, loss)

    def step(self, batches: list[tuple[torch.Tensor, ...]] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One optimizer step over `batches`: a list of micro-batches (x0, cond) or (x0, cond, t, noise),
        or one such tuple.

        Inputs must already be prepared (`prepare`). Returns the loss on the device; no host sync.
        """
        if isinstance(batches, tuple):
            batches = [batches]
        if self.run.cuda_graphs:
            if self._graph is None:
                self._capture(batches)
            static, loss = self._static
            for static_batch, batch in zip(static, batches, strict=True):
                for dst, src in zip(static_batch, batch, strict=True):
                    dst.copy_(src, non_blocking=True)
            self._graph.replay()
            loss = loss.clone()
        else:
            loss = self._step(batches)
        self.step_count += 1
        if self.ema is not None:
            self.ema.update(self.model, self.step_count)
        return loss

    # ---------------------------------------------------------------------------------- sampling

    @property
    def sampler(self):
        """The denoiser that sampling calls: the training one, or with `recompute_pointwise` the same
        model compiled a second time without it."""
        return self.denoiser if self._sampler is None else self._sampler

    def _denoise(self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        with self.autocast(), torch.no_grad():
            return self.diffusion.p_step(self.sampler, x, cond, t, noise)

    def _capture_denoise(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Record one denoising step, as `_capture` records a training step."""
        static = tuple(v.clone() for v in inputs)
        graph, out = self._graphed(lambda: self._denoise(*static))
        self._denoise_graph = graph, static, out

    def denoise_step(self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """One ancestral step x_t -> x_{t-1} (`GaussianDiffusion.p_step`) without gradients, under the
        configuration's autocast. With `cuda_graphs` the step is captured once per input shape and then
        replayed: 250 steps of one sample launch 250 graphs instead of some 150 kernels each."""
        if not self.run.cuda_graphs:
            return self._denoise(x, cond, t, noise)
        inputs = (x, cond, t, noise)
        if self._denoise_graph is None or [v.shape for v in self._denoise_graph[1]] != [v.shape for v in inputs]:
            self._capture_denoise(inputs)
        graph, static, out = self._denoise_graph
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out.clone()  # the next replay overwrites `out`

    def sample(self, cond: torch.Tensor, *, image_channels: int, generator: torch.Generator | None = None,
               progress: bool = True, step_callback=None) -> torch.Tensor:
        """Ancestral sampling (`GaussianDiffusion.sample`) with this configuration's denoising step."""
        return self.diffusion.sample(self.sampler, cond, image_channels=image_channels, generator=generator,
                                     progress=progress, step_callback=step_callback, step=self.denoise_step)

    # -------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step_count,
                 "cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step_count = int(state["step"])
        # set_rng_state takes a CPU uint8 tensor only; a checkpoint loaded with map_location=<a GPU> holds GPU ones
        torch.set_rng_state(cpu_rng_state(state["cpu_rng"]))
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(cpu_rng_state(state["cuda_rng"]), self.device)
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self._skipped.fill_(state.get("skipped_steps", 0))
