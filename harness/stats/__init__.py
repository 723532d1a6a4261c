"""The project's one percentile definition: nearest rank.

The q-th percentile of n observed values is the value at rank ceil(q/100 * n) (1-based) of the
sorted values: always an observed value, never an interpolation between two. So p100 is the
worst observation, p50 of [1, 2, 3, 4] is 2, and with few samples a high percentile is honest
about the tail (it does not invent a value between the two slowest requests). Every percentile
the harness reports (latency summaries, verdicts, fabric probes) comes from :func:`nearest_rank`;
quantiles of server histograms, which hold no observed values, are interpolated inside buckets
as Prometheus does (harness.probes.metrics.prometheus.histogram_quantile) and say so.

A leaf package (layer 0, docs/architecture.md): it imports only ``harness.errors``, so probes,
fabric and checks all use it without depending on each other. Confidence intervals: ``.intervals``.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from harness.errors import ProbeError

DEFINITION = "nearest rank: the value at rank ceil(q/100 * n) of the n sorted observations (an observed value)"


def nearest_rank(values: Sequence[float] | Iterable[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) of ``values`` by nearest rank; NaN values are ignored.
    Raises ProbeError when nothing is left to rank (callers decide what "not measured" means)."""
    if not 0 <= q <= 100:
        raise ProbeError(f"percentile must be in [0, 100], got {q!r}", fix="pass e.g. 99 for p99")
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        raise ProbeError(f"p{q:g} of no values", fix="check there are observations before asking for a percentile")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def percentile_or_nan(values: Iterable[float], q: float) -> float:
    """:func:`nearest_rank`, or NaN when there is no (non-NaN) value."""
    kept = [v for v in values if not math.isnan(v)]
    return nearest_rank(kept, q) if kept else math.nan
