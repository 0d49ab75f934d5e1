import gzip
import os

import nibabel as nib
import numpy as np
import pytest
import torch

from medddpm.train import data, nifti, synthetic
from medddpm.train.data import MNIPairs, NiftiPairs, one_hot_condition, open_dataset
from medddpm.train.nifti import DataError
from medddpm.train.synthetic import make_mni_pair


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The volume cache of every data set opened here in the test's own folder."""
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "volume-cache"))


# make_mni_pair

@pytest.mark.parametrize("size", [16, 24, 32])
def test_mni_pair_shapes_and_ranges(size):
    image, labels = make_mni_pair(3, size=size)
    assert image.shape == labels.shape == (size,) * 3
    assert image.dtype == np.float32 and labels.dtype == np.uint8
    assert image.min() >= -1 and image.max() <= 1
    assert set(np.unique(labels)) <= set(synthetic.LABELS)
    assert (image[labels == 0] == -1).all()
    assert (image[labels > 0] > -1).mean() > 0.95


def test_mni_pair_deterministic_per_seed():
    a, b, c = (make_mni_pair(s, size=24) for s in (5, 5, 6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mni_pair_all_labels_present(seed):
    _, labels = make_mni_pair(seed, size=32)
    counts = np.bincount(labels.ravel(), minlength=4)
    assert len(counts) == 4 and (counts > 0).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [24, 32])
def test_mni_brain_inside_field_of_view(seed, size):
    _, labels = make_mni_pair(seed, size=size)
    for axis in range(3):
        assert not labels.take(0, axis).any() and not labels.take(-1, axis).any()


def test_mni_spacing_is_honoured():
    _, labels = make_mni_pair(0, size=32, spacing_mm=2.0)  # 64 mm field of view: brain everywhere
    assert labels[0].any() and labels[-1].any()


def test_mni_template_dir():
    folder = synthetic.mni_template_dir()
    assert (folder / "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz").is_file()


def test_mni_template_dir_missing(monkeypatch):
    monkeypatch.setattr(synthetic.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="nilearn"):
        synthetic.mni_template_dir()


# one_hot_condition

@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_one_hot_condition(as_tensor, batched):
    labels = np.array([0, 1, 2, 3, 2, 0], dtype=np.uint8).reshape(1, 2, 3)
    if batched:
        labels = np.stack([labels, 3 - labels])
    cond = one_hot_condition(torch.from_numpy(labels).long() if as_tensor else labels, num_classes=3)
    channel_axis = 1 if batched else 0
    assert cond.dtype == torch.float32
    assert cond.shape == labels.shape[:channel_axis] + (3,) + labels.shape[channel_axis:]
    for k in range(3):  # channel k is label k + 1; background has no channel
        expected = torch.from_numpy(labels == k + 1).float() * 2 - 1
        assert torch.equal(cond.select(channel_axis, k), expected)


@pytest.mark.parametrize("labels, error", [
    (np.full((2, 2, 2), 4), ValueError),
    (np.full((2, 2, 2), -1), ValueError),
    (np.zeros((2, 2, 2), dtype=np.float32), TypeError),
    (np.zeros((2, 2, 2), dtype=bool), TypeError),
    (np.zeros((2, 2)), ValueError),
])
def test_one_hot_condition_rejects(labels, error):
    with pytest.raises(error):
        one_hot_condition(labels, num_classes=3)


# MNIPairs

def test_mni_pairs_items(tmp_path):
    ds = MNIPairs(2, size=16, cache_dir=tmp_path, seed=7, progress=False)
    assert len(ds) == 2 and ds.mask_channels == 3
    image, cond = ds[1]
    assert image.shape == (1, 16, 16, 16) and cond.shape == (3, 16, 16, 16)
    assert image.dtype == cond.dtype == torch.float32
    ref_image, ref_labels = make_mni_pair(8, size=16)
    assert torch.equal(image[0], torch.from_numpy(ref_image))
    assert torch.equal(cond, one_hot_condition(ref_labels, num_classes=3))
    with pytest.raises(IndexError):
        ds[2]


def test_mni_pairs_cache(tmp_path, monkeypatch):
    ds = MNIPairs(3, size=16, cache_dir=tmp_path, progress=False).prepare()
    first = [ds[i] for i in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ds.path(i).name for i in range(3))

    def boom(*args, **kwargs):
        raise AssertionError("pair regenerated instead of read from the cache")

    monkeypatch.setattr(data, "make_mni_pair", boom)
    again = MNIPairs(3, size=16, cache_dir=tmp_path, progress=False).prepare()
    for (a, b), (c, d) in zip(first, again):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_mni_pairs_killed_write_leaves_nothing(tmp_path, monkeypatch):
    def killed(f, **arrays):
        f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(data.np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        MNIPairs(1, size=16, cache_dir=tmp_path, progress=False).prepare()
    assert list(tmp_path.iterdir()) == []


def test_mni_pairs_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))
    ds = MNIPairs(1, size=16, progress=False)
    ds[0]
    assert ds.path(0).parent == tmp_path / "cache" and ds.path(0).is_file()


