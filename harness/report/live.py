"""What the operator sees while the suites run: current test and phase, the active fault and its
age, requests finished (ok / failed) and in flight, current TTFT/TPOT p99, KV use and the
degradation level.

On a terminal it is a rich ``Live`` panel as wide as the terminal, shown only while a conformance
test runs (so pytest's own progress output is never drawn over); elsewhere (CI logs) it is a plain
status line (:meth:`LiveStatus.plain_line`: a UTC timestamp, under 200 characters, always on a line
of its own) at most once every ``plain_every_s``; harness/report/live_phases.py shows it. Request counts are this suite's (they restart
when the test changes). It writes to its own duplicate of the
terminal's file descriptor, taken before any test runs, so pytest's output capture neither
swallows it nor receives it. A background thread samples the cluster's metrics (KV use,
degradation level, requests running/waiting) every ``interval_s``; the samples go into the
report's KV/degradation plot.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable

import httpx

from harness.report.text import faults_summary

log = logging.getLogger(__name__)

MODES = ("auto", "rich", "plain", "off")
_WINDOW_S = 30.0  # TTFT/TPOT p99 over requests that finished in the last 30 s
MAX_SAMPLES = 4096  # cluster gauges kept for the report: beyond, pairs merge (a 10-hour run stays bounded)
PLAIN_MAX = 199   # a plain line stays under 200 characters (a CI log line, a terminal's width)
SETUP = "setup (bringing the cluster up, starting load)"


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _or_dash(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _halved(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive pairs merged into one row at the later time holding each gauge's larger value
    (the report shows peaks: a KV spike or a degradation level must survive the merge)."""
    out = []
    for i in range(0, len(rows) - 1, 2):
        a, b = rows[i], rows[i + 1]
        merged: dict[str, Any] = {"t": b["t"]}
        for key in (a.keys() | b.keys()) - {"t"}:
            values = [v for v in (a.get(key), b.get(key)) if v is not None]
            if values:
                merged[key] = max(values)
        out.append(merged)
    if len(rows) % 2:
        out.append(rows[-1])
    return out


