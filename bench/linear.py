"""Decode-step matmuls: cuBLAS against the skinny Triton kernel (`kernels/linear.py`), per shape and as a chain.

For one model config (default Qwen2.5-0.5B) and each batch size given, with bf16 random weights:
  per shape  qkv, o_proj, gate_up, down_proj and the LM head, each timed over enough distinct weight copies
             (>= 512 MiB) that every call reads its weight from HBM, as the decode step does. Reports us per
             matmul and weight GB/s against the copy bandwidth measured in the same run, for cuBLAS
             (F.linear) and for the kernel with its chosen tiles (`choose_tiles`); --sweep also times
             every tile count, split count and stage count and prints the best.
  chain      all layers' matmuls with residual adds and SiLU, then the LM head (bench/decode.py's matmul floor),
             compiled and captured in one CUDA graph: F.linear against `skinny_linear`; --autotune adds
             F.linear compiled with Inductor's max-autotune (its Triton GEMM templates).
Timing: CUDA-graph replay, median (`bench/timing.py`). JSON to $OUT/bench_linear.json.

    python bench/linear.py [--rows 64 256] [--config DIR] [--sweep] [--autotune]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import copy_bandwidth_tbs, time_graph  # noqa: E402
from bench.workload import qwen_dir  # noqa: E402
from kernels.linear import BLOCK_K, MAX_SPLITS, choose_tiles, launch_skinny, skinny_linear  # noqa: E402
from kernels.decode_attention import sm_count  # noqa: E402
from minigrpo.model.config import ModelConfig  # noqa: E402

ROTATE_BYTES = 512 << 20


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


def chain_ms(cfg: ModelConfig, rows: int, lin, mode: str | None) -> float:
    """All layers' matmuls, residual adds and SiLU, then the LM head, compiled, in one graph."""
    L, C, H, Kv, D, Fw, V = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * s[-1] ** -0.5  # noqa: E731
    w_qkv, b_qkv, w_o = w(L, (H + 2 * Kv) * D, C), w(L, (H + 2 * Kv) * D), w(L, C, H * D)
    w_gu, w_down, head = w(L, 2 * Fw, C), w(L, C, Fw), w(V, C)
    x0 = torch.randn(rows, C, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        for i in range(L):
            qkv = lin(x, w_qkv[i], b_qkv[i])
            x = x + lin(qkv[:, :H * D], w_o[i])
            gate, up = lin(x, w_gu[i]).chunk(2, dim=-1)
            x = x + lin(F.silu(gate) * up, w_down[i])
        return lin(x, head)
    fn = torch.compile(chain, fullgraph=True, mode=mode)
    return time_graph(lambda: fn(x0))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--config", type=Path, default=None, help="folder with config.json (default: Qwen2.5-0.5B)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--autotune", action="store_true")
    args = p.parse_args()
    cfg = ModelConfig.from_json((args.config or qwen_dir()) / "config.json")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # the default; stated
    copy_tbs = copy_bandwidth_tbs()
    out = dict(copy_tb_s=round(copy_tbs, 3), device=torch.cuda.get_device_name(), shapes=[], chains=[])
    path = Path(os.environ.get("OUT", "out")) / "bench_linear.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"copy bandwidth {copy_tbs:.3f} TB/s")
    for rows in args.rows:
        for name, (N, K) in shapes(cfg).items():
            r = per_shape(name, N, K, rows, copy_tbs, args.sweep)
            out["shapes"].append(r)
            print(json.dumps(r))
            path.write_text(json.dumps(out, indent=1))
        for label, lin, mode in [("cublas", F.linear, None), ("skinny", skinny_linear, None)] + \
                                ([("max_autotune", F.linear, "max-autotune-no-cudagraphs")] if args.autotune else []):
            r = dict(rows=rows, chain=label, ms=round(chain_ms(cfg, rows, lin, mode), 4))
            out["chains"].append(r)
            print(json.dumps(r))
            path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
