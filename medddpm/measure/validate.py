"""Checks of a user's strings that reach a job script, a path or a folder name (one-line ValueErrors)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq

from medddpm.measure.env import gpu_slug

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def check_text(option: str, value: object) -> None:
    """A user's string that reaches a job script, a path or a folder name holds no control character: a
    newline would end the script's comment or #SBATCH line and run the rest as a command."""
    if isinstance(value, str) and _CONTROL.search(value):
        raise ValueError(f"{option} {value!r}: control characters (such as a newline) are not allowed")


# A label names a folder (data/<label>/) and starts every run id: a file system takes names of 255 bytes at most,
# and a legend or a table column in the book is read at a glance. A device type and a host name (`<type>-<host>`,
# the longest label the sweep derives itself) fit well within it.
MAX_LABEL = 100


def check_label(label: str, option: str = "--gpu-label") -> str:
    """A device label: no control characters, a letter or a digit (its slug names the folder), at most
    `MAX_LABEL` characters."""
    check_text(option, label)
    if len(label) > MAX_LABEL:
        raise ValueError(f"{option} {label[:24]!r}... ({len(label)} characters): a label is at most {MAX_LABEL} "
                         "characters (it names a folder)")
    if not gpu_slug(label):
        raise ValueError(f"{option} {label!r}: a label needs a letter or a digit")
    return label


def check_label_device(label: str, kind: str, known: set[str], option: str = "--gpu-label") -> None:
    """A label that names another device type than the one measured is refused: `nvidia-h200` given on an H100
    would file an H100's runs and roofs as an H200's, beside that card's real rows. `kind` is the device's own type,
    `known` the device types the data and the datasheets name; a label is its type, or `<type>-<host>`."""
    slug = gpu_slug(label)
    if slug == kind or slug.startswith(kind + "-"):
        return
    other = max((t for t in known if t != kind and (slug == t or slug.startswith(t + "-"))), key=len, default=None)
    if other is not None:
        raise ValueError(f"{option} {label!r} names a {other} but this device is a {kind}: a label names the device "
                         "it measures (its type, or <type>-<host>)")


def known_device_types(out: str | Path) -> set[str]:
    """The device types the data under `out` records (its runs' and roofs' `gpu_type`) and the datasheets name."""
    from medddpm.analysis.roofs import DATASHEET

    known = set(DATASHEET) | {"cpu"}
    for p in [*Path(out).glob("*/*/run.parquet"), *Path(out).glob("*/roofs.parquet")]:
        try:
            if "gpu_type" in pq.read_schema(p).names:
                known |= {str(t) for t in pq.read_table(p, columns=["gpu_type"]).column("gpu_type").to_pylist() if t}
        except (OSError, ValueError):
            continue
    return known
