"""How much serial dependence shrinks a percentile's evidence (issue 33 item 3; docs/statistics.md
"Dependence").

An order-statistics interval counts how many samples fall at or below the percentile: with
independent draws that count is binomial. Latency samples taken in time order are not independent:
requests queued behind the same slow batch, a restart's warm-up, a drift of the machine's load all
make neighbours alike, and the count's variance grows by the factor

    tau = 1 + 2 * sum_k rho_k

where rho_k is the lag-k autocorrelation of the indicator ``sample <= percentile`` in the order
the samples were taken. The interval is then built from ``n_eff = n / tau`` effective samples (the
same ranks as a fraction of n_eff, read off the n observed values): independent draws get tau
about 1 and the old interval. tau is estimated with Geyer's initial positive sequence (pairs of
autocorrelations summed while positive and decreasing), the standard estimator of MCMC output,
and never below 1 (dependence that alternates is not taken as extra evidence).

Measured on recorded runs (bench/bench_dependence.py): the bundled engine's 6.2 TTFT at the median
has tau ~27, its p99 ~3.6 (docs/statistics.md "Dependence"); vLLM's and Dynamo's are listed there. Below ``MIN_N`` samples the
autocorrelations cannot be estimated: independence is then assumed and the interval says so.
A leaf module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

MIN_N = 100            # fewer samples: tau not estimated (independence assumed, said in the interval)
MAX_LAG = 2000         # the longest lag summed (Geyer's sequence usually stops long before)
METHOD = "Geyer initial positive sequence of the indicator's autocorrelations"


@dataclass(frozen=True)
class Dependence:
    """The variance inflation used for one percentile interval: ``tau`` (>= 1) and the effective
    samples ``n_eff`` it leaves of ``n``; ``measured`` False: too few samples to estimate it."""

    tau: float
    n: int
    measured: bool
    lag1: float | None = None    # the indicator's lag-1 autocorrelation (evidence)

    @property
    def n_eff(self) -> int:
        return max(1, int(self.n / self.tau))

    def to_dict(self) -> dict[str, Any]:
        return {"tau": round(self.tau, 3), "n_eff": self.n_eff, "measured": self.measured,
                "lag1": None if self.lag1 is None else round(self.lag1, 3),
                "method": METHOD if self.measured else f"not estimated below {MIN_N} samples: independence assumed"}


def autocorrelations(x: Sequence[float] | np.ndarray, max_lag: int) -> np.ndarray:
    """rho_0 .. rho_max_lag of the series (rho_0 = 1), by FFT; all zeros past 0 for a constant series."""
    a = np.asarray(x, dtype=float)
    n = len(a)
    max_lag = max(0, min(max_lag, n - 1))
    if n == 0 or np.all(a == a[0]):   # constant: nothing varies (centering would leave rounding noise)
        out = np.zeros(max_lag + 1)
        out[0] = 1.0
        return out
    a = a - a.mean()
    size = 1 << (2 * n - 1).bit_length()
    f = np.fft.rfft(a, size)
    acov = np.fft.irfft(f * np.conjugate(f), size)[: max_lag + 1]
    if acov[0] <= 0:
        out = np.zeros(max_lag + 1)
        out[0] = 1.0
        return out
    return acov / acov[0]


def geyer_tau(x: Sequence[float] | np.ndarray) -> float:
    """Geyer's initial positive (monotone) sequence estimate of ``1 + 2 sum rho_k``, at least 1."""
    n = len(x)
    rho = autocorrelations(x, min(MAX_LAG, n // 2))
    total, previous = 0.0, math.inf
    for m in range(0, len(rho) - 1, 2):
        pair = rho[m] + rho[m + 1]
        if pair <= 0:
            break
        pair = min(pair, previous)   # initial monotone sequence
        total += pair
        previous = pair
    return float(max(1.0, 2 * total - 1))


def percentile_dependence(in_order: Sequence[float], q: float) -> Dependence:
    """The dependence of the indicator ``x <= x_q`` (x_q the sample's nearest-rank q-th percentile)
    along the samples in the order they were taken (NaN dropped)."""
    arr = np.asarray(in_order, dtype=float)
    arr = arr[~np.isnan(arr)]
    n = len(arr)
    if n < MIN_N:
        return Dependence(1.0, n, False)
    rank = max(1, math.ceil(q / 100 * n))
    cut = np.partition(arr, rank - 1)[rank - 1]
    indicator = (arr <= cut).astype(float)
    if indicator.min() == indicator.max():   # p100 (or ties all round): nothing varies
        return Dependence(1.0, n, True, 0.0)
    lag1 = float(autocorrelations(indicator, 1)[1])
    return Dependence(geyer_tau(indicator), n, True, lag1)


__all__ = ["Dependence", "MIN_N", "METHOD", "autocorrelations", "geyer_tau", "percentile_dependence"]
