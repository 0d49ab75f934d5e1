"""Layer ranges of an ncu report, read with Nsight Compute's Python report interface (`ncu_report`).

`medddpm.measure.profile.capture` names each convolution of an eager step with an NVTX push/pop range (`LAYER_PREFIX`,
then the layer's channels, kernel, stride and input size), around its forward and around its backward. ncu
records the ranges open at each launch; `with_layers` keeps them in the long table as one text row per launch
(section `LAYER_SECTION` of `medddpm.analysis.ncu_table`), so that the same layer can be compared kernel
against kernel across configurations (`medddpm.analysis.layers`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pandas as pd

from medddpm.analysis.ncu_table import COLUMNS, LAYER_METRIC, LAYER_SECTION

LAYER_PREFIX = "conv3d "  # medddpm.model.flops.LAYER_PREFIX (not imported: the model imports torch)


def report_module(ncu: str = "ncu"):
    """Nsight Compute's Python report interface (`ncu_report`), from the install that `ncu` belongs to
    (its `extras/python` folder: beside the binary, or in the CUDA toolkit's or /opt/nvidia's Nsight Compute
    folders when `ncu` is the toolkit's launcher script), else an installed `ncu_report` module; None where
    there is neither."""
    import importlib

    where = shutil.which(ncu)
    parents = list(Path(os.path.realpath(where)).parents) if where else []
    folders = [p / "extras" / "python" for p in parents]
    for root in [*parents[1:2], Path("/opt/nvidia/nsight-compute")]:  # the toolkit's root, NVIDIA's default
        folders += sorted(root.glob("nsight-compute*/extras/python"), reverse=True)
        folders += sorted(root.glob("*/extras/python"), reverse=True)
    for folder in folders:
        if folder.joinpath("ncu_report.py").is_file():
            if str(folder) not in sys.path:
                sys.path.append(str(folder))
            break
    try:
        return importlib.import_module("ncu_report")
    except ImportError:
        return None


def report_layers(report: Path, module) -> list[tuple[str, str]]:
    """(kernel name, innermost layer range or '') of each result of an ncu report, in result order (the CSV
    export's ID): read with the report interface's NVTX state."""
    ctx = module.load_report(str(report))
    out = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            action = rng.action_by_idx(a)
            state, layer = action.nvtx_state(), ""
            for domain in (state.domains() if state is not None else ()):
                ranges = [n for n in state.domain_by_id(domain).push_pop_ranges() if n.startswith(LAYER_PREFIX)]
                layer = ranges[-1] if ranges else layer
            out.append((action.name(), layer))
    return out


def with_layers(df: pd.DataFrame, report: Path, *, ncu: str = "ncu") -> tuple[pd.DataFrame, str]:
    """The long table with a `LAYER_SECTION` row for each launch made inside a layer range, and a note for the
    pass's message ('' where there is nothing to say). The report's results are matched to the table's IDs by position, checked by name: any
    disagreement, or no report interface, leaves the table as it was and says so."""
    module = report_module(ncu)
    if module is None:  # layer figures are left out, as for a compiled step
        return df, ""
    try:
        layers = report_layers(report, module)
    except Exception as e:  # the report interface's own errors have no common base class
        return df, f"; layer ranges not read ({type(e).__name__}: {e})"
    names = df.groupby("kernel_id")["kernel"].first()
    ids = sorted(names.index)
    # the interface names a result by its function (`vectorized_elementwise_kernel`), the export in full
    if len(layers) != len(ids) or any(function not in names[i] for i, (function, _) in zip(ids, layers)):
        return df, f"; layer ranges not kept ({len(layers)} results in the report, {len(ids)} in the export)"
    rows = [(names[i], i, layer) for i, (_, layer) in zip(ids, layers) if layer]
    if not rows:  # a compiled step: no layer ranges
        return df, ""
    extra = pd.DataFrame({"kernel": [r[0] for r in rows], "kernel_id": [r[1] for r in rows], "kind": "metric",
                          "section": LAYER_SECTION, "metric": LAYER_METRIC, "value": float("nan"), "unit": "",
                          "text": [r[2] for r in rows], "speedup_type": ""})
    return pd.concat([df, extra], ignore_index=True).astype(COLUMNS), f"; {len(rows)} launches inside layer ranges"
