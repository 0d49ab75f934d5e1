"""Where a volume's voxels lie: the geometry of an image and its label map compared before either is reoriented.

Each file is reoriented to its closest canonical orientation on its own (`nifti.read_volume`), so a mask whose
affine is flipped or shifted against its image's would be mirrored or moved against the anatomy it labels, and a
model trained on the pair would learn wrong anatomy. The pair's affines must therefore agree (`same_grid`), within
the tolerance nibabel and nilearn use for "the same affine" (`numpy.allclose`: relative 1e-5, and here an absolute
1e-4, the float32 noise of an affine derived from a NIfTI quaternion, far below any misregistration). A
disagreement is described in words (`difference`: "axis 0 flipped", "shift of 50.0 mm"), and a user who means it
resamples the mask onto the image's grid (`resample_onto`: nearest neighbour, labels stay labels).
"""

from __future__ import annotations

import math

import nibabel as nib
import numpy as np
from nibabel.affines import voxel_sizes
from nibabel.orientations import aff2axcodes, inv_ornt_aff, io_orientation

RTOL, ATOL = 1e-5, 1e-4


def same_grid(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two voxel-to-world affines map voxels to the same places."""
    return bool(np.allclose(a, b, rtol=RTOL, atol=ATOL))


def _mm(values) -> str:
    return "x".join(f"{v:g}" for v in np.round(values, 3))


def difference(image: np.ndarray, mask: np.ndarray, shape: tuple[int, ...]) -> str:
    """How `mask`'s affine differs from `image`'s (both volumes of `shape`), in the words a user fixes a header by:
    the same voxels stored in another order, the axes' order or direction (what reorienting would mirror), then
    the voxel size, a rotation, or a shift."""
    ours, theirs = io_orientation(image), io_orientation(mask)
    if not np.array_equal(ours, theirs):
        codes = f"{''.join(aff2axcodes(mask))} in the mask, {''.join(aff2axcodes(image))} in the image"
        flipped = [str(i) for i in range(3) if ours[i, 1] != theirs[i, 1]]
        what = ("axes in another order" if (ours[:, 0] != theirs[:, 0]).any() else
                f"axis {flipped[0]} flipped" if len(flipped) == 1 else f"axes {', '.join(flipped)} flipped")
        if same_grid(_canonical(image, ours, shape), _canonical(mask, theirs, shape)):
            # the headers place the two on one grid, each stored in its own order: consistent if both are right
            return f"{what} over the same grid ({codes})"
        return f"{what} ({codes})"
    zi, zm = voxel_sizes(image), voxel_sizes(mask)
    if not np.allclose(zi, zm, rtol=RTOL, atol=ATOL):
        return f"voxel size {_mm(zm)} mm in the mask, {_mm(zi)} mm in the image"
    ri, rm = image[:3, :3] / zi, mask[:3, :3] / zm
    if not np.allclose(ri, rm, rtol=RTOL, atol=ATOL):
        cos = (np.trace(ri.T @ rm) - 1) / 2
        return f"rotated by {math.degrees(math.acos(float(np.clip(cos, -1, 1)))):.1f} degrees"
    # the rotations agree: every voxel moves by the same vector, that of the translations
    shift = mask[:3, 3] - image[:3, 3]
    size = float(np.linalg.norm(shift))
    return f"shift of {size:.1f} mm" if size >= 0.05 else f"shift of {size:.2g} mm"


def _canonical(affine: np.ndarray, ornt: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The affine of a volume of `shape` reoriented to its closest canonical orientation (as
    `as_closest_canonical` gives it), from the header alone."""
    return affine @ inv_ornt_aff(ornt, shape[:3])


def resample_onto(mask: nib.spatialimages.SpatialImage, shape: tuple[int, ...], affine: np.ndarray):
    """`mask` resampled onto the grid (`shape`, `affine`) by nearest neighbour: each voxel takes the label at its
    centre, outside the mask's field of view background (0)."""
    from nibabel.processing import resample_from_to  # scipy, imported only when asked for

    mask = nib.funcs.squeeze_image(mask)  # a trailing singleton axis (D, H, W, 1) is common
    return resample_from_to(mask, (tuple(shape[:3]), affine), order=0, mode="constant", cval=0)
