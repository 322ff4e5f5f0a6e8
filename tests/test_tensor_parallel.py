"""Tensor parallelism on the CPU: TP = 2 over gloo, the worker a spawned process (lanes/parallel/worker.py).

On tiny random-weight Llama (GQA; and with attention and MLP biases, so that the row-parallel
o_proj and down_proj biases must be added once), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
norms) models, the co-located engine's greedy output with the target (and the draft) sharded over
two ranks equals the TP = 1 engine's and HF's own greedy `generate`, token for token: prompts of
1-60 tokens batched together (so prefill runs in chunks beside decoding rows; two share a cached
prefix), with speculation on (L = 4) and off
(L = 0), under preemption. float64 models: the all-reduce sums partial products in another order
than one GEMM, a difference float64 keeps far below any logit gap. Configs TP cannot run exactly are
refused at load and at config validation.
"""

from functools import partial

import pytest
import torch
import yaml
from pydantic import ValidationError
from transformers import AutoConfig

from deployments.builder import ConfigError, build_app
from deployments.config import REPO_ROOT, AppConfig
from lanes.engine.core import EngineConfig, EngineCore, build_runners
from lanes.model.families import UnsupportedModelError
from lanes.model.loader import LoadedModel, build_random_model
from lanes.parallel.tensor_parallel import TPGroup, check_shardable
from lanes.parallel.worker import worker_processes
from lanes.sample.params import SamplingParams
from tests.conftest import ARCH_CONFIGS, VOCAB, perturbed_copy
from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion

MAX_NEW = 24
# 14 KV blocks of 16 tokens for prompts and outputs of ~550 tokens: requests wait for blocks and are
# preempted and recomputed, so block tables change under the workers' feet as in a full server.
CONFIG = EngineConfig(max_model_len=128, max_num_seqs=8, num_speculative_tokens=4, max_draft_len=8,
                      prefill_chunk_tokens=32, idle_prefill_tokens=64, num_kv_blocks=14)
_PREFIX = random_prompts(1, VOCAB, 48, 48, seed=22)[0]  # three full blocks two prompts share (prefix cache)
PROMPTS = [[5]] + random_prompts(5, VOCAB, 2, 60, seed=21) + [_PREFIX + [7, 8], _PREFIX + [9]]


ARCHS = {**ARCH_CONFIGS, "llama_bias": dict(ARCH_CONFIGS["llama"], attention_bias=True, mlp_bias=True),
         "qwen3": dict(ARCH_CONFIGS["qwen2"], model_type="qwen3", head_dim=16)}  # per-head q/k norms


