"""A streaming request watched chunk by chunk in a thread of its own (the probe behind the live
migration scenario, harness/scenarios/migration.py): every SSE chunk of the bundled engine carries
the request id and ``served_by``, so the stream says where it runs the moment it has produced
``after_tokens`` tokens."""

from __future__ import annotations

import threading

from harness.errors import ProbeError
from harness.probes.client.records import RequestRecord
from harness.probes.client.streaming import CompletionRequest, StreamingClient


class ObservedStream:
    """A streaming request in a thread of its own, watched chunk by chunk: ``ready`` is set once
    it has ``after_tokens`` tokens and says which worker produced the latest one."""

    def __init__(self, api_url: str, request: CompletionRequest, after_tokens: int, *,
                 timeout_s: float = 300.0, name: str = "observed-stream") -> None:
        self.api_url = api_url
        self.request = request
        self.after_tokens = after_tokens
        self.timeout_s = timeout_s
        self.ready = threading.Event()
        self.worker: str | None = None          # served_by of the latest chunk
        self.request_id: str | None = None
        self.tokens = 0
        self.record: RequestRecord | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ObservedStream:
        self._thread.start()
        return self

    def _on_message(self, rec: RequestRecord, msg: dict) -> None:
        served = msg.get("served_by")
        if isinstance(served, str) and served:
            self.worker = served
        self.request_id = rec.response_id
        self.tokens = sum(rec.chunk_tokens)
        if self.tokens >= self.after_tokens and self.worker and self.request_id:
            self.ready.set()

    def _run(self) -> None:
        try:
            with StreamingClient(self.api_url, timeout_s=self.timeout_s, read_timeout_s=min(120.0, self.timeout_s),
                                 user="migration-probe") as client:
                self.record = client.send(self.request, on_message=self._on_message)
        except BaseException as exc:  # noqa: BLE001 - kept for the caller; the thread must not die silently
            self.error = exc
        finally:
            self.ready.set()  # wake a waiter: the stream is over (check ``finished``)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def wait_ready(self, timeout_s: float) -> bool:
        """True when the stream showed ``after_tokens`` tokens on a known worker and still runs."""
        self.ready.wait(timeout_s)
        return self.ready.is_set() and not self.finished and self.tokens >= self.after_tokens

    def join(self, timeout_s: float) -> RequestRecord:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ProbeError(f"{self._thread.name} did not end within {timeout_s:.0f} s",
                             fix="see the router's log: a stream that never ends is a hung request")
        if self.record is None:
            raise ProbeError(f"{self._thread.name} failed in the client: {self.error!r}",
                             fix="this is a harness bug; see the traceback in the log")
        return self.record


__all__ = ["ObservedStream"]
