"""Full Dr. GRPO steps on a random-initialised Qwen2.5-0.5B: seconds per phase, rollout's share, and the
update's memory with chunked log-probs vs full logits.

    python bench/train_step.py --model-dir /tmp/rand05b --data ../shared/data [--attn triton,sdpa:none]

`--attn` entries are BACKEND[:COMPILE]: `sdpa:none` runs that backend with `--compile none` (CUDA graphs
still on), which skips its ~70 s step compile when only the phases after the rollout matter.

Random weights never solve a GSM8K problem, so with the real reward every group has zero spread and
the trainer (rightly) skips the update. To time every phase at the real sizes, the GSM8K prompts are
scored here by a stand-in reward, the parity of the completion's token sum: about half the samples of
a group score 1, so every group trains. Timing does not depend on what the reward values are.
Settings: 8 prompts x 8 samples x 256 new tokens, K=2, beta=0.04 (as train.py flags). JSON to $OUT.

Each run also reports the memory estimate (minigrpo/rl/memory.py) beside its measured peak; a run the
estimate says would not fit stops at start, and its one-line message is the result (`refused`).

Data parallel (issue 6's scaling table): under `torchrun --nproc-per-node N` each rank rolls out
--prompts prompts, so the per-GPU batch stays fixed and B = N x --prompts (`-- --parallel fsdp` for FSDP2).
Rank 0 reports; step times, samples/s and tokens/s are over all ranks, `peak_gib_per_rank` lists each
rank's. --profile profiles one more step on every rank: the top kernels, the time in NCCL kernels and the
time the GPU has no compute kernel running, to profile.txt (rank 0) and a Chrome trace per rank.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train as train_cli  # noqa: E402
from bench.workload import StandInReward  # noqa: E402
from minigrpo.engine.decode import DecodeModel  # noqa: E402
from minigrpo.rl import distributed  # noqa: E402
from minigrpo.rl.trainer import Trainer  # noqa: E402


class GcClock:
    """Seconds the garbage collector ran, and its full (generation 2) collections, since reset()."""

    def __init__(self):
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2

    def reset(self) -> dict:
        seen = {"gc_s": self.seconds, "gc_full": self.full}
        self.seconds, self.full = 0.0, 0
        return seen


def run(spec: str, args, full_logits: bool, out: Path, dist: distributed.Dist) -> list[dict]:
    attn, _, comp = spec.partition(":")
    flags = ["--model-dir", args.model_dir, "--train-data", f"{args.data}/gsm8k/train.jsonl", "--device", args.device,
             "--attn", attn, "-B", str(args.prompts * dist.world), "-G", "8", "--max-new-tokens", "256",
             "-K", "2", "--beta", "0.04", "--steps", str(args.steps), "--eval-every", "0", "--save-every", "0",
             "--sample-every", "0", "--out", str(out)]
    # the full-logits flag goes last: it overrides a --logprob-chunk-size among the extra flags
    cli = train_cli.parse_args(flags + (["--compile", comp] if comp else []) + args.extra
                               + (["--logprob-chunk-size", "0"] if full_logits else []))
    model, tokenizer, task, _, model_dir = train_cli.build_qa(cli, dist)  # DoesNotFit: stops at start
    backend = train_cli.build_backend(cli, model, tokenizer, task, None, dist.world)
    reward = StandInReward(task)
    trainer = Trainer(cli.cfg, model, tokenizer, reward, backend, out, tokenizer_dir=model_dir, dist=dist)
    pool = getattr(backend, "kv", None)  # the engine's KV pool, resident through the update
    kv_gib = sum(t.numel() * t.element_size() for t in pool.k + pool.v) / 2**30 if pool else 0.0
    rows, clock = [], GcClock()
    for _ in range(args.steps):
        clock.reset()
        rows.append(dict(trainer.step(), kv_pool_gib=kv_gib, **clock.reset()))
        if rows[-1]["compile_s"] > 0.5:  # closes the step's block of TORCH_LOGS=recompiles lines (stderr)
            print(f"step {len(rows)} compiled for {rows[-1]['compile_s']:.1f} s", file=sys.stderr, flush=True)
    gc.callbacks.remove(clock._on)  # the next run (another --attn) starts its own clock
    if dist.is_main:  # where the compile seconds went, by stage (tracing, AOT, Inductor, Triton builds); cumulative
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_times.txt").write_text(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    # The estimate the start-up check made (for the data's longest prompt), and for the longest one drawn
    estimates = [train_cli.memory_estimator(cli, model.config, task, None, dist.world, longest_prompt=n)(cli.cfg)
                 for n in (None, reward.longest)]
    if args.profile:  # one more step under the profiler: where the time goes, GPU kernels vs host
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prof_row = trainer.step()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        nccl_us = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
        phases = ", ".join(f"{k[5:]} {v:.3f}" for k, v in prof_row.items()
                           if k.startswith("time_") and k != "time_step")
        launches = sum(e.count for e in events
                       if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        summary = (f"rank {dist.rank} profiled step: {prof_row['time_step']:.3f} s wall ({phases}); GPU kernels busy "
                   f"{gpu_us / 1e6:.3f} s, of which NCCL {nccl_us / 1e6:.3f} s; no compute kernel running "
                   f"{compute_idle_s(prof):.3f} s; {launches} kernel launches\n")
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"trace_rank{dist.rank}.json.gz"))
        if dist.is_main:
            (out / "profile.txt").write_text(summary + events.table(sort_by="self_cuda_time_total", row_limit=30))
        print(summary, flush=True)
    del trainer, backend, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, estimates


def compute_idle_s(prof) -> float:
    """Seconds of the profiled window in which no non-NCCL GPU kernel runs: the union of the compute kernels'
    intervals, subtracted from the window from the first kernel's start to the last one's end."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" not in e.name.lower())
    if not spans:
        return 0.0
    busy, (lo, hi) = 0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return (max(b for _, b in spans) - spans[0][0] - busy) / 1e6


