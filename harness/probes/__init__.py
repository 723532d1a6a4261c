"""Measurement from outside the engine: request records, streaming client, Locust load,
analysis, Prometheus scraping, the admin API and the run timeline (docs/load-and-metrics.md).

Nothing here imports locust: only ``locust_user``/``locustfile`` do, inside the Locust process,
because importing locust monkey-patches the standard library with gevent.
"""
