"""A request whose verify replica leaves or dies is recomputed elsewhere (issue 18, item 1): the
engine side, on CPU without Serve, and how the decode replica reads the failures it gets.

The verify results are those of the engine's own verify lane, with the rows of chosen calls
replaced by the failure a decode replica sees when their replica is gone (deployments/channels/remote.py
`merge_rows`). Those requests are recomputed and their output equals an undisturbed run's, greedy
and seeded sampling; a request lost more than `max_migrations` times fails alone, and so does one
that no replica takes back within `recover_within_s` of its loss.
"""

import time

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from deployments.channels.remote import lane_error, merge_rows
from deployments.routing.leases import LeaseGone
from lanes.engine.backends import KVLost
from lanes.kv.pool import PoolFullError
from lanes.sample.params import SamplingParams
from lanes.spec.verify import VerifyResult
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine


class _Lost:
    """A launched verify call whose rows `lost` came back as `error`; the other rows keep their result."""

    def __init__(self, pending, lost: list[int], error: BaseException):
        self.pending, self.lost, self.error = pending, lost, error

    def result(self) -> VerifyResult:
        real = self.pending.result()
        kept = [r for r in range(len(real.tokens)) if r not in self.lost]
        part = VerifyResult([real.tokens[r] for r in kept], [real.num_accepted[r] for r in kept])
        return merge_rows(len(real.tokens), [(kept, part), (self.lost, self.error)])


def _losing(engine, lose):
    """Make the engine's verifier lose rows: `lose(call number, batch)` -> (rows, error) or None."""
    real_launch, calls = engine.verifier.launch, []

    def launch(batch):
        calls.append(batch)
        pending = real_launch(batch)
        lost = lose(len(calls), batch)
        return pending if lost is None else _Lost(pending, *lost)

    engine.verifier.launch = launch


