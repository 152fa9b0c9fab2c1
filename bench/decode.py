"""Decode benchmark: the rollout engine per attention backend and graph mode, HF `generate` (dynamic and
static cache) on the same weights and prompts, and the floors, all in one run.

    python bench/decode.py                                   # 8x8 and 32x8 GSM8K prompts x 256 new tokens
    python bench/decode.py --workloads 8x8 --attn triton --modes step+graphs --peers none
    python bench/decode.py --report                          # graphs, graph breaks, kernel launches only
    python bench/decode.py --config ../shared/data/configs/qwen2.5-7b-instruct --workloads 8x8 --peers none  # 7B shape

Timing: CUDA events around each run of decode steps, median per step; tokens/s over the whole generate
call (prefill and host syncs included), the median of --repeats rollouts, and the same for each peer.
Stop ids are ignored, so every sequence decodes exactly `--new` tokens, as in the peer measurement.
Floors, measured in the same run:
  bandwidth floor  (weight bytes + KV bytes read per step) / measured copy bandwidth
  matmul floor     the step's own GEMM chain (per layer qkv, o_proj, gate_up, down, residual adds, SiLU, then the
                   LM head) captured alone in one CUDA graph
Each engine row also carries the step's compiled graphs, graph breaks with reasons (compile=step) and
kernel launches per step, in all and by name; the step breakdown is of the first row's configuration, so
put the mode that matters first. A table goes to stdout, everything to <out>/decode.json (rewritten after every row).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import copy_bandwidth_tbs, time_graph  # noqa: E402
from bench.workload import gsm8k_prompts, random_qwen, shared_prompt_pages  # noqa: E402
from minigrpo.engine.attention import decode_attention  # noqa: E402
from minigrpo.engine.config import EngineConfig  # noqa: E402
from minigrpo.engine.decode import advance, decode_step  # noqa: E402
from minigrpo.engine.engine import Engine  # noqa: E402
from minigrpo.model.sampling import SamplingParams  # noqa: E402

MODES = {"none": ("none", False), "graphs": ("none", True), "step": ("step", False), "step+graphs": ("step", True)}
SAMPLING = SamplingParams(temperature=1.0)  # the GRPO rollout setting; the peers sample the same way


def gemm_chain(engine: Engine, B: int, compiled: bool):
    """The decode step's matmuls alone (with residual adds and SiLU): the matmul floor."""
    m = engine.model
    H, D = m.cfg.num_attention_heads, m.cfg.head_dim
    x0 = torch.randn(B, m.cfg.hidden_size, device="cuda", dtype=m.embed.dtype)

    def chain(x, lm_head=True):
        for lw in m.layers:
            qkv = F.linear(x, lw.w_qkv, lw.b_qkv)
            x = x + F.linear(qkv[:, :H * D], lw.w_o)
            gate, up = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.w_down)
        return F.linear(x, m.lm_head) if lm_head else x
    fn = torch.compile(chain, fullgraph=True) if compiled else chain
    return lambda lm_head=True: fn(x0, lm_head)


def bandwidth_floor_ms(engine: Engine, B: int, mean_ctx: float, copy_tbs: float) -> float:
    """Bytes a decode step must read (every weight once, every cached K/V row once) over copy bandwidth."""
    m = engine.model
    # named_buffers lists a tied LM head once (it is the embedding); an untied embedding is only looked up.
    weight_bytes = sum(t.numel() * t.element_size() for n, t in m.named_buffers()
                       if n not in ("cos", "sin") and not (n == "embed" and m.lm_head is not m.embed))
    k0 = engine.kv.k[0]
    kv_bytes = 2 * len(engine.kv.k) * B * mean_ctx * k0[0, 0].numel() * k0.element_size()
    return (weight_bytes + kv_bytes) / (copy_tbs * 1e12) * 1e3


