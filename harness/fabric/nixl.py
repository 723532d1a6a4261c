"""Item 6.1.1 from vLLM's own KV transfers over NIXL (issue 35 item 3; docs/fabric.md, "KV bandwidth from
the engine's own transfers").

vLLM's NixlConnector exports, on the instance that pulls the KV (decode), one histogram observation per
finished NIXL transfer: ``vllm:nixl_bytes_transferred`` (bytes, NIXL's telemetry ``totalBytes``) and
``vllm:nixl_xfer_time_seconds`` (NIXL's ``xferDuration``: from the READ's post until decode's engine saw
it done, so it includes how long decode took to poll the completion), beside
``vllm:nixl_post_time_seconds`` and the counter ``vllm:nixl_num_failed_transfers_total``. Requests sent
one at a time, the histograms scraped before and after each: each scrape's ``_sum``/``_count`` deltas
are one transfer's bytes and seconds (a delta of several transfers is kept as their total, its count
said). At the same time the lossless class of the prefill host's fabric NIC (``tc -s class show`` over
SSH, as the cluster file names the host) counts what left that host: the cross-check that NIXL's bytes
crossed the link being judged (:data:`LINK_RATIO_MIN` .. :data:`LINK_RATIO_MAX` of them).

Nothing here judges: harness/checks/fabric.py does (:func:`harness.checks.fabric.raw_bandwidth_verdict`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx

from harness.errors import ProbeError
from harness.probes.metrics.prometheus import parse_metrics

log = logging.getLogger(__name__)

XFER_SECONDS = "vllm:nixl_xfer_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
POST_SECONDS = "vllm:nixl_post_time_seconds"
FAILED = "vllm:nixl_num_failed_transfers"
SOURCE = "nixl_metrics"

# The prefill host's lossless class must have sent at least NIXL's bytes (less: some KV took another
# way, e.g. UCX's shared memory between two namespaces: 1.8 KB on the link for 6.5 MB of KV, seen
# here) and at most 1.2 times them: TCP/IP and UCX headers on top (1.010-1.012 measured on
# vllm-pd-nixl, 4 MB transfers, 2026-12-06); more means other traffic shared the class while it was
# counted, and the link's count no longer says what NIXL moved.
LINK_RATIO_MIN, LINK_RATIO_MAX = 1.0, 1.2
PROMPT_WORDS = 100          # first guess (well inside any context); resized from the first answer's prompt_tokens
PROMPT_FILL = 0.9           # of the model's max_model_len (minus the tokens asked for)
MAX_TOKENS = 2


@dataclass(frozen=True)
class NixlTotals:
    """The NIXL histograms' totals in one scrape, summed over their label sets (engines)."""

    present: bool           # the histograms are exported (an instance running NixlConnector)
    transfers: float        # _count of the transfer-time histogram
    bytes: float            # _sum of the bytes histogram
    seconds: float          # _sum of the transfer-time histogram
    post_seconds: float     # _sum of the post-time histogram (0 where absent)
    failed: float           # failed transfers (counter; 0 where absent)


def parse_nixl(text: str) -> NixlTotals:
    """:class:`NixlTotals` of one Prometheus exposition (vLLM 0.32's names; see tests/fabric/data/nixl/)."""
    sums: dict[str, float] = {}
    families: set[str] = set()
    for s in parse_metrics(text):
        for family in (XFER_SECONDS, BYTES, POST_SECONDS):
            if s.name in (f"{family}_sum", f"{family}_count"):
                families.add(family)
                sums[s.name] = sums.get(s.name, 0.0) + s.value
        if s.name in (FAILED, f"{FAILED}_total"):
            sums[FAILED] = sums.get(FAILED, 0.0) + s.value
    present = XFER_SECONDS in families and BYTES in families
    return NixlTotals(present, sums.get(f"{XFER_SECONDS}_count", 0.0), sums.get(f"{BYTES}_sum", 0.0),
                      sums.get(f"{XFER_SECONDS}_sum", 0.0), sums.get(f"{POST_SECONDS}_sum", 0.0),
                      sums.get(FAILED, 0.0))


@dataclass(frozen=True)
class NixlTransfer:
    """What NIXL moved between two scrapes: ``count`` transfers (1 when requests go one at a time)."""

    bytes: float
    seconds: float
    count: int
    post_seconds: float = 0.0

    @property
    def bps(self) -> float:
        return 8 * self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "count": self.count, "post_seconds": self.post_seconds,
                "gbit_per_s": self.bps / 1e9}


def transfer_between(before: NixlTotals, after: NixlTotals) -> NixlTransfer | None:
    """The transfer(s) finished between two scrapes; None when none finished. Counters that went back
    (the instance restarted between the scrapes) are a ProbeError: the delta would be a guess."""
    count = after.transfers - before.transfers
    if count < 0 or after.bytes < before.bytes or after.seconds < before.seconds:
        raise ProbeError(f"NIXL counters went back between two scrapes ({before.transfers:g} -> {after.transfers:g} "
                         "transfers): the instance restarted", fix="measure again on a steady cluster")
    if count == 0:
        return None
    return NixlTransfer(after.bytes - before.bytes, after.seconds - before.seconds, int(round(count)),
                        max(0.0, after.post_seconds - before.post_seconds))


