"""Tables for the pages: HTML that fits the book's column, GPUs first, the CPU's smoke rows folded apart.

A page's text column is about 784 px wide. A table shows its key columns; the rest, and the rows of a CPU run
(the smoke preset, which checks the pipeline and says nothing about GPUs), go into a fold the reader opens:
an HTML ``<details>`` element, which needs no script and reads the same offline and in JupyterLab.
"""

from __future__ import annotations

import html

import pandas as pd
from IPython.display import HTML

from medddpm.report.loading import cpu_slugs, is_cpu


DEVICE_COLUMNS = ("device", "GPU", "gpu_slug", "measured on", "card")
LONG_TEXT = 30  # characters: a longer word of a cell's text may break inside itself
VENDORS = ("NVIDIA ", "AMD ", "Intel ")  # a device name's maker, left out of its short name


def card_names(run: pd.DataFrame) -> dict[str, str]:
    """A short display name per device label of `run`: its device's name without the maker ("NVIDIA H100 80GB
    HBM3" -> "H100 80GB HBM3"), with the host where the label is `<type>-<host>` (a machine kept beside the
    committed rows of its type: "H200 (lab3)"); a label of the user's own choosing (`--gpu-label`) and a CPU's
    stay as they are. In a narrow column a label such as nvidia-h100-80gb-hbm3 breaks at each hyphen, over four
    lines; its short name breaks between its words, if at all."""
    if run.empty:
        return {}
    names = {}
    for slug, g in run.groupby("gpu_slug"):
        name, kind = str(g["gpu_name"].mode().iloc[0]), str(g["gpu_type"].mode().iloc[0])
        if name == "cpu" or is_cpu(slug):
            names[slug] = slug
            continue
        short = next((name.removeprefix(v) for v in VENDORS if name.startswith(v)), name)
        if slug == kind:
            names[slug] = short
        elif slug.startswith(kind + "-"):
            names[slug] = f"{short} ({slug.removeprefix(kind + '-')})"
        else:
            names[slug] = slug
    return names


def _device_cell(names: dict[str, str]):
    """A device column's cell: its short name (`card_names`) with the label as the hover title, on one line; a
    label without a short name on one line too (a browser breaks it after its hyphens). A short name is short by
    design, and a card's name broken over three lines reads as three cards."""
    def cell(v):  # `v` comes escaped (Styler's escape="html")
        shown = names.get(html.unescape(str(v)))
        if shown is None:
            return f'<span style="white-space: nowrap">{v}</span>'
        return f'<span style="white-space: nowrap" title="{v}">{html.escape(shown)}</span>'
    return cell


def table_html(df: pd.DataFrame, digits: int = 4, formats: dict | None = None, code: tuple[str, ...] = (),
               names: dict[str, str] | None = None, devices: tuple[str, ...] = DEVICE_COLUMNS) -> str:
    """A compact HTML table: no index, cell text escaped (a `<config>` stays text), floats to `digits`
    significant digits unless `formats` says otherwise for a column, NaN as '-'; the columns named in `code`
    set as code (names a reader types). The columns named in `devices` hold device labels, shown by their short
    names where `names` (`card_names`) gives them, and a column headed by a device label gets its short name."""
    names = names or {}
    df = df.rename(columns={c: names[c] for c in df.columns if c in names})
    fmt = {c: (lambda v, d=digits: "-" if pd.isna(v) else f"{v:.{d}g}") for c in df.columns
           if pd.api.types.is_float_dtype(df[c])}
    fmt |= {c: (lambda v: f"<code>{v}</code>") for c in code}  # Styler escapes the value before this
    fmt |= {c: _device_cell(names) for c in df.columns if c in devices and c not in fmt}
    # a long name without spaces (a kernel's C++ signature) may break anywhere rather than widen the table; text of
    # shorter words ("conv3d 64>64 k3 s1 @128x128x128") breaks only between them
    fmt |= {c: (lambda v: f'<span style="overflow-wrap: anywhere">{v}</span>'
                if max(map(len, str(v).split()), default=0) > LONG_TEXT else v)
            for c in df.columns if c not in fmt and (pd.api.types.is_object_dtype(df[c])
                                                     or pd.api.types.is_string_dtype(df[c]))}
    fmt |= formats or {}
    return df.style.hide(axis="index").format(fmt, escape="html", na_rep="-").to_html()


def fold(summary: str, content: str) -> str:
    """`content` (HTML) folded under a one-line `summary` (plain text)."""
    return f'<details class="medddpm-fold"><summary>{html.escape(summary)}</summary>\n{content}\n</details>'


def show(df: pd.DataFrame, **kw) -> HTML:
    """`table_html` for display; `kw` as it takes them."""
    return HTML(table_html(df, **kw))


def show_folded(summary: str, df: pd.DataFrame, **kw) -> HTML:
    return HTML(fold(summary, table_html(df, **kw)))


def cpu_rows(df: pd.DataFrame, cpus: set[str] | None = None, column: str = "gpu_slug") -> pd.Series:
    """Which rows of `df` are a CPU's: their device label is in `cpus` (`loading.cpu_slugs` of the run table),
    or looks like a CPU's."""
    cpus = cpus or set()
    return df[column].map(lambda s: s in cpus or is_cpu(s)).astype(bool)


def by_device(df: pd.DataFrame, cpus: set[str] | None = None, *, column: str = "gpu_slug",
              rename: dict | None = None, what: str = "rows", hide: tuple[str, ...] = (), **kw) -> HTML:
    """The GPUs' rows as a table, then the CPU's folded under "CPU smoke runs (N <what>)"; `hide`: columns left
    out once the rows are split; `kw` as `table_html` takes them. With no GPU rows the CPU's are shown unfolded:
    they are all there is."""
    cpu = cpu_rows(df, cpus, column)
    gpu_df, cpu_df = df[~cpu].drop(columns=list(hide)), df[cpu].drop(columns=list(hide))
    if rename:  # `formats` and `code` may name the columns before or after renaming
        gpu_df, cpu_df = gpu_df.rename(columns=rename), cpu_df.rename(columns=rename)
        if kw.get("formats"):
            kw["formats"] = {rename.get(c, c): f for c, f in kw["formats"].items()}
        if kw.get("code"):
            kw["code"] = tuple(rename.get(c, c) for c in kw["code"])
    if gpu_df.empty:
        return show(cpu_df, **kw)
    out = table_html(gpu_df, **kw)
    if len(cpu_df):
        out += fold(f"CPU smoke runs ({len(cpu_df)} {what}: a tiny model that checks the pipeline)",
                    table_html(cpu_df, **kw))
    return HTML(out)


def gpus_first(slugs) -> list[str]:
    """Device labels, GPUs first (each group sorted)."""
    return sorted(set(slugs), key=lambda s: (is_cpu(s), s))


__all__ = ["DEVICE_COLUMNS", "card_names", "table_html", "fold", "show", "show_folded", "cpu_rows", "by_device",
           "gpus_first", "cpu_slugs"]
