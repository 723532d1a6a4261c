"""The TCP/IP class sampled all along an interleaved PFC storm, under a lossless-class flood (item 6.1.5).

The storm's bursts come in groups with calm gaps between them (``PfcStorm(group=..., gap_ms=...)``).
Each round runs a UDP flood in the lossless class (a full socket buffer holds it, as PFC holds an
RDMA sender) while paced TCP round trips, then bulk flows, cross the stormed NIC on TCP ports; every
round trip and flow is then put on the side it fell in: inside a storm group, or in a calm gap
(after ``settle_s`` of the group's aftermath). Both sides run under the same flood, interleaved
every few seconds, so they differ by the pause frames alone: the flood's own cost and the test
machine's noise, which drifts over minutes, fall on both (docs/fabric.md).

Among each round's paced round trips, one in FLOOR_EVERY goes over the stormed host's loopback
instead (no network: the host's timer, scheduler and probe ends), interleaved, so each side of the
storm carries its own floor (``TcpClassSample.floor_rtts_ms``) taken at the same moments as its
network round trips: the resolution its p99 is judged with. (Taken in a phase of its own, 2 s after
8 s of network round trips, the floor once fell wholly in a calm gap, while the storm side's round
trips paid for an idle host waking up: 0.53 ms against a calm 0.14 ms, a false fail over SSH.)

Used by the 6.1.5 suite (harness/suites/test_item5_pfc_isolation.py) and by the fabric tests, so
both measure the same way; the checks (harness/checks/fabric.py) judge what :meth:`sides` returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from harness.fabric.bandwidth import LosslessFlood, Station, measure_bulk
from harness.fabric.tcpprobe import (DEFAULT_PORT, LOOPBACK_PORT_OFFSET, TcpClassSample, class_sample,
                                     split_by_spans, timed_round_trips, timed_round_trips_with_floor)
from harness.errors import ProbeError
from harness.faults import PfcStorm
from harness.hosts import Executor

log = logging.getLogger(__name__)

RR_S, RR_INTERVAL_MS = 8.0, 2.0 # paced round trips per round: ~4000, ~1700 a side (power: docs/statistics.md)
FLOOR_S = 2.0                   # loopback round trips per round (the floor): ~1000, ~400 a side, interleaved:
FLOOR_EVERY = round((RR_S + FLOOR_S) / FLOOR_S)   # one round trip in 5 goes over loopback
BULK_S = 0.5                    # one bulk flow
BULK_EACH, BULK_MOST = 4, 16    # flows per round: until each side gained BULK_EACH, at most BULK_MOST
PAUSE_MS, RESUME_MS = 300.0, 100.0
GROUP = 8                       # bursts per storm group: 3.2 s of storm ...
GAP_MS = GROUP * (PAUSE_MS + RESUME_MS)   # ... then as long a calm gap
SETTLE_S = 0.5                  # a group's aftermath (the flood catching up) is on neither side
ROUND_S = RR_S + FLOOR_S + BULK_MOST * (BULK_S + 1.5) + 10   # the most one round takes


def storm_bursts(most: int, *, group: int = GROUP, gap_ms: float = GAP_MS, round_s: float = ROUND_S) -> int:
    """Bursts enough for ``most`` rounds and a margin, taken back to back (the storm is reverted as
    soon as the verdict is decided). A storm sized for fewer once ended under the later samples:
    the flood then had the NIC at full rate and TCP read 0.52 x baseline (a false FAIL)."""
    per_group_s = (group * (PAUSE_MS + RESUME_MS) + gap_ms) / 1000
    return int((most * round_s + 20) / per_group_s + 1) * group


@dataclass
class InterleavedStorm:
    """Rounds of TCP-class samples under an injected, grouped PfcStorm (``storm``; ``ex`` runs on its
    host). ``clock_margin_s`` widens each bulk flow's span when flows are timed by another clock
    than the storm's (over SSH). Inject the storm first; call :meth:`one_round` or :meth:`more`."""

    storm: PfcStorm
    ex: Executor
    client: Station
    server: Station
    flood_from: Station
    flood_to: Station
    flood_port: int
    datagram_bytes: int
    probe_port: int = DEFAULT_PORT
    clock_margin_s: float = 0.0
    rr_s: float = RR_S
    bulk_each: int = BULK_EACH
    bulk_most: int = BULK_MOST
    settle_s: float = SETTLE_S
    floor_s: float = FLOOR_S
    timed: list[tuple[float, float, float]] = field(default_factory=list)  # (sent, answered, ms) of each round trip
    flows: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, bit/s) of each bulk flow
    floor: list[tuple[float, float, float]] = field(default_factory=list)  # (sent, answered, ms) over loopback
    rounds: list[dict[str, int]] = field(default_factory=list)
    floods: list[dict[str, Any]] = field(default_factory=list)   # what each round's flood moved (evidence)
    ended_under: list[int] = field(default_factory=list)  # a round under which the bursts ended: left out
    floor_errors: list[str] = field(default_factory=list)  # why a round's loopback floor was not measured

    def sides(self) -> tuple[TcpClassSample, TcpClassSample]:
        """(calm, during): every round trip and flow so far, on the side of the storm it fell in; each
        side carries the loopback round trips taken on that side (its floor: what the host itself,
        storm machinery included, adds to a round trip there)."""
        spans = self.storm.spans(self.ex)
        rtt_in, rtt_out = split_by_spans(self.timed, spans, settle_s=self.settle_s)
        floor_in, floor_out = split_by_spans(self.floor, spans, settle_s=self.settle_s)
        m = self.clock_margin_s
        flow_in, flow_out = split_by_spans([(a - m, b + m, bps) for a, b, bps in self.flows], spans,
                                           settle_s=self.settle_s)
        t0 = min((a for a, _, _ in self.timed), default=0.0)
        t1 = max((b for _, b, _ in self.timed + self.flows), default=0.0)
        return (class_sample("calm", rtt_out, flow_out, t0, t1, floor_out),
                class_sample("during", rtt_in, flow_in, t0, t1, floor_in))

    def one_round(self) -> None:
        """Round trips with the loopback floor's interleaved (:meth:`round_trips`), then bulk flows until each side has
        ``bulk_each`` more (at most ``bulk_most``), under the flood. A round the storm's bursts ended
        under is left out (its figures are not the storm's)."""
        flood = LosslessFlood(self.flood_from, self.flood_to, port=self.flood_port, datagram_bytes=self.datagram_bytes)
        mine: list[tuple[float, float, float]] = []
        with flood:
            taken, floor = self.round_trips()
            calm0, storm0 = (len(x.throughputs_bps) for x in self.sides())
            while len(mine) < self.bulk_most:
                t0 = time.time()
                flow = measure_bulk(self.client, self.server, port=self.probe_port + 1, duration_s=BULK_S,
                                    tool="python", allow_zero=True)
                # the data's own span, by the receiver's clock (clock_margin_s covers another host's): the
                # SSH call around it (starting both ends, collecting) took 2-3 s on a loaded machine,
                # longer than a calm gap less its settle, so no flow over SSH fell on the calm side
                span = ((flow.first_wall, flow.last_wall) if flow.first_wall is not None and flow.last_wall is not None
                        else (t0, time.time()))   # nothing arrived: the whole call, as before
                mine.append((*span, flow.bps))
                self.flows.append(mine[-1])
                calm, during = self.sides()
                if (len(calm.throughputs_bps) - calm0 >= self.bulk_each
                        and len(during.throughputs_bps) - storm0 >= self.bulk_each):
                    break
        self.floods.append({"round": len(self.rounds) + 1, **flood.result})
        if not self.storm.running():
            del self.flows[len(self.flows) - len(mine):]
            self.ended_under.append(len(self.rounds) + 1)
            return
        self.timed.extend(taken)
        self.floor.extend(floor)
        self.rounds.append({"round_trips": len(taken), "loopback_round_trips": len(floor), "bulk_flows": len(mine)})

    def round_trips(self) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
        """(network, floor) round trips as (sent, answered, ms): ``rr_s + floor_s`` seconds of paced
        round trips, one in FLOOR_EVERY of them over the stormed host's loopback (on ``probe_port``
        + LOOPBACK_PORT_OFFSET there), so each side of the storm gets its floor in the same share as
        its network round trips. A floor that cannot be taken (that port taken on the host, its
        echo server refused) is no reason to stop the item: the round has none, ``floor_errors``
        says why, and the verdict's evidence names it (harness/checks/fabric.py)."""
        def timed(pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float, float]]:
            return [(sent, sent + ms / 1e3, ms) for sent, ms in pairs]

        if self.floor_s <= 0:
            return timed(timed_round_trips(self.client, self.server, port=self.probe_port, seconds=self.rr_s,
                                           interval_ms=RR_INTERVAL_MS)), []
        seconds = self.rr_s + self.floor_s
        got = timed_round_trips_with_floor(self.client, self.server, port=self.probe_port,
                                           floor_port=self.probe_port + LOOPBACK_PORT_OFFSET, seconds=seconds,
                                           interval_ms=RR_INTERVAL_MS,
                                           floor_every=max(2, round(seconds / self.floor_s)))
        if got.floor_error:
            self.floor_errors.append(f"round {len(self.rounds) + 1}: {got.floor_error}")
            log.warning("%s", self.floor_errors[-1])
        return timed(got.network), timed(got.floor)

    def more(self, k: int) -> None:
        """The extension loop's step: ``k`` counts round trips or flows that would decide, so judge
        again after at most 2 rounds (~3400 round trips a side) rather than running the budget out."""
        for _ in range(min(k, 2)):
            self.one_round()
            if self.ended_under:
                return

    def evidence(self) -> dict[str, Any]:
        """The storm's shape and what the rounds measured (no infinity: JSON has none)."""
        s = self.storm
        return {"target": s.target, "pause_ms": s.pause_ms, "resume_ms": s.resume_ms, "group": s.group,
                "gap_ms": s.gap_ms, "settle_s": self.settle_s, "lossless_flood": self.floods,
                "rounds": self.rounds, "storm_ended_under_round": self.ended_under,
                "loopback_floor_errors": self.floor_errors,
                "spans": [[a, b if b != float("inf") else None] for a, b in s.spans(self.ex)]}

