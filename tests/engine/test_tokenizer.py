import pytest

from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import InvalidRequestError

tok = ByteTokenizer()


def test_round_trip_of_multilingual_text():
    text = "KV 缓存 migration ✓ — ok"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True)[0] == tok.BOS


def test_decode_drops_specials_and_replaces_invalid_bytes():
    assert tok.decode([tok.BOS, *tok.encode("hi"), tok.EOS, tok.PAD]) == "hi"
    assert tok.decode([0xE4, 0x62]) == "\ufffdb"


def test_incremental_detokenizer_holds_partial_characters():
    ids = tok.encode("a缓b")  # 缓 is three bytes
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert pieces == ["a", "", "", "缓", "b"]
    assert "".join(pieces) + detok.flush() == "a缓b"


def test_incremental_detokenizer_flushes_an_unfinished_character():
    detok = tok.detokenizer()
    assert detok.push(tok.encode("缓")[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_chat_template_marks_roles_and_cues_the_assistant():
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "x"}], [{"role": "user"}], ["hi"]])
def test_chat_template_rejects_malformed_messages(messages):
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.apply_chat_template(messages)


def test_validate_names_the_bad_token():
    with pytest.raises(InvalidRequestError, match="259"):
        tok.validate([1, 259])
