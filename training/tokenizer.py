"""Byte-level BPE tokenizer shared by the target and the draft.

A small vocabulary keeps the embedding tables (a large share of a ~1-2 M draft) small, and
byte-level BPE never needs an unknown token. Saved as a ``PreTrainedTokenizerFast`` with a ChatML
chat template, so ``AutoTokenizer.from_pretrained(model_dir)`` is all a user needs.
"""

from collections.abc import Iterable

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from training.corpus import EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train on ``texts`` (in the given order, which makes the merges reproducible)."""
    tokenizer = Tokenizer(models.BPE())
    # Every newline is a token of its own: otherwise "\n" + "    return" trains as "\n   " +
    # " return", and the very common prompt that ends in "\n" (a chat template's "assistant\n",
    # a line just finished) is one the model has never seen.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return wrap_for_transformers(tokenizer)


def wrap_for_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,  # code: spaces before punctuation are meaningful
        model_max_length=2048,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> np.ndarray:
    """One token stream: each document followed by ``<|endoftext|>``. ``[num_tokens]`` uint16."""
    assert len(tokenizer) <= 2**16, "token ids are stored as uint16"
    eos_id = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False)
    pieces = []
    for encoding in encodings:
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
        pieces.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
