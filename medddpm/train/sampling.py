"""Generate volumes from a trained checkpoint and write them as NIfTI."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F

from medddpm.train import checkpoint
from medddpm.train.data import one_hot_condition
from medddpm.train import nifti
from medddpm.train.nifti import DataError
from medddpm.train.synthetic import BRATS_LABELS, LABELS, LABELS_2, make_brats_case, make_mni_pair, mni_labels
from medddpm.configs import Config
from medddpm.train.engine import Engine
from medddpm.model.unet import ModelSpec
from medddpm.store.storage import atomic_write


MNI_WIDTHS = (len(LABELS) - 1, len(LABELS_2) - 1)  # the embedded whole heads: 3 tissues, or 2 (`mni_labels`)
BRATS_WIDTH = len(BRATS_LABELS) - 1


def load_checkpoint(path: str | os.PathLike, *, device: torch.device | str = "cpu", use_ema: bool = True,
                    compiled: bool = False) -> Engine:
    """An engine with the trained weights (the EMA's by default), for sampling.

    By default it runs eagerly with the trained numerics; `compiled` keeps the configuration's
    torch.compile and CUDA-graph switches too, which makes the first sample wait for compilation
    (tens of seconds at 128^3) and each later one run at the compiled speed."""
    path = Path(path)
    if path.is_dir():
        path = path / checkpoint.CHECKPOINT
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    state = checkpoint.read(path, map_location="cpu")
    try:
        spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["spec"].items()})
        dropped = ("fused_adam",) if compiled else ("cuda_graphs", "compile", "fused_adam")
        flags = {k: v for k, v in state["config"].items() if k not in dropped}
        config = Config("checkpoint", **flags)
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a training checkpoint of this version ({e})".splitlines()[0]) from None
    engine = Engine(spec, config, device=device)
    try:
        engine.model.load_state_dict(state["model"])
        if use_ema and "ema" in state:
            engine.ema.load_state_dict(state["ema"])
            engine.ema.copy_to(engine.model)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        raise checkpoint.CheckpointError(f"{path}: its weights do not fit its model ({checkpoint.load_error(e)})") \
            from None
    engine.model.eval()
    return engine


def label_volume(source: str, *, size: int | tuple[int, int, int], mask_channels: int | None = None) -> np.ndarray:
    """Label map (uint8, the model's input shape) from 'mni:SEED' (an embedded whole-head subject),
    'mni-brats:SEED' (an embedded synthetic BraTS-like case) or a NIfTI file (resized, nearest).

    `mask_channels`: the label classes of the model it conditions, checked before any voxel is read or generated: an
    embedded source of another width, or a file with a label beyond them, is refused; a file's shape is held to
    the training data's bounds on stretching and shrinking (`nifti.check_fit`), from its header."""
    shape = nifti.shape3(size)
    for prefix, make, widths in (("mni:", make_mni_pair, MNI_WIDTHS), ("mni-brats:", make_brats_case, (BRATS_WIDTH,))):
        if source.startswith(prefix):
            seed = source.removeprefix(prefix)
            if not seed.isdigit():
                raise DataError(f"label source {source!r}: expected {prefix}<non-negative integer seed>")
            if mask_channels is not None and mask_channels not in widths:
                raise DataError(f"label source {source!r}: {' or '.join(map(str, widths))} label classes, but the "
                                f"checkpoint's model takes {mask_channels}")
            labels = make(int(seed), size=size)[1]
            return mni_labels(labels, mask_channels) if prefix == "mni:" and mask_channels else labels
    # the training data's reader: its header checks (colour, complex, oversized, truncated) and its orientation
    path = Path(source)
    nifti.check_file(path)
    nifti.check_fit(path, nifti.volume_shape(path), shape)
    labels = nifti.read_volume(path)
    nifti.label_counts(labels, path, mask_channels)
    t = torch.from_numpy(np.asarray(labels, dtype=np.float32))[None, None]
    return F.interpolate(t, size=shape, mode="nearest")[0, 0].numpy().astype(np.uint8)


def generate(engine: Engine, labels: np.ndarray, *, seed: int = 0, progress: bool = True) -> np.ndarray:
    spec = engine.spec
    if labels.max() > spec.mask_channels:
        raise DataError(f"label map has label {int(labels.max())} but the model knows {spec.mask_channels} classes")
    cond = engine.prepare(one_hot_condition(labels, num_classes=spec.mask_channels)[None])
    g = torch.Generator(engine.device).manual_seed(seed)
    x = engine.sample(cond, image_channels=spec.image_channels, generator=g, progress=progress)
    return x[0].float().cpu().numpy()


def write_nifti(path: str | os.PathLike, volume: np.ndarray, *, spacing_mm: float = 1.0) -> Path:
    """Write a (D, H, W) or (C, D, H, W) volume; channels go last, as NIfTI expects."""
    data = volume if volume.ndim == 3 else np.moveaxis(volume, 0, -1)
    img = nib.Nifti1Image(np.ascontiguousarray(data), np.diag([spacing_mm] * 3 + [1.0]))
    raw = img.to_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.compress(raw, mtime=0)
    with checkpoint.writing(path, "writing a volume"):
        return atomic_write(path, lambda f: f.write(raw))
