"""The nothing-lost checker over request histories. Records built here are test input; the
oracle is the real reference model (tiny preset) where token exactness is checked."""

import pytest

from harness.checks.invariants import check_history, nothing_lost_verdict, oracle_expectation
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.client.records import RequestRecord


def rec(rid, status="ok", tokens=(1, 2, 3), **kw):
    tokens = list(tokens)
    base = dict(request_id=rid, status=status, sent_ns=1, end_ns=2, prompt="hello", max_tokens=len(tokens) or 3,
                token_ids=tokens if status == "ok" else [], chunk_ns=[1] * len(tokens) if status == "ok" else [],
                chunk_tokens=[1] * len(tokens) if status == "ok" else [], finish_reason="length")
    base.update(kw)
    return RequestRecord(**base)


def fixed_oracle(rec):
    return [1, 2, 3]


def test_clean_history_passes():
    check = check_history([rec("a"), rec("b"), rec("r", "http_error", http_status=429, error_class="overloaded",
                                                    error_message="admission control: retry later")], fixed_oracle)
    assert (check.completed, check.verified, check.rejected) == (2, 2, 1)
    v = nothing_lost_verdict(check, Checklist.load())
    assert v.status is Status.PASS and v.measured == 0


def test_wrong_tokens_fail_with_the_first_divergence():
    check = check_history([rec("a", tokens=(1, 9, 3))], fixed_oracle)
    assert check.wrong[0]["problem"].startswith("token 1 is 9, the oracle says 2")
    v = nothing_lost_verdict(check, Checklist.load())
    assert v.status is Status.FAIL and "not token-exact" in v.reason


def test_duplicated_or_lost_tokens_against_usage_are_wrong():
    check = check_history([rec("a", completion_tokens=4)], None)
    assert "usage says 4" in check.wrong[0]["problem"]


def test_hung_and_cancelled_requests_have_no_final_state():
    check = check_history([rec("t", "timeout", error_class="DeadlineExceeded", error_message="x"),
                           rec("c", "cancelled", error_class="GreenletExit", error_message="stopped"),
                           rec("n", end_ns=None)], fixed_oracle)
    assert [r["request_id"] for r in check.without_final_state] == ["t", "c", "n"]
    v = nothing_lost_verdict(check, Checklist.load())
    assert v.status is Status.FAIL and v.measured == 3


@pytest.mark.parametrize("kw, clear", [
    (dict(status="stream_error", error_class="worker_lost", error_message="decode-1 died, could not resume"), True),
    (dict(status="http_error", http_status=500, error_class="HTTP500", error_message=""), False),
    (dict(status="stream_error", error_class="IncompleteStream", error_message="no [DONE]"), False),
    (dict(status="connection_error", error_class="ReadError", error_message="reset"), False),
    (dict(status="ok", finish_reason="error", error_message="engine error: kv lost"), True),
])
def test_failures_need_a_clear_server_error(kw, clear):
    check = check_history([rec("f", **kw)], fixed_oracle)
    assert (check.failed_clear, len(check.failures_without_error)) == ((1, 0) if clear else (0, 1))


def test_no_requests_or_an_oracle_that_cannot_check_a_completion_is_inconclusive():
    cl = Checklist.load()
    assert nothing_lost_verdict(check_history([], fixed_oracle), cl).status is Status.INCONCLUSIVE
    unknown = nothing_lost_verdict(check_history([rec("a")], lambda r: None), cl)  # e.g. a chat prompt
    assert unknown.status is Status.INCONCLUSIVE and "no oracle" in unknown.reason


def test_an_engine_without_an_oracle_is_judged_on_consistency_and_says_so():
    """A foreign engine (vLLM...) has no oracle: nothing-lost is still judged (hung requests, silent
    cuts, completions whose stream disagrees with the server's usage), and the verdict says that
    wrong tokens with HTTP 200 cannot be seen there."""
    cl = Checklist.load()
    ok = nothing_lost_verdict(check_history([rec("a"), rec("b")], None), cl)
    assert ok.status is Status.PASS and "not checked token by token" in ok.reason
    assert "cannot be seen" in ok.evidence["oracle"]
    cut = rec("c", status="stream_error", error_class="IncompleteStream", error_message="no [DONE]")
    bad = nothing_lost_verdict(check_history([rec("a"), cut], None), cl)
    assert bad.status is Status.FAIL and bad.evidence["failures_without_error"][0]["request_id"] == "c"


def test_oracle_expectation_uses_the_reference_model_and_caches():
    from harness.engine.core.oracle import greedy_reference
    from harness.engine.core.tokenizer import ByteTokenizer

    calls = []

    def oracle(ids, max_tokens, stop=(), ignore_eos=False):
        calls.append(max_tokens)
        return greedy_reference("tiny", ids, max_tokens, stop=stop, ignore_eos=ignore_eos)

    expected = oracle_expectation(oracle, ignore_eos=True)
    want = greedy_reference("tiny", ByteTokenizer().encode("hello"), 4, ignore_eos=True)
    assert len(want) == 4
    good, bad = rec("g", tokens=want), rec("b", tokens=[(want[0] + 1) % 256, *want[1:]])
    check = check_history([good, bad, rec("g2", tokens=want)], expected)
    assert check.verified == 2 and len(check.wrong) == 1 and calls == [4]


def _dynamo_stream(counts, done=True):
    """A record built from Dynamo-shaped SSE bytes: empty text, cumulative usage in every chunk."""
    import json

    from harness.probes.client.sse import RecordBuilder

    b = RecordBuilder(RequestRecord(request_id="d", sent_ns=0, prompt="p", max_tokens=4))
    for i, count in enumerate(counts):
        chunk = {"id": "c", "choices": [{"index": 0, "text": ""}], "usage": {"prompt_tokens": 2, "completion_tokens": count}}
        b.feed(f"data: {json.dumps(chunk)}\n\n".encode(), (i + 1) * 10)
    if done:
        final = {"id": "c", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": counts[-1]}}
        b.feed(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode(), 100)
    return b.finish(110)


def test_a_dynamo_stream_of_empty_text_tokens_passes_and_a_cut_one_fails():
    whole, cut = _dynamo_stream([1, 2, 3, 4]), _dynamo_stream([1, 2], done=False)
    check = check_history([whole, cut])
    assert check.completed == 1 and not check.wrong and check.token_sources == {"usage": 1}
    assert [f["request_id"] for f in check.failures_without_error] == ["d"] and check.failures_without_error[0]["tokens"] == 2
    v = nothing_lost_verdict(check, Checklist.load())
    assert v.status is Status.FAIL and v.evidence["tokens_counted_by"] == {"usage": 1}
    assert nothing_lost_verdict(check_history([whole]), Checklist.load()).status is Status.PASS


def test_per_chunk_usage_that_goes_down_is_a_wrong_completion():
    check = check_history([_dynamo_stream([1, 2, 3, 2])])
    assert check.wrong[0]["problem"] == ("usage says 2 completion tokens, the stream carried 3 "
                                         "(counted by the rises of its per-chunk usage)")
