"""Training data for Med-DDPM: synthetic subjects from the MNI templates, or user NIfTI.

Every item is ``(image, cond)``: ``image`` float32 (C, D, H, W) in [-1, 1] with background -1 (one
channel for the whole-head setting, four for BraTS: T1, T1ce, T2, FLAIR), and ``cond`` float32
(K, D, H, W), the label map one-hot without background, mapped to {-1, +1}.

The default data sets need no download: the nilearn wheel ships the MNI ICBM152 2009a nonlinear
symmetric templates (skull-stripped T1, GM and WM probability maps). Distinct subjects come from a
random smooth deformation plus intensity augmentation, deterministic per seed; the BraTS-like
cases add a synthetic tumour and synthesize the other three modalities from tissue contrasts.
Templates: Copyright (C) 1993-2004 Louis Collins, McConnell Brain Imaging Centre, Montreal
Neurological Institute, McGill University (see NOTICE); Fonov et al., NeuroImage 2011 and 2009.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import zlib
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError
from scipy import ndimage
from scipy.spatial.transform import Rotation
from torch.utils.data import Dataset
from tqdm import tqdm  # text bars: tqdm.auto draws ipywidgets bars, a message per update under papermill

from medddpm.store.storage import atomic_write

LABELS = {0: "background", 1: "CSF", 2: "GM", 3: "WM"}

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

_READ_ERRORS = (ImageFileError, HeaderDataError, OSError, EOFError, ValueError, zlib.error)


class DataError(ValueError):
    """Bad input data; str(e) is one line naming the offending file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


# helpers

def exists(v) -> bool:
    return v is not None


def default(v, d):
    return v if exists(v) else d


def _fail(path: str | os.PathLike, why: str) -> DataError:
    return DataError(f"{path}: {why}")


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


def _shape3(size: int | tuple[int, int, int]) -> tuple[int, int, int]:
    return (size,) * 3 if isinstance(size, int) else tuple(size)


def _smooth_field(values: np.ndarray, size: int | tuple[int, int, int]) -> np.ndarray:
    """(..., c, c, c) control values -> (..., D, H, W), separably (cheap at any size)."""
    d, h, w = (_basis(n, values.shape[-1]) for n in _shape3(size))
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
    shape = _shape3(size)
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
    shape = _shape3(size)
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


def one_hot_condition(labels: np.ndarray | torch.Tensor, *, num_classes: int) -> torch.Tensor:
    """Integer labels (D,H,W) or (B,D,H,W) -> float32 (C,D,H,W) or (B,C,D,H,W) in {-1, +1}.

    Background is dropped: channel k is label k + 1 (the Med-DDPM conditioning)."""
    labels = torch.as_tensor(labels)
    if labels.ndim not in (3, 4):
        raise ValueError(f"labels must be (D,H,W) or (B,D,H,W), got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.numel():
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if not 0 <= lo <= hi <= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes}], got [{lo}, {hi}]")
    classes = torch.arange(1, num_classes + 1, dtype=labels.dtype, device=labels.device).view(-1, 1, 1, 1)
    # one broadcast compare + where: ~6x faster than stacking per-class masks at 128^3
    return torch.where(labels.unsqueeze(-4) == classes, 1.0, -1.0).to(torch.float32)


# data sets

def default_cache_dir() -> Path:
    return Path(os.environ.get("MEDDDPM_CACHE") or Path.home() / ".cache" / "medddpm")


def _size_name(size: int | tuple[int, int, int]) -> str:
    return str(size) if isinstance(size, int) else "x".join(map(str, size))


class MNIPairs(Dataset):
    """n synthetic subjects (seeds seed .. seed + n - 1), generated once and cached on disk."""

    mask_channels = len(LABELS) - 1
    image_channels = 1

    def __init__(self, n: int, *, size: int | tuple[int, int, int] = 128, cache_dir: str | os.PathLike | None = None,
                 seed: int = 0, progress: bool = True):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.size, self.seed, self.progress = n, size, seed, progress
        self.cache_dir = Path(default(cache_dir, default_cache_dir()))

    def __len__(self) -> int:
        return self.n

    def path(self, i: int) -> Path:
        return self.cache_dir / f"{MNI_VERSION}-size{_size_name(self.size)}-seed{self.seed + i}.npz"

    def _pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        path = self.path(i)
        if not path.exists():
            image, labels = make_mni_pair(self.seed + i, size=self.size)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: np.savez_compressed(f, image=image, labels=labels))
            return image, labels
        try:
            with np.load(path) as f:
                return f["image"], f["labels"]
        except (OSError, ValueError, KeyError, zlib.error) as e:
            raise _fail(path, f"unreadable cache file ({type(e).__name__}); delete it") from e

    def prepare(self) -> MNIPairs:
        """Generate every missing pair now (with a progress bar), not during training."""
        missing = [i for i in range(self.n) if not self.path(i).exists()]
        for i in tqdm(missing, desc=f"MNI pairs {_size_name(self.size)}", disable=not self.progress):
            self._pair(i)
        return self

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:  # also ends plain iteration
            raise IndexError(f"index {i} out of range for {self.n} pairs")
        image, labels = self._pair(i)
        return torch.from_numpy(image)[None], one_hot_condition(labels, num_classes=self.mask_channels)


