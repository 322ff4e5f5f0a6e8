"""Structured output through the engine, on the shipped pair (a real tokenizer): greedy output is the
target's own greedy output under the grammar's mask, with speculation (draft model or prompt lookup)
and without; output always parses and matches; sampled output too."""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar

from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET
from lanes.engine.core import EngineConfig, EngineCore
from lanes.model.loader import load_model
from lanes.sample.grammar import apply_token_bitmask
from lanes.sample.params import SamplingParams, StructuredOutput
from lanes.spec.ngram import NgramProposer
from tests.engine_helpers import run_to_completion

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "count": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "tags", "count", "ok"]}
REGEX = r"def [a-z_]{1,12}\((x|y)\):\n    return [a-z_0-9 +*]{1,20}\n"
CHOICES = ["True", "False", "None", "raise ValueError"]
SPECS = {
    "json_schema": StructuredOutput("json", json.dumps(SCHEMA), "response_format"),
    "regex": StructuredOutput("regex", REGEX, "guided_regex"),
    "choice": StructuredOutput("choice", json.dumps(CHOICES), "guided_choice"),
}
PROMPTS = ["def fibonacci(n):\n", "config = ", "class Stack:\n    def __init__(self):\n", "    return "]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def pair():
    return load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)


def engine(pair, draft_len: int, ngram: bool = False) -> EngineCore:
    target, draft = pair
    config = EngineConfig(max_model_len=512, max_num_seqs=8, num_speculative_tokens=draft_len)
    if ngram:
        return EngineCore.colocated(target, None, config, proposer=NgramProposer(1, 3))
    return EngineCore.colocated(target, draft if draft_len else None, config)


def run(core: EngineCore, spec: StructuredOutput, **params) -> list[list[int]]:
    ids = [core.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=spec, **params)
    requests = {str(i): (p, params) for i, p in enumerate(ids)}
    outputs = run_to_completion(core, requests)
    assert core.verifier.lane.pool.num_used == 0
    return [outputs[str(i)] for i in range(len(ids))]


def masked_target_greedy(target, core: EngineCore, spec: StructuredOutput, prompt: list[int]) -> list[int]:
    """The reference: HF's forward with its own cache, argmax of the masked logits, one token at a time."""
    matcher = xgrammar.GrammarMatcher(core.grammars.compiled(spec).result())
    bitmask = xgrammar.allocate_token_bitmask(1, core.vocab_size)
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        while len(out) < MAX_TOKENS and not matcher.is_terminated():
            result = target.model(ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            matcher.fill_next_token_bitmask(bitmask)
            token = int(apply_token_bitmask(result.logits[0, -1:].float(), bitmask).argmax())
            assert matcher.accept_token(token)
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def check(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_equals_masked_target_greedy_with_and_without_speculation(pair, kind):
    spec = SPECS[kind]
    outputs = {}
    for name, draft_len, ngram in (("nospec", 0, False), ("L=2", 2, False), ("L=4", 4, False), ("ngram L=4", 4, True)):
        core = engine(pair, draft_len, ngram)
        outputs[name] = run(core, spec)
        if draft_len and not ngram:
            assert core.total_stats.num_accepted_tokens > 0  # speculation still helps under the mask
    eos = set(core.eos_ids)
    for i, prompt in enumerate(PROMPTS):
        ref = masked_target_greedy(pair[0], core, spec, core.tokenizer.encode(prompt))
        for name, out in outputs.items():
            assert out[i] == ref, (name, i, core.tokenizer.decode(out[i]), core.tokenizer.decode(ref))
        assert ref[-1] in eos, "ended by the grammar, not by max_tokens"
        check(kind, core.tokenizer.decode(ref[:-1]))


def test_sampled_output_always_parses(pair):
    core = engine(pair, 4)
    ids = [core.tokenizer.encode(p) for p in PROMPTS]
    for spec, kind in ((SPECS["json_schema"], "json_schema"), (StructuredOutput("json_object", "", "response_format"),
                                                               "json_object")):
        requests = {f"{i}-{seed}": (p, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured=spec))
                    for i, p in enumerate(ids) for seed in range(4)}
        for rid, out in run_to_completion(core, requests).items():
            assert out[-1] in core.eos_ids, rid
            text = core.tokenizer.decode(out[:-1])
            if kind == "json_schema":
                check(kind, text)
            else:
                assert isinstance(json.loads(text), dict), text
    assert core.total_stats.num_accepted_tokens > 0


def test_max_tokens_ends_with_length_and_free_text_rows_share_the_batch(pair):
    core = engine(pair, 4)
    prompt = core.tokenizer.encode(PROMPTS[0])
    core.add_request("cut", prompt, SamplingParams(max_tokens=3, structured=SPECS["json_schema"]))
    core.add_request("free", prompt, SamplingParams(max_tokens=20))
    finals, free = {}, []
    while core.has_work:
        for out in core.step():
            free += out.token_ids if out.request_id == "free" else []
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals == {"cut": "length", "free": "length"}
    alone = run_to_completion(engine(pair, 0), {"free": (prompt, SamplingParams(max_tokens=20))})["free"]
    assert free == alone  # a grammar row in the batch leaves the other rows' output as it was


def test_penalties_apply_after_the_mask_and_stay_lossless(pair):
    """Penalties on the masked logits never bring a forbidden token back; greedy output is the same with
    speculation as without."""
    penalised = dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={ord("{"): 5.0})
    outputs = [run(engine(pair, draft_len), SPECS["json_schema"], **penalised) for draft_len in (0, 4)]
    assert outputs[0] == outputs[1]
    tokenizer = engine(pair, 0).tokenizer
    for out in outputs[0]:
        check("json_schema", tokenizer.decode(out[:-1]))
