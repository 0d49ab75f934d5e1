"""The NIfTI folders' volume cache and the device loader: exact items, invalidation, corrupt files and entries,
hostile headers and labels, worker shutdown, and the exported folder read back."""

import gzip
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import nibabel as nib
import pandas as pd
import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F

from medddpm.cli.main import main
from medddpm.train import nifti
from medddpm.train.data import BratsCases, NiftiPairs, open_dataset
from medddpm.train.export import export_folder
from medddpm.train.loader import DeviceLoader, one_hot_condition
from medddpm.train.nifti import DataError
from medddpm.train.synthetic import BRATS_MODALITIES, make_brats_case, make_mni_pair

SIZE = 16
BRATS_DISK, BRATS_SIZE = (20, 20, 14), (16, 16, 12)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDDDPM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Folders written once per module; each test copies the one it changes."""
    root = tmp_path_factory.mktemp("exported")
    export_folder(root / "ref", pairs=3, size=SIZE)
    export_folder(root / "brats", pairs=2, size=BRATS_DISK, layout="brats")
    return root


@pytest.fixture
def ref(exported, tmp_path):
    import shutil

    return shutil.copytree(exported / "ref", tmp_path / "ref")


@pytest.fixture
def brats(exported, tmp_path):
    import shutil

    return shutil.copytree(exported / "brats", tmp_path / "brats")


def _direct(path):
    """A file read without the project's reader: nibabel's canonical orientation, the dtype nibabel stores."""
    return np.asarray(nib.as_closest_canonical(nib.load(path)).dataobj)


@pytest.fixture(autouse=True)
def _children_before(request):
    """The processes this one had started before the test (an Inductor compile pool an earlier test in this
    process left running): `_children_gone` looks at the test's own."""
    request.node.stash[_BEFORE] = {c.pid for c in psutil.Process().children(recursive=True)}


_BEFORE = pytest.StashKey[set]()


def _new_children(request) -> list:
    return [c for c in psutil.Process().children(recursive=True) if c.pid not in request.node.stash[_BEFORE]]


