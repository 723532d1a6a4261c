"""The bundled engine's admin API from the outside: the typed client (``client.AdminClient``, a
worker-table poller) and the results it parses (``models``: ``AdminWorker``, ``DegradationState``,
...). It lives with the engine because it speaks the engine's own API (``Topology`` returns these
types); probes, faults, scenarios and suites use it from above."""
