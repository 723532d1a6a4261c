"""Live migration of one observed stream: the probe behind checklist item 6.1.2.

A migration can only be measured on a stream the harness watches: its own streaming request,
sent with ``ignore_eos`` and enough ``max_tokens`` to still be decoding when the migration is
asked for. The stream itself says where it runs: every SSE chunk of the bundled engine carries
the request id and ``served_by`` (the worker that produced that token), so the victim and its
source worker are known the moment the stream has produced ``after_tokens`` tokens, without
waiting for a heartbeat or a worker-table poll that may come after the stream ended.

One :func:`migrate_observed_stream` call gives one :class:`MigrationAttempt` with one of three
outcomes, kept apart because they mean different things:

* ``migrated``: the engine moved the stream (HTTP 200); whether it could be *measured* is
  decided later from the router's events and the client record (harness/checks/migration.py);
* ``refused``: the engine refused or botched it (migration disabled, no target, an error):
  a failed migration, judged against ``failed_migrations``;
* ``unobservable``: the harness could not catch the stream mid-decode on a known worker (it
  ended first, or left the source before the request arrived, or finished on the source while
  the migration was being set up: 409 ``request_finished``): not the engine's fault, so the
  suite takes another victim.
"""

from __future__ import annotations

import logging
from typing import Any

from harness.errors import ProbeError
from harness.evidence.migration import OUTCOMES, MigrationAttempt  # noqa: F401  (OUTCOMES: the scenario's words)
from harness.faults import FaultRunner, Ledger, LiveMigration
from harness.engine.admin.client import AdminError
from harness.probes.client.observed_stream import ObservedStream
from harness.probes.client.records import RequestRecord
from harness.probes.client.streaming import CompletionRequest

log = logging.getLogger(__name__)

# admin-API refusals that say the stream was not (or no longer) decoding on the source: the harness
# asked too late (the stream ended or moved), not a migration the engine failed to do
NOT_THERE_CODES = frozenset({"nothing_to_migrate", "request_finished"})


def migrate_observed_stream(api_url: str, admin_url: str, *, phase: str, index: int, prompt: str,
                            max_tokens: int, after_tokens: int, ready_timeout_s: float = 60.0,
                            stream_timeout_s: float = 300.0, faults: Any = None) -> tuple[MigrationAttempt, RequestRecord]:
    """Send one watched stream, live-migrate it off the worker serving it once it has
    ``after_tokens`` tokens, and return the attempt's outcome with the stream's record (the
    stream always runs to its end: the record is part of the nothing-lost history). The migration
    is a ``live_migration`` fault of ``faults`` (the suite's FaultRunner: safety-checked, in the
    ledger); without one, a FaultRunner on the default state dir's ``adhoc`` ledger."""
    if max_tokens <= after_tokens:
        raise ProbeError(f"max_tokens ({max_tokens}) must exceed after_tokens ({after_tokens})",
                         fix="give the stream tokens left to decode after the migration")
    if faults is None:  # built before the stream starts: the migration must be asked for at once
        faults = FaultRunner(Ledger.for_cluster("adhoc"), recover_on_enter=False, handle_signals=False)
    stream = ObservedStream(api_url, CompletionRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True),
                            after_tokens, timeout_s=stream_timeout_s, name=f"{phase}-stream-{index}").start()
    attempt = MigrationAttempt(phase, index, "unobservable")
    try:
        if not stream.wait_ready(ready_timeout_s):
            attempt.detail = (f"the stream ended after {stream.tokens} token(s), before the harness saw it mid-decode"
                              if stream.finished else
                              f"the stream had {stream.tokens} token(s) after {ready_timeout_s:.0f} s "
                              f"(needs {after_tokens} before migrating)")
        else:
            attempt.source, attempt.request_id, attempt.at_tokens = stream.worker, stream.request_id, stream.tokens
            _ask(admin_url, attempt, faults)
    finally:
        record = stream.join(stream_timeout_s + 30.0)
    return attempt, record


def _ask(admin_url: str, attempt: MigrationAttempt, faults: Any) -> None:
    assert attempt.source is not None and attempt.request_id is not None
    migration = LiveMigration(admin_url=admin_url, source=attempt.source, rid=attempt.request_id)
    try:
        faults.inject(migration)
        attempt.done = migration.reply
        faults.revert(migration)  # nothing left in flight
        attempt.outcome = "migrated"
        attempt.detail = f"{attempt.source} -> {migration.reply.get('target')}"
    except AdminError as exc:
        if exc.code in NOT_THERE_CODES or (exc.status == 404 and exc.param == "rid"):
            # the stream ended, or moved (the health detector may have moved it first), between its
            # last chunk and the request: the harness was late, the engine did nothing wrong; an
            # engine that refused every stream this way would leave the item inconclusive, never passed
            attempt.outcome, attempt.detail = "unobservable", f"the stream had left {attempt.source}: {exc.message}"
        else:
            attempt.outcome, attempt.detail = "refused", f"HTTP {exc.status}: {exc.message}"
    except ProbeError as exc:  # transport error: the admin API did not answer
        attempt.outcome, attempt.detail = "refused", str(exc)
    finally:
        faults.revert(migration)  # a no-op once reverted
    if attempt.outcome != "migrated":
        log.info("migration attempt %s-%d: %s (%s)", attempt.phase, attempt.index, attempt.outcome, attempt.detail)


__all__ = ["MigrationAttempt", "OUTCOMES", "migrate_observed_stream"]