def _children_gone(request, timeout=10.0):
    """The processes the test started that are still there after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while _new_children(request) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _new_children(request)


def _one_line(e):
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# exact items

def test_cached_items_equal_reading_the_files(ref):
    ds = NiftiPairs(ref, size=SIZE)
    assert ds.cache.builds == 3 and ds.cache.hits == 0 and ds.cache_build_s > 0
    for i, (image_path, mask_path) in enumerate(ds.pairs):
        image, labels = ds.raw(i)
        want = nifti.normalize(_direct(image_path).astype(np.float32))
        assert image.dtype == torch.float32 and torch.equal(image[0], torch.from_numpy(want))
        assert torch.equal(labels, torch.from_numpy(_direct(mask_path).astype(np.uint8)))
        assert torch.equal(ds[i][1], one_hot_condition(labels.long(), num_classes=3))
    again = NiftiPairs(ref, size=SIZE)  # a second open reads the cache only, the same bytes
    assert again.cache.builds == 0 and again.cache.hits == 3 and again.cache_build_s == ds.cache_build_s
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(again.raw(i), ds.raw(i)))


def test_resized_items_equal_reading_the_files(ref):
    ds = NiftiPairs(ref, size=(12, 10, 8))
    image_path, mask_path = ds.pairs[1]
    image = torch.from_numpy(nifti.normalize(_direct(image_path).astype(np.float32)))
    want = F.interpolate(image[None, None], size=(12, 10, 8), mode="trilinear", align_corners=False)[0]
    labels = torch.from_numpy(_direct(mask_path).astype(np.float32))
    want_labels = F.interpolate(labels[None, None], size=(12, 10, 8), mode="nearest-exact")[0, 0].to(torch.uint8)
    assert torch.equal(ds.raw(1)[0], want) and torch.equal(ds.raw(1)[1], want_labels)


def test_brats_items_equal_reading_the_files(brats):
    ds = BratsCases(brats, size=BRATS_SIZE)
    case = ds.cases[1]
    image, labels = ds.raw(1)
    for k, m in enumerate(BRATS_MODALITIES):  # 20 -> 16: 2 off each side; 14 -> 12: 1 off each side
        want = nifti.normalize(_direct(case[m]).astype(np.float32))[2:18, 2:18, 1:13]
        assert torch.equal(image[k], torch.from_numpy(want)), m
    assert torch.equal(labels, torch.from_numpy(_direct(case["seg"])[2:18, 2:18, 1:13].astype(np.uint8)))


def test_device_loader_gives_the_items_in_order(ref, request):
    ds = NiftiPairs(ref, size=SIZE)
    order = [2, 0, 0, 1]
    got = list(DeviceLoader(ds, order, device="cpu", workers=2))
    assert len(got) == 4
    for i, (image, cond) in zip(order, got):
        want_image, want_cond = ds[i]
        assert image.shape == (1, 1, SIZE, SIZE, SIZE) and torch.equal(image[0], want_image)
        assert torch.equal(cond[0], want_cond)
    assert not _children_gone(request)


# invalidation and corruption

def test_changed_source_invalidates_its_entry(ref):
    ds = NiftiPairs(ref, size=SIZE)
    mask = ds.pairs[0][1]
    before = ds.raw(0)[1]
    assert (before == 3).any()
    img = nib.load(mask)
    labels = np.asarray(img.dataobj).copy()
    labels[labels == 3] = 2
    nib.save(nib.Nifti1Image(labels, img.affine, img.header), mask)
    os.utime(mask, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later mtime, as an edit gives
    again = NiftiPairs(ref, size=SIZE)
    assert again.cache.builds == 1 and again.cache.hits == 2
    after = again.raw(0)[1]
    assert torch.equal(after, torch.from_numpy(_direct(mask).astype(np.uint8))) and not (after == 3).any()


def test_changed_preprocessing_is_another_entry(ref):
    NiftiPairs(ref, size=SIZE)
    assert NiftiPairs(ref, size=8).cache.builds == 3


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_source_is_one_line_and_the_cache_stays_usable(ref, damage):
    NiftiPairs(ref, size=SIZE)
    path = ref / "mask" / "mask_001.nii.gz"
    good = path.read_bytes()
    path.write_bytes({"truncate": gzip.compress(gzip.decompress(good)[:-300]), "garbage": b"garbage" * 40,
                      "empty": b""}[damage])
    with pytest.raises(DataError) as e:
        NiftiPairs(ref, size=SIZE)
    assert "mask_001.nii.gz" in _one_line(e)
    path.write_bytes(good)
    ds = NiftiPairs(ref, size=SIZE)  # the other entries were kept; the repaired file is a hit again or rebuilt
    assert ds.cache.hits >= 2 and len(ds) == 3


@pytest.mark.parametrize("part", ["image.npy", "labels.npy", "json"])
def test_corrupt_cache_entry_is_rebuilt(ref, tmp_path, part):
    ds = NiftiPairs(ref, size=SIZE)
    want = [ds.raw(i) for i in range(3)]
    entry = sorted((tmp_path / "cache" / "volumes").glob(f"*.{part}"))[1]
    entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])
    again = NiftiPairs(ref, size=SIZE)
    assert again.cache.rebuilds == 1 and again.cache.builds == 1 and again.cache.hits == 2
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(again.raw(i), want[i]))


# hostile headers and labels

def _replace(path, array, dtype=None):
    img = nib.load(path)
    out = nib.Nifti1Image(array, img.affine)
    if dtype is not None:
        out.set_data_dtype(dtype)
    nib.save(out, path)


@pytest.mark.parametrize("value, dtype", [(7, np.uint8), (255, np.uint8), (60000, np.uint16)])
def test_stray_label_is_one_line_with_value_and_count(ref, value, dtype):
    path = ref / "mask" / "mask_002.nii.gz"
    labels = np.asarray(nib.load(path).dataobj).astype(dtype)
    labels[3, 4, 5] = value
    _replace(path, labels)  # on its image's grid: the label is what is wrong
    with pytest.raises(DataError) as e:
        open_dataset(str(ref), size=SIZE)
    message = _one_line(e)
    assert "mask_002.nii.gz" in message and f"label {value} (1 voxel)" in message, message


def test_declared_classes_bound_the_labels(ref):
    assert NiftiPairs(ref, size=SIZE, num_classes=5).mask_channels == 5
    with pytest.raises(DataError, match=r"mask_00\d.nii.gz: label 3 \([\d,]+ voxels\) out of range \(num_classes=2\)"):
        NiftiPairs(ref, size=SIZE, num_classes=2)


def _rgb(shape):
    rgb = np.zeros(shape, dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    rgb["R"] = 10
    return rgb


def _huge_header(path):
    """A gzip NIfTI whose header claims 2048^3 float32 voxels (32 GB); the file holds a few bytes of them."""
    header = nib.Nifti1Header()
    header.set_data_shape((2048, 2048, 2048))
    header.set_data_dtype(np.float32)
    header["vox_offset"] = 352
    path.write_bytes(gzip.compress(header.binaryblock + b"\0" * 4 + b"\0" * 1024))


HOSTILE = {
    "RGB image": (lambda r: nib.save(nib.Nifti1Image(_rgb((SIZE,) * 3), np.eye(4)), r / "image" / "img_001.nii.gz"),
                  "img_001.nii.gz", "colour image"),
    "complex image": (lambda r: nib.save(nib.Nifti1Image(np.ones((SIZE,) * 3, np.complex64) * (1 + 2j), np.eye(4)),
                                         r / "image" / "img_002.nii.gz"), "img_002.nii.gz", "complex-valued"),
    "2048^3 header": (lambda r: _huge_header(r / "image" / "img_000.nii.gz"), "img_000.nii.gz", "2048x2048x2048"),
    "truncated .nii": (lambda r: (r / "image" / "img_000.nii.gz").unlink() or nib.save(
        nib.Nifti1Image(np.ones((SIZE,) * 3, np.float32), np.eye(4)), r / "image" / "img_000.nii") or (
        r / "image" / "img_000.nii").write_bytes((r / "image" / "img_000.nii").read_bytes()[:2000]),
        "img_000.nii", "truncated"),
    "symlink loop": (lambda r: os.symlink("img_009.nii.gz", r / "image" / "img_009.nii.gz"), "img_009.nii.gz",
                     "symlink loop"),
    "broken symlink": (lambda r: os.symlink("gone.nii.gz", r / "mask" / "mask_009.nii.gz"), "mask_009.nii.gz",
                       "broken symlink"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_files_are_one_line(ref, case):
    make, name, why = HOSTILE[case]
    make(ref)
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as e:
            open_dataset(str(ref), size=SIZE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = _one_line(e)
    assert name in message and why in message, message
    assert peak < 200e6  # refused from the header, nothing of the claimed size allocated


def test_symlinked_data_folder_loop(tmp_path):
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(DataError, match="symlink loop"):
        open_dataset(str(tmp_path / "loop"), size=SIZE)


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["sweep", "--configs", "baseline"]])
def test_empty_data_name_is_refused(capsys, tmp_path, command):
    with pytest.raises(DataError, match="empty data set name"):
        open_dataset("", size=SIZE)
    assert main([*command, "--out", str(tmp_path / "out"), "--data", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "empty data set name" in err
    if command[0] == "sweep":
        assert not (tmp_path / "out").exists()  # refused before anything was measured


def test_brats_2023_names(tmp_path):
    export_folder(tmp_path / "b23", pairs=1, size=BRATS_DISK, layout="brats2023")
    assert sorted(p.name for p in (tmp_path / "b23").iterdir()) == ["seg", "t1c", "t1n", "t2f", "t2w"]
    ds = open_dataset(str(tmp_path / "b23"), size=BRATS_SIZE)
    assert isinstance(ds, BratsCases) and ds.names == ["BraTS-GLI-00000-000"]
    assert ds.raw(0)[0].shape == (4, *BRATS_SIZE)


# workers

def test_workers_stop_on_an_error(ref, request):
    ds = NiftiPairs(ref, size=SIZE)
    path = ref / "image" / "img_001.nii.gz"
    path.write_bytes(b"garbage" * 40)  # after the folder was checked: the worker meets it
    with pytest.raises(DataError) as e:
        for _ in DeviceLoader(ds, [0, 1, 2, 0], device="cpu", workers=2):
            pass
    assert "img_001.nii.gz" in _one_line(e)
    assert not _children_gone(request)


def test_workers_stop_on_keyboard_interrupt_in_the_loop(ref, request):
    ds = NiftiPairs(ref, size=SIZE)
    with pytest.raises(KeyboardInterrupt):
        for k, _ in enumerate(DeviceLoader(ds, [0, 1, 2] * 50, device="cpu", workers=2)):
            if k == 2:
                raise KeyboardInterrupt
    assert not _children_gone(request)


def test_ctrl_c_leaves_no_worker_behind(ref, tmp_path):
    """A real SIGINT to a process whose loop consumes slowly: it exits, and so do its workers."""
    script = textwrap.dedent(f"""
        import os, sys, time, psutil
        from medddpm.train.data import NiftiPairs
        from medddpm.train.loader import DeviceLoader
        ds = NiftiPairs({str(ref)!r}, size={SIZE})
        for k, _ in enumerate(DeviceLoader(ds, [0, 1, 2] * 1000, device="cpu", workers=2)):
            if k == 1:
                print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGINT)
    try:
        # generous: on a loaded 2-core machine the workers' shutdown and the interpreter's exit share the cores with
        # other tests' processes (30 s ran out beside two gloo ranks)
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 120 s after SIGINT: {proc.communicate()[1][-3000:]}") from None
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers)


