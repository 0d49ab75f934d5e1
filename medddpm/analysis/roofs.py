"""A card's roofs: its DRAM bandwidth and its dense matmul rate in each precision, measured on the card where
someone measured them (`medddpm.measure.timing.roofs`, table ``roofs`` in ``data/<label>/roofs.parquet``), else from
its maker's datasheet, each value with where it comes from.

Measured roofs are what a program reaches on random data (a device-to-device copy, a large matmul); datasheet
roofs are what the silicon could do at its boost clock, which no program reaches. A label's measured roofs
describe the machine that measured them, and no other: they are never lent to another label, even one of the same
device type (two hosts of one type differ in clocks, power caps and memory, and a CPU type spans any CPU). A
card is therefore read against its own measurement or its datasheet, never against another machine's.

Cards set side by side are read against one kind of source, so that the source's own bias cancels: `basis`
chooses it per roof for a whole set of cards (measured where every card with a datasheet value for that roof has
measured it, the datasheet otherwise), `on_basis` gives one card's roofs on it, and `pair_of` two cards' roofs on
the basis of the cards set beside them, or of the pair alone.

Tensor-core work is counted from the tensor pipe's active cycles (Nsight Compute counts no tensor FLOPs):
`tensor_flop_per_sm_cycle` is the dense rate of one SM in one cycle, the datasheet's peak over its SMs and the
clock the peak assumes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

ROOFS = ("dram", "fp32", "tf32", "bf16", "fp16")  # dram in byte/s, the others dense FLOP/s
COMPUTE = ROOFS[1:]
TENSOR = ("tf32", "bf16", "fp16")  # math on the tensor cores; fp32 is the CUDA cores' FMA
UNITS = {"dram": "byte/s", **dict.fromkeys(COMPUTE, "FLOP/s")}
MEASURED, DATASHEET_SOURCE = "measured", "datasheet"


@dataclass(frozen=True)
class Card:
    """A card as its maker publishes it: dense rates (half of a figure given "with sparsity")."""

    name: str
    roofs: dict[str, float]
    source: str
    sms: int | None = None  # streaming multiprocessors
    tensor_clock_mhz: float | None = None  # the clock the tensor rates assume

    def tensor_flop_per_sm_cycle(self, precision: str) -> float | None:
        if precision not in self.roofs or not self.sms or not self.tensor_clock_mhz:
            return None
        return self.roofs[precision] / (self.sms * self.tensor_clock_mhz * 1e6)


_HOPPER = "tensor rates dense (half the figures given with sparsity); tensor boost clock 1830 MHz, Hopper " \
          "architecture whitepaper"
# Keyed by the device type as the sweep names it (the device name, lower-cased, other characters as hyphens).
DATASHEET: dict[str, Card] = {
    "nvidia-h200": Card("NVIDIA H200 SXM", {"dram": 4.8e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12,
                                            "fp16": 989.4e12},
                        f"NVIDIA H200 Tensor Core GPU datasheet (SXM); {_HOPPER}", 132, 1830),
    "nvidia-h100-80gb-hbm3": Card("NVIDIA H100 SXM5 80GB", {"dram": 3.35e12, "fp32": 67e12, "tf32": 494.7e12,
                                                           "bf16": 989.4e12, "fp16": 989.4e12},
                                  f"NVIDIA H100 Tensor Core GPU datasheet (SXM); {_HOPPER}", 132, 1830),
    "nvidia-a100-sxm4-80gb": Card("NVIDIA A100 SXM4 80GB", {"dram": 2.039e12, "fp32": 19.5e12, "tf32": 156e12,
                                                           "bf16": 312e12, "fp16": 312e12},
                                  "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB; tensor rates dense); boost "
                                  "clock 1410 MHz, Ampere architecture whitepaper", 108, 1410),
    "nvidia-b200": Card("NVIDIA B200 (HGX)", {"dram": 7.7e12, "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15,
                                              "fp16": 2.25e15},
                        "NVIDIA HGX B200 datasheet, individual GPU (tensor rates dense: half the figures given with "
                        "sparsity)"),
    "tesla-v100-sxm2-16gb": Card("NVIDIA V100 SXM2", {"dram": 900e9, "fp32": 15.7e12, "fp16": 125e12},
                                 "NVIDIA Tesla V100 datasheet (SXM2); boost clock 1530 MHz", 80, 1530),
}
PAPER_CARDS = ("tesla-v100-sxm2-16gb", "nvidia-a100-sxm4-80gb", "nvidia-h100-80gb-hbm3")  # Ryoo et al.'s GPUs
ESTIMATE_CARDS = ("nvidia-a100-sxm4-80gb", "nvidia-b200")  # cards the book estimates where none is measured


@dataclass(frozen=True)
class Roof:
    value: float  # byte/s or FLOP/s
    source: str  # MEASURED or DATASHEET_SOURCE
    detail: str  # the label it was measured under, or the datasheet
    p10: float = math.nan
    p90: float = math.nan


def datasheet_roofs(gpu_type: str) -> dict[str, Roof]:
    card = DATASHEET.get(gpu_type)
    if card is None:
        return {}
    return {r: Roof(v, DATASHEET_SOURCE, card.source) for r, v in card.roofs.items()}


def _measured(rows: pd.DataFrame) -> dict[str, Roof]:
    return {r.roof: Roof(float(r.value), MEASURED, f"measured under {r.gpu_slug} ({r.method})", float(r.p10),
                         float(r.p90)) for r in rows.itertuples()}


def own_roofs(roofs: pd.DataFrame | None, slug: str) -> dict[str, Roof]:
    """The roofs measured under the label `slug` itself (its ``roofs.parquet``), and no other label's."""
    if roofs is None or roofs.empty:
        return {}
    return _measured(roofs[roofs["gpu_slug"] == slug])


