"""Measurement presets: a model and input setting, the data it runs on by default, and how much of each phase
of a measured run to run; beside them, the reference's training length. Presets are to the model and the
measurement what `medddpm.configs` is to the arithmetic: `python -m medddpm sweep --preset NAME`."""

from __future__ import annotations

from dataclasses import dataclass

from medddpm.model.unet import ModelSpec

REFERENCE_STEPS = 100_000  # optimizer steps of the reference's training run (mobaidoctor/med-ddpm)
REFERENCE_ACCUM = 2  # micro-steps per optimizer step (its gradient accumulation)


@dataclass(frozen=True)
class Preset:
    """A model and input setting, the data it runs on by default, and how much of each phase to run."""

    name: str
    size: int | tuple[int, int, int]  # voxels per side, or (D, H, W)
    base_channels: int = 64
    channel_mult: tuple[int, ...] | None = None
    attention_ds: tuple[int, ...] = (8,)
    num_res_blocks: int = 1
    image_channels: int = 1
    mask_channels: int | None = None  # None: the data set's label classes
    data: str = "mni"  # the embedded data set used when none is named
    warmup: int = 5
    micro_steps: int = 30  # timed training micro-steps (forward + backward + Adam of one micro-batch)
    profile_steps: int = 2
    quality_steps: int = 20
    sample_steps: int = 250  # denoising steps of the timed sample (the schedule's T)
    description: str = ""

    def spec(self, *, mask_channels: int | None = None, image_channels: int | None = None) -> ModelSpec:
        """The model; `mask_channels` / `image_channels` are the data's, checked against the preset's own."""
        for what, mine, theirs in (("label", self.mask_channels, mask_channels),
                                   ("image", self.image_channels, image_channels)):
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"preset {self.name} is a model of {mine} {what} channels; the data has {theirs}")
        mask = self.mask_channels if self.mask_channels is not None else (mask_channels or 3)
        return ModelSpec(size=self.size, mask_channels=mask, image_channels=self.image_channels,
                         base_channels=self.base_channels, channel_mult=self.channel_mult,
                         attention_ds=self.attention_ds, num_res_blocks=self.num_res_blocks)


PRESETS = {
    # Every configuration on a 2-core CPU in a few minutes: the model's shape, tiny.
    "smoke": Preset("smoke", size=16, base_channels=32, channel_mult=(1, 2), attention_ds=(2,), warmup=1, micro_steps=3,
                    profile_steps=1, quality_steps=3, sample_steps=250,
                    description="the whole-head model's shape at 16^3 with 32 base channels (CPU)"),
    # The study's setting: whole-head Med-DDPM at 128^3, batch 1.
    "paper": Preset("paper", size=128, description="whole-head Med-DDPM, 128^3, 3 labels in, 1 image out"),
    # The reference's BraTS setting (train_brats.py): 192 x 192 x 144, four modalities predicted from four
    # label channels, two residual blocks a level, attention only in the middle block. 57,562,564
    # parameters, 21.26 TFLOP forward. Its phases are short (a step takes seconds in FP32); the timed
    # sample runs 20 denoising steps: a full one is 250 times sample_step_median_ms.
    "brats": Preset("brats", size=(192, 192, 144), channel_mult=(1, 1, 2, 3, 4), attention_ds=(), num_res_blocks=2,
                    image_channels=4, mask_channels=4, data="mni-brats", warmup=2, micro_steps=10, profile_steps=1,
                    quality_steps=3, sample_steps=20,
                    description="BraTS Med-DDPM, 192x192x144, 4 labels in, 4 modalities out (T1, T1ce, T2, FLAIR)"),
}


def get_preset(name: str) -> Preset:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