@dataclass
class LinkCount:
    """Bytes the prefill host's fabric NIC sent in its lossless and TCP classes while NIXL moved ``nixl_bytes``."""

    host: str
    interface: str
    lossless_class: str
    lossless_bytes: int
    tcp_bytes: int | None
    nixl_bytes: float

    @property
    def ratio(self) -> float | None:
        return self.lossless_bytes / self.nixl_bytes if self.nixl_bytes > 0 else None

    @property
    def crossed(self) -> bool:
        """The link counted what NIXL reported, within LINK_RATIO_MIN .. LINK_RATIO_MAX."""
        return self.ratio is not None and LINK_RATIO_MIN <= self.ratio <= LINK_RATIO_MAX

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "interface": self.interface, "lossless_class": self.lossless_class,
                "lossless_bytes": self.lossless_bytes, "tcp_bytes": self.tcp_bytes, "nixl_bytes": self.nixl_bytes,
                "ratio": self.ratio, "accepted": [LINK_RATIO_MIN, LINK_RATIO_MAX], "crossed": self.crossed}


@dataclass
class NixlRun:
    """vLLM's own NIXL transfers, driven by the harness, with the link's count beside them."""

    metrics_urls: list[str]                                  # the workers whose NIXL histograms are summed
    transfers: list[NixlTransfer] = field(default_factory=list)
    links: list[LinkCount] = field(default_factory=list)     # one per batch of transfers
    failed: float = 0.0                                      # NIXL's failed-transfer count rose by this
    requests: int = 0
    errors: list[str] = field(default_factory=list)          # requests that failed (HTTP), not transfers
    prompt_tokens: list[int] = field(default_factory=list)

    @property
    def link(self) -> LinkCount | None:
        """All batches' counts together (None before any)."""
        if not self.links:
            return None
        first = self.links[0]
        tcp = [c.tcp_bytes for c in self.links]
        return LinkCount(first.host, first.interface, first.lossless_class, sum(c.lossless_bytes for c in self.links),
                         None if None in tcp else sum(t for t in tcp if t is not None),
                         sum(c.nixl_bytes for c in self.links))

    def to_dict(self) -> dict[str, Any]:
        link = self.link
        return {"source": SOURCE, "metrics_urls": self.metrics_urls, "transfers": [t.to_dict() for t in self.transfers],
                "requests": self.requests, "failed_transfers": self.failed, "request_errors": self.errors[:10],
                "prompt_tokens": self.prompt_tokens, "link": None if link is None else link.to_dict(),
                "link_batches": [c.to_dict() for c in self.links],
                "what": "bytes / seconds of each NIXL transfer from decode's vllm:nixl_bytes_transferred and "
                        "vllm:nixl_xfer_time_seconds (sum and count deltas between scrapes, one request at a time; "
                        "the time runs from the READ's post until decode's engine saw it done)"}


