"""Decode-step matmuls: cuBLAS against a skinny split-K Triton matmul, per shape and as a chain.

Session 15 asked whether the decode step's matmul chain (3.4x its weight bytes at 64 rows) is slow because
cuBLAS leaves SMs idle on narrow outputs (o_proj and down_proj: N = 896). The kernel here tiles N by 32 and
splits K so that every matmul runs on ~2 programs per SM, fp32 partials summed by the next kernel; it lives
here, not in `kernels/`, because it did not win (bench/NOTES.md, session 15): each small matmul costs ~3-4 us
whoever computes it, so the chain is bound by each matmul's fixed cost, not by bandwidth.

For one model config (default Qwen2.5-0.5B) and each batch size given, with bf16 random weights:
  per shape  qkv, o_proj, gate_up, down_proj and the LM head, each timed over enough distinct weight copies
             (>= 512 MiB) that every call reads its weight from HBM, as the decode step does. Reports us per
             matmul and weight GB/s against the copy bandwidth measured in the same run, for cuBLAS
             (F.linear) and for the kernel with its chosen tiles (`choose_tiles`); --sweep also times
             other tile, split and stage counts and prints the best.
  chain      all layers' matmuls with residual adds and SiLU, then the LM head (bench/decode.py's matmul floor),
             compiled and captured in one CUDA graph: F.linear, `skinny_linear`, F.linear with every layer
             reading layer 0's weights (`cublas_l2`: the weights stay in L2, so the chain's cost without
             HBM latency), and `skinny_mlp` (`fused_chain_ms`: one kernel fewer per layer); --autotune adds
             Inductor's max-autotune (its Triton GEMM templates).
  --pdl      instead, the matmuls chained in one graph, each followed by one pointwise kernel: cuBLAS against
             the skinny kernel launched plainly, with programmatic dependent launch, with an L2 prefetch of its
             weights, and with both (`pdl_chains`; bench/NOTES.md, sessions 17-18).
Timing: CUDA-graph replay, median (`bench/timing.py`). JSON to $OUT/bench_linear.json.

    python bench/linear.py [--rows 64 256] [--config DIR] [--sweep] [--autotune] [--pdl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch.library import wrap_triton  # noqa: E402

from bench.timing import copy_bandwidth_tbs, time_graph  # noqa: E402
from bench.workload import qwen_dir  # noqa: E402
from minigrpo.kernels.decode_attention import sm_count  # noqa: E402
from minigrpo.model.config import ModelConfig  # noqa: E402

ROTATE_BYTES = 512 << 20
BLOCK_M = 64         # rows per program: a 64-row batch in one tile; fewer rows are masked, not cheaper
BLOCK_K = 64
PROGRAMS_PER_SM = 2
MAX_SPLITS = 8       # Inductor unrolls a reduction of up to 8 into the kernel that reads it


@triton.jit
def _skinny_mm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, k_per_split, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, K_LINES: tl.constexpr,
):
    """fp32 partials (NS, M, N) of x @ w.T, each over k_per_split of K (grid: M tiles x N tiles x NS splits).
    PDL (launched with launch_pdl): wait for the previous grid (griddepcontrol.wait) only before the first
    load of x, and let the next grid launch right after. PREFETCH: before that wait, ask L2 for this program's
    weight slice, one prefetch per 128-byte line (K_LINES >= lines per row); weights do not depend on the
    previous kernel (CUTLASS's example 63 does this with TMA)."""
    m = tl.program_id(0)
    n = tl.program_id(1)
    split = tl.program_id(2)
    rm = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = split * k_per_split + tl.arange(0, BLOCK_K)
    if PREFETCH:
        lines = tl.minimum(tl.arange(0, K_LINES), k_per_split // 64 - 1)           # 64 elements: 128 bytes
        rows = tl.minimum(rn, N - 1)                                                # no address past w
        addr = w_ptr + rows[:, None] * stride_wn + split * k_per_split + lines[None, :] * 64
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [addr], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # K splits evenly into whole blocks (the launcher checks), so only M and N need masks: loads stay
    # 16-byte vectors along K.
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]                     # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]                     # (BLOCK_K, BLOCK_N)
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        if GATED:  # x holds [gate | up]: the MLP's silu(gate) * up, rounded once as Inductor's kernel does
            g = x.to(tl.float32)
            u = tl.load(x_ptrs + up_offset, mask=m_ok, other=0.0).to(tl.float32)
            x = (g * tl.sigmoid(g) * u).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptrs, mask=n_ok, other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=m_ok & n_ok)


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


