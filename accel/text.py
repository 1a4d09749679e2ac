"""Text that arrives in pieces: incremental detokenisation (the text that new tokens add, as
they arrive) and stop strings matched across pieces."""

from __future__ import annotations

from typing import Any

__all__ = ["StopMatcher", "TextStream"]


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


class StopMatcher:
    """Finds stop strings in text that arrives in pieces; emits only text before the first.

    ``feed(piece)`` returns ``(text_to_emit, matched)``. Text that could be the start of a
    stop string (a suffix of what was received that is a prefix of a stop string) is held
    back until the next piece decides it; :meth:`flush` releases it at the end.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return piece, False
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self.pending = True, ""
            return buf[: min(hits)], True
        hold = self._partial(buf)
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
