"""Time one training micro-step of the public reference implementation (med-ddpm).

The reference, github.com/mobaidoctor/med-ddpm, is GPL-3.0. This module does NOT
contain or copy any of its code: it imports it at run time from a directory the
user supplies (``ref_root``, e.g. a clone of that repository), by inserting that
directory into ``sys.path``. Keep such a clone outside tracked files.

Only ``diffusion_model/unet.py`` (+ ``modules.py``) and
``diffusion_model/trainer.py`` (``GaussianDiffusion``) are used. ``trainer.py``
imports at top level several packages that play no part in the loss
(torchvision, PIL, einops, torch.utils.tensorboard -> tensorboard, nibabel, tqdm;
apex is already inside a try/except there). Any of these that is not installed is
replaced by an empty placeholder module in ``sys.modules`` before the import
(see ``_stub_unrelated_imports``); installed ones are used as they are. Note that
importing ``trainer.py`` also prints "APEX: OFF" and installs a global
``warnings.filterwarnings("ignore", category=UserWarning)``.

Used by `python -m medddpm bench --reference PATH`, which times the reference's micro-step
beside ours in one process, on the same input and under the same precision flags.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

import torch

# Values of the reference's whole-head training (train.py defaults + scripts/train.sh).
REF_NUM_CHANNELS = 64
REF_NUM_RES_BLOCKS = 1
REF_TIMESTEPS = 250
REF_LOSS_TYPE = "l1"
REF_LR = 1e-5
REF_GRAD_ACCUM = 2  # Trainer(gradient_accumulate_every=2): each micro-step backprops loss / 2
# The reference's create_model() has a built-in channel_mult table for these sizes only.
_REF_SIZE_TABLE = (64, 128, 256, 512)


def _stub_unrelated_imports() -> list[str]:
    """Put empty placeholders in sys.modules for trainer.py's unrelated top-level
    imports that are not installed. Returns the names that were stubbed."""
    stubbed = []

    def missing(name: str) -> bool:
        if name in sys.modules:
            return False
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    # `from torchvision import transforms, utils`
    if missing("torchvision"):
        tv = types.ModuleType("torchvision")
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.utils = types.ModuleType("torchvision.utils")
        sys.modules.update({"torchvision": tv, "torchvision.transforms": tv.transforms,
                            "torchvision.utils": tv.utils})
        stubbed.append("torchvision")
    # `from PIL import Image`
    if missing("PIL"):
        pil = types.ModuleType("PIL")
        pil.Image = types.ModuleType("PIL.Image")
        sys.modules.update({"PIL": pil, "PIL.Image": pil.Image})
        stubbed.append("PIL")
    # `import nibabel as nib`, `from tqdm import tqdm` (tqdm only used when sampling)
    if missing("nibabel"):
        sys.modules["nibabel"] = types.ModuleType("nibabel")
        stubbed.append("nibabel")
    if missing("tqdm"):
        tq = types.ModuleType("tqdm")
        tq.tqdm = lambda it=None, *a, **k: it
        sys.modules["tqdm"] = tq
        stubbed.append("tqdm")
    # `from einops import rearrange` (unused by GaussianDiffusion)
    if missing("einops"):
        ein = types.ModuleType("einops")
        ein.rearrange = None
        sys.modules["einops"] = ein
        stubbed.append("einops")
    # `from torch.utils.tensorboard import SummaryWriter` (Trainer logging only);
    # torch.utils.tensorboard itself raises ImportError when `tensorboard` is absent.
    if "torch.utils.tensorboard" not in sys.modules:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            tb = types.ModuleType("torch.utils.tensorboard")

            class SummaryWriter:  # placeholder, never instantiated here
                def __init__(self, *a, **k):
                    raise RuntimeError("tensorboard placeholder")

            tb.SummaryWriter = SummaryWriter
            sys.modules["torch.utils.tensorboard"] = tb
            stubbed.append("torch.utils.tensorboard")
    return stubbed


def _ensure_fp16_util(ref_root: str) -> bool:
    """unet.py does `from .fp16_util import convert_module_to_f16, convert_module_to_f32`.
    A full clone has diffusion_model/fp16_util.py; if it is absent, register a minimal
    stand-in (our own code; these two functions are only used by convert_to_fp16/fp32,
    which the reference's training never calls). Returns True if stubbed."""
    if os.path.exists(os.path.join(ref_root, "diffusion_model", "fp16_util.py")):
        return False
    if "diffusion_model.fp16_util" in sys.modules:
        return True
    mod = types.ModuleType("diffusion_model.fp16_util")
    conv_types = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)

    def _convert(dtype):
        def fn(layer):
            if isinstance(layer, conv_types):
                layer.weight.data = layer.weight.data.to(dtype)
                if layer.bias is not None:
                    layer.bias.data = layer.bias.data.to(dtype)
        return fn

    mod.convert_module_to_f16 = _convert(torch.float16)
    mod.convert_module_to_f32 = _convert(torch.float32)
    sys.modules["diffusion_model.fp16_util"] = mod
    return True


