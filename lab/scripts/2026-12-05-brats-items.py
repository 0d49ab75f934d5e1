#!/usr/bin/env python3
"""Lab benchmark of 2026-12-05: BraTS-size items, the on-thread reader (every volume decoded each step, as before
the volume cache) against the cached loader: seconds per item, RSS over N items, the loader's rate with 2 workers.
    PYTHONPATH=. .venv/bin/python lab/scripts/2026-12-05-brats-items.py [N]   (exports 2 cases into runs/brats-items/)
"""
import os, sys, time
import numpy as np, psutil, torch
from pathlib import Path
from medddpm.train.export import export_folder
from medddpm.train import nifti
from medddpm.train.folders import BratsCases, _crop_or_pad
from medddpm.train.loader import one_hot_condition, DeviceLoader
from medddpm.train.synthetic import BRATS_MODALITIES

root = Path("runs/brats-items/brats")
if not root.exists():
    t = time.time(); export_folder(root, pairs=2, layout="brats"); print("export", round(time.time() - t, 1), "s", flush=True)
proc = psutil.Process()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 24

def old_item(case):  # the reader before the cache: every volume decoded on the training thread, every step
    shape = (192, 192, 144)
    image = np.stack([_crop_or_pad(nifti.normalize(np.asarray(__import__("nibabel").load(case[m]).dataobj).astype(np.float32)), shape, -1.0)
                      for m in BRATS_MODALITIES])
    labels = _crop_or_pad(np.asarray(__import__("nibabel").load(case["seg"]).dataobj).astype(np.int64), shape, 0)
    return torch.from_numpy(image), one_hot_condition(labels, num_classes=4)

os.environ["MEDDDPM_CACHE"] = "runs/brats-items/cache"
t = time.time(); ds = BratsCases(root); print("open (cache build)", round(time.time() - t, 2), "s; cache_build_s", round(ds.cache_build_s, 2), flush=True)
res = {}
times, rss = [], []
for i in range(N):
    t = time.perf_counter(); x = old_item(ds.cases[i % 2]); times.append(time.perf_counter() - t); del x
    rss.append(proc.memory_info().rss / 2**20)
res["old"] = (times, rss)
print("old   per item s: first4 %s last4 %s; RSS MB first %.0f max %.0f last %.0f" % (np.round(times[:4], 2), np.round(times[-4:], 2), rss[0], max(rss), rss[-1]), flush=True)
times, rss = [], []
for i in range(N):
    t = time.perf_counter(); img, lab = ds.raw(i % 2); c = one_hot_condition(lab, num_classes=4, check=False); times.append(time.perf_counter() - t); del img, lab, c
    rss.append(proc.memory_info().rss / 2**20)
print("cache per item s: first4 %s last4 %s; RSS MB first %.0f max %.0f last %.0f" % (np.round(times[:4], 3), np.round(times[-4:], 3), rss[0], max(rss), rss[-1]), flush=True)
t = time.perf_counter(); n = sum(1 for _ in DeviceLoader(ds, [i % 2 for i in range(N)], device="cpu", workers=2)); dt = time.perf_counter() - t
print("DeviceLoader 2 workers: %.1f items/s (one-hot included)" % (n / dt), flush=True)
