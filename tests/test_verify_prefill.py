"""pdv's split (deployments/channels/verify_prefill.py): a prompt of at most `local_max_tokens` has its target KV
prefilled by the verify lane into a slot of its own pool, and its draft KV by the decode engine; a
longer one goes through the prefill lane. The output is the target's either way.

The verify replica here is its real prefiller (`PromptPrefiller.launch_in_place` and `collect`, over the
pool its VerifyLane verifies from, as `VerifyServer.prefill` runs them) and the prefill lane its real
prefiller over scratch pools of its own, behind a link that answers the engine's orders as the decode
replica does over Ray: later, all at once."""

import time

import pytest

from deployments.channels.remote import PrefillDone, PrefillOrder, RemotePrefiller, VerifyPrefillOrder
from deployments.channels.verify_prefill import VerifyLanePrefiller
from deployments.config import AppConfig
from deployments.placement.kv_transfer import HostKV, Placement
from lanes.engine.backends import KVLost, LaneOOM
from lanes.engine.core import EngineCore
from lanes.engine.split_prefill import SplitPrefiller
from lanes.kv.pool import PoolFullError
from lanes.sample.params import SamplingParams
from lanes.spec.prompt_prefiller import PromptPrefiller
from lanes.spec.verify import VerifyLane
from tests.conftest import VOCAB
from tests.engine_helpers import (hf_greedy, random_prompts, run_with_lanes, sampled_three_ways,
                                  short_and_long_prompts, small_engine, split_engine_parts)

LOCAL_MAX_TOKENS = 16
LEASE = "verify-0"


class VerifyLaneSlots:
    """pdv's verify lane as the engine sees it (deployments/channels/remote.py RemoteVerifier): a pool it does not
    own, whose slots are handed out with a prompt's KV (by the verify lane's own prefill or the prefill
    lane's hand-over), never at admission."""

    def __init__(self, lane: VerifyLane):
        self.lane = lane

    def launch(self, batch):
        return self.lane.launch(batch)

    def allocate(self) -> None:
        return None

    def release(self, target_slot: int, lease: str | None = None) -> None:
        assert lease == LEASE
        self.lane.pool.free(target_slot)


class PdvLink:
    """The decode replica's link (deployments/channels/peer_calls.py), to a verify replica and a prefill lane in
    this process. Orders are held until `answer_all`, then each kind is answered in one batch."""

    node_id = None

    def __init__(self, verify: PromptPrefiller, lane: PromptPrefiller):
        self.verify, self.lane = verify, lane
        self.held: list[tuple[object, object]] = []
        self.by_verify: list[int] = []  # prompt lengths each prefilled, since start
        self.by_lane: list[int] = []
        self.refuse_next: BaseException | None = None  # the next batch of short prompts fails with this

    def call(self, order, on_done) -> None:
        self.held.append((order, on_done))

    def answer_all(self) -> None:
        held, self.held = self.held, []
        short = [(o, done) for o, done in held if isinstance(o, VerifyPrefillOrder)]
        long = [(o, done) for o, done in held if isinstance(o, PrefillOrder)]
        assert len(short) + len(long) == len(held)
        if short:
            self._answer_short(short)
        if long:
            self._answer_long(long)

    def _answer_short(self, held) -> None:
        if self.refuse_next is not None:  # as RemoteVerifier.prefill reads the failed call (lane_error)
            error, self.refuse_next = self.refuse_next, None
            for _, on_done in held:
                on_done((error, time.time()))
            return
        done = self.verify.collect(self.verify.launch_in_place([order.request for order, _ in held]))
        for (order, on_done), (slot, kv) in zip(held, done):
            self.by_verify.append(len(order.request.prompt_ids))
            on_done((PrefillDone(kv.first_token, None, None, slot, LEASE, logprobs=kv.logprobs,
                                 prompt_logprobs=kv.prompt_logprobs), time.time()))

    def _answer_long(self, held) -> None:
        # The prefill lane copies each prompt's KV into a slot of the verify pool (VerifyServer.load_kv).
        kvs = self.lane.prefill([order.request for order, _ in held])
        pool = self.verify.target.pool
        for (order, on_done), kv in zip(held, kvs):
            self.by_lane.append(len(order.request.prompt_ids))
            slot = pool.allocate()
            pool.write_slot(slot, kv.target_kv)
            on_done((PrefillDone(kv.first_token, HostKV.from_tensor(kv.draft_kv), None, slot, LEASE,
                                 logprobs=kv.logprobs, prompt_logprobs=kv.prompt_logprobs), time.time()))

    @staticmethod
    def record(kind: str, start_s: float, end_s: float, **info) -> None:
        pass


