"""The grammar's bitmasks per verified column, exactly: each equals a matcher stepped one token at a
time, and committing a step's tokens leaves the matcher where the committed tokens put it."""

import json

import pytest
import torch
import xgrammar

from deployments.config import DEFAULT_TARGET
from lanes.engine.sequence import Sequence
from lanes.model.loader import load_model
from lanes.sample.grammar import (ColumnMasks, Grammars, apply_token_bitmask, first_token_bitmask, mask_first_tokens,
                                  merge_bitmasks)
from lanes.sample.matcher import FirstTokenMask
from lanes.sample.params import ParamError, SamplingParams, StructuredOutput
from lanes.spec.draft import DraftProposal, verify_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
TEXT = '{"name": "ab", "n": 12}'


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(DEFAULT_TARGET).tokenizer


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def schema_params(**kw) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput("json", json.dumps(SCHEMA), "response_format"), **kw)


def request(grammars, committed: list[int], rid: str = "r", params: SamplingParams | None = None) -> Sequence:
    params = params or schema_params()
    seq = Sequence(rid, [1, 2], params, 0, 4, grammar=grammars.for_request(params))
    if seq.grammar is not None:
        seq.grammar.commit(committed)
    return seq


def reference_mask(grammars, tokens: list[int]) -> torch.Tensor:
    """The bitmask after `tokens`, from a fresh matcher stepped one token at a time."""
    matcher = xgrammar.GrammarMatcher(grammars.compiled(schema_params().structured).result())
    for t in tokens:
        assert matcher.accept_token(t)
    out = xgrammar.allocate_token_bitmask(1, grammars.vocab_size)
    matcher.fill_next_token_bitmask(out)
    return out[0]


def test_columns_of_a_batch_with_drafts_equal_a_matcher_stepped_one_token_at_a_time(grammars, tokenizer):
    ids = tokenizer.encode(TEXT)
    eos = tokenizer.eos_token_id
    bad = tokenizer.encode("}")[0]  # not valid inside the key "name"
    rows = [
        (ids[:2], ids[2:6]),  # four valid drafts
        (ids[:1], ids[1:3] + [bad, ids[3]]),  # the third draft is refused: drafts end before it
        (ids[:1], []),  # no drafts: column 0 only
        (ids[:4], ids[4:7]),  # no grammar (below)
        (ids[:-1], ids[-1:] + [eos, ids[0]]),  # ends the object, then EOS ends the grammar
    ]
    seqs = [request(grammars, c, str(i)) for i, (c, _) in enumerate(rows)]
    seqs[3].grammar = None
    drafts = torch.tensor([d + [0] * (4 - len(d)) for _, d in rows])  # [B, L]
    proposal = DraftProposal(drafts, None, [len(d) for _, d in rows])
    bitmask = verify_bitmask(seqs, proposal)  # [B, L + 1, W]
    assert bitmask.shape == (5, 5, (grammars.vocab_size + 31) // 32)
    assert proposal.num_draft == [4, 2, 0, 3, 2]
    for i, (committed, drafted) in enumerate(rows):
        for c in range(proposal.num_draft[i] + 1):
            if i == 3 or (i == 4 and c == 2):  # no grammar; after EOS: all allowed
                assert (bitmask[i, c] == -1).all()
            else:
                assert torch.equal(bitmask[i, c], reference_mask(grammars, committed + drafted[:c])), (i, c)
    # Verification: row 0 keeps 2 drafts and gets a recovered token, row 1 all (bonus), row 4 keeps
    # the closing token and EOS. Committing leaves each matcher where the committed tokens put it.
    allowed = [t for t in range(grammars.vocab_size) if bitmask[0, 2, t // 32] >> (t % 32) & 1]
    recovered = next(t for t in allowed if t != ids[4])  # a valid token other than the draft it replaces
    emitted = [ids[2:4] + [recovered], ids[1:3] + [ids[3]], [ids[1]], None, ids[-1:] + [eos]]
    for i, tokens in enumerate(emitted):
        if tokens is None:
            continue
        terminated = seqs[i].grammar.commit(tokens)
        assert terminated == (i == 4)
        if not terminated:
            now = torch.empty(1, bitmask.shape[-1], dtype=torch.int32)
            seqs[i].grammar.fill(now, 0)
            assert torch.equal(now[0], reference_mask(grammars, rows[i][0] + tokens))


def test_rejected_drafts_are_rolled_back(grammars, tokenizer):
    ids = tokenizer.encode(TEXT)
    seq = request(grammars, ids[:2])
    before = torch.empty(1, (grammars.vocab_size + 31) // 32, dtype=torch.int32)
    seq.grammar.fill(before, 0)
    masks = ColumnMasks.of([seq], [3], 4)
    masks.follow(torch.tensor([ids[2:5]]))
    assert seq.grammar.speculative == ids[2:5]
    seq.grammar.commit([])  # nothing kept (the request stopped): every draft undone
    after = torch.empty_like(before)
    seq.grammar.fill(after, 0)
    assert torch.equal(before, after) and seq.grammar.speculative == []


def test_the_draft_lane_fills_columns_as_it_draws(grammars, tokenizer):
    """`advance` (drafting, rows of a sub-batch) gives the same columns as `follow` (drafts made elsewhere)."""
    ids = tokenizer.encode(TEXT)
    drawn = [request(grammars, ids[:2], "a"), request(grammars, ids[:1], "b"), request(grammars, ids[:3], "c")]
    masks = ColumnMasks.of(drawn, [0, 2, 2], 3)
    for j in range(2):
        masks.advance(j, [ids[1 + j], ids[3 + j]], rows=[1, 2])
    walked = [request(grammars, ids[:2], "a"), request(grammars, ids[:1], "b"), request(grammars, ids[:3], "c")]
    expected = verify_bitmask(walked, DraftProposal(torch.tensor([[0, 0], ids[1:3], ids[3:5]]), None, [0, 2, 2]))
    assert torch.equal(masks.bitmask(), expected)


def test_no_grammar_costs_nothing():
    seqs = [Sequence("a", [1], SamplingParams(), 0, 4), Sequence("b", [1], SamplingParams(), 0, 4)]
    assert ColumnMasks.of(seqs, [2, 2], 3) is None
    assert verify_bitmask(seqs, DraftProposal(torch.zeros(2, 2, dtype=torch.long), None, [2, 2])) is None
    logits = torch.randn(2, 7)
    assert mask_first_tokens(logits, seqs) is logits
    assert first_token_bitmask(seqs[0]) is None


def test_bitmask_application_matches_xgrammar(grammars, tokenizer):
    seq = request(grammars, tokenizer.encode(TEXT)[:3])
    first = first_token_bitmask(seq)
    logits = torch.randn(3, grammars.vocab_size)
    ours = apply_token_bitmask(logits, first.expand(3, -1))
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, first.expand(3, -1).contiguous())
    assert torch.equal(ours, theirs)
    # A prefill lane of its own gets the first token's mask instead of the matcher: same result.
    remote = Sequence("r", [1], seq.params, 0, 0, grammar=FirstTokenMask(first))
    assert torch.equal(mask_first_tokens(logits[:1], [remote]), ours[:1])
    # A padded vocabulary (logits wider than the tokenizer): the padding is never allowed.
    wide = apply_token_bitmask(torch.zeros(1, grammars.vocab_size + 40), first[None])
    assert torch.isinf(wide[0, grammars.vocab_size:]).all()


def test_merged_batches_keep_their_masks():
    a = torch.full((2, 3, 4), 5, dtype=torch.int32)
    merged = merge_bitmasks([a, None], [2, 1], 5)
    assert merged.shape == (3, 5, 4)
    assert (merged[:2, :3] == 5).all() and (merged[:2, 3:] == -1).all() and (merged[2] == -1).all()
    assert merge_bitmasks([None, None], [1, 1], 2) is None


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput("json", '{"type": "nope"}', "response_format"), "response_format"),
    (StructuredOutput("regex", "(ab", "guided_regex"), "guided_regex"),
    (StructuredOutput("grammar", "root ::= x", "structured_outputs.grammar"), "structured_outputs.grammar"),
])
def test_a_grammar_that_does_not_compile_names_its_field(grammars, spec, field):
    with pytest.raises(ParamError) as info:
        grammars.for_request(SamplingParams(structured=spec))
    assert info.value.field == field and "[" not in info.value.reason  # xgrammar's log prefix is cut


