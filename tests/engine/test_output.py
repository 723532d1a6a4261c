"""OutputTracker: stop strings, held-back text and resumption on another worker.

A resumed request (rescheduled after a worker died, or live-migrated) gets a fresh tracker on
the new worker with the tokens already streamed. What the client sees across the switch must be
exactly what one tracker would have produced: same text, same stop point.
"""

from __future__ import annotations

import pytest

from harness.engine.core.output import OutputTracker
from harness.engine.core.types import FinishReason, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer

tok = ByteTokenizer()


def run(tracker: OutputTracker, ids: list[int]) -> tuple[str, int, FinishReason | None]:
    """Feed tokens one step at a time as the engine does; (text streamed, tokens used, reason)."""
    text, used = "", 0
    for t in ids:
        if tracker.finished:
            break
        tracker.append(t)
        used += 1
        text += tracker.take_text()
    return text, used, tracker.finish_reason


def tracker(stop: tuple[str, ...], resume: list[int] = ()) -> OutputTracker:
    params = SamplingParams(max_tokens=1000, stop=stop, ignore_eos=True)
    return OutputTracker(tok, params, num_prompt_tokens=5, max_model_len=4096, resume_token_ids=list(resume))


@pytest.mark.parametrize("text, stop", [
    ("hello abc world", ("abc",)),          # the stop string completes
    ("hello abx world", ("abc",)),          # a held-back prefix that turns out not to stop
    ("aaab then more", ("aab", "zz")),      # overlapping candidates
    ("x 缓存 stop here", ("存 st",)),        # a multi-byte character inside the stop string
    ("nothing to see", ("abc",)),
])
def test_resuming_at_any_token_streams_the_same_text_and_stops_at_the_same_place(text, stop):
    ids = tok.encode(text)
    whole_text, whole_used, whole_reason = run(tracker(stop), ids)
    for k in range(1, len(ids)):
        first = tracker(stop)
        before, used, reason = run(first, ids[:k])
        if reason is not None:
            continue  # stopped before the switch: nothing to resume
        after, more, reason = run(tracker(stop, ids[:k]), ids[k:])
        assert (before + after, used + more, reason) == (whole_text, whole_used, whole_reason), f"split at {k}"


def test_a_stop_string_spanning_the_switch_is_found():
    ids = tok.encode("hello abc world")
    k = len(tok.encode("hello ab"))  # "ab" was held back by the first worker
    before, _, _ = run(tracker(("abc",)), ids[:k])
    assert before == "hello "
    after, used, reason = run(tracker(("abc",), ids[:k]), ids[k:])
    assert (after, used, reason) == ("", 1, FinishReason.STOP)
