"""The engine in a process of its own (lanes/engine/process.py): the same streams as the engine
thread, requests that fail cleanly when that process dies, and no process left behind."""

import asyncio
import os
import pickle
import signal
import time
import types
from functools import partial

import pytest

from lanes.engine.backends import KVLost
from lanes.engine.process import EngineProcessDied, PeerLink, ProcessEngine, picklable
from lanes.engine.snapshot import EngineSnapshot, core_report
from lanes.sample.params import ParamError, SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, pair_engine, random_prompts


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _tokens(engine, prompt, params) -> list[int]:
    return [t async for out in engine.generate(prompt, params) for t in out.token_ids]


@pytest.fixture(scope="module", params=[False, True], ids=["host_first", "async_scheduling"])
def engine_args(request):
    return dict(factory=partial(pair_engine, "llama", async_scheduling=request.param), describe=_slots_total)


def _slots_total(core) -> int:
    return core.scheduler.draft_pool.shape.num_slots


def test_greedy_streams_equal_the_target_and_metrics_see_every_step(llama_pair, engine_args):
    target, _ = llama_pair
    prompts = random_prompts(5, VOCAB, 3, 30, seed=31)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    steps: list[tuple[EngineSnapshot, float, int]] = []

    async def main():
        engine = ProcessEngine(**engine_args, on_step=lambda *a: steps.append(a), stream_interval_s=0.02)
        try:
            outs = await asyncio.gather(*(_tokens(engine, p, params) for p in prompts))
            return outs, engine.info, engine.num_steps, await engine.call(core_report), engine.pid
        finally:
            engine.shutdown()

    outs, info, num_steps, report, pid = asyncio.run(main())
    for prompt, tokens in zip(prompts, outs):
        assert tokens == hf_greedy(target, prompt, params.max_tokens)
    assert info == 8  # describe() ran in the engine process
    assert num_steps == len(steps) > 0
    assert report["running"] == 0 and report["kv_slots_used"] == 0
    # Every drafted token of the run reached the replica's side in the snapshots.
    assert steps[-1][0].total_stats.num_draft_tokens == report["spec_decode"]["num_draft_tokens"] > 0
    assert pid != os.getpid() and not _pid_alive(pid)  # shut down: the engine process is gone


def test_bad_input_and_aborts_answer_without_harming_other_requests(llama_pair, engine_args):
    target, _ = llama_pair
    prompt = random_prompts(1, VOCAB, 5, 5, seed=2)[0]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def main():
        engine = ProcessEngine(**engine_args)
        try:
            with pytest.raises(ParamError) as refused:
                await _tokens(engine, [VOCAB + 5], params)  # a token id past the vocabulary
            # Leaving a stream after its first chunk aborts the request and frees its slots.
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True)):
                break
            await asyncio.sleep(0.3)
            used = (await engine.call(core_report))["kv_slots_used"]
            return refused.value, used, await _tokens(engine, prompt, params)
        finally:
            engine.shutdown()

    refused, used, tokens = asyncio.run(main())
    assert refused.field == "prompt"
    assert used == 0
    assert tokens == hf_greedy(target, prompt, params.max_tokens)


def test_requests_fail_fast_when_the_engine_process_dies():
    prompts = random_prompts(3, VOCAB, 5, 10, seed=5)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)  # far longer than the test

    async def one(engine, prompt):
        try:
            async for _ in engine.generate(prompt, params):
                pass
        except EngineProcessDied:
            return time.monotonic()
        return None

    async def main():
        engine = ProcessEngine(partial(pair_engine, "llama", max_model_len=4096), stream_interval_s=0.0)
        try:
            tasks = [asyncio.create_task(one(engine, p)) for p in prompts]
            await asyncio.sleep(1.0)
            killed_s = time.monotonic()
            os.kill(engine.pid, signal.SIGKILL)
            ended = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            with pytest.raises(EngineProcessDied):
                await _tokens(engine, prompts[0], params)  # a new request fails at once, too
            return killed_s, ended, engine.alive
        finally:
            engine.shutdown()

    killed_s, ended, alive = asyncio.run(main())
    assert all(t is not None and t - killed_s < 2.0 for t in ended), ended
    assert not alive


def test_a_factory_that_fails_fails_the_constructor_with_its_traceback():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        ProcessEngine(partial(divmod, 1, 0))


def test_a_peer_call_waiting_when_the_replica_goes_gets_the_error_and_so_does_every_later_one():
    """An engine may wait for a peer's answer inside its step (pdv's verify call): when the engine
    process's replica is gone, the reader thread fails what waits, and a later call fails at once
    instead of waiting for an answer that cannot come."""
    sent, answers = [], []
    link = PeerLink(sent.append, node_id=None)
    link.call("first", answers.append)
    link.answer(sent[0][1], "its answer")
    link.call("second", answers.append)
    gone = EngineProcessDied("the engine's replica is gone")
    link.fail_all(gone)
    link.call("third", answers.append)
    assert [message[2] for message in sent] == ["first", "second"]
    assert answers == ["its answer", gone, gone]


def test_an_error_whose_class_pickle_cannot_find_crosses_as_its_nearest_base_that_it_can():
    """Serve ships a request router's module by value, so an error class defined there is one pickle cannot
    find by name. LeaseGone (a KVLost) was one until it moved to deployments/routing/leases.py: sent to the engine
    process as a plain RuntimeError, its request failed ("internal error") where it should be recomputed."""
    gone_class = types.new_class("LeaseGone", (KVLost,))
    gone_class.__module__ = "deployments.routing.lease_router"  # the name, not this object
    gone = gone_class("verify replica abc is gone")
    gone.waited_s = 2.5
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(gone)
    crossed = pickle.loads(pickle.dumps(picklable(gone)))
    assert type(crossed) is KVLost and str(crossed) == "verify replica abc is gone" and crossed.waited_s == 2.5
    assert picklable(ValueError("x")).__class__ is ValueError

