"""pd's conditional disaggregation (lanes/engine/split_prefill.py; pdv's: tests/test_verify_prefill.py):
prompts of at most `local_max_tokens` are prefilled in the decode engine's own steps, longer ones by
the prefill lane, and the output is the target's either way.

The prefill lane here is its real prefiller (PromptPrefiller over scratch pools of its own, as the
prefill replica builds it) behind a link that answers the engine's orders as the replica does over
Ray: later, with a copy of each prompt's KV (the path off the GPU)."""

import time
from collections import Counter

from deployments.channels.remote import PrefillDone, PrefillOrder, RemotePrefiller
from deployments.config import AppConfig
from deployments.factories import build_engine, build_prompt_prefiller
from deployments.placement.kv_transfer import HostKV, Placement
from deployments.telemetry.engine_metrics import EngineMetrics
from lanes.engine.backends import LocalPrefiller, LocalVerifier
from lanes.engine.core import EngineCore
from lanes.engine.snapshot import core_report, snapshot
from lanes.engine.split_prefill import SplitPrefiller
from lanes.sample.params import SamplingParams
from lanes.spec.prefill import PrefillLane
from lanes.spec.prompt_prefiller import PromptPrefiller
from lanes.spec.verify import VerifyLane
from tests.conftest import VOCAB
from tests.engine_helpers import (hf_greedy, random_prompts, run_with_lanes, sampled_three_ways,
                                  short_and_long_prompts, split_engine_parts)

LOCAL_MAX_TOKENS = 16


class PrefillLaneLink:
    """The link a RemotePrefiller sends its orders over (deployments/channels/peer_calls.py ServeLink), to a
    prefill lane in this process: each order is held until `answer_all`, then prefilled in one batch."""

    def __init__(self, lane: PromptPrefiller):
        self.lane = lane
        self.held: list[tuple[PrefillOrder, object]] = []
        self.prompt_lengths: list[int] = []  # of every order answered

    def call(self, order: PrefillOrder, on_done) -> None:
        self.held.append((order, on_done))

    def answer_all(self) -> None:
        held, self.held = self.held, []
        if not held:
            return
        kvs = self.lane.prefill([order.request for order, _ in held])
        for (order, on_done), kv in zip(held, kvs):
            self.prompt_lengths.append(len(order.request.prompt_ids))
            on_done((PrefillDone(kv.first_token, HostKV.from_tensor(kv.draft_kv), HostKV.from_tensor(kv.target_kv),
                                 None, kv.num_cached_tokens, kv.logprobs, kv.prompt_logprobs), time.time()))

    node_id = None  # an engine process's link names its replica's Ray node; here there is none

    @staticmethod
    def record(kind: str, start_s: float, end_s: float, **info) -> None:
        pass


def pd_engine(target, draft, local_max_tokens: int, **overrides) -> tuple[EngineCore, PrefillLaneLink]:
    """pd's decode engine as deployments/factories.py builds it, over a prefill lane in this process."""
    config, target_runner, draft_runner, lane = split_engine_parts(target, draft, **overrides)
    link = PrefillLaneLink(lane)
    remote = RemotePrefiller(link, draft_runner.pool, target_runner.pool, Placement.here("cpu"), "decode-test")
    prefiller = remote
    if local_max_tokens:
        prefiller = SplitPrefiller(LocalPrefiller(PrefillLane(target_runner, draft_runner, lazy_draft=True)),
                                   remote, local_max_tokens)
    engine = EngineCore(config, target_runner.vocab_size, None, set(), draft_runner,
                        LocalVerifier(VerifyLane(target_runner)), prefiller)
    return engine, link


