"""Running the engine synchronously and computing references, shared by the tests."""

import torch

from lanes.engine_core import EngineConfig, EngineCore
from lanes.models import LoadedModel
from lanes.params import SamplingParams


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


def hf_greedy(model: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


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
