"""Incremental detokenisation with stop strings, for streaming.

Decodes a short window of recent tokens (not the whole output every step), holds back a trailing
partial UTF-8 character, and holds back any tail that could still grow into a stop string.
"""

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens  # a stop string counts only where a later token completes it (vLLM's)
        self.consumed = 0  # of the last `append`'s tokens: how many the text covers (up to a stop string)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (before any stop cut)
        self.emitted = 0  # characters of self.text already returned
        self._prefix_offset = 0
        self._read_offset = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def append(self, new_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to emit now, whether a stop string was hit).

        Several tokens at once (a verify step) end exactly as one at a time would: after a hit,
        `consumed` is how many of them reach the token that completed the stop string, and the
        caller drops the rest (they were generated past the end of the output)."""
        self.consumed = len(new_ids)
        if not self.stop or len(new_ids) == 1:
            return self._append(new_ids)
        saved = (len(self.ids), self.text, self.emitted, self._prefix_offset, self._read_offset)
        if not len(self.ids) < self.min_tokens < len(self.ids) + len(new_ids):  # not across min_tokens
            delta, hit = self._append(new_ids)
            if not hit:
                return delta, False
            # A hit: replay one token at a time, to find the token that completed it (rare: once a request).
            del self.ids[saved[0]:]
            _, self.text, self.emitted, self._prefix_offset, self._read_offset = saved
        pieces = []
        for n, token in enumerate(new_ids, 1):
            delta, hit = self._append([token])
            pieces.append(delta)
            if hit:
                self.consumed = n
                break
        return "".join(pieces), hit

    def _append(self, new_ids: list[int]) -> tuple[str, bool]:
        self.ids.extend(new_ids)
        since = len(self.text)
        self.text += self._decode_new()
        cut = self._first_stop(since) if len(self.ids) > self.min_tokens else None
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

    def _first_stop(self, since: int) -> int | None:
        # Only a stop string that ends in the new text (past `since`) is new; it starts in the
        # not-yet-emitted tail (plus overlap).
        start = max(0, self.emitted - self._hold)
        hits = [i for s in self.stop if (i := self.text.find(s, max(start, since - len(s) + 1))) >= 0]
        return min(hits) if hits else None