# memory over many items: what would have caught a step time that grows

def test_loading_many_items_does_not_grow_memory(brats):
    ds = BratsCases(brats, size=BRATS_SIZE)
    order = [0, 1] * 60
    tracemalloc.start()
    try:
        loader = iter(DeviceLoader(ds, order, device="cpu", workers=0))
        for _ in range(20):
            next(loader)
        settled = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            next(loader)
        grown = tracemalloc.get_traced_memory()[0] - settled
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"{grown} bytes more after 100 more items"


# export-data

def test_export_data_round_trips_through_the_loader(tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export-data", "--out", str(out), "--pairs", "2", "--size", "16", "--seed", "3"]) == 0
    assert "wrote 4 files" in capsys.readouterr().out
    img = nib.load(out / "image" / "img_003.nii.gz")
    assert img.get_data_dtype() == np.int16 and nib.aff2axcodes(img.affine) != ("R", "A", "S")  # needs reorienting
    ds = open_dataset(str(out), size=16)
    for i, seed in enumerate((3, 4)):
        image, labels = make_mni_pair(seed, size=16)
        got_image, got_labels = ds.raw(i)
        assert torch.equal(got_labels, torch.from_numpy(labels))
        scanner = np.rint((image + 1) * 500).astype(np.float32)
        assert torch.equal(got_image[0], torch.from_numpy(nifti.normalize(scanner)))
    assert main(["export-data", "--out", str(out), "--pairs", "1"]) == 2  # never into a folder holding files
    assert "not empty" in capsys.readouterr().err


def test_export_brats_round_trips(brats):
    ds = open_dataset(str(brats), size=BRATS_SIZE)
    assert nib.load(ds.cases[0]["t1"]).get_data_dtype() == np.float64
    image, labels = make_brats_case(1, size=BRATS_DISK, spacing_mm=1.2)
    got_image, got_labels = ds.raw(1)
    assert torch.equal(got_labels, torch.from_numpy(labels[2:18, 2:18, 1:13]))
    want = nifti.normalize(image[2].astype(np.float32))[2:18, 2:18, 1:13]  # T2
    assert torch.equal(got_image[2], torch.from_numpy(want))


# end-to-end timing in the measurement

def test_end_to_end_timing_feeds_the_step(ref, request):
    from medddpm.measure.timing.clocks import ClockMonitor
    from medddpm.measure.timing.end_to_end import drift, loader_rate, time_end_to_end
    from medddpm.model.unet import ModelSpec
    from medddpm.train.engine import Engine

    ds = NiftiPairs(ref, size=8)
    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1,), attention_ds=())
    engine = Engine(spec, "baseline", device="cpu", seed=0)
    before = engine.step_count
    timing = time_end_to_end(engine, ds, warmup=0, steps=2, progress=False)
    assert len(timing["step_ms"]) == 2 and min(timing["step_ms"]) > 0
    assert engine.step_count == before + 2  # every item fed a step
    assert not _children_gone(request)
    assert loader_rate(ds, device="cpu", items=6, workers=1) > 0
    assert drift([10.0] * 8 + [11.0] * 8) == pytest.approx(0.1) and np.isnan(drift([1.0] * 7))
    summary = ClockMonitor("cpu").summary()  # no GPU: every column missing, no error
    assert summary["throttle_reasons"] == "" and np.isnan(summary["sm_clock_mhz"])