def test_short_prompts_prefill_in_the_engine_long_ones_in_the_lane_and_output_is_the_targets(llama_pair):
    target, draft = llama_pair
    engine, link = pd_engine(target, draft, LOCAL_MAX_TOKENS)
    prompts = short_and_long_prompts(VOCAB, LOCAL_MAX_TOKENS, seed=301)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    outputs = run_with_lanes(engine, link, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert [outputs[str(i)] for i in range(len(prompts))] == [hf_greedy(target, p, 14) for p in prompts]
    short = [len(p) for p in prompts if len(p) <= LOCAL_MAX_TOKENS]
    assert sorted(link.prompt_lengths) == sorted(len(p) for p in prompts if len(p) > LOCAL_MAX_TOKENS)
    # The engine's own chunks carried exactly the short prompts (chunks of 8 tokens while others decode).
    assert engine.scheduler.num_prefill_tokens == sum(short)
    assert (engine.prefiller.num_local, engine.prefiller.num_remote) == (len(short), len(prompts) - len(short))
    assert engine.prefiller.num_in_flight == 0 and not engine.scheduler.by_id


def test_the_decode_replicas_metrics_count_prompts_by_where_they_were_prefilled(llama_pair):
    """vpd_prompts_prefilled{where}: what the replica exports after each step (deployments/telemetry/engine_metrics.py)
    adds up to the split's own counts, which its stats report too."""
    target, draft = llama_pair
    engine, link = pd_engine(target, draft, LOCAL_MAX_TOKENS)
    metrics = EngineMetrics("decode", "pd")
    metrics.metrics.record_prompts_prefilled({"decode_lane": 1, "prefill_lane": 0})  # the Ray counter takes it
    exported: Counter = Counter()
    metrics.metrics.record_prompts_prefilled = exported.update  # each step's increments, as the counter gets them
    prompts = short_and_long_prompts(VOCAB, LOCAL_MAX_TOKENS, seed=306)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_work or link.held:
        engine.step()
        metrics.on_step(snapshot(engine), 1.0, len(engine.scheduler.running))
        link.answer_all()
    short = sum(len(p) <= LOCAL_MAX_TOKENS for p in prompts)
    assert dict(exported) == {"decode_lane": short, "prefill_lane": len(prompts) - short}
    assert core_report(engine)["prompts_prefilled"] == dict(exported)


def test_seeded_sampling_is_the_same_split_or_all_through_the_lane_or_co_located(llama_pair):
    """Where a prompt is prefilled does not change what is sampled: each token is drawn from the
    request's seed and its position (lanes/sample/sampling.py)."""
    split, through_lane, colocated = sampled_three_ways(*llama_pair, pd_engine, PrefillLaneLink(None), LOCAL_MAX_TOKENS,
                                                        VOCAB, seed=311)
    assert split == through_lane == colocated


def test_a_pool_too_small_for_the_load_preempts_on_both_sides_and_loses_nothing(llama_pair):
    """A preempted request is routed again by its length then, its output included, and its prompt
    and output so far are prefilled again (here through the lane). Greedy output is unchanged."""
    target, draft = llama_pair
    engine, link = pd_engine(target, draft, LOCAL_MAX_TOKENS, max_model_len=128, block_size=4, num_kv_blocks=48)
    prompts = short_and_long_prompts(VOCAB, LOCAL_MAX_TOKENS, seed=321)
    outputs = run_with_lanes(engine, link, {str(i): (p, SamplingParams(max_tokens=24, ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    assert engine.scheduler.num_preemptions > 0
    long = [len(p) for p in prompts if len(p) > LOCAL_MAX_TOKENS]
    assert len(link.prompt_lengths) > len(long), "no preempted request was prefilled again by the lane"
    assert [outputs[str(i)] for i in range(len(prompts))] == [hf_greedy(target, p, 24) for p in prompts]
    assert engine.prefiller.num_in_flight == 0 and not engine.scheduler.by_id


def test_the_bound_defaults_to_one_prefill_chunk_in_pd():
    """pdv's bound: tests/test_verify_prefill.py."""
    assert AppConfig(mode="pd", engine={"max_model_len": 256, "prefill_chunk_tokens": 384}).local_prefill_max_tokens == 384
    assert AppConfig(mode="pd", engine={"max_model_len": 256}, local_prefill_max_tokens=0).local_prefill_max_tokens == 0


def test_pds_decode_lane_is_built_with_the_split_and_serves_through_both(pair_paths):
    """deployments/factories.py, as a pd decode replica (or its engine process) calls it: the
    engine's prefiller is the split at the configured bound, and its prompts go both ways."""
    target, draft = pair_paths
    cfg = AppConfig(mode="pd", target={"path": target}, draft={"path": draft}, local_prefill_max_tokens=12,
                    engine={"max_model_len": 128, "max_num_seqs": 4, "prefill_chunk_tokens": 8})
    link = PrefillLaneLink(build_prompt_prefiller(cfg))
    engine = build_engine(cfg, None, peer_link=link)
    assert isinstance(engine.prefiller, SplitPrefiller) and engine.prefiller.local_max_tokens == 12
    prompts = random_prompts(6, 300, 4, 40, seed=331)
    outputs = run_with_lanes(engine, link, {str(i): (p, SamplingParams(max_tokens=8, ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    assert all(len(out) == 8 for out in outputs.values())
    short = sum(len(p) <= 12 for p in prompts)
    assert 0 < short < len(prompts)
    assert (engine.prefiller.num_local, engine.prefiller.num_remote) == (short, len(prompts) - short)