def _pair(arch: str) -> tuple[LoadedModel, LoadedModel]:
    """A deterministic target and draft; their biases, zero at HF's initialisation, made random so
    that sharding them is tested."""
    target = build_random_model(ARCHS[arch], dtype="float64", seed=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in target.model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return target, perturbed_copy(target, 0.1, seed=2)


def _load(arch: str, shard_draft: bool):
    """A worker's models: the same deterministic pair rank 0 builds."""
    target, draft = _pair(arch)
    return CONFIG, [target.model, draft.model], (True, shard_draft)


def _requests(tag: str) -> dict:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return {f"{tag}{i}": (p, params) for i, p in enumerate(PROMPTS)}


def _generate(engine: EngineCore) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """Greedy outputs of every prompt, all batched together: with L = 4, then with speculation off
    (both preemption and the prefix cache, which holds the first run's prompts, ran); then the
    target's logits of a probe."""
    spec = run_to_completion(engine, _requests("spec"))
    engine.set_draft_lengths(0)
    plain = run_to_completion(engine, _requests("plain"))
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache.num_hits > 0
    return list(spec.values()), list(plain.values()), _probe(engine.verifier.lane.runner)


def _probe(runner) -> list[torch.Tensor]:
    """Logits of a 40-token prompt from position 0 (the maskless path), 20 tokens after it (masked),
    then 5 after those (a verify-sized step): greedy equality cannot see a small error (a bias added
    twice), logits can."""
    ids = torch.tensor([random_prompts(1, VOCAB, 65, 65, seed=23)[0]])
    slot = runner.pool.allocate()
    runner.pool.reserve([slot], [65])
    logits = [runner.forward(runner.rows([slot], [start]), ids[:, start:end]).clone()
              for start, end in ((0, 40), (40, 60), (60, 65))]
    runner.pool.free(slot)
    return logits


@pytest.fixture(scope="module",
                params=[("llama", True), ("qwen2", True), ("llama_bias", False), ("qwen3", True)],
                ids=["llama-draft-sharded", "qwen2-draft-sharded", "llama-biases-draft-whole", "qwen3-draft-sharded"])
def outputs(request):
    """(TP = 2 outputs, TP = 1 outputs, HF references) of one architecture."""
    arch, shard_draft = request.param
    reference, _ = _pair(arch)
    refs = [hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    one = _generate(EngineCore.colocated(*_pair(arch), CONFIG))
    with worker_processes(2, partial(_load, arch, shard_draft), timeout_s=120) as tp:  # a dead worker fails fast
        target, draft = _pair(arch)
        two = _generate(EngineCore.colocated(target, draft, CONFIG, tp=tp, shard_draft=shard_draft))
    return two, one, refs


def test_tp2_equals_tp1_and_hf_with_speculation(outputs):
    (spec2, _, _), (spec1, _, _), refs = outputs
    assert spec1 == refs
    assert spec2 == spec1


def test_tp2_equals_tp1_and_hf_without_speculation(outputs):
    (_, plain2, _), (_, plain1, _), refs = outputs
    assert plain1 == refs
    assert plain2 == plain1


def test_tp2_logits_equal_tp1_logits(outputs):
    (_, _, probe2), (_, _, probe1), _ = outputs
    for two, one in zip(probe2, probe1):  # float64 models, float32 logits: within float32's rounding
        torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides, named", [
    (dict(model_type="gpt_neox", rotary_pct=0.25), "model_type='gpt_neox'"),
    (dict(model_type="mistral", sliding_window=24), "sliding_window=24"),
    # Fused on one rank, not tested sharded.
    (dict(model_type="gemma2", head_dim=16), "model_type='gemma2'"),
    (dict(model_type="gemma3_text", head_dim=16), "model_type='gemma3_text'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (dict(intermediate_size=127), "intermediate_size=127"),
])
def test_unshardable_models_are_refused_by_name(overrides, named):
    config = AutoConfig.for_model(**dict(ARCH_CONFIGS["llama"], **overrides))
    with pytest.raises(UnsupportedModelError, match=named):
        check_shardable(config, 2)
    model = build_random_model(config)  # at load too, before any collective
    with pytest.raises(UnsupportedModelError, match=named):
        build_runners(CONFIG, model.model, tp=TPGroup(0, 2, torch.device("cpu")), sharded=(True,))


def _app(mode: str = "unified", target_tp: int = 2, draft_tp: int = 2, **overrides) -> dict:
    return {"mode": mode, "target": {"path": "models/vpd-target", "tensor_parallel_size": target_tp},
            "draft": {"path": "models/vpd-draft", "tensor_parallel_size": draft_tp}, **overrides}


@pytest.mark.parametrize("args, message", [
    (_app("pd"), "in 'pd' draft.tensor_parallel_size must be 1"),
    (_app("pdv"), "in 'pdv' draft.tensor_parallel_size must be 1"),
    (_app("pdv", draft_tp=1, verify_lane={"num_gpus": 0.5}), "verify_lane.num_gpus must be 1"),
    (_app("pd", draft_tp=1, prefill_lane={"num_gpus": 0.3}), "prefill_lane.num_gpus must be 1"),
    (_app(draft_tp=4), "draft.tensor_parallel_size must be 1 or the target's"),
    (_app(target_tp=1, draft_tp=2), "draft.tensor_parallel_size must be 1 or the target's"),
    (_app(decode_lane={"num_gpus": 0.5}), "one whole GPU per rank"),
])
def test_config_refuses_what_tensor_parallelism_cannot_serve(args, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(args)


def test_tensor_parallel_replica_owns_a_placement_group_of_one_bundle_per_rank():
    """The shipped TP = 2 placement: one {GPU: 1, CPU: 2} bundle per rank, on one node."""
    app = yaml.safe_load((REPO_ROOT / "configs/placements/e-unified-tp2.yaml").read_text())["applications"][0]
    cfg = AppConfig.model_validate(app["args"])
    opts = cfg.decode_lane.deployment_options(False, cfg.tensor_parallel_size)
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}] * 2
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"]["num_gpus"] == 1 and not cfg.shard_draft
    assert "placement_group_bundles" not in AppConfig().decode_lane.deployment_options()


@pytest.mark.parametrize("mode, sharded", [("pd", {"prefill_lane", "decode_lane"}),
                                           ("pdv", {"prefill_lane", "verify_lane"})])
def test_every_lane_that_holds_the_target_shards_it_in_pd_and_pdv(mode, sharded):
    cfg = AppConfig.model_validate(_app(mode, draft_tp=1))
    assert {lane for lane in cfg.lanes if cfg.lane_ranks(lane) == 2} == sharded


def test_builder_refuses_a_model_whose_kv_heads_do_not_divide(pair_paths):
    target, draft = pair_paths  # 2 KV heads
    args = {"mode": "nospec", "target": {"path": target, "tensor_parallel_size": 4}, "draft": None}
    with pytest.raises(ConfigError, match="num_key_value_heads=2 not divisible by tensor_parallel_size=4"):
        build_app(args)
