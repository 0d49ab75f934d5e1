"""The book's figures: one Altair chart builder per figure, fed with small aggregated frames.

Interactivity is Vega-Lite's own, so it works in a static HTML page with no Python behind it:
dropdowns and radio buttons bound to parameters (which GPU, which configuration, which metric),
legend-bound selections that highlight, and tooltips. Every GPU choice is built from the data's
``gpu_slug`` values, never from a list written here, so a GPU added under ``data/`` appears in
every chart. Each configuration keeps one colour across the whole book (`config_color`), each
kernel category another (`category_color`).

A chart of measured runs shows GPUs: rows measured on a CPU (a small model that checks the pipeline)
appear only when the page asks for them with ``cpu=True``. Bars start at zero on a linear axis, every
axis and tooltip names its unit, and rankings number the largest first.

Pages call `setup()` first: it is the one place where the renderer is chosen. One module per family:
`theme` (what every chart shares), `timing`, `kernels`, `counters`, `cards`, `device_memory`, `quality`, `study`.
"""

from __future__ import annotations

import sys

# jsonschema (under Altair) imports rfc3987_syntax whenever it is installed (jupyter-events pulls it in), and
# that builds some 35 Earley parsers: about 3 s of each page's start (python-jsonschema/jsonschema#1428).
# Altair's schema has no "iri" format, the only checks it serves; marked absent, jsonschema leaves them out.
if "jsonschema" not in sys.modules:
    sys.modules.setdefault("rfc3987_syntax", None)

from medddpm.report.charts.theme import (  # noqa: E402
    CARD_PALETTE, CATEGORIES, CATEGORY_COLORS, GIB, MAX_ROWS, MS, OTHER, OTHER_COLOR, PALETTE, PARTS, PASS_COLORS,
    PASS_ORDER, VERDICT_COLORS, _config_legend, _config_param, _configs_in, _default_gpu, _empty, _fold, _gpu_param,
    _height, _light, _metric_param, _no_gpu, _step_axis, card_color, card_legend, card_offset, card_order,
    card_palette, category_color, chosen_axis_title, config_color, decades, distinct_colors, duration_text, figure,
    gpu_rows, is_cpu, live_notebook, log_axis, parts_color, setup, table, title, top_parts, unit_of, with_unit)
from medddpm.report.charts.timing import (  # noqa: E402
    ABLATION_COLORS, COST_METRICS, ablation, bench, cost, gpu_busy, headline, scaling, speedup, step_time)
from medddpm.report.charts.kernels import PASS_METRICS, category_shares, pass_split, top_kernels  # noqa: E402
from medddpm.report.charts.counters import (  # noqa: E402
    MEMORY_METRICS, instruction_mix, kernel_stalls, memory, priorities, roofline, stalls, tensor_pipe)
from medddpm.report.charts.cards import card_compare, card_steps, category_ratios, ratio_by_share  # noqa: E402
from medddpm.report.charts.device_memory import (  # noqa: E402
    FIT_COLORS, _model_param, card_label, memory_fits, memory_peaks, switch_costs)
from medddpm.report.charts.quality import claims_grid, loss_curves, loss_difference, rel_err  # noqa: E402
from medddpm.report.charts.study import OUTCOME_COLORS, paired_differences, study_losses, study_scores  # noqa: E402

__all__ = [
    # shared
    "CARD_PALETTE", "CATEGORIES", "CATEGORY_COLORS", "GIB", "MAX_ROWS", "MS", "OTHER", "OTHER_COLOR", "PALETTE",
    "PARTS", "PASS_COLORS", "PASS_ORDER", "VERDICT_COLORS", "card_color", "card_legend", "card_offset", "card_order",
    "card_palette", "category_color", "chosen_axis_title", "config_color", "decades", "distinct_colors",
    "duration_text", "figure", "gpu_rows", "is_cpu", "live_notebook", "log_axis", "parts_color", "setup", "table",
    "title", "top_parts", "unit_of", "with_unit",
    # step time and what it buys
    "ABLATION_COLORS", "COST_METRICS", "ablation", "bench", "cost", "gpu_busy", "headline", "scaling", "speedup",
    "step_time",
    # kernels
    "PASS_METRICS", "category_shares", "pass_split", "top_kernels",
    # counters
    "MEMORY_METRICS", "instruction_mix", "kernel_stalls", "memory", "priorities", "roofline", "stalls",
    "tensor_pipe",
    # cards against each other
    "card_compare", "card_steps", "category_ratios", "ratio_by_share",
    # device memory
    "FIT_COLORS", "card_label", "memory_fits", "memory_peaks", "switch_costs",
    # quality and claims
    "claims_grid", "loss_curves", "loss_difference", "rel_err",
    # the convergence study
    "OUTCOME_COLORS", "paired_differences", "study_losses", "study_scores",
]
# Shared helpers other report modules draw with (explore, convergence, the workshop page).
_PRIVATE = (_config_legend, _config_param, _configs_in, _default_gpu, _empty, _fold, _gpu_param, _height, _light,
            _metric_param, _model_param, _no_gpu, _step_axis)