def run_engine(model, prompts, G, new, attn, mode, page_size, sampler, explain: bool, repeats: int) -> dict:
    comp, graphs = MODES[mode]
    N = len(prompts) * G
    max_len = -(-(max(len(p) for p in prompts) + new) // 64) * 64
    cfg = EngineConfig(attn=attn, compile=comp, cuda_graphs=graphs, max_batch=N, buckets=(N,),
                       max_seq_len=max_len, page_size=page_size, kv_pages=N * (max_len // page_size + 1) + 1,
                       sampler=sampler)
    engine = Engine(model.config, cfg, device="cuda")
    engine.load_weights(model)
    t0 = time.perf_counter()
    engine.generate(prompts, G, 2 * cfg.sync_every, SAMPLING)  # warm-up: compile and capture
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    # CUDA events around every run of decode steps, the prefill, and the prefill's model alone. Nothing
    # waits on them during the rollout (that would stall the pipelined rounds); they are read after it.
    windows = {"steps": [], "prefill": [], "prefill_model": []}
    originals = run, prefill, prefill_model = engine.runner.run, engine._prefill, engine.runner.prefill

    def timed(store, fn, count):
        def wrapper(*a):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a)
            e.record()
            store.append((s, e, count(a)))
            return out
        return wrapper
    engine.runner.run = timed(windows["steps"], run, lambda a: a[2])
    engine._prefill = timed(windows["prefill"], prefill, lambda a: 1)
    engine.runner.prefill = timed(windows["prefill_model"], prefill_model, lambda a: 1)
    torch.cuda.reset_peak_memory_stats()
    walls, step_ms, totals = [], [], {k: [] for k in windows}
    for _ in range(repeats):
        for w in windows.values():
            w.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, G, new, SAMPLING, seeds=list(range(N)))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        assert all(len(t) == new for t in out.tokens)
        step_ms += [s.elapsed_time(e) / n for s, e, n in windows["steps"] if n]
        for k, w in windows.items():
            totals[k].append(sum(s.elapsed_time(e) for s, e, _ in w))
    engine.runner.run, engine._prefill, engine.runner.prefill = originals
    med = statistics.median
    return dict(engine=engine, **step_report(engine, N, explain), ms_per_step=med(step_ms),
                prefill_ms=med(totals["prefill"]), prefill_model_ms=med(totals["prefill_model"]),
                # the rollout's wall time outside its step and prefill windows: syncs, compaction, launches
                outside_windows_ms=med(1e3 * w - a - b for w, a, b in zip(walls, totals["steps"], totals["prefill"])),
                tok_per_s=N * new / med(walls), seconds=med(walls), seconds_all=walls, warmup_s=warmup_s,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9)


