"""The prefill lane's prompt prefiller: whole prompts per forward, and the KV and first token it
hands out are those of each prompt run on its own."""

import torch

from lanes.engine.core import EngineConfig, build_runner
from lanes.engine.sequence import Sequence
from lanes.sample.params import SamplingParams
from lanes.spec.prefill import plan_whole_prompts
from lanes.spec.prompt_prefiller import PrefillRequest, PromptPrefiller
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts


def _seq(name: str, length: int, prefilled: int = 0) -> Sequence:
    seq = Sequence(name, list(range(1, length + 1)), SamplingParams(), 0, 0)
    seq.num_prefilled = prefilled
    return seq


def test_whole_prompts_first_fit_within_the_padded_budget_and_only_a_prompt_over_it_is_split():
    a, b, long, c = _seq("a", 50), _seq("b", 30), _seq("long", 200), _seq("c", 20)
    plan = plan_whole_prompts([a, b, long, c], 100)
    # Rows are padded to the widest: a and b make 2 x 50 padded tokens, c would make 3 x 50 > 100.
    assert [(ch.seq.request_id, ch.start, ch.length) for ch in plan] == [("a", 0, 50), ("b", 0, 30)]
    assert [ch.seq.request_id for ch in plan_whole_prompts([c, b, a], 100)] == ["c", "b"]  # 2 x 30, then 3 x 50
    assert [(ch.seq.request_id, ch.start, ch.length) for ch in plan_whole_prompts([long, c], 100)] == [("long", 0, 100)]
    long.num_prefilled = 100
    # A continuing prompt runs alone: its rows do not start at 0, so its forward needs the mask.
    assert [(ch.seq.request_id, ch.start) for ch in plan_whole_prompts([c, long], 100)] == [("c", 0)]
    assert [(ch.seq.request_id, ch.start, ch.length) for ch in plan_whole_prompts([long], 100)] == [("long", 100, 100)]


def test_batched_prefill_hands_out_what_each_prompt_gets_alone(llama_pair):
    target, draft = llama_pair
    config = EngineConfig(max_model_len=320, max_num_seqs=4, num_speculative_tokens=4, max_draft_len=8,
                          prefill_chunk_tokens=64, idle_prefill_tokens=64)
    prefiller = PromptPrefiller(build_runner(target.model, config), build_runner(draft.model, config), 64)
    # 100 tokens exceed the 64-token budget: split, its second chunk through the masked path.
    prompts = [random_prompts(1, VOCAB, n, n, seed=n)[0] for n in (40, 100, 7, 20)]

    def requests(ps):
        return [PrefillRequest(str(i), p, SamplingParams(), 0) for i, p in enumerate(ps)]

    together = prefiller.prefill(requests(prompts))
    for prompt, got in zip(prompts, together):
        alone = prefiller.prefill(requests([prompt]))[0]
        assert got.first_token == alone.first_token == hf_greedy(target, prompt, 1)[0]
        assert got.target_kv.shape[3] == got.draft_kv.shape[3] == len(prompt)
        torch.testing.assert_close(got.target_kv, alone.target_kv, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.draft_kv, alone.draft_kv, rtol=1e-4, atol=1e-5)
    # Views of the scratch slots, held until released: then the slots are free for the next batch.
    free = prefiller.target.pool.num_free, prefiller.draft.pool.num_free
    views, release = prefiller.prefill_in_scratch(requests(prompts[:2]))
    assert (prefiller.target.pool.num_free, prefiller.draft.pool.num_free) == (free[0] - 2, free[1] - 2)
    torch.testing.assert_close(views[1].target_kv, together[1].target_kv, rtol=1e-4, atol=1e-5)
    release()
    assert (prefiller.target.pool.num_free, prefiller.draft.pool.num_free) == free


def test_chunks_keep_the_padded_forward_within_the_budget():
    from lanes.spec.prefill import plan_chunks

    a, b, c = _seq("a", 300), _seq("b", 40), _seq("c", 40)
    plan = plan_chunks([a, b, c], 256)
    # a is cut to 256; no second row fits beside it (2 x 256 > 256).
    assert [(ch.seq.request_id, ch.start, ch.length) for ch in plan] == [("a", 0, 256)]
    plan = plan_chunks([b, c, a], 256)
    # 40, 40, then a is cut to 256 // 3 = 85: 3 x 85 <= 256.
    assert [(ch.seq.request_id, ch.length) for ch in plan] == [("b", 40), ("c", 40), ("a", 85)]
    assert len(plan) * max(ch.length for ch in plan) <= 256