def _run_with_errors(engine, requests) -> tuple[dict[str, list[int]], dict[str, str]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs, errors = {rid: [] for rid in requests}, {}
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    return outputs, errors


def _no_leaks(engine) -> None:
    for pool in (engine.verifier.lane.pool, engine.draft.pool):
        assert pool.num_free == pool.shape.num_slots and pool.num_free_blocks == pool.shape.num_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_a_lost_verify_replica_are_recomputed_and_output_is_unchanged(llama_pair, temperature):
    target, draft = llama_pair
    prompts = random_prompts(4, VOCAB, 5, 30, seed=181)
    requests = {str(i): (p, SamplingParams(max_tokens=20, temperature=temperature, seed=7 + i, ignore_eos=True))
                for i, p in enumerate(prompts)}
    undisturbed = run_to_completion(small_engine(target, draft, block_size=4), requests)
    engine = small_engine(target, draft, block_size=4)
    # Call 3: every row's replica was scaled down (the router no longer lists it); call 5: the first
    # two rows' replica died during the call.
    gone = {3: (None, LeaseGone("verify replica a is gone")), 5: ([0, 1], ActorDiedError())}
    _losing(engine, lambda n, batch: None if n not in gone else
            (gone[n][0] or list(range(len(batch.target_slots))), gone[n][1]))
    outputs = run_to_completion(engine, requests)
    assert outputs == undisturbed
    if temperature == 0:
        assert all(outputs[str(i)] == hf_greedy(target, p, 20) for i, p in enumerate(prompts))
    assert engine.num_migrations >= 6
    _no_leaks(engine)


def test_a_request_lost_more_than_max_migrations_times_fails_alone(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(3, VOCAB, 5, 30, seed=182)
    requests = {str(i): (p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)}
    engine = small_engine(target, draft, block_size=4, max_migrations=2)

    def lose_request_0(n, batch):  # a request whose every verify replica dies under it
        rows = [r for r in range(len(batch.target_slots)) if engine.scheduler.running[r].request_id == "0"]
        return (rows, ActorDiedError()) if rows else None

    _losing(engine, lose_request_0)
    outputs, errors = _run_with_errors(engine, requests)
    assert list(errors) == ["0"] and "KVLost" in errors["0"], errors
    assert engine.num_migrations == 2
    for i in (1, 2):
        assert outputs[str(i)] == hf_greedy(target, prompts[i], 20)
    _no_leaks(engine)


def test_what_a_decode_replica_reads_from_a_failed_call():
    # Straight from the verify lane: its router no longer lists the replica, or it died mid-call.
    assert isinstance(lane_error(LeaseGone("gone")), KVLost)
    assert isinstance(lane_error(ActorDiedError()), KVLost)
    # Raised in a verify replica (wrapped by Ray): out of blocks is requeued, anything else fails.
    wrapped_full = RayTaskError("verify", "tb", PoolFullError("no free KV blocks")).as_instanceof_cause()
    assert isinstance(lane_error(wrapped_full), PoolFullError)
    assert isinstance(lane_error(TimeoutError("slow")), TimeoutError)
    # Through the prefill lane: a verify replica gone behind it is a loss; the prefill replica's own
    # death is not (its requests fail, as before).
    behind = RayTaskError("prefill", "tb", LeaseGone("verify replica b is gone")).as_instanceof_cause()
    assert isinstance(lane_error(behind, via_prefill=True), KVLost)
    died_behind = RayTaskError("prefill", "tb", ActorDiedError()).as_instanceof_cause()
    assert isinstance(lane_error(died_behind, via_prefill=True), KVLost)
    assert isinstance(lane_error(ActorDiedError(), via_prefill=True), ActorDiedError)


def _holding_back(engine, request_id: str) -> None:
    """Make the prefill lane keep `request_id` and never answer for it, as a verify lane with no replica
    left does: it is never taken back."""
    real_step = engine.prefiller.step

    def step(scheduler, budget_tokens, decoding):
        held = [s for s in scheduler.prefilling if s.request_id == request_id]
        for seq in held:
            scheduler.prefilling.remove(seq)
        try:
            return real_step(scheduler, budget_tokens, decoding)
        finally:
            scheduler.prefilling[:0] = held

    engine.prefiller.step = step


def test_a_lost_request_no_replica_takes_back_fails_after_recover_within_s_and_the_rest_finish(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(3, VOCAB, 5, 30, seed=183)
    requests = {str(i): (p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)}
    engine = small_engine(target, draft, block_size=4, recover_within_s=0.3)

    def lose_request_0_once(n, batch):  # its verify replica dies at the third call, and none takes it back
        rows = [r for r in range(len(batch.target_slots)) if engine.scheduler.running[r].request_id == "0"]
        if n != 3 or not rows:
            return None
        _holding_back(engine, "0")
        return rows, ActorDiedError()

    _losing(engine, lose_request_0_once)
    start_s = time.monotonic()
    outputs, errors = _run_with_errors(engine, requests)
    assert list(errors) == ["0"] and "no replica took it back within 0.3 s" in errors["0"], errors
    assert time.monotonic() - start_s >= 0.3
    assert engine.num_migrations == 1
    for i in (1, 2):
        assert outputs[str(i)] == hf_greedy(target, prompts[i], 20)
    _no_leaks(engine)


def test_a_loss_is_dated_to_the_start_of_the_wait_that_found_it(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(2, VOCAB, 5, 30, seed=184)
    requests = {str(i): (p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)}
    engine = small_engine(target, draft, block_size=4, recover_within_s=8.0)
    # A call that waited 8 s for a silent replica: the request has been without one for the whole
    # window already, so it fails at once rather than wait a further window.
    silent = KVLost.after_waiting("verify replica a did not answer in 8 s", 8.0)
    _losing(engine, lambda n, batch: ([0], silent) if n == 2 else None)
    outputs, errors = _run_with_errors(engine, requests)
    assert len(errors) == 1 and "KVLost" in next(iter(errors.values())), errors
    assert engine.num_migrations == 0
    _no_leaks(engine)
    # A loss found at once (waited_s 0) within the window is recomputed, and its output is unchanged.
    engine = small_engine(target, draft, block_size=4, recover_within_s=8.0)
    _losing(engine, lambda n, batch: ([0], KVLost("verify replica a is gone")) if n == 2 else None)
    outputs, errors = _run_with_errors(engine, requests)
    assert not errors and engine.num_migrations == 1
    assert all(outputs[str(i)] == hf_greedy(target, p, 20) for i, p in enumerate(prompts))
    _no_leaks(engine)
