"""Verify calls from several decode replicas merge into one batch and split back per caller; a decode
replica's batch splits by verify replica (lease) and its results merge back in row order. A verify
replica that does not answer in time costs the request a recompute, not a failure."""

import asyncio
import types

import pytest
import torch

from deployments.channels.remote import PrefillDone, PrefillJob, RemoteVerifier, merge_rows
from deployments.placement.kv_transfer import HostKV, PoolViews
from deployments.replicas import prefill_replica
from deployments.replicas.verify_replica import merge_batches, split_result
from deployments.telemetry.slo_signals import LatencyWindow
from lanes.engine.backends import KVLost
from lanes.sample.params import SamplingParams
from lanes.spec.prompt_prefiller import PrefillRequest
from lanes.spec.verify import VerifyBatch, VerifyResult


def _batch(rows: int, width: int, greedy: bool, vocab: int = 11) -> VerifyBatch:
    tokens = torch.randint(0, vocab, (rows, width))
    probs = None if greedy else torch.softmax(torch.randn(rows, width, vocab), -1)
    params = [SamplingParams(temperature=0 if greedy else 1.0)] * rows
    return VerifyBatch(list(range(rows)), [5] * rows, [1] * rows, tokens, probs, [width] * rows, params, [0] * rows)


def test_merge_pads_drafts_and_makes_greedy_rows_one_hot():
    greedy, sampled = _batch(2, 3, True), _batch(3, 5, False)
    merged = merge_batches([greedy, sampled])
    assert merged.draft_tokens.shape == (5, 5) and merged.draft_probs.shape == (5, 5, 11)
    assert torch.equal(merged.draft_probs[:2, :3], torch.nn.functional.one_hot(greedy.draft_tokens, 11).float())
    assert torch.equal(merged.draft_probs[2:], sampled.draft_probs)
    assert merged.num_draft == [3, 3, 5, 5, 5]


def test_all_greedy_batches_merge_without_probabilities():
    assert merge_batches([_batch(2, 3, True), _batch(1, 2, True)]).draft_probs is None


def test_split_returns_each_caller_its_rows():
    result = VerifyResult([[1], [2, 3], [4], [5, 6, 7]], [0, 1, 0, 2])
    first, second = split_result(result, [1, 3])
    assert first.tokens == [[1]] and second.tokens == [[2, 3], [4], [5, 6, 7]] and second.num_accepted == [1, 0, 2]


def test_select_takes_rows_in_the_order_asked():
    batch = _batch(4, 3, False)
    batch.target_leases = ["a", "b", "a", "c"]
    part = batch.select([2, 0])
    assert part.target_slots == [2, 0] and part.target_leases == ["a", "a"] and part.num_draft == [3, 3]
    assert torch.equal(part.draft_tokens, batch.draft_tokens[[2, 0]])
    assert torch.equal(part.draft_probs, batch.draft_probs[[2, 0]])


def test_results_by_lease_merge_back_in_row_order_and_a_failed_lease_fails_its_rows_only():
    parts = [([0, 2], VerifyResult([[1], [3, 4]], [0, 1])), ([1, 4], TimeoutError("gone")),
             ([3], VerifyResult([[7]], [0]))]
    merged = merge_rows(5, parts)
    assert merged.tokens == [[1], [], [3, 4], [7], []] and merged.num_accepted == [0, 0, 1, 0, 0]
    assert merged.errors[0] is merged.errors[2] is merged.errors[3] is None
    assert isinstance(merged.errors[1], TimeoutError) and merged.errors[1] is merged.errors[4]
    assert merged.logprobs is None


def test_merged_rows_without_a_failure_carry_no_errors():
    merged = merge_rows(2, [([1], VerifyResult([[5]], [0])), ([0], VerifyResult([[6, 2]], [1]))])
    assert merged.tokens == [[6, 2], [5]] and merged.errors is None


