"""A request's choices: `n` per prompt, each a request of its own in the lanes, streamed concurrently.

Choice `prompt_index * n + i` is the i-th sample of prompt `prompt_index`, as OpenAI and vLLM number
them. With a `seed`, sample i draws with `seed + i` (vLLM's parallel sampling does the same), so the
answer is reproducible while the n samples of one prompt differ.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deployments.api.openai_logprobs import ChoiceExtras
from deployments.api.openai_protocol import usage
from lanes.engine.outputs import RequestOutput
from lanes.sample.params import INT64_MIN, SamplingParams
from lanes.spec.stats import SpecDecodeStats


@dataclass
class Choice:
    index: int
    prompt: str | list[int]
    params: SamplingParams
    extras: ChoiceExtras  # per choice: it keeps the running text offset of its own stream


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample i: `seed + i`, wrapped into int64 (the engine's seed tensors)."""
    if seed is None:
        return None
    return (seed + i - INT64_MIN) % 2**64 + INT64_MIN


def sample_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of a prompt's n samples."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]


def total_usage(finals: list[RequestOutput], n: int) -> dict:
    """Usage of a request from its choices' last outputs, in index order: each prompt's tokens once
    (its n samples share it), every choice's output tokens."""
    stats = SpecDecodeStats()
    for out in finals:
        if out.stats is not None:
            stats.merge(out.stats)
    return usage(sum(out.num_prompt_tokens for out in finals[::n]), sum(out.num_output_tokens for out in finals),
                 stats, sum(out.num_cached_tokens for out in finals[::n]))


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


async def interleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Every stream's items as they come, each as (its stream's index, item), until all end.

    Each stream is iterated by a task of its own, so all run concurrently. Leaving early (a client
    gone, one choice failed) or a stream raising cancels every task: each stream's own cleanup then
    aborts its request in the lanes."""
    if len(streams) == 1:  # the common request: no task, no queue
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, _Failed(exc)))
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.exc
            else:
                yield index, item
    finally:
        for task in tasks:  # synchronously first: a cancelled caller may not get past the next await
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
