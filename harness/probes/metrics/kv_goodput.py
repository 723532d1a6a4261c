"""The engine's own KV transfer goodput, from its metrics, beside the raw fabric probe of item 6.1.1.

Where the engine's metric profile counts KV transfer bytes and the time spent moving them (vLLM's
NIXL connector: ``vllm:nixl_bytes_transferred`` and ``vllm:nixl_xfer_time_seconds``, histograms
whose ``_sum`` are the totals), goodput = bytes / seconds over everything the engine moved so far,
summed over ``endpoints.metrics`` and every ``workers[].metrics``. Without such metrics the reason
is returned instead: never a guess.
"""

from __future__ import annotations

from typing import Any

import httpx

from harness.probes.metrics.prometheus import ENGINE_PROFILES, parse_metrics


def engine_kv_goodput(cluster: Any, line_bps: float | None = None) -> dict[str, Any]:
    """``{"gbit_per_s", "line_rate_fraction", "transfers", "bytes", "seconds", "source"}`` or ``{"unavailable"}``."""
    profile = ENGINE_PROFILES.get(cluster.spec.metric_profile or "", {})
    names = [profile.get(k) for k in ("kv_transfer_bytes", "kv_transfer_seconds")]
    if not all(names):
        return {"unavailable": f"engine {cluster.spec.engine_name!r}: its metric profile counts no KV transfer "
                               "bytes and time"}
    urls = [u for u in [cluster.metrics_url, *(w.metrics for w in cluster.spec.workers)] if u]
    if not urls:
        return {"unavailable": "no endpoints.metrics or workers[].metrics"}
    totals = {n: 0.0 for n in names}
    count_name = profile.get("kv_transfers")
    transfers, read, errors = 0.0, [], []
    for url in dict.fromkeys(urls):
        try:
            resp = httpx.get(url, timeout=10, headers=cluster.auth_headers())
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            errors.append(f"{url}: {exc}")
            continue
        read.append(url)
        for s in parse_metrics(resp.text):
            if s.name in totals:
                totals[s.name] += s.value
            elif count_name and s.name == count_name:
                transfers += s.value
    nbytes, seconds = totals[names[0]], totals[names[1]]
    if not seconds:
        return {"unavailable": f"the engine moved no KV yet ({names[0]} = {nbytes:g})", "read": read,
                "errors": errors}
    bps = 8 * nbytes / seconds
    out = {"gbit_per_s": round(bps / 1e9, 4), "bytes": nbytes, "seconds": round(seconds, 4),
           "transfers": transfers, "source": f"{names[0]} / {names[1]} over the engine's lifetime", "read": read}
    if line_bps:
        out["line_rate_fraction"] = round(bps / line_bps, 4)
    if errors:
        out["errors"] = errors
    return out


__all__ = ["engine_kv_goodput"]