def pdv_engine(target, draft, local_max_tokens: int, **overrides) -> tuple[EngineCore, PdvLink]:
    """pdv's decode engine as deployments/factories.py builds it, with its verify and prefill lanes here."""
    config, target_runner, draft_runner, lane = split_engine_parts(target, draft, **overrides)
    link = PdvLink(PromptPrefiller(target_runner, None, config.prefill_chunk_tokens, prefix_caching=False), lane)
    prefiller = RemotePrefiller(link, draft_runner.pool, None, Placement.here("cpu"), "decode-test")
    if local_max_tokens:
        short = VerifyLanePrefiller(link, draft_runner, None, Placement.here("cpu"), "decode-test")
        prefiller = SplitPrefiller(short, prefiller, local_max_tokens)
    engine = EngineCore(config, target_runner.vocab_size, None, set(), draft_runner,
                        VerifyLaneSlots(VerifyLane(target_runner)), prefiller)
    return engine, link


def _slots_free(engine: EngineCore) -> bool:
    return engine.verifier.lane.pool.num_used == 0 and engine.draft.pool.num_used == 0


def test_short_prompts_prefill_in_the_verify_lane_long_ones_in_the_prefill_lane_and_output_is_the_targets(
        llama_pair):
    target, draft = llama_pair
    engine, link = pdv_engine(target, draft, LOCAL_MAX_TOKENS)
    prompts = short_and_long_prompts(VOCAB, LOCAL_MAX_TOKENS, seed=401)
    outputs = run_with_lanes(engine, link, {str(i): (p, SamplingParams(max_tokens=14, ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(len(prompts))] == [hf_greedy(target, p, 14) for p in prompts]
    short = [len(p) for p in prompts if len(p) <= LOCAL_MAX_TOKENS]
    assert sorted(link.by_verify) == sorted(short)
    assert sorted(link.by_lane) == sorted(len(p) for p in prompts if len(p) > LOCAL_MAX_TOKENS)
    assert engine.scheduler.num_prefill_tokens == 0  # no target prefill in the decode engine
    assert (engine.prefiller.num_local, engine.prefiller.num_remote) == (len(short), len(prompts) - len(short))
    assert engine.prefiller.num_in_flight == 0 and not engine.scheduler.by_id and _slots_free(engine)


@pytest.mark.parametrize("budget_tokens", [8, 64])
def test_the_draft_kv_the_engine_wrote_is_whole_when_its_request_decodes(llama_pair, budget_tokens):
    """With the target as its own draft every draft is accepted, unless the draft's KV of a prompt is
    missing or wrong. At a budget of 8 tokens a step the engine writes one short prompt's draft KV a
    step, so most replies wait for their write (VerifyLanePrefiller._ready)."""
    target, _ = llama_pair
    engine, link = pdv_engine(target, target, LOCAL_MAX_TOKENS, prefill_chunk_tokens=budget_tokens,
                              idle_prefill_tokens=budget_tokens)
    prompts = random_prompts(6, VOCAB, 9, LOCAL_MAX_TOKENS, seed=411)
    outputs = run_with_lanes(engine, link, {str(i): (p, SamplingParams(max_tokens=12, ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(len(prompts))] == [hf_greedy(target, p, 12) for p in prompts]
    stats = engine.total_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert sorted(link.by_verify) == sorted(map(len, prompts)) and _slots_free(engine)


def test_seeded_sampling_is_the_same_split_or_all_through_the_lane_or_co_located(llama_pair):
    """The verify lane samples a prompt's first token by the prefill lane's rule (PrefillLane), from the
    request's seed and the position: where a prompt is prefilled does not change what is sampled."""
    split, through_lane, colocated = sampled_three_ways(*llama_pair, pdv_engine, PdvLink(None, None), LOCAL_MAX_TOKENS,
                                                        VOCAB, seed=421)
    assert split == through_lane == colocated


@pytest.mark.parametrize("error", [PoolFullError("no free KV blocks"),
                                   KVLost("verify replica verify-0 did not answer in 5 s"),
                                   LaneOOM("a lane ran out of device memory in the forward that carried this request")],
                         ids=["pool_full", "replica_lost", "out_of_memory"])
def test_a_failed_verify_prefill_is_recomputed_and_loses_nothing(llama_pair, error):
    """A verify replica out of slots or blocks refuses a prefill (PoolFullError, nothing held), one that died
    or went silent loses it (KVLost), one out of device memory gives it up (LaneOOM): the engine queues those
    prompts again, and they are prefilled at a later step with the output unchanged."""
    target, draft = llama_pair
    engine, link = pdv_engine(target, draft, LOCAL_MAX_TOKENS)
    link.refuse_next = error
    prompts = random_prompts(4, VOCAB, 3, LOCAL_MAX_TOKENS, seed=431)
    outputs = run_with_lanes(engine, link, {str(i): (p, SamplingParams(max_tokens=10, ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(len(prompts))] == [hf_greedy(target, p, 10) for p in prompts]
    assert engine.scheduler.num_preemptions >= len(prompts) and _slots_free(engine)
    assert sorted(link.by_verify) == sorted(map(len, prompts))  # each prefilled once, after the failure


def test_a_request_aborted_while_the_verify_lane_prefills_it_frees_both_slots(llama_pair):
    target, draft = llama_pair
    engine, link = pdv_engine(target, draft, LOCAL_MAX_TOKENS)
    engine.add_request("a", random_prompts(1, VOCAB, 10, 10, seed=441)[0], SamplingParams(max_tokens=8))
    engine.step()  # sends the order and writes the draft's KV
    assert link.held and engine.draft.pool.num_used == 1
    engine.abort("a")
    link.answer_all()  # the verify lane hands out a slot for it anyway
    assert engine.verifier.lane.pool.num_used == 1
    while engine.has_work:
        engine.step()
    assert _slots_free(engine) and engine.prefiller.num_in_flight == 0


def test_the_bound_is_taken_in_pd_and_pdv_within_the_verify_lanes_profile_and_refused_elsewhere():
    engine = {"max_model_len": 256, "prefill_chunk_tokens": 384}
    assert AppConfig(mode="pdv", engine=engine).local_prefill_max_tokens == 0
    assert AppConfig(mode="pdv", engine=engine, local_prefill_max_tokens=384).local_prefill_max_tokens == 384
    with pytest.raises(ValueError, match="must be at most engine.idle_prefill_tokens"):
        AppConfig(mode="pdv", engine={**engine, "idle_prefill_tokens": 256}, local_prefill_max_tokens=384)
    with pytest.raises(ValueError, match="applies to modes 'pd' and 'pdv'"):
        AppConfig(mode="unified", engine=engine, local_prefill_max_tokens=128)


def test_prompt_and_first_token_logprobs_are_the_same_split_or_co_located(llama_pair):
    """echo and logprobs: the verify lane computes a short prompt's prompt logprobs and its first token's
    as the engine's own prefill does (PrefillLane), and they reach the request's first output."""
    target, draft = llama_pair
    prompts = random_prompts(2, VOCAB, 6, LOCAL_MAX_TOKENS, seed=451)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2)

    def first_outputs(engine, link):
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        first = {}
        while engine.has_work or link.held:
            for out in engine.step():
                assert out.error is None, out.error
                first.setdefault(out.request_id, out)
            link.answer_all()
        return first

    engine, link = pdv_engine(target, draft, LOCAL_MAX_TOKENS)
    split = first_outputs(engine, link)
    assert sorted(link.by_verify) == sorted(map(len, prompts))
    colocated = first_outputs(small_engine(target, draft, prefill_chunk_tokens=8, enable_prefix_caching=False),
                              PdvLink(None, None))
    for rid, out in split.items():
        ref = colocated[rid]
        assert out.token_ids[:1] == ref.token_ids[:1] and len(out.prompt_logprobs) == len(prompts[int(rid)]) - 1
        assert out.prompt_logprobs.top_ids == ref.prompt_logprobs.top_ids
        assert out.prompt_logprobs.logprobs == pytest.approx(ref.prompt_logprobs.logprobs, abs=1e-4)
        assert out.logprobs.top_ids[0] == ref.logprobs.top_ids[0]
        assert out.logprobs.logprobs[0] == pytest.approx(ref.logprobs.logprobs[0], abs=1e-4)
