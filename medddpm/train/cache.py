"""A disk cache of preprocessed volumes: each item of a NIfTI folder decoded, reoriented and normalised once.

An entry holds one item's image (float32, C x D x H x W), its label map (uint8, D x H x W) and the label counts of
its source label map, as two uncompressed .npy files read back memory-mapped (no decompression, no copy until the
item is used) and a JSON file written last, whose presence marks the entry complete. The key hashes the cache
format, the preprocessing parameters and each source file's resolved path, size and modification time, so an
edited source or a changed preprocessing makes a new entry and the old one is never read again. Every file is
written atomically; an entry that does not read back (truncated, corrupt, half deleted) is rebuilt from its
sources.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from medddpm.store.storage import StorageError, atomic_write, check_regular, read_regular
from medddpm.train.nifti import DataError

# bump when an entry's layout, the meaning of a parameter or the checks a build makes change (2: images checked
# finite after their conversion to float32, so no entry built before holds an image that overflowed)
FORMAT = 2


class Entry(NamedTuple):
    image: np.ndarray   # float32 (C, D, H, W), memory-mapped read-only
    labels: np.ndarray  # uint8 (D, H, W), memory-mapped read-only
    counts: dict[int, int]  # voxels of each label in the source label map, before any resizing
    build_s: float  # what building the entry took, when it was built


Built = tuple[np.ndarray, np.ndarray, dict[int, int]]  # what a build function returns: image, labels, counts


def entry_key(sources: Sequence[Path], params: dict) -> str:
    """The hash of the format, `params` (JSON-serialisable) and each source's resolved path, size and mtime."""
    files = []
    for path in sources:
        st = os.stat(path)
        files.append([str(Path(path).resolve()), st.st_size, st.st_mtime_ns])
    text = json.dumps({"format": FORMAT, "params": params, "files": files}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class VolumeCache:
    """Entries under `root`; `get` returns an item's entry, building and storing it first if needed."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.hits = self.builds = self.rebuilds = 0
        self.build_s = 0.0  # time spent building entries (decoding, checking, normalising, writing)

    def paths(self, key: str) -> tuple[Path, Path, Path]:
        return (self.root / f"{key}.image.npy", self.root / f"{key}.labels.npy", self.root / f"{key}.json")

    def load(self, key: str) -> Entry | None:
        """The entry if it is complete and reads back with the shapes and types its JSON file records, else None."""
        image_path, labels_path, meta_path = self.paths(key)
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(read_regular(meta_path))  # a named pipe or a folder there is rebuilt, never waited on
            for path in (image_path, labels_path):
                check_regular(path)
            image = np.load(image_path, mmap_mode="r", allow_pickle=False)
            labels = np.load(labels_path, mmap_mode="r", allow_pickle=False)
            if (list(image.shape) != meta["image_shape"] or list(labels.shape) != meta["labels_shape"]
                    or image.dtype != np.float32 or labels.dtype != np.uint8):
                raise ValueError("shape or type differs from the entry's record")
            counts = {int(k): int(v) for k, v in meta["counts"].items()}
            build_s = float(meta["build_s"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # truncated or overwritten: unreadable as it stands, so it is rebuilt from the sources
            self.rebuilds += 1
            for path in (meta_path, image_path, labels_path):
                path.unlink(missing_ok=True)
            return None
        return Entry(image, labels, counts, build_s)

    def store(self, key: str, built: Built, build_s: float) -> Entry:
        image, labels, counts = built
        image = np.ascontiguousarray(image, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.uint8)
        image_path, labels_path, meta_path = self.paths(key)
        meta = {"image_shape": list(image.shape), "labels_shape": list(labels.shape),
                "counts": {str(k): v for k, v in sorted(counts.items())}, "build_s": build_s}
        try:
            atomic_write(image_path, lambda f: np.save(f, image, allow_pickle=False))
            atomic_write(labels_path, lambda f: np.save(f, labels, allow_pickle=False))
            atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))  # last: the entry is complete
        except (OSError, StorageError) as e:  # read-only, full disk, a file where the folder should be
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DataError(f"{self.root}: cannot write the volume cache ({why}); set MEDDDPM_CACHE to a writable "
                            "folder with room") from None
        return Entry(image, labels, dict(counts), build_s)

    def get(self, sources: Sequence[Path], params: dict, build: Callable[[], Built]) -> Entry:
        key = entry_key(sources, params)
        entry = self.load(key)
        if entry is not None:
            self.hits += 1
            return entry
        t0 = time.perf_counter()
        built = build()
        entry = self.store(key, built, time.perf_counter() - t0)
        self.builds += 1
        self.build_s += time.perf_counter() - t0
        return entry
