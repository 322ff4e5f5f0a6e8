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
                      blocks_per_seq=SHAPE.blocks_per_slot, max_blocks=SHAPE.num_slots * SHAPE.blocks_per_slot)


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
    prefill = _prefill_config(cfg)
    assert prefill.num_kv_blocks is None and prefill.max_num_seqs == 8 and prefill.lane_name == "prefill lane"