# the book's end-to-end view

def _runs(**columns):
    base = {"status": "ok", "gpu_slug": "nvidia-h200", "config": "best", "shape": "128x128x128", "data_source": "mni",
            "train_median_ms": 50.0, "e2e_median_ms": float("nan"), "loader_items_per_s": float("nan"),
            "cache_build_s": float("nan"), "e2e_drift": float("nan"), "throttle_reasons": "",
            "throttled_share": float("nan")}
    return pd.DataFrame([base | row for row in columns.get("rows", [{}])])


def test_end_to_end_view_says_when_there_is_nothing():
    from medddpm.report.end_to_end import end_to_end_table, end_to_end_view

    run = _runs()
    assert end_to_end_table(run).empty
    assert "No run in the data was trained from a NIfTI folder" in end_to_end_view(run).data


def test_end_to_end_view_shows_both_times_and_the_throttled():
    from medddpm.report.end_to_end import end_to_end_table, end_to_end_view

    run = _runs(rows=[{}, {"data_source": "folder:heads", "e2e_median_ms": 52.0, "loader_items_per_s": 40.0,
                           "cache_build_s": 12.0, "e2e_drift": 0.01},
                      {"config": "baseline", "data_source": "folder:brats", "e2e_median_ms": 80.0,
                       "throttle_reasons": "sw_power_cap", "throttled_share": 0.25}])
    table = end_to_end_table(run)
    assert list(table["data_source"]) == ["folder:brats", "folder:heads"]
    assert table["ratio"].tolist() == pytest.approx([1.6, 1.04])
    text = end_to_end_view(run).data
    assert "1.04x), within the 10% target" in text and "1.60x), outside the 10% target" in text
    assert "sw_power_cap, 25% of the samples" in text and "No run" not in text


