"""Synthetic subjects generated from the MNI templates: the embedded data sets, which need no download.

The nilearn wheel ships the MNI ICBM152 2009a nonlinear symmetric templates (skull-stripped T1, GM and
WM probability maps). Distinct subjects come from a random smooth deformation plus intensity
augmentation, deterministic per seed (`make_mni_pair`); the BraTS-like cases add a synthetic tumour and
synthesize the other three modalities from tissue contrasts (`make_brats_case`).
Templates: Copyright (C) 1993-2004 Louis Collins, McConnell Brain Imaging Centre, Montreal
Neurological Institute, McGill University (see NOTICE); Fonov et al., NeuroImage 2011 and 2009.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np
from scipy import ndimage
from scipy.spatial.transform import Rotation

from medddpm.train.nifti import DataError, default, exists, shape3

LABELS = {0: "background", 1: "CSF", 2: "GM", 3: "WM"}
# The same anatomy at the reference's whole-head width, two label channels: grey and white matter as one label
LABELS_2 = {0: "background", 1: "CSF", 2: "brain tissue (GM + WM)"}

# bump when make_mni_pair changes its output, so stale cache files are never read
MNI_VERSION = "mni1"
BRATS_VERSION = "brats1"  # the same for make_brats_case

_TEMPLATE = "mni_icbm152_{}_tal_nlin_sym_09a_converted.nii.gz"

# augmentation strengths; kept small so the brain stays inside a 1.6 mm x 128 field of view
ROTATION_DEG = 6.0      # uniform +- per axis
SCALE = 0.05            # per-axis scale in [1 - SCALE, 1 + SCALE]
SHIFT_MM = 3.0          # uniform +- per axis
WARP_MM = 2.0           # std of the displacement at each control point
WARP_CONTROL = 5        # control points per axis of the smooth displacement field
BIAS_STD = 0.1          # std of the log bias field at each control point
BIAS_CONTROL = 3
GAMMA_LOG = 0.3         # gamma = exp(uniform +- GAMMA_LOG)
CONTRAST = 0.15         # intensities stretched about the brain mean by 1 +- CONTRAST
NOISE_MAX = 0.03        # Gaussian noise std, uniform in [0, NOISE_MAX], on the [0, 1] scale


# MNI templates

def mni_template_dir() -> Path:
    """nilearn's bundled data folder, found without importing nilearn (its import is slow)."""
    spec = importlib.util.find_spec("nilearn")
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" if exists(spec) else None
    if not exists(folder) or not (folder / _TEMPLATE.format("t1")).is_file():
        raise DataError(f"{folder or 'nilearn'}: MNI ICBM152 templates not found; pip install 'nilearn>=0.9.2,<0.15'")
    return folder


class _Templates(NamedTuple):
    t1: np.ndarray        # uint8 volumes, template grid, read-only
    csf: np.ndarray
    gm: np.ndarray
    wm: np.ndarray
    centre: np.ndarray    # brain bounding-box centre, voxel coordinates
    mm_to_voxel: np.ndarray  # 3x3 linear part of the inverse affine


@functools.lru_cache(maxsize=1)
def _templates() -> _Templates:
    folder = mni_template_dir()
    imgs = {k: nib.load(folder / _TEMPLATE.format(k)) for k in ("t1", "gm", "wm")}
    t1, gm, wm = (np.asarray(imgs[k].dataobj, dtype=np.uint8) for k in ("t1", "gm", "wm"))
    brain = t1 > 0  # the T1 is skull-stripped: non-zero is brain
    # tissue only inside the brain, so that csf + gm + wm = 255 * brain exactly, and the warped
    # background probability is 255 minus their warped sum
    gm, wm = gm * brain, wm * brain
    csf = (np.clip(255 - gm.astype(np.int16) - wm, 0, 255) * brain).astype(np.uint8)
    idx = np.argwhere(brain)
    centre = (idx.min(0) + idx.max(0)) / 2
    mm_to_voxel = np.linalg.inv(imgs["t1"].affine[:3, :3])
    for a in (t1, csf, gm, wm):
        a.setflags(write=False)  # shared by every call through the cache
    return _Templates(t1, csf, gm, wm, centre, mm_to_voxel)


def _basis(n: int, control: int) -> np.ndarray:
    """(n, control) weights: Gaussian bumps at evenly spaced control points, rows summing to 1,
    so `basis @ values` is a smooth interpolant of the control values over the field of view."""
    x = (np.arange(n) + 0.5) / n
    c = (np.arange(control) + 0.5) / control
    w = np.exp(-0.5 * ((x[:, None] - c[None]) * control) ** 2)
    return (w / w.sum(1, keepdims=True)).astype(np.float32)


def _smooth_field(values: np.ndarray, size: int | tuple[int, int, int]) -> np.ndarray:
    """(..., c, c, c) control values -> (..., D, H, W), separably (cheap at any size)."""
    d, h, w = (_basis(n, values.shape[-1]) for n in shape3(size))
    return np.einsum("...abc,ia,jb,kc->...ijk", values.astype(np.float32), d, h, w, optimize=True)


