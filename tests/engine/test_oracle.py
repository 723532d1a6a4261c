import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import InvalidRequestError

tok = ByteTokenizer()
PROMPT = tok.encode("The oracle says")


def test_oracle_is_deterministic_and_respects_max_tokens():
    first = greedy_reference("tiny", PROMPT, 24, ignore_eos=True)
    assert len(first) == 24
    greedy_reference.cache_clear()  # recompute rather than remember
    assert greedy_reference("tiny", PROMPT, 24, ignore_eos=True) == first
    first.append(-1)  # callers get their own list; the remembered answer is untouched
    assert greedy_reference("tiny", PROMPT, 24, ignore_eos=True)[-1] != -1


def test_oracle_resume_continues_the_uninterrupted_run():
    full = greedy_reference("tiny", PROMPT, 30, ignore_eos=True)
    assert greedy_reference("tiny", PROMPT, 30, ignore_eos=True, resume_token_ids=full[:11]) == full[11:]


def test_oracle_stop_string_ends_generation_on_the_completing_token():
    full = greedy_reference("tiny", PROMPT, 40, ignore_eos=True)
    text = tok.decode(full)
    stop = text[10:13]
    cut = greedy_reference("tiny", PROMPT, 40, stop=[stop], ignore_eos=True)
    assert stop not in tok.decode(cut[:-1])
    assert stop in tok.decode(cut)
    assert cut == full[:len(cut)]


def test_oracle_context_limit():
    out = greedy_reference("tiny", PROMPT, 100, ignore_eos=True, max_model_len=len(PROMPT) + 5)
    assert len(out) == 5


def test_oracle_rejects_bad_tokens():
    with pytest.raises(InvalidRequestError):
        greedy_reference("tiny", [300], 4)