def _nifti_name(path: Path) -> str | None:
    """File name without its NIfTI extension, or None if it is not .nii / .nii.gz."""
    m = re.fullmatch(r"(.*)\.nii(\.gz)?", path.name, flags=re.IGNORECASE)
    return m.group(1) if m else None


def _numbered_files(folder: Path) -> dict[int, Path]:
    """{number: file} for the NIfTI files of a folder, keyed by the last integer in the name."""
    if not folder.is_dir():
        raise _fail(folder, "missing folder (expected <root>/image and <root>/mask)")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))  # skip .DS_Store & co
    if not files:
        raise _fail(folder, "empty folder")
    numbered: dict[int, Path] = {}
    for path in files:
        stem = _nifti_name(path)
        if stem is None or not path.is_file():
            raise _fail(path, "not a NIfTI file (.nii or .nii.gz)")
        numbers = re.findall(r"\d+", stem)
        if not numbers:
            raise _fail(path, "no number in the file name to pair image and mask by")
        k = int(numbers[-1])
        if k in numbered:
            raise _fail(path, f"same number {k} as {numbered[k].name}")
        numbered[k] = path
    return numbered


@contextlib.contextmanager
def _reading(path: Path):
    try:
        yield
    except _READ_ERRORS as e:
        raise _fail(path, f"unreadable NIfTI ({type(e).__name__}: {e})") from e


def _squeeze3(shape: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """Drop trailing singleton axes ((D,H,W,1) is common); anything else must be 3-D."""
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) != 3:
        raise _fail(path, f"expected a 3-D volume, got shape {shape}")
    return shape


def _shape(path: Path) -> tuple[int, ...]:
    with _reading(path):
        shape = tuple(nib.load(path).shape)  # header only
    return _squeeze3(shape, path)


def _volume(path: Path) -> np.ndarray:
    with _reading(path):
        data = np.asarray(nib.load(path).dataobj)
    return data.reshape(_squeeze3(data.shape, path))


def _check_image(x: np.ndarray, path: Path) -> None:
    if not np.isfinite(x).all():
        raise _fail(path, "image contains NaN or inf")
    if x.min() == x.max():
        raise _fail(path, f"constant image (every voxel is {x.flat[0]})")


def _check_labels(y: np.ndarray, path: Path, num_classes: int | None) -> int:
    """Validate a label map; returns its largest label."""
    if y.dtype.kind not in "biuf":
        raise _fail(path, f"labels must be integers, got dtype {y.dtype}")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise _fail(path, "labels must be integers, found non-integer or NaN/inf values")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0:
        raise _fail(path, f"negative label {lo}")
    if exists(num_classes) and hi > num_classes:
        raise _fail(path, f"label {hi} out of range (num_classes={num_classes})")
    return hi


def _normalize(x: np.ndarray) -> np.ndarray:
    """Per-volume scaling to [-1, 1]. The 0.5/99.5 percentiles keep a few hot voxels (vessels,
    artefacts) from squashing the tissue into a narrow band; min/max if they coincide."""
    lo, hi = np.percentile(x, (0.5, 99.5))
    if hi <= lo:
        lo, hi = x.min(), x.max()
    return ((np.clip(x, lo, hi) - lo) / (hi - lo) * 2 - 1).astype(np.float32)


def _resize(x: torch.Tensor, size: int | tuple[int, int, int], *, mode: str) -> torch.Tensor:
    shape = _shape3(size)
    if tuple(x.shape) == shape:
        return x
    kwargs = dict(align_corners=False) if mode == "trilinear" else {}
    return F.interpolate(x[None, None], size=shape, mode=mode, **kwargs)[0, 0]


