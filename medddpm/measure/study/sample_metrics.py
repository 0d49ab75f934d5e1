"""Scores of generated volumes against their label maps and the real images, with no trained network:

- `label_dice`: does a conditional model put each tissue where its label map says? The intensities inside
  the brain are split into three clusters (1-D k-means), the clusters are named by their order of brightness
  (on T1: CSF darkest, then grey matter, then white matter), and each is compared with its tissue's label by
  the Dice coefficient. A real image scores below 1 (partial volumes, bias field, noise): the ceiling is what
  the real images score.
- `intensity_w1`: how far a tissue's intensities lie from the real training images' in that tissue: the
  1-Wasserstein distance of the two distributions (the mean absolute difference of their quantiles), in the
  images' [-1, 1] units.
- `ms_ssim`: 3D multi-scale structural similarity of two volumes (Wang, Simoncelli & Bovik 2003), here of two
  samples drawn for one label map: a model that ignores its noise draws the same volume twice (near 1); one
  that draws varied anatomy within the map scores lower.
- `slices_png`: the middle slice along each axis, side by side, as a small PNG.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F

TISSUES = {1: "csf", 2: "gm", 3: "wm"}  # the embedded data's labels (medddpm.train.synthetic.LABELS), as table names
T1_ORDER = (1, 2, 3)  # tissue labels from darkest to brightest on a T1 image: CSF, grey, white matter
QUANTILES = np.linspace(0.0005, 0.9995, 1000)  # where two intensity distributions are compared


def kmeans_1d(values: np.ndarray, k: int = 3, *, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means on scalars, started from the quantiles (i + 1/2) / k, so that it is deterministic.

    Returns (cluster of each value, centres), clusters numbered from the darkest centre up."""
    values = np.asarray(values, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("k-means of no values")
    centres = np.quantile(values, (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        centres = np.sort(centres)
        cluster = np.digitize(values, (centres[1:] + centres[:-1]) / 2)  # nearest centre: centres are sorted
        sums = np.bincount(cluster, weights=values, minlength=k)
        counts = np.bincount(cluster, minlength=k)
        new = np.where(counts > 0, sums / np.maximum(counts, 1), centres)  # an empty cluster keeps its centre
        if np.allclose(new, centres, rtol=0, atol=1e-9):
            break
        centres = new
    centres = np.sort(centres)
    return np.digitize(values, (centres[1:] + centres[:-1]) / 2), centres


def dice(a: np.ndarray, b: np.ndarray) -> float:
    """2 |A and B| / (|A| + |B|) of two boolean masks; NaN where both are empty."""
    total = int(a.sum()) + int(b.sum())
    return 2.0 * int(np.logical_and(a, b).sum()) / total if total else math.nan


def label_dice(image: np.ndarray, labels: np.ndarray, *, order: tuple[int, ...] = T1_ORDER) -> dict[str, float]:
    """Dice of each tissue between the k-means clusters of `image`'s intensities inside the brain (labels > 0)
    and the label map; `order` names the clusters from darkest to brightest. Keys: the tissue names and 'mean'
    (over the tissues present)."""
    image, labels = np.asarray(image, dtype=np.float64), np.asarray(labels)
    if image.shape != labels.shape:
        raise ValueError(f"image {image.shape} and label map {labels.shape} differ in shape")
    brain = labels > 0
    if not brain.any():
        raise ValueError("the label map holds no brain (every label is 0)")
    cluster, _ = kmeans_1d(image[brain], len(order))
    named = np.asarray(order)[cluster]  # each brain voxel's tissue by its brightness
    truth = labels[brain]
    out = {TISSUES.get(t, str(t)): dice(named == t, truth == t) for t in order}
    present = [v for v in out.values() if not math.isnan(v)]
    out["mean"] = float(np.mean(present)) if present else math.nan
    return out


def tissue_quantiles(images, label_maps, *, tissues=tuple(TISSUES)) -> dict[int, np.ndarray]:
    """Per tissue: the quantiles (`QUANTILES`) of the intensities of all `images` inside that tissue's label."""
    pooled = {t: [] for t in tissues}
    for image, labels in zip(images, label_maps):
        image, labels = np.asarray(image), np.asarray(labels)
        for t in tissues:
            pooled[t].append(image[labels == t].ravel())
    return {t: np.quantile(np.concatenate(v), QUANTILES) if sum(map(len, v)) else np.full(QUANTILES.shape, np.nan)
            for t, v in pooled.items()}


def intensity_w1(image: np.ndarray, labels: np.ndarray, reference: dict[int, np.ndarray]) -> dict[str, float]:
    """Per tissue, the 1-Wasserstein distance between `image`'s intensities in that tissue and `reference`'s
    (`tissue_quantiles` of the real images); 'mean' over the tissues present."""
    image, labels = np.asarray(image), np.asarray(labels)
    out = {}
    for t, ref in reference.items():
        values = image[labels == t]
        out[TISSUES.get(t, str(t))] = (float(np.mean(np.abs(np.quantile(values, QUANTILES) - ref)))
                                       if values.size else math.nan)
    present = [v for v in out.values() if not math.isnan(v)]
    out["mean"] = float(np.mean(present)) if present else math.nan
    return out


# ------------------------------------------------------------------------------------------ MS-SSIM

MS_SSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)  # Wang et al. 2003, finest scale first


def _gauss(win: int, sigma: float, dtype) -> torch.Tensor:
    x = torch.arange(win, dtype=dtype) - (win - 1) / 2
    g = torch.exp(-x**2 / (2 * sigma**2))
    return g / g.sum()


def _blur(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian over the three axes of (N, 1, D, H, W), valid part only."""
    n = g.numel()
    for shape in ((n, 1, 1), (1, n, 1), (1, 1, n)):
        x = F.conv3d(x, g.reshape(1, 1, *shape))
    return x


def _ssim(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, c1: float, c2: float) -> tuple[float, float]:
    mx, my = _blur(x, g), _blur(y, g)
    sxx, syy, sxy = _blur(x * x, g) - mx**2, _blur(y * y, g) - my**2, _blur(x * y, g) - mx * my
    cs = (2 * sxy + c2) / (sxx + syy + c2)
    lum = (2 * mx * my + c1) / (mx**2 + my**2 + c1)
    return float((lum * cs).mean()), float(cs.mean())


def ms_ssim(a: np.ndarray, b: np.ndarray, *, data_range: float = 2.0, win: int = 7, sigma: float = 1.5,
            max_levels: int = 5) -> float:
    """3D MS-SSIM of two volumes of one shape: as many scales (halving each axis) as leave at least `win`
    voxels a side, at most five, with Wang et al.'s weights for those scales renormalised; negative terms
    are clipped at 0 (as pytorch-msssim does). `data_range`: 2 for images in [-1, 1]. A volume smaller than
    the window (a smoke run's) takes the largest odd window that fits."""
    x = torch.as_tensor(np.asarray(a), dtype=torch.float64)[None, None]
    y = torch.as_tensor(np.asarray(b), dtype=torch.float64)[None, None]
    if x.shape != y.shape or x.ndim != 5:
        raise ValueError(f"ms_ssim needs two 3D volumes of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    side = min(x.shape[2:])
    if side < 3:
        raise ValueError(f"volumes of {side} voxels a side are too small for MS-SSIM (3 at least)")
    win = min(win, side - 1 + side % 2)
    levels = min(max_levels, 1 + int(math.log2(side / win)))
    weights = torch.tensor(MS_SSIM_WEIGHTS[:levels], dtype=torch.float64)
    weights /= weights.sum()
    g = _gauss(win, sigma, torch.float64)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    terms = []
    for level in range(levels):
        ssim, cs = _ssim(x, y, g, c1, c2)
        terms.append(max(ssim if level == levels - 1 else cs, 0.0))
        if level < levels - 1:
            x, y = F.avg_pool3d(x, 2), F.avg_pool3d(y, 2)
    return float(np.prod([t ** float(w) for t, w in zip(terms, weights)]))


def brain_box(labels: np.ndarray, *, margin: int = 2) -> tuple[slice, ...]:
    """The bounding box of labels > 0, widened by `margin` voxels (within the volume)."""
    idx = np.argwhere(np.asarray(labels) > 0)
    if not len(idx):
        return tuple(slice(None) for _ in np.shape(labels))
    lo, hi = idx.min(0) - margin, idx.max(0) + margin + 1
    return tuple(slice(max(0, int(l)), min(n, int(h))) for l, h, n in zip(lo, hi, np.shape(labels)))


# ------------------------------------------------------------------------------------------- images

# label map colours: background, CSF, grey matter, white matter (then any further label)
LABEL_COLOURS = [(0, 0, 0), (70, 130, 220), (150, 150, 150), (245, 245, 245), (230, 90, 60), (240, 200, 60)]


def middle_slices(volume: np.ndarray) -> list[np.ndarray]:
    """The middle slice along each axis of a (D, H, W) volume in the embedded data's RAS axes (x, y, z), each
    turned so that anterior (axial) or superior (coronal, sagittal) is up: axial, coronal, sagittal."""
    v = np.asarray(volume)
    d, h, w = (n // 2 for n in v.shape)
    return [np.rot90(v[:, :, w]), np.rot90(v[:, h, :]), np.rot90(v[d, :, :])]


def slices_png(volume: np.ndarray, *, labels: bool = False, gap: int = 2) -> bytes:
    """A small PNG of `middle_slices` side by side: an image in [-1, 1] as grey levels, or a label map in
    `LABEL_COLOURS`."""
    from PIL import Image

    parts = middle_slices(volume)
    height = max(p.shape[0] for p in parts)
    width = sum(p.shape[1] for p in parts) + gap * (len(parts) - 1)
    canvas = np.zeros((height, width), dtype=np.uint8)
    x = 0
    for p in parts:
        if labels:
            pixels = np.asarray(p, dtype=np.int64).clip(0, len(LABEL_COLOURS) - 1).astype(np.uint8)
        else:
            pixels = np.round((np.clip(np.asarray(p, dtype=np.float64), -1, 1) + 1) * 127.5).astype(np.uint8)
        canvas[height - p.shape[0]:, x:x + p.shape[1]] = pixels
        x += p.shape[1] + gap
    if labels:
        image = Image.fromarray(canvas, mode="P")
        image.putpalette([c for rgb in LABEL_COLOURS for c in rgb])
    else:
        image = Image.fromarray(canvas, mode="L")
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()
