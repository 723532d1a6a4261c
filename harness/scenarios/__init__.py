"""Faults under load: each driver injects faults through the fault runner while the harness's own
load runs, and returns its records (request records, attempts) and fault records.

Layer 6 of docs/architecture.md: a scenario may import the leaves, the engine, clusterfile,
probes, fabric and faults; checks judge what it returns and never drive it. The record types that
scenarios and checks share (``ClientFault``, ``KillWindow``, ``FaultMark``, ``SoakOutcome``, ...) live in
:mod:`harness.evidence`, the layer below both: checks import nothing from here.
"""
