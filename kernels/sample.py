"""Fused Gumbel-max sampling in Triton: one pass over each row of logits, no (B, V) temporaries.

The PyTorch sampler (`minigrpo.sampling.sample`) is the readable reference. Run eagerly it makes about
20 passes over a (B, V) tensor: the counter hash, the Gumbel transform, log_softmax, argmax. That
measured 0.92 ms of a 3.4 ms decode step at 64 x 151936 on the H200 (bench/NOTES.md). Here one program
per row streams the row once and keeps, in registers:
  - the online log-sum-exp of x = logits / T, for the sampled token's log-prob;
  - the running argmax of x + Gumbel(seed, counter, index), the sample.
The noise is the reference's: the same 31-bit hash of (seed, counter, vocabulary index), so a sequence
draws the same token with either sampler (up to ties at float rounding).

Plain temperature sampling only (no top-k / top-p: those need a sort; the reference handles them).
Registered as `torch.ops.minigrpo.gumbel_sample`, so it is one opaque node inside torch.compile and a
plain launch inside CUDA graphs.

Shape legend: B rows, V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.decode_attention import INTERPRETED, check_runnable

BLOCK_V = 2048


@triton.jit
def _mix31(x):
    # minigrpo.sampling._mix31, value for value: int64 lanes holding [0, 2^31), no overflow anywhere.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0x7FFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0x7FFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_sample_kernel(logits_ptr, seeds_ptr, counters_ptr, tok_ptr, logp_ptr, stride_b, V, temperature,
                          BLOCK: tl.constexpr):
    b = tl.program_id(0)
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    ctr = tl.load(counters_ptr + b).to(tl.int64)
    key = _mix31((_mix31(seed & 0x7FFFFFFF) + ctr) & 0x7FFFFFFF)
    row = logits_ptr + b.to(tl.int64) * stride_b
    m = tl.full([], float("-inf"), tl.float32)        # running max of x
    s = tl.zeros([], tl.float32)                      # running sum of exp(x - m)
    best = tl.full([], float("-inf"), tl.float32)     # best x + gumbel so far
    best_idx = tl.zeros([], tl.int64)
    best_x = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        # .to: under torch.compile the Python-float temperature can arrive as fp64, which would change
        # the loop-carried types (Triton rejects that).
        x = (tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature).to(tl.float32)
        bits = _mix31(_mix31(key ^ idx.to(tl.int64)))
        u = ((bits >> 7).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
        blk_best = tl.max(score, 0)
        blk_idx = tl.argmax(score, 0)                 # first maximum, like torch.argmax
        blk_x = tl.sum(tl.where(tl.arange(0, BLOCK) == blk_idx, x, 0.0), 0)
        better = blk_best > best                      # strict: an earlier block wins a tie
        best_idx = tl.where(better, start + blk_idx, best_idx)
        best_x = tl.where(better, blk_x, best_x)
        best = tl.where(better, blk_best, best)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(x - m_new), 0.0), 0)
        m = m_new
    tl.store(tok_ptr + b, best_idx)
    tl.store(logp_ptr + b, best_x - (m + tl.log(s)))


@triton_op("minigrpo::gumbel_sample", mutates_args=())
def gumbel_sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B,) int64 drawn from softmax(logits / temperature) and their log-probs (B,) fp32.

    logits (B, V) fp32/bf16/fp16 with unit stride in V; seeds, counters (B,) int64 on the same device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (batch, vocab) with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    B = logits.shape[0]
    if seeds.shape != (B,) or counters.shape != (B,) or seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"seeds and counters must be int64 ({B},), got {seeds.dtype} {tuple(seeds.shape)} "
                         f"and {counters.dtype} {tuple(counters.shape)}")
    if not temperature > 0:
        raise ValueError(f"gumbel_sample needs temperature > 0 (greedy is an argmax), got {temperature}")
    check_runnable(logits.device)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    wrap_triton(_gumbel_sample_kernel)[(B,)](logits, seeds, counters, tokens, logp, logits.stride(0),
                                             logits.shape[1], temperature, BLOCK=BLOCK_V, num_warps=8)
    return tokens, logp


if INTERPRETED:
    # As in decode_attention.py: the interpreter needs real data, so Dynamo gets a shape-only fake.
    @gumbel_sample.register_fake
    def _(logits, seeds, counters, temperature):
        B = logits.shape[0]
        return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)
