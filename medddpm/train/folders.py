"""User data in NIfTI folders: the Med-DDPM layout (`NiftiPairs`) and the BraTS layout (`BratsCases`).

Opening a folder checks every file (headers first: each volume's shape against the model's input, and an image's
grid against its label map's; then voxels and labels, each error one line naming the file) and fills the volume
cache (`medddpm.train.cache`): each item decoded, reoriented to the closest canonical orientation, normalised and
resized or cropped once, stored memory-mapped. Later opens of an unchanged folder read only the cache;
`cache_build_s` is what the first pass over the folder took to build its entries (recorded in them, so it reads the
same after they were built by another process). Items come from the cache: `raw(i)`
(image float32 (C, D, H, W), labels uint8) for `medddpm.train.loader`, `[i]` with the labels one-hot.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from medddpm.progress import progress_bar
from medddpm.train.cache import Built, Entry, VolumeCache
from medddpm.train.loader import one_hot_condition
from medddpm.train.geometry import difference, same_grid
from medddpm.train.nifti import (check_file, check_fit, check_label_set, default, exists, fail, image_float32,
                                 label_counts, missing_why, nifti_name, normalize, numbered_files, read_volume,
                                 resize, shape3, volume_header)
from medddpm.train.synthetic import BRATS_LABELS, BRATS_MODALITIES, BRATS_SHAPE

NORMALIZE = "percentile-0.5-99.5"  # `normalize`'s scaling, part of every cache key: change it with the function


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEDDDPM_CACHE") or Path.home() / ".cache" / "medddpm")


def _root(root: str | os.PathLike) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise fail(root, missing_why(root) or "no such data folder")
    return root


class _CachedFolder(torch.utils.data.Dataset):
    """Items of a folder, each from its cache entry. Subclasses set `self.items` (per item, {role: file}) and
    `self.params`, and define `_build(item) -> Built`."""

    items: list[dict[str, Path]]
    params: dict
    mask_channels: int

    def _open_cache(self, cache_dir, progress: bool, what: str) -> list[tuple[Path, dict[int, int]]]:
        self.cache = VolumeCache(Path(default(cache_dir, default_cache_dir())) / "volumes")
        counts, self.cache_build_s = [], 0.0
        for item in progress_bar(self.items, desc=f"cache {what}", progress=progress):
            entry = self._entry(item)
            counts.append((item["labels"], entry.counts))
            self.cache_build_s += entry.build_s
        return counts

    def _entry(self, item: dict[str, Path]) -> Entry:
        return self.cache.get(list(item.values()), self.params, lambda: self._build(item))

    def __len__(self) -> int:
        return len(self.items)

    def raw(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Image float32 (C, D, H, W) and labels uint8 (D, H, W), copied out of the cache's memory map."""
        if not 0 <= i < len(self.items):  # also ends plain iteration
            raise IndexError(f"index {i} out of range for {len(self.items)} items")
        entry = self._entry(self.items[i])
        return torch.from_numpy(np.array(entry.image)), torch.from_numpy(np.array(entry.labels))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, labels = self.raw(i)
        return image, one_hot_condition(labels, num_classes=self.mask_channels, check=False)