def step_breakdown(engine: Engine, B: int, ctx: int, G: int, prompt_len: int) -> dict:
    """Share of one decode step per part, from graph-timed pieces; attention includes the new token's RoPE and
    KV store (as the step runs them), norms and the rest are the remainder. Every sequence is at context ctx, on
    pages laid out as a rollout lays them out: each group of G shares its prompt's full pages (Engine._reserve),
    so those K/V rows are read by G programs, as in the rollout, not once per sequence."""
    st, kv, m, attn = engine.state, engine.kv, engine.model, engine.cfg.attn
    a = st.step_args(B)
    tok, pos, ctr, seed, limit, done, table, out_tok, out_logp, stops = (
        a[n] for n in ("tok", "pos", "ctr", "seed", "limit", "done", "block_table", "out_tok", "out_logp", "stops"))
    table.copy_(shared_prompt_pages(kv.num_pages, B, G, table.shape[1], prompt_len // kv.page_size))
    pos.fill_(ctx)
    done.fill_(False)
    limit.fill_(1 << 30)
    ctr.zero_()
    step = engine.runner.step(B, SAMPLING)  # the step exactly as this engine config runs it

    def rewind():  # each timed sample starts at context ctx: replays advance positions and counters
        pos.fill_(ctx)
        ctr.zero_()

    full = time_graph(step, before=rewind)
    rewind()
    chain = gemm_chain(engine, B, compiled=True)
    matmul_ms = time_graph(lambda: chain(False))
    lm_head_ms = time_graph(chain) - matmul_ms
    H, K, D = m.cfg.num_attention_heads, m.cfg.num_key_value_heads, m.cfg.head_dim
    q, k, v = (torch.randn(B, h, D, device="cuda", dtype=m.embed.dtype) for h in (H, K, K))
    lens = torch.full((B,), ctx + 1, dtype=torch.int32, device="cuda")
    cos, sin = (t[ctx].to(q.dtype).expand(B, D).contiguous() for t in (m.cos, m.sin))  # (B, D) each
    attn_ms = time_graph(lambda: [decode_attention(attn, q, k, v, kv.k[i], kv.v[i], table, lens, cos, sin,
                                                   D ** -0.5) for i in range(len(kv.k))])
    logits = torch.randn(B, m.cfg.vocab_size, device="cuda", dtype=m.embed.dtype)
    adv = torch.compile(advance, fullgraph=True) if engine.cfg.compile == "step" else advance
    sample_ms = time_graph(lambda: adv(logits, SAMPLING, tok, pos, ctr, seed, limit, done, stops, out_tok, out_logp,
                                       engine.cfg.sampler), before=rewind)
    st.done.fill_(True)
    rest = full - matmul_ms - lm_head_ms - attn_ms - sample_ms
    parts = dict(matmuls=matmul_ms, attention=attn_ms, norms_rest=rest, lm_head=lm_head_ms,
                 sampling=sample_ms)
    return dict(step_ms=full, context=ctx, **{k: round(v, 4) for k, v in parts.items()},
                shares={k: round(v / full, 3) for k, v in parts.items()})


HF_MODES = {"dynamic": ("hf_dynamic_cache", {}), "static": ("hf_static_cache", dict(cache_implementation="static"))}


def hf_peer(model, prompts, G, new, modes, repeats: int) -> list[dict]:
    try:
        import transformers
    except ImportError:
        return [dict(peer="hf", skipped="transformers not installed")]
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**model.config.to_hf_dict("bfloat16")))
    hf = hf.to("cuda", torch.bfloat16).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    seqs = [p for p in prompts for _ in range(G)]
    T = max(len(s) for s in seqs)
    ids = torch.tensor([[0] * (T - len(s)) + s for s in seqs], device="cuda")
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in seqs], device="cuda")
    rows = []
    for mode, kw in (HF_MODES[m] for m in modes):
        args = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                    temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, **kw)
        try:
            # Warm-up: the static cache auto-compiles for these exact shapes (twice, to settle any recompile);
            # the dynamic cache only needs its kernels loaded.
            for _ in range(2 if kw else 1):
                hf.generate(ids, **(args if kw else dict(args, max_new_tokens=8, min_new_tokens=8)))
            walls = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = hf.generate(ids, **args)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            dt, n = statistics.median(walls), out.shape[1] - T
            rows.append(dict(mode=mode, ms_per_step=1e3 * dt / n, tok_per_s=len(seqs) * n / dt, seconds=dt,
                             seconds_all=walls))
        except Exception as e:  # a peer failing is a finding, not a reason to lose the run
            rows.append(dict(mode=mode, error=repr(e)[:300]))
    del hf
    torch.cuda.empty_cache()
    return rows


def step_report(engine: Engine, B: int, explain: bool = True) -> dict:
    """What the decode step is made of under this engine's config: compiled graphs and every graph break
    (torch._dynamo.explain over the step, when compile=step and `explain`: the trace is the same for every
    compiled mode of one backend, so the benchmark asks once per backend) and kernel launches per step
    (profiler, one un-captured step; under CUDA graphs the same kernels replay from one graph launch)."""
    st, kv, m = engine.state, engine.kv, engine.model
    row = {}
    if engine.cfg.compile == "step" and explain:
        ex = torch._dynamo.explain(decode_step)(m, engine.runner.layer, SAMPLING, **st.step_args(B), k_pools=kv.k,
                                                v_pools=kv.v, sampler=engine.cfg.sampler)
        row.update(graphs=ex.graph_count, graph_breaks=ex.graph_break_count,
                   break_reasons=[str(b.reason) for b in ex.break_reasons])
    step = engine.runner.step(B, SAMPLING)
    step()  # already compiled by the timed run; this one only warms the profiler's path
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row["kernels_per_step"] = len(names)
    # Which kernels make the count (the step's cost at small batch is mostly ~3 us per kernel, NOTES session 15).
    row["kernels_by_name"] = dict(collections.Counter(n[:80] for n in names).most_common())
    return row


