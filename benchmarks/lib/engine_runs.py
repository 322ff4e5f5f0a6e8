"""Workloads of random token-id prompts (no tokenizer in the way), as stream_latency.py sends them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.workload import WorkloadRequest


@dataclass(frozen=True)
class Work:
    prompts: list[list[int]]
    output_len: int
    concurrency: int
    vocab_size: int

    def workload(self) -> list[WorkloadRequest]:
        return [WorkloadRequest(p, len(p), self.output_len) for p in self.prompts]  # type: ignore[arg-type]


def random_work(vocab_size: int, prompt_len: int, output_len: int, concurrency: int, count: int, seed: int) -> Work:
    rng = np.random.default_rng(seed)
    return Work(rng.integers(1, vocab_size, (count, prompt_len)).tolist(), output_len, concurrency, vocab_size)