class NiftiPairs(_CachedFolder):
    """User data in the Med-DDPM layout: <root>/image/*.nii[.gz] and <root>/mask/*.nii[.gz], paired by the last
    integer in the file name. Volumes are resized (not cropped) to `size` (a side, or (D, H, W)): trilinear for
    images, nearest for labels; intensities scaled per volume (never per slice). `num_classes`: the label classes
    declared (None: inferred, contiguous from 0, see `check_label_set`).

    A mask must lie on its image's grid (the same shape and affine, `geometry.same_grid`); `resample_mask` instead
    resamples each mask onto its image's grid by nearest neighbour, for masks known to be registered otherwise."""

    image_channels = 1

    def __init__(self, root: str | os.PathLike, *, size: int | tuple[int, int, int] = 128,
                 num_classes: int | None = None, cache_dir: str | os.PathLike | None = None, progress: bool = False,
                 resample_mask: bool = False):
        root = _root(root)
        if exists(num_classes) and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        images, masks = numbered_files(root / "image"), numbered_files(root / "mask")
        for mine, theirs, other in ((images, masks, "mask"), (masks, images, "image")):
            if unpaired := sorted(mine.keys() - theirs.keys()):
                raise fail(mine[unpaired[0]], f"no {other} with number {unpaired[0]}")
        self.pairs = [(images[k], masks[k]) for k in sorted(images)]
        self.items = [{"image": image, "labels": mask} for image, mask in self.pairs]
        for image, mask in self.pairs:  # headers first: cheap, catches most mistakes
            (a, grid), (b, mask_grid) = volume_header(image), volume_header(mask)
            for path, shape in ((image, a), (mask, b)):
                check_fit(path, shape, shape3(size))
            if resample_mask:
                continue
            if a != b:
                raise fail(image, f"shape {a} differs from its mask {mask.name} {b} (--resample-mask resamples "
                                  "the mask onto the image's grid)")
            if not same_grid(grid, mask_grid):
                raise fail(mask, f"not on the grid of its image {image}: {difference(grid, mask_grid, a)}; fix the "
                                 "mask's header, or pass --resample-mask to resample it onto the image's grid")
        self.size, self.resample_mask = size, resample_mask
        self.params = {"layout": "pairs", "size": shape3(size), "normalize": NORMALIZE}
        if resample_mask:  # only then: the keys of every other folder's entries stay as they were
            self.params["resample_mask"] = "nearest"
        counts = self._open_cache(cache_dir, progress, root.name)
        top = check_label_set(counts, num_classes)
        if not exists(num_classes) and top == 0:
            raise fail(root / "mask", "every mask is all background (0)")
        self.num_classes = top

    @property
    def mask_channels(self) -> int:
        return self.num_classes

    def _build(self, item: dict[str, Path]) -> Built:
        image = image_float32(read_volume(item["image"]), item["image"])
        labels = read_volume(item["labels"], onto=item["image"] if self.resample_mask else None)
        # once the folder is open its label set bounds a file rebuilt later (edited while training)
        counts = label_counts(labels, item["labels"], getattr(self, "num_classes", None))
        image = resize(torch.from_numpy(normalize(image)), self.size, mode="trilinear")
        labels = resize(torch.from_numpy(labels.astype(np.float32)), self.size, mode="nearest-exact")
        return image[None].numpy(), labels.numpy().astype(np.uint8), counts


# The BraTS 2023 challenge's names for the four modalities (t1n native T1, t1c contrast-enhanced, t2w, t2f FLAIR)
BRATS_2023_NAMES = {"t1": "t1n", "t1ce": "t1c", "t2": "t2w", "flair": "t2f"}
_BRATS_FOLDERS = ("seg", *BRATS_MODALITIES)


def brats_folders(root: Path) -> dict[str, str] | None:
    """{modality: its folder's name} if `root` holds the BraTS layout (older or 2023 names), else None."""
    for names in ({m: m for m in _BRATS_FOLDERS}, {"seg": "seg", **BRATS_2023_NAMES}):
        if any((root / name).exists() for m, name in names.items() if m != "seg"):
            return names
    return None


def _brats_files(root: Path, modality: str, name: str) -> dict[str, Path]:
    """{case: file} of <root>/<name>/<case>_<name>.nii[.gz] (or <case>-<name>, BraTS 2023); anything else is an
    error."""
    folder = root / name
    if not folder.is_dir():
        raise fail(folder, missing_why(folder) or "missing folder (the BraTS layout is <root>/{seg,t1,t1ce,t2,flair}"
                                                   "/<case>_<modality>.nii.gz, or t1n, t1c, t2w, t2f)")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if not files:
        raise fail(folder, "empty folder")
    cases: dict[str, Path] = {}
    for path in files:
        check_file(path)
        m = re.fullmatch(r"(.+)[_-]([^_-]+)", nifti_name(path))
        if not m or m.group(2).lower() != name:
            raise fail(path, f"expected <case>_{name}.nii.gz in folder {name}/")
        cases[m.group(1)] = path
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


