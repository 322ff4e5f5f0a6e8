"""The in-place pool attention kernel (Triton, run by its interpreter on CPU: conftest sets
TRITON_INTERPRET) and the gather path, both over paged blocks in a shuffled order, against dense
attention; and the engine's greedy equality with the kernel in the loop."""

import pytest
import torch

from lanes.model.attention import PoolAttentionMeta, _gathered_attention
from lanes.model.triton_attention import merge_step, pool_attention, split_count
from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine
from tests.paged_helpers import dense_attention, paginate


def _gathered(query, k_dense, v_dense, slots, kv_lens, scale, block_size, window=None, softcap=None, masked=True):
    """The gather path over a paged copy of the dense slots."""
    k_blocks, table = paginate(k_dense, block_size, seed=1)
    v_blocks, _ = paginate(v_dense, block_size, seed=1)
    q_len = query.shape[2]
    positions = kv_lens[:, None].long() + torch.arange(q_len)
    bound = int(kv_lens.max()) + q_len
    allowed = torch.arange(bound)[None, None, :] <= positions[:, :, None]
    mask = torch.where(allowed, 0.0, float("-inf"))[:, None].to(query.dtype) if masked else None
    meta = PoolAttentionMeta(slots, kv_lens, bound, mask, 1, False, table)
    return _gathered_attention(query, k_blocks, v_blocks, meta, scale, window, softcap)


def _kernel(query, k_dense, v_dense, slots, kv_lens, scale, splits, block_size, window=None, softcap=None):
    k_blocks, table = paginate(k_dense, block_size, seed=2)
    v_blocks, _ = paginate(v_dense, block_size, seed=2)
    return pool_attention(query, k_blocks, v_blocks, table, slots, kv_lens, scale, splits, window, softcap)


@pytest.mark.parametrize(("heads", "kv_heads", "q_len"), [(4, 2, 1), (4, 2, 5), (2, 2, 3), (8, 1, 2)])
# Block sizes: several to a key step of 64 (16, 1), a key step or more to a block (64, 128), neither (3).
@pytest.mark.parametrize(("splits", "block_size"), [(1, 16), (3, 16), (3, 3), (2, 1), (3, 64), (2, 128)])
def test_kernel_and_gather_path_match_dense_attention(heads, kv_heads, q_len, splits, block_size):
    gen = torch.Generator().manual_seed(heads * 10 + q_len)
    slots, capacity, dim = 6, 200, 16
    k_dense = torch.randn(slots, kv_heads, capacity, dim, generator=gen)
    v_dense = torch.randn(slots, kv_heads, capacity, dim, generator=gen)
    slot_ids = torch.tensor([4, 0, 2])
    kv_lens = torch.tensor([0, 37, 190 - q_len], dtype=torch.int32)  # empty, middle, nearly full
    query = torch.randn(3, heads, q_len, dim, generator=gen)
    ref = dense_attention(query, k_dense, v_dense, slot_ids, kv_lens, dim**-0.5)
    out = _kernel(query, k_dense, v_dense, slot_ids, kv_lens, dim**-0.5, splits, block_size)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    gathered = _gathered(query, k_dense, v_dense, slot_ids, kv_lens, dim**-0.5, block_size)
    torch.testing.assert_close(gathered, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("window", "softcap"), [(8, None), (70, None), (None, 2.0), (8, 2.0)])