class _Draws(NamedTuple):
    """The random geometry of one synthetic subject (drawn before the grid size matters)."""
    rotation: np.ndarray
    scale: np.ndarray
    shift: np.ndarray
    warp: np.ndarray


def _draw_geometry(rng: np.random.Generator) -> _Draws:
    rotation = Rotation.from_euler("xyz", rng.uniform(-ROTATION_DEG, ROTATION_DEG, 3), degrees=True).as_matrix()
    scale = rng.uniform(1 - SCALE, 1 + SCALE, 3)
    shift = rng.uniform(-SHIFT_MM, SHIFT_MM, 3)
    warp = rng.normal(0, WARP_MM, (3, WARP_CONTROL, WARP_CONTROL, WARP_CONTROL))
    return _Draws(rotation, scale, shift, warp)


def _warped_templates(t: _Templates, g: _Draws, shape: tuple[int, int, int], spacing: float) -> list[np.ndarray]:
    """T1, CSF, GM, WM (0-255 float32) resampled onto a (D, H, W) grid through the deformation `g`."""
    # one coordinate map (output voxel -> template voxel) for resampling and deformation together
    # float32 throughout: numpy 2 would promote the whole 3 x D x H x W map to float64
    linear = (t.mm_to_voxel @ g.rotation @ np.diag(g.scale) * spacing).astype(np.float32)
    offset = (t.centre + t.mm_to_voxel @ g.shift).astype(np.float32)
    coords = _smooth_field(np.einsum("de,e...->d...", t.mm_to_voxel, g.warp), shape)
    grids = [np.arange(n, dtype=np.float32) - (n - 1) / 2 for n in shape]
    for d in range(3):
        coords[d] += offset[d]
        coords[d] += (linear[d, 0] * grids[0])[:, None, None]
        coords[d] += (linear[d, 1] * grids[1])[None, :, None]
        coords[d] += (linear[d, 2] * grids[2])[None, None, :]

    def resample(volume):
        return ndimage.map_coordinates(volume, coords, order=1, output=np.float32, mode="constant", cval=0.0)

    return [resample(v) for v in (t.t1, t.csf, t.gm, t.wm)]


