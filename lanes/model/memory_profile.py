"""The profile run that sizes a lane's KV pools (lanes/kv/sizing.py): the lane's largest forwards,
run once over one-sequence pools before the real pools are allocated, and what its CUDA graphs will
hold. Why measured and not computed: activations depend on the attention path, the fused layers and
the allocator's rounding, and the mode spec once ran out of memory mid-step on an H100 because its
pools took every byte that its weights left (issue 28)."""

import torch

from lanes.kv.sizing import SAMPLING_LOGITS_COPIES, MemoryPlan, block_bytes
from lanes.model.runner import GRAPH_MAX_Q, ModelRunner
from lanes.spec.draft import CATCH_UP_CHUNK

LOGIT_BYTES = 4  # logits are float32


def plan_memory(runners: list[ModelRunner], config, draft_index: int | None) -> MemoryPlan:
    """Run the profile on `runners` (over their one-sequence pools) and plan the lane's memory.
    `config`: the lane's EngineConfig; `draft_index`: which runner is the draft (it also catches up)."""
    device = runners[0].device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    pools_bytes = sum(r.pool.kv.numel() * r.pool.kv.element_size() for r in runners)
    held = torch.cuda.memory_allocated(device) - pools_bytes
    peaks = [profile_activations(r, config, i == draft_index) for i, r in enumerate(runners)]
    shapes = [r.pool.shape for r in runners]
    verify_rows = config.max_num_seqs * (config.max_draft_len + 1)  # as the profile's verify forward
    sampling = SAMPLING_LOGITS_COPIES * verify_rows * runners[0].vocab_size * LOGIT_BYTES
    total = torch.cuda.mem_get_info(device)[1]
    return MemoryPlan(
        lane=config.lane_name,
        total_bytes=total,
        budget_bytes=int(total * config.gpu_memory_utilization),
        held_bytes=held,
        activation_bytes=max(max(p.values()) for p in peaks) + sampling,
        graph_bytes=sum(graph_bytes(r, config, i == draft_index, p) for i, (r, p) in enumerate(zip(runners, peaks))),
        block_bytes=block_bytes(shapes, [r.pool.kv.dtype for r in runners]),
        blocks_per_seq=shapes[0].blocks_per_slot,
        block_size=shapes[0].block_size,
        slack_tokens=config.slot_capacity_tokens - config.max_model_len,
        max_blocks=config.max_num_seqs * shapes[0].blocks_per_slot,
        copied_out=config.kv_copied_out,
    )


def profile_activations(runner: ModelRunner, config, draft: bool) -> dict[str, int]:
    """Peak bytes above what the process held, per kind of the runner's largest eager forwards:
    - "prefill": a chunk of `idle_prefill_tokens` (one row; a batch of prompts is padded to at most
      that many tokens, lanes/spec/prefill.py) with every position's logits (prompt logprobs);
    - "verify": `max_num_seqs` rows of `max_draft_len + 1` tokens (a draft step is smaller);
    - "catch_up" (the draft): `max_num_seqs` rows of CATCH_UP_CHUNK tokens, last logits only.
    Graphs are held off while it runs: a graph captured here would read the pool about to be replaced.
    So is a tensor-parallel rank 0's sending of its forwards: every rank of the group profiles its own
    shard in the same order (they all build their runners through `build_runners`), and its
    collectives meet the workers' own."""
    device, capacity = runner.device, runner.pool.shape.capacity_tokens
    shapes = {"prefill": (1, min(config.idle_prefill_tokens, capacity), False),
              "verify": (config.max_num_seqs, min(config.max_draft_len + 1, capacity), False)}
    if draft:
        shapes["catch_up"] = (config.max_num_seqs, min(CATCH_UP_CHUNK, capacity), True)
    peaks = {}
    held_off = runner.graphs, runner.prefill_graphs, runner.share_forward
    runner.graphs = runner.prefill_graphs = runner.share_forward = None
    try:
        for kind, (batch, q_len, keep_last) in shapes.items():
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            runner.pad_forward(batch, 0, q_len, keep_last=keep_last, prefill=True)
            torch.cuda.synchronize(device)
            peaks[kind] = torch.cuda.max_memory_allocated(device) - base
    finally:
        runner.graphs, runner.prefill_graphs, runner.share_forward = held_off
    torch.cuda.empty_cache()
    return peaks


def graph_bytes(runner: ModelRunner, config, draft: bool, peaks: dict[str, int]) -> int:
    """What the CUDA graphs this runner captures at start will hold: each graph's float32 logits
    output stays allocated in its family's memory pool, and each pool keeps one forward's
    activations besides (taken as the profile's peak of the same kind: an over-estimate, since
    graphed shapes are the smaller ones). Graphs that a raised draft length captures on first use
    are not counted."""
    if runner.graphs is None:
        return 0
    vocab = runner.vocab_size
    q_lens = [q for q in ({1, 2} if draft else range(1, config.num_speculative_tokens + 2)) if q <= GRAPH_MAX_Q]
    outputs = sum(b * q for b in runner.graphs.buckets for q in q_lens)
    total = peaks["verify"]
    if runner.prefill_graphs is not None:
        outputs += sum(b for b in runner.prefill_graphs.batches for w in runner.prefill_graphs.widths
                       if runner.prefill_graphs.fits(b, w))
        total += peaks["prefill"]
    return total + outputs * vocab * LOGIT_BYTES
