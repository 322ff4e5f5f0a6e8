"""GPU-side work, no Ray: one package a concept.

engine/    the decode loop (step: schedule, run, postprocess), its scheduler, requests, outputs, async front
model/     loading the pair, model families, the runner of one batched forward, fused kernels, attention
kv/        the paged KV pool, its block allocator, the prefix cache, how many blocks fit
spec/      the lanes of speculation: prefill, draft (or n-gram lookup), verify, rejection, rollback, counters
sample/    request parameters, sampling, penalties, logprobs, grammars, detokenisation
parallel/  tensor parallelism: sharding, what rank 0 sends its workers, the workers, KV hand-over per rank
device/    the device itself: host/device copies without stalls, CUDA streams by lane, sticky faults

Modules import each other by full path (`from lanes.kv.pool import KVPool`); no import circle
forms anywhere (tests/test_layout.py).
"""
