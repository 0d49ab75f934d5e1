"""What the claims read of one GPU (`GPU`): its runs, kernel tables and counters by configuration, and the
summaries several rules share (step-weighted counters, the baseline/opt1 matched layers, achieved FLOP/s against
the card's roofs), each computed once, on first use. The rules themselves are in `medddpm.report.claim_rules`."""

from __future__ import annotations

import math
from functools import cached_property

import pandas as pd

from medddpm.analysis import layers
from medddpm.report.convergence import Study
from medddpm.report.counters import ncu_by_run
from medddpm.report.loading import Data, is_cpu
from medddpm.report.roofs import step_efficiency


class GPU:
    """The measurements of one GPU, with the summaries the rules share (computed once, on first use)."""

    def __init__(self, data: Data, slug: str, study: Study | None = None):
        self.data, self.slug, self.study = data, slug, study
        self.run = data.run[data.run["gpu_slug"] == slug]
        self.ok = self.run[self.run["status"] == "ok"].set_index("config")
        self.is_gpu = not is_cpu(slug) and (self.run["gpu_name"] != "cpu").all()

    def _table(self, name: str, config: str) -> pd.DataFrame:
        t = getattr(self.data, name)
        if config not in self.ok.index or t.empty:
            return t.iloc[0:0]
        return t[t["run_id"] == self.ok.loc[config, "run_id"]]

    def kernels(self, config: str) -> pd.DataFrame:
        return self._table("kernels", config)

    def counters(self, config: str) -> pd.DataFrame:
        return self._table("ncu", config)

    def train_median_ms(self, config: str) -> tuple[float, str] | None:
        """The configuration's median micro-step: the sweep's, else bench timings kept beside the data."""
        if config in self.ok.index:
            return float(self.ok.loc[config, "train_median_ms"]), "sweep"
        b = self.data.bench
        if not b.empty:
            b = b[(b["gpu_slug"] == self.slug) & (b["implementation"] == "ours") & (b["config"] == config)]
            if len(b):
                return float(b["train_median_ms"].median()), "bench timings"
        return None

    def precision_used(self, config: str) -> str | None:
        if config in self.ok.index:
            return self.ok.loc[config, "precision_used"] or None
        b = self.data.bench
        b = b[(b["gpu_slug"] == self.slug) & (b["config"] == config)] if not b.empty else b
        return {"tf32": "tf32", "ieee": "fp32"}.get(b["fp32_math"].iloc[0]) if len(b) else None

    def category_share(self, config: str, categories: tuple[str, ...]) -> float | None:
        k = self.kernels(config)
        if k.empty:
            return None
        return float(k[k["category"].isin(categories)]["share"].sum() / k["share"].sum())

    @cached_property
    def per_step(self) -> pd.DataFrame:
        """The counters page's step-weighted table of this GPU's runs (`counters.ncu_by_run`), by configuration:
        the claims read the same numbers the page shows."""
        ncu = self.data.ncu
        ncu = ncu[ncu["run_id"].isin(set(self.ok["run_id"]))] if not ncu.empty else ncu
        if ncu.empty:
            return pd.DataFrame()
        return ncu_by_run(ncu, self.data.kernels).set_index("config")

    @cached_property
    def step_weighted(self) -> dict[str, dict[str, float]]:
        return {c: row.to_dict() for c, row in self.per_step.iterrows()}

    def rate(self, config: str, column: str) -> float | None:
        v = self.step_weighted.get(config, {}).get(column, math.nan)
        return None if pd.isna(v) else float(v)

    def efficiency(self, config: str) -> pd.Series | None:
        """The configuration's step against the card's roof in its precision, as every page reads it
        (`roofs.step_efficiency`: achieved_tflops, roof, peak_tflops, efficiency, basis, peak_source)."""
        e = step_efficiency(self.data, self.slug, config)
        return e.iloc[0] if len(e) else None

    @cached_property
    def matched(self) -> pd.DataFrame:
        """baseline (a) against opt1 (b), layer by layer (`layers.matched_layers`)."""
        a, b = self.counters("baseline"), self.counters("opt1")
        if a.empty or b.empty:
            return layers.matched_layers(a.iloc[0:0], b.iloc[0:0], pd.Series(dtype="int64"))
        return layers.matched_layers(a, b, layers.layer_counts(self.ok.loc["baseline"]))

    def lacking(self, *configs: str) -> frozenset[tuple[str, str]]:
        """What `missing` names, as (kind, configuration) pairs: "run" or "counters"."""
        return frozenset({("run", c) for c in configs if c not in self.ok.index}
                         | {("counters", c) for c in configs if c in self.ok.index and self.counters(c).empty})

    def missing(self, *configs: str) -> str:
        """Which of `configs` lack a run or counters here, with the command that gives them."""
        unmeasured = [c for c in configs if c not in self.ok.index]
        uncounted = [c for c in configs if c in self.ok.index and self.counters(c).empty]
        parts = ([f"no run of {', '.join(unmeasured)} (`python -m medddpm sweep --preset paper --configs "
                  f"{','.join(unmeasured)}`)"] if unmeasured else [])
        parts += ([f"no counters for {', '.join(uncounted)} (`python -m medddpm counters "
                   f"{' '.join(f'data/{self.slug}/{c}' for c in uncounted)}`)"] if uncounted else [])
        return "; ".join(parts) or "the counters lack a metric this claim reads"


def matched_tables(g: GPU) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The baseline/opt1 matched layers of one GPU as the claims page shows them: the layer's time in baseline's
    step, its SM-cycle and instruction ratios and tensor-pipe use (the TF32 claims' figures); and, for a fold, its
    instances, L1 hit rate, DRAM throughput and the two stall reasons, each as baseline → opt1."""
    m = g.matched

    def arrow(a: str, b: str, fmt: str) -> list[str]:
        return [f"{x:{fmt}} → {y:{fmt}}" for x, y in zip(m[a], m[b])]

    main = pd.DataFrame({
        "layer": m["layer"], "direction": m["direction"], "baseline ms in step": m["step_ms_a"],
        "SM cycles, baseline / opt1": m["sm_cycles_ratio"], "instructions, baseline / opt1": m["instructions_ratio"],
        "tensor pipe %": arrow("tensor_pipe_pct_a", "tensor_pipe_pct_b", ".1f")})
    more = pd.DataFrame({
        "layer": m["layer"], "direction": m["direction"], "instances in the model": m["instances"],
        "L1 hit %": arrow("l1_hit_pct_a", "l1_hit_pct_b", ".0f"),
        "DRAM throughput %": arrow("dram_throughput_pct_a", "dram_throughput_pct_b", ".1f"),
        "long-scoreboard stalls": arrow("stall_long_scoreboard_a", "stall_long_scoreboard_b", ".2f"),
        "math-pipe-throttle stalls": arrow("stall_math_pipe_throttle_a", "stall_math_pipe_throttle_b", ".2f")})
    return main, more


def check_matched(main: pd.DataFrame) -> None:
    """Every matched layer's cycle ratio is positive, and the layers come ranked by their time in the step."""
    assert (main["SM cycles, baseline / opt1"] > 0).all() and main["baseline ms in step"].is_monotonic_decreasing, main


MATCHED_FORMATS = {"baseline ms in step": "{:.1f}", "SM cycles, baseline / opt1": "{:.2f}x",
                   "instructions, baseline / opt1": "{:.1f}x"}
