"""A slice viewer for volumes and their label maps (ipywidgets).

`SliceViewer` shows one slice of a volume, (C, D, H, W) or (D, H, W), with an optional integer label
map (D, H, W) drawn over it in colour: toggle buttons pick the view (sagittal / coronal / axial), a
slider the slice, a dropdown the channel. It takes training pairs (`SliceViewer.from_pair` on
`medddpm.train.data.open_dataset`) and generated samples (`SliceViewer.from_files` on what
``python -m medddpm sample`` writes). Axes are taken as the embedded MNI pairs store them (RAS voxel
order: axis 0 left-right, 1 posterior-anterior, 2 inferior-superior); other NIfTI files are shown
in their own voxel order. ipywidgets need a kernel; in a static page use `SliceViewer.png` for a still.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import ipywidgets as widgets
import numpy as np

AXES = {"sagittal": 0, "coronal": 1, "axial": 2}
# label -> RGB, the book's category palette order (Tableau 10); labels past its end cycle through it.
LABEL_COLORS = ((76, 120, 168), (245, 133, 24), (84, 162, 75), (228, 87, 86), (178, 121, 162), (114, 183, 178),
                (238, 202, 59), (255, 157, 166), (157, 117, 93), (186, 176, 172))
MIN_PIXELS = 256  # the slice is enlarged (nearest neighbour) until its longer side has this many pixels
MAX_ZOOM = 16


def _numpy(x, what: str) -> np.ndarray:
    """A numpy array from numpy / torch input (torch is optional here)."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be an array, got {type(x).__name__}") from e


def labels_from_condition(cond) -> np.ndarray:
    """One-hot condition (K, D, H, W) in {-1, +1} (what the data sets return) -> label map (D, H, W)
    in {0..K}: channel k is label k + 1, background where no channel is set."""
    c = _numpy(cond, "cond")
    if c.ndim != 4 or c.shape[0] < 1:
        raise ValueError(f"cond must be a one-hot condition (K, D, H, W), got shape {c.shape}")
    on = c > 0
    return np.where(on.any(axis=0), on.argmax(axis=0) + 1, 0).astype(np.int32)


def _check_labels(labels, shape: tuple[int, ...]) -> np.ndarray:
    y = _numpy(labels, "labels")
    if y.ndim != 3:
        hint = "; for a one-hot condition (K, D, H, W) use labels_from_condition" if y.ndim == 4 else ""
        raise ValueError(f"labels must be a (D, H, W) label map, got shape {y.shape}{hint}")
    if y.shape != shape:
        raise ValueError(f"labels shape {y.shape} does not match the volume's (D, H, W) {shape}")
    if y.dtype.kind not in "biuf":
        raise TypeError(f"labels must be integers, got dtype {y.dtype}")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise ValueError("labels must be integers, found non-integer or NaN/inf values")
    if y.size and y.min() < 0:
        raise ValueError(f"labels must be >= 0, found {int(y.min())}")
    return y.astype(np.int32)


def _check_volume(volume) -> np.ndarray:
    v = _numpy(volume, "volume")
    if v.ndim == 3:
        v = v[None]
    if v.ndim != 4 or min(v.shape) < 1:
        raise ValueError(f"volume must be (C, D, H, W) or (D, H, W), got shape {_numpy(volume, 'volume').shape}")
    if v.dtype.kind not in "biuf":
        raise TypeError(f"volume must be real numbers, got dtype {v.dtype}")
    v = v.astype(np.float32)
    if not np.isfinite(v).all():
        raise ValueError("volume contains NaN or inf")
    return v


def _orient(plane: np.ndarray) -> np.ndarray:
    """Slice (first kept axis, second kept axis) -> image rows top-down: the second axis runs up the
    screen (anterior / superior up in RAS order), the first across it."""
    return np.flipud(plane.T)


