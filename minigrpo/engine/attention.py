"""Decode-step attention over the paged KV cache: RoPE on the new token, its K/V stored, then attention
over each sequence, with three interchangeable backends:

  eager  - gather each sequence's pages, plain fp32 math: the reference the others are tested against.
  sdpa   - gather pages into a dense padded K/V, then F.scaled_dot_product_attention with a length mask.
  triton - one paged kernel (`kernels/decode_attention.py`) that also rotates and stores, reading K/V
           straight from the pool.

KV-cache contract (one layer): k_pool, v_pool (P, S, Hkv, D) contiguous; block_table (B, M) int32 lists each
sequence's pages in order; seq_lens (B,) int32 counts a sequence's tokens including the new one, which sits
at position seq_lens - 1; seq_len 0 (a padded or finished slot) stores nothing and yields zeros. Query head h
reads KV head h // n_rep. Static shapes and no host sync throughout, for torch.compile(fullgraph=True) and
CUDA graphs.

Shape legend: B sequences, Hq query heads, Hkv KV heads, R = n_rep = Hq / Hkv, D head dim, P pages,
S page size, M block-table width, T = M * S padded context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigrpo.kernels.decode_attention import check_decode_inputs, check_new_token_inputs
from minigrpo.model.qwen2 import apply_rope


def decode_attention(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, scale: float, num_splits: int = 0) -> torch.Tensor:
    """One new token per sequence: q (B, Hq, D), k, v (B, Hkv, D) before RoPE -> attention output (B, Hq, D).
    Rotates q and k by cos, sin (B, D) (the model's tables at position seq_lens - 1, in q's dtype), stores k
    and v at that position, and attends over the sequence. num_splits: the Triton kernel's split count; 0
    picks it from B, which a step compiled once for every B must not."""
    if backend == "triton":
        return torch.ops.minigrpo.paged_decode_attention(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin,
                                                         scale, num_splits)
    check_decode_inputs(q, k_pool, v_pool, block_table, seq_lens)
    check_new_token_inputs(q, k, v, k_pool, cos, sin)
    S = k_pool.shape[1]
    pos = (seq_lens - 1).clamp(min=0)                                           # (B,) the new token's position
    page = block_table.gather(1, (pos // S)[:, None].long()).squeeze(1)         # (B,)
    slots = torch.where(seq_lens > 0, page * S + pos % S, -1)                   # (B,) int32, -1: store nothing
    q = rope_store(q, k, v, k_pool, v_pool, slots, cos, sin)
    return _PLAIN[backend](q, k_pool, v_pool, block_table, seq_lens, scale)


def cached_attention(backend: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q (B, Hq, D), already rotated, over each sequence's first seq_lens tokens, all already in
    the cache, in plain PyTorch (backend eager or sdpa). -> (B, Hq, D)"""
    check_decode_inputs(q, k_pool, v_pool, block_table, seq_lens)
    return _PLAIN[backend](q, k_pool, v_pool, block_table, seq_lens, scale)


def _gather(q, k_pool, v_pool, block_table, seq_lens):
    """q grouped by KV head (B, Hkv, R, D); each sequence's cached K and V rows in order (B, T, Hkv, D),
    zeroed past its length; and the mask of valid rows (B, T)."""
    B, Hq, D = q.shape
    Hkv, S = k_pool.shape[2], k_pool.shape[1]
    valid = torch.arange(block_table.shape[1] * S, device=q.device) < seq_lens[:, None]   # (B, T)
    # Unused table entries may be -1 or stale: clamp keeps the gather in range. Zero, not just mask, the
    # rows past the length: a stale page may hold inf/NaN, and 0 * NaN would leak through p @ v.
    k, v = (pool[block_table.clamp(min=0)].flatten(1, 2).masked_fill(~valid[:, :, None, None], 0.0)
            for pool in (k_pool, v_pool))                                          # (B, T, Hkv, D) each
    return q.reshape(B, Hkv, Hq // Hkv, D), k, v, valid


def _eager_decode(q, k_pool, v_pool, block_table, seq_lens, scale):
    qg, k, v, valid = _gather(q, k_pool, v_pool, block_table, seq_lens)
    scores = torch.einsum("bgrd,btgd->bgrt", qg.float(), k.float()) * scale     # (B, Hkv, R, T)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A sequence with no tokens softmaxes over all -inf (NaN); the second mask turns that row into zeros.
    probs = scores.softmax(-1).masked_fill(~valid[:, None, None, :], 0.0)      # (B, Hkv, R, T)
    out = torch.einsum("bgrt,btgd->bgrd", probs, v.float())                     # (B, Hkv, R, D)
    return out.reshape(q.shape).to(q.dtype)


def _sdpa_decode(q, k_pool, v_pool, block_table, seq_lens, scale):
    # The R query heads sharing a KV head act as R query rows of one head: plain SDPA, no GQA expansion.
    qg, k, v, valid = _gather(q, k_pool, v_pool, block_table, seq_lens)
    # An empty sequence attends to its (zeroed) slot 0: output 0 rather than NaN from an all-masked row.
    first = torch.arange(valid.shape[1], device=q.device) == 0                  # (T,)
    mask = (valid | first)[:, None, None, :]                                    # (B, 1, 1, T)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)                           # (B, Hkv, R, D)
    return out.reshape(q.shape)


_PLAIN = {"eager": _eager_decode, "sdpa": _sdpa_decode}  # the plain-PyTorch backends, inputs already checked


def rope_store(q, k, v, k_pool, v_pool, slots, cos, sin) -> torch.Tensor:
    """Rotate q and k by cos, sin, store the rotated k and v at `slots`; returns the rotated q (B, Hq, D).
    Numerically the model's `apply_rope`. q (B, Hq, D), k/v (B, Hkv, D); slots (B,) int32 (slot = page * S +
    offset, < 0: skip); cos/sin (B, D) each sequence's rotation row, in q's dtype."""
    c, s = cos[:, None, :], sin[:, None, :]                                     # (B, 1, D) each
    _store_rows(k_pool, slots, apply_rope(k, c, s))
    _store_rows(v_pool, slots, v)
    return apply_rope(q, c, s)                                                  # (B, Hq, D)


def _store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool.view(P*S, Hkv, D)[slots[b]] = rows[b] wherever slots[b] >= 0, with static shapes: a skipped row
    re-writes the first real row's slot with that row's data (duplicate indices carry identical values, so
    the scatter is deterministic), or with no real row, slot 0 with its current value."""
    flat = pool.view(-1, *pool.shape[2:])                                       # (P*S, Hkv, D)
    real = slots >= 0                                                           # (B,)
    first_real = real.int().argmax()                                            # 0 if none is real
    src = torch.where(real, torch.arange(len(slots), device=slots.device), first_real)  # (B,) row to write
    dst = slots[src].long().clamp(min=0)                                        # (B,)
    values = torch.where(real.any(), rows[src].to(pool.dtype), flat[dst])       # (B, Hkv, D)
    flat.index_copy_(0, dst, values)
