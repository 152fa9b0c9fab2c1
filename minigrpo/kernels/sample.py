"""Fused two-level sampling in Triton: one reduction pass over the logits, no (B, V) temporaries.

The draw is the reference's (`minigrpo.model.sampling`, whose module doc explains it), with x = logits / T:
  1. grid (B, NC): each program reduces one chunk to its max m_c and its sum s_c of exp(x - m_c): per
     element a load, a max, one exp and an add, so this pass is bound by memory, not arithmetic.
  2. grid (B,): each program weighs its row's chunks, w_c = s_c exp(m_c - M), draws a chunk by inverse
     CDF with the uniform at index M31, and runs Gumbel-max over that chunk alone (the reference's hash
     of (seed, counter, vocabulary index)).
Same noise as the reference, so both samplers draw the same token, up to float rounding where the target
lands on a chunk boundary (the masses are summed in another order) or a tie. Plain temperature sampling
only (top-k / top-p need a sort: the reference handles them).

Shape legend: B rows, V vocabulary, NC = ceil(V / chunk) chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from minigrpo.kernels.decode_attention import INTERPRETED, check_runnable

M31 = 0x7FFFFFFF  # the hash's 31-bit mask, and the index of the chunk draw's uniform, as in the reference


@triton.jit
def _mix31(x):
    # minigrpo.model.sampling.mix31 on uint32 lanes holding [0, 2^31): (x * c) mod 2^31 only needs the low 31
    # bits of the product, which uint32's defined wrap-around keeps exactly.
    x = x ^ (x >> 16)
    x = (x * tl.full([], 0x7FEB352D, tl.uint32)) & tl.full([], 0x7FFFFFFF, tl.uint32)
    x = x ^ (x >> 15)
    x = (x * tl.full([], 0x5BD1E995, tl.uint32)) & tl.full([], 0x7FFFFFFF, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, idx):
    # minigrpo.model.sampling.uniform_noise at uint32 indices idx: the top 23 hash bits -> (0, 1).
    return ((_mix31(_mix31(key ^ idx)) >> 8).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _load_x(row, idx, V, temperature, UNIT_T: tl.constexpr):
    # x = logits / T in fp32 at indices idx, -inf past V; at T = 1 no division (x / 1 is exact anyway).
    x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if not UNIT_T:
        # Division, not a reciprocal: the reference's rounding. .to: torch.compile may pass T as fp64.
        x = (x / temperature).to(tl.float32)
    return x


@triton.jit
def _chunk_mass_kernel(logits_ptr, m_ptr, s_ptr, stride_b, V, temperature, NC: tl.constexpr,
                       CHUNK: tl.constexpr, UNIT_T: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = logits_ptr + b.to(tl.int64) * stride_b
    x = _load_x(row, c * CHUNK + tl.arange(0, CHUNK), V, temperature, UNIT_T)   # (CHUNK,)
    M = tl.max(x, 0)
    S = tl.sum(tl.exp(x - tl.where(M == float("-inf"), 0.0, M)), 0)           # a chunk of -inf: S = 0
    tl.store(m_ptr + b * NC + c, M)
    tl.store(s_ptr + b * NC + c, S)


@triton.jit
def _chunk_draw_kernel(logits_ptr, seeds_ptr, counters_ptr, m_ptr, s_ptr, tok_ptr, logp_ptr, stride_b, V,
                       temperature, NC: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
                       UNIT_T: tl.constexpr, M31: tl.constexpr):
    b = tl.program_id(0)
    m31 = tl.full([], M31, tl.uint32)
    seed = (tl.load(seeds_ptr + b) & M31).to(tl.uint32)
    ctr = (tl.load(counters_ptr + b) & M31).to(tl.uint32)
    key = _mix31((_mix31(seed) + ctr) & m31)           # both < 2^31: the sum fits in uint32
    # Level 1: the chunk. Padding lanes and chunks of only -inf have s = 0, so w = 0.
    c = tl.arange(0, NC_P2)
    m = tl.load(m_ptr + b * NC + c, mask=c < NC, other=float("-inf"))   # (NC_P2,)
    s = tl.load(s_ptr + b * NC + c, mask=c < NC, other=0.0)             # (NC_P2,)
    M = tl.max(m, 0)                                   # every row has a finite entry, so M is finite
    w = s * tl.exp(m - M)                              # (NC_P2,) each chunk's share of sum exp(x - M)
    cum = tl.cumsum(w, 0)                              # (NC_P2,)
    total = tl.max(cum, 0)                             # the last cumsum: it never decreases
    # The first chunk whose cumsum exceeds u * total (< total: see the reference; NC - 1 only for NaN rows).
    chunk = tl.min(tl.where(cum > _uniform(key, m31) * total, c, NC - 1), 0)
    # Level 2: Gumbel-max over the chosen chunk.
    row = logits_ptr + b.to(tl.int64) * stride_b
    idx = chunk * CHUNK + tl.arange(0, CHUNK)                                   # (CHUNK,)
    x = _load_x(row, idx, V, temperature, UNIT_T)                               # (CHUNK,)
    score = x - tl.log(-tl.log(_uniform(key, idx.to(tl.uint32))))               # (CHUNK,)
    tok = tl.min(tl.where(score == tl.max(score, 0), idx, V), 0)                # the first of equal maxima
    tl.store(tok_ptr + b, tok.to(tl.int64))
    tl.store(logp_ptr + b, _load_x(row, tok, V, temperature, UNIT_T) - (M + tl.log(total)))


@triton_op("minigrpo::fused_sample", mutates_args=())
def fused_sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                 temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B,) int64 drawn from softmax(logits / temperature) and their log-probs (B,) fp32.
    logits (B, V) with unit stride in V; seeds, counters (B,) int64; chunk: the draw's chunk, a power of two."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (batch, vocab) with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    B, V = logits.shape
    if seeds.shape != (B,) or counters.shape != (B,) or seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"seeds and counters must be int64 ({B},), got {seeds.dtype} {tuple(seeds.shape)} "
                         f"and {counters.dtype} {tuple(counters.shape)}")
    if not temperature > 0:
        raise ValueError(f"fused_sample needs temperature > 0 (greedy is an argmax), got {temperature}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16 (a Triton block), got {chunk}")
    # Every index of every (padded) chunk then fits int32 and stays below M31, the chunk draw's index.
    if V == 0 or V > M31 + 1 - chunk:
        raise ValueError(f"vocabulary size must be in [1, 2^31 - {chunk}], got {V}")
    check_runnable(logits.device)
    NC = triton.cdiv(V, chunk)
    m = torch.empty(B, NC, dtype=torch.float32, device=logits.device)   # (B, NC) chunk max of x
    s = torch.empty_like(m)                                             # (B, NC) chunk sum of exp(x - m)
    unit_t = temperature == 1.0
    wrap_triton(_chunk_mass_kernel)[(B, NC)](logits, m, s, logits.stride(0), V, temperature, NC=NC,
                                             CHUNK=chunk, UNIT_T=unit_t, num_warps=4)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    wrap_triton(_chunk_draw_kernel)[(B,)](logits, seeds, counters, m, s, tokens, logp, logits.stride(0), V,
                                          temperature, NC=NC, NC_P2=triton.next_power_of_2(NC),
                                          CHUNK=chunk, UNIT_T=unit_t, M31=M31, num_warps=8)
    return tokens, logp


if INTERPRETED:
    # As in decode_attention.py: the interpreter needs real data, so Dynamo gets a shape-only fake.
    @fused_sample.register_fake
    def _(logits, seeds, counters, temperature, chunk):
        B = logits.shape[0]
        return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
