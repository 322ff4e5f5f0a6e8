"""Paged KV pools in the co-located engine: greedy equality with HF across block sizes, every block's
KV after every step, preemption by recompute when blocks run out, and no block leaks."""

import numpy as np
import pytest
import torch

from lanes.kv.pool import KVPool, PoolFullError, PoolShape
from lanes.sample.params import SamplingParams
from lanes.spec.draft import CATCH_UP_FORWARDS
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine


def _pools(engine):
    return [engine.verifier.lane.pool] + ([engine.draft.pool] if engine.draft is not None else [])


def _reference_keys(model, token_ids: list[int]) -> torch.Tensor:
    """Keys of a fresh HF forward over `token_ids`: [layers, kv_heads, n, D]."""
    with torch.inference_mode():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return torch.stack([layer.keys[0] for layer in cache.layers])


def _assert_no_leaks(engine) -> None:
    for pool in _pools(engine):
        assert pool.num_free == pool.shape.num_slots
        assert pool.num_free_blocks == pool.shape.num_blocks
        assert (pool.num_held == 0).all() and (pool.block_table == pool.pad_block).all()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_greedy_equals_hf_with_blocks_crossed_mid_draft_and_mid_rollback(llama_pair, block_size):
    target, draft = llama_pair
    prompts = random_prompts(4, VOCAB, 2, 45, seed=31)
    engine = small_engine(target, draft, num_speculative_tokens=5, block_size=block_size)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=24, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 24)
    stats = engine.total_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were rolled back
    _assert_no_leaks(engine)


