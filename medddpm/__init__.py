"""medddpm: Med-DDPM's 3D diffusion U-Net trained and profiled under each precision, layout and fusion
optimization. The folders are the pipeline: `configs` -> `model` -> `train` -> `measure` -> `store` -> `report`,
with `analysis` (the table analyses both measure and report read) beside `store`, and `cli` on top."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent  # the checkout: data/, notebooks/ and runs/ lie beside the package
