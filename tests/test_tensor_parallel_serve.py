"""A tensor-parallel engine served by Ray Serve on the CPU: the DecodeLane replica owns a placement
group of two bundles, its worker rank is a Ray actor in the second (deployments/tp_workers.py), and
the ranks meet over gloo. Greedy output over HTTP equals HF's greedy `generate` of the whole target.
(A replica whose worker never came would not answer /health: rank 0 waits in the group's rendezvous
for every rank before it builds its shards.)"""

import pytest

from lanes.models import load_model
from tests.engine_helpers import hf_greedy, random_prompts
from tests.serve_helpers import MODEL, app_config, openai_client, serving

MODES = ("unified", "nospec")


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    configs = {}
    for mode in MODES:
        configs[mode] = app_config(mode, target, draft)
        configs[mode]["target"]["tensor_parallel_size"] = 2
        configs[mode]["draft"]["tensor_parallel_size"] = 2
    with serving(configs):
        yield


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_of_a_tp2_replica_equals_target_greedy(mode, pair_paths):
    target = load_model(pair_paths[0])
    c = openai_client(mode)
    for prompt in random_prompts(4, len(target.tokenizer), 1, 60, seed=31):
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == hf_greedy(target, prompt, 16)
