"""Skinny matmul for the decode step, in Triton: y = x @ w.T for a few rows (M <= 256) and a weight read once.

At decode the matmuls are pure weight traffic, yet cuBLAS leaves most of the GPU idle on the step's narrow
outputs: o_proj and down_proj have N = 896 columns at 0.5B, 7 tiles of 128 for 132 SMs. This kernel tiles N
finely and splits K, so every matmul runs on about two programs per SM, each streaming its own slab of the
weight. A split writes an fp32 partial; the caller sums the splits (`skinny_linear`), and inside the compiled
decode step that sum fuses into the next pointwise kernel (bias, residual add, RMSNorm, SiLU), so splitting
costs no extra launch.

Shape legend: M rows (batch slots), K inputs, N outputs, NS splits of K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.decode_attention import INTERPRETED, check_runnable, sm_count

BLOCK_M = 64         # rows per program: a 64-row batch in one tile; fewer rows are masked, not cheaper
BLOCK_K = 64
PROGRAMS_PER_SM = 2
MAX_SPLITS = 8       # Inductor unrolls a reduction of up to 8 into the kernel that reads it


@triton.jit
def _skinny_mm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    DOT_PRECISION: tl.constexpr = "ieee" if x_ptr.dtype.element_ty == tl.float32 else "tf32"
    m = tl.program_id(0)
    n = tl.program_id(1)
    split = tl.program_id(2)
    rm = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = split * k_per_split + tl.arange(0, BLOCK_K)
    # K splits evenly into whole blocks (the launcher checks), so only M and N need masks: loads stay
    # 16-byte vectors along K.
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]                     # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]                     # (BLOCK_K, BLOCK_N)
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        w = tl.load(w_ptrs, mask=n_ok, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=m_ok & n_ok)


def skinny_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes this matmul: K in whole blocks, unit stride along K, one dtype."""
    return (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.shape[1] % BLOCK_K == 0
            and x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype)


def choose_tiles(N: int, K: int, sms: int) -> tuple[int, int]:
    """(BLOCK_N, NS) from the weight's shape alone (so one compiled step serves every batch size): the widest
    N tile and then the fewest K splits that give PROGRAMS_PER_SM programs per SM for a 64-row batch. At most
    MAX_SPLITS, so that Inductor unrolls their sum into the next kernel instead of launching a reduction."""
    want = PROGRAMS_PER_SM * sms
    block_n = 64 if triton.cdiv(N, 64) >= want else 32
    tiles = triton.cdiv(N, block_n)
    k_blocks = K // BLOCK_K
    splits = [d for d in range(1, MAX_SPLITS + 1) if k_blocks % d == 0]
    return block_n, next((d for d in splits if tiles * d >= want), splits[-1])


# Defined before the op on purpose (triton_op reads the source of the functions it calls, see decode_attention).
def launch_skinny(x: torch.Tensor, w: torch.Tensor, block_n: int = 0, num_splits: int = 0, block_m: int = BLOCK_M,
                  num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """The kernel on checked inputs -> fp32 partials (NS, M, N). Zeros pick the tiles (`choose_tiles`);
    `bench/linear.py` varies them. The grid's fastest axis is M, so the programs that share a weight tile
    run together and read it from HBM once."""
    check_runnable(x.device)
    M, K = x.shape
    N = w.shape[0]
    bn, ns = choose_tiles(N, K, sm_count(x.device))
    bn, ns = block_n or bn, num_splits or ns
    if (K // BLOCK_K) % ns:
        raise ValueError(f"num_splits {ns} must divide K / {BLOCK_K} = {K // BLOCK_K}")
    out = torch.empty((ns, M, N), dtype=torch.float32, device=x.device)              # (NS, M, N)
    wrap_triton(_skinny_mm_kernel)[(triton.cdiv(M, block_m), triton.cdiv(N, bn), ns)](
        x, w, out, M, N, x.stride(0), w.stride(0), K // ns,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton_op("minigrpo::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K).T in fp32 partials over K: (NS, M, N); their sum is the product."""
    if not skinny_supported(x, w):
        raise ValueError(f"skinny_mm takes x (M, K) and w (N, K) of one dtype, K a multiple of {BLOCK_K}, "
                         f"unit stride along K; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    return launch_skinny(x, w)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) for a decode step's few rows: the splits summed in fp32, the bias added, then one
    rounding to x's dtype (cuBLAS rounds once after its bias epilogue too). Falls back to F.linear where
    the kernel does not apply."""
    if not skinny_supported(x, w):
        return torch.nn.functional.linear(x, w, b)
    y = torch.ops.minigrpo.skinny_mm(x, w).sum(0)                                    # (M, N) fp32
    return (y if b is None else y + b).to(x.dtype)


if INTERPRETED:
    # The interpreter needs real data, so Dynamo gets a shape-only fake instead of tracing the launch.
    @skinny_mm.register_fake
    def _(x, w):
        _, ns = choose_tiles(w.shape[0], w.shape[1], sm_count(x.device))
        return x.new_empty((ns, x.shape[0], w.shape[0]), dtype=torch.float32)
