"""Paged decode attention in Triton: one new token per sequence, rotated, stored and attended in one launch.

Decode attention is pure memory traffic, so the design reads the cache once, straight from the pool:
* No gather: each token's page is looked up in the block table inside the kernel, and K/V rows load as
  D contiguous elements (16-byte vector loads).
* One program per (sequence, KV head, split) serves all n_rep query heads of the group with `tl.dot`s,
  so each K/V tile is read once per group.
* The new token's RoPE and cache store are folded in, one launch fewer per layer (the decode step is bound
  by its kernel count, bench/NOTES.md): every program rotates its q heads; the split that holds the new
  position rotates k, starts its softmax with the new token from registers and writes k and v to the cache.
* Split-K over the sequence fills the GPU when batch * kv_heads cannot: each split runs an online softmax
  (fp32, log2 domain) and writes a normalised partial output and its log-sum-exp; a second kernel merges them.

Registered through `torch.library.triton_op`, so torch.compile(fullgraph=True) traces it with no graph break.

Shape legend: B sequences, Hq query heads, Hkv KV heads, D head dim, P pages in the pool, S tokens per
page, M block-table width (pages per sequence), NS splits of the sequence.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK_N = 64                 # tokens per inner-loop step
MIN_TOKENS_PER_SPLIT = 128   # a split shorter than this costs more in merge traffic than it gains
MAX_SPLITS = 32
PROGRAMS_PER_SM = 3          # splits cost a merge and fp32 partials: split only to fill the GPU (bench/NOTES.md)
LOG2E = 1.4426950408889634


@triton.jit
def _rotate(x_ptr, d, partner, sign, c, s, mask, DT: tl.constexpr):
    """RoPE of the rows at x_ptr + d (HF Qwen2's x * cos + rotate_half(x) * sin), rounding each product and
    then the sum to DT, as the model's `apply_rope` does; rotate_half reads column (d + D/2) % D, negated
    in the first half. c, s: the position's table rows, already rounded to DT."""
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    return ((x * c).to(DT).to(tl.float32) + sign * (x_partner * s).to(DT).to(tl.float32)).to(DT)


@triton.jit
def _attend_cached(q, m, l, acc, table_row_ptr, k_pool_ptr, v_pool_ptr, kvh, lo, hi, qk_scale, HKV: tl.constexpr,
                   D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax (m, l, acc: max, denominator, numerator, log2 units) of q (BLOCK_H, D) carried over
    cached positions [lo, hi) of one sequence, whose pages table_row_ptr lists, in BLOCK_N-token steps."""
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)                        # (BLOCK_N,) positions in the sequence
        tok_ok = tok < hi
        page = tl.load(table_row_ptr + tok // PAGE, mask=tok_ok, other=0)
        # int64: page * PAGE * HKV * D overflows int32 on large pools.
        row = (page.to(tl.int64) * PAGE + tok % PAGE) * (HKV * D) + kvh * D   # (BLOCK_N,) element offsets
        kv_off = row[:, None] + d[None, :]                                     # (BLOCK_N, D)
        k = tl.load(k_pool_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_pool_ptr + kv_off, mask=tok_ok[:, None], other=0.0)

        # Under torch.compile the Python-float scale can arrive as fp64; the cast keeps the loop-carried
        # softmax state fp32 (Triton rejects a loop variable whose type changes).
        s_blk = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale).to(tl.float32)  # (BLOCK_H, BLOCK_N)
        s_blk = tl.where(tok_ok[None, :], s_blk, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_blk, 1))    # finite: every step has at least one valid token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s_blk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt, stride_ob, stride_oh, stride_os,
    qk_scale, max_tokens,
    HKV: tl.constexpr, N_REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    DT: tl.constexpr = q_ptr.dtype.element_ty
    # fp32 inputs (tests) get exact products; bf16/fp16 ignore the setting and use tensor cores.
    DOT_PRECISION: tl.constexpr = "ieee" if DT == tl.float32 else "tf32"
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_tokens)  # clamp: never walk off the table row
    new = seq_len - 1                                              # the new token's position (-1: empty slot)
    # Every split gets an equal share rounded up to whole blocks; trailing splits may be empty.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    # RoPE at the new token's position, for this group's query heads and (below) its new key. The caller
    # gathers each sequence's cos/sin row once per step: no load here waits for seq_lens.
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    c = tl.load(cos_ptr + b * D + d).to(tl.float32)               # (D,) already rounded to DT
    s = tl.load(sin_ptr + b * D + d).to(tl.float32)
    rows = tl.arange(0, BLOCK_H)                                   # query heads of this group (padded)
    row_ok = rows < N_REP
    heads = kvh * N_REP + rows
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = _rotate(q_rows, d[None, :], partner[None, :], sign[None, :], c[None, :], s[None, :], row_ok[:, None],
                DT)                                                # (BLOCK_H, D)

    # The split that holds the new token starts its online softmax with it, from registers, and stores its K/V
    # in the cache. First, so that these loads overlap the loop's instead of trailing it; no program of this
    # launch reads that row, so the store needs no ordering.
    owner = (new >= lo) & (new < hi)
    mine = d < tl.where(owner, D, 0)                               # (D,) all true or all false
    k_new = _rotate(k_ptr + b * stride_kb + kvh * stride_kh, d, partner, sign, c, s, mine, DT)  # (D,)
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=mine, other=0.0)         # (D,)
    new_page = tl.load(block_table_ptr + b * stride_bt + tl.maximum(new, 0) // PAGE)  # in the row: new < M * S
    new_row = (new_page.to(tl.int64) * PAGE + new % PAGE) * (HKV * D) + kvh * D
    tl.store(k_pool_ptr + new_row + d, k_new, mask=mine)
    tl.store(v_pool_ptr + new_row + d, v_new, mask=mine)
    s_new = (tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale).to(tl.float32)  # (BLOCK_H,)

    # Online softmax state (log2 units): max, denominator, numerator; with the new token, exp2(0) = 1 times v.
    m = tl.where(owner, s_new, float("-inf"))                      # (BLOCK_H,)
    l = tl.where(owner, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32) + v_new.to(tl.float32)[None, :]  # v_new is 0 unless owner
    m, l, acc = _attend_cached(q, m, l, acc, block_table_ptr + b * stride_bt, k_pool_ptr, v_pool_ptr, kvh, lo,
                               tl.minimum(hi, new), qk_scale, HKV, D, PAGE, BLOCK_N, DOT_PRECISION)  # positions < new

    # An empty split (or seq_len 0) has l == 0: output 0 and lse -inf, which the merge weighs as nothing.
    has_any = l > 0
    out = acc / tl.where(has_any, l, 1.0)[:, None]
    lse = tl.where(has_any, m + tl.log2(tl.where(has_any, l, 1.0)), float("-inf"))
    o_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptr + o_off, out, mask=row_ok[:, None])             # casts to o's dtype
    tl.store(lse_ptr + (b * HKV * N_REP + heads) * NUM_SPLITS + split, lse, mask=row_ok)  # (B, Hq, NS)


@triton.jit
def _merge_splits_kernel(o_part_ptr, lse_ptr, out_ptr,
                         NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(0)                                          # flat (sequence, query head)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + bh * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))   # (SPLITS_P2,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)       # every split empty (seq_len 0): weights become 0
    w = tl.exp2(lse - m)
    o = tl.load(o_part_ptr + (bh * NUM_SPLITS + s)[:, None] * D + d[None, :],
                mask=s_ok[:, None], other=0.0)                                     # (SPLITS_P2, D)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + bh * D + d, out)


def check_decode_inputs(q, k_pool, v_pool, block_table, seq_lens) -> None:
    """Assert the paged-KV decode contract on metadata only (no device sync; safe under torch.compile)."""
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, q_heads, head_dim), got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be (pages, page_size, kv_heads, head_dim) for one "
                         f"layer (pass pool[layer]); got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    P, S, Hkv, Dk = k_pool.shape
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, the KV pool has {Dk}")
    if Hq % Hkv:
        raise ValueError(f"q_heads ({Hq}) must be a multiple of kv_heads ({Hkv}) for grouped-query attention")
    if not q.dtype == k_pool.dtype == v_pool.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k_pool, v_pool must share one dtype, float16, bfloat16 or float32; got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 (batch={B}, max_pages), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and q.stride(-1) == 1 and block_table.stride(-1) == 1):
        raise ValueError("k_pool and v_pool must be contiguous, and q and block_table contiguous in their last dim")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 (batch={B},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    devices = {t.device for t in (q, k_pool, v_pool, block_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all decode-attention inputs must be on one device, got {sorted(map(str, devices))}")


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small grids keep tests fast


def choose_num_splits(batch: int, kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Splits of each sequence so that batch * kv_heads * splits programs fill the GPU. Static inputs only
    (max_tokens = block-table width * page size), so a captured CUDA graph stays valid for any seq_lens."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, batch * kv_heads)
    cap = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


# TRITON_INTERPRET=1 runs @triton.jit functions on CPU tensors (the tests), if it was set before triton's
# first import (which builds tl.max and the rest); otherwise the two checks disagree.
INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.JITFunction) and \
    not isinstance(tl.max, triton.runtime.JITFunction)


def check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}); to run them on the CPU, set "
                           "TRITON_INTERPRET=1 before anything imports triton (torch._dynamo does)")


def check_new_token_inputs(q, k, v, k_pool, cos, sin) -> None:
    """Assert the new token's side of the contract (metadata only): k, v (B, Hkv, D) in q's dtype, the rotation
    rows cos, sin (B, D) in q's dtype, last dims contiguous (q, k, v may be views of one fused projection)."""
    B, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    if k.shape != (B, Hkv, D) or v.shape != (B, Hkv, D):
        raise ValueError(f"k and v must be (batch={B}, kv_heads={Hkv}, head_dim={D}), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if not k.dtype == v.dtype == q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cos.shape != (B, D) or sin.shape != (B, D) or not cos.dtype == sin.dtype == q.dtype:
        raise ValueError(f"cos and sin must be this step's rotation rows, (batch={B}, head_dim={D}) in q's dtype "
                         f"{q.dtype}, got {cos.dtype} {tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("cos and sin must be contiguous, and k and v contiguous in their last dim")
    if len({t.device for t in (q, k, v, cos, sin)}) != 1:
        raise ValueError("all decode-attention inputs must be on one device")


# Defined before the op on purpose: triton_op records the kernels an op launches (torch.compile's cache
# key) by reading the source of the functions it calls, which must exist when the decorator runs.
def launch_paged_decode(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale: float,
                        num_splits: int = 0, block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int = 0):
    """Both kernels (inputs already checked). -> (B, Hq, D). num_splits and num_stages 0 pick them from
    static shapes; block_n, num_warps and num_stages are what `bench/attention.py --sweep` varies."""
    check_runnable(q.device)
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_pool.shape
    M = block_table.shape[1]
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernel, got {D}")
    if S & (S - 1):
        raise ValueError(f"page_size must be a power of two for the Triton kernel, got {S}")
    NS = num_splits or choose_num_splits(B, Hkv, M * S, sm_count(q.device))
    # Fewer stages at D = 128: each stage buffers a K and a V tile, and the shared memory per program grows with both.
    num_stages = num_stages or (2 if D >= 128 else 3)
    n_rep = Hq // Hkv

    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)                        # (B, Hq, D)
    lse = torch.empty((B, Hq, NS), dtype=torch.float32, device=q.device)                 # (B, Hq, NS)
    # One split writes the final output directly; several write fp32 partials for the merge.
    o_part = out if NS == 1 else torch.empty((B, Hq, NS, D), dtype=torch.float32, device=q.device)
    stride_os = 0 if NS == 1 else o_part.stride(2)                                       # o_part (B, Hq, NS, D)
    wrap_triton(_paged_decode_kernel)[(B, Hkv, NS)](
        q, k, v, cos, sin, k_pool, v_pool, block_table, seq_lens, o_part, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0),
        o_part.stride(0), o_part.stride(1), stride_os,
        scale * LOG2E, M * S,
        HKV=Hkv, N_REP=n_rep, BLOCK_H=max(16, triton.next_power_of_2(n_rep)), D=D, PAGE=S,
        BLOCK_N=block_n, NUM_SPLITS=NS, num_warps=num_warps, num_stages=num_stages,
    )
    if NS > 1:
        wrap_triton(_merge_splits_kernel)[(B * Hq,)](
            o_part, lse, out, NUM_SPLITS=NS, SPLITS_P2=triton.next_power_of_2(NS), D=D,
            num_warps=1 if D <= 64 else 2,
        )
    return out


@triton_op("minigrpo::paged_decode_attention", mutates_args={"k_pool", "v_pool"})
def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, scale: float, num_splits: int = 0) -> torch.Tensor:
    """The decode step's attention for one new token per sequence, in one launch (two with splits): rotate q and
    k by cos, sin (B, D) (the model's tables at position seq_lens[b] - 1, in q's dtype), store k and v at that
    position, and return softmax(q K^T * scale) V over the sequence's seq_lens[b] tokens, (B, Hq, D) in q's
    dtype. q (B, Hq, D), k, v (B, Hkv, D) before RoPE; the cache as in `check_decode_inputs`, except that
    position seq_lens[b] - 1 is written, never read. num_splits: 0 picks it from static shapes, >= 1 forces it."""
    check_decode_inputs(q, k_pool, v_pool, block_table, seq_lens)
    check_new_token_inputs(q, k, v, k_pool, cos, sin)
    if num_splits < 0:
        raise ValueError(f"num_splits must be 0 (auto) or positive, got {num_splits}")
    return launch_paged_decode(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale, num_splits)


if INTERPRETED:
    # The interpreter needs real data, so Dynamo gets a shape-only fake instead of tracing the launches.
    @paged_decode_attention.register_fake
    def _(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale, num_splits=0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