def launch_skinny(x: torch.Tensor, w: torch.Tensor, block_n: int = 0, num_splits: int = 0, block_m: int = BLOCK_M,
                  num_warps: int = 4, num_stages: int = 4, gated: bool = False, pdl: bool = False,
                  prefetch: bool = False) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as fp32 partials (NS, M, N), K a multiple of BLOCK_K. Zeros pick the tiles
    (`choose_tiles`). The grid's fastest axis is M, so programs sharing a weight tile run together.
    gated: x is the MLP's gate_up output (M, 2K) and the product is of silu(gate) * up (the down_proj).
    pdl, prefetch: the kernel's PDL and PREFETCH (eager launches only: `pdl_chains`)."""
    M, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    bn, ns = choose_tiles(N, K, sm_count(x.device))
    bn, ns = block_n or bn, num_splits or ns
    if (K // BLOCK_K) % ns:
        raise ValueError(f"num_splits {ns} must divide K / {BLOCK_K} = {K // BLOCK_K}")
    out = torch.empty((ns, M, N), dtype=torch.float32, device=x.device)              # (NS, M, N)
    wrap_triton(_skinny_mm_kernel)[(triton.cdiv(M, block_m), triton.cdiv(N, bn), ns)](
        x, w, out, M, N, x.stride(0), w.stride(0), K // ns, K,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, GATED=gated, num_warps=num_warps, num_stages=num_stages,
        PDL=pdl, PREFETCH=prefetch, K_LINES=triton.next_power_of_2(triton.cdiv(K // ns, 64)),
        **({"launch_pdl": True} if pdl else {}),  # a launch option the compiled chains never pass
    )
    return out


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) through the kernel: the splits summed in fp32, the bias added, one rounding to x's
    dtype (as cuBLAS's bias epilogue). Compiled, the sum fuses into the kernel that reads it."""
    y = launch_skinny(x, w).sum(0)                                                    # (M, N) fp32
    return (y if b is None else y + b).to(x.dtype)


@triton.jit
def _sum_kernel(parts_ptr, out_ptr, numel, NS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out (numel,) bf16 = the sum of NS partials (NS, numel), rounded once: the pointwise kernel that
    follows each matmul of the decode step (there a residual add, a norm or SiLU; here the split-K sum)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(NS):
        acc += tl.load(parts_ptr + s * numel + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


# (BLOCK_N, splits) per matmul. "unsplit": one program per 16 columns (64 for gate_up and the LM head);
# "split": session 15's best skinny tiles for qkv, o_proj and down_proj, gate_up's next best with 2 splits.
CHAIN_TILES = {"unsplit": {"qkv": (16, 1), "o_proj": (16, 1), "gate_up": (64, 1), "down": (16, 1), "lm_head": (64, 1)},
               "split": {"qkv": (32, 7), "o_proj": (16, 7), "gate_up": (32, 2), "down": (16, 4), "lm_head": (64, 1)}}
SUM_BLOCK = 1024


def pdl_chains(cfg: ModelConfig, rows: int) -> dict:
    """The decode step's matmuls, each followed by one pointwise kernel (as in the step, where a residual add,
    a norm or SiLU follows each), each matmul reading the previous pointwise output, in one CUDA graph:
    cuBLAS with a copy kernel after each matmul, against the skinny kernel (`CHAIN_TILES`, unsplit and
    split) with its split sum after it, both launched plainly, with programmatic dependent launch (the next
    kernel's programs start while this one finishes, and wait for it in-kernel), with an L2 prefetch of the
    weights first, and with both (4 stages; the last also at 6). ms per chain, and each Triton chain's max
    error against cuBLAS's output, relative to its largest value."""
    L = cfg.num_hidden_layers
    x0, w_qkv, _, w_o, w_gu, w_down, head = chain_weights(cfg, rows)
    names = ["qkv", "o_proj", "gate_up", "down"] * L + ["lm_head"]
    ws = [w for i in range(L) for w in (w_qkv[i], w_o[i], w_gu[i], w_down[i])] + [head]
    bf16 = [torch.empty(rows, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]  # pointwise outputs

    def pointwise(parts, out, pdl):
        ns, numel = parts.shape[0], out.numel()
        _sum_kernel[(triton.cdiv(numel, SUM_BLOCK),)](parts, out, numel, NS=ns, BLOCK=SUM_BLOCK, PDL=pdl,
                                                      num_warps=4, launch_pdl=pdl)
        return out

    def cublas_chain():
        x = x0
        for w, out in zip(ws, bf16):  # x[:, :K]: q of qkv, gate of gate_up
            x = pointwise(torch.mm(x[:, :w.shape[1]], w.t())[None], out, False)
        return x

    def triton_chain(tiles: dict, pdl: bool, prefetch: bool, stages: int):
        def chain():
            x = x0
            for name, w, out in zip(names, ws, bf16):
                parts = launch_skinny(x[:, :w.shape[1]], w, *tiles[name], num_stages=stages, pdl=pdl, prefetch=prefetch)
                x = pointwise(parts, out, pdl)
            return x
        return chain
    ref = cublas_chain().float()
    result = {"cublas_ms": time_graph(cublas_chain)}
    for tiling in CHAIN_TILES:
        for suffix, pdl, prefetch, stages in (("", False, False, 4), ("_pdl", True, False, 4),
                                              ("_prefetch", False, True, 4), ("_pdl_prefetch", True, True, 4),
                                              ("_pdl_prefetch", True, True, 6)):
            chain = triton_chain(CHAIN_TILES[tiling], pdl, prefetch, stages)
            key = f"triton_{tiling}{suffix}_s{stages}"
            result[f"{key}_ms"] = time_graph(chain)
            result[f"{key}_rel_err"] = (chain().float() - ref).abs().max().item() / ref.abs().max().item()
    return {k: round(v, 4) if k.endswith("_ms") else v for k, v in result.items()}


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode matmul, in the engine's fused layout."""
    C, H, K, D, Fw = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                      cfg.intermediate_size)
    return {"qkv": ((H + 2 * K) * D, C), "o_proj": (C, H * D), "gate_up": (2 * Fw, C), "down": (C, Fw),
            "lm_head": (cfg.vocab_size, C)}


def per_shape(name, N, K, rows, copy_tbs, sweep: bool) -> dict:
    copies = max(1, min(64, ROTATE_BYTES // (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    err = (launch_skinny(x, ws[0]).sum(0) - ref).abs().max().item()

    def us(fn):
        return 1e3 * time_graph(lambda: [fn(w) for w in ws], reps=20, inner=4) / copies

    gbs = lambda t: N * K * 2 / (t * 1e-6) / 1e9  # noqa: E731
    bn, ns = choose_tiles(N, K, sm_count(x.device))
    row = dict(shape=name, rows=rows, N=N, K=K, weight_mb=round(N * K * 2 / 1e6, 2), copies=copies,
               floor_us=round(N * K * 2 / (copy_tbs * 1e6), 2), max_abs_err=err)
    row["cublas_us"] = us(lambda w: F.linear(x, w))
    row["skinny_us"] = us(lambda w: launch_skinny(x, w))
    row["skinny_tiles"] = dict(block_n=bn, splits=ns)
    if sweep:
        best = None
        k_blocks = K // BLOCK_K
        for block_n in (16, 32, 64, 128):
            for splits in [d for d in range(1, 2 * MAX_SPLITS + 1) if k_blocks % d == 0]:
                for stages in (3, 5):
                    t = us(lambda w: launch_skinny(x, w, block_n, splits, num_stages=stages))
                    if best is None or t < best[0]:
                        best = (t, dict(block_n=block_n, splits=splits, stages=stages))
        row["sweep_best_us"], row["sweep_best"] = best
    for k in [k for k in row if k.endswith("_us") and k != "floor_us"]:
        row[k.replace("_us", "_pct_copy")] = round(100 * gbs(row[k]) * 1e9 / (copy_tbs * 1e12), 1)
        row[k] = round(row[k], 2)
    return row


def chain_weights(cfg: ModelConfig, rows: int) -> tuple[torch.Tensor, ...]:
    """A chain's input (rows, C) and bf16 random weights in the engine's fused layout, stacked over layers:
    qkv (L, (H + 2K) D, C) and its bias, o (L, C, H D), gate_up (L, 2F, C), down (L, C, F), the LM head (V, C)."""
    L, C, H, Kv, D, Fw, V = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * s[-1] ** -0.5  # noqa: E731
    x0 = torch.randn(rows, C, device="cuda", dtype=torch.bfloat16)
    return (x0, w(L, (H + 2 * Kv) * D, C), w(L, (H + 2 * Kv) * D), w(L, C, H * D), w(L, 2 * Fw, C), w(L, C, Fw),
            w(V, C))


def chain_ms(cfg: ModelConfig, rows: int, lin, mode: str | None, one_layer: bool = False) -> float:
    """All layers' matmuls, residual adds and SiLU, then the LM head, compiled, in one graph. one_layer: every
    layer uses layer 0's weights (30 MB at 0.5B, inside the H200's L2), so no matmul waits on HBM."""
    L, HD = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    x0, w_qkv, b_qkv, w_o, w_gu, w_down, head = chain_weights(cfg, rows)

    def chain(x):
        for layer in range(L):
            i = 0 if one_layer else layer
            qkv = lin(x, w_qkv[i], b_qkv[i])
            x = x + lin(qkv[:, :HD], w_o[i])
            gate, up = lin(x, w_gu[i]).chunk(2, dim=-1)
            x = x + lin(F.silu(gate) * up, w_down[i])
        return lin(x, head)
    fn = torch.compile(chain, fullgraph=True, mode=mode)
    return time_graph(lambda: fn(x0))


def fused_chain_ms(cfg: ModelConfig, rows: int) -> float:
    """The chain with the kernel where it removes a kernel or wins (session 15's table): o_proj and down_proj
    through it, their split sums fused into the residual adds, SiLU-and-mul done in down_proj's loads (one
    kernel fewer per layer); qkv, gate_up and the LM head stay on cuBLAS."""
    L, HD = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    x0, w_qkv, b_qkv, w_o, w_gu, w_down, head = chain_weights(cfg, rows)

    def chain(x):
        for i in range(L):
            qkv = F.linear(x, w_qkv[i], b_qkv[i])
            x = x + launch_skinny(qkv[:, :HD], w_o[i]).sum(0).to(x.dtype)
            gate_up = F.linear(x, w_gu[i])
            x = x + launch_skinny(gate_up, w_down[i], gated=True).sum(0).to(x.dtype)
        return F.linear(x, head)
    fn = torch.compile(chain, fullgraph=True)
    return time_graph(lambda: fn(x0))


def gated_error(x: torch.Tensor, w: torch.Tensor) -> float:
    """Max |kernel - reference| of down_proj(silu(gate) * up), x = [gate | up] (M, 2K), w (N, K)."""
    gate, up = x.chunk(2, dim=-1)
    ref = F.linear((F.silu(gate.float()) * up.float()).to(x.dtype), w).float()
    return (launch_skinny(x, w, gated=True).sum(0) - ref).abs().max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--config", type=Path, default=None, help="folder with config.json (default: Qwen2.5-0.5B)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--pdl", action="store_true", help="only the chains with and without programmatic dependent "
                   "launch (pdl_chains)")
    args = p.parse_args()
    cfg = ModelConfig.from_json((args.config or qwen_dir()) / "config.json")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # the default; stated
    copy_tbs = copy_bandwidth_tbs()
    out = dict(copy_tb_s=round(copy_tbs, 3), device=torch.cuda.get_device_name(), shapes=[], chains=[])
    path = Path(os.environ.get("OUT", "out")) / "bench_linear.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"copy bandwidth {copy_tbs:.3f} TB/s")
    for rows in args.rows:
        if args.pdl:
            out["chains"].append(dict(rows=rows, chain="pdl", **pdl_chains(cfg, rows)))
            print(json.dumps(out["chains"][-1]))
            path.write_text(json.dumps(out, indent=1))
            continue
        for name, (N, K) in shapes(cfg).items():
            r = per_shape(name, N, K, rows, copy_tbs, args.sweep)
            out["shapes"].append(r)
            print(json.dumps(r))
            path.write_text(json.dumps(out, indent=1))
        chains = [("cublas", F.linear, None, False), ("cublas_l2", F.linear, None, True),
                  ("skinny", skinny_linear, None, False)]
        if args.autotune:
            chains.append(("max_autotune", F.linear, "max-autotune-no-cudagraphs", False))
        for label, lin, mode, one_layer in chains:
            r = dict(rows=rows, chain=label, ms=round(chain_ms(cfg, rows, lin, mode, one_layer), 4))
            out["chains"].append(r)
            print(json.dumps(r))
            path.write_text(json.dumps(out, indent=1))
        x = torch.randn(rows, 2 * cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cfg.hidden_size, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
        r = dict(rows=rows, chain="skinny_mlp", ms=round(fused_chain_ms(cfg, rows), 4),
                 gated_max_abs_err=gated_error(x, w * cfg.intermediate_size ** -0.5))
        out["chains"].append(r)
        print(json.dumps(r))
        path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
