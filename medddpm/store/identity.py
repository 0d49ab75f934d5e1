"""A run's identity: everything that defines what it measured, recorded in its row (`run.identity`).

The identity is a JSON object of the configuration and its switches, the preset, the input shape, the
batch, the warm-up and timed micro-steps and the denoising steps, the data source and a fingerprint of it, the label
channels, the device label and the group. Two runs of one identity measure the same thing: a sweep skips
a configuration whose folder holds its identity, and measures any other identity beside it, in
``<folder>~<key>`` (`folder_name`), never over it. What runs after the training steps (the phases, Nsight
Compute's time) is not part of it: it decides which tables a run has, not what they measure.

A row written before identities were recorded holds ''; it counts as the default identity of its folder
name (the preset's size, micro-steps and data, the configuration's switches as they are now), which is what
every such row measured: no sweep before then changed them for the main runs.

The switches are recorded where they differ from their default, "off" (`canonical`): a switch added later is off in
every run recorded before it, and one retired was off in every run the product can still make, so neither changes
an identity. Identities recorded with every switch then existing compare, and key their folders, in that form.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from medddpm.configs import Config, switches
from medddpm.store.layout import SEPARATOR
from medddpm.store.schema import RETIRED_SWITCHES

# Each switch's "off" value: the product's own, then the retired ones' (`schema.RETIRED_SWITCHES`)
_OFF = {f.name: f.default for f in switches(Config)} | RETIRED_SWITCHES


def data_fingerprint(source: str) -> str:
    """A fingerprint of a data set: its name for an embedded one (its content ships with the package);
    for a folder, a hash of every file's path inside it, size and modification time (reading every
    volume of a large data set would take longer than a smoke run)."""
    path = Path(source)
    if not path.is_dir():
        return str(source)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath, name)
            try:
                st = p.stat()
            except OSError:
                continue
            h.update(f"{p.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def run_identity(*, config: str, switches: dict, preset: str, shape: str, batch: int, warmup: int, steps: int,
                 sample_steps: int, data: str, mask_channels: int | None, label: str, group: str = "",
                 resample_mask: bool = False) -> dict:
    """The identity of a run as a plain dict (`encode` makes it the row's text). `warmup` and `steps` count training
    micro-steps; the key stays `steps`, as every recorded identity spells it. `resample_mask` (a folder's masks
    resampled onto their images' grids) is recorded where it is on only, so that every identity recorded before it
    existed stays the same."""
    embedded = not Path(data).is_dir()
    return {"config": config, "switches": switches_on(switches), "preset": preset, "shape": shape,
            "batch": int(batch), "warmup": int(warmup), "steps": int(steps), "sample_steps": int(sample_steps),
            "data": str(data) if embedded else str(Path(data).resolve()), "data_fingerprint": data_fingerprint(data),
            "mask_channels": mask_channels, "label": label, "group": group} | (
        {"resample_mask": "nearest"} if resample_mask else {})


def switches_on(switches: dict) -> dict:
    """The switches away from their "off" value, sorted (a name the product never had stays, whatever its value)."""
    return {k: v for k, v in sorted(switches.items()) if k not in _OFF or v != _OFF[k]}


def canonical(text: str) -> str:
    """An encoded identity in the form `run_identity` records now: its switches only where on. '' (a row from
    before identities) and text that is not an identity's JSON stay as they are."""
    try:
        identity = json.loads(text)
    except ValueError:
        return text
    if not isinstance(identity, dict) or not isinstance(identity.get("switches"), dict):
        return text
    return encode(identity | {"switches": switches_on(identity["switches"])})


def same(a: str, b: str) -> bool:
    """Whether two encoded identities define the same run (`canonical`)."""
    return canonical(a) == canonical(b)


def encode(identity: dict) -> str:
    """The identity as the row records it: canonical JSON (sorted keys, no spaces)."""
    return json.dumps(identity, sort_keys=True, separators=(",", ":"))


def key(text: str) -> str:
    """A short hash of an encoded identity (`canonical`), the suffix of its folder."""
    return hashlib.sha256(canonical(text).encode()).hexdigest()[:8]


def folder_name(plain: str, identity: str, default: str) -> str:
    """The folder of a run of `identity` whose configuration, preset, batch and width name `plain`: `plain`
    itself for the default identity, ``<plain>~<key>`` for any other."""
    return plain if same(identity, default) else f"{plain}{SEPARATOR}{key(identity)}"


def split_folder(name: str) -> tuple[str, str]:
    """('baseline~1a2b3c4d' ->) the plain folder name and the key ('' for a plain name)."""
    plain, _, suffix = name.partition(SEPARATOR)
    return plain, suffix