@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("ahead", [False, True], ids=["host_first", "async_scheduling"])
def test_every_block_holds_the_committed_kv_after_every_step(llama_pair, block_size, ahead):
    """Each slot holds the blocks its length needs and at most those of one draft more (rollback keeps
    the blocks the next step writes again), or two where a step was launched ahead of the one before it
    (async scheduling reserves for the longest acceptance), and the KV read through its block table
    equals a fresh forward over the committed tokens."""
    target, draft = llama_pair
    engine = small_engine(target, draft, num_speculative_tokens=4, block_size=block_size, async_scheduling=ahead)
    for i, p in enumerate(random_prompts(3, VOCAB, 5, 30, seed=12)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True))
    checked = 0
    while engine.has_work:
        engine.step()
        for seq in engine.scheduler.running:
            for runner, slot in ((engine.verifier.lane.runner, seq.target_slot), (engine.draft, seq.draft_slot)):
                pool = runner.pool
                n = int(pool.lengths[slot])
                slack = 4 + 1 + (4 if engine.num_steps_ahead else 0)
                assert -(-n // block_size) <= pool.num_held[slot] <= -(-(n + slack) // block_size)
                assert len(set(pool.slot_blocks(slot))) == pool.num_held[slot]
                torch.testing.assert_close(pool.read_slot(slot)[0], _reference_keys(runner.model, seq.token_ids[:n]),
                                           rtol=1e-9, atol=1e-9)
                checked += 1
        # No block is held twice across slots.
        for pool in _pools(engine):
            held = np.concatenate([pool.slot_blocks(s) for s in range(pool.shape.num_slots)] + [[]]).astype(int)
            assert len(held) == len(set(held.tolist())) == pool.shape.num_blocks - pool.num_free_blocks
    assert checked > 0 and (engine.num_steps_ahead > 0) == ahead
    _assert_no_leaks(engine)


def test_preemption_under_block_exhaustion_completes_every_request_identically(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(6, VOCAB, 20, 40, seed=5)
    requests = {str(i): (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    unconstrained = run_to_completion(small_engine(target, draft, num_speculative_tokens=4, block_size=4), requests)
    # A 100-token context needs 41 blocks of 4 (with the draft slack); these requests grow to 15-20
    # blocks each: 50 blocks hold two or three of them at once.
    tight = small_engine(target, draft, num_speculative_tokens=4, block_size=4, num_kv_blocks=50, max_model_len=100)
    outputs = run_to_completion(tight, requests)
    assert outputs == unconstrained
    assert tight.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts[:2]):
        assert outputs[str(i)] == hf_greedy(target, p, 40)
    _assert_no_leaks(tight)


def test_preemption_in_nospec_mode_and_under_sampling_keeps_outputs(llama_pair):
    """Seeded sampling draws by absolute position: a preempted request recomputed continues the same stream."""
    target, draft = llama_pair
    prompts = random_prompts(5, VOCAB, 20, 40, seed=6)
    requests = {str(i): (p, SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)}
    for d in (None, draft):
        free = run_to_completion(small_engine(target, d, block_size=8), requests)
        tight = small_engine(target, d, block_size=8, num_kv_blocks=24, max_model_len=100)
        assert run_to_completion(tight, requests) == free
        assert tight.scheduler.num_preemptions > 0
        _assert_no_leaks(tight)


def test_admission_waits_for_blocks_and_max_num_seqs_caps_running(llama_pair):
    target, draft = llama_pair
    engine = small_engine(target, draft, block_size=16, num_kv_blocks=30, max_num_seqs=3)
    for i, p in enumerate(random_prompts(6, VOCAB, 100, 120, seed=3)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.scheduler.admit()
    # 8 blocks per prompt, a block of headroom per admitted one: 3 fit in 30 blocks; the cap is 3 anyway.
    assert engine.scheduler.num_admitted == 3
    while engine.has_work:
        engine.step()
        assert engine.scheduler.num_admitted <= 3
    _assert_no_leaks(engine)


def test_no_block_leaks_after_aborted_and_failed_requests(llama_pair):
    target, draft = llama_pair
    engine = small_engine(target, draft, block_size=3, num_speculative_tokens=3)
    prompts = random_prompts(6, VOCAB, 5, 60, seed=8)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, ignore_eos=True))
    real_launch, calls = engine.verifier.lane.launch, []

    def flaky(batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected verify failure")
        return real_launch(batch)

    engine.verifier.lane.launch = flaky
    step = 0
    while engine.has_work:
        if step == 2:
            engine.abort("0")  # running or prefilling
        if step == 3:
            engine.abort(next(iter(engine.scheduler.by_id)))
        engine.step()
        step += 1
    _assert_no_leaks(engine)


def test_pool_reserve_is_all_or_nothing_and_hand_over_round_trips():
    shape = PoolShape(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=3, capacity_tokens=20, block_size=3,
                      num_blocks=9)
    pool = KVPool(shape, torch.float32, "cpu")
    a, b = pool.allocate(), pool.allocate()
    pool.reserve([a], [20])  # 7 blocks
    with pytest.raises(PoolFullError):
        pool.reserve([b, a], [9, 20])  # 3 more wanted, 2 free
    assert pool.num_free_blocks == 2 and pool.num_held[b] == 0
    kv = torch.randn(2, 2, 2, 5, 4)
    pool.free(a)
    pool.write_slot(b, kv)
    assert pool.num_held[b] == 2
    torch.testing.assert_close(pool.read_slot(b), kv)
    pool.sync_block_table()
    assert torch.equal(pool.block_table_device, torch.from_numpy(pool.block_table))


# ---- prefix caching ------------------------------------------------------------------------

def _finish_one(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Run one request alone; its output and the prompt tokens the prefix cache held for it."""
    engine.add_request(request_id, prompt, params)
    tokens, cached = [], None
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_a_prefix_hit_gives_the_output_of_a_miss(llama_pair, block_size):
    target, draft = llama_pair
    system = random_prompts(1, VOCAB, 40, 40, seed=41)[0]
    tails = random_prompts(3, VOCAB, 1, 9, seed=42)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cached = small_engine(target, draft, block_size=block_size, num_speculative_tokens=3)
    uncached = small_engine(target, draft, block_size=block_size, num_speculative_tokens=3,
                            enable_prefix_caching=False)
    hits = []
    for i, tail in enumerate(tails + [[]]):  # the last: the system prompt alone, every block of it cached
        prompt = system + tail
        got, hit = _finish_one(cached, str(i), prompt, params)
        want, miss = _finish_one(uncached, str(i), prompt, params)
        assert got == want == hf_greedy(target, prompt, 12) and miss == 0
        hits.append(hit)
    # The first request found nothing; the others its full blocks of the shared prefix, never the
    # prompt's last token (recomputed for its logits).
    assert hits[0] == 0
    assert all(hit == (min(len(system), len(system + t) - 1) // block_size) * block_size
               for hit, t in zip(hits[1:], tails[1:] + [[]]))
    cache = cached.scheduler.prefix_cache
    assert cache.num_hits == sum(hits) and cache.num_queries == sum(len(system + t) for t in tails + [[]])
    _assert_no_leaks(cached)


def test_prefix_hits_while_the_owner_still_runs_and_under_preemption(llama_pair):
    """Requests sharing a prompt run together (blocks shared by several holders) in a pool small enough
    to preempt: outputs equal those of an engine without caching, and nothing leaks."""
    target, draft = llama_pair
    system = random_prompts(1, VOCAB, 30, 30, seed=43)[0]
    prompts = [system + t for t in random_prompts(6, VOCAB, 2, 10, seed=44)]
    requests = {str(i): (p, SamplingParams(max_tokens=50, ignore_eos=True)) for i, p in enumerate(prompts)}
    want = run_to_completion(small_engine(target, draft, block_size=4, enable_prefix_caching=False), requests)
    # 41 blocks of 4: one 100-token context (with the draft slack); these requests grow to 21-23 blocks.
    tight = small_engine(target, draft, block_size=4, num_kv_blocks=41, max_model_len=100, prefill_chunk_tokens=8,
                         idle_prefill_tokens=8)
    assert run_to_completion(tight, requests) == want
    assert tight.scheduler.prefix_cache.num_hits > 0 and tight.scheduler.num_preemptions > 0
    _assert_no_leaks(tight)


def test_speculation_off_writes_no_draft_kv_and_a_later_request_catches_up_on_a_cached_prefix(llama_pair):
    """With L = 0 the engine's prefill writes no draft KV (a request costs what it would without a
    draft model), and its target blocks still serve the prefix cache. With L back on, a request on that
    prefix finds it in the target pool, not in the draft's; the draft's catch-up writes the rest, and
    every output equals HF's greedy."""
    target, draft = llama_pair
    system = random_prompts(1, VOCAB, 40, 40, seed=45)[0]
    tails = random_prompts(2, VOCAB, 3, 9, seed=46)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = small_engine(target, draft, block_size=4, num_speculative_tokens=0)
    engine.add_request("off", system + tails[0], params)
    off = []
    while engine.has_work:
        for out in engine.step():
            off += out.token_ids
        assert all(engine.draft.pool.lengths[s.draft_slot] == 0 for s in engine.scheduler.running)
    engine.set_draft_lengths(3)
    on, hit = _finish_one(engine, "on", system + tails[1], params)
    assert off == hf_greedy(target, system + tails[0], 16) and on == hf_greedy(target, system + tails[1], 16)
    assert hit == len(system)  # every block of the shared prefix, from the target pool alone
    assert engine.total_stats.num_draft_tokens > 0
    _assert_no_leaks(engine)


def test_one_prefill_forward_writes_draft_kv_only_for_the_rows_that_draft(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(3, VOCAB, 9, 20, seed=47)
    engine = small_engine(target, draft, num_speculative_tokens=3, prefill_chunk_tokens=64)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.set_draft_lengths(3, {"1": 0})  # before their prefill, which takes the three in one forward
    by_id, drafted = {}, {}
    while engine.has_work:
        for out in engine.step():
            by_id.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                drafted[out.request_id] = out.stats.num_drafts
        for seq in engine.scheduler.running:
            assert (engine.draft.pool.lengths[seq.draft_slot] == 0) == (seq.request_id == "1")
    assert all(by_id[str(i)] == hf_greedy(target, p, 20) for i, p in enumerate(prompts))
    assert drafted["1"] == 0 and drafted["0"] > 0 and drafted["2"] > 0


def test_a_draft_cache_a_whole_prompt_behind_catches_up_over_several_steps(llama_pair, monkeypatch):
    """A prompt prefilled at L = 0 leaves the draft cache a whole prompt behind: once L is back, each step
    runs at most CATCH_UP_FORWARDS catch-up forwards (the row drafts nothing until it is within two
    tokens), so no one step is held for the whole prompt; the output is HF's greedy."""
    target, draft = llama_pair
    prompt = random_prompts(1, VOCAB, 250, 250, seed=48)[0]
    engine = small_engine(target, draft, num_speculative_tokens=0, idle_prefill_tokens=256)
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    out = []
    while not engine.scheduler.running:
        out += [t for o in engine.step() for t in o.token_ids]
    engine.set_draft_lengths(3)
    forward, catch_ups = engine.draft.forward, []

    def counted(*args, **kwargs):
        catch_ups[-1] += bool(kwargs.get("prefill"))  # catch-up forwards; drafting's are not prefill
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.draft, "forward", counted)
    while engine.has_work:
        catch_ups.append(0)
        out += [t for o in engine.step() for t in o.token_ids]
    assert max(catch_ups) == CATCH_UP_FORWARDS and sum(catch_ups) == 4  # ~250 tokens, 64 a forward
    assert out == hf_greedy(target, prompt, 30) and engine.total_stats.num_draft_tokens > 0


def test_eviction_takes_plain_blocks_first_then_the_least_recently_used_and_never_a_held_one():
    from lanes.kv.block_allocator import BlockAllocator

    alloc = BlockAllocator(4)
    a, b, c, d = alloc.allocate(4)
    alloc.register(a, b"ka")
    alloc.register(b, b"kb")
    alloc.release([b, a, c])  # b cached first, then a; c holds nothing worth keeping
    assert alloc.num_free == 3 and alloc.lookup(b"ka") == a
    alloc.share(a)  # a cache hit: a is held again, out of the eviction queue
    assert alloc.allocate(1) == [c]  # plain blocks go first
    assert alloc.allocate(1) == [b] and alloc.lookup(b"kb") is None  # then the least recently used cached one
    with pytest.raises(PoolFullError):
        alloc.allocate(1)  # a and d are held: never evicted
    assert alloc.lookup(b"ka") == a
    alloc.release([a, a] if alloc.refcount[a] == 2 else [a])
    assert alloc.refcount[a] == 0 and alloc.allocate(1) == [a] and alloc.lookup(b"ka") is None


def test_prompt_prefiller_prefix_hit_hands_out_the_kv_of_a_miss(llama_pair):
    from lanes.engine.core import EngineConfig, build_runners
    from lanes.spec.prompt_prefiller import PrefillRequest, PromptPrefiller

    target, draft = llama_pair
    config = EngineConfig(max_model_len=200, max_num_seqs=4, block_size=4)
    cached = PromptPrefiller(*build_runners(config, target.model, draft.model), 64)
    plain = PromptPrefiller(*build_runners(config, target.model, draft.model), 64, prefix_caching=False)
    system = random_prompts(1, VOCAB, 30, 30, seed=45)[0]
    for i, tail in enumerate(random_prompts(3, VOCAB, 1, 6, seed=46)):
        request = [PrefillRequest(str(i), system + tail, SamplingParams(), 0)]
        got, want = cached.prefill(request)[0], plain.prefill(request)[0]
        assert got.num_cached_tokens == (0 if i == 0 else 28) and want.num_cached_tokens == 0
        assert got.first_token == want.first_token
        torch.testing.assert_close(got.target_kv, want.target_kv, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got.draft_kv, want.draft_kv, rtol=1e-9, atol=1e-9)
    assert cached.target.pool.num_free_blocks == cached.target.pool.shape.num_blocks


def test_a_verify_lane_out_of_blocks_requeues_its_rows_instead_of_failing_them(llama_pair):
    """pdv's verify lane refuses a batch whose blocks it cannot back (PoolFullError, before touching
    its pool): the decode engine preempts those rows and recomputes them, and output is unchanged."""
    from deployments.channels.remote import merge_rows
    from lanes.spec.verify import VerifyResult

    target, draft = llama_pair
    prompts = random_prompts(3, VOCAB, 5, 30, seed=47)
    requests = {str(i): (p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)}
    engine = small_engine(target, draft, block_size=4)
    real_launch, calls = engine.verifier.launch, []

    class Refused:
        def __init__(self, rows: int):
            self.rows = rows

        def result(self) -> VerifyResult:
            return merge_rows(self.rows, [(list(range(self.rows)), PoolFullError("no free KV blocks"))])

    def refusing(batch):
        calls.append(len(batch.target_slots))
        return Refused(len(batch.target_slots)) if len(calls) in (3, 4) else real_launch(batch)

    engine.verifier.launch = refusing
    outputs = run_to_completion(engine, requests)
    assert engine.scheduler.num_preemptions >= 2
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, p, 20)
    _assert_no_leaks(engine)


def test_a_verify_lane_short_of_blocks_picks_the_rows_it_can_back_first_come(llama_pair):
    """VerifyLane.rows_that_fit: every row while the free blocks cover the batch; else, in row order,
    each row whose drafts still fit (a later, smaller row may fit where an earlier one did not)."""
    from lanes.spec.verify import VerifyBatch

    target, draft = llama_pair
    engine = small_engine(target, draft, block_size=4, num_kv_blocks=30, max_model_len=40)
    lane = engine.verifier.lane
    pool = lane.pool
    slots = [pool.allocate() for _ in range(3)]
    for slot in slots:
        pool.reserve([slot], [8])  # 2 blocks each
        pool.lengths[slot] = 8
    pool.reserve([pool.allocate()], [72])  # 18 blocks held elsewhere: 6 of 30 left

    def batch(num_tokens: list[int], num_draft: list[int]) -> VerifyBatch:
        rows = len(num_tokens)
        return VerifyBatch(slots[:rows], num_tokens, [1] * rows, torch.zeros(rows, max(num_draft), dtype=torch.long),
                           None, num_draft, [SamplingParams()] * rows, [0] * rows)

    assert lane.rows_that_fit(batch([9, 9, 9], [3, 3, 3])) == [0, 1, 2]  # 12 tokens: 1 more block each
    # Rows want 4 + 1 + 2 more blocks against 6 free: the first two fit, the third does not.
    assert lane.rows_that_fit(batch([9, 9, 9], [15, 3, 7])) == [0, 1]
    assert lane.rows_that_fit(batch([9, 9, 9], [27, 3, 3])) == [1, 2]  # the first wants 7
    assert pool.num_free_blocks == 6  # it only counts; launch reserves
