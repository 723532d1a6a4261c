"""What the client saw: the request records (records), the streaming client and its SSE parsing
(streaming, sse, observed_stream), the request shapes engines accept (shapes, request_shape), the
latency analysis of records (analysis, record_digest) and the run's timeline (timeline)."""
