"""Latency metrics from request records, with pandas. Definitions (docs/load-and-metrics.md):

- TTFT: first output chunk carrying a non-empty token minus the send time.
- E2E: end of the stream minus the send time.
- TPOT: (E2E - TTFT) / (n - 1), n = output tokens from the server's usage (else counted
  from the stream); undefined for n < 2.
- ITL: the gap between consecutive output chunks of one request, pooled over requests.
- Basis: ``sent`` times from the actual send; ``scheduled`` from the open-loop scheduled
  send, which adds the generator's own queueing delay (no coordinated omission). In closed
  loop both are equal.
- Only ``ok`` requests enter percentiles; every other status is counted apart.
- Percentiles by nearest rank, the project's one definition (harness/stats/__init__.py): always an
  observed value, never an interpolation between two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from harness.stats import percentile_or_nan
from harness.errors import ProbeError
from harness.probes.client.records import NOT_SENT, STATUSES, RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
BASES = ("sent", "scheduled")

_REQUEST_COLUMNS = [
    "request_id", "user", "status", "ok", "http_status", "error_class", "finish_reason", "served_by",
    "n_tokens", "prompt_tokens", "start_wall_ns", "t_s", "sched_delay_ms", "first_byte_ms",
    "ttft_ms", "e2e_ms", "tpot_ms", "ttft_sched_ms", "e2e_sched_ms",
]


@dataclass(frozen=True)
class SLO:
    """Per-request targets that make a request count toward goodput (None: no target)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ProbeError(f"SLO {name} must be > 0 ms, got {value!r}", fix="give a positive target or None")


def _ms(a: int | None, b: int | None) -> float:
    return (a - b) / 1e6 if a is not None and b is not None else math.nan


def requests_frame(records: Iterable[RequestRecord], *, t0_wall_ns: int | None = None) -> pd.DataFrame:
    """One row per request. ``t_s`` is the scheduled send in seconds after ``t0_wall_ns``
    (default: the earliest scheduled send), on the wall clock, so fault windows line up."""
    rows = []
    for r in records:
        n = r.num_output_tokens
        sched = r.scheduled_or_sent_ns
        ttft, e2e = _ms(r.first_token_ns, r.sent_ns), _ms(r.end_ns, r.sent_ns)
        rows.append({
            "request_id": r.request_id, "user": r.user, "status": r.status, "ok": r.ok,
            "http_status": r.http_status, "error_class": r.error_class, "finish_reason": r.finish_reason,
            "served_by": ",".join(r.served_by), "n_tokens": n, "prompt_tokens": r.prompt_tokens,
            "start_wall_ns": r.anchor.perf_to_wall(sched), "t_s": math.nan,
            "sched_delay_ms": _ms(r.sent_ns, sched), "first_byte_ms": _ms(r.first_byte_ns, r.sent_ns),
            "ttft_ms": ttft, "e2e_ms": e2e,
            "tpot_ms": (e2e - ttft) / (n - 1) if n >= 2 and not math.isnan(ttft + e2e) else math.nan,
            "ttft_sched_ms": _ms(r.first_token_ns, sched), "e2e_sched_ms": _ms(r.end_ns, sched),
        })
    df = pd.DataFrame(rows, columns=_REQUEST_COLUMNS)
    if len(df):
        t0 = df["start_wall_ns"].min() if t0_wall_ns is None else t0_wall_ns
        df["t_s"] = (df["start_wall_ns"] - t0) / 1e9
    return df


def itl_frame(records: Iterable[RequestRecord]) -> pd.DataFrame:
    """One row per gap between consecutive output chunks: request_id, ok, itl_ms, tokens
    (tokens in the later chunk: several under speculative decoding)."""
    rows = [
        {"request_id": r.request_id, "ok": r.ok, "itl_ms": (b - a) / 1e6, "tokens": n}
        for r in records
        for a, b, n in zip(r.chunk_ns, r.chunk_ns[1:], r.chunk_tokens[1:])
    ]
    return pd.DataFrame(rows, columns=["request_id", "ok", "itl_ms", "tokens"])


