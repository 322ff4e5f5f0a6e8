"""Streaming text: stop strings cut the text, partial stop strings are held back, UTF-8 is whole."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lanes.engine.core import EngineCore
from lanes.model.loader import load_model
from lanes.sample.detokenizer import IncrementalDetokenizer
from lanes.sample.params import SamplingParams
from tests.engine_helpers import small_engine

CORPUS = ["def main():\n    return 42\n", "print('héllo wörld ✓')\n", "for i in range(10):\n    pass\n"] * 20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces, hit = [], False
    for token in tokenizer.encode(text):
        piece, hit = detok.append([token])
        pieces.append(piece)
        if hit:
            break
    if not hit:
        pieces.append(detok.flush())
    return pieces, hit


def test_streamed_pieces_join_to_the_text(tokenizer):
    text = "print('héllo wörld ✓')\n"
    pieces, hit = _stream(tokenizer, text, [])
    assert "".join(pieces) == text and not hit
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_is_never_emitted(tokenizer):
    pieces, hit = _stream(tokenizer, "def main():\n    return 42\n", ["return"])
    assert hit and "".join(pieces) == "def main():\n    "
    assert not any("ret" in p for p in pieces)


def test_stop_string_spanning_tokens(tokenizer):
    pieces, hit = _stream(tokenizer, "for i in range(10):\n    pass\n", ["e(1"])
    assert hit and "".join(pieces) == "for i in rang"


def _chunked(tokenizer, ids: list[int], stop: list[str], sizes: list[int], min_tokens: int = 0) -> tuple[str, int]:
    """Feed `ids` in chunks of `sizes` (cycled) as verify steps do; (the text, tokens kept)."""
    detok = IncrementalDetokenizer(tokenizer, stop, min_tokens)
    text, kept, i, step = "", 0, 0, 0
    while i < len(ids):
        chunk = ids[i : i + sizes[step % len(sizes)]]
        piece, hit = detok.append(chunk)
        text, kept = text + piece, kept + detok.consumed
        if hit:
            return text, kept
        i, step = i + len(chunk), step + 1
    return text + detok.flush(), kept


TWICE = "for i in range(10):\n    pass\nfor i in range(10):\n    pass\n"


@pytest.mark.parametrize("stop", [["e(1"], ["pass\nfor"], ["range", "i in"], ["\n    p"]])
def test_several_tokens_at_once_stop_where_one_at_a_time_stops(tokenizer, stop):
    """A verify step appends up to L + 1 tokens at once: the text, and the tokens kept (up to the one
    that completed the stop string, which may span several tokens), are those of one at a time."""
    ids = tokenizer.encode(TWICE)
    one = _chunked(tokenizer, ids, stop, [1])
    assert one[0] == TWICE[: min(TWICE.find(s) for s in stop)]
    assert tokenizer.decode(ids[: one[1]]).startswith(one[0]) and one[1] < len(ids)
    for sizes in ([2], [3], [5], [1, 4], [len(ids)]):
        assert _chunked(tokenizer, ids, stop, sizes) == one, sizes


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """vLLM's rule: a stop string completed by one of the first min_tokens tokens does not count."""
    ids = tokenizer.encode(TWICE)
    first_end = next(n for n in range(1, len(ids)) if "i in" in tokenizer.decode(ids[:n]))
    assert _chunked(tokenizer, ids, ["i in"], [1])[0] == "for "
    text, kept = _chunked(tokenizer, ids, ["i in"], [1], min_tokens=first_end)
    assert text == TWICE[: TWICE.index("i in", 5)] and kept > first_end
    for sizes in ([2], [3], [4, 1], [len(ids)]):
        assert _chunked(tokenizer, ids, ["i in"], sizes, min_tokens=first_end) == (text, kept), sizes


def _generate(engine: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], str, str]:
    """(the tokens of each step, the text, the finish reason) of one request run to its end."""
    engine.add_request("r", prompt, params)
    steps, text, reason = [], "", None
    while engine.has_work:
        for out in engine.step():
            steps, text, reason = steps + [out.token_ids], text + out.text, out.finish_reason or reason
    return steps, text, reason


def _boundary_stop(tok, tokens: list[int], steps: list[list[int]]) -> tuple[int, str]:
    """(k, a stop string from the end of token k's text into token k + 1's) where tokens k and k + 1
    come in one step with more after them, and the string occurs nowhere earlier."""
    ends = np.cumsum([len(s) for s in steps])
    for k in range(2, len(tokens) - 2):
        before, upto, text = tok.decode(tokens[: k + 1]), tok.decode(tokens[: k + 2]), tok.decode(tokens)
        mid_step = not {k, k + 1} & set((ends - 1).tolist())  # k, k + 1 and one more in one step
        if mid_step and upto.startswith(before) and len(upto) > len(before) > 0:
            stop = before[-1] + upto[len(before)]
            if "\ufffd" not in stop and text.find(stop) == len(before) - 1:
                return k, stop
    raise AssertionError("no stop string across two tokens inside one step")


@pytest.mark.parametrize("draft_len", [2, 4])
def test_engine_stops_at_a_stop_string_across_tokens_exactly_as_without_speculation(pair_paths, draft_len):
    """With speculation a step emits several tokens; the output still ends at the token that completed
    the stop string (inside the step): the same tokens, text and usage as decoding one token a step."""
    target, draft = (load_model(path) for path in pair_paths)
    tok = target.tokenizer
    prompt = tok.encode("class Point:\n    def __init__(self, x, y):")
    plain = SamplingParams(max_tokens=60, ignore_eos=True)
    steps = _generate(small_engine(target, draft, num_speculative_tokens=draft_len), prompt, plain)[0]
    tokens = [t for step in steps for t in step]
    k, stop = _boundary_stop(tok, tokens, steps)
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop])
    expected_tokens, expected_text = tokens[: k + 2], tok.decode(tokens[: k + 1])[:-1]
    for engine in (small_engine(target, None), small_engine(target, draft, num_speculative_tokens=draft_len)):
        steps, text, reason = _generate(engine, prompt, params)
        assert ([t for step in steps for t in step], text, reason) == (expected_tokens, expected_text, "stop")
        assert engine.scheduler.by_id == {}
