"""An explorer over the measurements under ``data/`` (ipywidgets and Altair).

`DataExplorer` puts dropdowns for GPU, configuration, kernel category and view over the tables
`medddpm.report` reads, and draws the chosen view as an Altair chart. In JupyterLab the chart is an
`altair.JupyterChart` whose JavaScript comes from vl-convert (``offline=True``): nothing is fetched
from a CDN. ipywidgets need a kernel; in a static page use `DataExplorer.chart` for a still.
"""

from __future__ import annotations

import os

import altair as alt
import ipywidgets as widgets
import numpy as np
import pandas as pd

from medddpm import report

ALL = "all"
_WIDE = {"description_width": "initial"}  # whole descriptions, not "configurat..."
VIEWS = {
    "kernels": "largest kernels of the configuration (in the category)",
    "categories": "share of the category in each configuration",
    "step time": "median micro-step time of each configuration",
    "stalls": "warp stall reasons of the category's profiled kernels (Nsight Compute)",
}


def _category_of(names: pd.Series) -> pd.Series:
    from medddpm.analysis.kernels import categorize

    return names.map({n: categorize(n) for n in names.unique()})


class DataExplorer:
    """Dropdowns over the measurements (`medddpm.report.Data`): GPU, configuration, kernel category,
    and what to show; `chart()` draws the choice and `frame()` is its data. The choice can be set from
    Python (`gpu`, `config`, `category`, `view`) or with the widgets, built on first use (`widget`, or
    displaying the explorer in JupyterLab), where an `altair.JupyterChart` follows the dropdowns."""

    def __init__(self, data: report.Data | None = None, *, root: str | os.PathLike | None = None, gpu: str | None = None,
                 config: str | None = None, category: str = ALL, view: str = "kernels", top: int = 15,
                 width: int | str = "container", offline: bool = True):
        from medddpm.report.charts import _default_gpu

        if data is not None and root is not None:
            raise ValueError("give data or root, not both")
        self.data = data if data is not None else report.load_all(root)
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}")
        if not (width == "container" or isinstance(width, int) and not isinstance(width, bool) and width > 0):
            raise ValueError(f"width must be a positive int or 'container', got {width!r}")
        self.top, self.width, self.offline = top, width, offline
        k = self.data.kernels
        self.kernels = k.assign(us_per_step=k["total_us"] / k["micro_steps"].clip(lower=1),
                                calls_per_step=k["calls"] / k["micro_steps"].clip(lower=1))
        # step_summary needs at least one finished run (its arithmetic on an empty table has no dtypes)
        self.summary = (report.step_summary(self.data.run) if len(self.data.ok) else
                        pd.DataFrame(columns=["gpu_slug", "config", "precision_used", "train_median_ms",
                                              "train_p10_ms", "train_p90_ms", "speedup"]))
        self.ncu = self._ncu_with_categories()
        self.gpus = sorted(set(self.kernels["gpu_slug"]) | set(self.summary["gpu_slug"]))
        if not self.gpus:
            raise ValueError(f"no finished runs in the data ({report.data_root() if root is None else root})")
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
        k = report.ncu_kernels(self.data.ncu)
        return k.assign(category=_category_of(k["kernel"])) if len(k) else k.assign(category=pd.Series(dtype="str"))

    def configs(self, gpu: str | None = None) -> list[str]:
        """Configurations with kernels or timings on a GPU, in the book's order."""
        gpu = gpu or self._gpu
        present = (set(self.kernels.loc[self.kernels["gpu_slug"] == gpu, "config"])
                   | set(self.summary.loc[self.summary["gpu_slug"] == gpu, "config"]))
        return [c for c in report.config_order(present) if c in present]

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
            s = report.category_shares(k)
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
