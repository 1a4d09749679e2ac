"""Incremental detokenisation: the text that new tokens add, as they arrive."""

from __future__ import annotations

from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """Turns a growing token sequence into text deltas.

    Each :meth:`push` decodes everything generated so far and returns the text that is new
    since the last call. Text ending in an incomplete character (a multi-byte character split
    over tokens decodes to U+FFFD) is held back until the next token completes it, or until
    ``final``. Special tokens are skipped, as in ``tokenizer.decode(..., skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already returned

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        return delta

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)
