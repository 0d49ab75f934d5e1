"""What the explorers page shows of its widgets in a static book: the slice viewer's three views through the middle
of a training pair, and the data explorer's first view and its warp-stall view, each checked against what it
must draw."""

from __future__ import annotations

import html

import numpy as np

from medddpm.report.explore.measurements import DataExplorer
from medddpm.report.explore.volumes import AXES, LABEL_COLORS, SliceViewer, png_bytes
from medddpm.report.safe import code, md
from medddpm.train.data import open_dataset
from medddpm.train.synthetic import LABELS

GAP = 8  # white pixels between two views


def training_pairs(source: str = "mni", *, size: int = 96, n: int = 1):
    """Training pairs (image, one-hot condition) of the embedded data, as the training loop reads them: `source`
    "mni" makes them from the MNI templates in the nilearn wheel (cached after the first call)."""
    return open_dataset(source, size=size, n=n)


def middle_views(viewer: SliceViewer) -> bytes:
    """A PNG of the viewer's sagittal, coronal and axial slices through the middle of the volume, side by side,
    each with the label map drawn over it. Every middle slice of a head holds CSF, grey and white matter."""
    stills = []
    for axis in AXES:
        viewer.axis = axis
        viewer.index = viewer.size() // 2
        stills.append(viewer.rgb())
        present = set(np.unique(viewer.slice_labels()))
        assert present <= set(LABELS) and {1, 2, 3} <= present, (axis, present)
    gap = np.full((stills[0].shape[0], GAP, 3), 255, dtype=np.uint8)
    return png_bytes(np.hstack([stills[0], gap, stills[1], gap, stills[2]]))


def views_caption(viewer: SliceViewer) -> str:
    """The views' caption (Markdown with inline HTML): the pair's size, each label with its colour, the opacity."""
    def swatch(rgb) -> str:
        return f'<span style="color: rgb{tuple(rgb)}">&#9632;</span>'

    labels = ", ".join(f"{swatch(LABEL_COLORS[k - 1])} {html.escape(LABELS[k])}" for k in sorted(LABELS) if k)
    return (f"Sagittal, coronal and axial slices of training pair 0 ({viewer.volume.shape[1]}³ voxels); labels "
            f"{labels} at opacity {viewer.alpha}.")


def check_explorer(explorer: DataExplorer) -> None:
    """The explorer starts on a GPU and configuration it offers, with something to draw there."""
    assert explorer.gpu in explorer.gpus and explorer.config in explorer.configs(), (explorer.gpu, explorer.config)
    assert len(explorer.frame()) > 0, (explorer.gpu, explorer.config)


def show_stalls(explorer: DataExplorer) -> str:
    """Set the explorer on the warp-stall view of the first run with Nsight Compute counters, else on step time;
    returns the still's caption."""
    with_ncu = explorer.ncu[["gpu_slug", "config"]].drop_duplicates()
    if len(with_ncu):
        explorer.gpu, explorer.config = with_ncu.iloc[0]
        explorer.view = "stalls"
    else:
        explorer.view = "step time"
    return f"The `{explorer.view}` view for {md(explorer.gpu)}" + (
        f" / {code(explorer.config)}:" if explorer.view == "stalls" else ":")