def card_roofs(roofs: pd.DataFrame, slug: str, gpu_type: str | None = None) -> dict[str, Roof]:
    """The roofs of the card a label was measured on, each from the best source it has: the label's own
    ``roofs.parquet``, else the datasheet of its type. Another label's measurement never stands in, even one of
    the same device type: a machine's roofs describe that machine. A card with neither has no roofs."""
    out = datasheet_roofs(gpu_type or slug) | own_roofs(roofs, slug)
    return {r: out[r] for r in ROOFS if r in out}


def basis(roofs: pd.DataFrame | None, cards: Mapping[str, str]) -> dict[str, str]:
    """The one source per roof that every card of `cards` (label -> device type) is read against where they are
    set side by side: MEASURED where every card whose datasheet gives the roof has measured it under its own
    label, DATASHEET_SOURCE otherwise (one card not measured yet puts all of them on their datasheets). A card
    without a datasheet takes no part in the choice: its own measurement is all it has."""
    own = {slug: own_roofs(roofs, slug) for slug in cards}
    out = {}
    for r in ROOFS:
        sheets = [slug for slug, kind in cards.items() if r in datasheet_roofs(kind)]
        out[r] = MEASURED if all(r in own[slug] for slug in sheets) else DATASHEET_SOURCE
    return out


def on_basis(roofs: pd.DataFrame | None, slug: str, gpu_type: str, chosen: Mapping[str, str]) -> dict[str, Roof]:
    """One card's roofs on the chosen `basis`: per roof its own measurement where the basis is MEASURED, its
    datasheet where that is the basis; a card that lacks the chosen source for a roof (no datasheet for its type)
    keeps the other one, and its `Roof.source` says which it is."""
    own, sheet = own_roofs(roofs, slug), datasheet_roofs(gpu_type)
    out = {}
    for r in ROOFS:
        first, second = (own, sheet) if chosen.get(r) == MEASURED else (sheet, own)
        if r in first or r in second:
            out[r] = first.get(r) or second[r]
    return out


def pair_of(roofs: pd.DataFrame | None, a: tuple[str, str], b: tuple[str, str],
            chosen: Mapping[str, str] | None = None) -> tuple[dict, dict, str]:
    """Two cards' roofs, each card given as (label, device type), both on one `basis` (`on_basis`): `chosen`, the
    basis of every card set beside them (a page's, with both among its cards), else that of the pair alone (both
    measured where both have measured a roof, else both datasheet). A roof one card lacks altogether is left out.
    Returns the two value dicts (byte/s, FLOP/s) and the source used: "measured", "datasheet", "mixed" (a card
    with no datasheet read against one that is, or some roofs of each kind) or "none"."""
    chosen = chosen if chosen is not None else basis(roofs, dict([a, b]))
    ra, rb = on_basis(roofs, *a, chosen), on_basis(roofs, *b, chosen)
    av, bv, used = {}, {}, set()
    for r in ROOFS:
        if r in ra and r in rb:
            av[r], bv[r] = ra[r].value, rb[r].value
            used.add(ra[r].source if ra[r].source == rb[r].source else "mixed")
    return av, bv, used.pop() if len(used) == 1 else ("mixed" if used else "none")


def attainable(intensity: float, bandwidth: float, peak: float) -> float:
    """The roofline: the FLOP/s a kernel of `intensity` FLOP per DRAM byte can reach under both roofs."""
    return min(peak, intensity * bandwidth)
