"""Host-side costs of three per-step paths, on the CPU (no GPU needed): what the decode loop and the
ingress spend in Python between GPU work.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_costs.py

- grammar: `ColumnMasks` for one decode step of 64 JSON-schema rows inside a string (nearly every token
  allowed), 3 drafts, V = 32,000: fill column 0, narrow and read each drafted column, follow the drafts,
  the verify bitmask, and the commit that rolls each matcher back.
- logprobs: `ChoiceExtras.render` of 3-token chunks with top-5 logprobs, per token, once the vocabulary's
  strings are known (a long run over random ids).
- n-gram: `NgramProposer.propose` for 1 and 16 rows of random prompts (nothing matches), and for 16 rows of
  ~1,700 tokens that repeat a document (every row matches), each row growing a token a step.

Prints one line per measurement (microseconds or milliseconds per unit, mean over the repeats). The
script runs unchanged on 0cc757a (before this session's changes to these paths): copy it into a worktree.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.gpu_evidence import JSON_SCHEMA, grammar_tokenizer  # noqa: E402
from deployments.openai_logprobs import ChoiceExtras  # noqa: E402
from lanes.engine.sequence import Sequence  # noqa: E402
from lanes.sample.grammar import ColumnMasks, Grammars  # noqa: E402
from lanes.sample.logprobs import TokenLogprobs  # noqa: E402
from lanes.sample.params import SamplingParams, StructuredOutput  # noqa: E402
from lanes.spec.ngram import NgramProposer  # noqa: E402

VOCAB = 32000
INTO_STRING = [1, 3, 6, 3, 4, 7, 3]  # '{', '"', 'text', '"', ':', ' ', '"' in grammar_tokenizer's ids


def mean_s(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def grammar_step_ms(tokenizer, rows: int = 64, drafts: int = 3) -> float:
    grammars = Grammars(tokenizer, VOCAB, {0})
    spec = StructuredOutput("json", json.dumps(JSON_SCHEMA), "response_format")
    seqs = [SimpleNamespace(grammar=grammars.for_request(SimpleNamespace(structured=spec, ignore_eos=False,
                                                                         min_tokens=0))) for _ in range(rows)]
    for seq in seqs:
        assert all(seq.grammar.matcher.accept_token(t) for t in INTO_STRING)
    drafted = [200 + j for j in range(drafts + 1)]

    def step() -> None:
        masks = ColumnMasks.of(seqs, [drafts] * rows, drafts + 1)
        for j in range(drafts):
            # What `apply` reads for the draft's position j (before b53c320 the fills were narrowed one by one).
            masks.host[:, j] & masks._narrowing(j) if hasattr(masks, "_narrowing") else masks.host[:, j]
            masks.advance(j, [drafted[j]] * rows)
        masks.bitmask()
        for seq in seqs:
            seq.grammar.commit(drafted)  # every draft kept, plus a bonus token
            seq.grammar.matcher.rollback(len(drafted))  # back inside the string for the next repeat

    return 1e3 * mean_s(step, 30)


def logprobs_us_per_token(tokenizer, chat: bool, chunks: int = 20000) -> float:
    rng = random.Random(0)
    extras = ChoiceExtras(tokenizer, chat, True)

    def chunk() -> None:
        ids = [rng.randrange(100, VOCAB) for _ in range(3)]
        lp = TokenLogprobs([-0.1] * 3, [[rng.randrange(VOCAB) for _ in range(5)] for _ in ids], [[-0.1] * 5] * 3)
        extras.render(SimpleNamespace(token_ids=ids, logprobs=lp, prompt_logprobs=None))

    return 1e6 * mean_s(chunk, chunks) / 3


def ngram_ms(rows: int, matching: bool, steps: int = 100) -> float:
    rng = np.random.default_rng(0)
    doc = rng.integers(10, VOCAB, 850).tolist()
    prompt = (lambda: doc + doc[:845]) if matching else (lambda: rng.integers(10, VOCAB, 256).tolist())
    seqs = [Sequence(str(i), prompt(), SamplingParams(), 0, 3) for i in range(rows)]
    proposer = NgramProposer(2, 5)

    def step() -> None:
        proposer.propose(seqs, [3] * rows)
        for seq in seqs:
            seq.token_ids.append(doc[len(seq.token_ids) % len(doc)] if matching else int(rng.integers(10, VOCAB)))

    return 1e3 * mean_s(step, steps)


def main() -> None:
    tokenizer = grammar_tokenizer(VOCAB)
    print(f"grammar: host mask work per decode step, 64 rows, 3 drafts: {grammar_step_ms(tokenizer):.2f} ms")
    for chat in (False, True):
        print(f"logprobs ({'chat' if chat else 'completions'}): {logprobs_us_per_token(tokenizer, chat):.1f} us a token")
    print(f"n-gram, 1 row, nothing matches: {1e3 * ngram_ms(1, False):.0f} us a step")
    print(f"n-gram, 16 rows, nothing matches: {1e3 * ngram_ms(16, False):.0f} us a step")
    print(f"n-gram, 16 rows of ~1,700 matching tokens: {ngram_ms(16, True):.2f} ms a step")


if __name__ == "__main__":
    main()
