"""An equivalence test on paired differences: is a candidate as good as a reference, within a stated margin?

Runs of one seed share their initial weights, data order and training noise, so the difference of a score
between two configurations is taken seed by seed, and its mean is judged with a two-sided t-interval at
`CONFIDENCE` (the two one-sided tests of Schuirmann, 1987, at 5% each):

- **equivalent**: the whole interval lies within plus or minus the margin;
- **worse**: it lies beyond the margin on the candidate's losing side;
- **better**: it lies beyond the margin on its winning side;
- **undecided**: otherwise, with the number of seeds that the observed spread would need for the interval to
  clear the nearest boundary (none where the mean sits on the margin itself).

A t-interval rather than a bootstrap: with five to ten seeds a bootstrap's interval is too narrow (it cannot
see beyond the few values it resamples), while the t-interval widens for small samples as it should.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.90
EQUIVALENT, WORSE, BETTER, UNDECIDED = "equivalent", "worse", "better", "undecided"
OUTCOMES = (EQUIVALENT, BETTER, WORSE, UNDECIDED)
MAX_SEEDS = 10_000  # beyond this, "seeds needed" is reported as none: the spread cannot decide it in practice


@dataclass(frozen=True)
class Judgement:
    """The paired differences' mean, their interval (candidate minus reference, in the score's units), the
    verdict, and, when undecided, the seeds the observed spread would need (None when no number of seeds would)."""

    n: int
    mean: float
    sd: float
    low: float
    high: float
    margin: float
    verdict: str
    seeds_needed: int | None = None


def half_width(sd: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Half the two-sided t-interval of a mean of `n` values with standard deviation `sd`."""
    return float(stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n))


def seeds_to_clear(sd: float, gap: float, confidence: float = CONFIDENCE) -> int | None:
    """The fewest values whose interval half-width, at this `sd`, is under `gap`; None when none up to MAX_SEEDS."""
    if gap <= 0:
        return None
    if sd == 0:
        return 2
    n = 2
    while n <= MAX_SEEDS:
        if half_width(sd, n, confidence) < gap:
            return n
        n = n + 1 if n < 100 else int(n * 1.1)
    return None


def judge(differences, margin: float, *, higher_is_better: bool = True,
          confidence: float = CONFIDENCE) -> Judgement:
    """Judge paired `differences` (candidate minus reference, one per seed; NaN left out) against `margin`."""
    if not margin > 0:
        raise ValueError(f"the margin must be positive, got {margin!r}")
    d = np.asarray(differences, dtype=float)
    d = d[~np.isnan(d)]
    n = len(d)
    if n < 2:  # one difference has no spread: nothing to weigh it against
        mean = float(d.mean()) if n else math.nan
        return Judgement(n, mean, math.nan, math.nan, math.nan, margin, UNDECIDED, None)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    h = half_width(sd, n, confidence)
    low, high = mean - h, mean + h
    sign = 1 if higher_is_better else -1
    gain_low, gain_high = sorted((sign * low, sign * high))  # the interval with "higher is better" on both sides
    if gain_low > -margin and gain_high < margin:
        return Judgement(n, mean, sd, low, high, margin, EQUIVALENT)
    if gain_high < -margin:
        return Judgement(n, mean, sd, low, high, margin, WORSE)
    if gain_low > margin:
        return Judgement(n, mean, sd, low, high, margin, BETTER)
    gap = margin - abs(mean)  # to fit inside the margin; past it, to clear the margin on the mean's side
    return Judgement(n, mean, sd, low, high, margin, UNDECIDED, seeds_to_clear(sd, abs(gap)))