def percentiles(values: Sequence[float] | pd.Series, qs: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """{"p50": .., "p90": .., "mean": .., "max": .., "n": ..} over the non-NaN values."""
    arr = np.asarray(pd.Series(values, dtype="float64").dropna())
    out: dict[str, float] = {f"p{q:g}": percentile_or_nan(arr.tolist(), q) for q in qs}
    out["mean"] = float(arr.mean()) if arr.size else math.nan
    out["max"] = float(arr.max()) if arr.size else math.nan
    out["n"] = int(arr.size)
    return out


def _column(metric: str, basis: str) -> str:
    if basis not in BASES:
        raise ProbeError(f"latency basis {basis!r} is unknown", fix=f"use one of {', '.join(BASES)}")
    if metric not in LATENCY_METRICS:
        raise ProbeError(f"latency metric {metric!r} is unknown", fix=f"use one of {', '.join(LATENCY_METRICS)}")
    if basis == "scheduled" and metric != "tpot_ms":  # TPOT is a difference: the basis cancels out
        return metric.replace("_ms", "_sched_ms")
    return metric


def meets_slo(df: pd.DataFrame, slo: SLO, basis: str = "sent") -> pd.Series:
    """Per row: ok and within every target of ``slo`` (a missing TPOT, n < 2, passes TPOT)."""
    good = df["ok"].astype(bool)
    for metric in LATENCY_METRICS:
        target = getattr(slo, metric)
        if target is not None:
            col = df[_column(metric, basis)]
            good &= (col <= target) | (col.isna() & (metric == "tpot_ms"))
    return good


def summarize(records: Sequence[RequestRecord], *, slo: SLO | None = None, basis: str = "sent") -> dict:
    """JSON-able summary: counts by status, duration, throughput, percentiles of ok
    requests on both bases, ITL, and goodput against ``slo`` (on ``basis``)."""
    df = requests_frame(records)
    ok = df.loc[df["ok"].astype(bool)]
    by_status = {s: int((df["status"] == s).sum()) for s in STATUSES}
    if len(df):
        ends = [r.anchor.perf_to_wall(r.end_ns) for r in records if r.end_ns is not None]
        duration_s = max((max(ends, default=0) - df["start_wall_ns"].min()) / 1e9, 1e-9)
    else:
        duration_s = 0.0
    out: dict = {
        "requests": len(df), "ok": len(ok), "failed": len(df) - len(ok), "by_status": by_status,
        "error_classes": {str(k): int(v) for k, v in df.loc[~df["ok"], "error_class"].value_counts().items()},
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s else 0.0,
        "output_tokens_per_s": float(ok["n_tokens"].sum()) / duration_s if duration_s else 0.0,
        "latency_ms": {b: {m: percentiles(ok[_column(m, b)]) for m in LATENCY_METRICS} for b in BASES},
        "itl_ms": percentiles(itl_frame(r for r in records if r.ok)["itl_ms"]),
        # generator lateness over requests that were sent (a NotSent arrival has no send time)
        "sched_delay_ms": percentiles(df.loc[df["error_class"] != NOT_SENT, "sched_delay_ms"]),
    }
    if slo is not None:
        good = int(meets_slo(df, slo, basis).sum())
        out["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms, "basis": basis}
        out["goodput_rps"] = good / duration_s if duration_s else 0.0
        out["slo_attainment"] = good / len(df) if len(df) else math.nan
    return out


def windowed(records: Sequence[RequestRecord], *, window_s: float = 1.0, metric: str = "ttft_ms",
             basis: str = "sent", t0_wall_ns: int | None = None) -> pd.DataFrame:
    """Latency over time: requests bucketed by scheduled send into windows of ``window_s``;
    per window the counts of ok and failed requests and percentiles of ``metric`` over ok ones."""
    return windowed_frame(requests_frame(records, t0_wall_ns=t0_wall_ns), window_s=window_s, metric=metric,
                          basis=basis)


def windowed_frame(df: pd.DataFrame, *, window_s: float = 1.0, metric: str = "ttft_ms",
                   basis: str = "sent") -> pd.DataFrame:
    """:func:`windowed` over a frame with ``t_s``, ``ok`` and the metric's column (a
    :func:`requests_frame`, or the few columns a soak keeps while it streams its records)."""
    if window_s <= 0:
        raise ProbeError(f"window_s must be > 0, got {window_s!r}", fix="give a window length in seconds")
    col = _column(metric, basis)
    df = df.copy()
    cols = ["window_start_s", "ok", "failed"] + [f"p{q}" for q in PERCENTILES]
    if not len(df):
        return pd.DataFrame(columns=cols)
    df["window"] = np.floor(df["t_s"] / window_s).astype(int)
    rows = []
    for w, g in df.groupby("window", sort=True):
        p = percentiles(g.loc[g["ok"], col])
        rows.append({"window_start_s": w * window_s, "ok": int(g["ok"].sum()), "failed": int((~g["ok"]).sum()),
                     **{f"p{q}": p[f"p{q}"] for q in PERCENTILES}})
    return pd.DataFrame(rows, columns=cols)


def mark_fault_windows(df: pd.DataFrame, windows: Iterable[tuple[int, int]]) -> pd.DataFrame:
    """Add ``in_fault``: the request was in flight during any (start_wall_ns, end_wall_ns) window.
    A request's span runs from its scheduled send to its end (e2e after the scheduled send)."""
    start = df["start_wall_ns"].astype("int64")
    end = start + (df["e2e_sched_ms"].fillna(0) * 1e6).astype("int64")
    in_fault = pd.Series(False, index=df.index)
    for w_start, w_end in windows:
        if w_end < w_start:
            raise ProbeError(f"fault window ends before it starts: {w_start} > {w_end}",
                             fix="pass (start_wall_ns, end_wall_ns) pairs")
        in_fault |= (start <= w_end) & (end >= w_start)
    return df.assign(in_fault=in_fault)