@pytest.mark.parametrize("content", [b"not a zip", b"PK\x03\x04" + b"\0" * 40, b""])
def test_mni_pairs_unreadable_cache_file_is_generated_again(tmp_path, content):
    ds = MNIPairs(1, size=16, cache_dir=tmp_path, progress=False)
    image, cond = ds[0]
    ds.path(0).write_bytes(content)  # overwritten, truncated or emptied
    again, cond_again = ds[0]
    assert torch.equal(image, again) and torch.equal(cond, cond_again)
    with np.load(ds.path(0)) as f:  # and written back whole
        assert torch.equal(torch.from_numpy(f["image"])[None], image)


# NiftiPairs

SHAPE = (18, 20, 16)


def write_nifti(path, array):
    nib.save(nib.Nifti1Image(np.asarray(array), np.eye(4)), str(path))


def write_pair(root, k, *, image=None, labels=None, ext=".nii.gz"):
    rng = np.random.default_rng(k)
    write_nifti(root / "image" / f"t1_sub{k:02d}{ext}",
                rng.normal(size=SHAPE).astype(np.float32) if image is None else image)
    write_nifti(root / "mask" / f"seg_{k}{ext}", rng.integers(0, 4, SHAPE, dtype=np.uint8) if labels is None else labels)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "data"
    (root / "image").mkdir(parents=True)
    (root / "mask").mkdir()
    for k in (1, 2):
        write_pair(root, k)
    write_pair(root, 3, ext=".nii")
    return root


def test_nifti_pairs_items(root):
    ds = NiftiPairs(root, size=16)
    assert len(ds) == 3 and ds.mask_channels == ds.num_classes == 3
    for image, cond in ds:
        assert image.shape == (1, 16, 16, 16) and cond.shape == (3, 16, 16, 16)
        assert image.dtype == cond.dtype == torch.float32
        assert image.min() >= -1 and image.max() <= 1
        assert set(cond.unique().tolist()) == {-1.0, 1.0}
        assert (cond > 0).sum(0).max() <= 1  # at most one class per voxel


def test_nifti_pairs_explicit_num_classes(root):
    assert NiftiPairs(root, size=8, num_classes=5)[0][1].shape == (5, 8, 8, 8)


def test_nifti_pairs_normalizes_per_volume_not_per_slice(tmp_path):
    root = tmp_path / "ramp"
    (root / "image").mkdir(parents=True)
    (root / "mask").mkdir()
    ramp = np.broadcast_to(np.arange(16, dtype=np.float32) * 10 + 100, (16, 16, 16)).copy()
    write_pair(root, 1, image=ramp, labels=np.ones((16, 16, 16), dtype=np.uint8))
    image = NiftiPairs(root, size=16)[0][0][0]
    assert torch.allclose(image, torch.from_numpy(ramp - 100) / 75 - 1)


