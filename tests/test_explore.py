"""The JupyterLab explorers, driven from Python through their widgets: the slice viewer shows the slice
its controls name (and refuses bad input in one line), the data explorer's chart follows its dropdowns."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from medddpm import report
from medddpm.report import charts
from medddpm.train.data import one_hot_condition
from medddpm.report.explore import AXES, LABEL_COLORS, DataExplorer, SliceViewer, labels_from_condition
from medddpm.train.sampling import write_nifti

REPO = Path(__file__).resolve().parents[1]
D, H, W = 6, 8, 10  # distinct sizes: a view showing the wrong axis has the wrong shape


def volume_and_labels(channels: int = 2):
    rng = np.random.default_rng(0)
    vol = rng.normal(size=(channels, D, H, W)).astype(np.float32)
    labels = rng.integers(0, 4, size=(D, H, W))
    return vol, labels


def decoded(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(bytes(png))).convert("RGB"))


def shown(viewer: SliceViewer) -> np.ndarray:
    """What the image widget holds, decoded."""
    return decoded(viewer.image.value)


def test_slice_viewer_widgets_change_the_displayed_slice():
    vol, labels = volume_and_labels()
    v = SliceViewer(vol, labels=labels, zoom=2)
    v.widget  # build the controls, as displaying the viewer in JupyterLab does
    z = v.zoom
    assert v.axis == "axial" and v.index == W // 2
    first = shown(v)
    assert first.shape == (H * z, D * z, 3)  # axial: the last axis is fixed, (D, H) drawn with H up the screen
    np.testing.assert_array_equal(first, v.rgb())

    v.axis_widget.value = "coronal"
    assert v.axis == "coronal" and v.index_widget.max == H - 1 and v.index == v.index_widget.value
    coronal = shown(v)
    assert coronal.shape == (W * z, D * z, 3)
    np.testing.assert_array_equal(v.slice_image(), np.flipud(vol[0, :, v.index, :].T))

    v.index_widget.value = 1
    assert v.index == 1
    moved = shown(v)
    assert not np.array_equal(moved, coronal)
    np.testing.assert_array_equal(moved, v.rgb(axis="coronal", index=1))
    np.testing.assert_array_equal(v.slice_labels(), np.flipud(labels[:, 1, :].T))

    v.channel_widget.value = 1
    other = shown(v)
    assert not np.array_equal(other, moved)
    np.testing.assert_array_equal(v.slice_image(), np.flipud(vol[1, :, 1, :].T))

    # The overlay colours exactly the labelled voxels; off, the slice is grey.
    colored = ~((other[..., 0] == other[..., 1]) & (other[..., 1] == other[..., 2]))
    lab = np.repeat(np.repeat(v.slice_labels(), z, axis=0), z, axis=1)
    assert not colored[lab == 0].any() and colored[lab > 0].all()
    v.labels_widget.value = False
    grey = shown(v)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    assert "coronal slice 1 of 7" in v.caption()

    # Setting the state from Python moves the widgets too.
    v.axis = "sagittal"
    assert v.axis_widget.value == "sagittal" and v.index_widget.max == D - 1
    assert shown(v).shape == (W * z, H * z, 3)


def test_slice_viewer_keeps_the_relative_position_and_colours_labels():
    vol, labels = volume_and_labels(channels=1)
    v = SliceViewer(vol[0], labels=labels, axis="sagittal", index=D - 1, zoom=1, alpha=1.0)
    v.axis = "axial"
    assert v.index == W - 1  # the last slice stays the last
    rgb, lab = v.rgb(), v.slice_labels()
    k = int(lab[lab > 0].flat[0])
    where = np.argwhere(lab == k)[0]
    assert tuple(rgb[tuple(where)]) == LABEL_COLORS[k - 1]  # alpha 1: the label's own colour


@pytest.mark.parametrize("volume, kwargs, message", [
    (np.zeros((4, 4)), {}, "volume must be (C, D, H, W) or (D, H, W), got shape (4, 4)"),
    (np.zeros((1, 2, 4, 4, 4)), {}, "volume must be (C, D, H, W) or (D, H, W)"),
    (np.full((4, 4, 4), np.nan), {}, "volume contains NaN or inf"),
    (np.zeros((4, 4, 4)), {"labels": np.zeros((4, 4, 5), int)}, "labels shape (4, 4, 5) does not match the volume's"),
    (np.zeros((4, 4, 4)), {"labels": np.zeros((3, 4, 4, 4))}, "use labels_from_condition"),
    (np.zeros((4, 4, 4)), {"labels": np.full((4, 4, 4), 0.5)}, "labels must be integers"),
    (np.zeros((4, 4, 4)), {"labels": -np.ones((4, 4, 4), int)}, "labels must be >= 0"),
    (np.zeros((4, 4, 4)), {"axis": "transverse"}, "axis must be one of"),
    (np.zeros((4, 4, 4)), {"index": 4}, "axial slice index must be an int in [0, 3], got 4"),
    (np.zeros((2, 4, 4, 4)), {"channel": 2}, "channel must be an int in [0, 1]"),
    (np.zeros((4, 4, 4)), {"alpha": 2}, "alpha must be in [0, 1]"),
])
def test_slice_viewer_rejects_bad_input_in_one_line(volume, kwargs, message):
    with pytest.raises((ValueError, TypeError)) as e:
        SliceViewer(volume, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_slice_viewer_rejects_bad_state():
    v = SliceViewer(np.zeros((4, 4, 4)))
    with pytest.raises(ValueError, match="slice index must be an int in"):
        v.index = 9
    with pytest.raises(ValueError, match="no label map"):
        v.overlay = True
    with pytest.raises(ValueError, match="axis must be one of"):
        v.axis = "z"
    assert v.index == 2 and v.axis == "axial"  # a refused change changes nothing


def test_training_pairs_and_generated_samples(tiny_spec, tmp_path):
    from conftest import Pairs

    pairs = Pairs(tiny_spec, n=2)
    v = SliceViewer.from_pair(pairs, 1)
    image, cond = pairs[1]
    np.testing.assert_array_equal(one_hot_condition(v.labels, num_classes=tiny_spec.mask_channels), cond)
    np.testing.assert_array_equal(v.volume, image.numpy())
    assert v.title == "training pair 1"

    # What `python -m medddpm sample` writes: image/ and mask/ NIfTI files.
    sample = np.random.default_rng(1).normal(size=(1, 8, 8, 8)).astype(np.float32)
    labels = labels_from_condition(cond[:, :8, :8, :8])
    write_nifti(tmp_path / "image" / "sample_000.nii.gz", sample[0])
    write_nifti(tmp_path / "mask" / "sample_000.nii.gz", labels.astype(np.uint8))
    s = SliceViewer.from_files(tmp_path / "image" / "sample_000.nii.gz", labels=tmp_path / "mask" / "sample_000.nii.gz")
    np.testing.assert_allclose(s.volume, sample)
    np.testing.assert_array_equal(s.labels, labels)
    two = np.concatenate([sample, -sample])
    write_nifti(tmp_path / "two.nii.gz", two)  # channels go last in the file and come back first
    np.testing.assert_allclose(SliceViewer.from_files(tmp_path / "two.nii.gz").volume, two)
    with pytest.raises(FileNotFoundError, match="no such file"):
        SliceViewer.from_files(tmp_path / "missing.nii.gz")


# ------------------------------------------------------------------------------------ data explorer


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """Two CPU runs of the committed data, and a GPU run (a third CPU run renamed) carrying the
    committed Nsight Compute counters of a real GPU."""
    from medddpm.store.schema import read_table, write_table

    root = tmp_path_factory.mktemp("data")
    configs = sorted(p.parent.name for p in (REPO / "data" / "cpu").glob("*/run.parquet"))
    assert len(configs) >= 3, "the committed CPU data has fewer than three runs"
    for config in configs[:2]:
        shutil.copytree(REPO / "data" / "cpu" / config, root / "cpu" / config)
    gpu = root / "gpu-x" / configs[2]  # a configuration the CPU here lacks: its own kernels
    shutil.copytree(REPO / "data" / "cpu" / configs[2], gpu)
    for path in gpu.glob("*.parquet"):
        df = read_table(path)
        df["run_id"] = df["run_id"].str.replace("cpu/", "gpu-x/", n=1, regex=False)
        if "gpu_slug" in df:
            df["gpu_slug"], df["gpu_name"] = "gpu-x", "GPU X"
        write_table(df, path, path.stem)
    run_id = read_table(gpu / "run.parquet")["run_id"].iloc[0]
    write_table(committed_stall_counters().assign(run_id=run_id), gpu / "ncu.parquet", "ncu")
    return root


def committed_stall_counters():
    """The first committed ncu.parquet that holds warp-stall counters (a real GPU's)."""
    from medddpm.analysis import ncu_table
    from medddpm.store.schema import read_table

    stall = ncu_table._stall_metric(ncu_table.STALL_REASONS[0])
    for path in sorted(REPO.glob("data/*/*/ncu.parquet")):
        df = read_table(path, "ncu")
        if (df["metric"] == stall).any():
            return df
    raise AssertionError("no committed data/<gpu>/<config>/ncu.parquet holds warp-stall counters")


def spec_data(chart) -> list:
    """The rows a Vega-Lite spec draws (Altair puts them in `datasets`)."""
    return [row for rows in chart.get("datasets", {}).values() for row in rows]


def test_data_explorer_dropdowns_change_the_chart(data_root):
    e = DataExplorer(root=data_root, top=5)
    assert e.gpu == "gpu-x"  # a GPU before the CPU
    e.widget  # dropdowns and the JupyterChart, as JupyterLab shows them
    assert list(e.gpu_widget.options) == ["cpu", "gpu-x"]

    before = e.chart_widget.spec
    e.gpu_widget.value = "cpu"
    assert e.gpu == "cpu" and list(e.config_widget.options) == e.configs("cpu") and len(e.configs("cpu")) == 2
    cpu_first = e.chart_widget.spec
    assert spec_data(cpu_first) != spec_data(before)
    assert len(spec_data(cpu_first)) == 5 == len(e.frame())

    e.config_widget.value = e.configs()[1]
    assert e.config == e.configs()[1] and spec_data(e.chart_widget.spec) != spec_data(cpu_first)

    cats = [c for c in e.category_widget.options if c != "all"]
    e.category_widget.value = cats[-1]
    rows = spec_data(e.chart_widget.spec)
    assert rows and {r["category"] for r in rows} == {cats[-1]}

    e.view_widget.value = "categories"
    assert {r["config"] for r in spec_data(e.chart_widget.spec)} == set(e.configs())
    e.view_widget.value = "step time"
    assert {r["config"] for r in spec_data(e.chart_widget.spec)} == set(e.configs())
    e.view_widget.value = "stalls"  # the CPU has no counters: the chart says so
    assert e.frame().empty and "no Nsight Compute counters" in str(e.chart_widget.spec)

    e.gpu_widget.value = "gpu-x"
    e.category_widget.value = "all"
    stalls = e.frame()
    assert len(stalls) > 3 and stalls["cycles"].is_monotonic_decreasing and (stalls["cycles"] >= 0).all()
    drawn = {r["reason"] for r in spec_data(e.chart_widget.spec)}
    assert drawn == set(stalls.loc[stalls["cycles"] >= 0.01, "reason"]) and stalls["reason"].iloc[0] in drawn


def test_data_explorer_state_and_bad_input(data_root, tmp_path):
    data = report.load_all(data_root)
    e = DataExplorer(data, gpu="cpu", view="step time", width=400)
    assert e.chart().to_dict()["width"] == 400
    with pytest.raises(ValueError, match=r"gpu must be one of \['cpu', 'gpu-x'\]"):
        e.gpu = "nvidia-z100"
    with pytest.raises(ValueError, match="config must be one of"):
        e.config = "no-such-config"
    with pytest.raises(ValueError, match="view must be one of"):
        e.view = "pie"
    with pytest.raises(ValueError, match="category must be one of"):
        e.category = "quantum"
    assert (e.gpu, e.view) == ("cpu", "step time")
    with pytest.raises(ValueError, match="give data or root, not both"):
        DataExplorer(data, root=data_root)
    with pytest.raises(ValueError, match="top must be a positive int"):
        DataExplorer(data, top=0)
    with pytest.raises(ValueError, match="no finished runs"):
        DataExplorer(root=tmp_path)  # an empty data tree


def test_charts_render_offline_widgets_in_a_live_notebook(monkeypatch):
    import altair as alt

    monkeypatch.setenv("JPY_SESSION_NAME", "explorers.ipynb")
    charts.setup()
    try:
        assert alt.renderers.active == "jupyter" and alt.renderers.options == {"offline": True}
        # Drawing a chart is what switches JupyterChart to vl-convert's bundle (altair's jupyter_renderer);
        # the online bundle imports vega-embed from esm.sh, the offline one imports nothing.
        alt.Chart(pd.DataFrame({"x": [1]})).mark_point().encode(x="x")._repr_mimebundle_()
        assert alt.JupyterChart._is_offline and "esm.sh" not in alt.JupyterChart._esm
    finally:
        monkeypatch.delenv("JPY_SESSION_NAME")
        charts.setup()
    assert alt.renderers.active == "default"


@pytest.mark.slow
def test_jupyterlab_sh_opens_pages_as_notebooks(tmp_path):
    """scripts/jupyterlab.sh (what the explorers page tells readers to run): pages become valid notebooks, the
    live-widget cells keep their tag, an edited notebook is kept, and the JupyterLab it starts is there."""
    import os
    import subprocess
    import sys

    import nbformat

    env = dict(os.environ, JUPYTERLAB_SKIP_SETUP="1", JUPYTERLAB_CONVERT_ONLY="1", JUPYTERLAB_OUT=str(tmp_path))

    def lab(*args):
        return subprocess.run(["bash", "scripts/jupyterlab.sh", *args], cwd=REPO, env=env, capture_output=True, text=True)

    proc = lab("book/explorers.md", "book/workshop.md", "--", "--no-browser")
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip().splitlines()[-1]
    assert "MEDDDPM_LAB=1" in command and f"jupyter lab {tmp_path}/explorers.ipynb --no-browser" in command
    for name in ("explorers", "workshop"):
        nb = nbformat.read(tmp_path / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        assert sum(c.cell_type == "code" for c in nb.cells) > 3
    tags = [c.metadata.get("tags", []) for c in nbformat.read(tmp_path / "explorers.ipynb", as_version=4).cells]
    assert ["skip-execution"] in tags  # the cells that show live widgets: skipped by the book, run in JupyterLab

    edited = tmp_path / "workshop.ipynb"
    edited.write_text(edited.read_text() + "\n")
    assert "keeping" in lab("book/workshop.md").stdout and edited.read_text().endswith("\n\n")
    assert lab("book/nope.md").returncode == 2 and lab("README.md").returncode == 2
    jupyter = Path(sys.executable).parent / "jupyter"
    assert subprocess.run([str(jupyter), "lab", "--version"], capture_output=True).returncode == 0
