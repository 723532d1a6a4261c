"""Byte-level tokenizer: token i < 256 is byte i; then BOS, EOS and PAD.

No vocabulary file and no downloads: any text round-trips through UTF-8 bytes. A token may
hold part of a multi-byte character, so streaming text goes through ``IncrementalDetokenizer``.

Chat template (``apply_chat_template``), one block per message, then the assistant cue::

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n
"""

from __future__ import annotations

import codecs
from typing import Iterable

from harness.errors import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant")


class ByteTokenizer:
    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}",
                                      param="prompt")
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Special tokens are dropped; invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def validate(self, ids: Iterable[int], what: str = "prompt") -> None:
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise InvalidRequestError(f"{what} holds token id {i!r} outside [0, {self.vocab_size})",
                                          param=what)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        parts = []
        for n, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{n}].role must be one of {CHAT_ROLES}, got {role!r}",
                                          param="messages")
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{n}].content must be a string", param="messages")
            parts.append(f"<|{role}|>\n{content}\n")
        return "".join(parts) + "<|assistant|>\n"

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer()


class IncrementalDetokenizer:
    """Turns a token stream into text, holding back the bytes of an unfinished character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < 256))

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)
