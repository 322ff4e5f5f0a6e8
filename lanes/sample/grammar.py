"""Structured output: a grammar (JSON schema, regex, choice, EBNF) masks every token a request samples.

xgrammar compiles the grammar against the tokenizer once (cached by its text) and gives each request
a matcher that says, after the tokens it has accepted, which tokens may come next: a bitmask of
ceil(V / 32) int32 words (token t allowed iff bit t % 32 of word t // 32 is set).

Speculation stays lossless under the mask. One decode step masks
- the draft at draft position j with the matcher after drafts[:j] (the draft samples only valid
  tokens, and q is the masked draft distribution);
- the target at verify column c with the matcher after drafts[:c], c = 0..n (the last is the bonus).
The rejection rule then compares q with the masked target p, so the output has the masked target's
distribution, and greedy output is the masked target's greedy output. The mask is applied to the raw
logits, before penalties (lanes/sample/penalties.py), temperature and the filters, so nothing after it can
bring a forbidden token back.

The matcher lives with the request in the decode loop (EngineCore), next to the committed tokens.
`ColumnMasks` advances it through the step's drafts while it fills the columns' bitmasks; after
verification `RequestGrammar.commit` rolls it back to the committed tokens (rejected drafts undone)
and accepts the tokens the step emitted, as `rollback_after_verify` does for the KV. In pd/pdv only
the bitmasks travel, with the verify batch ([B, L + 1, ceil(V / 32)] int32, 1/32 of the draft
probabilities' size) and with a prefill request (the first token's, [ceil(V / 32)]).

Cost: nothing for a batch without a grammar row (no bitmask is built, sent or applied). A batch with
one pays host work per grammar row and column (xgrammar's fill, microseconds at V = 4k, more for
large vocabularies) and, on the GPU, one device-to-host read of the drafted tokens per draft
position, because the next position's mask depends on the token just drawn.
"""

import json
import re
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from lanes.sample.matcher import RequestGrammar
from lanes.sample.params import ParamError, StructuredOutput

if TYPE_CHECKING:
    from lanes.engine.sequence import Sequence
    from lanes.sample.params import SamplingParams

assert sys.byteorder == "little", "apply_token_bitmask reads int32 words as little-endian bytes"
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine, least recently used dropped
_ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with the tokens `bitmask` [..., W] (int32, host or device) forbids set to -inf
    (a copy). Tokens past 32 W (a model's padded vocabulary) are forbidden."""
    vocab = logits.shape[-1]
    if bitmask.device != logits.device:
        bitmask = _to(bitmask, logits.device)
    # Bit t of the words is bit t % 8 of byte t // 8 (little-endian), unpacked a byte at a time: one
    # byte per token in between, not four.
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((bitmask.contiguous().view(torch.uint8)[..., None] >> shifts) & 1).flatten(-2).bool()  # [..., 32 W]
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]))
    return logits.masked_fill(~allowed[..., :vocab], float("-inf"))


def _to(host: torch.Tensor, device) -> torch.Tensor:
    # Pinned, so that the copy does not make the host wait for the GPU (lanes/device/batching.py).
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pending_compile(seq: "Sequence") -> Future | None:
    """The compile a request's grammar still waits for, or None (no grammar, or compiled): a decode
    engine sends a prompt and its first token's mask to a prefill lane only once it has compiled."""
    if isinstance(seq.grammar, RequestGrammar) and not seq.grammar.compiled.done():
        return seq.grammar.compiled
    return None


def first_token_bitmask(seq: "Sequence") -> torch.Tensor | None:
    """[W] the bitmask of a request's first output token (what travels to a remote prefill lane)."""
    if seq.grammar is None:
        return None
    out = torch.empty(1, seq.grammar.words, dtype=torch.int32)
    seq.grammar.fill(out, 0)
    return out[0]


