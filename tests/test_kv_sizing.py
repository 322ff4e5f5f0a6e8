"""KV memory sizing from a lane's profile (lanes/kv/sizing.py): the arithmetic, the refusal, and two
lanes sized from their shares of one device without overlap. The profile run itself needs CUDA
(lanes/model/memory_profile.py; exercised by benchmarks/lanes_1gpu.py on the GPU)."""

import pytest
import torch

from deployments.config import AppConfig
from deployments.factories import _prefill_config, _verify_config
from lanes.kv.pool import PoolShape
from lanes.kv.sizing import GIB, KVMemoryError, MemoryPlan, check_free, num_kv_blocks

TOTAL = 80 * GIB
SHAPE = PoolShape(num_layers=32, num_kv_heads=32, head_dim=128, num_slots=16, capacity_tokens=3264, block_size=16)
BLOCK = SHAPE.block_elements * 2  # bf16: 16 tokens x 0.5 MiB


def _plan(budget_share: float, held: int = 14 * GIB, activations: int = 2 * GIB, graphs: int = GIB,
          lane: str = "decode lane") -> MemoryPlan:
    return MemoryPlan(lane=lane, total_bytes=TOTAL, budget_bytes=int(TOTAL * budget_share), held_bytes=held,
                      activation_bytes=activations, graph_bytes=graphs, block_bytes=BLOCK,
                      blocks_per_seq=SHAPE.blocks_per_slot, block_size=SHAPE.block_size, slack_tokens=64,
                      max_blocks=SHAPE.num_slots * SHAPE.blocks_per_slot)


def test_the_pools_get_what_weights_activations_graphs_and_the_context_leave():
    plan = _plan(0.9 * 0.5)  # 36 GiB
    assert plan.kv_bytes == 36 * GIB - 14 * GIB - 2 * GIB - GIB - plan.non_torch_bytes
    assert plan.num_blocks == plan.kv_bytes // BLOCK - 1  # one pad block
    assert num_kv_blocks([SHAPE], [torch.bfloat16], torch.device("cpu"), 16, None, None) == 16 * SHAPE.blocks_per_slot
    # Capped at every slot full: more blocks could never be used.
    assert _plan(0.9, held=0, activations=0, graphs=0).num_blocks == SHAPE.num_slots * SHAPE.blocks_per_slot
    assert "sequences of max_model_len" in plan.describe()


def test_a_lane_that_cannot_hold_one_sequence_is_refused_in_one_line_with_bytes_and_knobs():
    # 0.3 of 80 GiB at 0.9 = 21.6 GiB: weights 15, activations 6, graphs 1, context 1 leave none; one
    # sequence of 3,264 tokens needs 204 blocks (+ the pad block) of 8 MiB.
    plan = _plan(0.9 * 0.3, held=15 * GIB, activations=6 * GIB)
    with pytest.raises(KVMemoryError) as refused:
        num_kv_blocks([SHAPE], [torch.bfloat16], torch.device("cuda"), 16, None, plan)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("decode lane: one sequence of max_model_len needs 1.60 GiB of KV, but 0.00 GiB is left")
    assert "budget of 21.60 GiB" in message
    for knob in ("num_gpus", "gpu_memory_utilization", "max_model_len"):
        assert knob in message
    assert "would fit" not in message  # nothing does


def test_the_longest_context_that_fits_is_named_and_taken_where_max_model_len_was_left_unset():
    # 0.3 of 80 GiB at 0.9 = 21.6 GiB; 15 + 2 + 1 + 1 GiB leave 2.6 GiB = 332 blocks of 8 MiB, one the pad:
    # 331 blocks of 16 tokens, less the slot's 64 tokens of slack.
    plan = _plan(0.9 * 0.3, held=15 * GIB)
    assert plan.longest_context_tokens() == 331 * 16 - 64
    short = _plan(0.9 * 0.3, held=15 * GIB, activations=int(4.5 * GIB))  # 0.1 GiB left: 11 blocks
    assert short.longest_context_tokens() == 11 * 16 - 64
    assert f"(max_model_len {11 * 16 - 64} would fit)" in short.refusal()
    # Only a co-located engine takes it: the lanes of pd and pdv must agree on one length, so they refuse.
    unset = AppConfig(mode="unified", target={"path": "models/vpd-target"}, draft={"path": "models/vpd-draft"})
    assert unset.engine.engine_config("unified").fit_max_model_len
    assert not unset.engine.engine_config("pdv").fit_max_model_len
    explicit = AppConfig(mode="unified", engine={"max_model_len": 512})
    assert not explicit.engine.engine_config("unified").fit_max_model_len