def scrape(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> str:
    resp = httpx.get(url, timeout=timeout, headers=headers or {})
    resp.raise_for_status()
    return resp.text


def nixl_metrics_urls(cluster: Any) -> list[str]:
    """The metrics URLs of the workers exporting NIXL's histograms, decode workers first (the pull is
    counted where it is posted: on decode; prefill exports the same families at zero); their totals
    are summed, so a transfer to any decode worker counts. Empty when no worker runs NixlConnector."""
    found = []
    for w in sorted(cluster.spec.workers, key=lambda w: 0 if w.role == "decode" else 1):
        if not w.metrics or w.metrics in found:
            continue
        try:
            if parse_nixl(scrape(w.metrics, cluster.auth_headers())).present:
                found.append(w.metrics)
        except (httpx.HTTPError, ProbeError) as exc:
            log.info("no NIXL metrics from %s: %s", w.metrics, exc)
    return found


class NixlDrive:
    """Requests with long prompts through the cluster's API one at a time, each one's KV moved by NIXL;
    decode's histograms scraped around each, the prefill host's link classes around each batch.

    ``read_link()``: {"lossless": bytes, "tcp": bytes | None} sent so far by the prefill host's fabric NIC
    (over SSH); ``host``/``interface``/``lossless_class`` name it in the evidence."""

    def __init__(self, cluster: Any, metrics_urls: Sequence[str], read_link: Callable[[], dict[str, int | None]], *,
                 host: str, interface: str, lossless_class: str, seed: int = 0) -> None:
        self.cluster, self.read_link = cluster, read_link
        self.run = NixlRun(list(metrics_urls))
        self.host, self.interface, self.lossless_class = host, interface, lossless_class
        self.rng = random.Random(seed)
        self.words = PROMPT_WORDS
        self.target_tokens: int | None = None
        self.model: str | None = None

    def _totals(self) -> NixlTotals:
        each = [parse_nixl(scrape(url, self.cluster.auth_headers())) for url in self.run.metrics_urls]
        return NixlTotals(any(t.present for t in each), *(sum(getattr(t, f) for t in each) for f in
                                                          ("transfers", "bytes", "seconds", "post_seconds", "failed")))

    def _prompt(self) -> str:
        # unique words each time: no prefix-cache hit on decode (it would pull fewer blocks)
        return " ".join(f"w{self.rng.randrange(10 ** 6)}" for _ in range(self.words))

    def _model_card(self) -> dict[str, Any]:
        """The first of ``/v1/models`` (its ``id`` and, on vLLM, ``max_model_len``); {} when unreadable."""
        try:
            resp = httpx.get(f"{self.cluster.api_url}/v1/models", timeout=10, headers=self.cluster.auth_headers())
            cards = resp.json().get("data") or []
            return dict(cards[0]) if cards else {}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            return {}

    def _max_model_len(self) -> int | None:
        most = self._model_card().get("max_model_len")
        return int(most) if most else None

    def _request(self) -> bool:
        if self.model is None:   # the cluster file names none: the first the API serves
            self.model = self.cluster.model or self._model_card().get("id")
        body = {"model": self.model, "prompt": self._prompt(), "max_tokens": MAX_TOKENS, "temperature": 0}
        self.run.requests += 1
        try:
            resp = httpx.post(f"{self.cluster.api_url}/v1/completions", json=body, timeout=180,
                              headers=self.cluster.auth_headers())
        except httpx.HTTPError as exc:
            self.run.errors.append(f"{type(exc).__name__}: {exc}")
            return False
        if resp.status_code == 400 and self.words > 8:   # longer than the model takes: shorter next time
            self.run.errors.append(f"HTTP 400 at {self.words} words: {resp.text[:160]}")
            self.words //= 2
            return False
        if resp.status_code != 200:
            self.run.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return False
        tokens = int((resp.json().get("usage") or {}).get("prompt_tokens") or 0)
        if tokens:
            self.run.prompt_tokens.append(tokens)
            if self.target_tokens is None:
                most = self._max_model_len()
                self.target_tokens = int(PROMPT_FILL * (most - MAX_TOKENS)) if most else tokens
            self.words = max(8, int(self.words * self.target_tokens / tokens))
        return True

    def more(self, n: int) -> None:
        """``n`` more requests (a batch): their transfers, and the link's count around the batch."""
        link0 = self.read_link()
        before = self._totals()
        nixl0, failed0 = before.bytes, before.failed
        for _ in range(n):
            self._request()
            after = self._totals()
            if (t := transfer_between(before, after)) is not None:
                self.run.transfers.append(t)
            before = after
        link1 = self.read_link()
        self.run.failed += before.failed - failed0
        tcp = (None if link0.get("tcp") is None or link1.get("tcp") is None
               else int(link1["tcp"]) - int(link0["tcp"]))  # type: ignore[arg-type]
        self.run.links.append(LinkCount(self.host, self.interface, self.lossless_class,
                                        int(link1["lossless"] or 0) - int(link0["lossless"] or 0), tcp,
                                        before.bytes - nixl0))
        log.info("NIXL drive: %d transfers so far, link/NIXL bytes %s", len(self.run.transfers),
                 self.run.links[-1].ratio)


def tc_link_reader(executor: Any, interface: str, lossless_class: str, tcp_class: str | None = "1:20"
                   ) -> Callable[[], dict[str, int | None]]:
    """``read_link`` of :class:`NixlDrive` from ``tc -s class show dev IF`` run by ``executor`` (SSH)."""
    from harness.fabric.shaping import read_classes

    def read() -> dict[str, int | None]:
        classes = read_classes(executor, interface, None)
        if lossless_class not in classes:
            raise ProbeError(f"{interface} has no tc class {lossless_class} (found {sorted(classes) or 'none'})",
                             fix="name the lossless class the host's shaping has in the cluster file "
                                 "(fabric.lossless_class)")
        tcp = classes.get(tcp_class) if tcp_class else None
        return {"lossless": classes[lossless_class].sent_bytes, "tcp": None if tcp is None else tcp.sent_bytes}
    return read


def median_rate(transfers: Sequence[NixlTransfer]) -> float:
    from harness.stats import nearest_rank
    return nearest_rank([t.bps for t in transfers], 50) if transfers else 0.0


__all__ = ["NixlTotals", "NixlTransfer", "NixlRun", "NixlDrive", "LinkCount", "parse_nixl", "transfer_between",
           "nixl_metrics_urls", "tc_link_reader", "LINK_RATIO_MIN", "LINK_RATIO_MAX", "SOURCE"]