def make_mni_pair(seed: int, *, size: int | tuple[int, int, int] = 128,
                  spacing_mm: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic subject: image float32 (D, H, W) in [-1, 1] (background -1), labels uint8 in {0..3}.

    `size`: voxels per side of a cube, or (D, H, W). Every seed, 0 included, is augmented. All
    random draws except the noise are made before the grid size matters, so a seed gives the same
    anatomy at every size. Default spacing 1.6 mm at 128 voxels along the largest side (field of
    view ~205 mm at any size), centred on the brain; axes follow the template (RAS).
    """
    shape = shape3(size)
    spacing = default(spacing_mm, 1.6 * 128 / max(shape))
    t = _templates()
    rng = np.random.default_rng(seed)
    geometry = _draw_geometry(rng)
    log_bias = rng.normal(0, BIAS_STD, (BIAS_CONTROL,) * 3)
    gamma = float(np.exp(rng.uniform(-GAMMA_LOG, GAMMA_LOG)))
    contrast = rng.uniform(1 - CONTRAST, 1 + CONTRAST)
    noise_std = rng.uniform(0, NOISE_MAX)

    t1, csf, gm, wm = _warped_templates(t, geometry, shape, spacing)
    # argmax of the warped probability maps; background = what the tissues leave over
    labels = np.argmax(np.stack([255 - (csf + gm + wm), csf, gm, wm]), axis=0).astype(np.uint8)
    brain = labels > 0

    x = t1 / 255 * np.exp(_smooth_field(log_bias, shape))
    x = np.clip(x, 0, 1) ** gamma
    mean = x[brain].mean() if brain.any() else 0.0
    x = mean + contrast * (x - mean)
    x += rng.normal(0, noise_std, x.shape).astype(np.float32)
    image = np.where(brain, 2 * np.clip(x, 0, 1) - 1, -1).astype(np.float32)
    return image, labels


def mni_labels(labels: np.ndarray, mask_channels: int) -> np.ndarray:
    """`make_mni_pair`'s labels for a model of `mask_channels` label channels: 3 as they are (`LABELS`), 2 with
    grey and white matter as one label (`LABELS_2`), the width of the reference's whole-head model."""
    if mask_channels == len(LABELS) - 1:
        return labels
    if mask_channels == len(LABELS_2) - 1:
        return np.minimum(labels, 2).astype(labels.dtype)
    raise ValueError(f"the embedded MNI data has 2 or 3 label channels, not {mask_channels}")


# Synthetic BraTS-like cases. Labels as the reference's BraTS preprocessing writes them
# (preprocess_brats_data.py of mobaidoctor/med-ddpm): 0 background, 1 necrotic tumour core,
# 2 peritumoral edema, 3 enhancing tumour (BraTS' label 4), 4 the rest of the brain.
BRATS_LABELS = {0: "background", 1: "necrotic core", 2: "edema", 3: "enhancing tumour", 4: "brain"}
BRATS_MODALITIES = ("t1", "t1ce", "t2", "flair")  # the reference's channel order
BRATS_SHAPE = (192, 192, 144)  # BraTS' 240 x 240 x 155 at 1 mm, cropped as the reference does
BRATS_SPACING_MM = 1.2  # wider than BraTS' 1 mm so the warped template brain stays inside 144 slices
# Mean intensity of each tissue on a [0, 1] scale, per modality: CSF, GM, WM, then the tumour classes
# necrotic core, edema, enhancing tumour (T1's CSF, GM and WM come from the template's own T1). Typical contrasts,
# chosen by eye, not fitted to any data: the volumes only need to look like MRI to a convolution.
_TISSUE_MEANS = {
    "t1": (0.15, 0.45, 0.70, 0.20, 0.40, 0.45),
    "t1ce": (0.15, 0.45, 0.68, 0.20, 0.40, 0.95),
    "t2": (0.95, 0.55, 0.35, 0.90, 0.80, 0.60),
    "flair": (0.10, 0.50, 0.40, 0.30, 0.90, 0.70),
}


def make_brats_case(seed: int, *, size: int | tuple[int, int, int] = BRATS_SHAPE,
                    spacing_mm: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic four-modality case: image float32 (4, D, H, W) in [-1, 1] (T1, T1ce, T2, FLAIR;
    background -1), labels uint8 (D, H, W) in {0..4} as `BRATS_LABELS`. Synthetic, not BraTS data.

    The anatomy is an MNI subject (`make_mni_pair`'s deformation for this seed); a tumour (an
    irregular ellipsoid: necrotic core, enhancing rim, surrounding edema) is placed in the white or
    grey matter; each modality is drawn from the tissue probabilities with its own contrasts, bias
    field and noise. Values are rounded to float16 precision, so a float16 cache is lossless.
    """
    shape = shape3(size)
    spacing = default(spacing_mm, BRATS_SPACING_MM * max(BRATS_SHAPE) / max(shape))
    t = _templates()
    geometry = _draw_geometry(np.random.default_rng(seed))
    t1, csf, gm, wm = _warped_templates(t, geometry, shape, spacing)
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the anatomy matches make_mni_pair's
    tissue = np.stack([csf, gm, wm]) / 255  # soft tissue probabilities, summing to the brain mask
    labels = np.argmax(np.stack([255 - (csf + gm + wm), csf, gm, wm]), axis=0)
    brain = labels > 0

    # tumour: an ellipsoid whose radius wobbles smoothly with direction, centred on a random WM/GM voxel
    grid = np.stack(np.meshgrid(*(np.arange(n, dtype=np.float32) for n in shape), indexing="ij"))
    candidates = np.argwhere(labels >= 2)
    centre = candidates[rng.integers(len(candidates))] if len(candidates) else np.array(shape) // 2
    radii = rng.uniform(10, 22, 3) / spacing  # necrotic core plus rim, in voxels
    wobble = 1 + 0.25 * _smooth_field(rng.normal(0, 1, (4, 4, 4)), shape)
    r = np.sqrt((((grid - centre[:, None, None, None]) / radii[:, None, None, None]) ** 2).sum(0)) * wobble
    rim = rng.uniform(0.25, 0.45)
    edema = rng.uniform(1.6, 2.3)
    tumour = np.select([r < 1 - rim, r < 1, r < edema], [1, 3, 2], 0) * brain
    labels = np.where(tumour > 0, tumour, np.where(brain, 4, 0)).astype(np.uint8)

    # tumour classes replace the tissue probabilities where they are, softened over about a voxel
    classes = np.stack([ndimage.gaussian_filter((tumour == k).astype(np.float32), 0.8) for k in (1, 2, 3)])
    weights = np.concatenate([tissue * (1 - classes.sum(0, keepdims=True).clip(0, 1)), classes * brain])
    channels = []
    for m in BRATS_MODALITIES:
        means = np.asarray(_TISSUE_MEANS[m], dtype=np.float32)[:, None, None, None]
        x = (weights * means).sum(0)
        if m == "t1":  # the template's own T1 contrast, tumour classes blended in
            x = t1 / 255 * (1 - classes.sum(0).clip(0, 1)) + (classes * means[3:]).sum(0)
        x = x * np.exp(_smooth_field(rng.normal(0, BIAS_STD, (BIAS_CONTROL,) * 3), shape))
        x = np.clip(x, 0, 1) ** float(np.exp(rng.uniform(-GAMMA_LOG, GAMMA_LOG)))
        x = x + rng.normal(0, rng.uniform(0, NOISE_MAX), shape).astype(np.float32)
        channels.append(np.where(brain, 2 * np.clip(x, 0, 1) - 1, -1))
    image = np.stack(channels).astype(np.float16).astype(np.float32)
    return image, labels
