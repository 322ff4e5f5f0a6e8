"""The shipped pair through the project's own engine: greedy speculative output equals the target's."""

import pytest
import torch

from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET
from lanes.engine.core import EngineConfig, EngineCore
from lanes.model.loader import check_compatible, load_model
from lanes.sample.params import SamplingParams
from tests.engine_helpers import run_to_completion

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def pair():
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    check_compatible(draft, target)
    return target, draft


def test_engine_greedy_equals_target_greedy_and_drafts_are_accepted(pair):
    target, draft = pair
    engine = EngineCore.colocated(target, draft, EngineConfig(max_model_len=256, max_num_seqs=4,
                                                              num_speculative_tokens=4))
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(ids)})
    for i, prompt in enumerate(ids):
        ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, len(prompt):].tolist()
        assert outputs[str(i)] == ref
    # A trained draft is accepted far more often than a random one (~0): the pair is real.
    assert engine.total_stats.acceptance_rate > 0.4
