"""Serving: the OpenAI-compatible HTTP API over any ``EngineClient``, the single-process server,
and the Prometheus metrics."""
