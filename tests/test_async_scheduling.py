"""Async scheduling (EngineConfig.async_scheduling): a decode step launched before the one it follows is
read. Its output must be exactly what the engine gives with the host in the loop, a row that ends while
its next step is in flight must lose that step's token and keep its blocks until the step is read, and
the engine must fall back to reading first wherever the next step needs the host (penalties, prompt lookup)."""

import pytest
import torch

from lanes.engine.core import EngineConfig, EngineCore, build_runner
from lanes.sample.params import SamplingParams
from lanes.spec.ngram import NgramProposer
from lanes.spec.verify import VerifyLane
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine


def _requests(prompts, **params):
    return {str(i): (p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **params)) for i, p in enumerate(prompts)}


def _slots_used(engine) -> int:
    return engine.verifier.lane.runner.pool.num_used


def test_nospec_steps_ahead_and_keeps_greedy_output(llama_pair):
    target, _ = llama_pair
    prompts = random_prompts(4, VOCAB, 3, 20, seed=31)
    ahead, host_first = small_engine(target, None), small_engine(target, None, async_scheduling=False)
    outputs = run_to_completion(ahead, _requests(prompts))
    assert outputs == run_to_completion(host_first, _requests(prompts))
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 6 + 3 * i)
    # Most steps of a batch that only decodes go ahead (the default); none without async scheduling.
    assert ahead.num_steps_ahead >= 10 and host_first.num_steps_ahead == 0
    assert _slots_used(ahead) == 0 and not ahead.has_work


def test_a_request_arriving_mid_stream_joins_after_the_step_in_flight(llama_pair):
    target, _ = llama_pair
    first, second = random_prompts(2, VOCAB, 5, 12, seed=32)
    engine = small_engine(target, None, async_scheduling=True)
    engine.add_request("a", first, SamplingParams(max_tokens=20, ignore_eos=True))
    tokens = {"a": [], "b": []}
    for step in range(200):
        if step == 6:
            assert engine._in_flight is not None  # "a" decodes alone and ahead by now
            engine.add_request("b", second, SamplingParams(max_tokens=10, ignore_eos=True))
        if step > 6 and not engine.has_work:
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    assert tokens == {"a": hf_greedy(target, first, 20), "b": hf_greedy(target, second, 10)}


def test_a_step_launched_ahead_that_fails_is_scheduled_again_once_the_step_in_flight_is_read(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(2, VOCAB, 4, 16, seed=40)
    engine = small_engine(target, draft, num_speculative_tokens=2)
    launch_after, calls = engine.verifier.lane.launch_after, [0]

    def fails_once(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("injected")
        return launch_after(*args)

    engine.verifier.lane.launch_after = fails_once
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=40, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    assert calls[0] > 3 and engine.num_steps_ahead == calls[0] - 1  # it went ahead again after the failure
    assert outputs == {str(i): hf_greedy(target, p, 40) for i, p in enumerate(prompts)}
    assert _slots_used(engine) == 0 and not engine.has_work


def test_a_row_stopped_while_its_next_step_is_in_flight_drops_its_token_and_frees_its_slot_after(llama_pair):
    target, _ = llama_pair
    prompt = random_prompts(1, VOCAB, 12, 12, seed=33)[0]
    ref = hf_greedy(target, prompt, 30)
    stop_at = next(i for i in range(6, 30) if ref[i] not in ref[:i])
    engine = small_engine(target, None, async_scheduling=True)
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, stop_token_ids=[ref[stop_at]]))
    tokens, last = [], None
    while last is None or not last.finished:
        for out in engine.step():
            tokens.extend(out.token_ids)
            last = out
    assert tokens == ref[: stop_at + 1] and last.finish_reason == "stop"
    # The step after the stop was launched before the stop was read: the slot waits for it.
    assert engine._in_flight is not None and _slots_used(engine) == 1 and engine.has_work
    assert engine.step() == []
    assert _slots_used(engine) == 0 and not engine.has_work


