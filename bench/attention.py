"""Decode-attention microbenchmark: the paged Triton kernel against gather + SDPA and dense SDPA.

For each (sequences, context) point and page size, with Qwen2.5-0.5B heads (Hq=14, Hkv=2, D=64, bf16; `--heads`
picks another published shape's) and shuffled pages, times with `triton.testing.do_bench_cudagraph` (median,
CUDA-graph replay):
  dense   F.scaled_dot_product_attention on contiguous K/V (the no-paging lower bound)
  gather  the `sdpa` backend: gather pages into padded dense K/V, then SDPA with a length mask
  triton  the paged kernel (`torch.ops.minigrpo.paged_decode_attention`)
  eager   the readable reference backend (skip with --no-eager)
and reports microseconds, ratios, and achieved bandwidth (K/V bytes read / time) next to the device's
copy bandwidth (bytes read + written / time of a large device-to-device copy) measured in the same run.
The paged backends also rotate the new token and store its K/V, as in the decode step; dense SDPA does not.
`--group G --prompt T` lays the pages out as a rollout does: each group of G sequences shares its first T tokens'
full pages (bench/NOTES.md, session 35: the rollout's attention reads those once from DRAM, then from L2). The
bandwidth columns then count each shared page once; dense SDPA still reads every sequence's rows.

Inputs rotate over enough copies to exceed ~512 MiB, so each call reads K/V from HBM, not from L2.
A quick correctness check (triton vs gather) runs at every point before timing.

    python bench/attention.py [--page-sizes 16 64] [--out FILE] [--sweep]
    python bench/attention.py --device cpu --interpret        # tiny smoke run, no GPU (plain timer)

JSON goes to --out, else to $OUT/bench_attention.json when $OUT is set.
"""

from __future__ import annotations

import os
import sys

# Triton reads TRITON_INTERPRET once, when first imported: set it before anything imports it.
if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import minigrpo.kernels.decode_attention as kda  # noqa: E402
from bench.timing import copy_bandwidth_tbs  # noqa: E402
from bench.workload import shared_prompt_pages  # noqa: E402
from minigrpo.engine.attention import decode_attention  # noqa: E402

HEADS = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "3b": (16, 2, 128), "7b": (28, 4, 128)}  # (Hq, Hkv, D)
# bf16 on the GPU; the CPU smoke run uses fp16 because Triton's interpreter mishandles bf16 loads.
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float16}
GPU_POINTS = [(64, 512), (64, 2048), (256, 512), (256, 2048)]
CPU_POINTS = [(2, 64), (3, 200)]
ROTATE_BYTES = 512 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--interpret", action="store_true", help="run Triton under its CPU interpreter")
    p.add_argument("--heads", default="0.5b", choices=list(HEADS), help="the published shape whose heads to use")
    p.add_argument("--group", type=int, default=1, help="sequences sharing a prompt's pages (a rollout's G)")
    p.add_argument("--prompt", type=int, default=0, help="tokens of each group's shared prompt")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--points", default=None, help="override, e.g. '64x512,256x2048' (sequences x context)")
    p.add_argument("--no-eager", action="store_true", help="skip the (slow) eager backend")
    p.add_argument("--sweep", action="store_true", help="also time other split counts and launch configs")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench_cudagraph measurement window")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args()
    if args.device == "cpu" and not args.interpret:
        p.error("--device cpu needs --interpret (Triton kernels only run on the CPU through its interpreter)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu --interpret for a smoke run")
    if args.group < 1 or args.prompt < 0:
        p.error(f"--group must be >= 1 and --prompt >= 0, got {args.group} and {args.prompt}")
    return args


