"""Checkpoints written whole and read without running code, and one-line messages for file-system faults.

A checkpoint holds tensors, dicts, lists, tuples, numbers, strings and booleans only (the model's, the
optimizer's, the EMA's and the scaler's state, the RNG states as uint8 tensors, the run's spec, switches and
hyperparameters), so `torch.load(weights_only=True)` reads it: a crafted file's pickled calls are refused
instead of run.
"""

from __future__ import annotations

import io
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from medddpm.store.storage import atomic_write, os_error_reason

CHECKPOINT = "checkpoint.pt"
REQUIRED = ("model", "opt", "step", "spec", "config")  # what every checkpoint of `train` holds


def os_error_line(path: str | os.PathLike, e: OSError, doing: str) -> str:
    """One line for an OSError while `doing` something at `path`: a full disk says so (`storage.os_error_reason`)."""
    return f"{path}: {os_error_reason(e) or e.strerror or type(e).__name__} while {doing}"


@contextmanager
def writing(path: str | os.PathLike, doing: str) -> Iterator[None]:
    """Turn an OSError inside the block into a ValueError of one line (the command line prints it)."""
    try:
        yield
    except OSError as e:
        raise ValueError(os_error_line(path, e, doing)) from None


def save(state: dict, path: str | os.PathLike) -> None:
    """Write `state` atomically. It is serialised in memory first: torch's zip writer reports a full disk as
    'unexpected pos', while a plain write of the bytes raises the OSError that names it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    with writing(path, "writing the checkpoint"):
        atomic_write(path, lambda f: f.write(data))


def read(path: str | os.PathLike, *, map_location: torch.device | str = "cpu") -> dict:
    """A training checkpoint, read with `weights_only=True`; a ValueError of one line for a file that is
    truncated, corrupt, not a checkpoint, or asks to run code."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(os_error_line(path, e, "reading the checkpoint")) from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...; one line
        raise ValueError(f"{path}: not a readable training checkpoint, refused ({_reason(e)})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise ValueError(f"{path}: not a training checkpoint (it lacks {', '.join(k for k in REQUIRED if not isinstance(state, dict) or k not in state)})")
    return state


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


def cpu_rng_state(state: torch.Tensor) -> torch.Tensor:
    """An RNG state as `torch.set_rng_state` and `torch.cuda.set_rng_state` take it: a CPU uint8 tensor,
    whatever device `map_location` put it on."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.ndim != 1:
        raise ValueError(f"an RNG state must be a 1-D uint8 tensor, got {type(state).__name__}"
                         + (f" of {state.dtype}, shape {tuple(state.shape)}" if isinstance(state, torch.Tensor) else ""))
    if state.device.type == "meta":
        raise ValueError("an RNG state on the meta device holds no values")
    return state.to("cpu")
