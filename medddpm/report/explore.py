"""JupyterLab explorers (ipywidgets): a slice viewer for volumes and their label maps, and an explorer
over the measurements under ``data/``.

`SliceViewer` shows one slice of a volume, (C, D, H, W) or (D, H, W), with an optional integer label
map (D, H, W) drawn over it in colour: toggle buttons pick the view (sagittal / coronal / axial), a
slider the slice, a dropdown the channel. It takes training pairs (`SliceViewer.from_pair` on
`medddpm.data.open_dataset`) and generated samples (`SliceViewer.from_files` on what
``python -m medddpm sample`` writes). Axes are taken as the embedded MNI pairs store them (RAS voxel
order: axis 0 left-right, 1 posterior-anterior, 2 inferior-superior); other NIfTI files are shown
in their own voxel order.

`DataExplorer` puts dropdowns for GPU, configuration, kernel category and view over the tables
`medddpm.report` reads, and draws the chosen view as an Altair chart. In JupyterLab the chart is an
`altair.JupyterChart` whose JavaScript comes from vl-convert (``offline=True``): nothing is fetched
from a CDN. ipywidgets need a kernel; in a static page use `SliceViewer.png` and
`DataExplorer.chart` for a still.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import altair as alt
import ipywidgets as widgets
import numpy as np
import pandas as pd

from medddpm import report as bd

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


# ------------------------------------------------------------------------------------ data explorer

ALL = "all"
_WIDE = {"description_width": "initial"}  # whole descriptions, not "configurat..."
VIEWS = {
    "kernels": "largest kernels of the configuration (in the category)",
    "categories": "share of the category in each configuration",
    "step time": "median micro-step time of each configuration",
    "stalls": "warp stall reasons of the category's profiled kernels (Nsight Compute)",
}


def _category_of(names: pd.Series) -> pd.Series:
    from medddpm.measure.kernels import categorize

    return names.map({n: categorize(n) for n in names.unique()})


class DataExplorer:
    """Dropdowns over the measurements (`medddpm.report.Data`): GPU, configuration, kernel category,
    and what to show; `chart()` draws the choice and `frame()` is its data. The choice can be set from
    Python (`gpu`, `config`, `category`, `view`) or with the widgets, built on first use (`widget`, or
    displaying the explorer in JupyterLab), where an `altair.JupyterChart` follows the dropdowns."""

    def __init__(self, data: bd.Data | None = None, *, root: str | os.PathLike | None = None, gpu: str | None = None,
                 config: str | None = None, category: str = ALL, view: str = "kernels", top: int = 15,
                 width: int | str = "container", offline: bool = True):
        from medddpm.report.charts import _default_gpu

        if data is not None and root is not None:
            raise ValueError("give data or root, not both")
        self.data = data if data is not None else bd.load_all(root)
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}")
        if not (width == "container" or isinstance(width, int) and not isinstance(width, bool) and width > 0):
            raise ValueError(f"width must be a positive int or 'container', got {width!r}")
        self.top, self.width, self.offline = top, width, offline
        k = self.data.kernels
        self.kernels = k.assign(us_per_step=k["total_us"] / k["steps"].clip(lower=1),
                                calls_per_step=k["calls"] / k["steps"].clip(lower=1))
        # step_summary needs at least one finished run (its arithmetic on an empty table has no dtypes)
        self.summary = (bd.step_summary(self.data.run) if len(self.data.ok) else
                        pd.DataFrame(columns=["gpu_slug", "config", "precision_used", "train_median_ms",
                                              "train_p10_ms", "train_p90_ms", "speedup"]))
        self.ncu = self._ncu_with_categories()
        self.gpus = sorted(set(self.kernels["gpu_slug"]) | set(self.summary["gpu_slug"]))
        if not self.gpus:
            raise ValueError(f"no finished runs in the data ({bd.data_root() if root is None else root})")
        self._gpu = self._config = None
        self._category, self._view = ALL, "kernels"
        self._box = self._chart_widget = None
        self._syncing = False
        self.gpu = gpu if gpu is not None else _default_gpu(self.gpus)
        if config is not None:
            self.config = config
        self.category = category
        self.view = view

    # -- options and state ---------------------------------------------------------------------------

    def _ncu_with_categories(self) -> pd.DataFrame:
        k = bd.ncu_kernels(self.data.ncu)
        return k.assign(category=_category_of(k["kernel"])) if len(k) else k.assign(category=pd.Series(dtype="str"))

    def configs(self, gpu: str | None = None) -> list[str]:
        """Configurations with kernels or timings on a GPU, in the book's order."""
        gpu = gpu or self._gpu
        present = (set(self.kernels.loc[self.kernels["gpu_slug"] == gpu, "config"])
                   | set(self.summary.loc[self.summary["gpu_slug"] == gpu, "config"]))
        return [c for c in bd.config_order(present) if c in present]

    def categories(self, gpu: str | None = None, config: str | None = None) -> list[str]:
        """'all', then the kernel categories profiled in one run."""
        from medddpm.report.charts import CATEGORIES

        gpu, config = gpu or self._gpu, config or self._config
        k = self.kernels[(self.kernels["gpu_slug"] == gpu) & (self.kernels["config"] == config)]
        present = set(k["category"])
        return [ALL] + [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))

    @property
    def gpu(self) -> str:
        return self._gpu

    @gpu.setter
    def gpu(self, value: str) -> None:
        if value not in self.gpus:
            raise ValueError(f"gpu must be one of {self.gpus}, got {value!r}")
        self._gpu = value
        configs = self.configs(value)
        if self._config not in configs:  # keep the configuration where the new GPU has it
            self._config = configs[0]
        if self._category not in self.categories():
            self._category = ALL
        self._changed()

    @property
    def config(self) -> str:
        return self._config

    @config.setter
    def config(self, value: str) -> None:
        configs = self.configs()
        if value not in configs:
            raise ValueError(f"config must be one of {configs} on {self._gpu}, got {value!r}")
        self._config = value
        if self._category not in self.categories():
            self._category = ALL
        self._changed()

    @property
    def category(self) -> str:
        return self._category

    @category.setter
    def category(self, value: str) -> None:
        options = self.categories()
        if value not in options:
            raise ValueError(f"category must be one of {options} for {self._gpu} / {self._config}, got {value!r}")
        self._category = value
        self._changed()

    @property
    def view(self) -> str:
        return self._view

    @view.setter
    def view(self, value: str) -> None:
        if value not in VIEWS:
            raise ValueError(f"view must be one of {list(VIEWS)}, got {value!r}")
        self._view = value
        self._changed()

    # -- data and chart ------------------------------------------------------------------------------

    def frame(self) -> pd.DataFrame:
        """The rows the current chart draws."""
        gpu, config, cat, view = self.gpu, self.config, self.category, self.view
        k = self.kernels[self.kernels["gpu_slug"] == gpu]
        if view == "kernels":
            k = k[k["config"] == config]
            if cat != ALL:
                k = k[k["category"] == cat]
            g = (k.groupby("kernel", as_index=False)
                 .agg(short_name=("short_name", "first"), category=("category", "first"),
                      passes=("pass", lambda s: ", ".join(sorted(set(s)))), calls_per_step=("calls_per_step", "sum"),
                      us_per_step=("us_per_step", "sum"), share=("share", "sum"), tensor_cores=("tensor_cores", "any")))
            g = g.sort_values("us_per_step", ascending=False).head(self.top).reset_index(drop=True)
            g["rank"] = np.arange(1, len(g) + 1)
            return g
        if view == "categories":
            s = bd.category_shares(k)
            return s if cat == ALL else s[s["category"] == cat].reset_index(drop=True)
        if view == "step time":
            return self.summary[self.summary["gpu_slug"] == gpu][
                ["gpu_slug", "config", "precision_used", "train_median_ms", "train_p10_ms", "train_p90_ms",
                 "speedup"]].reset_index(drop=True)
        # stalls: duration-weighted over the profiled launches of the category
        n = self.ncu[(self.ncu["gpu_slug"] == gpu) & (self.ncu["config"] == config)]
        if cat != ALL:
            n = n[n["category"] == cat]
        stall_cols = [c for c in n.columns if c.startswith("stall_")]
        rows = []
        w = n["duration_ns"].fillna(0) if len(n) else pd.Series(dtype=float)
        for c in stall_cols:
            m = n[c].notna() & (w > 0)
            if m.any():
                rows.append({"reason": c.removeprefix("stall_"), "cycles": float(np.average(n.loc[m, c], weights=w[m])),
                             "kernels": int(m.sum())})
        out = pd.DataFrame(rows, columns=["reason", "cycles", "kernels"])
        return out.sort_values("cycles", ascending=False).reset_index(drop=True)

    def chart(self) -> alt.TopLevelMixin:
        """The current view as an Altair chart (says why when there is nothing to draw)."""
        from medddpm.report import charts

        df, gpu, config, cat, view = self.frame(), self.gpu, self.config, self.category, self.view
        where = f"{gpu} / {config}" + ("" if cat == ALL else f" / {cat}")
        if df.empty:
            why = {"stalls": "no Nsight Compute counters", "step time": "no finished timing"}.get(view, "no kernels")
            return charts._empty(f"{why} for {where if view != 'step time' else gpu}").properties(width=self.width)
        df = charts._light(df)
        if view == "kernels":
            df["label"] = df["rank"].astype(str).str.rjust(2) + ". " + df["short_name"].str.slice(0, 48)
            df["kernel"] = df["kernel"].str.slice(0, 240)
            return alt.Chart(df).mark_bar().encode(
                y=alt.Y("label:N", sort=alt.EncodingSortField("rank", order="ascending"), title=None),
                x=alt.X("us_per_step:Q", title="device time per step (µs)"),
                color=alt.Color("category:N", scale=charts.category_color(),
                                legend=alt.Legend(values=sorted(set(df["category"])), title="category")),
                tooltip=["kernel:N", "category:N", alt.Tooltip("passes:N", title="pass"),
                         alt.Tooltip("calls_per_step:Q", format=".3g"), alt.Tooltip("us_per_step:Q", format=",.0f"),
                         alt.Tooltip("share:Q", title="share of step", format=".1%"), "tensor_cores:N"],
            ).properties(width=self.width, height=alt.Step(18), title=f"Largest kernels: {where}")
        if view == "categories":
            highlight = alt.condition(alt.datum.config == config, alt.value(1.0), alt.value(0.45))
            return alt.Chart(df).mark_bar().encode(
                y=alt.Y("config:N", sort=charts._configs_in(df), title=None),
                x=alt.X("share:Q", axis=alt.Axis(format="%"), title="share of profiled kernel time",
                        scale=alt.Scale(domain=[0, 1]) if cat == ALL else alt.Undefined),
                color=alt.Color("category:N", scale=charts.category_color(),
                                legend=alt.Legend(values=sorted(set(df["category"])), title="category")),
                opacity=highlight,
                tooltip=["config:N", "category:N", alt.Tooltip("share:Q", format=".1%"),
                         alt.Tooltip("us_per_step:Q", title="µs per step", format=",.0f")],
            ).properties(width=self.width, height=alt.Step(22), title=f"Kernel time by category on {gpu}"
                         + ("" if cat == ALL else f": {cat}"))
        if view == "step time":
            highlight = alt.condition(alt.datum.config == config, alt.value(1.0), alt.value(0.45))
            y = alt.Y("config:N", sort=charts._configs_in(df), title=None)
            bars = alt.Chart(df).mark_bar().encode(
                y=y, x=alt.X("train_median_ms:Q", title="median micro-step time (ms); whisker p10-p90"),
                color=alt.Color("config:N", scale=charts.config_color(df["config"]), legend=None), opacity=highlight,
                tooltip=["config:N", "precision_used:N", alt.Tooltip("train_median_ms:Q", format=".4g"),
                         alt.Tooltip("speedup:Q", title="speedup vs baseline", format=".2f")])
            spread = alt.Chart(df).mark_rule(color="black").encode(y=y, x="train_p10_ms:Q", x2="train_p90_ms:Q")
            return alt.layer(bars, spread).properties(width=self.width, height=alt.Step(22), title=f"Step time on {gpu}")
        df = df[df["cycles"] >= 0.01]  # reasons that never occur only crowd the axis
        return alt.Chart(df).mark_bar().encode(
            y=alt.Y("reason:N", sort="-x", title=None),
            x=alt.X("cycles:Q", title="stall cycles per issued instruction (duration-weighted)"),
            tooltip=["reason:N", alt.Tooltip("cycles:Q", format=".3g"),
                     alt.Tooltip("kernels:Q", title="profiled launches")],
        ).properties(width=self.width, height=alt.Step(18), title=f"Why warps wait: {where}")

    # -- widgets -------------------------------------------------------------------------------------

    @property
    def widget(self) -> widgets.VBox:
        """Dropdowns above an `altair.JupyterChart`; with ``offline=True`` its JavaScript comes from
        vl-convert (`altair.JupyterChart.enable_offline`), not from a CDN."""
        if self._box is None:
            if self.offline:
                alt.JupyterChart.enable_offline()
            self.gpu_widget = widgets.Dropdown(options=self.gpus, value=self._gpu, description="GPU", style=_WIDE)
            self.config_widget = widgets.Dropdown(options=self.configs(), value=self._config,
                                                  description="configuration", style=_WIDE)
            self.category_widget = widgets.Dropdown(options=self.categories(), value=self._category,
                                                    description="category", style=_WIDE)
            self.view_widget = widgets.Dropdown(options=[(f"{k}: {v}", k) for k, v in VIEWS.items()],
                                                value=self._view, description="show", style=_WIDE,
                                                layout=widgets.Layout(width="36em"))
            for w, attr in ((self.gpu_widget, "gpu"), (self.config_widget, "config"),
                            (self.category_widget, "category"), (self.view_widget, "view")):
                w.observe(lambda change, attr=attr: self._from_widget(attr, change["new"]), names="value")
            self._chart_widget = alt.JupyterChart(self.chart())
            self._box = widgets.VBox([widgets.HBox([self.gpu_widget, self.config_widget]),
                                      widgets.HBox([self.category_widget, self.view_widget]), self._chart_widget])
        return self._box

    @property
    def chart_widget(self) -> alt.JupyterChart:
        self.widget
        return self._chart_widget

    def _from_widget(self, attr: str, value) -> None:
        if not self._syncing:
            setattr(self, attr, value)

    def _changed(self) -> None:
        """Bring the dropdowns (if built) to the state and its options, then redraw once."""
        if self._box is None:
            return
        self._syncing = True
        try:
            self.gpu_widget.value = self._gpu
            self.config_widget.options = self.configs()
            self.config_widget.value = self._config
            self.category_widget.options = self.categories()
            self.category_widget.value = self._category
            self.view_widget.value = self._view
        finally:
            self._syncing = False
        self._chart_widget.chart = self.chart()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
