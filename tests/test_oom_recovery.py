"""Out-of-memory errors inside an engine step (issue 28): a real engine on the tiny pair whose target
runner raises a real torch.OutOfMemoryError from chosen forwards. The step's requests are recomputed,
never failed; the next steps run smaller and grow back; greedy output is unchanged; and a request that
still runs out of memory at the smallest step size fails after max_oom_attempts with a clean error."""

import torch

from lanes.engine.step_cap import RESTORE_AFTER_STEPS
from lanes.sample.params import SamplingParams
from tests.client_errors import assert_clean
from tests.conftest import VOCAB
from tests.engine_helpers import random_prompts, run_to_completion, small_engine

OOM_TEXT = ("CUDA out of memory. Tried to allocate 228.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
            "106.62 MiB is free. Process 455 has 2.67 GiB memory in use.")


def _inject_oom(engine, when) -> list[int]:
    """Make the engine's target runner raise an out-of-memory error from the forwards `when(prefill,
    ids, call)` picks (call: the forward's number); returns the numbers of those that raised."""
    runner = engine.verifier.lane.runner
    forward, calls, raised = runner.forward, [0], []

    def failing_forward(rows, ids, *args, prefill=False, **kwargs):
        calls[0] += 1
        if when(prefill, ids, calls[0]):
            raised.append(calls[0])
            raise torch.OutOfMemoryError(OOM_TEXT)
        return forward(rows, ids, *args, prefill=prefill, **kwargs)

    runner.forward = failing_forward
    return raised


def _requests(count: int, max_tokens: int = 24, seed: int = 41):
    prompts = random_prompts(count, VOCAB, 20, 60, seed=seed)
    return {str(i): (p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)}


def test_an_oom_in_a_decode_step_recomputes_its_requests_and_output_is_unchanged(llama_pair):
    target, draft = llama_pair
    requests = _requests(6)
    reference = run_to_completion(small_engine(target, draft), requests)
    engine = small_engine(target, draft)
    decodes = []  # the second failure hits the first decode step after the recompute
    raised = _inject_oom(engine, lambda prefill, ids, call: not prefill and (decodes.append(call) or len(decodes)
                                                                              in (5, 6)))
    assert run_to_completion(engine, requests) == reference  # run_to_completion asserts no output has an error
    assert len(raised) == 2
    assert engine.step_cap.num_oom_recoveries == 2 and engine.scheduler.num_preemptions >= 2
    assert engine.device_fault is None


def test_an_oom_in_a_prefill_forward_recomputes_and_the_step_cap_halves_then_grows_back(llama_pair):
    target, draft = llama_pair
    requests = _requests(4, max_tokens=RESTORE_AFTER_STEPS * 3)
    reference = run_to_completion(small_engine(target, draft), requests)
    engine = small_engine(target, draft, max_num_seqs=8, idle_prefill_tokens=64)
    raised = _inject_oom(engine, lambda prefill, ids, call: prefill and call == 1)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    caps, outputs = [], {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id] += out.token_ids
        caps.append((engine.step_cap.rows, engine.step_cap.prefill_tokens))
    assert raised == [1] and outputs == reference
    assert caps[0] == (4, 32)  # halved by the failed step
    assert caps[-1] == (8, 64)  # doubled back after clean steps


