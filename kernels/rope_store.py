"""Fused RoPE + KV-cache store for the decode step, in Triton: one launch instead of ~10 small kernels.

Per new token: rotate q and k by the token's position (HF Qwen2's non-interleaved convention, as the
model's `apply_rope`, rounding step by step as it does), return the rotated q, and write the rotated k and
the v into the pools at `slot = page * S + offset`; a negative slot (a padded batch slot) stores nothing.

Shape legend: B sequences, Hq query heads, Hkv KV heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.decode_attention import INTERPRETED, check_runnable


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, D: tl.constexpr,
):
    b = tl.program_id(0)
    DT: tl.constexpr = q_out_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    pos = tl.load(positions_ptr + b)
    slot = tl.load(slots_ptr + b)
    j = tl.arange(0, HALF)
    # Tables rounded to the activation dtype first, as the model does.
    c1 = tl.load(cos_ptr + pos * D + j).to(DT).to(tl.float32)[None, :]          # (1, D/2)
    c2 = tl.load(cos_ptr + pos * D + HALF + j).to(DT).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * D + j).to(DT).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * D + HALF + j).to(DT).to(tl.float32)[None, :]

    # q: out1 = x1 * c1 - x2 * s1, out2 = x2 * c2 + x1 * s2, rounding each product then the sum.
    hq = tl.arange(0, HQ_P2)
    mq = (hq < HQ)[:, None]
    q_in = q_ptr + b * stride_qb + hq[:, None] * stride_qh + j[None, :]          # (HQ_P2, D/2)
    x1 = tl.load(q_in, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(q_in + HALF, mask=mq, other=0.0).to(tl.float32)
    o1 = (x1 * c1).to(DT).to(tl.float32) - (x2 * s1).to(DT).to(tl.float32)
    o2 = (x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)
    q_out = q_out_ptr + b * HQ * D + hq[:, None] * D + j[None, :]
    tl.store(q_out, o1, mask=mq)
    tl.store(q_out + HALF, o2, mask=mq)

    # k (same rotation) and v go to the pool row of this slot; slot < 0 masks the stores off.
    hk = tl.arange(0, HKV_P2)
    mk = (hk < HKV)[:, None]
    ms = (hk < tl.where(slot >= 0, HKV, 0))[:, None]           # a skipped slot stores no head
    k_in = k_ptr + b * stride_kb + hk[:, None] * stride_kh + j[None, :]          # (HKV_P2, D/2)
    y1 = tl.load(k_in, mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(k_in + HALF, mask=mk, other=0.0).to(tl.float32)
    r1 = (y1 * c1).to(DT).to(tl.float32) - (y2 * s1).to(DT).to(tl.float32)
    r2 = (y2 * c2).to(DT).to(tl.float32) + (y1 * s2).to(DT).to(tl.float32)
    row = slot.to(tl.int64) * (HKV * D) + hk[:, None] * D                        # (HKV_P2, 1)
    tl.store(k_pool_ptr + row + j[None, :], r1, mask=ms)
    tl.store(k_pool_ptr + row + HALF + j[None, :], r2, mask=ms)
    d = tl.arange(0, D)
    v_row = tl.load(v_ptr + b * stride_vb + hk[:, None] * stride_vh + d[None, :], mask=mk, other=0.0)
    tl.store(v_pool_ptr + row + d[None, :], v_row, mask=ms)


def check_rope_store_inputs(q, k, v, k_pool, v_pool, positions, slots, cos, sin) -> None:
    """Assert the rope-store contract on metadata only (no device sync; safe under torch.compile)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[::2] != k.shape[::2]:
        raise ValueError(f"expected q (B, Hq, D) and k, v (B, Hkv, D); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[2:] != (Hkv, D):
        raise ValueError(f"k_pool and v_pool must both be (pages, page_size, kv_heads={Hkv}, head_dim={D}) "
                         f"for one layer; got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if not (q.dtype == k.dtype == v.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(f"q, k, v and the pools must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}")
    for name, t in (("positions", positions), ("slots", slots)):
        if t.shape != (B,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (batch={B},), got {t.dtype} {tuple(t.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or cos.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 (max_positions, head_dim={D}) tables, got "
                         f"{cos.dtype} {tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if not all(t.is_contiguous() for t in (k_pool, v_pool, cos, sin)) or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("k_pool, v_pool, cos and sin must be contiguous, and q, k, v contiguous in their last dim")
    devices = {t.device for t in (q, k, v, k_pool, v_pool, positions, slots, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"all rope-store inputs must be on one device, got {sorted(map(str, devices))}")


@triton_op("minigrpo::rope_store", mutates_args={"k_pool", "v_pool"})
def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotated q (B, Hq, D), new tensor; rotated k and v written to k_pool/v_pool (P, S, Hkv, D) at slots."""
    check_rope_store_inputs(q, k, v, k_pool, v_pool, positions, slots, cos, sin)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if D % 2 or not triton.next_power_of_2(D) == D:
        raise ValueError(f"head_dim must be a power of two for the Triton rope kernel, got {D}")
    check_runnable(q.device)
    q_out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)             # (B, Hq, D)
    wrap_triton(_rope_store_kernel)[(B,)](
        q, k, v, positions, slots, cos, sin, q_out, k_pool, v_pool,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HQ=Hq, HKV=Hkv, HQ_P2=triton.next_power_of_2(Hq), HKV_P2=triton.next_power_of_2(Hkv), D=D,
        num_warps=1 if Hq * D <= 1024 else 2,
    )
    return q_out


if INTERPRETED:
    # As in decode_attention.py: Triton's interpreter needs real data, so Dynamo gets a shape-only fake.
    @rope_store.register_fake
    def _(q, k, v, k_pool, v_pool, positions, slots, cos, sin):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
