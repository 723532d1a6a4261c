"""Metric sources: the engine's /metrics scraped directly (prometheus) or read through a Prometheus
server (promql), behind one interface (metrics_base, metrics_source); the engine's own KV transfer
goodput (kv_goodput)."""
