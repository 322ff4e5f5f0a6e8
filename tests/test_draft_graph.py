"""A whole draft replayed as one graph (lanes/spec/draft.py, GraphedDraft) drafts what the forward-by-forward
loop drafts. Off CUDA a "graph" runs its body eagerly on the same padded static buffers, so these tests
prove the body, the batch-bucket padding and the shared outputs; the Triton kernel runs under its CPU
interpreter, in float32 (it has no float64 dot)."""

import pytest

from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion, small_engine

SAMPLED = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=5),
           SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, top_p=0.8, top_k=20, seed=6),
           SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, min_p=0.05, seed=7)]


@pytest.fixture(scope="module")
def pair32(llama_pair):
    target, draft = llama_pair
    yield type(target)(target.model.float(), None, "t32"), type(draft)(draft.model.float(), None, "d32")
    target.model.double()
    draft.model.double()


def _engine(pair32, graphed: bool):
    engine = small_engine(*pair32, attention_kernel=True, cuda_graphs=True, num_speculative_tokens=3,
                          draft_graphs=graphed)
    assert (engine.proposer.graphs is not None) == graphed  # else the forward-by-forward loop
    return engine


def test_graphed_greedy_draft_keeps_the_target_greedy_output_and_was_captured_at_start(pair32):
    prompts = random_prompts(3, VOCAB, 2, 40, seed=13)
    engine = _engine(pair32, graphed=True)
    engine.capture_graphs()
    captured = set(engine.proposer.graphs.graphs)
    assert {key[:3] for key in captured} >= {(1, 1, 3), (4, 2, 3)}  # (bucket, pending tokens, L)
    outputs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=10, ignore_eos=True))
                                         for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(3)] == [hf_greedy(pair32[0], p, 10) for p in prompts]
    assert engine.total_stats.num_accepted_tokens > 0
    assert set(engine.proposer.graphs.graphs) == captured, "a greedy step captured a draft graph at run time"


def test_graphed_sampled_draft_draws_what_the_loop_draws(pair32):
    """Seeded sampling is counter-based (lanes/sample/sampling.py), so the same request draws the same
    tokens whichever path drafts them; a draft that differed would change acceptance and so the output."""
    prompts = random_prompts(3, VOCAB, 2, 40, seed=21)
    requests = {str(i): (p, params) for i, (p, params) in enumerate(zip(prompts, SAMPLED))}
    graphed, loop = _engine(pair32, graphed=True), _engine(pair32, graphed=False)
    assert run_to_completion(graphed, requests) == run_to_completion(loop, requests)
    kinds = {key[3] for key in graphed.proposer.graphs.graphs}
    assert kinds == {(False, True, True)}, kinds  # sampled, top-k/top-p, min-p: one graph kind for the batch
    assert graphed.total_stats.num_draft_tokens == loop.total_stats.num_draft_tokens > 0
    assert graphed.total_stats.num_accepted_tokens == loop.total_stats.num_accepted_tokens
