"""The roofs every page reads: each card's DRAM bandwidth and dense matmul rates, measured on it where its label
has a ``roofs.parquet`` (`medddpm.measure.timing.roofs`), else its datasheet's, and always labelled with which.

Pages never type a peak in: the floors of the step-time pages, the efficiency of the first page, the roofline
and the cross-card model take their roofs from `card_roofs` here, so a user's GPU gets its roofs from its own
measurement. The datasheet values stay beside the measured ones (`roofs_view`), as the source a reader checks
a measurement against.
"""

from __future__ import annotations

import pandas as pd

from medddpm.analysis import roofs as ar
from medddpm.report.loading import Data, gpu_types, is_cpu

ROOF_LABELS = {"dram": "DRAM bandwidth", "fp32": "FP32 (CUDA cores, strict)", "tf32": "TF32 tensor cores",
               "bf16": "bf16 tensor cores", "fp16": "fp16 tensor cores"}
# FP32 peaks of the paper's three GPUs, from their datasheets: what the first page counts training time with.
DATASHEET_FP32 = {ar.DATASHEET[t].name: ar.DATASHEET[t].roofs["fp32"] for t in ar.PAPER_CARDS}


def card_roofs(slug: str, run: pd.DataFrame | None = None, roofs: pd.DataFrame | None = None) -> dict[str, ar.Roof]:
    """The roofs of the card behind a label (`analysis.roofs.card_roofs`): its device type read from its runs
    (a label `nvidia-h200-<host>` is an H200), its own measurement first, the datasheet for the rest."""
    kind = gpu_types(run if run is not None else pd.DataFrame(), roofs).get(slug, slug)
    return ar.card_roofs(roofs if roofs is not None else pd.DataFrame(), slug, kind)


def peaks_of(slug: str, run: pd.DataFrame | None = None,
             roofs: pd.DataFrame | None = None) -> dict[str, tuple[float, str]]:
    """The card's compute roofs (FLOP/s) per precision, each with its source in words ("measured under ..." or
    "datasheet: ...")."""
    return {r: (roof.value, _source_text(roof)) for r, roof in card_roofs(slug, run, roofs).items()
            if r in ar.COMPUTE}


def bandwidth_of(slug: str, run: pd.DataFrame | None = None,
                 roofs: pd.DataFrame | None = None) -> tuple[float, str] | None:
    roof = card_roofs(slug, run, roofs).get("dram")
    return (roof.value, _source_text(roof)) if roof else None


def _source_text(roof: ar.Roof) -> str:
    return roof.detail if roof.source == ar.MEASURED else f"datasheet: {roof.detail}"


def gpu_labels(data: Data) -> list[str]:
    """Every GPU label of the data: labels with runs or bench timings, and labels with measured roofs only."""
    found = set(data.run["gpu_slug"]) | set(data.roofs["gpu_slug"])
    found |= set(data.bench["gpu_slug"]) if not data.bench.empty else set()
    cpu = set(data.run.loc[data.run["gpu_name"] == "cpu", "gpu_slug"]) if not data.run.empty else set()
    return sorted(s for s in found if not is_cpu(s) and s not in cpu)


def roofs_view(data: Data) -> pd.DataFrame:
    """A row per GPU label and roof: the value in use (measured, else the datasheet's), its source, the spread of
    the measurement, and the datasheet's value beside it with the measured share of it."""
    cols = ["gpu_slug", "gpu_type", "roof", "what", "unit", "value", "p10", "p90", "source", "datasheet",
            "of_datasheet", "detail"]
    types = gpu_types(data.run, data.roofs)
    rows = []
    for slug in gpu_labels(data):
        kind = types.get(slug, slug)
        sheet = ar.DATASHEET.get(kind)
        for r, roof in ar.card_roofs(data.roofs, slug, kind).items():
            ds = sheet.roofs.get(r) if sheet else None
            rows.append({"gpu_slug": slug, "gpu_type": kind, "roof": r, "what": ROOF_LABELS[r], "unit": ar.UNITS[r],
                         "value": roof.value, "p10": roof.p10, "p90": roof.p90, "source": roof.source,
                         "datasheet": ds, "of_datasheet": roof.value / ds if ds and roof.source == ar.MEASURED else None,
                         "detail": roof.detail})
    out = pd.DataFrame(rows, columns=cols)
    if out.empty:
        return out
    out["order"] = out["roof"].map({r: i for i, r in enumerate(ar.ROOFS)})
    return out.sort_values(["gpu_slug", "order"]).drop(columns="order").reset_index(drop=True)


def check_roofs(view: pd.DataFrame) -> None:
    """Roofs are positive, a measurement's median lies within its spread, and no measured roof exceeds its
    datasheet's by more than a tenth (a measurement above the silicon's limit is a timing error)."""
    assert (view["value"] > 0).all(), view[view["value"] <= 0]
    m = view[view["source"] == ar.MEASURED]
    assert ((m["p10"] <= m["value"] * (1 + 1e-9)) & (m["value"] <= m["p90"] * (1 + 1e-9))).all(), m
    over = m[m["of_datasheet"].astype(float) > 1.1]
    assert over.empty, f"measured above the datasheet: {over[['gpu_slug', 'roof', 'of_datasheet']].to_dict('records')}"


__all__ = ["DATASHEET_FP32", "ROOF_LABELS", "bandwidth_of", "card_roofs", "check_roofs", "gpu_labels", "peaks_of",
           "roofs_view"]