def mask_first_tokens(logits: torch.Tensor, seqs: list["Sequence"]) -> torch.Tensor:
    """Prefill's last-position logits [B, V], masked for the rows with a grammar (their first output
    token); unchanged, with no host work, when no row has one."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return logits
    host = torch.full((len(seqs), seqs[rows[0]].grammar.words), _ALL_ALLOWED, dtype=torch.int32)
    for i in rows:
        seqs[i].grammar.fill(host, i)
    return apply_token_bitmask(logits, host)


class ColumnMasks:
    """The bitmasks of one decode step's columns, for rows with a grammar: column c of row i is what
    row i's matcher allows after its drafts[:c]. Filled column by column as drafts are known (while
    the draft model samples, or afterwards for drafts made without a mask, such as prompt lookup).

    A draft the grammar refuses (prompt lookup) ends the row's drafts there; so does a draft that
    ends the grammar (a stop token): nothing after it is kept. Columns past a row's last filled one
    stay all-allowed; no token verified there is kept (the request stops at the stop token)."""

    def __init__(self, seqs: list["Sequence"], num_draft: list[int], columns: int):
        assert columns > max(num_draft, default=0), (columns, num_draft)
        self.grammars = [s.grammar for s in seqs]
        self.rows = [i for i, g in enumerate(self.grammars) if g is not None]
        self.num_draft = list(num_draft)  # per row, cut where the grammar refuses or ends
        words = self.grammars[self.rows[0]].words  # the target's vocabulary, whichever model drafts
        self.host = torch.full((len(seqs), columns, words), _ALL_ALLOWED, dtype=torch.int32)  # [B, L + 1, W]
        # [B, W] what each row's fills are narrowed by (JSON's tokens), in one operation per use rather
        # than one per fill (with the flat view, a 64-row step: 1.99 -> 1.52 ms on the 2-core CPU,
        # docs/diagnoses.md, host_costs); None when no row narrows.
        self.allowed = _row_narrowing(self.grammars, words)
        self.matched = np.zeros((len(seqs), columns), dtype=bool)  # the columns a matcher filled
        self._cells = self.host.view(len(seqs) * columns, words)  # row i, column c at i * (L + 1) + c: no view per fill
        self.filled = [0] * len(seqs)  # columns filled per row
        for i in self.rows:
            self._fill_next(i)

    @classmethod
    def of(cls, seqs: list["Sequence"], num_draft: list[int], columns: int) -> "ColumnMasks | None":
        """`columns`: L + 1 of the verify batch. None, at no cost, when no row has a grammar."""
        if all(s.grammar is None for s in seqs):
            return None
        return cls(seqs, num_draft, columns)

    def apply(self, logits: torch.Tensor, column: int, rows: list[int] | None = None) -> torch.Tensor:
        """Mask `logits` [B', V] (rows `rows` of the batch, default all) with their bitmasks of `column`."""
        host = self.host[:, column] & self._narrowing(column)
        return apply_token_bitmask(logits, host if rows is None else host[rows])

    def advance(self, column: int, tokens: list[int], rows: list[int] | None = None) -> None:
        """Drafts `tokens` were drawn at `column` (for rows `rows`, default all): fill the next column."""
        for i, token in zip(range(len(tokens)) if rows is None else rows, tokens):
            if self.grammars[i] is not None and self.filled[i] == column + 1 and column < self.num_draft[i]:
                self._follow(i, token)

    def follow(self, draft_tokens: torch.Tensor) -> None:
        """Fill the columns of drafts made without the mask: [B, L] (read to the host only if needed)."""
        todo = [i for i in self.rows if self.filled[i] <= self.num_draft[i]]
        if not todo:
            return
        drafts = draft_tokens.tolist()
        for i in todo:
            while self.filled[i] <= self.num_draft[i]:
                self._follow(i, drafts[i][self.filled[i] - 1])

    def bitmask(self) -> torch.Tensor:
        """[B, L + 1, W] int32, on the host; every row's columns filled (`follow` first)."""
        return self.host & self._narrowing()

    def _narrowing(self, column: int | None = None) -> torch.Tensor:
        """`allowed` where a row's matcher filled the column, all-allowed elsewhere: [B, L + 1, W], or
        [B, W] for one column ([1] when no row narrows)."""
        if self.allowed is None:
            return torch.tensor([_ALL_ALLOWED], dtype=torch.int32)
        if column is not None:
            return torch.where(torch.from_numpy(self.matched[:, column, None]), self.allowed, _ALL_ALLOWED)
        return torch.where(torch.from_numpy(self.matched)[..., None], self.allowed[:, None], _ALL_ALLOWED)

    def _follow(self, i: int, token: int) -> None:
        grammar, column = self.grammars[i], self.filled[i] - 1
        if not grammar.advance(token):
            self.num_draft[i] = column  # refused: the row's drafts end before it
        elif grammar.terminated:
            self.num_draft[i] = column + 1  # a stop token: nothing can follow it, its next column stays open
            self.filled[i] += 1
        else:
            self._fill_next(i)

    def _fill_next(self, i: int) -> None:
        self.grammars[i].fill(self._cells, i * self.host.shape[1] + self.filled[i], narrow=False)
        self.matched[i, self.filled[i]] = True
        self.filled[i] += 1


def _row_narrowing(grammars: list, words: int) -> torch.Tensor | None:
    narrowing = [getattr(g, "allowed", None) for g in grammars]
    if all(a is None for a in narrowing):
        return None
    every = torch.full((words,), _ALL_ALLOWED, dtype=torch.int32)
    return torch.stack([every if a is None else a for a in narrowing])


def merge_bitmasks(masks: list[torch.Tensor | None], rows: list[int], columns: int) -> torch.Tensor | None:
    """One [sum(rows), columns, W] bitmask for merged verify batches (rows: each batch's), all-allowed
    where a batch had none or fewer columns; None when none had one."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = torch.full((sum(rows), columns, present[0].shape[-1]), _ALL_ALLOWED, dtype=torch.int32)
    start = 0
    for mask, n in zip(masks, rows):
        if mask is not None:
            out[start : start + n, : mask.shape[1]] = mask
        start += n
    return out


class Grammars:
    """Compiles requests' grammars for one tokenizer and hands out matchers. xgrammar is imported and
    the tokenizer's table built on the first request that asks for a grammar, not before.

    A request's grammar is parsed (and checked: a bad one is refused) when it is admitted, and
    compiled (the token-mask tables, the slow part) on a thread of its own, which xgrammar runs
    without the GIL; the engine steps meanwhile. The request needs it first for its first token's
    mask, after its prompt's prefill forward."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()  # by (kind, spec, whitespace), LRU
        self._thread: ThreadPoolExecutor | None = None
        self._no_control: dict[bool, torch.Tensor] = {}  # by any_whitespace: see _json_tokens

    def for_request(self, params: "SamplingParams") -> RequestGrammar | None:
        """A fresh matcher for a request's `structured` output, or None. Raises ParamError naming the
        request field when the grammar does not compile or cannot be honoured."""
        spec = params.structured
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ParamError(spec.field, "structured output needs the model's tokenizer; this engine has none")
        if params.ignore_eos:
            raise ParamError("ignore_eos", "cannot be combined with structured output: the grammar ends the output")
        if params.min_tokens:  # where the grammar can only end, min_tokens would leave no token to sample
            raise ParamError("min_tokens", "cannot be combined with structured output: the grammar ends the output")
        allowed = self._json_tokens(spec.any_whitespace) if spec.kind in ("json", "json_object") else None
        return RequestGrammar(self.compiled(spec), bitmask_words(self.vocab_size), allowed)

    def compiled(self, spec: StructuredOutput) -> Future:
        """The grammar's compilation, started now or earlier (cached by text). Raises ParamError if it
        does not parse."""
        key = (spec.kind, spec.spec, spec.any_whitespace)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            grammar = _parse(spec)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            raise ParamError(spec.field, f"invalid {_NAMES[spec.kind]}: {_clean(exc)}") from None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="vpd-grammar")
        self._compiled[key] = self._thread.submit(self._compiler_for_tokenizer().compile_grammar, grammar)
        if len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return self._compiled[key]

    def _json_tokens(self, any_whitespace: bool) -> torch.Tensor:
        """[W] the tokens JSON output may hold: none with a raw control character (JSON escapes them),
        and, in compact JSON, none with a tab or newline either. xgrammar's rule for strings with
        minLength/maxLength lets raw control characters through (0.2.8; strict parsers such as
        Python's json.loads then refuse the output), so every JSON matcher's mask is narrowed by this."""
        if any_whitespace not in self._no_control:
            forbidden = set(range(32)) - ({9, 10, 13} if any_whitespace else set())
            self._compiler_for_tokenizer()
            vocab = self._info.decoded_vocab
            bits = torch.zeros(bitmask_words(self.vocab_size) * 32, dtype=torch.int64)
            bits[: len(vocab)] = torch.tensor([not forbidden.intersection(token) for token in vocab])
            words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)  # [W] as unsigned 32-bit values
            self._no_control[any_whitespace] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._no_control[any_whitespace]

    def _compiler_for_tokenizer(self):
        if self._compiler is None:
            import xgrammar

            self._info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=self.stop_token_ids)
            # This class caches (by text, bounded by count); xgrammar's own cache would hold a second copy.
            self._compiler = xgrammar.GrammarCompiler(self._info, cache_enabled=False)
        return self._compiler


def _parse(spec: StructuredOutput):
    import xgrammar

    if spec.kind == "json":
        return xgrammar.Grammar.from_json_schema(spec.spec, any_whitespace=spec.any_whitespace)
    if spec.kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar takes any value)
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                 any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        # One alternative per choice, each an EBNF string literal (JSON's escapes are EBNF's).
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
    return xgrammar.Grammar.from_ebnf(spec.spec)


_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
          "grammar": "EBNF grammar"}


def _clean(exc: Exception) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: " and may add "Check failed: ...".
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.split("\n")[0][:300]
