"""Checkpoints written whole and proved whole when read, read without running code, and one-line messages for
file-system faults.

A checkpoint holds tensors, dicts, lists, tuples, numbers, strings and booleans only (the model's, the
optimizer's, the EMA's and the scaler's state, the RNG states as uint8 tensors, the run's spec, switches and
hyperparameters), so `torch.load(weights_only=True)` reads it: a crafted file's pickled calls are refused
instead of run.

Its last entry is a digest of everything before it (`digest`: SHA-256 over every tensor's bytes and every other
value, in a defined order). A file whose bytes were changed after it was written (a disk's or a copy's fault, a
tool that wrote into it) still unzips and unpickles, and its weights, NaN or finite garbage, would sample an
empty volume or train on from nonsense and be saved again as the new checkpoint: reading recomputes the digest
and refuses the file in one line where the two differ. The digest of the paper model's checkpoint (0.64 GB of
tensors: weights, EMA and Adam's moments) takes 0.8 to 0.95 s on one core of a 2-core AVX2 machine (2 s while
other work shares it), on writing and again on reading, where serialising it takes 1.2 to 1.9 s and reading it
1.6; a checkpoint is written every 500 steps, minutes of training apart.

A checkpoint written before checkpoints carried a digest (`UndigestedCheckpoint`) is read, since the training
behind it may have taken days: every floating-point value is checked to be finite (what a corrupt file most
often holds), a one-line warning says that nothing more could be checked, and the next checkpoint of the run
carries a digest.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from medddpm.errors import Notice, UserError
from medddpm.store.storage import NotRegularFile, StorageError, atomic_write, open_regular, os_error_reason

CHECKPOINT = "checkpoint.pt"
REQUIRED = ("model", "opt", "step", "spec", "config")  # what every checkpoint of `train` holds
DIGEST = "digest"  # the last entry of a checkpoint: "sha256:<hex>" of the entries before it


class CheckpointError(UserError):
    """A checkpoint that is not read: unreadable, not a checkpoint, changed since it was written (one line)."""


class UndigestedCheckpoint(Notice):
    """A checkpoint without a digest (written before checkpoints carried one) was read: only its values' being
    finite could be checked."""


def os_error_line(path: str | os.PathLike, e: OSError, doing: str) -> str:
    """One line for an OSError while `doing` something at `path`: a full disk says so (`storage.os_error_reason`)."""
    return f"{path}: {os_error_reason(e) or e.strerror or type(e).__name__} while {doing}"


@contextmanager
def writing(path: str | os.PathLike, doing: str) -> Iterator[None]:
    """Turn an OSError inside the block into a StorageError of one line (the command line prints it)."""
    try:
        yield
    except OSError as e:
        raise StorageError(os_error_line(path, e, doing)) from None


def _leaves(value, path: str = "") -> Iterator[tuple[str, object]]:
    """(path, value) of every tensor, number, string or boolean in `value`, dicts in the order of their keys' repr
    (the same however the dict was built), lists and tuples in their order."""
    if isinstance(value, dict):
        for k in sorted(value, key=repr):
            yield from _leaves(value[k], f"{path}/{k!r}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def digest(state: dict) -> str:
    """'sha256:<hex>' of a checkpoint's entries but its digest: each tensor's place, dtype, shape and bytes (read
    on the CPU, in C order), and each other value's place, type and repr."""
    h = hashlib.sha256()
    for path, value in _leaves({k: v for k, v in state.items() if k != DIGEST}):
        if isinstance(value, torch.Tensor):
            t = value.detach()
            h.update(f"{path}\0tensor\0{t.dtype}\0{tuple(t.shape)}\n".encode())
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(f"{path}\0{type(value).__name__}\0{value!r}\n".encode())
    return f"sha256:{h.hexdigest()}"


def save(state: dict, path: str | os.PathLike) -> None:
    """Write `state` atomically, its digest last. It is serialised in memory first: torch's zip writer reports a
    full disk as 'unexpected pos', while a plain write of the bytes raises the OSError that names it."""
    state = {k: v for k, v in state.items() if k != DIGEST}
    state[DIGEST] = digest(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    with writing(path, "writing the checkpoint"):
        atomic_write(path, lambda f: f.write(data))


def read(path: str | os.PathLike, *, map_location: torch.device | str = "cpu") -> dict:
    """A training checkpoint, read with `weights_only=True` and proved whole by its digest (which it returns
    without); a CheckpointError of one line for a file that is truncated, corrupt, changed since it was written,
    not a checkpoint, or asks to run code, and a NotRegularFile for a path that is not a regular file."""
    path = Path(path)
    try:
        with open_regular(path, "a checkpoint") as f:
            state = torch.load(f, map_location=map_location, weights_only=True)
    except (FileNotFoundError, NotRegularFile):
        raise
    except OSError as e:
        raise CheckpointError(os_error_line(path, e, "reading the checkpoint")) from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...; one line
        raise CheckpointError(f"{path}: not a readable training checkpoint, refused ({_reason(e)})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise CheckpointError(f"{path}: not a training checkpoint (it lacks "
                              f"{', '.join(k for k in REQUIRED if not isinstance(state, dict) or k not in state)})")
    recorded = state.pop(DIGEST, None)
    if recorded is None:
        _check_finite(path, state)
        warnings.warn(f"{path} carries no digest (it was written before checkpoints carried one): its values are "
                      "finite, nothing more could be checked; the next checkpoint written carries one",
                      UndigestedCheckpoint, stacklevel=2)
    elif recorded != digest(state):
        raise CheckpointError(f"{path}: its contents differ from the digest written with them (the file was changed "
                              "or damaged after it was saved), refused")
    return state


def _check_finite(path: Path, state: dict) -> None:
    for where, value in _leaves(state):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            raise CheckpointError(f"{path}: {where.lstrip('/')} holds NaN or infinite values, and the file carries no "
                                  "digest to tell damage from a diverged run's weights; refused")


def _reason(e: Exception) -> str:
    """The cause in torch's message, without its advice (which suggests loading the file with weights_only=False)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"WeightsUnpickler error:\s*(.+)", text, re.S)
    reason = (m.group(1) if m else text).strip()
    g = re.match(r"Unsupported global: GLOBAL (\S+)", reason)
    if g:
        return f"it asks to call {g.group(1)}, which a checkpoint never does"
    first = re.split(r"\.\s|\n", reason, maxsplit=1)[0].strip()
    return first[:200] or type(e).__name__


def load_error(e: Exception) -> str:
    """The cause of a `load_state_dict` failure in one line. torch's message opens with 'Error(s) in loading
    state_dict for UNet3D:' and lists each mismatch on a line of its own: the first is kept whole, the rest
    counted."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if lines and re.match(r"Error\(s\) in loading state_dict for \w+:$", lines[0]):
        lines = lines[1:]
    if not lines:
        return type(e).__name__
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return lines[0].rstrip(".")[:300] + more


def cpu_rng_state(state: torch.Tensor) -> torch.Tensor:
    """An RNG state as `torch.set_rng_state` and `torch.cuda.set_rng_state` take it: a CPU uint8 tensor,
    whatever device `map_location` put it on."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.ndim != 1:
        raise ValueError(f"an RNG state must be a 1-D uint8 tensor, got {type(state).__name__}"
                         + (f" of {state.dtype}, shape {tuple(state.shape)}" if isinstance(state, torch.Tensor) else ""))
    if state.device.type == "meta":
        raise ValueError("an RNG state on the meta device holds no values")
    return state.to("cpu")
