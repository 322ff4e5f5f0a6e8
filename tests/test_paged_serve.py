"""Paged KV pools over HTTP on a real Serve instance in pd and pdv (CPU, tiny pair), with so few
blocks that the decode and verify lanes run out mid-decode: every request completes with the
output it gets without the limit (greedy), requeued and recomputed where blocks ran out, never
failed; and no lane holds a block afterwards."""

import asyncio

import httpx
import pytest

from lanes.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_prompts
from tests.serve_helpers import MODEL, app_config, base_url, lane_stats, serving, wait_until_idle

pytestmark = pytest.mark.serve

MODES = ("pd", "pdv")
# max_model_len 256 + 64 tokens of slack = 20 blocks of 16 per slot: 40 blocks hold four requests of
# 60 prompt + 60 output tokens at once, and pdv's one verify lane serves two decode replicas.
TIGHT = {"max_model_len": 256, "max_num_seqs": 8, "num_speculative_tokens": 3, "prefill_chunk_tokens": 32,
         "num_kv_blocks": 40}


@pytest.fixture(scope="module")
def target_path(pair_paths):
    target, draft = pair_paths
    with serving({mode: app_config(mode, target, draft, engine=TIGHT) for mode in MODES}):
        yield target


async def _complete(http: httpx.AsyncClient, mode: str, prompt: list[int]) -> list[int]:
    r = await http.post(f"{base_url(mode)}/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_block_exhaustion_requeues_and_every_request_gets_its_greedy_output(mode, target_path):
    target = load_model(target_path)
    prompts = random_prompts(12, len(target.tokenizer), 50, 60, seed=61)

    async def main():
        async with httpx.AsyncClient(timeout=600) as http:
            return await asyncio.gather(*(_complete(http, mode, p) for p in prompts))

    outputs = asyncio.run(main())
    for prompt, out in zip(prompts, outputs):
        assert out == hf_greedy(target, prompt, 60)
    preempted = sum(s.get("num_preemptions", 0) for s in lane_stats(mode, "DecodeLane"))
    assert preempted > 0, "the pools never ran out: the test does not test preemption"
    wait_until_idle(mode, mode, timeout_s=30)
