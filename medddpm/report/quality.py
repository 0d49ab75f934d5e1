"""The quality page: a configuration's forward pass and first training losses against strict FP32."""

from __future__ import annotations


import pandas as pd

from medddpm.report.loading import Data, _sort

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