def _import_reference(ref_root: str):
    ref_root = os.path.abspath(ref_root)
    if not os.path.isfile(os.path.join(ref_root, "diffusion_model", "unet.py")):
        raise FileNotFoundError(f"{ref_root}/diffusion_model/unet.py not found "
                                "(expected a clone of github.com/mobaidoctor/med-ddpm)")
    if ref_root not in sys.path:
        sys.path.insert(0, ref_root)
    stubbed = _stub_unrelated_imports()
    if _ensure_fp16_util(ref_root):
        stubbed.append("diffusion_model.fp16_util")
    unet = importlib.import_module("diffusion_model.unet")
    trainer = importlib.import_module("diffusion_model.trainer")
    return unet, trainer, stubbed


def build_reference(ref_root: str, *, size: int = 128, mask_channels: int = 2,
                    device="cpu") -> tuple[Any, Any]:
    """Build the reference UNet and GaussianDiffusion as its whole-head train.py does.

    For 128 this is exactly
        create_model(128, 64, 1, in_channels=mask_channels + 1, out_channels=1)
    i.e. channel_mult (1,1,2,3,4), attention_resolutions "16" (-> downsample factor
    128 // 16 = 8), use_checkpoint=False (create_model default, not overridden by
    train.py), dropout 0, 1 head, use_fp16=False; then
        GaussianDiffusion(model, image_size=size, depth_size=size, timesteps=250,
                          loss_type='l1', with_condition=True, channels=1).
    For 64/256/512 the reference's own size table is used (as it would be). Any other
    size (e.g. 32, for CPU smoke tests) keeps the 128 architecture: channel_mult
    "1,1,2,3,4" and attention at downsample factor 8 (size must be a multiple of 16).

    device: "cpu", "cuda", ... or "meta" (built directly on the meta device, no
    memory, for counting parameters). Other devices: built on the CPU (as the
    reference does before .cuda()) then moved. Precision flags are the caller's
    (`configs.set_precision_flags`), exactly as for our own model.
    """
    unet, trainer, stubbed = _import_reference(ref_root)
    in_channels = mask_channels + 1  # train.py: num_class_labels (default 3) = masks + image
    kwargs = dict(in_channels=in_channels, out_channels=1)
    if size not in _REF_SIZE_TABLE:
        if size % 16 or size < 16:
            raise ValueError("size must be 64/128/256/512 or a multiple of 16")
        kwargs.update(channel_mult="1,1,2,3,4", attention_resolutions=str(size // 8))
    dev = torch.device(device)

    def make():
        model = unet.create_model(size, REF_NUM_CHANNELS, REF_NUM_RES_BLOCKS, **kwargs)
        diffusion = trainer.GaussianDiffusion(
            model, image_size=size, depth_size=size, timesteps=REF_TIMESTEPS,
            loss_type=REF_LOSS_TYPE, with_condition=True, channels=1)
        return model, diffusion

    if dev.type == "meta":
        with torch.device("meta"):
            model, diffusion = make()
    else:
        model, diffusion = make()
        diffusion = diffusion.to(dev)  # moves model (its denoise_fn) and buffers
    diffusion.stubbed_imports = stubbed
    return model, diffusion


def make_reference_optimizer(diffusion, lr: float = REF_LR):
    """The reference Trainer's optimizer: Adam(diffusion.parameters(), lr=train_lr)
    with every other argument at its default (train.py passes lr 1e-5).
    (The reference pinned torch 1.13.1, whose Adam default was the per-tensor loop;
    torch >= 2.0 picks the foreach implementation on CUDA by default.)"""
    return torch.optim.Adam(diffusion.parameters(), lr=lr)


def reference_micro_step(model, diffusion, optimizer, image, cond, *,
                         optimizer_step: bool = True) -> torch.Tensor:
    """One micro-step as the reference Trainer.train() does it, with the optimizer
    step done after this single micro-step (optimizer_step=False leaves it out, so
    that two calls + one step reproduce the reference's accumulation of 2).

    image: (B, 1, S, S, S) in [-1, 1]; cond: (B, mask_channels, S, S, S) in {-1, 1}.
    Calls diffusion(image, condition_tensors=cond) exactly like the Trainer:
    GaussianDiffusion.forward draws t ~ U{0..249}, p_losses draws the noise, feeds
    cat([x_noisy, cond], dim=1) to the UNet and returns mean |noise - pred|.
    Then loss.sum() / batch_size, backward of loss / 2 (gradient_accumulate_every=2),
    optimizer.step(), optimizer.zero_grad() (set_to_none default of current torch).
    No AMP: train.py passes fp16=False (the only mixed-precision path in the
    reference is apex amp O1, off by default); no torch.cuda.amp anywhere.
    The reference also calls loss.item() twice per micro-step (print + log list),
    a host sync; here the loss is returned detached and the caller synchronizes.
    """
    assert diffusion.denoise_fn is model
    loss = diffusion(image, condition_tensors=cond)
    loss = loss.sum() / image.shape[0]
    (loss / REF_GRAD_ACCUM).backward()
    if optimizer_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach()


def count_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def bench_reference(ref_root: str, spec, *, precision: str, device: torch.device, warmup: int = 5,
                    micro_steps: int = 30, seed: int = 0, progress: bool = True) -> dict:
    """Time the reference's micro-step (forward + backward + Adam step) like `bench.bench_train`."""
    from medddpm.measure.timing.bench import train_summary
    from medddpm.train.data import real_batch
    from medddpm.train.timing import time_steps
    from medddpm.configs import set_precision_flags

    if precision not in ("fp32", "tf32"):
        raise ValueError(f"the reference runs in fp32 or tf32 only, not {precision!r}")
    if spec.image_channels != 1 or not isinstance(spec.size, int):
        raise ValueError("the reference is timed in its whole-head setting only (one image channel, a cubic input)")
    flags = set_precision_flags(precision)
    torch.manual_seed(seed)
    model, diffusion = build_reference(ref_root, size=spec.size, mask_channels=spec.mask_channels, device=device)
    opt = make_reference_optimizer(diffusion)
    image, cond = (t.to(device) for t in real_batch(spec, seed=seed))
    losses = []
    result = time_steps(lambda: losses.append(reference_micro_step(model, diffusion, opt, image, cond)),
                        device=device, warmup=warmup, steps=micro_steps, desc=f"reference {precision}",
                        progress=progress)
    return result | train_summary(result["step_ms"]) | {"config": f"reference-{precision}", "loss": torch.stack(losses).cpu().tolist(),
                     "not_applicable": {}, "backend_flags": flags, "parameters": count_parameters(model)}
