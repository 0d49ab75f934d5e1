"""Reading the user's NIfTI volumes, and the checks and scaling applied to them.

Every problem with input data is a `DataError`, one line naming the offending file (`fail`). NIfTI files
are found in a folder and paired by number (`numbered_files`), their headers checked before any voxel is read
(`volume_header`: one real value per voxel, 3-D once trailing singleton axes are dropped, at most `MAX_VOXELS`;
`check_fit`: not far from the model's input shape), read in the closest canonical (RAS) orientation
(`read_volume`), checked (`image_float32`: finite as float32, not constant; `label_counts`), scaled to [-1, 1] per
volume (`normalize`) and resized (`resize`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError

from medddpm.errors import UserError
from medddpm.store.storage import NotRegularFile, check_regular

_READ_ERRORS = (ImageFileError, HeaderDataError, OSError, EOFError, ValueError, zlib.error)
# The largest volume read: 512^3 voxels (0.5 GB as float32) is several times any MRI (BraTS is 240x240x155), so a
# header claiming more is corrupt or not a scan, and is refused before nibabel allocates it.
MAX_VOXELS = 512 ** 3


class DataError(UserError):
    """Bad input data; str(e) is one line naming the offending file."""


# helpers

def exists(v) -> bool:
    return v is not None


def default(v, d):
    return v if exists(v) else d


def fail(path: str | os.PathLike, why: str) -> DataError:
    return DataError(f"{path}: {why}")


def shape3(size: int | tuple[int, int, int]) -> tuple[int, int, int]:
    return (size,) * 3 if isinstance(size, int) else tuple(size)


# files and volumes

def nifti_name(path: Path) -> str | None:
    """File name without its NIfTI extension, or None if it is not .nii / .nii.gz."""
    m = re.fullmatch(r"(.*)\.nii(\.gz)?", path.name, flags=re.IGNORECASE)
    return m.group(1) if m else None


def missing_why(path: Path) -> str | None:
    """Why `path` cannot be opened as a file or folder (a symlink loop, a dangling symlink), or None if it can."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        if path.is_symlink():
            return f"broken symlink (to {os.readlink(path)})"
        return None
    return None


def check_file(path: Path) -> None:
    """A folder entry that should be a NIfTI file: an error naming it if it is not."""
    if (why := missing_why(path)) is not None:
        raise fail(path, why)
    if nifti_name(path) is None:
        raise fail(path, "not a NIfTI file (.nii or .nii.gz)")
    try:  # a folder, or a named pipe that would block the reader, of a NIfTI file's name
        check_regular(path, "a volume")
    except FileNotFoundError:
        raise fail(path, "no such file") from None
    except NotRegularFile as e:
        raise DataError(str(e)) from None


def numbered_files(folder: Path) -> dict[int, Path]:
    """{number: file} for the NIfTI files of a folder, keyed by the last integer in the name."""
    if not folder.is_dir():
        raise fail(folder, missing_why(folder) or "missing folder (expected <root>/image and <root>/mask)")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))  # skip .DS_Store & co
    if not files:
        raise fail(folder, "empty folder")
    numbered: dict[int, Path] = {}
    for path in files:
        check_file(path)
        stem = nifti_name(path)
        numbers = re.findall(r"\d+", stem)
        if not numbers:
            raise fail(path, "no number in the file name to pair image and mask by")
        k = int(numbers[-1])
        if k in numbered:
            raise fail(path, f"same number {k} as {numbered[k].name}")
        numbered[k] = path
    return numbered


@contextlib.contextmanager
def _reading(path: Path):
    try:
        yield
    except _READ_ERRORS as e:
        raise fail(path, f"unreadable NIfTI ({type(e).__name__}: {e})") from e


def _squeeze3(shape: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """Drop trailing singleton axes ((D,H,W,1) is common); anything else must be 3-D."""
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) != 3:
        raise fail(path, f"expected a 3-D volume, got shape {shape}")
    return shape


