"""Tensor parallelism on the CPU: TP = 2 over gloo, the worker a spawned process (lanes/tp_worker.py).

On tiny random-weight Llama (GQA) and Qwen2 (q/k/v biases) models, the co-located engine's greedy
output with the target (and the draft) sharded over two ranks equals the TP = 1 engine's and HF's
own greedy `generate`, token for token: prompts of 1-60 tokens batched together (so prefill runs in
chunks beside decoding rows; two share a cached prefix), with speculation on (L = 4) and off
(L = 0), under preemption. float64 models: the all-reduce sums partial products in another order
than one GEMM, a difference float64 keeps far below any logit gap. Configs TP cannot run exactly are
refused at load and at config validation.
"""

from functools import partial

import pytest
from transformers import AutoConfig

from lanes.engine_core import EngineConfig, EngineCore
from lanes.families import UnsupportedModelError
from lanes.params import SamplingParams
from lanes.tensor_parallel import check_shardable
from lanes.tp_worker import worker_processes
from tests.conftest import ARCH_CONFIGS, VOCAB, make_pair
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion

MAX_NEW = 24
# 14 KV blocks of 16 tokens for prompts and outputs of ~550 tokens: requests wait for blocks and are
# preempted and recomputed, so block tables change under the workers' feet as in a full server.
CONFIG = EngineConfig(max_model_len=128, max_num_seqs=8, num_speculative_tokens=4, max_draft_len=8,
                      prefill_chunk_tokens=32, idle_prefill_tokens=64, num_kv_blocks=14)
_PREFIX = random_prompts(1, VOCAB, 48, 48, seed=22)[0]  # three full blocks two prompts share (prefix cache)
PROMPTS = [[5]] + random_prompts(5, VOCAB, 2, 60, seed=21) + [_PREFIX + [7, 8], _PREFIX + [9]]


def _load(arch: str, shard_draft: bool):
    """A worker's models: the same deterministic pair rank 0 builds."""
    target, draft = make_pair(arch)
    return CONFIG, [target.model, draft.model], (True, shard_draft)


def _requests(tag: str) -> dict:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return {f"{tag}{i}": (p, params) for i, p in enumerate(PROMPTS)}


def _generate(engine: EngineCore) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs of every prompt, all batched together: with L = 4, then with speculation off.
    Both preemption and the prefix cache (the second run's prompts were cached by the first) ran."""
    spec = run_to_completion(engine, _requests("spec"))
    engine.set_draft_lengths(0)
    plain = run_to_completion(engine, _requests("plain"))
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache.num_hits > 0
    return list(spec.values()), list(plain.values())


@pytest.fixture(scope="module", params=[("llama", True), ("qwen2", True), ("llama", False)],
                ids=["llama-draft-sharded", "qwen2-draft-sharded", "llama-draft-whole"])
def outputs(request):
    """(TP = 2 outputs, TP = 1 outputs, HF references) of one architecture."""
    arch, shard_draft = request.param
    reference, _ = make_pair(arch)
    refs = [hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    one = _generate(EngineCore.colocated(*make_pair(arch), CONFIG))
    with worker_processes(2, partial(_load, arch, shard_draft)) as tp:
        target, draft = make_pair(arch)
        two = _generate(EngineCore.colocated(target, draft, CONFIG, tp=tp, shard_draft=shard_draft))
    return two, one, refs


def test_tp2_equals_tp1_and_hf_with_speculation(outputs):
    (spec2, _), (spec1, _), refs = outputs
    assert spec1 == refs
    assert spec2 == spec1


def test_tp2_equals_tp1_and_hf_without_speculation(outputs):
    (_, plain2), (_, plain1), refs = outputs
    assert plain1 == refs
    assert plain2 == plain1


@pytest.mark.parametrize("overrides, named", [
    (dict(model_type="gpt_neox", rotary_pct=0.25), "gpt_neox"),
    (dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (dict(intermediate_size=127), "intermediate_size=127"),
])
def test_unshardable_models_are_refused(overrides, named):
    config = AutoConfig.for_model(**dict(ARCH_CONFIGS["llama"], **overrides))
    with pytest.raises(UnsupportedModelError, match=named):
        check_shardable(config, 2)