@pytest.mark.parametrize("fault", ["read-only", "full disk"])
def test_unwritable_cache_is_one_line(ref, tmp_path, monkeypatch, fault):
    from medddpm.train import cache

    if fault == "read-only":
        (tmp_path / "cache").write_text("a file where the cache folder goes")
    else:
        def full(path, write):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(cache, "atomic_write", full)
    with pytest.raises(DataError) as e:
        NiftiPairs(ref, size=SIZE)
    message = _one_line(e)
    assert "cannot write the volume cache" in message and "MEDDDPM_CACHE" in message
    if fault == "full disk":
        assert "No space left on device" in message


def test_training_loop_stops_its_workers_on_ctrl_c(ref, tmp_path, monkeypatch, request):
    """Ctrl-C inside the training loop: its workers stop while the traceback (which keeps the loop's variables alive,
    as a notebook keeps the last one) is still held."""
    from medddpm.model.unet import ModelSpec
    from medddpm.train import engine as engine_module
    from medddpm.train.loop import train

    ds = NiftiPairs(ref, size=8)
    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1,), attention_ds=())
    calls = []

    def interrupted(self, batches):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module.Engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt) as e:
        train(spec, "baseline", ds, out_dir=tmp_path / "run", steps=3, progress=False)
    assert calls and e.traceback  # the traceback, and the loop's frame with it, still held here
    assert not _children_gone(request)