def _checked_header(path: Path):
    """The image object, its header checked: voxels of one real value, 3-D, at most `MAX_VOXELS`; nothing read."""
    with _reading(path):
        img = nib.load(path)
        dtype = img.get_data_dtype()
    if dtype.fields:  # RGB24 / RGBA32: a colour image, three or four values per voxel
        raise fail(path, f"colour image ({'/'.join(dtype.names)} per voxel): expected one grey value per voxel")
    if dtype.kind == "c":
        raise fail(path, f"complex-valued image ({dtype}): expected real values (magnitude images)")
    if dtype.kind not in "biuf":
        raise fail(path, f"unsupported voxel type {dtype}")
    shape = _squeeze3(tuple(img.shape), path)
    if (voxels := math.prod(shape)) > MAX_VOXELS:
        raise fail(path, f"header claims a {'x'.join(map(str, shape))} volume ({voxels / 1e6:,.0f} M voxels), more "
                         f"than the {MAX_VOXELS / 1e6:,.0f} M voxels of any MRI: a corrupt header?")
    if nifti_name(path) and not path.name.lower().endswith(".gz"):  # uncompressed: the file must hold the voxels
        need = int(img.header.get("vox_offset", 0)) + voxels * dtype.itemsize
        if (have := path.stat().st_size) < need:
            raise fail(path, f"truncated: the header needs {need:,} bytes, the file has {have:,}")
    return img


def volume_shape(path: Path) -> tuple[int, ...]:
    """The shape from the header alone, after the header's checks."""
    return volume_header(path)[0]


def volume_header(path: Path) -> tuple[tuple[int, ...], np.ndarray]:
    """The shape and the voxel-to-world affine from the header alone, after the header's checks."""
    img = _checked_header(path)
    return _squeeze3(tuple(img.shape), path), np.asarray(img.affine, dtype=np.float64)


# How far a volume may lie from the model's input shape, per axis. Training resizes (or, in the BraTS layout,
# crops and pads) every volume to that shape, which is right near it: the reference resizes whole heads of about
# 180 voxels a side to 128 and crops BraTS' 240 x 240 x 155 to 192 x 192 x 144, and a smoke model of 16 voxels
# takes files of 128. Far from it the model learns something else than the anatomy, so it is refused rather
# than warned about (a warning scrolls away above a progress bar, and the cache keeps what it built):
# - an axis of the model filled from fewer than a quarter as many voxels (32 x 32 x 2 stretched to 16^3) is
#   interpolation, or in the BraTS layout mostly padding;
# - an axis of the file squeezed more than eight to one (512^3 into 16^3) averages the anatomy away; it is also
#   the bound that lets the header refuse a file before its voxels are decompressed (a 1 MB .nii.gz may inflate
#   to 1 GB), as no allowed file holds more than 8^3 times the model's voxels.
MAX_STRETCH = 4
MAX_SQUEEZE = 8


def check_fit(path: Path, shape: tuple[int, ...], target: tuple[int, int, int], *, crop: bool = False) -> None:
    """Refuse a volume of `shape` (from its header) too far from the model's input `target` (`MAX_STRETCH`,
    `MAX_SQUEEZE`); `crop`: the BraTS layout's centre crop or pad in place of a resize."""
    up = max(t / n for n, t in zip(shape, target))
    down = max(n / t for n, t in zip(shape, target))
    if up > MAX_STRETCH:
        how, factor, limit = ("padded" if crop else "stretched"), up, MAX_STRETCH
    elif down > MAX_SQUEEZE:
        how, factor, limit = ("cropped" if crop else "shrunk"), down, MAX_SQUEEZE
    else:
        return
    raise fail(path, f"a {'x'.join(map(str, shape))} volume for the model's {'x'.join(map(str, target))} input: an "
                     f"axis would be {how} {factor:.3g}-fold (at most {limit}); choose a --size nearer the files' "
                     "shape, or leave this file out")


def read_volume(path: Path, *, onto: Path | None = None) -> np.ndarray:
    """The voxels in the closest canonical orientation (RAS+: axes as nibabel.as_closest_canonical orders and
    flips them), so that scanners' differing storage orders give one anatomy; the stored dtype is kept. `onto`:
    another file whose grid the voxels are resampled onto first, by nearest neighbour (a mask onto its image's)."""
    img = _checked_header(path)
    with _reading(path):
        if onto is not None:
            from medddpm.train.geometry import resample_onto

            shape, affine = volume_header(onto)
            img = resample_onto(img, shape, affine)
        data = np.asarray(nib.as_closest_canonical(img).dataobj)
    return data.reshape(_squeeze3(data.shape, path))