def test_an_abort_while_a_step_is_in_flight_frees_the_slot_once_the_step_is_read(llama_pair):
    target, _ = llama_pair
    prompt = random_prompts(1, VOCAB, 8, 8, seed=34)[0]
    engine = small_engine(target, None, async_scheduling=True)
    engine.add_request("x", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.num_steps_ahead < 3:
        engine.step()
    aborted = engine.abort("x")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert _slots_used(engine) == 1 and engine.has_work
    assert engine.step() == []  # the step in flight is read, its token dropped
    assert _slots_used(engine) == 0 and not engine.has_work


def test_seeded_sampling_and_logprobs_are_the_same_with_and_without_async_scheduling(llama_pair):
    target, _ = llama_pair
    prompts = random_prompts(3, VOCAB, 4, 16, seed=35)
    runs = []
    for on in (True, False):
        engine = small_engine(target, None, async_scheduling=on)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i,
                                                         logprobs=2, ignore_eos=True))
        outs = {}
        while engine.has_work:
            for out in engine.step():
                entry = outs.setdefault(out.request_id, ([], []))
                entry[0].extend(out.token_ids)
                entry[1].extend(out.logprobs.logprobs)
        runs.append((outs, engine.num_steps_ahead))
    (ahead, num_ahead), (host_first, _) = runs
    assert num_ahead > 0 and ahead.keys() == host_first.keys()
    for rid in ahead:
        assert ahead[rid][0] == host_first[rid][0]
        assert ahead[rid][1] == pytest.approx(host_first[rid][1], abs=1e-9)


def test_spec_drafts_ahead_and_keeps_greedy_and_seeded_output(llama_pair):
    """With a draft model the next step's draft starts from the verify step's device output: the accepted
    count picks its input (the bonus token, or the last draft and the bonus token) and its positions."""
    target, draft = llama_pair
    prompts = random_prompts(3, VOCAB, 4, 16, seed=37)
    greedy = {str(i): (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    ahead, host_first = (small_engine(target, draft, num_speculative_tokens=3, async_scheduling=on) for on in (1, 0))
    outputs = run_to_completion(ahead, greedy)
    assert outputs == run_to_completion(host_first, greedy)
    assert all(outputs[str(i)] == hf_greedy(target, p, 40) for i, p in enumerate(prompts))
    # The same drafts, position by position: both of the inputs drafted ahead (drafts accepted in part, and
    # whole: accepted_per_pos[2] counts verify steps of 3 drafts that kept all 3) fed what the host would.
    stats = ahead.total_stats
    assert stats.to_dict() == host_first.total_stats.to_dict()
    assert ahead.num_steps_ahead >= 10
    assert stats.accepted_per_pos[2] > 0 and stats.num_drafts > stats.accepted_per_pos[0]
    sampled = {str(i): (p, SamplingParams(max_tokens=40, temperature=0.9, seed=11 + i, ignore_eos=True))
               for i, p in enumerate(prompts)}
    runs = [run_to_completion(small_engine(target, draft, num_speculative_tokens=3, async_scheduling=on), sampled)
            for on in (True, False)]
    assert runs[0] == runs[1]


def test_prompt_lookup_and_penalties_keep_the_host_in_the_loop(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(2, VOCAB, 4, 16, seed=36)
    long = {str(i): (p, SamplingParams(max_tokens=30, ignore_eos=True)) for i, p in enumerate(prompts)}
    penalised = small_engine(target, None, async_scheduling=True)
    run_to_completion(penalised, _requests(prompts, repetition_penalty=1.3))
    assert penalised.num_steps_ahead == 0  # the next token's penalty counts this one
    lookup = EngineCore.colocated(target, None, EngineConfig(max_model_len=320, num_speculative_tokens=3,
                                                             async_scheduling=True),
                                  proposer=NgramProposer(1, 3))
    run_to_completion(lookup, long)
    assert lookup.num_steps_ahead == 0  # the next lookup needs the tokens on the host
    spec_off = small_engine(target, draft, async_scheduling=True)
    spec_off.set_draft_lengths(0)
    outputs = run_to_completion(spec_off, _requests(prompts))
    assert spec_off.num_steps_ahead > 0  # speculation switched off by the controller: it decodes ahead
    assert outputs["1"] == hf_greedy(target, prompts[1], 9)


@pytest.mark.parametrize("drafts", [0, 3])
def test_the_benchmarks_pipelined_steps_commit_each_steps_tokens_and_give_back_their_slots(llama_pair, drafts):
    """benchmarks/gpu_check.py times the 7B's steps chained as async scheduling chains them: the context each
    timed step reads must be what the steps before it committed (one token each without drafts)."""
    from benchmarks.gpu_check import pipelined_verify_ms

    target, _ = llama_pair
    lane = VerifyLane(build_runner(target.model, EngineConfig(max_model_len=96, max_num_seqs=2)))
    ms, mean_context = pipelined_verify_ms(lane, 2, drafts, context=40, steps=4, repeats=2)
    # Steps 2-5 are timed; before step n a row holds 40 + (n - 1) tokens at least, 40 + (n - 1) * (drafts + 1) at most.
    assert ms > 0 and (mean_context == 42.5 if drafts == 0 else 42.5 <= mean_context <= 40 + 2.5 * (drafts + 1))
    assert lane.pool.num_used == 0