def test_rows_capped_after_an_oom_all_advance_and_no_forward_exceeds_the_cap(llama_pair):
    target, draft = llama_pair
    requests = _requests(8, max_tokens=80)
    reference = run_to_completion(small_engine(target, draft), requests)
    engine = small_engine(target, draft, max_num_seqs=8)
    widths = []  # (prefill, rows) of every target forward

    def when(prefill, ids, call):
        widths.append((prefill, ids.shape[0]))
        return not prefill and ids.shape[0] >= 6 and not any(w >= 6 for p, w in widths[:-1] if not p)

    raised = _inject_oom(engine, when)
    assert run_to_completion(engine, requests) == reference
    assert len(raised) == 1 and engine.step_cap.num_oom_recoveries == 1
    failed = widths[raised[0] - 1][1]
    decodes_after = [rows for prefill, rows in widths[raised[0]:] if not prefill]
    assert max(decodes_after[:RESTORE_AFTER_STEPS // 2]) == failed // 2  # capped, yet every request completed
    assert max(decodes_after) > failed // 2  # and grown back


def test_a_request_that_runs_out_of_memory_at_the_smallest_step_fails_cleanly_the_rest_complete(llama_pair):
    target, draft = llama_pair
    poison = 127  # only the poisoned prompt holds this token: every prefill forward over it fails
    requests = _requests(3, seed=43)
    for prompt, _ in requests.values():
        prompt[:] = [t % poison for t in prompt]
    reference = run_to_completion(small_engine(target, draft), requests)
    engine = small_engine(target, draft, block_size=4, max_oom_attempts=3)
    raised = _inject_oom(engine, lambda prefill, ids, call: prefill and bool((ids == poison).any()))
    engine.add_request("poison", [5] * 30 + [poison] + [6] * 10, SamplingParams(max_tokens=8, ignore_eos=True))
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs, errors, steps = {rid: [] for rid in requests}, {}, 0
    while engine.has_work:
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                outputs[out.request_id] += out.token_ids
        steps += 1
        assert steps < 2000, "a request that cannot fit looped"
    assert list(errors) == ["poison"] and outputs == reference
    assert_clean(errors["poison"])
    # Halved from 64 prefill tokens to one block of 4 (4 errors), then 3 more at that size.
    assert len(raised) == 4 + 3 and engine.step_cap.num_oom_recoveries == len(raised)
    assert engine.device_fault is None and not engine.scheduler.by_id


def test_a_remote_lanes_oom_comes_back_as_a_recompute_not_an_error(llama_pair):
    """How the decode replica reads a prefill or verify replica that ran out of device memory in its
    smallest retry (deployments/channels/remote.py `lane_error`): LaneOOM, whose rows are recomputed; the output
    is that of an undisturbed run, and the bound holds for remote errors too."""
    from ray.exceptions import RayTaskError

    from deployments.channels.remote import lane_error
    from lanes.engine.backends import LaneOOM
    from tests.test_kv_migration import _losing

    behind_prefill = RayTaskError("prefill", "Traceback ...", LaneOOM("prefill lane")).as_instanceof_cause()
    verify_raised = RayTaskError("verify", "Traceback ...", torch.OutOfMemoryError(OOM_TEXT)).as_instanceof_cause()
    assert isinstance(lane_error(behind_prefill, via_prefill=True), LaneOOM)
    assert isinstance(lane_error(verify_raised), LaneOOM)

    target, draft = llama_pair
    requests = _requests(4)
    reference = run_to_completion(small_engine(target, draft), requests)
    engine = small_engine(target, draft, max_oom_attempts=3)
    _losing(engine, lambda n, batch: ([0], lane_error(verify_raised)) if n in (3, 6) else None)
    assert run_to_completion(engine, requests) == reference
    assert engine.scheduler.num_preemptions == 2

    engine = small_engine(target, draft, max_oom_attempts=2)
    _losing(engine, lambda n, batch: ([r for r, s in enumerate(engine.scheduler.running) if s.request_id == "0"],
                                      LaneOOM("verify lane")))
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    errors = {}
    while engine.has_work:
        errors.update({out.request_id: out.error for out in engine.step() if out.error is not None})
    assert list(errors) == ["0"]
    assert_clean(errors["0"])


def test_no_forward_exceeds_the_step_shape_the_lanes_memory_profile_measures(llama_pair):
    """Activations are bounded by admission: a decode forward carries at most max_num_seqs rows and a
    prefill forward at most idle_prefill_tokens tokens, in the engine and in the prefill lane's
    PromptPrefiller, whatever the burst (the peak the memory profile measures is at these maxima)."""
    from lanes.engine.core import EngineConfig, build_runners
    from lanes.spec import prompt_prefiller
    from lanes.spec.prompt_prefiller import PrefillRequest, PromptPrefiller

    target, draft = llama_pair
    engine = small_engine(target, draft, max_num_seqs=4, idle_prefill_tokens=64, prefill_chunk_tokens=32)
    shapes = []
    _inject_oom(engine, lambda prefill, ids, call: shapes.append((prefill, tuple(ids.shape))) and False)
    prompts = random_prompts(10, VOCAB, 50, 150, seed=44)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    while engine.has_work:
        planned = engine.scheduler.num_prefill_tokens
        engine.step()
        assert engine.scheduler.num_prefill_tokens - planned <= 64  # prompt tokens (padding aside)
    assert 1 < max(rows for prefill, (rows, _) in shapes if not prefill) <= 4

    config = EngineConfig(max_model_len=320, max_num_seqs=8, idle_prefill_tokens=64, prefill_chunk_tokens=32)
    prefiller = PromptPrefiller(*build_runners(config, target.model, draft.model), config.idle_prefill_tokens)
    tokens = []  # prompt tokens of each prefill forward the lane plans
    plan = prompt_prefiller.plan_whole_prompts

    def planned(seqs, budget):
        chunks = plan(seqs, budget)
        tokens.append(sum(c.length for c in chunks))
        return chunks

    prompt_prefiller.plan_whole_prompts = planned
    try:
        prefiller.prefill([PrefillRequest(str(i), p, SamplingParams(max_tokens=1), i) for i, p in enumerate(prompts[:8])])
    finally:
        prompt_prefiller.plan_whole_prompts = plan
    assert tokens and max(tokens) <= 64
