"""KV hand-over into and out of a tensor-parallel lane (lanes/parallel/kv_handover.py), on the CPU over gloo.

A prefill lane whose target is sharded over two ranks gathers each prompt's KV from both ranks' heads:
it equals the KV an unsharded prefill lane computes for the same prompts (float64: the all-reduce adds
partial products in another order, far below any tolerance that matters), and the first tokens are
the same. Written into a sharded pool, a whole KV lands head by head on the rank that owns those heads:
rank 0 keeps its own half, and reading the slot back gathers the KV that was written. Prompts prefilled
from the lane's prefix cache hand over the same KV as an unsharded lane's.
"""

import torch

from lanes.engine.core import EngineConfig, build_runners
from lanes.kv.pool import KVPool
from lanes.model.loader import build_random_model
from lanes.parallel.worker import worker_processes
from lanes.sample.params import SamplingParams
from lanes.spec.prompt_prefiller import PrefillRequest, PromptPrefiller
from tests.conftest import ARCH_CONFIGS, VOCAB, perturbed_copy
from tests.engine_helpers import random_prompts

CONFIG = EngineConfig(max_model_len=128, max_num_seqs=8, prefill_chunk_tokens=32, num_kv_blocks=64)


def _models():
    target = build_random_model(ARCH_CONFIGS["llama"], dtype="float64", seed=1)
    return target, perturbed_copy(target, 0.1, seed=2)


def _load():
    """The worker's models: the target (sharded); the draft runs whole on rank 0."""
    target, _ = _models()
    return CONFIG, [target.model, None], (True, False)


_PREFIX = random_prompts(1, VOCAB, 40, 40, seed=6)[0]  # two full blocks and a half


def _requests() -> list[PrefillRequest]:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    return [PrefillRequest(f"r{i}", p, params, 0) for i, p in enumerate(random_prompts(5, VOCAB, 1, 70, seed=5))]


def _sharing_a_prefix() -> list[list[PrefillRequest]]:
    """Two batches whose prompts start with `_PREFIX`: the second's are prefilled from the cache."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    return [[PrefillRequest("p0", _PREFIX + [3, 4, 5], params, 0)],
            [PrefillRequest("p1", _PREFIX + [9], params, 0), PrefillRequest("p2", _PREFIX[:35] + [1, 2], params, 0)]]


def test_a_tp2_prefill_lane_hands_over_the_kv_of_an_unsharded_one_and_takes_kv_back_per_shard():
    target, draft = _models()
    whole = PromptPrefiller(*build_runners(CONFIG, target.model, draft.model), CONFIG.prefill_chunk_tokens,
                            prefix_caching=False).prefill(_requests())
    with worker_processes(2, _load) as tp:
        target, draft = _models()
        runners = build_runners(CONFIG, target.model, draft.model, tp=tp, sharded=(True, False))
        sharded = PromptPrefiller(*runners, CONFIG.prefill_chunk_tokens, prefix_caching=False).prefill(_requests())
        for a, b in zip(whole, sharded):
            assert a.first_token == b.first_token
            assert a.target_kv.shape == b.target_kv.shape
            torch.testing.assert_close(b.target_kv, a.target_kv, rtol=0, atol=1e-9)
            assert torch.equal(b.draft_kv, a.draft_kv)  # the draft is not sharded: the same computation

        pool = runners[0].pool
        heads = pool.shape.num_kv_heads  # rank 0's: half the model's
        assert heads * 2 == whole[0].target_kv.shape[2]
        for kv in (whole[1].target_kv, whole[3].target_kv):
            slot = pool.allocate()
            pool.write_slot(slot, kv)
            blocks = pool.slot_blocks(slot)
            assert torch.equal(KVPool.read_blocks(pool, blocks, kv.shape[3]), kv[:, :, :heads])  # rank 0's own
            assert torch.equal(pool.read_slot(slot), kv)  # and the worker's, gathered back


def test_a_tp2_prefill_lane_hands_over_prefix_cached_kv_as_an_unsharded_one_does():
    target, draft = _models()
    whole_lane = PromptPrefiller(*build_runners(CONFIG, target.model, draft.model), CONFIG.prefill_chunk_tokens)
    whole = [kv for batch in _sharing_a_prefix() for kv in whole_lane.prefill(batch)]
    with worker_processes(2, _load) as tp:
        target, draft = _models()
        lane = PromptPrefiller(*build_runners(CONFIG, target.model, draft.model, tp=tp, sharded=(True, False)),
                               CONFIG.prefill_chunk_tokens)
        sharded = [kv for batch in _sharing_a_prefix() for kv in lane.prefill(batch)]
    assert [kv.num_cached_tokens for kv in sharded] == [kv.num_cached_tokens for kv in whole] == [0, 32, 32]
    for a, b in zip(whole, sharded):
        assert a.first_token == b.first_token
        torch.testing.assert_close(b.target_kv, a.target_kv, rtol=0, atol=1e-9)
