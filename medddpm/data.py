"""Training pairs (image, label map) for Med-DDPM: synthetic subjects from the MNI templates, or user NIfTI.

Every item is ``(image, cond)``: ``image`` float32 (1, S, S, S) in [-1, 1] with background -1, and
``cond`` float32 (C, S, S, S), the label map one-hot without background, mapped to {-1, +1}.

The default data set needs no download: the nilearn wheel ships the MNI ICBM152 2009a nonlinear
symmetric templates (skull-stripped T1, GM and WM probability maps). Distinct subjects come from a
random smooth deformation plus intensity augmentation, deterministic per seed. Templates:
Copyright (C) 1993-2004 Louis Collins, McConnell Brain Imaging Centre, Montreal Neurological
Institute, McGill University (see NOTICE); Fonov et al., NeuroImage 2011 and 2009.
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
# Text bars, not tqdm.auto: with ipywidgets installed (the explorers) tqdm.auto draws widget bars, and
# under papermill every update became a widget message (the producer sampled 15x slower).
from tqdm import tqdm

from .storage import atomic_write

LABELS = {0: "background", 1: "CSF", 2: "GM", 3: "WM"}

# bump when make_mni_pair changes its output, so stale cache files are never read
MNI_VERSION = "mni1"

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


def _smooth_field(values: np.ndarray, size: int) -> np.ndarray:
    """(..., c, c, c) control values -> (..., size, size, size), separably (cheap at any size)."""
    b = _basis(size, values.shape[-1])
    return np.einsum("...abc,ia,jb,kc->...ijk", values.astype(np.float32), b, b, b, optimize=True)


def make_mni_pair(seed: int, *, size: int = 128, spacing_mm: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic subject: image float32 (size,)*3 in [-1, 1] (background -1), labels uint8 in {0..3}.

    Every seed, 0 included, is augmented. All random draws except the noise are made before the
    grid size matters, so a seed gives the same anatomy at every size. Default spacing 1.6 mm at
    128^3 (field of view ~205 mm at any size), centred on the brain; axes follow the template (RAS).
    """
    spacing = default(spacing_mm, 1.6 * 128 / size)
    t = _templates()
    rng = np.random.default_rng(seed)

    rotation = Rotation.from_euler("xyz", rng.uniform(-ROTATION_DEG, ROTATION_DEG, 3), degrees=True).as_matrix()
    scale = rng.uniform(1 - SCALE, 1 + SCALE, 3)
    shift = rng.uniform(-SHIFT_MM, SHIFT_MM, 3)
    warp = rng.normal(0, WARP_MM, (3, WARP_CONTROL, WARP_CONTROL, WARP_CONTROL))
    log_bias = rng.normal(0, BIAS_STD, (BIAS_CONTROL,) * 3)
    gamma = float(np.exp(rng.uniform(-GAMMA_LOG, GAMMA_LOG)))
    contrast = rng.uniform(1 - CONTRAST, 1 + CONTRAST)
    noise_std = rng.uniform(0, NOISE_MAX)

    # one coordinate map (output voxel -> template voxel) for resampling and deformation together
    # float32 throughout: numpy 2 would promote the whole 3 x size^3 map to float64
    linear = (t.mm_to_voxel @ rotation @ np.diag(scale) * spacing).astype(np.float32)
    offset = (t.centre + t.mm_to_voxel @ shift).astype(np.float32)
    coords = _smooth_field(np.einsum("de,e...->d...", t.mm_to_voxel, warp), size)
    grid = np.arange(size, dtype=np.float32) - (size - 1) / 2
    for d in range(3):
        coords[d] += offset[d]
        coords[d] += (linear[d, 0] * grid)[:, None, None]
        coords[d] += (linear[d, 1] * grid)[None, :, None]
        coords[d] += (linear[d, 2] * grid)[None, None, :]

    def resample(volume):
        return ndimage.map_coordinates(volume, coords, order=1, output=np.float32, mode="constant", cval=0.0)

    t1, csf, gm, wm = (resample(v) for v in (t.t1, t.csf, t.gm, t.wm))
    # argmax of the warped probability maps; background = what the tissues leave over
    labels = np.argmax(np.stack([255 - (csf + gm + wm), csf, gm, wm]), axis=0).astype(np.uint8)
    brain = labels > 0

    x = t1 / 255 * np.exp(_smooth_field(log_bias, size))
    x = np.clip(x, 0, 1) ** gamma
    mean = x[brain].mean() if brain.any() else 0.0
    x = mean + contrast * (x - mean)
    x += rng.normal(0, noise_std, x.shape).astype(np.float32)
    image = np.where(brain, 2 * np.clip(x, 0, 1) - 1, -1).astype(np.float32)
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


class MNIPairs(Dataset):
    """n synthetic subjects (seeds seed .. seed + n - 1), generated once and cached on disk."""

    mask_channels = len(LABELS) - 1

    def __init__(self, n: int, *, size: int = 128, cache_dir: str | os.PathLike | None = None,
                 seed: int = 0, progress: bool = True):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.size, self.seed, self.progress = n, size, seed, progress
        self.cache_dir = Path(default(cache_dir, default_cache_dir()))

    def __len__(self) -> int:
        return self.n

    def path(self, i: int) -> Path:
        return self.cache_dir / f"{MNI_VERSION}-size{self.size}-seed{self.seed + i}.npz"

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
        for i in tqdm(missing, desc=f"MNI pairs {self.size}^3", disable=not self.progress):
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


def _resize(x: torch.Tensor, size: int, *, mode: str) -> torch.Tensor:
    if x.shape == (size,) * 3:
        return x
    kwargs = dict(align_corners=False) if mode == "trilinear" else {}
    return F.interpolate(x[None, None], size=(size,) * 3, mode=mode, **kwargs)[0, 0]


class NiftiPairs(Dataset):
    """User data in the Med-DDPM layout: <root>/image/*.nii[.gz] and <root>/mask/*.nii[.gz],
    paired by the last integer in the file name. Everything is checked in __init__, so bad data
    fails before any GPU work. Volumes are resized (not cropped) to size^3: trilinear for images,
    nearest for labels; intensities scaled per volume (never per slice)."""

    def __init__(self, root: str | os.PathLike, *, size: int = 128, num_classes: int | None = None):
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


def open_dataset(source: str, *, size: int, n: int = 8, cache_dir: str | os.PathLike | None = None,
                 seed: int = 0) -> MNIPairs | NiftiPairs:
    """"mni" -> the synthetic MNI pairs; anything else is a folder in the Med-DDPM layout."""
    if source == "mni":
        return MNIPairs(n, size=size, cache_dir=cache_dir, seed=seed)
    if not Path(source).exists():
        raise _fail(source, "no such data set (expected 'mni' or a folder holding image/ and mask/)")
    return NiftiPairs(source, size=size)
