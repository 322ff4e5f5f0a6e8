"""Streaming text: stop strings cut the text, partial stop strings are held back, UTF-8 is whole."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lanes.detokenizer import IncrementalDetokenizer

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
