"""GPU checks in one device call: the engine's greedy output on CUDA against HF's, then per-step timings
against HF eager and the memory-bandwidth floor (needs a CUDA device).

    python benchmarks/gpu_check.py --out OUT   [--skip-steps] [--floor] [--profile] [--attention] [--engine]
                                               [--engine-config '{"async_scheduling": false}'] [--int8-linears]
                                               [--int8-tiles] [--draft] [--one-row-tiles '[[8, 2048, 4]]']
                                               [--row-tiles '[[32, 512, 4]]']

`--floor`: the draft at L = 1..4 beside the 7B verify, and contexts to 32,768, each 7B step also pipelined as async
scheduling launches them (`pipelined_verify_ms`); `--profile`: GPU time by kernel; `--attention`: the pool attention
alone; `--engine`: the engine's loop at 1 in flight against the device's busy time; `--int8-linears`: the draft's
linears alone, bf16 against int8 weights; `--int8-tiles`: the int8 kernel at each candidate tile; `--draft`: the
draft's step alone; `--one-row-tiles` / `--row-tiles`: the tiles the int8 kernel's tuners time in this process.
Writes gpu_check.json (profile_steps.json, attention.json, engine_loop.json, int8.json, int8_tiles.json); the
tables and their reading: docs/performance.md.
"""

import os

# tests/conftest.py (imported below for its model helpers) turns on Triton's CPU interpreter for
# the test suite; here the kernels must compile for the GPU (unless a CPU caller chose the interpreter).
os.environ.setdefault("TRITON_INTERPRET", "0")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lanes.engine.core import EngineConfig, EngineCore, build_runner  # noqa: E402
from lanes.model.loader import LoadedModel, build_random_model  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.verify import VerifyBatch, VerifyLane  # noqa: E402

LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
TINYLLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096)
CONTEXT = 512
ENGINE_OVERRIDES: dict = {}  # --engine-config: EngineConfig fields set in every engine and runner built here
Step = Callable[[], None]  # one timed or profiled step, its inputs reset inside


def random_model(shape: dict, dtype: str = "bfloat16", device: str = "cuda") -> LoadedModel:
    """A model of `shape` with random weights from seed 0 (the same on every rank), built on `device`
    (on a GPU: seconds, not minutes on the host)."""
    with torch.device(device):
        return build_random_model(shape, dtype=dtype, device=device, seed=0)


@functools.cache
def shaped_models() -> dict:
    """The TinyLlama-shaped draft and the Llama-2-7B-shaped target (random bf16), built once a run."""
    return {"draft": random_model(TINYLLAMA).model, "target": random_model(LLAMA2_7B).model}


def engine_config(**fields) -> EngineConfig:
    return EngineConfig(**{**fields, **ENGINE_OVERRIDES})


