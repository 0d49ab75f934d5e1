"""Gaussian diffusion as Med-DDPM trains and samples it: cosine schedule, epsilon prediction, L1.

Cosine schedule from Nichol & Dhariwal, "Improved Denoising Diffusion Probabilistic Models"
(ICML 2021), eq. 17, with s = 0.008 and betas clipped at 0.999. Ancestral sampling follows Ho et
al. (NeurIPS 2020): predict x0 from the noise estimate, clip it to [-1, 1], then draw from the
posterior q(x_{t-1} | x_t, x0).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from medddpm.progress import progress_bar

TIMESTEPS = 250  # the reference's T, for training and for ancestral sampling


def cosine_betas(timesteps: int, *, s: float = 0.008, max_beta: float = 0.999) -> torch.Tensor:
    steps = torch.arange(timesteps + 1, dtype=torch.float64)
    alpha_bar = torch.cos((steps / timesteps + s) / (1 + s) * math.pi / 2) ** 2
    return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=max_beta)


def _gather(buf: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """buf[t] shaped (B, 1, 1, ...) to broadcast over a (B, C, D, H, W) tensor."""
    return buf.gather(0, t).reshape(-1, *([1] * (ndim - 1)))


class GaussianDiffusion(nn.Module):
    """Holds the schedule; the denoiser is passed in, so one schedule serves a compiled model too."""

    def __init__(self, *, timesteps: int = TIMESTEPS, betas: torch.Tensor | None = None,
                 timestep_map: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(timesteps, int) or timesteps < 1:
            raise ValueError(f"timesteps must be a positive int, got {timesteps!r}")
        self.timesteps = timesteps
        betas = cosine_betas(timesteps) if betas is None else betas.double()
        # a respaced schedule's step i is the model's timestep timestep_map[i] (`respaced`); None: the same
        self.timestep_map = timestep_map
        alpha_bar = torch.cumprod(1 - betas, 0)
        alpha_bar_prev = F.pad(alpha_bar[:-1], (1, 0), value=1.0)
        post_var = betas * (1 - alpha_bar_prev) / (1 - alpha_bar)
        tables = {
            "sqrt_alpha_bar": alpha_bar.sqrt(),
            "sqrt_one_minus_alpha_bar": (1 - alpha_bar).sqrt(),
            "sqrt_recip_alpha_bar": (1 / alpha_bar).sqrt(),
            "sqrt_recipm1_alpha_bar": (1 / alpha_bar - 1).sqrt(),
            # log of the posterior variance, clipped at t=0 where it is 0 (Ho et al.)
            "post_log_var": torch.log(torch.cat([post_var[1:2], post_var[1:]])),
            "post_coef_x0": betas * alpha_bar_prev.sqrt() / (1 - alpha_bar),
            "post_coef_xt": (1 - alpha_bar_prev) * (1 - betas).sqrt() / (1 - alpha_bar),
        }
        self.register_buffer("betas", betas.float(), persistent=False)
        for name, value in tables.items():
            self.register_buffer(name, value.float(), persistent=False)

    def respaced(self, steps: int) -> "GaussianDiffusion":
        """This schedule on `steps` evenly spaced ones of its timesteps (Nichol & Dhariwal 2021, section 4: the
        betas recomputed from the kept cumulative alphas), for ancestral sampling in fewer steps; the model is
        called with the original timesteps. `steps` equal to `timesteps`: this schedule itself."""
        if not isinstance(steps, int) or not 1 <= steps <= self.timesteps:
            raise ValueError(f"steps must be an int from 1 to {self.timesteps}, got {steps!r}")
        if steps == self.timesteps:
            return self
        keep = torch.linspace(0, self.timesteps - 1, steps, dtype=torch.float64).round().long()
        alpha_bar = torch.cumprod(1 - cosine_betas(self.timesteps), 0)[keep]
        betas = 1 - alpha_bar / torch.cat([torch.ones(1, dtype=alpha_bar.dtype), alpha_bar[:-1]])
        return GaussianDiffusion(timesteps=steps, betas=betas, timestep_map=keep).to(self.betas.device)

    def _apply(self, fn, *args, **kwargs):  # the map moves with the buffers
        if self.timestep_map is not None:
            self.timestep_map = fn(self.timestep_map)
        return super()._apply(fn, *args, **kwargs)

    # ---------------------------------------------------------------------------------- training

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return _gather(self.sqrt_alpha_bar, t, x0.ndim) * x0 + _gather(self.sqrt_one_minus_alpha_bar, t, x0.ndim) * noise

    def loss(self, model: nn.Module, x0: torch.Tensor, cond: torch.Tensor, *, t: torch.Tensor | None = None,
             noise: torch.Tensor | None = None) -> torch.Tensor:
        """L1 between the true and predicted noise at uniformly drawn timesteps (no host sync)."""
        b = x0.shape[0]
        if t is None:
            t = torch.randint(0, self.timesteps, (b,), device=x0.device)
        if noise is None:
            noise = torch.randn_like(x0)
        x_t = self.q_sample(x0, t, noise)
        pred = model(torch.cat([x_t, cond.to(x_t.dtype)], dim=1), t)
        return F.l1_loss(pred.float(), noise.float())

    # ---------------------------------------------------------------------------------- sampling

    def p_step(self, model: nn.Module, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
               noise: torch.Tensor) -> torch.Tensor:
        """One ancestral step x_t -> x_{t-1}; `noise` is ignored where t == 0."""
        model_t = t if self.timestep_map is None else self.timestep_map[t]
        eps = model(torch.cat([x, cond.to(x.dtype)], dim=1), model_t).float()
        x0 = (_gather(self.sqrt_recip_alpha_bar, t, x.ndim) * x - _gather(self.sqrt_recipm1_alpha_bar, t, x.ndim) * eps)
        x0 = x0.clamp(-1, 1)
        mean = _gather(self.post_coef_x0, t, x.ndim) * x0 + _gather(self.post_coef_xt, t, x.ndim) * x
        nonzero = (t != 0).float().reshape(-1, *([1] * (x.ndim - 1)))
        return mean + nonzero * (0.5 * _gather(self.post_log_var, t, x.ndim)).exp() * noise

    @torch.no_grad()
    def sample(self, model: nn.Module, cond: torch.Tensor, *, image_channels: int = 1,
               generator: torch.Generator | None = None, progress: bool = True, step_callback=None,
               step: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Generate images for the label maps `cond` (B, mask_channels, D, H, W); returns (B, C, D, H, W).

        `step(x, cond, t, noise)` replaces `p_step(model, ...)` (`Engine.denoise_step` replays a CUDA graph)."""
        step = step or functools.partial(self.p_step, model)
        b, _, *spatial = cond.shape
        shape = (b, image_channels, *spatial)
        x = torch.randn(shape, device=cond.device, generator=generator)
        for i in progress_bar(reversed(range(self.timesteps)), total=self.timesteps, desc="sampling",
                               progress=progress):
            t = torch.full((b,), i, device=cond.device, dtype=torch.long)
            x = step(x, cond, t, torch.randn(shape, device=cond.device, generator=generator))
            if step_callback is not None:
                step_callback(i)
        return x
