"""Measurement from outside the engine, in five rooms (docs/load-and-metrics.md):

- ``loadgen``: Locust load here or from load hosts, its workloads, the KV-use drive;
- ``client``: request records, the streaming client, latency analysis, the run timeline;
- ``metrics``: the engine's metrics, scraped or through Prometheus;
- ``workers``: the cluster's workers observed (inventory, rejoin, leaks, GPUs);
- ``machine_health``: the test machine's own health (PSI, run-queue waits, the harness's memory).

The
admin API client is the engine's (harness/engine/admin/); drivers that inject faults under load are
scenarios (harness/scenarios/): probes measure, they never inject.

Nothing here imports locust: only ``loadgen.locust_user``/``loadgen.locustfile`` do, inside the Locust process,
because importing locust monkey-patches the standard library with gevent.
"""