def image_float32(x: np.ndarray, path: Path) -> np.ndarray:
    """The image as float32 (what the model trains on), checked after the conversion: a float64 file's finite
    values beyond float32's range (1e300) become inf there, and are refused as NaN and inf are."""
    with np.errstate(over="ignore"):  # an overflow is what the check below refuses, in its own words
        y = x.astype(np.float32, copy=False)
    if not np.isfinite(y).all():
        if x.dtype.kind == "f" and np.isfinite(x).all():
            raise fail(path, f"values up to {float(np.abs(x).max()):.3g} exceed float32's range "
                             f"({float(np.finfo(np.float32).max):.3g}): rescale the image")
        raise fail(path, "image contains NaN or inf")
    if y.min() == y.max():
        raise fail(path, f"constant image (every voxel is {y.flat[0]})")
    return y


# Labels are stored as uint8 once read, and a model has one input channel per label: a data set with more label
# classes than this is refused unless declared (a stray value such as 255 or 60000 would otherwise size the model).
MAX_INFERRED_LABEL = 32
MAX_LABEL = 255


def label_counts(y: np.ndarray, path: Path, num_classes: int | None = None) -> dict[int, int]:
    """Validate a label map (integers from 0, at most `num_classes` or `MAX_LABEL`); {label: voxel count}."""
    if y.dtype.kind not in "biuf":
        raise fail(path, f"labels must be integers, got dtype {y.dtype}")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise fail(path, "labels must be integers, found non-integer or NaN/inf values")
    values, counts = np.unique(y, return_counts=True)
    found = {int(v): int(c) for v, c in zip(values, counts)}
    if (lo := min(found)) < 0:
        raise fail(path, f"negative label {lo} ({_voxels(found[lo])})")
    limit = default(num_classes, MAX_LABEL)
    if (hi := max(found)) > limit:
        raise fail(path, f"label {hi} ({_voxels(found[hi])}) out of range ("
                         + (f"num_classes={num_classes})" if exists(num_classes) else f"labels go up to {MAX_LABEL})"))
    return found


def _voxels(n: int) -> str:
    return f"{n:,} voxel{'s' if n != 1 else ''}"


def check_label_set(counts: list[tuple[Path, dict[int, int]]], num_classes: int | None = None) -> int:
    """The data set's label classes (background not counted), from each file's `label_counts`.

    Declared (`num_classes`): every label lies in 0..num_classes. Inferred: the labels found must be contiguous from
    0 and at most `MAX_INFERRED_LABEL`; a value beyond a gap (one stray voxel of 7 among 0..3) is an error naming its
    file, the value and its voxel count, never a wider model."""
    if exists(num_classes):
        for path, found in counts:
            if (hi := max(found)) > num_classes:
                raise fail(path, f"label {hi} ({_voxels(found[hi])}) out of range (num_classes={num_classes})")
        return num_classes
    present = set().union(*(found.keys() for _, found in counts)) if counts else {0}
    top = 0
    while top + 1 in present:
        top += 1
    stray = sorted(v for v in present if v > top)
    if stray or top > MAX_INFERRED_LABEL:
        value = stray[0] if stray else top
        path, n = min(((p, f[value]) for p, f in counts if value in f), key=lambda pn: pn[1])
        why = (f"unexpected label {value} ({_voxels(n)}): the data set's other labels are 0..{top}" if stray else
               f"label {value} ({_voxels(n)}): more than {MAX_INFERRED_LABEL} label classes")
        raise fail(path, why + "; fix the label map, or declare the classes with --mask-channels")
    return top


def normalize(x: np.ndarray) -> np.ndarray:
    """Per-volume scaling to [-1, 1]. The 0.5/99.5 percentiles keep a few hot voxels (vessels,
    artefacts) from squashing the tissue into a narrow band; min/max if they coincide."""
    lo, hi = np.percentile(x, (0.5, 99.5))
    if hi <= lo:
        lo, hi = x.min(), x.max()
    return ((np.clip(x, lo, hi) - lo) / (hi - lo) * 2 - 1).astype(np.float32)


def resize(x: torch.Tensor, size: int | tuple[int, int, int], *, mode: str) -> torch.Tensor:
    shape = shape3(size)
    if tuple(x.shape) == shape:
        return x
    kwargs = dict(align_corners=False) if mode == "trilinear" else {}
    return F.interpolate(x[None, None], size=shape, mode=mode, **kwargs)[0, 0]