def _clear(folder, *, remove=False):
    for p in folder.iterdir():
        p.unlink()
    if remove:
        folder.rmdir()
    return folder.name


def _put(root, name, array):
    write_nifti(root / name, array)
    return os.path.basename(name)


def _put_bytes(root, name, content):
    (root / name).write_bytes(content)
    return os.path.basename(name)


def _rename(root, name, new_name):
    (root / name).rename(root / new_name)
    return os.path.basename(new_name)


def _unlink(root, name, *, report):
    (root / name).unlink()
    return report


def _truncate_data(root, name):
    path = root / name  # header intact, voxel data cut short
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-200]))
    return path.name


def _one(value, dtype, shape=SHAPE):
    return np.full(shape, value, dtype)


def _with_nan():
    a = np.ones(SHAPE, np.float32)
    a[3, 4, 5] = np.nan
    return a


def _all_background(root):
    for name in ("mask/seg_1.nii.gz", "mask/seg_2.nii.gz", "mask/seg_3.nii"):
        _put(root, name, _one(0, np.uint8))
    return "mask"


BAD = {  # case -> corrupt the good data set, return the name the error must mention
    "missing root": lambda r: _clear(r / "image", remove=True) and _clear(r / "mask", remove=True) and r.rmdir() or r.name,
    "missing mask folder": lambda r: _clear(r / "mask", remove=True),
    "empty image folder": lambda r: _clear(r / "image"),
    "non-NIfTI file": lambda r: _put_bytes(r, "image/notes.txt", b"hi"),
    "unreadable NIfTI": lambda r: _put_bytes(r, "image/t1_sub02.nii.gz", b"garbage" * 50),
    "unreadable .nii": lambda r: _put_bytes(r, "image/t1_sub03.nii", b"garbage" * 50),
    "truncated header": lambda r: _put_bytes(r, "image/t1_sub02.nii.gz", (r / "image/t1_sub02.nii.gz").read_bytes()[:300]),
    "truncated data": lambda r: _truncate_data(r, "mask/seg_2.nii.gz"),
    "no number": lambda r: _rename(r, "image/t1_sub01.nii.gz", "image/brain.nii.gz"),
    "image without mask": lambda r: _unlink(r, "mask/seg_2.nii.gz", report="t1_sub02.nii.gz"),
    "mask without image": lambda r: _unlink(r, "image/t1_sub02.nii.gz", report="seg_2.nii.gz"),
    "duplicate number": lambda r: _put(r, "mask/seg_002.nii.gz", _one(1, np.uint8)) and "seg_2.nii.gz",
    "shape mismatch": lambda r: _put(r, "mask/seg_2.nii.gz", _one(1, np.uint8, (4, 4, 4))) and "t1_sub02.nii.gz",
    "4-D volume": lambda r: _put(r, "image/t1_sub01.nii.gz", np.random.rand(*SHAPE, 2).astype(np.float32)),
    "NaN image": lambda r: _put(r, "image/t1_sub02.nii.gz", _with_nan()),
    "inf image": lambda r: _put(r, "image/t1_sub02.nii.gz", _one(np.inf, np.float32)),
    "constant image": lambda r: _put(r, "image/t1_sub03.nii", _one(7, np.float32)),
    "negative label": lambda r: _put(r, "mask/seg_1.nii.gz", _one(-1, np.int16)),
    "fractional label": lambda r: _put(r, "mask/seg_1.nii.gz", _one(1.5, np.float32)),
    "all background": _all_background,
}


@pytest.mark.parametrize("case", BAD)
def test_nifti_pairs_bad_input(root, case):
    name = BAD[case](root)
    with pytest.raises(DataError) as e:
        NiftiPairs(root, size=16)
    message = str(e.value)
    assert "\n" not in message and name in message, message


