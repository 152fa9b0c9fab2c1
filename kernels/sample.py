"""Fused Gumbel-max sampling in Triton: one pass over the logits, no (B, V) temporaries.

The PyTorch sampler (`minigrpo.sampling.sample`) is the readable reference. Run eagerly it makes about
20 passes over a (B, V) tensor: the counter hash, the Gumbel transform, log_softmax, argmax. That
measured 0.92 ms of a 3.4 ms decode step at 64 x 151936 on the H200, and 0.12 ms even when Inductor
fuses it (bench/NOTES.md). Here each row is streamed once and these are kept in registers:
  - the online log-sum-exp of x = logits / T, for the sampled token's log-prob;
  - the running argmax of x + Gumbel(seed, counter, index), the sample.
The noise is the reference's: the same 31-bit hash of (seed, counter, vocabulary index), so a sequence
draws the same token with either sampler (up to ties at float rounding).

Why it is shaped this way (measured on the H200, or counted in the sm_90 SASS; see bench/NOTES.md):
* The work is arithmetic, not bytes. The loop first ran 102 instructions per element; it now runs 67.
  - Half of the 102 were the two `tl.log` calls (libdevice's software logf). The outer log of
    -log(-log(u)) now uses the hardware lg2 (`fast_logf`): its error of about 2^-22 relative to log(E)
    cannot reorder scores whose gaps are far larger.
  - The inner log must stay precise. -log(u) for u near 1 is the small Exp(1) draw that makes a token
    win, and there the hardware lg2's absolute error (~2^-22) would be largest.
  - The online sum of exponentials takes one exp per element, not two. exp(-|x - m|) serves both
    cases: a new maximum rescales the sum, any other value adds to it.
  - There is no division at temperature 1, the RL default. Dividing by 1 is exact, so the draws do
    not change.
  - About 20 instructions are the hash. The reference keeps its 31-bit hash values in int64, so that
    every backend computes them without overflow. Here the low 31 bits of each product are computed in
    uint32 (wrap-around is defined, the bits are the same), instead of emulated int64 multiplies.
* One program per row left the GPU half idle at 64 rows (0.24 ms). The vocabulary is split into chunks
  so that rows x chunks fills every SM several times; a small second kernel merges the chunks (max,
  rescaled sum, first argmax), as split-K decode attention merges its splits. Measured: 0.067 ms at
  64 x 151936, 0.219 ms at 256 x 151936.
* Accumulators are per lane (element-wise max / select); the cross-lane reductions run once per chunk,
  not once per block.

Plain temperature sampling only (no top-k / top-p: those need a sort; the reference handles them).
Registered as `torch.ops.minigrpo.gumbel_sample`, so it is one opaque node inside torch.compile and two
plain launches inside CUDA graphs. The chunk count depends only on static shapes.

Shape legend: B rows, V vocabulary, NC vocabulary chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from triton.language.extra import libdevice

from kernels.decode_attention import INTERPRETED, _num_sms, check_runnable

BLOCK_V = 1024            # elements per lane-vector step
PROGRAMS_PER_SM = 8       # enough resident programs to hide the logits loads behind the hash arithmetic


@triton.jit
def _mix31(x):
    # minigrpo.sampling.mix31 on uint32 lanes holding [0, 2^31): (x * c) mod 2^31 only needs the low 31
    # bits of the product, which uint32's defined wrap-around keeps exactly.
    x = x ^ (x >> 16)
    x = (x * tl.full([], 0x7FEB352D, tl.uint32)) & tl.full([], 0x7FFFFFFF, tl.uint32)
    x = x ^ (x >> 15)
    x = (x * tl.full([], 0x5BD1E995, tl.uint32)) & tl.full([], 0x7FFFFFFF, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_chunk_kernel(logits_ptr, seeds_ptr, counters_ptr, m_ptr, s_ptr, best_ptr, idx_ptr,
                         stride_b, V, chunk, temperature, NC: tl.constexpr, BLOCK: tl.constexpr,
                         UNIT_T: tl.constexpr, FAST_LOG: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    m31 = tl.full([], 0x7FFFFFFF, tl.uint32)
    seed = (tl.load(seeds_ptr + b) & 0x7FFFFFFF).to(tl.uint32)
    ctr = (tl.load(counters_ptr + b) & 0x7FFFFFFF).to(tl.uint32)
    key = _mix31((_mix31(seed) + ctr) & m31)          # both < 2^31: the sum fits in uint32
    row = logits_ptr + b.to(tl.int64) * stride_b
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)
    m = tl.full([BLOCK], float("-inf"), tl.float32)    # per-lane running max of x
    s = tl.zeros([BLOCK], tl.float32)                  # per-lane sum of exp(x - m)
    best = tl.full([BLOCK], float("-inf"), tl.float32) # per-lane best x + gumbel
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < hi
        x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32)
        if not UNIT_T:
            # .to: under torch.compile the Python-float temperature can arrive as fp64, which would change
            # the loop-carried types (Triton rejects that). Division, not a reciprocal: the reference's rounding.
            x = (x / temperature).to(tl.float32)
        bits = _mix31(_mix31(key ^ idx.to(tl.uint32)))
        u = ((bits >> 7).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        e = -tl.log(u)                                 # Exp(1): precise (module doc)
        if FAST_LOG:
            score = x - libdevice.fast_logf(e)         # masked lanes: -inf
        else:                                          # the CPU interpreter has no fast_logf
            score = x - tl.log(e)
        better = score > best                          # strict: the earlier index wins a tie
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, score, best)
        # s = sum exp(x - m) per lane with one exp: d = exp(-|x - m|) rescales for a new max, else adds.
        # A lane with nothing valid yet (m = -inf) gets d = 0, so its first value sets s = 1.
        d = tl.exp(-tl.abs(x - m))
        s = tl.where(x == float("-inf"), s, tl.where(x > m, s * d + 1.0, s + d))
        m = tl.maximum(m, x)
    M = tl.max(m, 0)
    S = tl.sum(s * tl.exp(m - tl.where(M == float("-inf"), 0.0, M)), 0)
    BEST = tl.max(best, 0)
    IDX = tl.min(tl.where(best == BEST, best_idx, V), 0)      # first index among equal maxima
    out = b * NC + c
    tl.store(m_ptr + out, M)
    tl.store(s_ptr + out, S)
    tl.store(best_ptr + out, BEST)
    tl.store(idx_ptr + out, IDX)


@triton.jit
def _gumbel_merge_kernel(logits_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, tok_ptr, logp_ptr, stride_b, V,
                         temperature, NC: tl.constexpr, NC_P2: tl.constexpr):
    b = tl.program_id(0)
    c = tl.arange(0, NC_P2)
    ok = c < NC
    m = tl.load(m_ptr + b * NC + c, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + b * NC + c, mask=ok, other=0.0)
    best = tl.load(best_ptr + b * NC + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + b * NC + c, mask=ok, other=V)
    M = tl.max(m, 0)
    lse = M + tl.log(tl.sum(s * tl.exp(m - M), 0))     # every row has >= 1 element, so M is finite
    BEST = tl.max(best, 0)
    tok = tl.min(tl.where(best == BEST, idx, V), 0)    # chunks are in index order: first index wins a tie
    x = (tl.load(logits_ptr + b.to(tl.int64) * stride_b + tok).to(tl.float32) / temperature).to(tl.float32)
    tl.store(tok_ptr + b, tok.to(tl.int64))
    tl.store(logp_ptr + b, x - lse)


def num_chunks(batch: int, vocab: int, num_sms: int) -> int:
    """Vocabulary chunks per row: enough programs to fill the GPU, at least one block per chunk."""
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms, batch), triton.cdiv(vocab, BLOCK_V)))


@triton_op("minigrpo::gumbel_sample", mutates_args=())
def gumbel_sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B,) int64 drawn from softmax(logits / temperature) and their log-probs (B,) fp32.

    logits (B, V) fp32/bf16/fp16 with unit stride in V; seeds, counters (B,) int64 on the same device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (batch, vocab) with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    B, V = logits.shape
    if seeds.shape != (B,) or counters.shape != (B,) or seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"seeds and counters must be int64 ({B},), got {seeds.dtype} {tuple(seeds.shape)} "
                         f"and {counters.dtype} {tuple(counters.shape)}")
    if not temperature > 0:
        raise ValueError(f"gumbel_sample needs temperature > 0 (greedy is an argmax), got {temperature}")
    if V == 0 or V >= 2**31:
        raise ValueError(f"vocabulary size must be in [1, 2^31), got {V}")
    check_runnable(logits.device)
    NC = num_chunks(B, V, _num_sms(logits.device))
    chunk = triton.cdiv(triton.cdiv(V, NC), BLOCK_V) * BLOCK_V
    NC = triton.cdiv(V, chunk)                         # rounding chunks up to whole blocks can leave fewer
    dev = logits.device
    m, s, best = (torch.empty(B, NC, dtype=torch.float32, device=dev) for _ in range(3))  # (B, NC) each
    idx = torch.empty(B, NC, dtype=torch.int32, device=dev)                               # (B, NC)
    wrap_triton(_gumbel_chunk_kernel)[(B, NC)](logits, seeds, counters, m, s, best, idx, logits.stride(0), V,
                                               chunk, temperature, NC=NC, BLOCK=BLOCK_V,
                                               UNIT_T=temperature == 1.0, FAST_LOG=not INTERPRETED, num_warps=4)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    wrap_triton(_gumbel_merge_kernel)[(B,)](logits, m, s, best, idx, tokens, logp, logits.stride(0), V,
                                            temperature, NC=NC, NC_P2=triton.next_power_of_2(NC), num_warps=1)
    return tokens, logp


if INTERPRETED:
    # As in decode_attention.py: the interpreter needs real data, so Dynamo gets a shape-only fake.
    @gumbel_sample.register_fake
    def _(logits, seeds, counters, temperature):
        B = logits.shape[0]
        return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
