"""Coalesced streams: a request's chunks are merged between messages, never lost or reordered, the
first chunk is never held, and the last one is not held either; without a time floor, a consumer
that keeps up gets each step's tokens alone and one that falls behind gets them merged."""

import asyncio
import time

from lanes.engine.async_engine import AsyncEngine
from lanes.engine.outputs import RequestOutput, merge_outputs
from lanes.sample.params import SamplingParams
from lanes.spec.stats import SpecDecodeStats
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, small_engine


def test_merge_joins_tokens_and_text_and_keeps_the_last_chunks_state():
    stats = SpecDecodeStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4)
    chunks = [RequestOutput("r", [1], "a", num_output_tokens=1),
              RequestOutput("r", [2, 3], "bc", num_output_tokens=3),
              RequestOutput("r", [4], "d", True, "length", 7, 4, stats)]
    merged = merge_outputs(chunks)
    assert (merged.token_ids, merged.text) == ([1, 2, 3, 4], "abcd")
    assert (merged.finished, merged.finish_reason, merged.num_prompt_tokens, merged.num_output_tokens) == (
        True, "length", 7, 4)
    assert merged.stats is stats
    assert merge_outputs(chunks[:1]) is chunks[0]


async def _chunks(engine: AsyncEngine, prompt, params) -> list[tuple[float, RequestOutput]]:
    start = time.perf_counter()
    return [(time.perf_counter() - start, out) async for out in engine.generate(prompt, params)]


def test_coalesced_streams_deliver_every_token_once_in_order(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(6, VOCAB, 3, 40, seed=21)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    interval_s = 0.15

    async def main():
        engine = AsyncEngine(small_engine(target, draft), stream_interval_s=interval_s)
        try:
            runs = await asyncio.gather(*(_chunks(engine, p, params) for p in prompts))
            return runs, engine.num_messages, engine.num_steps
        finally:
            engine.shutdown()

    runs, num_messages, num_steps = asyncio.run(main())
    for prompt, chunks in zip(prompts, runs):
        tokens = [t for _, out in chunks for t in out.token_ids]
        assert tokens == hf_greedy(target, prompt, params.max_tokens)  # all, in order, once
        assert [out.finished for _, out in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1][1].num_output_tokens == params.max_tokens
        assert chunks[-1][1].stats is not None and all(out.stats is None for _, out in chunks[:-1])
        gaps = [b[0] - a[0] for a, b in zip(chunks[1:], chunks[2:])]
        # Between the first and the last chunk, messages are at least an interval apart.
        assert all(g >= interval_s * 0.9 for g in gaps[:-1]), gaps
    assert num_messages == sum(len(c) for c in runs)
    assert num_messages < num_steps * len(prompts) / 2  # merged: far fewer messages than step outputs


def test_first_and_last_chunks_are_not_held_by_the_interval(llama_pair):
    target, draft = llama_pair
    prompt = random_prompts(1, VOCAB, 10, 10, seed=3)[0]
    short = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main(interval_s):
        engine = AsyncEngine(small_engine(target, draft), stream_interval_s=interval_s)
        try:
            await _chunks(engine, prompt, short)  # warm-up
            return await _chunks(engine, prompt, short)
        finally:
            engine.shutdown()

    held = asyncio.run(main(5.0))
    free = asyncio.run(main(0.0))
    # The first chunk (the prefill's token) leaves at once; the request then ends well inside one
    # interval, so its last chunk went out when it finished, not when the interval ran out.
    assert held[0][1].token_ids == free[0][1].token_ids and len(held[0][1].token_ids) == 1
    assert held[0][0] < free[0][0] + 0.5
    assert len(held) == 2 and held[-1][1].finished
    assert held[-1][0] < 2.0


def test_a_message_budget_lengthens_every_streams_interval(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(4, VOCAB, 3, 20, seed=8)
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    async def main():
        # 4 streams sharing 10 messages/s: each stream's messages are >= 0.4 s apart, not 0.01 s.
        engine = AsyncEngine(small_engine(target, draft), stream_interval_s=0.01, max_stream_messages_per_s=10)
        try:
            start = time.perf_counter()
            runs = await asyncio.gather(*(_chunks(engine, p, params) for p in prompts))
            return runs, time.perf_counter() - start
        finally:
            engine.shutdown()

    runs, elapsed_s = asyncio.run(main())
    for chunks in runs:
        assert sum(len(out.token_ids) for _, out in chunks) == params.max_tokens
        gaps = [b[0] - a[0] for a, b in zip(chunks[1:], chunks[2:])]
        # While all 4 run, n / rate = 0.4 s; the interval shrinks as streams finish. The last gap
        # is free: a finished request's chunk is never held.
        assert all(g >= 0.3 for g in gaps[:-1]), gaps
    # Besides each stream's first and last chunk, messages leave at no more than 10 a second.
    middle = sum(len(chunks) - 2 for chunks in runs)
    assert middle <= 10 * elapsed_s + len(runs), (middle, elapsed_s)


def test_without_a_floor_a_slow_consumer_gets_merged_chunks_and_a_fast_one_each_steps(llama_pair):
    target, draft = llama_pair
    prompt = random_prompts(1, VOCAB, 10, 10, seed=5)[0]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    pause_s = 0.25

    async def read(engine: AsyncEngine, pause: float) -> tuple[list[RequestOutput], int, int]:
        messages, coalesced = engine.num_messages, engine.num_coalesced
        chunks = []
        async for out in engine.generate(prompt, params):
            chunks.append(out)
            await asyncio.sleep(pause)  # a consumer that takes its chunks this slowly
        return chunks, engine.num_messages - messages, engine.num_coalesced - coalesced

    async def main():
        engine = AsyncEngine(small_engine(target, draft))  # the defaults: no interval, no bound
        try:
            await read(engine, 0.0)  # warm-up
            steps = engine.num_steps
            fast = await read(engine, 0.0)
            fast_steps = engine.num_steps - steps
            return fast, fast_steps, await read(engine, pause_s)
        finally:
            engine.shutdown()

    (fast, fast_messages, fast_coalesced), fast_steps, (slow, slow_messages, slow_coalesced) = asyncio.run(main())
    expected = hf_greedy(target, prompt, params.max_tokens)
    for chunks in (fast, slow):
        assert [t for out in chunks for t in out.token_ids] == expected  # all, in order, once
        assert chunks[-1].finished and not any(out.finished for out in chunks[:-1])
    # A consumer that keeps up: about one message per step (the engine thread may still end two steps
    # between two turns of the event loop); each step output is a message or merged into one.
    assert fast_messages == len(fast) and fast_messages + fast_coalesced >= fast_steps * 0.9
    assert fast_messages >= fast_steps / 2, (fast_messages, fast_steps)
    # A slow one: the steps made while it paused went out together, not as a queue of messages.
    assert slow_messages == len(slow) and slow_coalesced > 0
    assert max(len(out.token_ids) for out in slow) > 1
