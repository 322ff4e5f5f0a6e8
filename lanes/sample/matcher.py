"""One request's grammar state: the matcher of its committed tokens, or only its first token's mask.

Apart from lanes/sample/grammar.py (the compiler and the masks of a batch of sequences) so that a
Sequence can hold one without importing what works on sequences.
"""

from concurrent.futures import Future

import torch


class RequestGrammar:
    """One request's matcher. Between steps it has accepted exactly the request's committed output
    tokens; during a step, also the drafts `ColumnMasks` walked (`speculative`)."""

    def __init__(self, compiled: Future, words: int, allowed: torch.Tensor | None = None):
        self.compiled = compiled  # the CompiledGrammar, compiling on Grammars' thread
        self.words = words  # bitmask width, ceil(V / 32)
        self.allowed = allowed  # [W] a bitmask every fill is narrowed by (JSON: no raw control characters)
        self.speculative: list[int] = []
        self._matcher = None

    @property
    def matcher(self):
        """Made at first use, the first token's mask: that waits for the compilation if it is still running."""
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.compiled.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, out: torch.Tensor, index: int, narrow: bool = True) -> None:
        """The next token's bitmask into row `index` of the host int32 tensor `out` [K, W]; `narrow`:
        and by `allowed` (a caller that fills many rows narrows them all in one operation instead)."""
        self.matcher.fill_next_token_bitmask(out, index)
        if narrow and self.allowed is not None:
            out[index] &= self.allowed

    def advance(self, token: int) -> bool:
        """Accept a draft token for this step only (undone by `commit`); False if the grammar refuses it."""
        if not self.matcher.accept_token(token):
            return False
        self.speculative.append(token)
        return True

    def commit(self, tokens: list[int]) -> bool:
        """The step emitted `tokens`: roll back the drafts it did not keep, accept the rest. Returns
        whether the grammar has ended (it accepted a stop token): the request stops there."""
        kept = 0
        for token, draft in zip(tokens, self.speculative):
            if token != draft:
                break
            kept += 1
        self.matcher.rollback(len(self.speculative) - kept)
        self.speculative = []
        for token in tokens[kept:]:
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused emitted token {token}: the mask was not applied")
        return self.matcher.is_terminated()


class FirstTokenMask:
    """Where a prefill lane of its own samples a request's first token: that token's bitmask only,
    computed by the decode replica that holds the matcher, in place of the matcher."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask  # [W] int32
        self.words = bitmask.shape[0]

    def fill(self, out: torch.Tensor, index: int, narrow: bool = True) -> None:
        out[index] = self.bitmask  # narrowed already, where the matcher filled it