def test_nifti_pairs_label_out_of_range(root):
    _put(root, "mask/seg_2.nii.gz", _one(5, np.uint8))
    with pytest.raises(DataError, match="seg_2.nii.gz"):
        NiftiPairs(root, size=16, num_classes=3)
    with pytest.raises(DataError, match=r"seg_2.nii.gz: unexpected label 5 \(5,760 voxels\).* 0..3"):
        NiftiPairs(root, size=16)  # inferred: 4 is missing, so 5 is not one of the data set's classes
    _put(root, "mask/seg_2.nii.gz", (np.arange(np.prod(SHAPE)).reshape(SHAPE) % 6).astype(np.uint8))
    assert NiftiPairs(root, size=16).num_classes == 5  # inferred: 0..5, contiguous


def test_nifti_pairs_shape_mismatch_names_both(root):
    _put(root, "mask/seg_2.nii.gz", _one(1, np.uint8, (4, 4, 4)))
    with pytest.raises(DataError, match=r"t1_sub02.nii.gz.*seg_2.nii.gz.*\(4, 4, 4\)"):
        NiftiPairs(root, size=16)


# open_dataset

def test_open_dataset(root, tmp_path):
    mni = open_dataset("mni", size=16, n=3, cache_dir=tmp_path / "cache", seed=4)
    assert isinstance(mni, MNIPairs) and len(mni) == 3 and mni.size == 16 and mni.seed == 4
    nifti = open_dataset(str(root), size=16)
    assert isinstance(nifti, NiftiPairs) and len(nifti) == 3


def test_open_dataset_missing_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(DataError, match="nowhere") as e:
        open_dataset(missing, size=16)
    assert "\n" not in str(e.value)


def test_data_error_is_one_line():
    assert str(DataError("a.nii\nbroken")) == "a.nii broken"
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------------ BraTS

from medddpm.train.data import BratsCases, MNIBratsCases  # noqa: E402
from medddpm.train.synthetic import BRATS_LABELS, make_brats_case  # noqa: E402

BRATS_SMALL = (40, 40, 32)


def test_brats_case_shapes_ranges_and_labels():
    image, labels = make_brats_case(2, size=BRATS_SMALL)
    assert image.shape == (4, *BRATS_SMALL) and labels.shape == BRATS_SMALL
    assert image.dtype == np.float32 and labels.dtype == np.uint8
    assert image.min() >= -1 and image.max() <= 1
    assert np.array_equal(image, image.astype(np.float16).astype(np.float32)), "float16-exact (lossless cache)"
    assert set(np.unique(labels)) == set(BRATS_LABELS), "background, three tumour classes and the brain"
    brain = labels > 0
    assert (image[:, ~brain] == -1).all()
    # the anatomy is the MNI subject of the same seed (same deformation, same grid)
    _, mni = make_mni_pair(2, size=BRATS_SMALL, spacing_mm=1.2 * 192 / 40)
    assert np.array_equal(brain, mni > 0)
    # the tumour classes look different across modalities: enhancing tumour is brightest on T1ce
    t1, t1ce = image[0], image[1]
    assert t1ce[labels == 3].mean() > t1ce[labels == 4].mean() + 0.15
    assert t1ce[labels == 3].mean() > t1[labels == 3].mean() + 0.15