def test_compiled_grammars_are_cached_by_text(grammars):
    spec = StructuredOutput("choice", json.dumps(["yes", "no"]), "guided_choice")
    assert grammars.compiled(spec) is grammars.compiled(StructuredOutput("choice", spec.spec, "structured_outputs"))
    with pytest.raises(ParamError, match="ignore_eos"):
        grammars.for_request(SamplingParams(structured=spec, ignore_eos=True))
    with pytest.raises(ParamError, match="min_tokens"):
        grammars.for_request(SamplingParams(structured=spec, min_tokens=2))


def test_json_never_allows_raw_control_characters(grammars, tokenizer):
    """xgrammar lets them into strings with maxLength; strict JSON parsers refuse them."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    params = SamplingParams(structured=StructuredOutput("json", json.dumps(schema), "guided_json"))
    seq = request(grammars, tokenizer.encode('{"s": "'), params=params)
    mask = first_token_bitmask(seq)
    allowed = [t for t in range(grammars.vocab_size) if mask[t // 32] >> (t % 32) & 1]
    control = [t for t in range(grammars.vocab_size) if any(ord(c) < 32 for c in tokenizer.decode([t]))]
    assert control and allowed and not set(control) & set(allowed)


def test_every_spelling_of_a_constraint_reads_the_same():
    from deployments.api.openai_structured import structured_output

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = json.dumps(schema)
    ways = [structured_output({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, None, {}),
            structured_output(None, {"json": schema}, {}), structured_output(None, None, {"guided_json": text}),
            structured_output({"type": "text"}, None, {"guided_json": schema, "guided_regex": None})]
    assert {(w.kind, w.spec, w.any_whitespace) for w in ways} == {("json", text, False)}
    assert [w.field for w in ways] == ["response_format", "structured_outputs.json", "guided_json", "guided_json"]
    assert structured_output(None, {"regex": "a+", "disable_any_whitespace": False}, {}).kind == "regex"
    assert structured_output(None, {"json_object": True, "disable_any_whitespace": False}, {}).any_whitespace
    assert structured_output({"type": "text"}, {}, {"guided_choice": None}) is None