def report(model, prompts, attns, modes, sampler) -> list[dict]:
    """--report: step_report per backend and mode at 8 sequences, no timing."""
    rows = []
    for attn in attns:
        for mode in modes:
            comp, graphs = MODES[mode]
            cfg = EngineConfig(attn=attn, compile=comp, cuda_graphs=graphs, max_batch=8, buckets=(8,),
                               max_seq_len=512, kv_pages=8 * 33 + 1, sampler=sampler)
            engine = Engine(model.config, cfg, device="cuda")
            engine.load_weights(model)
            engine.generate(prompts[:8], 1, 4, SAMPLING)
            rows.append(dict(attn=attn, mode=mode, **step_report(engine, 8)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="8x8,32x8", help="PROMPTSxSAMPLES, comma-separated")
    p.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    p.add_argument("--attn", default="eager,sdpa,triton", help="backends, comma-separated")
    p.add_argument("--modes", default="none,graphs,step,step+graphs", help=f"of {list(MODES)}")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sampler", default="torch",
                   help="torch: the reference sampler; triton: the fused one-pass kernel; 'torch,triton': every row "
                        "with torch, then the first backend's CUDA-graph modes again with triton")
    p.add_argument("--peers", default="dynamic,static", help="HF generate caches to time: dynamic,static, or none")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per row (engine and peers): medians")
    p.add_argument("--report", action="store_true", help="graph / graph-break / kernel-launch report only")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for decode.json")
    p.add_argument("--config", type=Path, default=None,
                   help="folder whose config.json gives the random model's shape (default: Qwen2.5-0.5B's)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("no CUDA device: this benchmark times the engine and HF generate on a GPU")
    workloads = [tuple(int(x) for x in w.split("x") if x.isdigit()) for w in args.workloads.split(",")]
    if not all(len(w) == 2 and min(w) >= 1 for w in workloads):
        p.error(f"--workloads {args.workloads!r}: expected PROMPTSxSAMPLES[,...] with positive numbers, "
                f"e.g. 8x8,32x8")
    if args.repeats < 1 or args.new < 1:
        p.error(f"--repeats and --new must be >= 1, got {args.repeats} and {args.new}")
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        p.error(f"--out {out_dir} is a file; pass the folder decode.json should go in")
    if args.config is not None and not (args.config / "config.json").is_file():
        p.error(f"--config {args.config}: no config.json there; pass a folder such as data/configs/qwen2.5-7b-instruct")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = random_qwen(config_dir=args.config)
    _, all_prompts = gsm8k_prompts(max(n for n, _ in workloads))
    attns = args.attn.split(",")
    # Rows in this order: every backend x mode with the first sampler, then the first backend's CUDA-graph
    # modes with each other sampler.
    samplers = args.sampler.split(",")
    plan = [(a, m, samplers[0]) for a in attns for m in args.modes.split(",")]
    plan += [(attns[0], m, s) for s in samplers[1:] for m in args.modes.split(",") if m.endswith("graphs")]
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=copy_bandwidth_tbs(),
                  sampler=args.sampler, model=model.config.to_hf_dict())
    out = out_dir / ("decode_report.json" if args.report else "decode.json")
    if args.report:
        result["report"] = report(model, all_prompts, attns, args.modes.split(","), samplers[0])
        out.write_text(json.dumps(result, indent=1))
        return
    result["workloads"] = []

    def save():  # after every row: a run cut off at its time limit still leaves what it measured
        out.write_text(json.dumps(result, indent=1))
    for n_prompts, G in workloads:
        w = f"{n_prompts}x{G}"
        prompts, N = all_prompts[:n_prompts], n_prompts * G
        mean_ctx = statistics.mean(len(p) for p in prompts) + args.new / 2
        wl = dict(workload=w, sequences=N, new=args.new, mean_prompt=statistics.mean(len(p) for p in prompts),
                  engine=[])
        result["workloads"].append(wl)
        if args.peers != "none":  # first: the yardstick every row is compared with
            wl["peers"] = hf_peer(model, prompts, G, args.new, args.peers.split(","), args.repeats)
            print(json.dumps(wl["peers"]), flush=True)
            save()
        explained = set()
        for attn, mode, sampler in plan:
            try:
                r = run_engine(model, prompts, G, args.new, attn, mode, args.page_size, sampler,
                               explain=MODES[mode][0] == "step" and (attn, sampler) not in explained,
                               repeats=args.repeats)
                if "graph_breaks" in r:
                    explained.add((attn, sampler))
                engine = r.pop("engine")
                if "breakdown" not in wl:  # floors and the breakdown of the first row's configuration
                    wl["bandwidth_floor_ms"] = bandwidth_floor_ms(engine, N, mean_ctx, result["copy_tb_s"])
                    wl["matmul_floor_ms"] = time_graph(gemm_chain(engine, N, compiled=True))
                    wl["matmul_floor_cublas_ms"] = time_graph(gemm_chain(engine, N, compiled=False))
                    parts = step_breakdown(engine, N, int(mean_ctx), G, int(wl["mean_prompt"]))
                    wl["breakdown"] = dict(parts, attn=attn, mode=mode, sampler=sampler)
                del engine
            except Exception as e:
                traceback.print_exc()
                r = dict(error=repr(e)[:300])
            wl["engine"].append(dict(attn=attn, mode=mode, sampler=sampler, **r))
            print(json.dumps(wl["engine"][-1]), flush=True)
            save()
            torch.cuda.empty_cache()
    print_table(result)


