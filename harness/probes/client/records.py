"""One record per request, written as one JSON line, read back for analysis.

Times are ``time.perf_counter_ns()`` values of the process that sent the request. Each
record also carries that process's clock anchor (wall, monotonic and perf counter read
together once), so records from several processes can be placed on one timeline with
fault records and engine events (which carry wall-clock and monotonic times).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

from harness.errors import ProbeError

log = logging.getLogger(__name__)

# Fixed status vocabulary: a request ends in exactly one of these.
STATUSES = ("ok", "http_error", "stream_error", "timeout", "connection_error", "cancelled")
NOT_SENT = "NotSent"  # error class of a cancelled open-loop arrival the run ended before sending


@dataclass(frozen=True)
class ClockAnchor:
    """Wall, monotonic and perf-counter clocks read back to back in one process."""

    wall_ns: int
    mono_ns: int
    perf_ns: int

    @classmethod
    def now(cls) -> ClockAnchor:
        # perf first and last, take the midpoint, so the three readings are as close as possible
        p0 = time.perf_counter_ns()
        wall = time.time_ns()
        mono = time.monotonic_ns()
        p1 = time.perf_counter_ns()
        return cls(wall_ns=wall, mono_ns=mono, perf_ns=(p0 + p1) // 2)

    def perf_to_wall(self, perf_ns: int) -> int:
        return self.wall_ns + (perf_ns - self.perf_ns)

    def perf_to_mono(self, perf_ns: int) -> int:
        return self.mono_ns + (perf_ns - self.perf_ns)


_anchors: dict[int, ClockAnchor] = {}  # pid -> anchor; a forked child reads its own


def process_anchor() -> ClockAnchor:
    """The anchor of this process, read once (perf_counter has no fixed epoch across processes)."""
    pid = os.getpid()
    if pid not in _anchors:
        _anchors[pid] = ClockAnchor.now()
    return _anchors[pid]


@dataclass
class RequestRecord:
    """Everything observed about one request, from its scheduled send to its last byte.

    ``chunk_ns[i]`` is when the i-th SSE message that carried output arrived and
    ``chunk_tokens[i]`` how many tokens it carried (several with speculative decoding).
    A chunk that carries no token (no token ids, no rise of per-chunk usage, no text) is not an output
    chunk; one that carries a token is, whatever its text (harness.probes.client.sse.RecordBuilder).
    """

    request_id: str
    user: str = ""
    response_id: str | None = None  # the server's id for it (the SSE chunks' "id"), as engine events name it
    scheduled_ns: int | None = None  # when the load generator meant to send (open loop); None: = sent_ns
    sent_ns: int = 0               # just before the request bytes were written
    first_byte_ns: int | None = None
    first_token_ns: int | None = None
    chunk_ns: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_ns: int | None = None
    status: str = "ok"
    http_status: int | None = None
    error_class: str | None = None
    error_message: str | None = None
    prompt: str = ""
    max_tokens: int | None = None
    prompt_tokens: int | None = None      # from the server's usage
    completion_tokens: int | None = None  # from the server's usage
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    served_by: list[str] = field(default_factory=list)  # distinct workers, in order first seen
    finish_reason: str | None = None
    # how chunk_tokens were counted: "token_ids" (the server's ids), "usage" (per-chunk usage), "text"
    # (one token per chunk with text); None: no chunk carried a token
    token_source: str | None = None
    anchor_wall_ns: int = 0
    anchor_mono_ns: int = 0
    anchor_perf_ns: int = 0
    load_host: str | None = None  # the load host whose Locust worker sent it (distributed load; None: this machine)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ProbeError(f"unknown request status {self.status!r}", fix=f"use one of {', '.join(STATUSES)}")
        if len(self.chunk_ns) != len(self.chunk_tokens):
            raise ProbeError("chunk_ns and chunk_tokens must have the same length",
                             fix="append to both for every output chunk")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def anchor(self) -> ClockAnchor:
        return ClockAnchor(self.anchor_wall_ns, self.anchor_mono_ns, self.anchor_perf_ns)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens: the server's usage when it sent one, else what the stream carried."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(self.chunk_tokens)

    @property
    def token_ns(self) -> list[int]:
        """Arrival time of every output token (tokens of one chunk share its time)."""
        return [t for t, n in zip(self.chunk_ns, self.chunk_tokens) for _ in range(n)]

    @property
    def scheduled_or_sent_ns(self) -> int:
        return self.sent_ns if self.scheduled_ns is None else self.scheduled_ns

    def start_wall_ns(self) -> int:
        """Wall-clock time of the scheduled send (for the timeline)."""
        return self.anchor.perf_to_wall(self.scheduled_or_sent_ns)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ProbeError(f"request record has unknown fields {sorted(unknown)}",
                             fix="read records written by the same harness version")
        return cls(**data)


class RecordWriter:
    """Appends records to a JSONL file, one line each, flushed per record so a killed
    load generator loses at most the line it was writing."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        if self._fh is None:
            raise ProbeError(f"record writer for {self.path} is closed", fix="write before close()")
        self._fh.write(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_records(path: str | os.PathLike) -> Iterator[RequestRecord]:
    """Records of a JSONL file. A truncated last line (writer killed mid-write) is skipped
    with a warning; any other bad line is an error naming the line."""
    path = Path(path)
    if not path.exists():
        raise ProbeError(f"request record file {path} does not exist",
                         fix="check the load run's output path and that the load generator started")
    with open(path, encoding="utf-8") as fh:   # line by line: a 10-hour run's file never sits in memory
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            record = _parse_line(path, lineno, line)
            if record is not None:
                yield record


def _parse_line(path: Path, lineno: int, line: str) -> RequestRecord | None:
    """One line's record; None for a truncated last line (only the last line lacks its newline)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        if not line.endswith("\n"):
            log.warning("skipping truncated last line %s of %s", lineno, path)
            return None
        raise ProbeError(f"{path}:{lineno} is not valid JSON: {exc}",
                         fix="the file must hold one JSON request record per line") from exc
    return RequestRecord.from_dict(data)


def read_records(path: str | os.PathLike) -> list[RequestRecord]:
    return list(iter_records(path))


def write_records(path: str | os.PathLike, records: Iterable[RequestRecord]) -> None:
    with RecordWriter(path) as writer:
        for record in records:
            writer.write(record)
