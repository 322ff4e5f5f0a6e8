"""What a replica reads of its engine: small, picklable values, so that the engine may step in another
process (lanes/engine/process.py) and its replica still export metrics and answer stats()."""

from dataclasses import asdict, dataclass

from lanes.engine.core import EngineCore
from lanes.engine.sequence import Sequence
from lanes.kv.pool import KVPool
from lanes.spec.stats import SpecDecodeStats


@dataclass
class EngineSnapshot:
    """The engine's state after a step (or while idle), as the replica's metrics read it."""

    total_stats: SpecDecodeStats  # a copy: spec-decode totals since start
    draft_lens: list[int]  # the L of each running request
    queue_depth: int  # requests waiting for or in prefill
    draft_slots: tuple[int, int] | None  # (used, total) KV slots of the draft pool; None without one
    target_slots: tuple[int, int] | None  # the same for a local target pool
    default_draft_len: int
    draft_blocks: tuple[int, int] | None = None  # (used, total) KV blocks of the draft pool; None without one
    target_blocks: tuple[int, int] | None = None  # the same for a local target pool
    prefix_cache: tuple[int, int] = (0, 0)  # prompt tokens looked up in the prefix cache since start, and found
    num_oom_recoveries: int = 0  # out-of-memory errors in a step recovered from since start (lanes/engine/step_cap.py)
    num_prefill_tokens: int = 0  # prompt tokens launched in this engine's own prefill chunks since start
    # pd's split (lanes/engine/split_prefill.py): prompts prefilled by this engine and by the prefill lane since start.
    prompts_prefilled: dict[str, int] | None = None


def snapshot(core: EngineCore) -> EngineSnapshot:
    sched = core.scheduler
    total = core.total_stats
    draft_pool, target_pool = sched.draft_pool, getattr(core.verifier, "pool", None)
    return EngineSnapshot(
        total_stats=SpecDecodeStats(total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens,
                                    list(total.accepted_per_pos)),
        draft_lens=[seq.draft_len for seq in sched.running],
        queue_depth=len(sched.waiting) + len(sched.prefilling),
        draft_slots=(draft_pool.num_used, draft_pool.shape.num_slots) if draft_pool is not None else None,
        target_slots=(target_pool.num_used, target_pool.shape.num_slots) if target_pool is not None else None,
        default_draft_len=core.default_draft_len,
        draft_blocks=_blocks(draft_pool),
        target_blocks=_blocks(target_pool),
        prefix_cache=(cache.num_queries, cache.num_hits) if (cache := sched.prefix_cache) is not None else (0, 0),
        num_oom_recoveries=core.step_cap.num_oom_recoveries,
        num_prefill_tokens=sched.num_prefill_tokens,
        prompts_prefilled=getattr(core.prefiller, "prompts_prefilled", None),
    )


def _blocks(pool: KVPool | None) -> tuple[int, int] | None:
    return None if pool is None else (pool.shape.num_blocks - pool.num_free_blocks, pool.shape.num_blocks)


def core_report(core: EngineCore) -> dict:
    """Slot usage, queues, spec-decode totals and each request's counters (the engine's part of a
    replica's stats()). Module-level, so that it can be sent to an engine process and run there."""
    s = core.scheduler
    return {
        "kv_slots_used": s.draft_pool.num_used if s.draft_pool is not None else None,
        "waiting": len(s.waiting), "prefilling": len(s.prefilling), "running": len(s.running),
        "max_num_seqs": core.config.max_num_seqs,
        # The context it serves: below the configured one where max_model_len was left unset and one
        # sequence of the model's own does not fit (lanes/engine/core.py build_runners).
        "max_model_len": core.config.max_model_len,
        # KV blocks (free, total) of each pool this engine holds; requests preempted for want of them
        # (or migrated: num_preemptions counts those too).
        "kv_blocks": {name.removesuffix("_slot"): (pool.num_free_blocks, pool.shape.num_blocks)
                      for pool, name in s.pools},
        "num_preemptions": s.num_preemptions,
        "num_migrations": core.num_migrations,  # requests recomputed after their verify replica left or died
        "num_oom_recoveries": core.step_cap.num_oom_recoveries,  # steps that ran out of device memory, recomputed
        "prefix_cache": ({"queries": s.prefix_cache.num_queries, "hits": s.prefix_cache.num_hits}
                         if s.prefix_cache is not None else None),
        "default_draft_len": core.default_draft_len,
        "forward_ms": core.forward_ms,  # {model: {rows: ms}}: a one-token forward per local model, measured at start
        "spec_decode": core.total_stats.to_dict(),
        "step_profile": asdict(core.step_profile),  # cumulative; StepProfile(**a).since(StepProfile(**b))
        # The target pool where this engine holds it (unified, spec, nospec, pd); pdv's is the verify lane's.
        "target_slots_used": getattr(getattr(getattr(core.verifier, "lane", None), "pool", None), "num_used", None),
        # pd, pdv: prompts at the prefill lane; one of an aborted request holds a verify slot until it lands.
        "prefills_in_flight": getattr(core.prefiller, "num_in_flight", 0),
        # pd with local_prefill_max_tokens: prompts prefilled by this engine and by the prefill lane (SplitPrefiller).
        "prompts_prefilled": getattr(core.prefiller, "prompts_prefilled", None),
        "requests": {seq.request_id: request_counters(seq) for seq in s.by_id.values()},
    }


def request_counters(seq: Sequence) -> dict[str, int]:
    """The L a request drafts with and its spec-decode counters since it started."""
    st = seq.stats
    return {"draft_len": seq.draft_len, "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens}