def step_config(max_model_len: int, max_num_seqs: int) -> EngineConfig:
    return engine_config(max_model_len=max_model_len, max_num_seqs=max_num_seqs, prefill_chunk_tokens=64,
                         idle_prefill_tokens=64)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (the floor's denominator);
    the median copy timed by CUDA events."""
    from triton.testing import do_bench

    src = torch.randn(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, repeats: int = 10) -> float:
    """Host-timed median of `repeats` calls after one warm-up, synchronised around each (on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# ---- correctness ----------------------------------------------------------------------------

def engine_greedy_check() -> dict:
    """Engine greedy output against HF's on CUDA (kernel and CUDA graphs, its defaults there; async scheduling), with
    small prefill budgets (prompts in chunks), large ones (whole prompts batched: graphed prefill), and no drafts."""
    from tests.conftest import make_pair
    from tests.engine_helpers import hf_greedy, random_prompts, run_to_completion

    target, draft = make_pair("llama", dtype="float32")
    target.model.cuda()
    draft.model.cuda()
    prompts = random_prompts(16, 128, 1, 150, seed=7)
    refs = [hf_greedy(target, p, 24) for p in prompts]
    result = {"prompts": len(prompts)}
    for name, chunk, idle, drafter in (("chunked", 32, 64, draft), ("whole_prompts", 256, 1024, draft),
                                       ("nospec", 32, 64, None)):
        config = engine_config(max_model_len=320, max_num_seqs=16, prefill_chunk_tokens=chunk,
                               idle_prefill_tokens=idle, async_scheduling=True)
        engine = EngineCore.colocated(target, drafter, config)
        assert engine.verifier.lane.runner.graphs is not None and engine.verifier.lane.runner.attention_kernel
        outs = run_to_completion(engine, {str(i): (p, SamplingParams(max_tokens=24, ignore_eos=True))
                                          for i, p in enumerate(prompts)})
        result[name] = {"equal_to_hf_greedy": sum(outs[str(i)] == ref for i, ref in enumerate(refs)),
                        "acceptance_rate": engine.total_stats.acceptance_rate, "steps_ahead": engine.num_steps_ahead,
                        # whole-prompt prefills replayed as graphs, by (batch bucket, width bucket)
                        "prefill_graph_shapes": sorted(engine.verifier.lane.runner.prefill_graphs.graphs)}
    return result


# ---- per-step timings -----------------------------------------------------------------------

def fill_pool(runner, batch: int, length: int) -> list[int]:
    assert length + 16 <= runner.pool.shape.capacity_tokens, (length, runner.pool.shape.capacity_tokens)
    slots = [runner.pool.allocate() for _ in range(batch)]
    runner.pool.reserve(slots, [length] * batch)  # the blocks of `length` tokens each (steps add their own)
    runner.pool.kv.normal_()  # real-looking data, never zeros
    for s in slots:
        runner.pool.lengths[s] = length
    return slots


def timed_ms(pool, step: Step, slots: list[int]) -> float:
    """median_ms of `step`, then `slots` back to the pool."""
    ms = median_ms(step)
    for s in slots:
        pool.free(s)
    return ms


def verify_step(lane: VerifyLane, batch: int, drafts: int, context: int = CONTEXT,
                draft_probs: bool = True) -> tuple[Step, list[int]]:
    """A verify of `drafts` tokens a row over `batch` rows of `context` tokens of random KV, and its slots;
    without `draft_probs` the drafts count as greedy (q one-hot, built in the step)."""
    slots = fill_pool(lane.runner, batch, context - 1)
    vocab = lane.runner.vocab_size
    device = lane.pool.kv.device
    tokens = torch.randint(0, vocab, (batch, drafts), device=device)
    probs = torch.softmax(torch.randn(batch, drafts, vocab, device=device), -1) if draft_probs else None
    vb = VerifyBatch(slots, [context] * batch, [1] * batch, tokens, probs, [drafts] * batch,
                     [SamplingParams(max_tokens=16)] * batch, list(range(batch)))

    def step():
        for s in slots:
            lane.pool.lengths[s] = context - 1
        lane.verify(vb)

    return step, slots


def pipelined_verify_ms(lane: VerifyLane, batch: int, drafts: int, context: int = CONTEXT, steps: int = 8,
                        repeats: int = 5) -> tuple[float, float]:
    """The engine's cadence under async scheduling: each verify of `drafts` tokens a row (0: a decode step)
    launched after the one before it and before that one is read (`PendingVerify.launch_next`), so that the
    host's work overlaps the device's. Returns (median ms between two steps' results over `steps` steps,
    the mean context those steps read). Rows start at `context` tokens of random KV; each step commits its
    accepted drafts and one token, so the context grows (a step reserves at most 2 * drafts + 1 past it)."""
    slots = fill_pool(lane.runner, batch, context - 1)
    device = lane.pool.kv.device
    tokens = torch.randint(0, lane.runner.vocab_size, (batch, drafts), device=device)
    params, seeds = [SamplingParams(max_tokens=4 * steps * (drafts + 1))] * batch, list(range(batch))
    first = VerifyBatch(slots, [context] * batch, [1] * batch, tokens, None, [drafts] * batch, params, seeds)
    after = VerifyBatch(slots, None, None, tokens, None, [drafts] * batch, params, seeds)
    times_ms, contexts = [], []
    for repeat in range(repeats + 1):  # the first, a warm-up
        lane.pool.lengths[slots] = context - 1
        num_tokens, pending = [context] * batch, lane.launch(first)
        read, read_at = [], []  # perf_counter after each step's result, and the context that step read
        for _ in range(steps + 1):
            following = pending.launch_next(after, num_tokens)
            accepted = pending.result().num_accepted
            read.append(time.perf_counter())
            read_at.append(sum(num_tokens) / batch)
            num_tokens = [n + a + 1 for n, a in zip(num_tokens, accepted)]
            pending = following
        pending.result()  # the last one launched, untimed
        if repeat:
            times_ms.append((read[-1] - read[0]) * 1e3 / steps)
            contexts += read_at[1:]
    for s in slots:
        lane.pool.free(s)
    return statistics.median(times_ms), statistics.mean(contexts)


def decode_step(runner, batch: int, context: int = CONTEXT) -> tuple[Step, list[int]]:
    """One decode forward (1 new token a row) over `batch` rows of `context` tokens of random KV, and its slots."""
    slots = fill_pool(runner, batch, context)
    runner.pool.reserve(slots, [context + 1] * batch)  # the new token's block
    ids = torch.randint(0, runner.vocab_size, (batch, 1), device=runner.pool.kv.device)
    return lambda: runner.forward(runner.rows(slots, [context] * batch), ids), slots


def decode_forward_ms(runner, batch: int, context: int = CONTEXT) -> float:
    return timed_ms(runner.pool, *decode_step(runner, batch, context))


def draft_step(runner, batch: int, draft_len: int, temperature: float = 0.0) -> tuple[Step, list[int]]:
    """A whole draft step, L tokens for every row (L forwards, sampling on the device), and its slots."""
    from lanes.engine.sequence import Sequence
    from lanes.spec.draft import DraftLane

    slots = fill_pool(runner, batch, CONTEXT - 1)
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=1 if temperature else None)
    seqs = [Sequence(str(i), list(range(1, CONTEXT + 1)), params, i, draft_len, draft_slot=s)
            for i, s in enumerate(slots)]
    lane = DraftLane(runner)

    def step():
        for s in slots:
            runner.pool.lengths[s] = CONTEXT - 1
        lane.propose(seqs, [draft_len] * batch).tokens.cpu()

    return step, slots


def hf_eager_ms(model, batch: int, q: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.randint(0, 32000, (batch, CONTEXT), device="cuda"), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        ids = torch.randint(0, 32000, (batch, q), device="cuda")

        def step():
            model(ids, past_key_values=cache, use_cache=True)
            cache.crop(CONTEXT)

        return median_ms(step)


def kv_bytes(config: dict, batch: int, context: int, itemsize: int) -> int:
    """KV read by one forward over `batch` rows of `context` tokens (every layer's K and V)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * itemsize * batch * context


def floor_ms(model, batch: int, context: int, bandwidth_gbs: float) -> float:
    """(weights + KV read) / copy bandwidth: no forward can take less."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    itemsize = next(model.parameters()).element_size()
    return (weights + kv_bytes(model.config.to_dict(), batch, context, itemsize)) / (bandwidth_gbs * 1e9) * 1e3


def step_table(bandwidth: float) -> list[dict]:
    rows = []
    for name, role, q in (("verify Llama-2-7B, 4 drafts", "target", 5), ("draft TinyLlama, 1 token", "draft", 1)):
        model = shaped_models()[role]
        runner = build_runner(model, step_config(CONTEXT + 8, 64), draft=role == "draft")
        lane = VerifyLane(runner)
        for batch in (1, 8, 32, 64):
            ours = timed_ms(lane.pool, *verify_step(lane, batch, q - 1)) if q > 1 else decode_forward_ms(runner, batch)
            hf = hf_eager_ms(model, batch, q)
            floor = floor_ms(model, batch, CONTEXT, bandwidth)
            rows.append({"step": name, "batch": batch, "ours_ms": round(ours, 2), "hf_eager_ms": round(hf, 2),
                         "floor_ms": round(floor, 2), "ours_over_floor": round(ours / floor, 2),
                         "hf_over_ours": round(hf / ours, 2)})
            if q == 1:  # the whole draft step at L = 4 (four forwards and sampling)
                rows[-1]["draft_step_L4_ms"] = round(timed_ms(runner.pool, *draft_step(runner, batch, 4)), 2)
            print(rows[-1], flush=True)
        del runner, lane
        torch.cuda.empty_cache()
    return rows


def pipelined_row(name: str, lane: VerifyLane, batch: int, drafts: int, context: int, bandwidth: float,
                  model) -> dict:
    """`pipelined_verify_ms` as columns, over the floor at the mean context its steps read."""
    ms, mean_context = pipelined_verify_ms(lane, batch, drafts, context)
    return {f"{name}_pipelined_ms": round(ms, 3), f"{name}_pipelined_context": round(mean_context, 1),
            f"{name}_pipelined_over_floor": round(ms / floor_ms(model, batch, mean_context, bandwidth), 2)}


def floor_table(bandwidth: float) -> dict:
    """Each step over its floor: the draft at L = 1..4 (greedy and sampled) beside the 7B verify at L, at
    batch 1 and 64; the 7B decode (1 token) and verify (4 drafts) at batch 1 over long contexts."""
    out = {"draft_vs_verify": [], "contexts": []}
    models = shaped_models()
    short = step_config(CONTEXT + 16, 64)
    draft, target = build_runner(models["draft"], short, draft=True), VerifyLane(build_runner(models["target"], short))
    for batch in (1, 64):
        draft_floor = round(floor_ms(models["draft"], batch, CONTEXT, bandwidth), 3)
        verify_floor = floor_ms(models["target"], batch, CONTEXT, bandwidth)
        for draft_len in (1, 2, 3, 4):
            row = {"batch": batch, "L": draft_len, "floor_one_draft_token_ms": draft_floor}
            for label, temperature in (("greedy", 0.0), ("sampled", 0.8)):
                ms = timed_ms(draft.pool, *draft_step(draft, batch, draft_len, temperature))
                row[f"draft_{label}_ms"] = round(ms, 3)
            row["verify_ms"] = round(timed_ms(target.pool, *verify_step(target, batch, draft_len)), 3)
            row["verify_over_floor"] = round(row["verify_ms"] / verify_floor, 2)
            row.update(pipelined_row("verify", target, batch, draft_len, CONTEXT, bandwidth, models["target"]))
            row["draft_per_token_over_floor"] = round(row["draft_greedy_ms"] / draft_len / draft_floor, 2)
            print(row, flush=True)
            out["draft_vs_verify"].append(row)
    del draft, target
    torch.cuda.empty_cache()
    for context in (512, 4096, 32768):
        lane = VerifyLane(build_runner(models["target"], step_config(context + 16, 1)))
        floor = floor_ms(models["target"], 1, context, bandwidth)
        decode = decode_forward_ms(lane.runner, 1, context)
        verify = timed_ms(lane.pool, *verify_step(lane, 1, 4, context))
        row = {"context": context, "floor_ms": round(floor, 3), "decode_ms": round(decode, 3),
               "verify_L4_ms": round(verify, 3), "decode_over_floor": round(decode / floor, 2),
               "verify_over_floor": round(verify / floor, 2),
               **pipelined_row("decode", lane, 1, 0, context, bandwidth, models["target"]),
               **pipelined_row("verify_L4", lane, 1, 4, context, bandwidth, models["target"])}
        print(row, flush=True)
        out["contexts"].append(row)
        del lane
        torch.cuda.empty_cache()
    return out


# ---- where a step's GPU time goes ---------------------------------------------------------------

KINDS = (("attention (pool kernel)", ("_split_kernel", "_merge_")),
         ("GEMM", ("gemm", "Gemm", "sm90", "cutlass", "nvjet")),
         ("fused norm / rotary+KV write / act-mul", ("_add_rms_norm_kernel", "_rope_store_kernel", "_act_mul_kernel")),
         ("KV write (index_put)", ("index_put", "indexing")),
         ("elementwise / norm / rotary", ("elementwise", "reduce", "vectorized")), ("copies", ("Memcpy", "copy")))


def profile_fn(fn, steps: int = 5) -> dict:
    """GPU busy time (the sum of kernel times), span (first kernel start to last end) and kernels, per step."""
    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    by_kind: dict[str, float] = {}
    by_name: list[tuple[str, float, float]] = []  # (kernel, per step: launches, ms)
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        # Kernels only: an eager aten op (aten::argmax) also carries its kernel's time and would count it twice.
        if device_us <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_name.append((evt.key[:90], evt.count / steps, round(device_us / steps / 1e3, 4)))
        kind = next((kind for kind, keys in KINDS if any(k in evt.key for k in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + device_us / steps / 1e3
    ranges = [e.time_range for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    span_ms = (max(r.end for r in ranges) - min(r.start for r in ranges)) / steps / 1e3 if ranges else None
    return {"gpu_busy_ms_per_step": round(sum(by_kind.values()), 3),
            "gpu_span_ms_per_step": round(span_ms, 3) if span_ms else None,
            "kernels_per_step": int(sum(count for _, count, _ in by_name)),
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "by_kernel": [dict(kernel=k, launches=n, ms=ms) for k, n, ms in sorted(by_name, key=lambda r: -r[2])]}


def bandwidth_shares(step_profile: dict, model, batch: int, forwards: int) -> dict:
    """GB/s the GEMMs reach on the weights they read (embeddings excluded: a lookup reads B rows) and
    the attention kernel on the KV at CONTEXT, over the step's forwards."""
    embed = model.get_input_embeddings().weight
    gemm_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    kv = kv_bytes(model.config.to_dict(), batch, CONTEXT, embed.element_size())
    by_kind = step_profile["by_kind_ms"]
    gbs = {"GEMM": gemm_bytes * forwards / (by_kind.get("GEMM", 0) or float("nan")) / 1e6,
           "attention (pool kernel)": kv * forwards / (by_kind.get("attention (pool kernel)", 0) or float("nan")) / 1e6}
    return {**step_profile, "achieved_gbs": {k: round(v, 1) for k, v in gbs.items()}}


def profile_steps() -> dict:
    """Profiled: the 7B verify at batch 64 and 1 with 4 greedy drafts, the 7B decode forward at batch 1, and the
    TinyLlama draft at batch 1, L = 4 (GPU time by kernel kind and by kernel)."""
    config = step_config(CONTEXT + 8, 64)
    target, draft = shaped_models()["target"], shaped_models()["draft"]
    lane, drafter = VerifyLane(build_runner(target, config)), build_runner(draft, config, draft=True)
    steps = {"verify_7b_b64_l4": (target, lane.runner, 64, 1, lambda: verify_step(lane, 64, 4, draft_probs=False)),
             "verify_7b_b1_l4": (target, lane.runner, 1, 1, lambda: verify_step(lane, 1, 4, draft_probs=False)),
             "decode_7b_b1": (target, lane.runner, 1, 1, lambda: decode_step(lane.runner, 1)),
             "draft_tinyllama_b1_l4": (draft, drafter, 1, 4, lambda: draft_step(drafter, 1, 4))}
    result = {"device": torch.cuda.get_device_name()}
    for name, (model, runner, batch, forwards, make) in steps.items():
        step, slots = make()
        result[name] = bandwidth_shares(profile_fn(step), model, batch, forwards)
        for slot in slots:  # back to the pool for the next step's rows
            runner.pool.free(slot)
    print(result, flush=True)
    return result


def engine_loop(out: Path, steps: int = 128, traced: int = 16) -> dict:
    """`EngineCore.step()` at 1 in flight on the shaped pair (random bf16: drafts are rarely accepted, so a spec
    step yields about one token), L = 3: each decode step's wall time against the device's busy time, from a
    profiler trace of `traced` steps by region (lanes/engine/step_trace.py, files under `out`). The difference
    is what the loop adds to a step where the GPU waits on the host; each mode with async scheduling and without."""
    from lanes.engine.step_trace import start_trace

    models = shaped_models()
    prompt = torch.randint(1, 32000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    result = {}
    for mode in ("nospec", "nospec_host_first", "spec", "spec_host_first"):
        config = engine_config(max_model_len=2048, max_num_seqs=8, num_speculative_tokens=3, num_kv_blocks=1024,
                               async_scheduling=not mode.endswith("host_first"))
        draft = LoadedModel(models["draft"], None, "draft") if mode.startswith("spec") else None
        engine = EngineCore.colocated(LoadedModel(models["target"], None, "target"), draft, config)
        for request in range(2):  # the first warms up; the second is timed, then traced
            engine.add_request(str(request), prompt, SamplingParams(max_tokens=steps + traced + 2, ignore_eos=True))
            wall_ms, tokens = [], 0
            while engine.has_work:
                if request and len(wall_ms) == steps:
                    start_trace(engine, traced, str(out), f"engine_{mode}")
                start = time.perf_counter()
                tokens += sum(len(o.token_ids) for o in engine.step())
                wall_ms.append((time.perf_counter() - start) * 1e3)
        summary = engine.trace.finish()
        decode_ms = statistics.mean(wall_ms[1:steps])  # the first step prefills
        result[mode] = {"step_ms": round(decode_ms, 3), "tokens_per_step": round(tokens / len(wall_ms), 3),
                        "device_busy_ms_traced": summary["device_busy_ms_per_step"],
                        "host_ms_traced": summary["region_ms_per_step"],
                        "gpu_idle_share": round(1 - summary["device_busy_ms_per_step"] / decode_ms, 3),
                        "steps_ahead": engine.num_steps_ahead}
        print(mode, result[mode], flush=True)
        del engine
        torch.cuda.empty_cache()
    return result


def attention_table() -> list[dict]:
    """The pool attention alone (split + merge kernels, CUDA-graph timed) at context 512, over the engine's blocks
    of 16, for the draft's and the 7B's heads: capacity 576 as the step tables build it, 2,048 as configs/ serve."""
    from triton.testing import do_bench_cudagraph

    from lanes.model.triton_attention import pool_attention, split_count
    sms, rows = torch.cuda.get_device_properties(0).multi_processor_count, []
    for name, shape in (("tinyllama", TINYLLAMA), ("llama2_7b", LLAMA2_7B)):
        heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        dim = shape["hidden_size"] // heads
        for capacity, batch, q_len in ((c, b, q) for c in (576, 2048) for b in (1, 4, 16, 64) for q in (1, 5)):
            blocks = batch * capacity // 16
            k_pool = torch.randn(blocks, kv_heads, 16, dim, dtype=torch.bfloat16, device="cuda")
            v_pool = torch.randn_like(k_pool)
            table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, capacity // 16)
            slots = torch.arange(batch, device="cuda")
            lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device="cuda")
            query = torch.randn(batch, heads, q_len, dim, dtype=torch.bfloat16, device="cuda")
            splits = split_count(capacity, batch, kv_heads, sms)
            torch.cuda.synchronize()  # the bench runs on a stream of its own, which would not wait for the inputs
            us = 1e3 * do_bench_cudagraph(lambda: pool_attention(query, k_pool, v_pool, table, slots, lens,
                                                                 dim ** -0.5, splits), rep=20)
            kv = 2 * batch * kv_heads * (CONTEXT + q_len) * dim * 2
            rows.append(dict(model=name, capacity=capacity, batch=batch, q=q_len, splits=splits, us=round(us, 2),
                             kv_gbs=round(kv / us / 1e3, 1)))
            print(rows[-1], flush=True)
    return rows


def int8_linears(bandwidth: float) -> list[dict]:
    """Each of the draft's linears alone, bf16 cuBLAS against the int8 kernel (lanes/model/int8_linear.py), at 1 to
    64 rows: CUDA-graph time over enough copies of the weight (>= 256 MiB) that none is read from L2, the
    weight bytes' share of `bandwidth`, and the kernel's largest error against the dequantized weight in F.linear.
    The kernel runs at every row count here, also past the MAX_KERNEL_ROWS where the engine stops it."""
    from lanes.model import int8_linear as int8_module

    engine_rows, int8_module.MAX_KERNEL_ROWS = int8_module.MAX_KERNEL_ROWS, 64
    try:
        return [row for name, n, k in draft_linears() for row in _int8_linear_rows(name, n, k, bandwidth)]
    finally:
        int8_module.MAX_KERNEL_ROWS = engine_rows  # for the engines built after this


def _int8_linear_rows(name: str, n: int, k: int, bandwidth: float) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from lanes.model.int8_linear import int8_linear, quantize

    rows_out = []
    copies = max(1, -(-256 * 2**20 // (n * k * 2)))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    packed = [quantize(w) for w in dense]
    for rows in (1, 4, 16, 32, 64):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        error = (int8_linear(x, packed[0]).float() - F.linear(x, packed[0].dequantize()).float()).abs().max()
        bf16_us = 1e3 * do_bench_cudagraph(lambda: [F.linear(x, w) for w in dense]) / copies
        int8_us = 1e3 * do_bench_cudagraph(lambda: [int8_linear(x, w) for w in packed]) / copies
        row = {"linear": name, "n": n, "k": k, "rows": rows, "bf16_us": round(bf16_us, 2),
               "int8_us": round(int8_us, 2), "int8_over_bf16": round(int8_us / bf16_us, 3),
               "bf16_bw_share": round(n * k * 2 / bf16_us / 1e3 / bandwidth, 3),
               "int8_bw_share": round(n * k / int8_us / 1e3 / bandwidth, 3),
               "max_abs_error": round(float(error), 5)}
        print(row, flush=True)
        rows_out.append(row)
    del dense, packed
    torch.cuda.empty_cache()
    return rows_out


ONE_ROW_TILES = ((8, 512, 2), (8, 1024, 2), (16, 512, 4), (32, 256, 4), (2, 4096, 4), (4, 2048, 4), (4, 4096, 8),
                 (8, 2048, 4), (8, 2048, 8), (16, 2048, 8), (8, 4096, 8), (16, 1024, 4))
ROW_TILE_TILES = ((16, 512, 4), (32, 256, 4), (64, 128, 4), (64, 256, 4), (16, 1024, 4), (32, 512, 4), (16, 2048, 8),
                  (32, 1024, 8))


def int8_tile_sweep(bandwidth: float) -> list[dict]:
    """The int8 kernel at each tile (BLOCK_N, BLOCK_K, warps), one row and 16, over each of the draft's linears:
    which tiles its two tuners should time (lanes/model/int8_linear.py). Same timing as int8_linears."""
    from triton.testing import do_bench_cudagraph

    from lanes.model.int8_linear import _int8_linear_kernel, quantize

    rows_out = []
    for name, n, k in draft_linears():
        copies = max(1, -(-256 * 2**20 // (n * k)))
        packed = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
        for rows, tiles in ((1, ONE_ROW_TILES), (16, ROW_TILE_TILES)):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            for block_n, block_k, warps in tiles:
                def launch(w, block_n=block_n, block_k=block_k, warps=warps):
                    _int8_linear_kernel[(-(-n // block_n), 1)](
                        x, w.q, w.scale, w.scale, out, rows, n, k, k, HAS_BIAS=False, BLOCK_M=rows, BLOCK_N=block_n,
                        BLOCK_K=block_k, UPCAST=False, num_warps=warps)
                try:
                    us = 1e3 * do_bench_cudagraph(lambda: [launch(w) for w in packed]) / copies
                except Exception as error:  # a tile the compiler refuses (shared memory, registers): say so
                    rows_out.append({"linear": name, "rows": rows, "tile": [block_n, block_k, warps],
                                     "error": str(error).splitlines()[0][:200]})
                    continue
                rows_out.append({"linear": name, "n": n, "k": k, "rows": rows, "tile": [block_n, block_k, warps],
                                 "us": round(us, 2), "bw_share": round(n * k / us / 1e3 / bandwidth, 3)})
                print(rows_out[-1], flush=True)
        del packed
        torch.cuda.empty_cache()
    return rows_out


def draft_linears() -> tuple[tuple[str, int, int], ...]:
    """(name, N, K) of each linear of the TinyLlama-shaped draft, QKV and gate/up concatenated as the runner does."""
    hidden, inter, vocab = TINYLLAMA["hidden_size"], TINYLLAMA["intermediate_size"], TINYLLAMA["vocab_size"]
    kv = hidden // TINYLLAMA["num_attention_heads"] * TINYLLAMA["num_key_value_heads"]
    return (("qkv", hidden + 2 * kv, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter), ("lm_head", vocab, hidden))


def draft_table(bandwidth: float) -> list[dict]:
    """The draft's step alone at L = 1..4, batch 1 and 64, greedy, over its floor (the weights as loaded)."""
    model = shaped_models()["draft"]
    runner = build_runner(model, step_config(CONTEXT + 16, 64), draft=True)
    rows = []
    for batch in (1, 64):
        floor = floor_ms(model, batch, CONTEXT, bandwidth)
        for draft_len in (1, 2, 3, 4):
            ms = timed_ms(runner.pool, *draft_step(runner, batch, draft_len))
            rows.append({"batch": batch, "L": draft_len, "draft_greedy_ms": round(ms, 3),
                         "floor_one_draft_token_ms": round(floor, 3),
                         "draft_per_token_over_floor": round(ms / draft_len / floor, 2)})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--floor", action="store_true", help="the steps against their floor alone (see above)")
    parser.add_argument("--profile", action="store_true", help="GPU time by kernel kind: profile_steps.json")
    parser.add_argument("--attention", action="store_true", help="the pool attention alone: attention.json")
    parser.add_argument("--engine", action="store_true", help="the engine's loop at 1 in flight: engine_loop.json")
    parser.add_argument("--engine-config", type=json.loads, default={}, help="EngineConfig fields, JSON")
    parser.add_argument("--int8-linears", action="store_true", help="the draft's linears, bf16 and int8: int8.json")
    parser.add_argument("--int8-tiles", action="store_true", help="the int8 kernel at each tile: int8_tiles.json")
    parser.add_argument("--one-row-tiles", type=json.loads, default=None,
                        help="[[BLOCK_N, BLOCK_K, warps], ...]: the tiles the int8 kernel's one-row tuner times")
    parser.add_argument("--row-tiles", type=json.loads, default=None, help="the same for its 2-64 row tuner")
    parser.add_argument("--max-kernel-rows", type=int, default=None, help="the int8 kernel's most rows a call")
    parser.add_argument("--draft", action="store_true", help="the draft's step alone, L = 1..4 (gpu_check.json)")
    args = parser.parse_args()
    ENGINE_OVERRIDES.update(args.engine_config)
    from lanes.model import int8_linear
    for tuner, tiles in ((int8_linear._ONE_ROW, args.one_row_tiles), (int8_linear._ROW_TILES, args.row_tiles)):
        if tiles is not None:  # before any kernel is tuned
            tuner.configs = int8_linear._configs(tuple(map(tuple, tiles)))
    if args.max_kernel_rows is not None:
        int8_linear.MAX_KERNEL_ROWS = args.max_kernel_rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "engine_config": ENGINE_OVERRIDES}
    result["engine_greedy"] = engine_greedy_check()
    print(result, flush=True)  # then each row as it is timed; the whole: gpu_check.json

    def bandwidth() -> float:  # measured once, by whichever part needs it first
        if "copy_bandwidth_gbs" not in result:
            result["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)
        return result["copy_bandwidth_gbs"]

    if not args.skip_steps:
        result["steps"] = step_table(bandwidth())
    if args.floor:
        result["floor"] = floor_table(bandwidth())
    if args.draft:
        result["draft"] = draft_table(bandwidth())
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    if args.int8_linears:
        (out / "int8.json").write_text(json.dumps(int8_linears(bandwidth()), indent=2))
    if args.int8_tiles:
        (out / "int8_tiles.json").write_text(json.dumps(int8_tile_sweep(bandwidth()), indent=2))
    if args.attention:
        (out / "attention.json").write_text(json.dumps(attention_table(), indent=2))
    if args.engine:
        (out / "engine_loop.json").write_text(json.dumps(engine_loop(out), indent=2))
    if args.profile:
        torch.cuda.empty_cache()
        (out / "profile_steps.json").write_text(json.dumps(profile_steps(), indent=2))


if __name__ == "__main__":
    main()