def make_timer(device: str, rep_ms: int):
    """Median microseconds per call: CUDA-graph replay on a GPU, a plain wall clock on the CPU."""
    if device == "cuda":
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3

    def cpu_timer(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    return cpu_timer


def rotating(fn, sets):
    """Call fn on the next input set each time (CUDA-graph capture unrolls calls, so each binds one set)."""
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def copy_bandwidth(device: str, timer) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    if device == "cuda":
        return 1e3 * copy_bandwidth_tbs()  # the same ceiling bench/decode.py reports
    src = torch.empty(64 << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timer(lambda: dst.copy_(src)) * 1e-6) / 1e9


def make_paged_set(B, ctx, S, HKV, D, device, gen, G, shared):
    """Full-length sequences on shuffled pages, groups of G sharing their first `shared` pages: pools
    (P, S, Hkv, D), block table (B, M)."""
    M = math.ceil(ctx / S)
    P = B * M + 8
    k_pool = torch.randn(P, S, HKV, D, device=device, generator=gen).to(DTYPE[device])
    v_pool = torch.randn(P, S, HKV, D, device=device, generator=gen).to(DTYPE[device])
    block_table = shared_prompt_pages(P, B, G, M, shared, device, gen)
    return k_pool, v_pool, block_table


def bench_point(B, ctx, S, args, timer, gen):
    device = args.device
    HQ, HKV, D = HEADS[args.heads]
    # Full prompt pages each group shares; the page the new token is written to stays private, as in a rollout.
    G, shared = args.group, min(args.prompt, ctx - 1) // S
    kv_bytes = 2 * (B * ctx - (B - B // G) * shared * S) * HKV * D * DTYPE[device].itemsize  # K and V, shared once
    n_sets = 1 if device == "cpu" else max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))
    q, k, v = (torch.randn(B, h, D, device=device, generator=gen).to(DTYPE[device]) for h in (HQ, HKV, HKV))
    cos, sin = (torch.rand(B, D, device=device, generator=gen).to(DTYPE[device]) for _ in range(2))  # (B, D)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    paged = [make_paged_set(B, ctx, S, HKV, D, device, gen, G, shared) for _ in range(n_sets)]
    dense = [tuple(torch.randn(B, HKV, ctx, D, device=device, generator=gen).to(DTYPE[device])
                   for _ in range(2)) for _ in range(n_sets)]                              # (B, Hkv, T, D)
    scale = D ** -0.5
    q_groups = q.view(B, HKV, HQ // HKV, D)    # the n_rep query heads of a KV head as query rows
    new_token = dict(q=q, k=k, v=v, seq_lens=seq_lens, cos=cos, sin=sin, scale=scale)

    def paged_fn(backend):
        return lambda kp, vp, bt: decode_attention(backend, k_pool=kp, v_pool=vp, block_table=bt, **new_token)

    kp, vp, bt = paged[0]
    check = (paged_fn("triton")(kp, vp, bt).float() - paged_fn("sdpa")(kp, vp, bt).float()).abs().max().item()
    num_splits = kda.choose_num_splits(B, HKV, bt.shape[1] * S, kda.sm_count(q.device))

    us = {
        "dense": timer(rotating(lambda k, v: F.scaled_dot_product_attention(q_groups, k, v, scale=scale), dense)),
        "gather": timer(rotating(paged_fn("sdpa"), paged)),
        "triton": timer(rotating(paged_fn("triton"), paged)),
    }
    if not args.no_eager:
        us["eager"] = timer(rotating(paged_fn("eager"), paged))
    row = dict(sequences=B, context=ctx, page_size=S, group=G, shared_pages=shared, num_splits=num_splits,
               kv_mib=kv_bytes / 2**20, input_sets=n_sets, max_abs_err_vs_gather=check, us=us,
               gbps={k: kv_bytes / (t * 1e-6) / 1e9 for k, t in us.items()},
               gather_over_triton=us["gather"] / us["triton"], triton_over_dense=us["triton"] / us["dense"])
    if args.sweep:
        row["sweep"] = sweep(new_token, paged, timer, num_splits, D)
    return row


def sweep(new_token, paged, timer, auto_splits, D):
    """Microseconds for other split counts and (block_n, num_warps, num_stages); failures are recorded."""
    stages = 2 if D >= 128 else 3  # launch_paged_decode's default
    configs = [(ns, kda.BLOCK_N, 4, stages) for ns in (1, 2, 3, 4, 6, 8, 16)]
    configs += [(ns, bn, w, st) for ns in sorted({auto_splits, 2, 4})
                for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
    results = {}
    for ns, bn, w, st in configs:
        cfg = {"num_splits": ns, "block_n": bn, "num_warps": w, "num_stages": st}
        key = f"splits={ns} block_n={bn} warps={w} stages={st}"
        if key in results:
            continue
        try:
            results[key] = timer(rotating(
                lambda kp, vp, bt, cfg=cfg: kda.launch_paged_decode(k_pool=kp, v_pool=vp, block_table=bt,
                                                                    **new_token, **cfg), paged))
        except Exception as e:  # a config may not compile (e.g. shared memory): note it, keep sweeping
            results[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
    return results


def print_tables(result):
    cols = ["dense", "gather", "triton"] + (["eager"] if "eager" in result["points"][0]["us"] else [])
    print(f"\ncopy bandwidth: {result['copy_gbps']:.0f} GB/s (read + write)   device: {result['device']}")
    head = (f"{'seqs':>5} {'ctx':>5} {'page':>4} {'splits':>6} " + " ".join(f"{c + ' us':>10}" for c in cols)
            + f" {'gath/tri':>8} {'tri/dense':>9} {'tri GB/s':>9} {'%copy':>6} {'maxerr':>8}")
    print(head)
    print("-" * len(head))
    for r in result["points"]:
        print(f"{r['sequences']:>5} {r['context']:>5} {r['page_size']:>4} {r['num_splits']:>6} "
              + " ".join(f"{r['us'][c]:>10.1f}" for c in cols)
              + f" {r['gather_over_triton']:>8.2f} {r['triton_over_dense']:>9.2f} {r['gbps']['triton']:>9.0f}"
              + f" {100 * r['gbps']['triton'] / result['copy_gbps']:>5.0f}% {r['max_abs_err_vs_gather']:>8.1e}")
        for key, t in sorted(r.get("sweep", {}).items(), key=lambda kv: (isinstance(kv[1], str), kv[1])):
            print(f"{'':>22}sweep {key:<48} " + (f"{t:>10.1f} us" if not isinstance(t, str) else t))


def main():
    args = parse_args()
    device = args.device
    timer = make_timer(device, args.rep_ms)
    gen = torch.Generator(device=device).manual_seed(0)
    if args.points:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    else:
        points = GPU_POINTS if device == "cuda" else CPU_POINTS
    if any(B % args.group for B, _ in points):
        sys.exit(f"--group {args.group} must divide every point's sequence count, got {[B for B, _ in points]}")
    result = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, shape=args.heads,
        heads=dict(zip(("q", "kv", "head_dim"), HEADS[args.heads])),
        dtype=str(DTYPE[device]), copy_gbps=copy_bandwidth(device, timer), points=[],
    )
    for S in args.page_sizes:
        for B, ctx in points:
            row = bench_point(B, ctx, S, args, timer, gen)
            result["points"].append(row)
            print(f"done: {B} x {ctx}, page {S}: triton {row['us']['triton']:.1f} us", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    print_tables(result)

    out = args.out or (os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