def png_bytes(rgb: np.ndarray) -> bytes:
    """(h, w, 3) uint8 -> PNG file bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


class SliceViewer:
    """One slice of a volume with its label map overlaid; ipywidgets to move through it.

    ``volume``: (C, D, H, W) or (D, H, W), real and finite. ``labels``: optional (D, H, W) integer
    label map (0 is background and stays uncoloured). What is on show (`axis`, `index`, `channel`,
    `overlay`) can be set from Python or with the widgets; `png` renders it. The widgets are built on
    first use (`widget`, or displaying the viewer in JupyterLab): rendering a still needs no kernel
    frontend. Once built, `axis_widget`, `index_widget`, `channel_widget` and `labels_widget` drive the
    view and `image` holds the PNG on show.
    """

    def __init__(self, volume, *, labels=None, axis: str = "axial", index: int | None = None, channel: int = 0,
                 alpha: float = 0.45, window: tuple[float, float] | None = None, zoom: int | None = None,
                 channel_names: list[str] | None = None, title: str = ""):
        self.volume = _check_volume(volume)
        shape = self.volume.shape[1:]
        self.labels = None if labels is None else _check_labels(labels, shape)
        n_channels = self.volume.shape[0]
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        names = list(channel_names) if channel_names is not None else [f"channel {c}" for c in range(n_channels)]
        if len(names) != n_channels:
            raise ValueError(f"channel_names has {len(names)} names for {n_channels} channels")
        if window is not None and not (len(window) == 2 and window[0] < window[1]):
            raise ValueError(f"window must be (low, high) with low < high, got {window!r}")
        if zoom is not None and not (isinstance(zoom, int) and 1 <= zoom <= MAX_ZOOM):
            raise ValueError(f"zoom must be an int in [1, {MAX_ZOOM}], got {zoom!r}")
        self.alpha, self.window, self.title, self.channel_names = alpha, window, title, names
        self.zoom = zoom or max(1, min(MAX_ZOOM, math.ceil(MIN_PIXELS / max(shape))))
        self._check_axis(axis)
        self._axis = axis
        index = self.size(axis) // 2 if index is None else index
        self._check_index(axis, index)
        self._index = int(index)
        self._check_channel(channel)
        self._channel = int(channel)
        self._overlay = self.labels is not None
        self._box = None
        self._syncing = False

    # -- constructors --------------------------------------------------------------------------------

    @classmethod
    def from_pair(cls, dataset, i: int = 0, **kwargs) -> "SliceViewer":
        """Item ``i`` of a data set of (image, one-hot condition) pairs (`medddpm.data.open_dataset`)."""
        image, cond = dataset[i]
        kwargs.setdefault("title", f"training pair {i}")
        return cls(image, labels=labels_from_condition(cond), **kwargs)

    @classmethod
    def from_files(cls, image: str | os.PathLike, labels: str | os.PathLike | None = None, **kwargs) -> "SliceViewer":
        """NIfTI files: an image (D, H, W) or (D, H, W, C), and optionally its label map, such as the
        ``image/sample_000.nii.gz`` and ``mask/sample_000.nii.gz`` that ``python -m medddpm sample`` writes."""
        import nibabel as nib

        def load(path):
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
            try:
                return np.asarray(nib.load(path).dataobj)
            except Exception as e:  # noqa: BLE001 - nibabel raises many kinds; one line for the user
                raise ValueError(f"{path}: not a readable NIfTI file ({type(e).__name__})") from None

        volume = load(image)
        if volume.ndim == 4:  # NIfTI keeps channels last (sampling.write_nifti)
            volume = np.moveaxis(volume, -1, 0)
        kwargs.setdefault("title", Path(image).name)
        return cls(volume, labels=None if labels is None else load(labels), **kwargs)

    # -- state ---------------------------------------------------------------------------------------

    def size(self, axis: str | None = None) -> int:
        """Number of slices along a view's axis."""
        axis = axis or self._axis
        self._check_axis(axis)
        return self.volume.shape[1 + AXES[axis]]

    def _check_axis(self, axis) -> None:
        if axis not in AXES:
            raise ValueError(f"axis must be one of {list(AXES)}, got {axis!r}")

    def _check_index(self, axis: str, index) -> None:
        n = self.size(axis)
        if not (isinstance(index, (int, np.integer)) and not isinstance(index, bool) and 0 <= index < n):
            raise ValueError(f"{axis} slice index must be an int in [0, {n - 1}], got {index!r}")

    def _check_channel(self, channel) -> None:
        n = self.volume.shape[0]
        if not (isinstance(channel, (int, np.integer)) and not isinstance(channel, bool) and 0 <= channel < n):
            raise ValueError(f"channel must be an int in [0, {n - 1}], got {channel!r}")

    @property
    def axis(self) -> str:
        return self._axis

    @axis.setter
    def axis(self, value: str) -> None:
        self._check_axis(value)
        if value != self._axis:
            # Keep the relative position along the new axis.
            pos = self._index / max(1, self.size() - 1)
            self._axis = value
            self._index = int(round(pos * (self.size() - 1)))
        self._changed()

    @property
    def index(self) -> int:
        return self._index

    @index.setter
    def index(self, value: int) -> None:
        self._check_index(self._axis, value)
        self._index = int(value)
        self._changed()

    @property
    def channel(self) -> int:
        return self._channel

    @channel.setter
    def channel(self, value: int) -> None:
        self._check_channel(value)
        self._channel = int(value)
        self._changed()

    @property
    def overlay(self) -> bool:
        """Whether the label map is drawn (always False without one)."""
        return self._overlay

    @overlay.setter
    def overlay(self, value: bool) -> None:
        if value and self.labels is None:
            raise ValueError("this viewer has no label map to overlay")
        self._overlay = bool(value)
        self._changed()

    def caption(self) -> str:
        parts = [self.title] if self.title else []
        parts.append(f"{self._axis} slice {self._index} of {self.size() - 1}")
        if self.volume.shape[0] > 1:
            parts.append(self.channel_names[self._channel])
        if self._overlay:
            present = [int(v) for v in np.unique(self.slice_labels()) if v > 0]
            parts.append("labels here: " + (", ".join(map(str, present)) or "none"))
        return " | ".join(parts)

    # -- rendering -----------------------------------------------------------------------------------

    def _take(self, array: np.ndarray, axis: str, index: int) -> np.ndarray:
        return _orient(np.take(array, index, axis=AXES[axis]))

    def _where(self, axis, index) -> tuple[str, int]:
        axis = self._axis if axis is None else axis
        self._check_axis(axis)
        index = (self._index if axis == self._axis else self.size(axis) // 2) if index is None else index
        self._check_index(axis, index)
        return axis, int(index)

    def slice_image(self, *, axis: str | None = None, index: int | None = None, channel: int | None = None) -> np.ndarray:
        """The 2-D slice on show (or the one named), oriented as drawn, in the volume's units."""
        axis, index = self._where(axis, index)
        channel = self._channel if channel is None else channel
        self._check_channel(channel)
        return self._take(self.volume[channel], axis, index)

    def slice_labels(self, *, axis: str | None = None, index: int | None = None) -> np.ndarray:
        if self.labels is None:
            raise ValueError("this viewer has no label map")
        axis, index = self._where(axis, index)
        return self._take(self.labels, axis, index)

    def rgb(self, *, axis: str | None = None, index: int | None = None, channel: int | None = None,
            overlay: bool | None = None) -> np.ndarray:
        """(h, w, 3) uint8: the slice in grey (window: the channel's range unless given), labels blended in."""
        c = self._channel if channel is None else channel
        plane = self.slice_image(axis=axis, index=index, channel=c)
        lo, hi = self.window or (float(self.volume[c].min()), float(self.volume[c].max()))
        grey = np.clip((plane - lo) / (hi - lo), 0, 1) if hi > lo else np.zeros_like(plane)
        rgb = np.repeat(grey[..., None] * 255.0, 3, axis=-1)
        if overlay and self.labels is None:
            raise ValueError("this viewer has no label map to overlay")
        if self._overlay if overlay is None else overlay:
            lab = self.slice_labels(axis=axis, index=index)
            colors = np.array(LABEL_COLORS, dtype=np.float32)[(lab - 1) % len(LABEL_COLORS)]
            rgb = np.where((lab > 0)[..., None], (1 - self.alpha) * rgb + self.alpha * colors, rgb)
        rgb = np.repeat(np.repeat(rgb, self.zoom, axis=0), self.zoom, axis=1)
        return np.clip(np.round(rgb), 0, 255).astype(np.uint8)

    def png(self, **kwargs) -> bytes:
        """PNG bytes of `rgb` (the slice on show unless axis / index / channel / overlay are given)."""
        return png_bytes(self.rgb(**kwargs))

    # -- widgets -------------------------------------------------------------------------------------

    @property
    def widget(self) -> widgets.VBox:
        """View buttons, channel dropdown, label-map checkbox, slice slider, the image and its caption."""
        if self._box is None:
            self._axis_w = widgets.ToggleButtons(options=list(AXES), value=self._axis, description="view")
            self._index_w = widgets.IntSlider(value=self._index, min=0, max=self.size() - 1, description="slice")
            self._channel_w = widgets.Dropdown(options=[(nm, c) for c, nm in enumerate(self.channel_names)],
                                               value=self._channel, description="channel")
            self._labels_w = widgets.Checkbox(value=self._overlay, description="label map",
                                              disabled=self.labels is None)
            self._image_w = widgets.Image(format="png")
            self._caption_w = widgets.HTML()
            self._draw()
            for w, attr in ((self._axis_w, "axis"), (self._index_w, "index"), (self._channel_w, "channel"),
                            (self._labels_w, "overlay")):
                w.observe(lambda change, attr=attr: self._from_widget(attr, change["new"]), names="value")
            controls = [self._axis_w] + ([self._channel_w] if self.volume.shape[0] > 1 else []) + (
                [self._labels_w] if self.labels is not None else [])
            self._box = widgets.VBox([widgets.HBox(controls), self._index_w, self._image_w, self._caption_w])
        return self._box

    @property
    def axis_widget(self) -> widgets.ToggleButtons:
        self.widget
        return self._axis_w

    @property
    def index_widget(self) -> widgets.IntSlider:
        self.widget
        return self._index_w

    @property
    def channel_widget(self) -> widgets.Dropdown:
        self.widget
        return self._channel_w

    @property
    def labels_widget(self) -> widgets.Checkbox:
        self.widget
        return self._labels_w

    @property
    def image(self) -> widgets.Image:
        self.widget
        return self._image_w

    def _caption_html(self) -> str:
        import html

        return f"<code>{html.escape(self.caption())}</code>"

    def _from_widget(self, attr: str, value) -> None:
        if not self._syncing:
            setattr(self, attr, value)

    def _changed(self) -> None:
        """Bring the widgets (if built) to the state, then redraw once."""
        if self._box is None:
            return
        self._syncing = True
        try:
            self._axis_w.value = self._axis
            self._index_w.max = self.size() - 1
            self._index_w.value = self._index
            self._channel_w.value = self._channel
            self._labels_w.value = self._overlay
        finally:
            self._syncing = False
        self._draw()

    def _draw(self) -> None:
        rgb = self.rgb()
        self._image_w.value = png_bytes(rgb)
        self._image_w.width = str(rgb.shape[1])  # pixels as drawn, not stretched to the output's width
        self._caption_w.value = self._caption_html()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
