"""Incremental detokenisation with stop strings, for streaming.

Decodes a short window of recent tokens (not the whole output every step), holds back a trailing
partial UTF-8 character, and holds back any tail that could still grow into a stop string.
"""

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (before any stop cut)
        self.emitted = 0  # characters of self.text already returned
        self._prefix_offset = 0
        self._read_offset = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def append(self, new_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to emit now, whether a stop string was hit)."""
        self.ids.extend(new_ids)
        self.text += self._decode_new()
        cut = self._first_stop()
        if cut is not None:
            delta = self.text[self.emitted : cut]
            self.emitted = cut
            return delta, True
        safe = max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted : safe]
        self.emitted = safe
        return delta, False

    def flush(self) -> str:
        """The held-back tail, once the request has finished without a stop string."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

    def _decode_new(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self._prefix_offset :], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""  # a multi-byte character is split across tokens: wait for the rest
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return full[len(prefix) :]

    def _first_stop(self) -> int | None:
        # Only the not-yet-emitted tail (plus overlap) can contain a new stop string.
        start = max(0, self.emitted - self._hold)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None
