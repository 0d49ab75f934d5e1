"""Writing the embedded synthetic subjects as a NIfTI folder, as a scanner's export would hold them.

`export_folder` writes gzip NIfTI files in the reference's layout (image/, mask/: int16 intensities as scanners
store magnitude images, uint8 labels) or the BraTS layout (seg/, t1/, t1ce/, t2/, flair/, or the BraTS 2023 names:
float64 volumes, as the preprocessed BraTS files are often stored). The voxels are stored in another orientation
than the canonical one (the affine says which), so that a reader must reorient them to see the anatomy the
generator made. A folder for the tests and for timing training on files, without downloaded data.

The folder is built in a staging folder beside it (`.<name>.stage-<pid>`) and put in place whole, by one rename,
once every file is written: an export stopped by Ctrl-C, SIGTERM or a full disk leaves no folder that training
would take for a complete one, and the next export of that folder removes what a killed one left.
"""

from __future__ import annotations

import errno
import gzip
import math
import os
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np

from medddpm.store.lock import output_lock
from medddpm.store.storage import atomic_write, storage_error
from medddpm.train.folders import BRATS_2023_NAMES
from medddpm.train.nifti import MAX_VOXELS, DataError, shape3
from medddpm.train.synthetic import BRATS_MODALITIES, BRATS_SPACING_MM, make_brats_case, make_mni_pair

LAYOUTS = ("reference", "brats", "brats2023")
# Storage orientations (nibabel axis codes): a sagittal-first order for whole heads, the LPS order of DICOM-derived
# BraTS files; neither is RAS, so reading them unreoriented would give another anatomy.
ORIENTATION = {"reference": ("P", "S", "L"), "brats": ("L", "P", "S"), "brats2023": ("L", "P", "S")}
BRATS_ON_DISK = (240, 240, 155)  # BraTS' 1 mm grid, cropped to the preset's 192 x 192 x 144 as the reference does


def _image(array: np.ndarray, spacing: float, axcodes: tuple[str, str, str], dtype) -> nib.Nifti1Image:
    """`array` (RAS axes, isotropic `spacing` mm, centred on the origin) stored in the orientation `axcodes`."""
    shape = np.array(array.shape)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = -spacing * (shape - 1) / 2
    canonical = nib.Nifti1Image(np.asarray(array, dtype=dtype), affine)
    ornt = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(("R", "A", "S")),
                                           nib.orientations.axcodes2ornt(axcodes))
    img = canonical.as_reoriented(ornt)
    img.header.set_xyzt_units("mm", "sec")
    img.set_qform(img.affine, code=1)  # scanner coordinates, as a converted DICOM series says
    img.set_sform(img.affine, code=1)
    return img


def _save(img: nib.Nifti1Image, path: Path) -> Path:
    # mtime=0: the same subject gives the same bytes, so the files' hashes say whether anything changed
    return atomic_write(path, lambda f: f.write(gzip.compress(img.to_bytes(), compresslevel=6, mtime=0)))


def export_folder(out: str | os.PathLike, *, pairs: int, layout: str = "reference",
                  size: int | tuple[int, int, int] | None = None, seed: int = 0) -> list[Path]:
    """Write `pairs` subjects (seeds seed .. seed + pairs - 1) under `out`; returns the files written.

    `size`: voxels on disk (default 128^3 whole heads, 240x240x155 BraTS). `out` must be empty or new; it appears
    only once complete."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not isinstance(pairs, int) or pairs < 1:
        raise ValueError(f"pairs must be a positive integer, got {pairs!r}")
    shape = shape3(size or (128 if layout == "reference" else BRATS_ON_DISK))
    if math.prod(shape) > MAX_VOXELS:  # training would refuse every file: nothing is written
        raise ValueError(f"size {'x'.join(map(str, shape))}: more than the {MAX_VOXELS / 1e6:,.0f} M voxels a "
                         "volume for training may hold")
    out = Path(out)
    _check_empty(out)
    with output_lock(out, what="export-data"):  # one export at a time stages this folder
        for left in out.parent.glob(f".{out.name}.stage-*"):  # what a killed export left
            shutil.rmtree(left, ignore_errors=True)
        stage = out.parent / f".{out.name}.stage-{os.getpid()}"
        try:
            written = _write(stage, pairs=pairs, layout=layout, shape=shape, seed=seed)
            try:  # one atomic step; it replaces an empty folder and fails on one that holds files
                os.rename(stage, out)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    _check_empty(out)  # someone wrote there meanwhile: refused as at the start
                raise storage_error(out, e) from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return [out / p.relative_to(stage) for p in written]


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out}: {'not a folder' if not out.is_dir() else 'not empty'}; export-data writes a new "
                        "folder")


def _write(stage: Path, *, pairs: int, layout: str, shape: tuple[int, int, int], seed: int) -> list[Path]:
    """Every file of the folder, under `stage`."""
    try:
        stage.mkdir(parents=True)
    except OSError as e:
        raise storage_error(stage, e) from None
    axcodes, written = ORIENTATION[layout], []
    for k in range(seed, seed + pairs):
        if layout == "reference":
            image, labels = make_mni_pair(k, size=shape)
            spacing = 1.6 * 128 / max(shape)
            scanner = np.rint((image + 1) * 500).astype(np.int16)  # 0 .. 1000, background 0
            written.append(_save(_image(scanner, spacing, axcodes, np.int16), stage / "image" / f"img_{k:03d}.nii.gz"))
            written.append(_save(_image(labels, spacing, axcodes, np.uint8), stage / "mask" / f"mask_{k:03d}.nii.gz"))
            continue
        image, labels = make_brats_case(k, size=shape, spacing_mm=BRATS_SPACING_MM)
        new = layout == "brats2023"
        case = f"BraTS-GLI-{k:05d}-000" if new else f"BraTS2021_{k:05d}"
        sep = "-" if new else "_"
        volumes = {"seg": labels, **dict(zip(BRATS_MODALITIES, image))}
        for m, volume in volumes.items():
            name = BRATS_2023_NAMES.get(m, m) if new else m
            written.append(_save(_image(volume, BRATS_SPACING_MM, axcodes, np.float64),
                                 stage / name / f"{case}{sep}{name}.nii.gz"))
    return written
