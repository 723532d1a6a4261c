"""Measurement from outside the engine: request records, streaming client, Locust load,
analysis, Prometheus scraping, host readings and the run timeline (docs/load-and-metrics.md). The
admin API client is the engine's (harness/engine/admin/); drivers that inject faults under load are
scenarios (harness/scenarios/): probes measure, they never inject.

Nothing here imports locust: only ``locust_user``/``locustfile`` do, inside the Locust process,
because importing locust monkey-patches the standard library with gevent.
"""