def test_two_lanes_on_one_device_are_sized_from_their_shares_not_from_free_memory():
    """pd on one GPU: the prefill lane (0.3) and the decode lane (0.7) each plan within their own
    share, so whichever starts first leaves the other what it needs: the free memory each checks
    after the other has allocated still holds it."""
    cfg = AppConfig(mode="pd", engine={"max_model_len": 3200, "max_num_seqs": 16},
                    prefill_lane={"num_gpus": 0.3}, decode_lane={"num_gpus": 0.7})
    prefill_util = _prefill_config(cfg).gpu_memory_utilization
    decode_util = cfg.engine.engine_config("pd").gpu_memory_utilization * 0.7
    assert prefill_util + decode_util <= cfg.engine.gpu_memory_utilization + 1e-9
    prefill, decode = _plan(prefill_util, held=15 * GIB, lane="prefill lane"), _plan(decode_util, held=16 * GIB)
    for plan in (prefill, decode):
        used = plan.held_bytes + plan.activation_bytes + plan.graph_bytes + plan.non_torch_bytes
        assert used + (plan.num_blocks + 1) * plan.block_bytes <= plan.budget_bytes
    for first, second in ((prefill, decode), (decode, prefill)):
        free = TOTAL
        check_free(first, free)
        free -= first.budget_bytes  # everything the first lane may ever take
        check_free(second, free - second.held_bytes - second.activation_bytes - second.non_torch_bytes)
    # A lane whose GPU neighbours hold more than their shares is refused with the figures.
    with pytest.raises(KVMemoryError, match=r"decode lane: its KV pools and CUDA graphs need .* GiB but .* free"):
        check_free(decode, 4 * GIB)


def test_the_verify_lane_pool_holds_every_decode_replica_and_the_prefill_lane_batches_by_blocks():
    cfg = AppConfig(mode="pdv", engine={"max_model_len": 512, "max_num_seqs": 8},
                    decode_lane={"num_replicas": 2}, verify_lane={"num_gpus": 0.5})
    assert _verify_config(cfg).max_num_seqs == 16
    assert _verify_config(cfg).lane_name == "verify lane"
    # Under slo: the decode lane starts at num_replicas and the planner may take it to slo.max_replicas.
    planned = AppConfig(mode="pdv", engine={"max_model_len": 512, "max_num_seqs": 8}, decode_lane={"num_replicas": 1},
                        verify_lane={"num_gpus": 0.5}, slo={"tpot_p95_ms": 40, "max_replicas": 3})
    assert _verify_config(planned).max_num_seqs == 24
    prefill = _prefill_config(cfg)
    assert prefill.num_kv_blocks is None and prefill.max_num_seqs == 8 and prefill.lane_name == "prefill lane"


def test_a_lone_lane_counts_the_one_sequence_pools_it_profiled_over_as_its_own():
    """The profile runs over pools of one sequence, which the lane still holds when it checks the free
    memory and frees before its pools grow. At a long context they are large (an engine at 32,768 tokens on
    an H200: 107.28 GiB needed against 106.43 free, alone on the GPU; docs/diagnoses.md): the check credits them."""
    plan = _plan(1.0, held=45 * GIB, activations=10 * GIB)  # the whole device: no slack to hide in
    assert plan.num_blocks < plan.max_blocks
    one_sequence = (SHAPE.blocks_per_slot + 1) * BLOCK
    # Alone on the device: the driver's free memory lacks everything this process holds.
    free = TOTAL - plan.held_bytes - plan.activation_bytes - plan.non_torch_bytes - one_sequence
    check_free(plan, free, held_blocks=SHAPE.blocks_per_slot)
    with pytest.raises(KVMemoryError):  # what the check did before: the pools counted twice
        check_free(plan, free)
    with pytest.raises(KVMemoryError):  # short by two blocks: a neighbour holds more than its share
        check_free(plan, free - 2 * BLOCK, held_blocks=SHAPE.blocks_per_slot)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the profile run measures CUDA memory")
def test_on_cuda_an_unset_context_too_long_for_memory_becomes_the_longest_that_fits():
    """The whole path on a GPU: profile, plan, the fitted max_model_len, and a request served at it.
    A tiny Llama whose context (2**20 tokens) cannot fit a budget of 1.25 GiB, of which 1 GiB is
    the CUDA context's allowance."""
    from lanes.engine.core import EngineConfig, EngineCore
    from lanes.model.loader import build_random_model
    from lanes.sample.params import SamplingParams
    from tests.conftest import ARCH_CONFIGS

    config = {**ARCH_CONFIGS["llama"], "max_position_embeddings": 1 << 20}
    target = build_random_model(config, dtype="bfloat16", device="cuda", seed=1)
    draft = build_random_model(config, dtype="bfloat16", device="cuda", seed=2)
    total = torch.cuda.mem_get_info()[1]
    engine = EngineCore.colocated(target, draft, EngineConfig(
        max_model_len=1 << 20, max_num_seqs=4, fit_max_model_len=True, gpu_memory_utilization=1.25 * GIB / total))
    fitted = engine.config.max_model_len
    assert 1024 < fitted < 1 << 20
    with pytest.raises(Exception, match="context"):
        engine.add_request("long", [1] * fitted, SamplingParams(max_tokens=1))
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_work:
        tokens += [t for out in engine.step() for t in out.token_ids if out.request_id == "ok"]
    assert len(tokens) == 4