class NiftiPairs(Dataset):
    """User data in the Med-DDPM layout: <root>/image/*.nii[.gz] and <root>/mask/*.nii[.gz],
    paired by the last integer in the file name. Everything is checked in __init__, so bad data
    fails before any GPU work. Volumes are resized (not cropped) to `size` (a side, or (D, H, W)):
    trilinear for images, nearest for labels; intensities scaled per volume (never per slice)."""

    image_channels = 1

    def __init__(self, root: str | os.PathLike, *, size: int | tuple[int, int, int] = 128,
                 num_classes: int | None = None):
        root = Path(root)
        if not root.is_dir():
            raise _fail(root, "no such data folder")
        if exists(num_classes) and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        images, masks = _numbered_files(root / "image"), _numbered_files(root / "mask")
        for mine, theirs, other in ((images, masks, "mask"), (masks, images, "image")):
            if unpaired := sorted(mine.keys() - theirs.keys()):
                raise _fail(mine[unpaired[0]], f"no {other} with number {unpaired[0]}")
        self.pairs = [(images[k], masks[k]) for k in sorted(images)]

        for image, mask in self.pairs:  # headers first: cheap, catches most mistakes
            if (a := _shape(image)) != (b := _shape(mask)):
                raise _fail(image, f"shape {a} differs from its mask {mask.name} {b}")
        max_label = 0
        for image, mask in self.pairs:
            _check_image(_volume(image), image)
            max_label = max(max_label, _check_labels(_volume(mask), mask, num_classes))
        if not exists(num_classes) and max_label == 0:
            raise _fail(root / "mask", "every mask is all background (0)")
        self.size, self.num_classes = size, default(num_classes, max_label)

    @property
    def mask_channels(self) -> int:
        return self.num_classes

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, mask_path = self.pairs[i]
        image = torch.from_numpy(_normalize(_volume(image_path).astype(np.float32)))
        labels = torch.from_numpy(_volume(mask_path).astype(np.int64))  # integral: checked in __init__
        image = _resize(image, self.size, mode="trilinear")
        labels = _resize(labels.float(), self.size, mode="nearest-exact").long()
        return image[None], one_hot_condition(labels, num_classes=self.num_classes)


class MNIBratsCases(Dataset):
    """n synthetic four-modality cases in the BraTS setting (`make_brats_case`, seeds seed ..
    seed + n - 1), generated on first use and cached on disk as float16 (lossless: see there)."""

    mask_channels = len(BRATS_LABELS) - 1
    image_channels = len(BRATS_MODALITIES)

    def __init__(self, n: int, *, size: int | tuple[int, int, int] = BRATS_SHAPE,
                 cache_dir: str | os.PathLike | None = None, seed: int = 0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.size, self.seed = n, size, seed
        self.cache_dir = Path(default(cache_dir, default_cache_dir()))

    def __len__(self) -> int:
        return self.n

    def path(self, i: int) -> Path:
        return self.cache_dir / f"{BRATS_VERSION}-size{_size_name(self.size)}-seed{self.seed + i}.npz"

    def _case(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        path = self.path(i)
        if not path.exists():
            image, labels = make_brats_case(self.seed + i, size=self.size)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: np.savez_compressed(f, image=image.astype(np.float16), labels=labels))
            return image, labels
        try:
            with np.load(path) as f:
                return f["image"].astype(np.float32), f["labels"]
        except (OSError, ValueError, KeyError, zlib.error) as e:
            raise _fail(path, f"unreadable cache file ({type(e).__name__}); delete it") from e

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} cases")
        image, labels = self._case(i)
        return torch.from_numpy(image), one_hot_condition(labels, num_classes=self.mask_channels)


_BRATS_FOLDERS = ("seg", *BRATS_MODALITIES)


def _brats_files(root: Path, modality: str) -> dict[str, Path]:
    """{case: file} of <root>/<modality>/<case>_<modality>.nii[.gz]; any other file is an error."""
    folder = root / modality
    if not folder.is_dir():
        raise _fail(folder, f"missing folder (the BraTS layout is <root>/{{{','.join(_BRATS_FOLDERS)}}}/"
                            f"<case>_<modality>.nii.gz)")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if not files:
        raise _fail(folder, "empty folder")
    cases: dict[str, Path] = {}
    for path in files:
        stem = _nifti_name(path)
        if stem is None or not path.is_file():
            raise _fail(path, "not a NIfTI file (.nii or .nii.gz)")
        case, sep, suffix = stem.rpartition("_")
        if not sep or not case or suffix.lower() != modality:
            raise _fail(path, f"expected <case>_{modality}.nii.gz in folder {modality}/")
        cases[case] = path
    return cases