class BratsCases(_CachedFolder):
    """User data in the BraTS layout: <root>/{seg,t1,t1ce,t2,flair}/<case>_<modality>.nii[.gz], or with the BraTS
    2023 names (t1n, t1c, t2w, t2f).

    Items are ``(image, cond)``: image float32 (4, D, H, W), the modalities T1, T1ce, T2, FLAIR each scaled to
    [-1, 1] on its own; cond float32 (4, D, H, W), the label map one-hot without background in {-1, +1}. Label maps
    follow the reference's preprocessing (`BRATS_LABELS`: 1 necrotic core, 2 edema, 3 enhancing tumour, 4 the rest
    of the brain); a raw BraTS map (enhancing tumour as 4, the brain as background) is refused, since it would train
    on wrong classes. Volumes are centre-cropped or padded to `size`, as the reference does (192 x 192 x 144 from
    BraTS' 240 x 240 x 155).
    """

    mask_channels = len(BRATS_LABELS) - 1
    image_channels = len(BRATS_MODALITIES)

    def __init__(self, root: str | os.PathLike, *, size: int | tuple[int, int, int] = BRATS_SHAPE,
                 cache_dir: str | os.PathLike | None = None, progress: bool = False):
        root = _root(root)
        names = brats_folders(root) or {m: m for m in _BRATS_FOLDERS}
        files = {m: _brats_files(root, m, names[m]) for m in _BRATS_FOLDERS}
        cases = sorted(set().union(*(f.keys() for f in files.values())))
        for case in cases:  # every case in every folder
            have = [m for m in _BRATS_FOLDERS if case in files[m]]
            for m in _BRATS_FOLDERS:
                if case not in files[m]:
                    raise fail(files[have[0]][case], f"case {case!r} has no {names[m]} volume "
                                                      f"(expected {root / names[m] / f'{case}_{names[m]}.nii.gz'})")
        self.cases = [{m: files[m][case] for m in _BRATS_FOLDERS} for case in cases]
        self.items = [{**{m: case[m] for m in BRATS_MODALITIES}, "labels": case["seg"]} for case in self.cases]
        self.names = cases
        self.size = size
        for case in self.cases:  # headers first: cheap, catches most mistakes
            seg_shape, seg_grid = volume_header(case["seg"])
            check_fit(case["seg"], seg_shape, shape3(size), crop=True)
            for m in BRATS_MODALITIES:
                got, grid = volume_header(case[m])
                if got != seg_shape:
                    raise fail(case[m], f"shape {got} differs from its label map {case['seg'].name} {seg_shape}")
                if not same_grid(grid, seg_grid):
                    raise fail(case["seg"], f"not on the grid of its {names[m]} volume {case[m]}: "
                                            f"{difference(grid, seg_grid, got)}; fix the label map's header")
        self.params = {"layout": "brats", "size": shape3(size), "normalize": NORMALIZE}
        check_label_set(self._open_cache(cache_dir, progress, root.name), self.mask_channels)

    def _build(self, item: dict[str, Path]) -> Built:
        shape = shape3(self.size)
        channels, t1 = [], None
        for m in BRATS_MODALITIES:
            # float32 at once: BraTS files are often float64, and every copy of a 240x240x155 volume costs 71 MB
            x = image_float32(read_volume(item[m]), item[m])
            t1 = x if m == "t1" else t1
            channels.append(_crop_or_pad(normalize(x), shape, -1.0))
        seg = read_volume(item["labels"])
        counts = label_counts(seg, item["labels"], self.mask_channels)
        brain = t1 > t1.min()  # skull-stripped: the brain is what is above the background
        if brain.any() and (seg[brain] == 0).mean() > 0.5:
            raise fail(item["labels"], "most of the brain is labelled 0: a raw BraTS label map? Label the brain 4 "
                                       "and enhancing tumour 3, as the reference's preprocess_brats_data.py does")
        return np.stack(channels), _crop_or_pad(seg.astype(np.uint8), shape, 0), counts
