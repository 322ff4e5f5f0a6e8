"""Workloads: what each request asks for (prompt text, prompt and output lengths in tokens).

Two sources, both repeatable from a seed:

- ShareGPT-format JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first turn is
  the prompt and the second turn's token count the output length, filtered on lengths the way
  `vllm bench serve` does (drop prompt or output under 4 tokens, prompt over 1024, prompt + output
  over 2048), after a seeded shuffle.
- Synthetic: prompt and output lengths drawn from clipped log-normal distributions, which have
  ShareGPT's right skew; `fit_lognormal` fits them to a real ShareGPT sample. Prompts are random
  vocabulary tokens, so acceptance rates measured on them say little about chat text: measure
  acceptance on ShareGPT.

Mixed traffic: `mix_long_prompts` swaps a seeded share of the requests' prompts for long ones
(kind "long") while keeping their output lengths, to measure prefill interference.

Lengths are counted with a real tokenizer (the target model's), never by splitting on spaces.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

# The project's shipped tokenizer, used when no --tokenizer is given.
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "models" / "vpd-target"


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    prompt_len: int  # tokens, by the workload's tokenizer
    output_len: int  # max_tokens sent; with ignore_eos the server generates exactly this many
    kind: str = "normal"  # "normal", or "long" for the long prompts of mixed traffic


@dataclass(frozen=True)
class LengthFilter:
    """Which ShareGPT conversations to keep; defaults are those of `vllm bench serve`."""

    min_prompt_len: int = 4
    max_prompt_len: int = 1024
    min_output_len: int = 4
    max_output_len: int | None = None
    max_total_len: int = 2048

    def keeps(self, prompt_len: int, output_len: int) -> bool:
        if prompt_len < self.min_prompt_len or prompt_len > self.max_prompt_len:
            return False
        if output_len < self.min_output_len:
            return False
        if self.max_output_len is not None and output_len > self.max_output_len:
            return False
        return prompt_len + output_len <= self.max_total_len


@dataclass(frozen=True)
class LogNormal:
    """Token lengths exp(N(log median, sigma)), rounded and clipped to [min_len, max_len]."""

    median: float
    sigma: float
    min_len: int = 4
    max_len: int = 1024

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(int)


def load_tokenizer(path: str | Path | None) -> Any:
    """A Hugging Face tokenizer from a local directory; the shipped target tokenizer by default."""
    from transformers import AutoTokenizer  # slow import, needed only when a workload is built

    chosen = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
    if not chosen.exists():
        raise FileNotFoundError(
            f"tokenizer directory {chosen} not found: pass --tokenizer PATH (lengths are counted "
            "in the served model's tokens)")
    return AutoTokenizer.from_pretrained(str(chosen))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def load_sharegpt(path: str | Path, tokenizer: Any, num_requests: int, seed: int,
                  length_filter: LengthFilter = LengthFilter(),
                  output_len: int | None = None) -> list[WorkloadRequest]:
    """`num_requests` requests from a ShareGPT JSON file (module docstring says how).

    `output_len` fixes every output length instead of taking the second turn's.
    Raises ValueError if the file has fewer conversations that pass the filter.
    """
    conversations = [c["conversations"] for c in json.loads(Path(path).read_text())
                     if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    requests: list[WorkloadRequest] = []
    for turns in conversations:
        if len(requests) == num_requests:
            break
        request = _sharegpt_request(turns, tokenizer, output_len)
        if length_filter.keeps(request.prompt_len, request.output_len):
            requests.append(request)
    if len(requests) < num_requests:
        raise ValueError(f"{path}: only {len(requests)} conversations pass the length filter, "
                         f"{num_requests} asked for")
    return requests


def _sharegpt_request(turns: list[dict], tokenizer: Any,
                      output_len: int | None) -> WorkloadRequest:
    prompt = turns[0]["value"]
    completion_len = count_tokens(tokenizer, turns[1]["value"])
    return WorkloadRequest(prompt=prompt, prompt_len=count_tokens(tokenizer, prompt),
                           output_len=output_len if output_len is not None else completion_len)


def fit_lognormal(lengths: list[int] | np.ndarray, min_len: int, max_len: int) -> LogNormal:
    """Maximum-likelihood log-normal of observed token lengths (e.g. a ShareGPT sample's)."""
    logs = np.log(np.asarray(lengths, dtype=float))
    return LogNormal(median=float(np.exp(logs.mean())), sigma=float(logs.std()),
                     min_len=min_len, max_len=max_len)


def synthetic(tokenizer: Any, num_requests: int, seed: int,
              prompt_lengths: LogNormal = LogNormal(median=128, sigma=1.0),
              output_lengths: LogNormal = LogNormal(median=128, sigma=0.8)
              ) -> list[WorkloadRequest]:
    """Requests with log-normal prompt and output lengths and random-token prompts."""
    rng = np.random.default_rng(seed)
    prompt_lens = prompt_lengths.sample(num_requests, rng)
    output_lens = output_lengths.sample(num_requests, rng)
    usable_ids = usable_token_ids(tokenizer)
    return [_random_prompt_request(tokenizer, usable_ids, int(p), int(o), rng)
            for p, o in zip(prompt_lens, output_lens)]


def mix_long_prompts(requests: list[WorkloadRequest], share: float, long_prompt_len: int,
                     tokenizer: Any, seed: int) -> list[WorkloadRequest]:
    """Replace round(share * n) seeded-chosen prompts by `long_prompt_len`-token ones."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"long-prompt share must be in [0, 1], got {share}")
    num_long = round(share * len(requests))
    if num_long == 0:  # nothing to replace: skip the vocabulary scan below
        return list(requests)
    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(len(requests), size=num_long, replace=False).tolist())
    usable_ids = usable_token_ids(tokenizer)
    return [replace(_random_prompt_request(tokenizer, usable_ids, long_prompt_len, r.output_len,
                                           rng), kind="long") if i in chosen else r
            for i, r in enumerate(requests)]


def _random_prompt_request(tokenizer: Any, usable_ids: np.ndarray, prompt_len: int,
                           output_len: int, rng: np.random.Generator) -> WorkloadRequest:
    prompt = random_prompt(tokenizer, usable_ids, prompt_len, rng)
    return WorkloadRequest(prompt=prompt, prompt_len=count_tokens(tokenizer, prompt),
                           output_len=output_len)


def random_prompt(tokenizer: Any, usable_ids: np.ndarray, num_tokens: int,
                  rng: np.random.Generator) -> str:
    """Text of random non-special tokens that re-encodes to about `num_tokens` tokens.

    Decoding then re-encoding can merge or split tokens, so the draw is trimmed or extended
    a few times towards the target; the caller records the length actually obtained.
    """
    ids = rng.choice(usable_ids, size=num_tokens).tolist()
    text = tokenizer.decode(ids)
    for _ in range(4):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == num_tokens:
            break
        if len(encoded) > num_tokens:
            ids = encoded[:num_tokens]
        else:
            ids = encoded + rng.choice(usable_ids, size=num_tokens - len(encoded)).tolist()
        text = tokenizer.decode(ids)
    return text


def usable_token_ids(tokenizer: Any) -> np.ndarray:
    """Every token id of the vocabulary except special tokens (BOS, EOS, pad, ...)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])