def _crop_or_pad(x: np.ndarray, shape: tuple[int, int, int], fill) -> np.ndarray:
    """Centre crop or pad each axis to `shape` (the reference's CropOrPad; it never resizes)."""
    out = np.full(shape, fill, dtype=x.dtype)
    src, dst = [], []
    for n, m in zip(x.shape, shape):
        a, b = max(0, (n - m) // 2), max(0, (m - n) // 2)
        k = min(n, m)
        src.append(slice(a, a + k))
        dst.append(slice(b, b + k))
    out[tuple(dst)] = x[tuple(src)]
    return out


class BratsCases(Dataset):
    """User data in the BraTS layout: <root>/{seg,t1,t1ce,t2,flair}/<case>_<modality>.nii[.gz].

    Items are ``(image, cond)``: image float32 (4, D, H, W), the modalities T1, T1ce, T2, FLAIR each
    scaled to [-1, 1] on its own; cond float32 (4, D, H, W), the label map one-hot without background
    in {-1, +1}. Label maps follow the reference's preprocessing (`BRATS_LABELS`: 1 necrotic core,
    2 edema, 3 enhancing tumour, 4 the rest of the brain); a raw BraTS map (enhancing tumour as 4,
    the brain as background) is refused, since it would train on wrong classes. Volumes are
    centre-cropped or padded to `size`, as the reference does (192 x 192 x 144 from BraTS'
    240 x 240 x 155). Everything is checked in __init__, before any GPU work; each error is one
    line naming the file.
    """

    mask_channels = len(BRATS_LABELS) - 1
    image_channels = len(BRATS_MODALITIES)

    def __init__(self, root: str | os.PathLike, *, size: int | tuple[int, int, int] = BRATS_SHAPE):
        root = Path(root)
        if not root.is_dir():
            raise _fail(root, "no such data folder")
        files = {m: _brats_files(root, m) for m in _BRATS_FOLDERS}
        cases = sorted(set().union(*(f.keys() for f in files.values())))
        for case in cases:  # every case in every folder
            have = [m for m in _BRATS_FOLDERS if case in files[m]]
            for m in _BRATS_FOLDERS:
                if case not in files[m]:
                    raise _fail(files[have[0]][case], f"case {case!r} has no {m} volume "
                                                      f"(expected {root / m / f'{case}_{m}.nii.gz'})")
        self.cases = [{m: files[m][case] for m in _BRATS_FOLDERS} for case in cases]
        self.names = cases
        self.size = size

        for case in self.cases:  # headers first: cheap, catches most mistakes
            seg_shape = _shape(case["seg"])
            for m in BRATS_MODALITIES:
                if (got := _shape(case[m])) != seg_shape:
                    raise _fail(case[m], f"shape {got} differs from its label map {case['seg'].name} {seg_shape}")
        for case in self.cases:
            t1 = None
            for m in BRATS_MODALITIES:
                x = _volume(case[m])
                _check_image(x, case[m])
                t1 = x if m == "t1" else t1
            seg = _volume(case["seg"])
            _check_labels(seg, case["seg"], self.mask_channels)
            brain = t1 > t1.min()  # skull-stripped: the brain is what is above the background
            if brain.any() and (seg[brain] == 0).mean() > 0.5:
                raise _fail(case["seg"], "most of the brain is labelled 0: a raw BraTS label map? Label the "
                                         "brain 4 and enhancing tumour 3, as the reference's "
                                         "preprocess_brats_data.py does")

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        case, shape = self.cases[i], _shape3(self.size)
        image = np.stack([_crop_or_pad(_normalize(_volume(case[m]).astype(np.float32)), shape, -1.0)
                          for m in BRATS_MODALITIES])
        labels = _crop_or_pad(_volume(case["seg"]).astype(np.int64), shape, 0)  # integral: checked in __init__
        return torch.from_numpy(image), one_hot_condition(labels, num_classes=self.mask_channels)


EMBEDDED = ("mni", "mni-brats")


def open_dataset(source: str, *, size: int | tuple[int, int, int], n: int = 8,
                 cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Dataset:
    """"mni": synthetic whole-head pairs; "mni-brats": synthetic four-modality BraTS-like cases (both
    from the embedded MNI templates); anything else is a folder in the Med-DDPM layout (image/, mask/)
    or the BraTS layout (seg/, t1/, t1ce/, t2/, flair/)."""
    if source == "mni":
        return MNIPairs(n, size=size, cache_dir=cache_dir, seed=seed)
    if source == "mni-brats":
        return MNIBratsCases(n, size=size, cache_dir=cache_dir, seed=seed)
    root = Path(source)
    if not root.exists():
        raise _fail(source, f"no such data set (expected {' or '.join(map(repr, EMBEDDED))}, or a folder holding "
                            "image/ and mask/, or seg/, t1/, t1ce/, t2/ and flair/)")
    if root.is_dir() and not (root / "image").exists() and not (root / "mask").exists() \
            and any((root / m).exists() for m in _BRATS_FOLDERS):
        return BratsCases(root, size=size)
    return NiftiPairs(root, size=size)