def print_table(result):
    print(f"\n{result['gpu']}  copy {result['copy_tb_s']:.2f} TB/s")
    for wl in result["workloads"]:
        peers = {r["mode"]: r for r in wl.get("peers", []) if "ms_per_step" in r}
        static = peers.get("hf_static_cache", {}).get("tok_per_s")
        mm = wl.get("matmul_floor_ms")
        print(f"\n{wl['workload']} ({wl['sequences']} seqs x {wl['new']} new); floors: bandwidth "
              f"{wl.get('bandwidth_floor_ms', float('nan')):.3f} ms, matmul chain {mm or float('nan'):.3f} ms "
              f"(cuBLAS eager {wl.get('matmul_floor_cublas_ms', float('nan')):.3f})")
        print(f"{'attn':8} {'mode':12} {'sampler':7} {'ms/step':>8} {'tok/s':>9} {'prefill':>8} {'outside':>8} "
              f"{'peak GB':>8} {'x HF static':>11} {'/ matmul':>8} {'kernels':>7} {'breaks':>6}")
        for r in wl["engine"]:
            if "error" in r:
                print(f"{r['attn']:8} {r['mode']:12} {r['sampler']:7} ERROR {r['error'][:80]}")
                continue
            print(f"{r['attn']:8} {r['mode']:12} {r['sampler']:7} {r['ms_per_step']:8.3f} {r['tok_per_s']:9.0f} "
                  f"{r['prefill_ms']:8.2f} {r['outside_windows_ms']:8.2f} {r['peak_gb']:8.2f} "
                  f"{(r['tok_per_s'] / static) if static else float('nan'):11.2f} "
                  f"{(r['ms_per_step'] / mm) if mm else float('nan'):8.2f} {r['kernels_per_step']:7d} "
                  f"{r.get('graph_breaks', '-'):>6}")
            for reason in r.get("break_reasons", []):
                print(f"    graph break: {reason}")
        for mode, r in peers.items():
            print(f"{'hf':8} {mode:12} {'':7} {r['ms_per_step']:8.3f} {r['tok_per_s']:9.0f}")
        if "breakdown" in wl:
            print("step breakdown:", json.dumps(wl["breakdown"]))


if __name__ == "__main__":
    main()
