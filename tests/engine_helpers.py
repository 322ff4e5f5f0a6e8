"""Running the engine synchronously and computing references, shared by the tests."""

from dataclasses import replace

import torch

from lanes.engine.core import EngineConfig, EngineCore, build_runners
from lanes.model.loader import LoadedModel
from lanes.model.runner import ModelRunner
from lanes.sample.params import SamplingParams
from lanes.spec.prompt_prefiller import PromptPrefiller


def run_with_lanes(engine: EngineCore, link, requests: dict[str, tuple[list[int], SamplingParams]]
                   ) -> dict[str, list[int]]:
    """Every request to its end, over a link to other lanes in this process (`link.held`: orders not answered
    yet; `link.answer_all()` answers them). The lanes answer between steps, as their replies land while a
    step runs (tests/test_split_prefill.py, tests/test_verify_prefill.py)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(5_000):
        if not (engine.has_work or link.held):
            return outputs
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].extend(out.token_ids)
        link.answer_all()
    raise AssertionError("the engine did not finish")


def split_engine_parts(target: LoadedModel, draft: LoadedModel, **overrides
                       ) -> tuple[EngineConfig, ModelRunner, ModelRunner, PromptPrefiller]:
    """A small decode engine's config and its target and draft runners, with a prefill lane beside it (its real
    prefiller, over scratch pools of its own sized for a batch of prompts, whatever the engine's pools)."""
    values = dict(max_model_len=320, max_num_seqs=8, num_speculative_tokens=4, max_draft_len=8,
                  prefill_chunk_tokens=8, idle_prefill_tokens=64, enable_prefix_caching=False)
    config = EngineConfig(**{**values, **overrides})
    target_runner, draft_runner = build_runners(config, target.model, draft.model)
    lane = PromptPrefiller(*build_runners(replace(config, num_kv_blocks=None), target.model, draft.model),
                           config.idle_prefill_tokens, prefix_caching=False)
    return config, target_runner, draft_runner, lane


def sampled_three_ways(target: LoadedModel, draft: LoadedModel, build, empty_link, local_max_tokens: int, vocab: int,
                       seed: int) -> tuple[dict, dict, dict]:
    """Seeded sampled outputs of short and long prompts from a decode engine built by `build(target, draft,
    local_max_tokens)` (an engine and its link), the same with every prompt through the prefill lane
    (`local_max_tokens` 0), and a co-located engine: where a prompt is prefilled must not change them."""
    prompts = short_and_long_prompts(vocab, local_max_tokens, seed=seed)
    requests = {str(i): (p, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=seed + i, ignore_eos=True))
                for i, p in enumerate(prompts)}
    colocated = small_engine(target, draft, prefill_chunk_tokens=8, enable_prefix_caching=False)
    return (run_with_lanes(*build(target, draft, local_max_tokens), requests),
            run_with_lanes(*build(target, draft, 0), requests), run_with_lanes(colocated, empty_link, requests))


def short_and_long_prompts(vocab: int, max_short_tokens: int, seed: int) -> list[list[int]]:
    """Four prompts of at most `max_short_tokens` and four longer ones (up to 90), interleaved."""
    short = random_prompts(4, vocab, 3, max_short_tokens, seed=seed)
    long = random_prompts(4, vocab, max_short_tokens + 1, 90, seed=seed + 1)
    return [p for pair in zip(short, long) for p in pair]


def run_to_completion(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    steps = 0
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].extend(out.token_ids)
        steps += 1
        assert steps < 10_000, "engine did not finish"
    return outputs


def hf_greedy(model: LoadedModel, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """HF's greedy `generate` (`generate_kwargs`: its logits processors, e.g. repetition_penalty)."""
    out = model.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        **generate_kwargs,
    )
    return out[0, len(prompt):].tolist()


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        eos_ids: set[int]) -> torch.Tensor:
    """vLLM's penalties of one position [V], written out token by token: a reference for lanes/sample/penalties.py."""
    x = logits.double().clone()
    if len(output) < params.min_tokens:
        for t in set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids):
            x[t] = float("-inf")
    for t, bias in (params.logit_bias or {}).items():
        x[t] += bias
    for t in set(prompt) | set(output):  # every other token keeps its logit
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty * (t in output)
    return x


def penalised_greedy(model: LoadedModel, prompt: list[int], params: SamplingParams, eos_ids: set[int]) -> list[int]:
    """Greedy decoding of the target with `params`' penalties, one full forward per token (no cache)."""
    output: list[int] = []
    with torch.no_grad():
        while len(output) < params.max_tokens:
            logits = model.model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_penalties(logits, prompt, output, params, eos_ids).argmax()))
            if output[-1] in params.stop_token_ids or (output[-1] in eos_ids and not params.ignore_eos):
                break
    return output


def random_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy_references(model: LoadedModel, count: int, max_new_tokens: int, seed: int
                      ) -> list[tuple[list[int], list[int]]]:
    """`count` random prompts of 4-24 tokens, each with the model's greedy continuation."""
    prompts = random_prompts(count, len(model.tokenizer), 4, 24, seed=seed)
    return [(p, hf_greedy(model, p, max_new_tokens)) for p in prompts]


def small_engine(target: LoadedModel, draft: LoadedModel | None, **overrides) -> EngineCore:
    config = dict(max_model_len=320, max_num_seqs=8, num_speculative_tokens=4, max_draft_len=8,
                  prefill_chunk_tokens=32, idle_prefill_tokens=64)
    config.update(overrides)
    return EngineCore.colocated(target, draft, EngineConfig(**config))


def pair_engine(arch: str = "llama", **overrides) -> EngineCore:
    """small_engine over the tests' deterministic pair, built from nothing: a factory that pickles, for
    an engine process to call."""
    from tests.conftest import make_pair

    target, draft = make_pair(arch)
    return small_engine(target, draft, **overrides)
