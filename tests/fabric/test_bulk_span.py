"""A bulk flow's own span: the receiver's wall clock at its first and last byte (harness/fabric/ends.py
``bulk-serve``), what 6.1.5 sorts flows into storm and calm by (harness/scenarios/pfc_isolation.py).

Planted defect it catches: the span taken around the whole call (starting the receiver and the
sender, collecting the result), which over SSH took 2-3 s for 0.5 s of data, longer than a calm gap
less its settle time, so no flow fell on the calm side (vLLM over NIXL, 2026-12-06)."""

from __future__ import annotations

import socket
import time

from harness.fabric.bandwidth import Station, measure_bulk


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_flow_reports_when_its_data_arrived_inside_the_call():
    here = Station((), "127.0.0.1", "loopback")
    t0 = time.time()
    flow = measure_bulk(here, here, port=_free_port(), duration_s=0.5, tool="python")
    t1 = time.time()
    assert flow.bytes > 0 and flow.first_wall is not None and flow.last_wall is not None
    assert t0 < flow.first_wall < flow.last_wall < t1
    # the data's span is the measured seconds (one clock read twice), and shorter than the call around it
    assert abs((flow.last_wall - flow.first_wall) - flow.seconds) < 0.05, flow
    assert flow.last_wall - flow.first_wall < (t1 - t0) - 0.05, (flow, t1 - t0)
    assert {"first_wall", "last_wall"} <= set(flow.to_dict())