KEYS = ("time_rollout", "time_reward", "time_logprobs", "time_update", "time_sync", "time_step", "rollout_tokens_per_s",
        "peak_mem_gib", "peak_mem_update_gib", "update_working_mem_gib", "trained_rows", "loss", "kl", "clip_frac",
        "grad_norm", "logp_diff_mean", "logp_diff_max", "mismatch_kl", "tis_weight_mean", "tis_ratio_max",
        "tis_capped_frac", "old_logp_gap_mean", "old_logp_gap_max", "compiled_graphs", "compile_s",
        "completion_len_mean", "kv_pool_gib", "gc_s", "gc_full")


def summary(rows: list[dict], estimates, dist: distributed.Dist, samples: int) -> dict:
    """The last step's metrics, the fastest step after the first that compiled nothing, each step's times, and
    the memory estimate against the measured peak: for the data's longest prompt (what the start-up check
    used) and, like for like, for the longest prompt the steps drew (estimate_error). samples: completions
    per step over all ranks; every rank's peak in peak_gib_per_rank (a collective: every rank calls this)."""
    last, (estimate, drawn) = rows[-1], estimates
    row = {k: last[k] for k in KEYS if k in last}
    row.update(rollout_share=last["time_rollout"] / last["time_step"], world=dist.world)
    peak = max(r.get("peak_mem_gib", 0.0) for r in rows)
    row["peak_gib_per_rank"] = [round(x, 2) for x in dist.gather(torch.tensor([peak])).tolist()]
    row.update(peak_gib=peak, estimate_gib=estimate.total / 2**30, estimate_drawn_gib=drawn.total / 2**30,
               estimate_error=drawn.total / 2**30 / peak - 1 if peak else None, estimate_terms=str(drawn))
    graphs = [r.get("compiled_graphs", 0) for r in rows]
    warm = [r["time_step"] for i, r in enumerate(rows) if i and graphs[i] == graphs[i - 1]]
    row["warm_step_s"] = min(warm) if warm else None
    row["median_warm_step_s"] = sorted(warm)[len(warm) // 2] if warm else None
    row["samples_per_s"] = samples / row["median_warm_step_s"] if warm else None
    per_step = ("compiled_graphs", "compile_s", "gc_s", "gc_full")
    row["every_step"] = [{k: round(r[k], 3) for k in KEYS if k in r and (k.startswith("time") or k in per_step)}
                         for r in rows]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True, help="folder holding gsm8k/train.jsonl")
    p.add_argument("--attn", default="triton,sdpa", help="BACKEND[:COMPILE], comma-separated ('' = none: only "
                   "the --full-logits run)")
    p.add_argument("--full-logits-attn", default="triton:none", help="the backend of the --full-logits run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step per rank (x 8 samples each)")
    p.add_argument("--steps", type=int, default=2, help="steps per backend; the last one is reported")
    p.add_argument("--full-logits", action="store_true",
                   help="also one run with full logits (--logprob-chunk-size 0: the naive log_softmax)")
    p.add_argument("--profile", action="store_true", help="profile one extra step (profile.txt in each run's folder)")
    p.add_argument("--engine-copy", action="store_true",
                   help="the engine keeps a copy of the weights, synced after each update, even where it could share "
                        "the policy's memory (--weights bf16 on CUDA): the behaviour before sharing, to compare")
    p.add_argument("extra", nargs="*", help="more train.py flags (after --)")
    args = p.parse_args()
    if args.engine_copy:
        DecodeModel.load_from = functools.partialmethod(DecodeModel.load_from, share=False)
    dist, args.device = distributed.init_from_env(args.device)  # torchrun: one GPU per rank
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    runs = [(a, False) for a in args.attn.split(",") if a]
    runs += [(args.full_logits_attn, True)] if args.full_logits else []
    for attn, full in runs:
        name = (f"{attn}_full_logits" if full else attn).replace(":", "_compile_")
        try:
            rows, estimates = run(attn, args, full, out / f"train_{name}", dist)
            result[name] = summary(rows, estimates, dist, samples=8 * args.prompts * dist.world)
        except train_cli.DoesNotFit as e:  # the memory check stopped it at start: that line is the result
            result[name] = {"refused": str(e)}
        if dist.is_main:
            print(name, json.dumps(result[name]), flush=True)
            (out / "train_step.json").write_text(json.dumps(result, indent=1))  # after each run: partials survive
    distributed.shutdown(dist, together=True)


if __name__ == "__main__":
    main()
