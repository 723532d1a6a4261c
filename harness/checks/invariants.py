"""The nothing-lost invariant, checked over the whole request history after the run (as Jepsen
checks its histories): every request ends completed and token-exact against the oracle, or
rejected or failed with a clear error from the server; none hangs, none is silently wrong.

Classification of one :class:`~harness.probes.client.records.RequestRecord`:

* ``ok`` and the stream finished: **completed**; compared token by token with the oracle when
  one is given (bundled engine), else only checked for internal consistency (usage vs stream).
* ``http_error`` 429/503 with a message: **rejected** (admission control, Level 1/5).
* any other error the *server* explained (HTTP error body, SSE error event): **failed, clear**.
* an error only the *client* noticed (connection dropped, stream cut without ``[DONE]``,
  unparseable SSE): **failed without a clear error** -- the silent failure users hate.
* ``timeout`` (no end within the client's deadline) or ``cancelled`` (still in flight when the
  load run's stop grace ran out): **without a final state** -- a hung request.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Status, Verdict, judge
from harness.probes.client.records import NOT_SENT, RequestRecord

log = logging.getLogger(__name__)

ITEM = "nothing-lost"
REJECT_STATUSES = (429, 503)
# error classes the streaming client assigns itself: the server said nothing
CLIENT_SIDE_ERRORS = frozenset({"IncompleteStream", "MalformedSSE"})
_MAX_LISTED = 20  # evidence lists at most this many request ids per category

Expected = Callable[[RequestRecord], "list[int] | None"]


@dataclass
class HistoryCheck:
    total: int = 0
    completed: int = 0
    verified: int = 0            # completed and token-exact against the oracle
    unverified: int = 0          # completed, no oracle available for it
    rejected: int = 0
    failed_clear: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    failures_without_error: list[dict[str, Any]] = field(default_factory=list)
    without_final_state: list[dict[str, Any]] = field(default_factory=list)
    error_classes: Counter = field(default_factory=Counter)
    token_sources: Counter = field(default_factory=Counter)  # how completions' tokens were counted
    oracle: bool = True          # False: no oracle for this engine (a foreign cluster): consistency only

    def evidence(self) -> dict[str, Any]:
        return {"requests": self.total, "completed": self.completed, "token_exact": self.verified,
                "completed_unverified": self.unverified, "rejected": self.rejected,
                "failed_with_clear_error": self.failed_clear, "wrong_completions": self.wrong[:_MAX_LISTED],
                "failures_without_error": self.failures_without_error[:_MAX_LISTED],
                "requests_without_final_state": self.without_final_state[:_MAX_LISTED],
                "error_classes": dict(self.error_classes), "tokens_counted_by": dict(self.token_sources)}


def check_history(records: Iterable[RequestRecord], expected: Expected | None = None) -> HistoryCheck:
    """Classify every record; ``expected(record)`` gives the oracle's token ids (or None when
    that record cannot be checked)."""
    out = HistoryCheck(oracle=expected is not None)
    for rec in records:
        if rec.error_class == NOT_SENT:  # an open-loop arrival the generator never sent: not the server's
            continue
        out.total += 1
        if rec.status in ("timeout", "cancelled") or rec.end_ns is None:
            out.without_final_state.append(_brief(rec))
            continue
        if not rec.ok or rec.finish_reason == "error":
            out.error_classes[rec.error_class or "?"] += 1
            if _clear_error(rec):
                if rec.status == "http_error" and rec.http_status in REJECT_STATUSES:
                    out.rejected += 1
                else:
                    out.failed_clear += 1
            else:
                out.failures_without_error.append(_brief(rec))
            continue
        out.completed += 1
        out.token_sources[rec.token_source or "none"] += 1
        problem = _consistency_problem(rec)
        # a server that streams text without token ids cannot be checked token by token
        checkable = expected is not None and problem is None and (rec.token_ids or not rec.chunk_tokens)
        want = expected(rec) if checkable else None
        if problem is None and want is not None:
            problem = _token_mismatch(rec.token_ids, want)
        if problem is not None:
            out.wrong.append({**_brief(rec), "problem": problem})
        elif want is not None:
            out.verified += 1
        else:
            out.unverified += 1
    return out


def nothing_lost_verdict(check: HistoryCheck, checklist: Checklist) -> Verdict:
    item = checklist.item(ITEM)
    t = item.thresholds
    measurements = [
        Measurement(t["requests_without_final_state"], len(check.without_final_state),
                    f"requests without a final state (of {check.total})"),
        Measurement(t["wrong_completions"], len(check.wrong), f"completions not token-exact (of {check.completed})"),
        Measurement(t["failures_without_error"], len(check.failures_without_error),
                    "failed requests without a clear server error"),
    ]
    thin = None
    if check.total == 0:
        thin = "no request was recorded"
    elif check.unverified and check.oracle:
        thin = f"{check.unverified} of {check.completed} completions had no oracle to check them against"
    evidence = check.evidence()
    if not check.oracle:
        evidence["oracle"] = ("none for this engine: completions were checked for consistency (the tokens the stream "
                              "carried, counted by token ids, else per-chunk usage, else text, vs the server's final "
                              "usage), not token by token; wrong tokens with HTTP 200 cannot be seen")
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=thin)
    if verdict.status is Status.PASS and check.oracle:  # say what the history held, not just zero counts
        verdict = verdict.restated("ended_cleanly", total=check.total, verified=check.verified,
                                   rejected=check.rejected, failed_clear=check.failed_clear)
    elif verdict.status is Status.PASS:
        verdict = verdict.restated("ended_cleanly", total=check.total, completed=check.completed,
                                   rejected=check.rejected, failed_clear=check.failed_clear)
    return verdict


def oracle_expectation(oracle: Callable[..., list[int]], *, ignore_eos: bool, chat: bool = False) -> Expected:
    """Adapt a cluster oracle ``oracle(prompt_token_ids, max_tokens, stop=, ignore_eos=)`` to
    request records of a completions load run, caching per (prompt, max_tokens): load runs
    reuse a small prompt set, so the oracle runs once per distinct request."""
    from harness.engine.core.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    cache: dict[tuple[str, int], list[int]] = {}

    def expected(rec: RequestRecord) -> list[int] | None:
        if chat or rec.max_tokens is None:
            return None  # chat prompts are templated server-side; not reproduced here
        key = (rec.prompt, rec.max_tokens)
        if key not in cache:
            cache[key] = list(oracle(tokenizer.encode(rec.prompt), rec.max_tokens, ignore_eos=ignore_eos))
        return cache[key]

    return expected


def failed_with_clear_error(rec: RequestRecord) -> bool:
    """The request failed and the server said why (HTTP error body, SSE error event, finish
    reason "error" with a message); False for an error only the client noticed."""
    return (not rec.ok or rec.finish_reason == "error") and _clear_error(rec)


def _clear_error(rec: RequestRecord) -> bool:
    if not (rec.error_message or "").strip():
        return False
    if rec.status == "http_error":
        return rec.http_status is not None
    if rec.status == "stream_error":
        return rec.error_class not in CLIENT_SIDE_ERRORS
    return rec.status == "ok"  # finish_reason "error" with the server's message


def _consistency_problem(rec: RequestRecord) -> str | None:
    streamed = sum(rec.chunk_tokens)
    if rec.token_ids and len(rec.token_ids) != streamed:
        return f"stream carried {streamed} tokens but {len(rec.token_ids)} token ids"
    if rec.completion_tokens is not None and rec.completion_tokens != streamed:
        how = _COUNTED_BY.get(rec.token_source or "")
        return (f"usage says {rec.completion_tokens} completion tokens, the stream carried {streamed}"
                + (f" ({how})" if how else ""))
    return None


_COUNTED_BY = {"token_ids": "counted by token ids", "text": "counted one per chunk with text",
               "usage": "counted by the rises of its per-chunk usage"}


def _token_mismatch(got: list[int], want: list[int]) -> str | None:
    if got == want:
        return None
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i} is {a}, the oracle says {b} ({len(got)} vs {len(want)} tokens)"
    return f"{len(got)} tokens, the oracle gives {len(want)} (one is a prefix of the other)"


def _brief(rec: RequestRecord) -> dict[str, Any]:
    return {"request_id": rec.request_id, "status": rec.status, "http_status": rec.http_status,
            "error_class": rec.error_class, "error": (rec.error_message or "")[:200],
            "served_by": list(rec.served_by), "tokens": sum(rec.chunk_tokens)}