def test_brats_case_deterministic_per_seed():
    a, b, c = (make_brats_case(s, size=(24, 24, 16)) for s in (5, 5, 6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_brats_case_brain_inside_the_default_field_of_view():
    _, labels = make_brats_case(0, size=(48, 48, 36))  # BraTS' 192 x 192 x 144 at a quarter of the voxels
    for axis in range(3):
        assert not labels.take(0, axis).any() and not labels.take(-1, axis).any()


def test_mni_brats_cases_items_and_cache(tmp_path, monkeypatch):
    ds = MNIBratsCases(2, size=(24, 24, 16), cache_dir=tmp_path, seed=3)
    assert len(ds) == 2 and (ds.image_channels, ds.mask_channels) == (4, 4)
    image, cond = ds[1]
    ref_image, ref_labels = make_brats_case(4, size=(24, 24, 16))
    assert torch.equal(image, torch.from_numpy(ref_image))
    assert torch.equal(cond, one_hot_condition(ref_labels, num_classes=4))
    monkeypatch.setattr(data, "make_brats_case", lambda *a, **k: pytest.fail("regenerated instead of cached"))
    again = MNIBratsCases(2, size=(24, 24, 16), cache_dir=tmp_path, seed=3)[1]
    assert torch.equal(again[0], image) and torch.equal(again[1], cond)
    with pytest.raises(IndexError):
        ds[2]
    assert isinstance(open_dataset("mni-brats", size=(24, 24, 16), n=2, cache_dir=tmp_path), MNIBratsCases)


BRATS_ON_DISK = (20, 22, 12)  # not the model's shape: the loader crops or pads


def write_brats(root, cases=("BraTS2021_00001", "BraTS2021_00002")):
    """A BraTS-layout folder: <root>/{seg,t1,t1ce,t2,flair}/<case>_<modality>.nii.gz, from synthetic
    cases with intensities on a scanner-like scale (background 0)."""
    for i, case in enumerate(cases):
        image, labels = make_brats_case(i, size=BRATS_ON_DISK)
        volumes = {"seg": labels.astype(np.int16)}
        volumes |= {m: ((image[k] + 1) * 500).astype(np.float32) for k, m in enumerate(("t1", "t1ce", "t2", "flair"))}
        for m, vol in volumes.items():
            (root / m).mkdir(parents=True, exist_ok=True)
            write_nifti(root / m / f"{case}_{m}.nii.gz", vol)
    return root


@pytest.fixture
def brats_root(tmp_path):
    return write_brats(tmp_path / "brats")


def test_brats_cases_items(brats_root):
    ds = BratsCases(brats_root, size=(16, 16, 8))
    assert len(ds) == 2 and ds.names == ["BraTS2021_00001", "BraTS2021_00002"]
    image, cond = ds[1]
    assert image.shape == (4, 16, 16, 8) and cond.shape == (4, 16, 16, 8)
    assert image.dtype == cond.dtype == torch.float32 and image.min() >= -1 and image.max() <= 1
    assert set(cond.unique().tolist()) == {-1.0, 1.0} and (cond > 0).sum(0).max() <= 1
    # channel order T1, T1ce, T2, FLAIR; each normalized on its own, then centre-cropped (20 -> 16: 2 off each side)
    for k, m in enumerate(("t1", "t1ce", "t2", "flair")):
        raw = nib.load(brats_root / m / f"BraTS2021_00002_{m}.nii.gz").get_fdata().astype(np.float32)
        want = nifti.normalize(raw)[2:18, 3:19, 2:10]
        assert torch.allclose(image[k], torch.from_numpy(want)), m
    seg = np.asarray(nib.load(brats_root / "seg" / "BraTS2021_00002_seg.nii.gz").dataobj)[2:18, 3:19, 2:10]
    assert torch.equal(cond, one_hot_condition(seg.astype(np.int64), num_classes=4))


def test_brats_cases_pad_to_a_larger_shape(brats_root):
    image, cond = BratsCases(brats_root, size=(24, 24, 16))[0]
    assert image.shape == (4, 24, 24, 16)
    assert (image[:, :2] == -1).all() and (cond[:, :2] == -1).all(), "padding is background"


def test_open_dataset_finds_the_brats_layout(brats_root, root):
    assert isinstance(open_dataset(str(brats_root), size=(16, 16, 8)), BratsCases)
    assert isinstance(open_dataset(str(root), size=16), NiftiPairs)


def _raw_brats_labels(r):
    """The challenge's own labels: enhancing tumour 4, the rest of the brain background."""
    path = r / "seg" / "BraTS2021_00001_seg.nii.gz"
    seg = np.asarray(nib.load(path).dataobj)
    write_nifti(path, np.select([seg == 4, seg == 3], [0, 4], seg).astype(np.int16))
    return path.name


BRATS_BAD = {  # case -> corrupt the good folder, return what the one-line error must name
    "missing modality folder": lambda r: _clear(r / "flair", remove=True),
    "empty folder": lambda r: _clear(r / "t2"),
    "case missing a modality": lambda r: _unlink(r, "t1ce/BraTS2021_00002_t1ce.nii.gz",
                                                 report="BraTS2021_00002_t1ce.nii.gz"),
    "case only in one folder": lambda r: _put(r, "t2/BraTS2021_00003_t2.nii.gz", _one(1.0, np.float32, BRATS_ON_DISK)),
    "wrong modality in a folder": lambda r: _rename(r, "t1/BraTS2021_00001_t1.nii.gz", "t1/BraTS2021_00001_t1ce.nii.gz"),
    "no case name": lambda r: _rename(r, "seg/BraTS2021_00001_seg.nii.gz", "seg/seg.nii.gz"),
    "non-NIfTI file": lambda r: _put_bytes(r, "seg/notes.txt", b"hi"),
    "unreadable NIfTI": lambda r: _put_bytes(r, "t2/BraTS2021_00002_t2.nii.gz", b"garbage" * 50),
    "shape mismatch": lambda r: _put(r, "flair/BraTS2021_00001_flair.nii.gz", _one(1.0, np.float32, (4, 4, 4))),
    "constant image": lambda r: _put(r, "t1ce/BraTS2021_00002_t1ce.nii.gz", _one(3.0, np.float32, BRATS_ON_DISK)),
    "label out of range": lambda r: _put(r, "seg/BraTS2021_00002_seg.nii.gz", _one(5, np.int16, BRATS_ON_DISK)),
    "raw BraTS labels": _raw_brats_labels,
}


@pytest.mark.parametrize("case", BRATS_BAD)
def test_brats_cases_bad_input(brats_root, case):
    name = BRATS_BAD[case](brats_root)
    with pytest.raises(DataError) as e:
        BratsCases(brats_root, size=(16, 16, 8))
    message = str(e.value)
    assert "\n" not in message and name in message, message


def test_brats_missing_modality_names_the_expected_file(brats_root):
    (brats_root / "t1ce" / "BraTS2021_00002_t1ce.nii.gz").unlink()
    with pytest.raises(DataError, match=r"BraTS2021_00002.*no t1ce volume.*t1ce/BraTS2021_00002_t1ce\.nii\.gz"):
        BratsCases(brats_root)


def test_sample_reads_a_label_file_as_training_does(tmp_path):
    """`sample --labels FILE`: the training reader's orientation and checks, one line for a bad file."""
    from medddpm.train.sampling import label_volume

    labels = np.zeros((8, 8, 8), np.uint8)
    labels[:4] = 1
    flipped = np.diag([-1.0, 1.0, 1.0, 1.0])  # stored left-right mirrored: canonical order flips it back
    nib.save(nib.Nifti1Image(labels[::-1].copy(), flipped), str(tmp_path / "mirrored.nii.gz"))
    assert np.array_equal(label_volume(str(tmp_path / "mirrored.nii.gz"), size=8), labels)
    nib.save(nib.Nifti1Image(np.full((8, 8, 8), 2.5, np.float32), np.eye(4)), str(tmp_path / "half.nii.gz"))
    with pytest.raises(DataError, match="half.nii.gz: labels must be integers"):
        label_volume(str(tmp_path / "half.nii.gz"), size=8)
    with pytest.raises(DataError, match="absent.nii.gz"):
        label_volume(str(tmp_path / "absent.nii.gz"), size=8)
