"""Wrong data never trains quietly: an image and its mask on other grids, volumes far from the model's shape,
values that overflow float32, and tables of the wrong types (requests that cannot fit and commands stopped half-way
are `test_reliability_commands`'s).

Each case runs through the command line where one is involved and asserts its exit code, exactly one line on
stderr naming the problem, and files left as they were (no half-written folder); the cases handled rather than
refused assert what was made of them."""

from __future__ import annotations

import gzip
import math
import time
import tracemalloc
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from medddpm.cli.main import main
from medddpm.configs import get_config
from medddpm.measure.run import run_row
from medddpm.report import loading
from medddpm.store import schema
from medddpm.store.schema import read_table, write_table
from medddpm.train import checkpoint
from medddpm.train.data import NiftiPairs
from medddpm.train.nifti import DataError
from medddpm.train.synthetic import make_brats_case
from test_reliability import env  # noqa: F401 - the environment of the run rows written below
from test_reliability_training import PROGRESS, files, two_levels

SHAPE = (16, 16, 16)
AFFINE = np.array([[1.5, 0, 0, -12], [0, 1.5, 0, -14], [0, 0, 1.5, -10], [0, 0, 0, 1.0]])


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One volume cache for the module: the embedded subjects are generated once, not for every test."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _small(monkeypatch, shared_cache):
    two_levels(monkeypatch)
    monkeypatch.setenv("MEDDDPM_CACHE", str(shared_cache))


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own, to show that nothing was decoded or generated into it."""
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def one_line(capsys, start: str = "error: ", *needles) -> str:
    """The one line of stderr (progress bars aside), which starts with `start` and holds every needle."""
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not PROGRESS.match(line)]
    assert len(err) == 1, err
    assert err[0].startswith(start), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


# ------------------------------------------------------------------------ data folders


def _save(path: Path, array: np.ndarray, affine: np.ndarray = AFFINE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.asarray(array), affine), str(path))


def pairs(root: Path, *, image=None, mask=None, mask_affine=AFFINE, image_affine=AFFINE) -> Path:
    """Two image/mask pairs on one grid; `image`, `mask` and the affines replace those of pair 1."""
    rng = np.random.default_rng(0)
    for k in (1, 2):
        mine = k == 1
        img = image if mine and image is not None else (rng.normal(size=SHAPE) * 50 + 500).astype(np.float32)
        lab = mask if mine and mask is not None else rng.integers(0, 4, SHAPE).astype(np.uint8)
        _save(root / "image" / f"img_{k:03d}.nii.gz", img, image_affine if mine else AFFINE)
        _save(root / "mask" / f"mask_{k:03d}.nii.gz", lab, mask_affine if mine else AFFINE)
    return root


def brats(root: Path, *, seg_affine=AFFINE, flair=None, shape=(20, 20, 14)) -> Path:
    """One BraTS-layout case on one grid (`flair` replaces its FLAIR volume)."""
    image, labels = make_brats_case(0, size=shape)
    _save(root / "seg" / "case1_seg.nii.gz", labels.astype(np.int16), seg_affine)
    for k, m in enumerate(("t1", "t1ce", "t2", "flair")):
        volume = flair if m == "flair" and flair is not None else ((image[k] + 1) * 500).astype(np.float32)
        _save(root / m / f"case1_{m}.nii.gz", volume)
    return root


def shifted(dx: float) -> np.ndarray:
    a = AFFINE.copy()
    a[0, 3] += dx
    return a


def flipped(axis: int, same_grid: bool = False) -> np.ndarray:
    a = AFFINE.copy()
    a[:3, axis] *= -1
    if same_grid:  # the grid's other end: the same voxel centres, indexed from the other side
        a[axis, 3] = AFFINE[axis, 3] + (SHAPE[axis] - 1) * AFFINE[axis, axis]
    return a


def rotated(degrees: float) -> np.ndarray:
    t = math.radians(degrees)
    a = AFFINE.copy()
    a[:3, :3] = np.array([[math.cos(t), -math.sin(t), 0], [math.sin(t), math.cos(t), 0], [0, 0, 1]]) @ AFFINE[:3, :3]
    return a


def swapped() -> np.ndarray:
    a = AFFINE.copy()
    a[:3, [0, 1]] = AFFINE[:3, [1, 0]]
    return a


def zoomed() -> np.ndarray:
    a = AFFINE.copy()
    a[1, 1] = 2.0
    return a


def inflating(path: Path, side: int = 512) -> None:
    """A 1 MB .nii.gz whose header declares side^3 float64 voxels (1 GiB at 512): gzip members of zeros, each
    16 MiB inflated, so that reading the voxels would allocate all of them."""
    header = nib.Nifti1Header()
    header.set_data_shape((side,) * 3)
    header.set_data_dtype(np.float64)
    header.set_sform(AFFINE, 1)
    header["vox_offset"] = 352
    zeros = gzip.compress(b"\0" * 2**24, compresslevel=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(header.binaryblock + b"\0" * 4) + zeros * (side**3 * 8 // 2**24))


def train_on(tmp_path, data, *extra) -> int:
    return main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--data", str(data), "--size", "16",
                 "--base-channels", "32", "--grad-accum", "1", "--device", "cpu", *extra])


# ------------------------------------------------------------------------ 1. geometry and shape


GEOMETRY = {  # case -> (the folder, what the one line names besides the mask's file)
    "mask shifted 50 mm": (lambda r: pairs(r, mask_affine=shifted(50.0)), ["img_001.nii.gz", "shift of 50.0 mm"]),
    "mask shifted half a voxel": (lambda r: pairs(r, mask_affine=shifted(0.75)), ["shift of 0.8 mm"]),
    "mask axis 0 flipped": (lambda r: pairs(r, mask_affine=flipped(0)), ["axis 0 flipped (LAS in the mask"]),
    "mask axis 2 flipped over its grid": (lambda r: pairs(r, mask_affine=flipped(2, same_grid=True)),
                                          ["axis 2 flipped over the same grid"]),
    "mask axes swapped": (lambda r: pairs(r, mask_affine=swapped()), ["axes in another order"]),
    "mask voxels 2 mm tall": (lambda r: pairs(r, mask_affine=zoomed()), ["voxel size 1.5x2x1.5 mm in the mask"]),
    "mask rotated 5 degrees": (lambda r: pairs(r, mask_affine=rotated(5.0)), ["rotated by 5.0 degrees"]),
    "image flipped against its mask": (lambda r: pairs(r, image_affine=flipped(1)), ["axis 1 flipped"]),
}


@pytest.mark.parametrize("case", GEOMETRY)
def test_a_mask_on_another_grid_is_refused_naming_both_files(tmp_path, capsys, own_cache, case):
    make, needles = GEOMETRY[case]
    data = make(tmp_path / "data")
    before = files(data)
    assert train_on(tmp_path, data) == 2
    one_line(capsys, f"error: {data / 'mask' / 'mask_001.nii.gz'}: not on the grid of its image", *needles,
             "--resample-mask")
    assert files(data) == before and not (tmp_path / "run").exists()
    assert not own_cache.exists(), "refused from the headers: nothing decoded, nothing cached"


SHAPES = {  # case -> (the folder, the train options, what the one line names)
    "32x32x2 stretched to 16^3": (
        lambda r: pairs(r, image=np.random.default_rng(1).normal(size=(32, 32, 2)).astype(np.float32),
                        mask=np.ones((32, 32, 2), np.uint8)), [], ["img_001.nii.gz", "32x32x2 volume",
                                                                   "stretched 8-fold (at most 4)"]),
    "mask of another shape": (lambda r: pairs(r, mask=np.ones((16, 16, 12), np.uint8)), [],
                              ["img_001.nii.gz", "differs from its mask", "--resample-mask"]),
    "16^3 stretched into an 80^3 model": (lambda r: pairs(r), ["--size", "80"],
                                          ["img_001.nii.gz", "16x16x16 volume", "stretched 5-fold"]),
    "BraTS label map shifted 50 mm": (lambda r: brats(r, seg_affine=shifted(50.0)), ["--size", "16x16x8"],
                                      ["case1_seg.nii.gz", "not on the grid of its t1 volume", "shift of 50.0 mm"]),
    "BraTS case padded 5.7-fold": (lambda r: brats(r), ["--size", "16x16x80"],
                                   ["case1_seg.nii.gz", "padded 5.71-fold (at most 4)"]),
    "--resample-mask on BraTS files": (lambda r: brats(r), ["--size", "16x16x8", "--resample-mask"],
                                       ["--resample-mask resamples the masks of a folder of image/ and mask/"]),
    "--resample-mask on the embedded data": (None, ["--resample-mask"], ["mni: --resample-mask"]),
}


@pytest.mark.parametrize("case", SHAPES)
def test_a_volume_far_from_the_model_s_shape_is_refused_from_its_header(tmp_path, capsys, case):
    make, extra, needles = SHAPES[case]
    data = make(tmp_path / "data") if make else "mni"
    before = files(data) if make else {}
    argv = ["train", "--out", str(tmp_path / "run"), "--steps", "1", "--data", str(data), "--base-channels", "32",
            "--grad-accum", "1", "--device", "cpu", *extra]
    if "--size" not in extra:
        argv += ["--size", "16"]
    assert main(argv) == 2
    one_line(capsys, "error: ", *needles)
    assert (files(data) if make else {}) == before and not (tmp_path / "run").exists()


def test_a_1_mb_file_inflating_to_1_gib_is_refused_before_its_voxels_are_read(tmp_path, capsys):
    data = pairs(tmp_path / "data")
    (data / "image" / "img_001.nii.gz").unlink()
    inflating(data / "image" / "img_001.nii.gz")
    assert (data / "image" / "img_001.nii.gz").stat().st_size < 2e6
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        assert train_on(tmp_path, data) == 2
        took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_line(capsys, "error: ", "img_001.nii.gz", "512x512x512 volume", "shrunk 32-fold (at most 8)")
    assert peak < 100e6, f"{peak / 1e6:.0f} MB allocated: the voxels were read"
    assert took < 20 and not (tmp_path / "run").exists()


def test_a_label_map_for_sampling_is_held_to_the_same_bounds(tmp_path):
    from medddpm.train.sampling import label_volume

    inflating(tmp_path / "huge.nii.gz")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"huge.nii.gz: a 512x512x512 volume .* shrunk 32-fold"):
            label_volume(str(tmp_path / "huge.nii.gz"), size=16, mask_channels=3)
        assert tracemalloc.get_traced_memory()[1] < 100e6
    finally:
        tracemalloc.stop()


# handled, not refused: float noise in an affine, the same grid in another order, and what --resample-mask makes


def test_float32_noise_in_a_mask_s_affine_is_the_same_grid(tmp_path):
    data = pairs(tmp_path / "data", mask_affine=shifted(2e-5))
    assert len(NiftiPairs(data, size=16)) == 2


def test_resample_mask_reorders_a_mask_stored_in_another_axis_order_exactly(tmp_path):
    labels = np.random.default_rng(3).integers(0, 4, SHAPE).astype(np.uint8)
    same = pairs(tmp_path / "same", mask=labels)
    other = pairs(tmp_path / "other", mask=labels[::-1].copy(), mask_affine=flipped(0, same_grid=True))
    with pytest.raises(DataError, match="axis 0 flipped over the same grid"):
        NiftiPairs(other, size=16)
    want, got = NiftiPairs(same, size=16).raw(0)[1], NiftiPairs(other, size=16, resample_mask=True).raw(0)[1]
    assert torch.equal(want, got)


def test_resample_mask_moves_a_shifted_mask_onto_the_image_s_grid(tmp_path):
    labels = np.random.default_rng(4).integers(1, 4, SHAPE).astype(np.uint8)
    data = pairs(tmp_path / "data", mask=labels, mask_affine=shifted(3.0))  # two voxels along axis 0
    got = NiftiPairs(data, size=16, resample_mask=True).raw(0)[1].numpy()
    assert (got[:2] == 0).all(), "outside the mask's field of view: background"
    assert np.array_equal(got[2:], labels[:-2])


def test_resample_mask_trains_from_the_command_line(tmp_path, capsys):
    data = pairs(tmp_path / "data", mask_affine=shifted(3.0))
    before = files(data)
    assert train_on(tmp_path, data, "--resample-mask") == 0
    assert (tmp_path / "run" / checkpoint.CHECKPOINT).is_file() and files(data) == before


def test_a_volume_within_the_bounds_is_resized_as_before(tmp_path):
    image = np.random.default_rng(5).normal(size=(40, 40, 40)).astype(np.float32)
    data = pairs(tmp_path / "data", image=image, mask=np.ones((40, 40, 40), np.uint8))
    assert NiftiPairs(data, size=16)[0][0].shape == (1, 16, 16, 16)  # 2.5-fold: within 8


# ------------------------------------------------------------------------ 2. values after conversion to float32


def _with(value, dtype=np.float64, base=None) -> np.ndarray:
    x = (np.random.default_rng(6).normal(size=SHAPE) * 50 + 500).astype(dtype) if base is None else base
    x[3, 4, 5] = value
    return x


VALUES = {  # case -> (the folder, what the one line names)
    "float64 image holding 1e300": (lambda r: pairs(r, image=_with(1e300)),
                                    ["img_001.nii.gz", "values up to 1e+300 exceed float32's range"]),
    "float64 image holding -1e39": (lambda r: pairs(r, image=_with(-1e39)), ["img_001.nii.gz", "exceed float32"]),
    "float64 image with a NaN": (lambda r: pairs(r, image=_with(np.nan)), ["img_001.nii.gz", "NaN or inf"]),
    "BraTS FLAIR holding 1e300": (lambda r: brats(r, flair=_with(1e300, base=np.ones((20, 20, 14)) * 7)),
                                  ["case1_flair.nii.gz", "exceed float32's range"]),
}


@pytest.mark.parametrize("case", VALUES)
def test_values_are_checked_after_their_conversion_to_float32(tmp_path, capsys, case):
    make, needles = VALUES[case]
    data = make(tmp_path / "data")
    before = files(data)
    extra = ["--size", "16x16x8"] if case.startswith("BraTS") else []
    assert train_on(tmp_path, data, *extra) == 2
    one_line(capsys, "error: ", *needles)
    assert files(data) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("image", [_with(1e30), _with(-3e38, np.float32, _with(3e38, np.float32)),
                                   np.where(np.indices(SHAPE).sum(0) % 2, 3e38, -3e38).astype(np.float32)],
                         ids=["float64 up to 1e30", "float32 with two voxels at -3e38 and 3e38",
                              "float32 half -3e38, half 3e38"])
def test_values_that_fit_float32_train_as_before(tmp_path, image):
    data = pairs(tmp_path / "data", image=image)
    image = NiftiPairs(data, size=16)[0][0]  # scaled in float64: the span of float32's range does not overflow
    assert torch.isfinite(image).all() and image.min() >= -1 and image.max() <= 1


# ------------------------------------------------------------------------ 3. table types on read


def _run_tree(tmp_path, env, change=None, table="run") -> tuple[Path, Path]:
    """data/cpu/{baseline,opt1}/run.parquet (and a steps table each); `change(df)` rewrites opt1's `table` with
    pandas (not write_table), as a hand or another tool would. Returns the data root and the changed file."""
    root = tmp_path / "data"
    for config in ("baseline", "opt1"):
        row = run_row(get_config(config), "smoke", env=env, gpu_name="cpu", label="cpu", status="ok", message="")
        row |= {"run_id": f"cpu/{config}/0", "train_median_ms": 2.0, "timed_steps": 1}
        write_table(pd.DataFrame([row]), root / "cpu" / config / "run.parquet", "run")
        steps = pd.DataFrame({"run_id": row["run_id"], "phase": "train", "micro_step": [0, 1], "timed": [False, True],
                              "step_ms": [3.0, 2.0], "dispatch_ms": 0.1, "loss": 0.5, "peak_mem_bytes": -1})
        write_table(steps, root / "cpu" / config / "steps.parquet", "steps")
    path = root / "cpu" / "opt1" / f"{table}.parquet"
    if change is not None:
        change(pd.read_parquet(path)).to_parquet(path)
    return root, path


def _arrow(column: str, typ: pa.DataType):
    """A change that stores `column` as `typ` (cast by Arrow, as another writer would store it)."""
    def change(df):
        t = pa.Table.from_pandas(df, preserve_index=False)
        i = t.schema.get_field_index(column)
        return t.set_column(i, pa.field(column, typ), t.column(column).cast(typ)).to_pandas()
    return change


TYPES = {  # case -> (table, change, what the one line names)
    "train_median_ms as text": ("run", lambda df: df.assign(train_median_ms="2.0"),
                                "column train_median_ms is large_string, expected double"),
    "batch as a float": ("run", lambda df: df.assign(batch=1.0), "column batch is double, expected int64"),
    "channels_last as 0/1": ("run", lambda df: df.assign(channels_last=0),
                             "column channels_last is int64, expected bool"),
    "run_id as a number": ("run", lambda df: df.assign(run_id=7), "column run_id is int64, expected string"),
    "start_time as a timestamp": ("run", lambda df: df.assign(start_time=pd.Timestamp("2026-01-01")),
                                  "column start_time is timestamp"),
    "train_median_ms negative": ("run", lambda df: df.assign(train_median_ms=-5.0),
                                 "column train_median_ms: -5.0 is out of range (a finite number of at least 0)"),
    "train_median_ms infinite": ("run", lambda df: df.assign(train_median_ms=math.inf),
                                 "column train_median_ms: inf is out of range"),
    "steps' micro_step as text": ("steps", lambda df: df.assign(micro_step=df["micro_step"].astype(str)),
                                  "column micro_step is large_string, expected int64"),
}


@pytest.mark.parametrize("case", TYPES)
def test_a_column_of_the_wrong_type_is_refused_and_its_folder_left_out(tmp_path, env, monkeypatch, case):
    table, change, needle = TYPES[case]
    root, path = _run_tree(tmp_path, env, change, table)
    before = path.read_bytes()
    with pytest.raises(schema.SchemaError) as e:
        read_table(path)
    assert str(e.value).startswith(f"{path}: ") and needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    with pytest.warns(loading.DataWarning) as caught:
        got = loading.load(table, root)
    assert len(caught) == 1 and str(caught[0].message).count(str(path)) == 1 and needle in str(caught[0].message)
    assert list(got["config"].unique()) == ["baseline"], "the other folder is shown"
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")
    with pytest.raises(loading.DataError, match=needle.split(" is ")[0]):
        loading.load(table, root)
    assert path.read_bytes() == before, "reading changes nothing"


@pytest.mark.parametrize("change", [_arrow("run_id", pa.large_string()), _arrow("train_median_ms", pa.float32()),
                                    _arrow("batch", pa.int32()), lambda df: df.assign(train_median_ms=2)],
                         ids=["large_string", "float32", "int32", "a whole number in a float column"])
def test_another_width_of_the_right_kind_still_reads(tmp_path, env, change):
    root, path = _run_tree(tmp_path, env, change)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loading.DataWarning)
        run = loading.runs(root)
    assert list(run["config"]) == ["baseline", "opt1"] and (run["train_median_ms"] == 2.0).all()
    assert run["batch"].dtype == np.int64
