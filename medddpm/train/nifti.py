"""Reading the user's NIfTI volumes, and the checks and scaling applied to them.

Every problem with input data is a `DataError`, one line naming the offending file (`fail`). NIfTI files
are found in a folder and paired by number (`numbered_files`), read with trailing singleton axes dropped
(`volume_shape` from the header alone, `read_volume`), checked (`check_image`, `check_labels`), scaled to
[-1, 1] per volume (`normalize`) and resized (`resize`).
"""

from __future__ import annotations

import contextlib
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


def fail(path: str | os.PathLike, why: str) -> DataError:
    return DataError(f"{path}: {why}")


def shape3(size: int | tuple[int, int, int]) -> tuple[int, int, int]:
    return (size,) * 3 if isinstance(size, int) else tuple(size)


# files and volumes

def nifti_name(path: Path) -> str | None:
    """File name without its NIfTI extension, or None if it is not .nii / .nii.gz."""
    m = re.fullmatch(r"(.*)\.nii(\.gz)?", path.name, flags=re.IGNORECASE)
    return m.group(1) if m else None


def numbered_files(folder: Path) -> dict[int, Path]:
    """{number: file} for the NIfTI files of a folder, keyed by the last integer in the name."""
    if not folder.is_dir():
        raise fail(folder, "missing folder (expected <root>/image and <root>/mask)")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))  # skip .DS_Store & co
    if not files:
        raise fail(folder, "empty folder")
    numbered: dict[int, Path] = {}
    for path in files:
        stem = nifti_name(path)
        if stem is None or not path.is_file():
            raise fail(path, "not a NIfTI file (.nii or .nii.gz)")
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


def volume_shape(path: Path) -> tuple[int, ...]:
    with _reading(path):
        shape = tuple(nib.load(path).shape)  # header only
    return _squeeze3(shape, path)


def read_volume(path: Path) -> np.ndarray:
    with _reading(path):
        data = np.asarray(nib.load(path).dataobj)
    return data.reshape(_squeeze3(data.shape, path))


def check_image(x: np.ndarray, path: Path) -> None:
    if not np.isfinite(x).all():
        raise fail(path, "image contains NaN or inf")
    if x.min() == x.max():
        raise fail(path, f"constant image (every voxel is {x.flat[0]})")


def check_labels(y: np.ndarray, path: Path, num_classes: int | None) -> int:
    """Validate a label map; returns its largest label."""
    if y.dtype.kind not in "biuf":
        raise fail(path, f"labels must be integers, got dtype {y.dtype}")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise fail(path, "labels must be integers, found non-integer or NaN/inf values")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0:
        raise fail(path, f"negative label {lo}")
    if exists(num_classes) and hi > num_classes:
        raise fail(path, f"label {hi} out of range (num_classes={num_classes})")
    return hi


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
