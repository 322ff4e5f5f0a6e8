"""Prompt-lookup drafting served over HTTP in pdv, on a real Serve instance (CPU, tiny target): the
decode lane holds no model, the prefill lane prefills no draft, and greedy output is the target's."""

import pytest

from lanes.model.loader import load_model
from tests.engine_helpers import hf_greedy
from tests.serve_helpers import MODEL, app_config, lane_stats, openai_client, serving, wait_until_idle

pytestmark = pytest.mark.serve

APP = "pdv_ngram"
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def target_path(pair_paths) -> str:
    target, _ = pair_paths
    config = app_config("pdv", target, "unused", decode_lane={"num_cpus": 0.05})
    config["draft"] = NGRAM
    with serving({APP: config}):
        yield target


def test_pdv_with_prompt_lookup_serves_the_targets_greedy_output(target_path):
    target = load_model(target_path)
    chunk = target.tokenizer.encode("for i in range(10):\n    print(i)\n")
    prompts = [chunk * 3, target.tokenizer.encode("def add(a, b):\n    return a + b\n") * 2 + chunk]
    c = openai_client(APP)
    drafted = 0
    for prompt in prompts:
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == hf_greedy(target, prompt, 24)
        drafted += out.usage.spec_decode["num_draft_tokens"]
    assert drafted > 0
    sampled = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=16, temperature=0.8, seed=3,
                                   extra_body={"ignore_eos": True})
    assert sampled.usage.completion_tokens == 16
    wait_until_idle(APP, "pdv")
    (prefill,) = lane_stats(APP, "PrefillLane")
    assert prefill["handed_over"]["none"] == len(prompts) + 1  # no draft KV to hand over