def test_kernel_sliding_window_and_softcap_match_dense_attention(window, softcap):
    """Sliding windows shorter than one key block and spanning blocks and splits; soft-capped scores."""
    gen = torch.Generator().manual_seed(window or 1)
    k_dense = torch.randn(6, 2, 200, 16, generator=gen)
    v_dense = torch.randn(6, 2, 200, 16, generator=gen)
    slot_ids, kv_lens = torch.tensor([4, 0, 2]), torch.tensor([0, 37, 187], dtype=torch.int32)
    query = torch.randn(3, 4, 3, 16, generator=gen)
    ref = dense_attention(query, k_dense, v_dense, slot_ids, kv_lens, 0.25, window, softcap)
    for block_size in (16, 3):
        out = _kernel(query, k_dense, v_dense, slot_ids, kv_lens, 0.25, 3, block_size, window, softcap)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        gathered = _gathered(query, k_dense, v_dense, slot_ids, kv_lens, 0.25, block_size, window, softcap)
        torch.testing.assert_close(gathered, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_rows_from_position_0_attend_causally_without_a_mask(heads, kv_heads):
    """Whole prompts (every row starts at 0) take the maskless causal path; rows padded past their
    length still match the masked reference on every real token."""
    gen = torch.Generator().manual_seed(heads)
    k_dense = torch.randn(5, kv_heads, 64, 16, generator=gen)
    v_dense = torch.randn(5, kv_heads, 64, 16, generator=gen)
    slot_ids, kv_lens = torch.tensor([3, 1]), torch.zeros(2, dtype=torch.int32)
    query = torch.randn(2, heads, 9, 16, generator=gen)
    causal = _gathered(query, k_dense, v_dense, slot_ids, kv_lens, 0.25, 3, masked=False)
    torch.testing.assert_close(causal, dense_attention(query, k_dense, v_dense, slot_ids, kv_lens, 0.25),
                               rtol=1e-5, atol=1e-5)


def test_merge_over_more_splits_than_it_takes_at_once():
    """40 splits of 16 keys: the merge takes them 16 at a time, and a later step's splits hold larger
    scores than the earlier ones', so what was merged is rescaled; some splits are empty."""
    gen = torch.Generator().manual_seed(3)
    slots, capacity, dim, splits = 3, 640, 16, 40
    assert splits > 2 * merge_step(splits)
    k_dense = torch.randn(slots, 2, capacity, dim, generator=gen)
    k_dense[:, :, 400:] *= 4  # the largest scores sit in later splits
    v_dense = torch.randn(slots, 2, capacity, dim, generator=gen)
    slot_ids, kv_lens = torch.tensor([1, 2]), torch.tensor([600, 90], dtype=torch.int32)
    query = torch.randn(2, 4, 2, dim, generator=gen)
    ref = dense_attention(query, k_dense, v_dense, slot_ids, kv_lens, dim**-0.5)
    k_blocks, table = paginate(k_dense, 16, seed=2)
    v_blocks, _ = paginate(v_dense, 16, seed=2)
    out = pool_attention(query, k_blocks, v_blocks, table, slot_ids, kv_lens, dim**-0.5, splits, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_split_count_fills_the_gpu_and_never_exceeds_the_key_blocks():
    assert split_count(capacity_tokens=2048, batch=1, kv_heads=32, num_sms=132) == 9
    assert split_count(capacity_tokens=2048, batch=64, kv_heads=32, num_sms=132) == 1
    assert split_count(capacity_tokens=100, batch=1, kv_heads=1, num_sms=132) == 2


def test_engine_with_the_kernel_equals_target_greedy(llama_pair):
    target, draft = llama_pair
    # float64 has no Triton dot: run this pair in float32.
    target32 = type(target)(target.model.float(), None, "t32")
    draft32 = type(draft)(draft.model.float(), None, "d32")
    try:
        prompts = random_prompts(3, VOCAB, 2, 40, seed=13)
        engine = small_engine(target32, draft32, attention_kernel=True, num_speculative_tokens=3)
        outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=10, ignore_eos=True))
                                             for i, p in enumerate(prompts)})
        for i, p in enumerate(prompts):
            assert outputs[str(i)] == hf_greedy(target32, p, 10)
        assert engine.total_stats.num_accepted_tokens > 0
    finally:
        target.model.double()
        draft.model.double()


def test_head_dims_the_kernel_cannot_take_fall_back_to_the_gathered_path():
    from lanes.model.triton_attention import head_dim_supported

    assert head_dim_supported(16) and head_dim_supported(128)
    assert not head_dim_supported(8) and not head_dim_supported(80) and not head_dim_supported(96)
