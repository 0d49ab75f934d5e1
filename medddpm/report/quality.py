"""The quality page: a configuration's forward pass and first training losses against strict FP32."""

from __future__ import annotations

import numpy as np
import pandas as pd

from medddpm.report.loading import Data, _sort
from medddpm.report.safe import code, md
from medddpm.report.tables import cpu_rows

# Quality against strict FP32, for the quality page and the claims' "TF32 keeps quality" (`medddpm.report.claims`).
QUALITY_REL_ERR = 1e-2  # forward-pass relative L2 error tolerated against strict FP32
QUALITY_LOSS = 0.02  # mean relative loss difference tolerated against strict FP32




def quality_summary(data: Data) -> pd.DataFrame:
    """Per run: forward relative error and mean relative loss difference against strict FP32."""
    q = data.quality
    if q.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "rel_err", "loss_diff", "precision_used"])
    g = q.groupby(["gpu_slug", "config"], as_index=False).apply(
        lambda d: pd.Series({"rel_err": d["rel_err"].iloc[0],
                             "loss_diff": (d["loss"] - d["baseline_loss"]).abs().mean() / d["baseline_loss"].abs().mean()}),
        include_groups=False)
    pu = data.run.set_index(["gpu_slug", "config"])["precision_used"]
    g["precision_used"] = [pu.get((s, c), "") for s, c in zip(g["gpu_slug"], g["config"])]
    return _sort(g)


# ------------------------------------------------------------------------------------------ the page

QUALITY_COLUMNS = {"gpu_slug": "device", "config": "configuration", "rel_err": "forward rel. error",
                   "loss_diff": "mean rel. loss difference", "precision_used": "precision ran"}


def check_quality(data: Data) -> None:
    """Some run has a quality table, its losses and errors are finite and non-negative, and strict FP32 against
    itself is the same computation: exactly zero error and identical losses."""
    q = data.quality
    assert len(q), "no quality.parquet under data/"
    assert np.isfinite(q[["loss", "baseline_loss", "rel_err"]].to_numpy()).all(), q
    assert (q["rel_err"] >= 0).all(), q
    base = q[q["config"] == "baseline"]
    assert (base["rel_err"] == 0).all(), "baseline differs from itself"
    assert np.allclose(base["loss"], base["baseline_loss"]), "baseline differs from itself"


def rel_err_text() -> str:
    return ("The relative L2 error of one forward pass against strict FP32. The dashed line is the tolerance the "
            f"[claims page](claims.md) applies to TF32, a relative error of {QUALITY_REL_ERR:g}. A configuration that "
            "computes exactly what strict FP32 computes (the baseline, or TF32 on a CPU where it does not apply) is "
            "drawn at the left edge.")


def tolerance_text(qsum: pd.DataFrame, cpus: set[str]) -> str:
    """The largest forward error by the precision that ran (on GPUs where there are some), and the runs above the
    tolerance, with why half precision is not expected to meet it."""
    on_gpu = qsum[~cpu_rows(qsum, cpus)]
    judged = on_gpu if len(on_gpu) else qsum  # a data tree of CPU runs only: those are all there is
    over = judged[(judged["rel_err"] > QUALITY_REL_ERR) | (judged["loss_diff"] > QUALITY_LOSS)]
    by_prec = judged.groupby("precision_used")["rel_err"].max()
    text = f"Largest forward error {'on a GPU ' if len(on_gpu) else ''}by the precision that ran: " + ", ".join(
        f"{md(p) or 'unknown'} {v:.1e}" for p, v in by_prec.items()) + ". "
    if over.empty:
        return text + "Every run is within the tolerance."
    text += "Above the tolerance: " + ", ".join(code(f"{r.gpu_slug}/{r.config}") for r in over.itertuples()) + "."
    if over["precision_used"].isin(["bf16", "fp16"]).all():
        text += (" All of them ran in bf16 or fp16, which round every value to 8 or 11 significant bits (a relative "
                 "step of 2⁻⁸ ≈ 0.4% or 2⁻¹¹ ≈ 0.05%): the tolerance is the one the claims page applies to TF32, "
                 "and half precision is not expected to meet it.")
    return text
