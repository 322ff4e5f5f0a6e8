"""Attention of a few new query tokens per sequence over that sequence's KV blocks in the pool.

Used for decode (Q = 1), verify (Q = L + 1) and short prefill chunks. It reads each row's keys and values straight from
its blocks (no gather into a batch copy): key position p of a row is at offset p % block_size of
block block_table[slot, p // block_size], looked up per key, so any block size works and a key step
may span blocks. The key axis is split so that small batches still fill the GPU (flash-decoding),
then the splits are merged. Causal: query i of row b sits at absolute
position kv_lens[b] + i and sees keys 0 .. kv_lens[b] + i, or only the last `window` of them on a
sliding-window layer; scores are soft-capped (softcap * tanh(s / softcap)) where the layer asks. The
new tokens' keys and values are already in the pool when this runs (PoolCache writes them first).

Shapes and the split count depend only on (batch, Q), never on sequence lengths, so the kernels
can be captured in CUDA graphs; each program reads its row's length from device memory and loops
over that row's keys only, so a step's attention costs what the sequences hold, not
max_model_len (a static loop over the slot's capacity cost the same at any length). Q is a runtime
argument, not a compile-time one: prefill chunks come in every width up to MAX_ROWS / group, and a
compile per width (~1 s each) stalled serving. The split count is a runtime value too (the grid's
third axis): it follows the batch, and as a compile-time constant it compiled the kernel again for
each new split count, such as an eager prefill chunk's new batch size (only whether there is one
split is compile-time: two compiles at most). Eager chunks of new shapes stalled steps 0.4-1.2 s on
an H200 (benchmarks/results/engine_loads_h200); this removes one cause of those compiles, not yet
measured there. Runs on CPU under TRITON_INTERPRET=1 (tests).
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner step
MAX_ROWS = 128  # Q * (query heads per kv head) handled by one program
# Splits the merge takes at once: 4 where there are at most 4 (batches of a few dozen rows), else 16. Two
# values, not the split count rounded up: that follows the batch, and each new value would compile the
# merge again mid-serving (see above).
SPLIT_STEPS = (4, 16)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, kvlen_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr,
    stride_qb, stride_qh, stride_qq, stride_ob, stride_oq, stride_oh,
    stride_kb, stride_kh, stride_kn, stride_table,
    scale, Q, window, softcap,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, ONE_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    kv_len = tl.load(kvlen_ptr + b)
    total = kv_len + Q  # keys in the slot after this step's writes

    rows = tl.arange(0, BLOCK_M)  # row m = (query index m // GROUP, head kv_head * GROUP + m % GROUP)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < Q * GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + q_idx[:, None] * stride_qq + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    row_last_key = kv_len + q_idx  # causal bound per row
    first_key = kv_len - window + 1  # the window of the first query; later queries' windows start later

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Each split takes an equal share of the keys this row has (whole key steps), so the splits
    # divide the row's real length, whatever max_model_len is.
    keys_per_split = tl.cdiv(tl.cdiv(total, splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, total)
    table_row = table_ptr + slot * stride_table
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_kh
    # The trip count follows the row's length read from device memory (a graph replays the same
    # launch), not the slot's capacity; blocks before every query's window are skipped too.
    lo = start + tl.maximum(first_key - start, 0) // BLOCK_N * BLOCK_N
    for block_start in range(lo, stop, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        key_ok = (keys < stop) & (keys >= first_key)  # keys before every row's window are not loaded
        key_at = _key_offsets(table_row, block_start, stop, stride_kb, stride_kn, PAGE, BLOCK_N)
        k = tl.load(k_base + key_at[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        # The cast comes after the scale: under torch.compile a Python-float scale arrives as fp64.
        s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        visible = (key_ok[None, :] & (keys[None, :] <= row_last_key[:, None])
                   & (keys[None, :] > row_last_key[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no visible key yet keep m = -inf; shift by 0 to avoid inf - inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        v = tl.load(v_base + key_at[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    if ONE_SPLIT:  # the whole row in one program (large batches): its output, and no merge kernel
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + q_idx[:, None] * stride_oq + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        base = ((b * tl.num_programs(1) + kv_head) * splits + split) * BLOCK_M
        tl.store(max_ptr + base + rows, m_i)
        tl.store(sum_ptr + base + rows, l_i)
        tl.store(acc_ptr + (base + rows[:, None]) * HEAD_DIM + dims[None, :], acc)


@triton.jit
def _key_offsets(table_row, block_start, stop, stride_kb, stride_kn, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets [BLOCK_N] of keys block_start .. block_start + BLOCK_N - 1 of one row (block_start is
    a multiple of BLOCK_N)."""
    if PAGE % BLOCK_N == 0:  # the key step lies inside one block: one table read a step
        page = tl.load(table_row + block_start // PAGE).to(tl.int64)
        return page * stride_kb + (block_start % PAGE + tl.arange(0, BLOCK_N)) * stride_kn
    else:  # a step spans blocks: one table read a key
        keys = block_start + tl.arange(0, BLOCK_N)
        page = tl.load(table_row + keys // PAGE, mask=keys < stop, other=0).to(tl.int64)
        return page * stride_kb + (keys % PAGE) * stride_kn


@triton.jit
def tanh(x):
    # tl has no tanh that the interpreter also runs; exp of a non-positive argument cannot overflow.
    t = tl.exp(-2.0 * tl.abs(x))
    return tl.where(x >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)


@triton.jit
def _merge_row_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr,
    stride_ob, stride_oq, stride_oh, splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_STEP: tl.constexpr,
):
    """Where there are more than two splits (small batches). One program per (row, kv head, query row of the
    group): the row's splits merged SPLIT_STEP at a time, each step's maxima, sums and partial outputs loaded
    at once. _merge_pair_kernel, walking the splits one by one, twice, over all BLOCK_M rows (most of them
    padding at Q = 1), was a chain of dependent loads: on an H100 the attention at batch 1 took 1.45x (the
    7B) to 4.8x (the draft at configs/' 32 splits, Q = 5) as long (benchmarks/results/kernels_h100/merge/)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.program_id(2)  # m = (query index m // GROUP, head kv_head * GROUP + m % GROUP), m < Q * GROUP
    dims = tl.arange(0, HEAD_DIM)
    first = (b * tl.num_programs(1) + kv_head) * splits * BLOCK_M + row  # this row's entry in split 0
    m_run = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, splits, SPLIT_STEP):
        split = s0 + tl.arange(0, SPLIT_STEP)
        ok = split < splits
        at = first + split * BLOCK_M
        m_split = tl.load(max_ptr + at, mask=ok, other=float("-inf"))  # [SPLIT_STEP]
        m_new = tl.maximum(m_run, tl.max(m_split, axis=0))
        # Splits that saw no visible key keep m = -inf (weight 0); shift by 0 to avoid inf - inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(m_split - shift)  # [SPLIT_STEP]
        alpha = tl.exp(m_run - shift)  # [1]: what the splits merged so far are worth now
        total = total * alpha + tl.sum(w * tl.load(sum_ptr + at, mask=ok, other=0.0), axis=0)
        part = tl.load(acc_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m_run = m_new
    out = acc / total
    q_idx = row // GROUP
    head = kv_head * GROUP + row % GROUP
    tl.store(out_ptr + b * stride_ob + q_idx * stride_oq + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_pair_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr,
    stride_ob, stride_oq, stride_oh, Q, splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Where there are two splits (batches that nearly fill the GPU): one program per (row, kv head) over all
    its query rows. A program per query row was up to 1.24x slower here (the draft's 64 rows, Q = 5: 10,240
    programs of two loads each)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    first = (b * tl.num_programs(1) + kv_head) * splits * BLOCK_M
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(splits):
        m_all = tl.maximum(m_all, tl.load(max_ptr + first + s * BLOCK_M + rows))
    shift = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(splits):
        base = first + s * BLOCK_M
        w = tl.exp(tl.load(max_ptr + base + rows) - shift)
        total += w * tl.load(sum_ptr + base + rows)
        acc += w[:, None] * tl.load(acc_ptr + (base + rows[:, None]) * HEAD_DIM + dims[None, :])
    out = acc / total[:, None]
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    ok = rows < Q * GROUP
    tl.store(out_ptr + b * stride_ob + q_idx[:, None] * stride_oq + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def merge_step(splits: int) -> int:
    """Splits _merge_row_kernel loads at once (SPLIT_STEPS)."""
    return SPLIT_STEPS[0] if splits <= SPLIT_STEPS[0] else SPLIT_STEPS[1]


def head_dim_supported(head_dim: int) -> bool:
    """tl.arange over the head dimension needs a power of two; tl.dot needs at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def split_count(capacity_tokens: int, batch: int, kv_heads: int, num_sms: int) -> int:
    """Enough key splits that batch * kv_heads * splits fills the GPU, fixed per (batch, capacity)."""
    programs = batch * kv_heads
    wanted = max(1, -(-2 * num_sms // programs))
    return min(wanted, -(-capacity_tokens // BLOCK_N))


def pool_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                   slot_ids: torch.Tensor, kv_lens: torch.Tensor, scale: float, splits: int,
                   window: int | None = None, softcap: float | None = None, num_warps: int = 4,
                   num_stages: int = 2, block_n: int = BLOCK_N) -> torch.Tensor:
    """query [B, H, Q, D]; pools [blocks, kv_heads, block_size, D]; block_table [slots, blocks_per_slot]
    int32; returns [B, Q, H, D]. `window`: keys each query sees, itself included (None: all before
    it); `softcap`: tanh cap on scores. num_warps / num_stages / block_n (keys a step): the split
    kernel's launch. Two stages, not Triton's default three: on an H200, 7B shapes at 64 rows, Q = 1 took
    148 against 169 us over blocks of 16, and the contiguous layout 144 against 150
    (benchmarks/results/gpu_evidence_h200/attention_kernel_bd92372)."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, page = k_pool.shape[1], k_pool.shape[2]
    capacity = block_table.shape[1] * page
    assert k_pool.stride(-1) == 1 and query.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    assert block_table.stride(-1) == 1
    group = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(q_len * group))
    work = (batch, kv_heads, splits, block_m)
    acc = torch.empty(*work, head_dim, dtype=torch.float32, device=query.device)
    row_max = torch.empty(work, dtype=torch.float32, device=query.device)
    row_sum = torch.empty(work, dtype=torch.float32, device=query.device)
    out = torch.empty(batch, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    _split_kernel[(batch, kv_heads, splits)](
        query, k_pool, v_pool, block_table, slot_ids, kv_lens, acc, row_max, row_sum, out,
        query.stride(0), query.stride(1), query.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_table.stride(0),
        scale, q_len, window if window is not None else capacity + q_len, softcap or 1.0,
        PAGE=page, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        # float32 models keep float32 products (tf32 would differ from the reference in the 4th digit)
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SOFTCAP=softcap is not None,
        # A compile-time branch: as a runtime test of the split count it cost the two-split kernel 1-6 % on an H100.
        ONE_SPLIT=splits == 1, num_warps=num_warps, num_stages=num_stages,
    )
    if splits == 2:
        _merge_pair_kernel[(batch, kv_heads)](
            acc, row_max, row_sum, out, out.stride(0), out.stride(1), out.stride(2), q_len, splits,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m,
        )
    elif splits > 2:  # one warp a program: it holds SPLIT_STEP x HEAD_DIM values (slower with four)
        _merge_row_kernel[(batch, kv_heads, q_len * group)](
            acc, row_max, row_sum, out, out.stride(0), out.stride(1), out.stride(2), splits,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, SPLIT_STEP=merge_step(splits), num_warps=1,
        )
    return out