class _RecordTail:
    """Follows one load run's ``requests*.jsonl`` files (appended as requests finish)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.offsets: dict[Path, int] = {}

    def new_records(self) -> list[dict[str, Any]]:
        out = []
        folder = Path(self.runner.output_dir)
        for path in sorted(folder.glob("requests*.jsonl")):
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next tick
            self.offsets[path] = start + len(complete)
            for line in complete.splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


class LiveStatus:
    """Live progress of a conformance run (see the module doc). Thread-safe setters."""

    def __init__(self, stream: IO[str], *, mode: str = "auto", interval_s: float = 1.0,
                 plain_every_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        if mode not in MODES:
            raise ValueError(f"live mode {mode!r}: use one of {', '.join(MODES)}")
        self.stream = stream
        is_tty = hasattr(stream, "isatty") and stream.isatty()
        self.mode = ("rich" if is_tty else "plain") if mode == "auto" else mode
        self.interval_s, self.plain_every_s, self.clock = interval_s, plain_every_s, clock
        self.samples: list[dict[str, Any]] = []  # cluster gauges over time, for the report
        self.test = ""
        self.test_since = clock()
        self.phase = ""
        self.faults: dict[str, tuple[str, float]] = {}  # fault id -> (label, since)
        self.ok = self.failed = 0
        self.in_flight: float | None = None
        self.kv_usage: float | None = None
        self.level: float | None = None
        self._recent: deque[tuple[float, float | None, float | None]] = deque()  # (end, ttft ms, tpot ms)
        self._tails: list[_RecordTail] = []
        self._metrics_url: str | None = None
        self._families: dict[str, str] = {}
        self._http: httpx.Client | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Any = None
        self._last_plain = -math.inf
        self._newline_first = False  # the terminal's cursor is mid-line (pytest's progress dots)

    # -- inputs ------------------------------------------------------------------------------------

    def set_cluster(self, metrics_url: str | None, cluster: Any = None) -> None:
        """Sample ``metrics_url`` with the metric profile of the cluster's engine (docs/metrics.md;
        the bundled engine's when the cluster file names none; nothing for an engine without one)."""
        from harness.errors import ProbeError
        from harness.probes.metrics.prometheus import ENGINE_PROFILES, profile_for

        try:
            name = profile_for(cluster)
        except ProbeError:
            name = None
        profile = ENGINE_PROFILES.get(name, {}) if name else {}
        with self._lock:
            self._metrics_url = metrics_url
            self._families = {q: profile[q] for q in ("kv_usage", "degradation_level", "requests_running",
                                                      "requests_waiting") if q in profile}

    def set_phase(self, phase: str, test: str | None = None) -> None:
        with self._lock:
            self.phase = phase
            if test is not None and test != self.test:
                self.test, self.test_since = test, self.clock()
                # counts are per suite: the previous suite's load runs have ended
                self.ok = self.failed = 0
                self._tails.clear()
        self._redraw()
        self._maybe_plain()

    def fault_event(self, record: Any) -> None:
        """A FaultRunner listener: an inject makes the fault active, its revert ends it."""
        action = getattr(record.action, "value", record.action)
        status = getattr(record.status, "value", record.status)
        with self._lock:
            if action == "inject" and status in ("succeeded", "dry_run"):
                self.faults[record.fault_id] = (f"{record.kind} {record.target}", self.clock())
            elif action == "revert":
                self.faults.pop(record.fault_id, None)
        self._redraw()
        self._maybe_plain()

    def add_load(self, runner: Any) -> None:
        with self._lock:
            self._tails.append(_RecordTail(runner))

    # -- sampling ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """One sampling step: new request records, the cluster's gauges; then redraw."""
        now = self.clock()
        with self._lock:
            tails = list(self._tails)
        for tail in tails:
            for rec in tail.new_records():
                self._count(rec, now)
        self._sample_metrics(now)
        with self._lock:
            while self._recent and self._recent[0][0] < now - _WINDOW_S:
                self._recent.popleft()
        self._redraw()
        self._maybe_plain()

    def _redraw(self) -> None:
        live = self._live
        if live is not None:
            live.update(self.renderable(), refresh=True)

    def _count(self, rec: dict[str, Any], now: float) -> None:
        ok = rec.get("status") == "ok"
        sent, first, end = rec.get("sent_ns"), rec.get("first_token_ns"), rec.get("end_ns")
        n = sum(rec.get("chunk_tokens") or []) or len(rec.get("token_ids") or [])
        ttft = (first - sent) / 1e6 if ok and None not in (first, sent) else None
        tpot = (end - first) / 1e6 / (n - 1) if ok and None not in (first, end) and n >= 2 else None
        with self._lock:
            if ok:
                self.ok += 1
            else:
                self.failed += 1
            self._recent.append((now, ttft, tpot))

    def _sample_metrics(self, now: float) -> None:
        with self._lock:
            url, families = self._metrics_url, dict(self._families)
        if not url or not families:
            return
        from harness.probes.metrics.prometheus import parse_metrics

        try:
            if self._http is None:
                self._http = httpx.Client(timeout=2.0)
            resp = self._http.get(url)
            samples = parse_metrics(resp.text) if resp.status_code == 200 else []
        except Exception as exc:  # noqa: BLE001 -- a dead endpoint during a fault is a reading, not an error
            log.debug("live status: metrics scrape failed: %s", exc)
            return
        values: dict[str, list[float]] = {}
        for s in samples:
            for quantity, family in families.items():
                if s.name in (family, family + "_total"):
                    values.setdefault(quantity, []).append(s.value)
        row: dict[str, Any] = {"t": now}
        if values.get("kv_usage"):
            row["kv_usage"] = max(values["kv_usage"])  # the fullest worker: where degradation triggers
        if values.get("degradation_level"):
            row["degradation_level"] = max(values["degradation_level"])
        running = sum(values.get("requests_running", [])) + sum(values.get("requests_waiting", []))
        if "requests_running" in values or "requests_waiting" in values:
            row["requests_in_engine"] = running
        with self._lock:
            self.kv_usage, self.level = row.get("kv_usage"), row.get("degradation_level")
            self.in_flight = row.get("requests_in_engine")
            if len(row) > 1:
                self.samples.append(row)
                if len(self.samples) > MAX_SAMPLES:
                    self.samples[:] = _halved(self.samples)

    # -- output ------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        with self._lock:
            recent = list(self._recent)
            return {"test": self.test, "phase": self.phase, "test_age_s": now - self.test_since,
                    "faults": [(label, now - since) for label, since in self.faults.values()],
                    "ok": self.ok, "failed": self.failed, "in_flight": self.in_flight,
                    "ttft_p99_ms": _p99([t for _, t, _ in recent if t is not None]),
                    "tpot_p99_ms": _p99([t for _, _, t in recent if t is not None]),
                    "kv_usage": self.kv_usage, "level": self.level}

    def plain_line(self) -> str:
        """``[live] 07:21:03Z test_x.py | running 12 s | faults 2: hbm_fill decode-0 (40 s), ... |
        this suite: ok 624 failed 0 | in engine 2 | p99 TTFT 100 ms TPOT 15.4 ms | KV 93% L3`` (p99 over
        the requests that ended in the last 30 s)"""
        s = self.snapshot()
        stamp = time.strftime("%H:%M:%SZ", time.gmtime(self.clock()))
        head = f"[live] {stamp} {_suite(s['test'])} | {s['phase'] or '-'} {s['test_age_s']:.0f} s | "
        tail = (f" | this suite: ok {s['ok']} failed {s['failed']} | in engine {_or_dash(s['in_flight'], '{:.0f}')}"
                f" | p99 TTFT {_or_dash(s['ttft_p99_ms'], '{:.0f} ms')} TPOT "
                f"{_or_dash(s['tpot_p99_ms'], '{:.1f} ms')} | KV {_or_dash(s['kv_usage'], '{:.0%}')} "
                f"{_or_dash(s['level'], 'L{:.0f}')}")
        faults = faults_summary(s["faults"], PLAIN_MAX - len(head) - len(tail))
        return (head + faults + tail)[:PLAIN_MAX]

    def renderable(self) -> Any:
        from rich.table import Table

        s = self.snapshot()
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        table.add_row("suite", f"{s['test'] or '-'}  [dim]({s['phase'] or '-'}, {s['test_age_s']:.0f} s)[/]")
        table.add_row("fault", ", ".join(f"[bold red]{label}[/] for {age:.1f} s" for label, age in s["faults"])
                      or "[green]none active[/]")
        table.add_row("requests", f"ok {s['ok']}  [red]failed {s['failed']}[/]  in engine "
                                  f"{_or_dash(s['in_flight'], '{:.0f}')}")
        table.add_row("p99 (30 s)", f"TTFT {_or_dash(s['ttft_p99_ms'], '{:.0f} ms')}   "
                                    f"TPOT {_or_dash(s['tpot_p99_ms'], '{:.1f} ms')}")
        table.add_row("KV use", _or_dash(s["kv_usage"], "{:.0%}"))
        table.add_row("degradation", _or_dash(s["level"], "Level {:.0f}"))
        return table

    def _maybe_plain(self) -> None:
        """At most one line per ``plain_every_s`` (a phase or fault change shows in the next one; its
        timestamp says when it was written)."""
        if self.mode != "plain" or self._thread is None:
            return
        now = self.clock()
        if now - self._last_plain < self.plain_every_s:
            return
        self._last_plain = now
        self.write_line(self.plain_line())

    def begin_line(self) -> None:
        """The terminal's cursor is not at a line start: the next line starts with a newline."""
        self._newline_first = True

    def write_line(self, line: str) -> None:
        with self._lock:
            prefix, self._newline_first = ("\n" if self._newline_first else ""), False
            try:
                self.stream.write(prefix + line + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def print(self, renderable: Any) -> bool:
        """Print above the live panel; False when no panel is shown (the caller prints as usual)."""
        live = self._live
        if live is None:
            return False
        live.console.print(renderable, soft_wrap=True)
        return True

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Show the display (one conformance test phase); sampling runs until :meth:`stop`."""
        if self.mode == "off" or self._thread is not None:
            return
        if self.mode == "rich":
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True, width=_terminal_width(self.stream))
            self._live = Live(self.renderable(), console=console, auto_refresh=False, transient=True)
            self._live.start(refresh=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="harness-live", daemon=True)
        self._thread.start()
        self._maybe_plain()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 -- the display must never end a run
                log.exception("live status tick failed")

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(10)
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def close(self) -> None:
        self.stop()
        if self._http is not None:
            self._http.close()
            self._http = None


def _suite(nodeid: str) -> str:
    """The suite's file (and parameters): what the user passed to pytest, short enough for a line."""
    from harness.report.suites import suite_label

    return suite_label(nodeid) if nodeid else "-"


def _terminal_width(stream: IO[str]) -> int | None:
    """Columns of the terminal ``stream`` is on (rich would ask stdin/stdout, which pytest captures)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None
    return columns or None  # a terminal that never set its size reports 0: rich's default then
