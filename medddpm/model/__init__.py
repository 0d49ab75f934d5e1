"""The model: Med-DDPM's 3D U-Net (`unet`, built from `blocks` and `group_norm`), the Gaussian diffusion it is
trained in (`diffusion`), its FLOP count on the meta device (`flops`), and the passes that shape its compiled
graphs (`layout`, `recompute`)."""
