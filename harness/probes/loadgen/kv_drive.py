"""Drive a foreign engine's KV use over stated thresholds with load (6.1.3 by load).

Real engines preallocate their KV pool, so KV use moves only with the tokens the engine holds:
this driver keeps a ramping number of concurrent streams of long prompts (each prompt unique from
its first token, so prefix caching cannot share their blocks; output lengths spread +-25 %) and reads KV use from the engine's
own metric (``kv_usage`` of its profile: ``vllm:kv_cache_usage_perc``, ``sglang:token_usage``,
Dynamo's kvstats), the fullest endpoint's value, every ``sample_s``. Concurrency grows until KV
use crosses the next threshold, is held there for ``hold_s``, then grows on to the next one; a
threshold not crossed within ``ramp_budget_s`` (or at ``max_concurrency``) ends the ramp. While a
level is held, KV use is kept inside its band: a stream fewer whenever it is past the next threshold,
more when it fell below the level's own; the hold lasts until KV use was seen inside the band twice
(at most ``ramp_budget_s``). Then no new request is sent, the ones in flight end, and
KV use is watched until it falls below the first threshold. Every request becomes a RequestRecord; nothing in flight is ever cancelled.

    drive = KvDrive(client, KvMeter(urls, "vllm"), plan, records_path)
    result = asyncio.run(drive.run())
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ProbeError
from harness.probes.metrics.metrics_source import MetricsSource, ScrapeSource
from harness.probes.metrics.prometheus import ENGINE_PROFILES
from harness.probes.client.records import RecordWriter, RequestRecord
from harness.probes.client.streaming import AsyncStreamingClient, CompletionRequest
from harness.probes.loadgen.workload import WORDS

log = logging.getLogger(__name__)

GAUGES = ("kv_usage", "requests_waiting", "requests_running", "preemptions")  # read when the profile has them
CALIBRATION_CHARS = 2000  # one probe prompt measures the server's characters per token


@dataclass(frozen=True)
class DrivePlan:
    thresholds: tuple[float, ...]     # ascending KV-use thresholds, 0..1 (the levels')
    prompt_tokens: int
    output_tokens: int
    max_concurrency: int = 64
    ramp_budget_s: float = 120.0      # most time to cross each threshold
    hold_s: float = 10.0              # each crossed threshold is held this long
    step_down_timeout_s: float = 60.0
    sample_s: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.thresholds or list(self.thresholds) != sorted(set(self.thresholds)):
            raise ProbeError(f"thresholds must be distinct and ascending, got {self.thresholds}",
                             fix="list the levels in rising order of kv_use_above")
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.max_concurrency < 1:
            raise ProbeError("prompt_tokens, output_tokens and max_concurrency must be >= 1",
                             fix="set degradation.load in the cluster file")

    @property
    def ramp_step(self) -> int:
        """Streams added per ramp tick (one tick per second): max_concurrency in about 32 s."""
        return max(1, math.ceil(self.max_concurrency / 32))


@dataclass
class KvSample:
    t_wall_ns: int
    kv_use: float | None              # fullest endpoint; None: no endpoint answered
    concurrency: int                  # streams the driver kept in flight
    waiting: float | None = None      # summed over endpoints
    running: float | None = None
    preemptions: float | None = None  # counter, summed
    per_endpoint: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"t_wall": self.t_wall_ns / 1e9, "kv_use": self.kv_use, "concurrency": self.concurrency,
                "waiting": self.waiting, "running": self.running, "preemptions": self.preemptions}


class KvMeter:
    """Reads the profile's KV-use gauge (and waiting/running/preemptions where it has them) of every
    metrics URL through a :class:`~harness.probes.metrics.metrics_source.MetricsSource` (default: scraping each
    URL; the cluster's Prometheus when its file names one); ``check()`` drops the URLs that do not expose
    KV use and raises ProbeError when none does (the item is then inconclusive, naming the family).
    The meter closes its source."""

    def __init__(self, urls: list[str], profile: str, *, api_key: str | None = None, timeout_s: float = 5.0,
                 source: MetricsSource | None = None) -> None:
        if profile not in ENGINE_PROFILES or "kv_usage" not in ENGINE_PROFILES[profile]:
            raise ProbeError(f"metric profile {profile!r} names no KV-use metric",
                             fix="use an engine whose profile has kv_usage (vllm, sglang, dynamo)")
        self.families = {q: ENGINE_PROFILES[profile][q] for q in GAUGES if q in ENGINE_PROFILES[profile]}
        self.urls = list(dict.fromkeys(urls))
        self.errors: list[str] = []
        self.dropped: dict[str, str] = {}
        self.source = source if source is not None else ScrapeSource(profile, api_key=api_key, timeout_s=timeout_s)

    def check(self) -> None:
        try:
            reading = self.source.read(self.urls, list(self.families)) if self.urls else None
        except ProbeError as exc:  # the source itself (a Prometheus) cannot be read
            reading, self.dropped = None, {u: f"not readable: {exc}" for u in self.urls}
            self.urls = []
        for url in list(self.urls):
            assert reading is not None
            if url in reading.errors:
                self.dropped[url] = f"not readable: {reading.errors[url]}"
                self.urls.remove(url)
            elif "kv_usage" not in reading.values.get(url, {}):
                self.dropped[url] = f"exposes no {self.families['kv_usage']}"
                self.urls.remove(url)
        if not self.urls:
            why = "; ".join(f"{u} {w}" for u, w in self.dropped.items()) or "no metrics URL given"
            raise ProbeError(f"no metrics endpoint exposes {self.families['kv_usage']} ({why})",
                             fix="name each worker's metrics URL (workers[].metrics) in the cluster file")

    def read(self, concurrency: int = 0) -> KvSample:
        t = time.time_ns()
        sample = KvSample(t, None, concurrency)
        try:
            reading = self.source.read(self.urls, list(self.families))
        except ProbeError as exc:  # a Prometheus that does not answer: this sample has no values, as a dead endpoint
            self.errors.append(f"{time.strftime('%H:%M:%S')} {self.source.label}: {exc}")
            return sample
        for url, why in reading.errors.items():
            self.errors.append(f"{time.strftime('%H:%M:%S')} {url}: {why}")
        for url in self.urls:
            values = reading.values.get(url)
            if values is None:
                continue
            if "kv_usage" in values:
                sample.per_endpoint[url] = values["kv_usage"]
            for q, attr in (("requests_waiting", "waiting"), ("requests_running", "running"),
                            ("preemptions", "preemptions")):
                if q in values:
                    setattr(sample, attr, (getattr(sample, attr) or 0.0) + values[q])
        if sample.per_endpoint:
            sample.kv_use = max(sample.per_endpoint.values())
        return sample

    def per_worker(self, start_wall_ns: int, end_wall_ns: int) -> dict[str, dict[str, Any]]:
        """KV use of each endpoint over a window, as the source has it (a Prometheus: every sample it
        scraped; a scrape: the meter's own reads): points, max and when it was reached."""
        out: dict[str, dict[str, Any]] = {}
        for url, points in self.source.series(self.urls, "kv_usage", start_wall_ns, end_wall_ns).items():
            top = max(points, key=lambda p: p[1], default=None)
            out[url] = {"points": len(points), "max": None if top is None else top[1],
                        "max_at": None if top is None else round(top[0] / 1e9, 3)}
        return out

    def close(self) -> None:
        self.source.close()


@dataclass
class DriveResult:
    samples: list[KvSample]
    records: list[RequestRecord]
    crossed_wall_ns: dict[int, int]      # threshold index -> first sample at or above it
    stopped_wall_ns: int                 # no new request after this
    drained_wall_ns: int                 # the last stream in flight ended
    step_down_s: float | None            # from the stop until KV use < the first threshold; None: never
    ramp_ended: str                      # why the ramp stopped
    chars_per_token: float
    max_concurrency_used: int


class KvDrive:
    def __init__(self, client: AsyncStreamingClient, meter: KvMeter, plan: DrivePlan,
                 records_path: Path | None = None) -> None:
        self.client, self.meter, self.plan = client, meter, plan
        self.records: list[RequestRecord] = []
        self.samples: list[KvSample] = []
        self._writer = RecordWriter(records_path) if records_path is not None else None
        self._rng = random.Random(plan.seed)
        self._target = 0
        self._most = 0
        self._slots: dict[int, asyncio.Task] = {}
        self._sending = True
        self._n = 0
        self.chars_per_token = 4.0

    # -- prompts -----------------------------------------------------------------------------------

    def _words(self, n_chars: int) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n_chars:
            words.append(self._rng.choice(WORDS))
        return " ".join(words)[:n_chars].rstrip()

    async def calibrate(self) -> float:
        """Characters per prompt token of this server's tokenizer, from one probe's usage."""
        text = self._words(CALIBRATION_CHARS)
        rec = await self.client.send(CompletionRequest(prompt=text, max_tokens=1), request_id="kv-drive-calibration")
        if not rec.ok or not rec.prompt_tokens:
            raise ProbeError(f"the calibration request failed ({rec.status} {rec.error_class}: {rec.error_message}) "
                             "or reported no usage.prompt_tokens", fix="check the cluster serves completions")
        self.chars_per_token = len(text) / rec.prompt_tokens
        return self.chars_per_token

    def _prompt(self) -> str:
        self._n += 1
        head = f"{self._n} {self._rng.getrandbits(64):016x} "  # unique first block: no shared prefix
        return head + self._words(max(1, int(self.plan.prompt_tokens * self.chars_per_token) - len(head)))

    def _output_tokens(self) -> int:
        """``output_tokens`` +-25 %: streams of equal length admitted together would also end together, and
        KV use would saw-tooth between full and empty instead of staying near a level."""
        n = self.plan.output_tokens
        return max(1, self._rng.randint(math.ceil(n * 0.75), math.floor(n * 1.25)))

    # -- streams -----------------------------------------------------------------------------------

    async def _stream_slot(self, slot: int) -> None:
        while self._sending and slot < self._target:
            request = CompletionRequest(prompt=self._prompt(), max_tokens=self._output_tokens(), ignore_eos=True)
            rec = await self.client.send(request, request_id=f"kv-{self._n}")
            self.records.append(rec)
            if self._writer is not None:
                self._writer.write(rec)
            if not rec.ok:
                await asyncio.sleep(1.0)  # a refused or failed request is retried after a pause, as a client would

    def _set_target(self, n: int) -> None:
        """Keep ``n`` streams going: slots at or above ``n`` end after their current request, missing
        ones below it start."""
        self._target = max(1, min(self.plan.max_concurrency, n))
        self._most = max(self._most, self._target)
        for s in range(self._target):
            task = self._slots.get(s)
            if task is None or task.done():
                if task is not None:
                    task.result()  # a bug in a slot must not pass silently
                self._slots[s] = asyncio.create_task(self._stream_slot(s))

    async def run(self) -> DriveResult:
        """Ramp until KV use crosses the next threshold, then hold it inside that level's band (below
        the next threshold: one stream fewer when above it, more when below the level) for hold_s."""
        plan = self.plan
        await self.calibrate()
        crossed: dict[int, int] = {}
        ramp_ended = "every threshold crossed and held"
        next_tick = time.monotonic()
        level_deadline = next_tick + plan.ramp_budget_s
        hold_until: float | None = None
        in_band = 0  # samples inside the held level's band
        idx = 0  # the level being reached or held
        try:
            while idx < len(plan.thresholds):
                now = time.monotonic()
                sample = await asyncio.to_thread(self.meter.read, self._target)
                self.samples.append(sample)
                kv = sample.kv_use
                for i, th in enumerate(plan.thresholds):
                    if kv is not None and kv >= th and i not in crossed:
                        crossed[i] = sample.t_wall_ns
                upper = plan.thresholds[idx + 1] if idx + 1 < len(plan.thresholds) else None
                if hold_until is None and idx in crossed:
                    hold_until, in_band, level_deadline = now + plan.hold_s, 0, now + plan.ramp_budget_s
                if hold_until is not None and kv is not None and kv >= plan.thresholds[idx] and (
                        upper is None or kv < upper):
                    in_band += 1
                # held (and seen inside its band at least twice, so requests ran at this level): on to the next
                if hold_until is not None and now >= hold_until and (in_band >= 2 or now > level_deadline):
                    idx, hold_until, level_deadline = idx + 1, None, now + plan.ramp_budget_s
                    continue
                if hold_until is None and now > level_deadline:
                    ramp_ended = (f"KV use did not cross {plan.thresholds[idx]:.2f} within "
                                  f"{plan.ramp_budget_s:.0f} s at up to {self._most} streams")
                    break
                if now >= next_tick and kv is not None:
                    if hold_until is not None and upper is not None and kv >= upper:
                        self._set_target(self._target - 1)  # past the next level: back into this one
                    elif kv < plan.thresholds[idx]:
                        self._set_target(self._target + plan.ramp_step)
                    next_tick = now + 1.0
                await asyncio.sleep(plan.sample_s)
        finally:
            self._sending = False
            stopped = time.time_ns()
            stop_mono = time.monotonic()
            drained, step_down = await self._drain_and_watch(list(self._slots.values()), stop_mono)
            if self._writer is not None:
                self._writer.close()
        return DriveResult(self.samples, sorted(self.records, key=lambda r: r.start_wall_ns()), crossed, stopped,
                           drained, step_down, ramp_ended, self.chars_per_token, self._most)

    async def _drain_and_watch(self, slots: list[asyncio.Task], stop_mono: float) -> tuple[int, float | None]:
        """Until every stream ended (the client's own timeout bounds each) and KV use is below the first
        threshold, or step_down_timeout_s after the last stream ended."""
        pending = set(slots)
        step_down: float | None = None
        drained_wall: int | None = None
        deadline: float | None = None
        while True:
            done, pending = await asyncio.wait(pending, timeout=self.plan.sample_s) if pending else (set(), set())
            for task in done:
                task.result()  # a bug in a slot must not pass silently
            sample = await asyncio.to_thread(self.meter.read, 0)
            self.samples.append(sample)
            if step_down is None and sample.kv_use is not None and sample.kv_use < self.plan.thresholds[0]:
                step_down = time.monotonic() - stop_mono
            if not pending and drained_wall is None:
                drained_wall = time.time_ns()
                deadline = time.monotonic() + self.plan.step_down_timeout_s
            if drained_wall is not None and (step_down is not None or time.monotonic() > deadline):
                return drained_wall, step_down
            if pending:
                continue
            await asyncio.sleep(self.plan.sample_s)


__all__ = ["DrivePlan", "DriveResult", "KvDrive", "KvMeter", "KvSample"]