def test_rows_a_verify_replica_shed_keep_their_errors_through_split_and_merge():
    """A verify replica out of KV blocks verifies the rows that fit and sheds the rest with
    PoolFullError (VerifyServer._forward): each caller's part keeps its rows' errors, and the decode
    replica's merge by lease keeps them too, so it recomputes only those rows."""
    from lanes.kv.pool import PoolFullError

    shed = PoolFullError("no free KV blocks")
    replica = merge_rows(4, [([1, 3], shed), ([0, 2], VerifyResult([[1], [2, 3]], [0, 1]))])
    first, second = split_result(replica, [2, 2])
    assert first.tokens == [[1], []] and first.errors[0] is None and first.errors[1] is shed
    assert second.tokens == [[2, 3], []] and second.errors == [None, shed]
    assert split_result(VerifyResult([[1], [2]], [0, 0]), [1, 1])[0].errors is None

    decode = merge_rows(3, [([2, 0], second), ([1], VerifyResult([[9]], [0]))])
    assert decode.tokens == [[], [9], [2, 3]] and decode.num_accepted == [0, 0, 1]
    assert decode.errors == [shed, None, None]


class _SilentLane:
    """A verify lane whose calls never answer (what a caller sees of a stopping replica whose
    refusals its router keeps retrying)."""

    class _Method:
        def remote(self, *args, **kwargs):
            return asyncio.get_running_loop().create_future()

    verify = _Method()


def test_a_replica_asked_by_name_that_never_answers_is_taken_as_gone():
    # Rows leased to a silent replica are recomputed elsewhere (KVLost); rows that name no replica
    # fail with the timeout as they are.
    batch = _batch(3, 2, True)
    batch.target_leases = ["a", None, "a"]
    verifier = RemoteVerifier(_SilentLane(), loop=None, timeout_s=0.05)
    merged = asyncio.run(verifier.verify(batch))
    assert isinstance(merged.errors[0], KVLost) and merged.errors[0] is merged.errors[2]
    assert isinstance(merged.errors[1], TimeoutError)


class _SlowVerifyLane:
    """A verify lane that takes a prompt's KV only after `late_s` (its worker queued behind forwards)."""

    def __init__(self, late_s: float):
        self.late_s = late_s
        self.released: list[tuple[list[int], str]] = []
        outer = self

        class _Load:
            def remote(self, kv, owner):
                async def load():
                    await asyncio.sleep(outer.late_s)
                    return "lease-a", 7
                return asyncio.ensure_future(load())

        class _Release:
            def remote(self, slots, lease=None):
                outer.released.append((slots, lease))
                return asyncio.sleep(0)

        self.load_kv, self.release = _Load(), _Release()


def test_kv_that_no_verify_replica_takes_in_time_recomputes_the_request_and_frees_the_late_slot(monkeypatch):
    monkeypatch.setattr(prefill_replica, "PEER_CALL_TIMEOUT_S", 0.05)
    server = object.__new__(prefill_replica.PrefillServer)
    server.verify, server.pending, server.metrics = _SlowVerifyLane(late_s=0.3), 0, types.SimpleNamespace(
        set_queue_depth=lambda depth: None)
    server.views, server._views_watch = PoolViews(), None  # its watch for dead owners' pools: none opened here
    server.prompt_time, server.pending_tokens = LatencyWindow(), 0  # what the replica planner reads
    done = PrefillDone(3, None, None, None)
    prefilled = prefill_replica.Prefilled(done, "copied", "none", 4, 0, 0, 0.0, 0.0,
                                          verify_kv=HostKV.from_tensor(torch.zeros(2, 1, 1, 4, 2)))

    async def submit(job):
        return prefilled
    server.batcher = types.SimpleNamespace(submit=submit)
    job = PrefillJob(PrefillRequest("r", [1, 2, 3, 4], SamplingParams(), 0), None, None, None, None)

    async def run():
        with pytest.raises(KVLost, match="no verify replica took"):
            await server.prefill(job)
        await asyncio.sleep(0.5)  # the load answers late: its slot is freed
    asyncio.run(run())
    assert server.verify.released == [([7], "lease-a")]
