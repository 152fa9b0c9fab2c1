"""Issue 20's speed table: Dr. GRPO steps of several code versions or settings, each in its own process.

    python bench/speed.py --model-dir /tmp/rand05b --data DATA --steps 8 \
        --variant before=.rev/before --variant after=. --variant after32=.:--micro-batch-size=32 --profile after32

A variant is NAME=CODE[:FLAG,FLAG...]. CODE is a folder holding a minigrpo checkout, whose package (and
top-level kernels/, in code from before it moved into the package) and train.py the variant imports
(`mkdir -p .rev/x && git archive COMMIT | tar -x -C .rev/x` makes one; `.` is this one); the flags are added
to the workload's train.py flags. Workload: 8 prompts x 8 samples x 256 tokens, K = 2, beta 0.04, `--weights bf16
--activation-checkpointing --logprob-chunk-size 256` (LEAN), and bench/train_step.py's stand-in reward, so that
every group trains on random weights.

Each variant starts with an empty compile cache of its own (Inductor's and Triton's), so its compile
seconds are a cold start's. They are measured here, from Dynamo's compile start / end callbacks (lazy
backward compiles included), so code from before the `compile_s` metric is measured alike.

Update MFU: model FLOPs over the update's seconds, against 989 TFLOP/s (H200 dense bf16). Model FLOPs, per
epoch: 6 x (body parameters x tokens + LM-head parameters x completion tokens) for the weights (the LM
head runs on completion positions only; body = all but the embedding and the LM head), plus
3 x 4 x layers x width x sum over rows of T^2 / 2 for causal attention; tokens are the trained rows' real
ones, each row with its own prompt, no padding, no recompute. Since the packed forward shares prompts
(model/packing.py), the update runs fewer FLOPs than that count: its MFU is then an effective one, the rows'
work over the update's seconds. `--profile NAME` runs one more step of that variant under the profiler and
reports how much of the update's wall time the GPU was busy, and its largest kernels.

Results: $OUT/speed.json (every step of every variant) and $OUT/speed_NAME.log; the table on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK_FLOPS = 989e12
LEAN = ["--weights", "bf16", "--activation-checkpointing", "--logprob-chunk-size", "256"]


class StandInReward:
    """The GSM8K task's prompts, scored by the parity of the completion's token ids (bench/train_step.py)."""

    def __init__(self, task):
        self.task, self.stops = task, getattr(task, "stops", None)  # stops: the task's, since issue 18

    def __len__(self):
        return len(self.task)

    def prompt(self, i):
        return self.task.prompt(i)

    def score(self, i, completion_ids):
        return float(sum(completion_ids) % 2 == 0), False

    def describe(self, i):
        return self.task.describe(i)


def model_flops(model, prompt_lens, completion_lens, epochs: int) -> float:
    """The update's model FLOPs (module doc) for trained rows of these lengths."""
    cfg = model.config
    head = model.lm_head.weight.numel()
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("model.embed_tokens", "lm_head")))
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens)]
    attention = 3 * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(t * t / 2 for t in lengths)
    return epochs * (6 * (body * sum(lengths) + head * sum(completion_lens)) + attention)


# kernel families of the update, by name (first match): cuBLAS matmuls, attention, the optimizer, Inductor's fused
# kernels, copies
_KERNEL_KINDS = (("matmul", r"nvjet|gemm|cutlass|xmma"), ("attention", r"flash|fmha|attention|cudnn"),
                 ("optimizer", r"multi_tensor|adam|foreach"), ("inductor", r"^triton_"),
                 ("copy", r"copy|Memcpy|memcpy"))


def gpu_busy(trace_path: str) -> dict:
    """From a chrome trace: the 'update' range's wall seconds, the seconds some kernel ran inside it (union of
    kernel intervals), the kernel count, and the kernels taking the most time."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    window = next(e for e in events if e.get("name") == "update" and e.get("cat") == "user_annotation")
    t0, t1 = window["ts"], window["ts"] + window["dur"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") == "kernel" and t0 <= e["ts"] < t1)
    busy, end, by_name = 0.0, t0, {}
    for s, e, name in kernels:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
        by_name[name[:60]] = by_name.get(name[:60], 0.0) + (e - s)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    by_kind = {}
    for name, t in by_name.items():
        kind = next((k for k, pattern in _KERNEL_KINDS if re.search(pattern, name)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    return {"update_wall_s": (t1 - t0) / 1e6, "gpu_busy_s": busy / 1e6, "kernels": len(kernels),
            "top_kernels_ms": [(n, round(t / 1e3, 1)) for n, t in top],
            "by_kind_ms": {k: round(t / 1e3, 1) for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def worker(args) -> None:
    """One variant, in this process: build the trainer from args.code, run the steps, write one JSON line each."""
    sys.path.insert(0, str(Path(args.code).resolve()))
    from torch._dynamo.callback import callback_handler

    import train as train_cli
    from minigrpo.rl.trainer import Trainer

    clock = {"total": 0.0, "since": None}
    callback_handler.register_start_callback(lambda *_: clock.update(since=time.perf_counter()))
    callback_handler.register_end_callback(
        lambda *_: clock.update(total=clock["total"] + time.perf_counter() - clock["since"], since=None))
    out = Path(tempfile.mkdtemp())
    flags = ["--model-dir", args.model_dir, "--train-data", f"{args.data}/gsm8k/train.jsonl", "--attn", "triton",
             "-B", "8", "-G", "8", "--max-new-tokens", "256", "-K", "2", "--beta", "0.04", "--steps", str(args.steps),
             "--eval-every", "0", "--save-every", "0", "--sample-every", "0", "--out", str(out), *LEAN, *args.flags]
    cli = train_cli.parse_args(flags)
    from minigrpo.rl.distributed import Dist
    build = getattr(train_cli, "build_qa", None) or train_cli.build_gsm8k  # build_qa: code since issue 18
    later = "dist" in inspect.signature(build).parameters  # code since the memory check
    model, tokenizer, task, _, model_dir = build(cli, *((Dist(),) if later else ()))
    backend = train_cli.build_backend(cli, model, tokenizer, task, None)
    trainer = Trainer(cli.cfg, model, tokenizer, StandInReward(task), backend, out, tokenizer_dir=model_dir)
    lens, training_rows = {}, trainer._training_rows

    def spy(*a, **k):  # the trained rows' lengths, for the model FLOPs
        rows = training_rows(*a, **k)
        prompt_lens = getattr(rows.batch, "prompt_lens", None) or [len(p) for p in rows.batch.prompts]  # older code
        lens.update(p=list(prompt_lens), c=list(rows.batch.completion_lens))
        return rows

    trainer._training_rows = spy
    for step in range(1, args.steps + 2 if args.profile else args.steps + 1):
        compiling = clock["total"]
        if step > args.steps:  # the profiled extra step
            from torch.profiler import ProfilerActivity, profile, record_function

            def annotated(*a, update=trainer._update, **k):
                with record_function("update"):
                    return update(*a, **k)
            trainer._update = annotated
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m = trainer.step()
            trace = str(out / "trace.json")
            prof.export_chrome_trace(trace)
            row = {"step": step, "profile": gpu_busy(trace), "time_update": m["time_update"]}
        else:
            m = trainer.step()
            flops = model_flops(model, lens["p"], lens["c"], cli.cfg.inner_epochs)
            row = {"step": step, **{k: round(v, 4) for k, v in m.items() if k.startswith("time_")},
                   "compile_s": round(clock["total"] - compiling, 2), "peak_mem_gib": round(m["peak_mem_gib"], 3),
                   "update_tflops": round(flops / 1e12, 1),
                   "update_mfu": round(flops / m["time_update"] / PEAK_FLOPS, 4),
                   "graphs": m.get("compiled_graphs"), "tokens": sum(lens["p"]) + sum(lens["c"])}
        print("SPEED " + json.dumps(row), flush=True)


def summary(name: str, rows: list[dict]) -> str:
    steps = [r for r in rows if "profile" not in r]
    warm = [r for r in steps if r["step"] >= 4 and r["compile_s"] < 0.5] or steps[-1:]

    def med(key):
        return statistics.median(r[key] for r in warm)
    compile_total = sum(r["compile_s"] for r in steps)
    line = (f"{name:>10} | {med('time_step'):.3f} s/step | roll {med('time_rollout'):.3f} "
            f"lp {med('time_logprobs'):.3f} upd {med('time_update'):.3f} | MFU {100 * med('update_mfu'):.1f}% | "
            f"compile {compile_total:.1f} s (step 1 {steps[0]['compile_s']:.1f}, "
            f"later {compile_total - steps[0]['compile_s']:.1f}) | "
            f"peak {max(r['peak_mem_gib'] for r in steps):.2f} GiB | graphs {steps[-1]['graphs']} | "
            f"warm steps {len(warm)}")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            line += (f"\n{'':>10}   profiled update: {p['update_wall_s']:.3f} s wall, GPU busy {p['gpu_busy_s']:.3f} s "
                     f"({100 * p['gpu_busy_s'] / p['update_wall_s']:.0f}%), {p['kernels']} kernels; "
                     f"by kind ms: {p['by_kind_ms']}; top ms: {p['top_kernels_ms']}")
    return line


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True, help="folder holding gsm8k/train.jsonl")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variant", action="append", default=[], help="NAME=CODE[:FLAG,FLAG...] (module doc)")
    p.add_argument("--profile", action="append", default=[], help="variant NAME to profile one more step of")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    p.add_argument("--flags", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.profile, args.flags = bool(args.profile), json.loads(args.flags)
        return worker(args)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    results, lines = {}, []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        code, _, flags = rest.partition(":")
        flags = [x for f in flags.split(",") if f for x in (f.split("=", 1) if f.startswith("--") else [f])]
        cache = tempfile.mkdtemp(prefix=f"speed_cache_{name}_")
        env = {**os.environ, "PYTHONPATH": str(Path(code).resolve()), "TORCHINDUCTOR_CACHE_DIR": cache,
               "TRITON_CACHE_DIR": f"{cache}/triton", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, __file__, "--worker", "--code", code, "--model-dir", args.model_dir, "--data", args.data,
               "--steps", str(args.steps), *(["--profile", name] if name in args.profile else []),
               "--flags", json.dumps(flags)]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        (out / f"speed_{name}.log").write_text(proc.stdout + proc.stderr)
        rows = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("SPEED ")]
        results[name] = {"code": code, "flags": flags, "steps": rows, "wall_s": round(time.time() - t0, 1)}
        (out / "speed.json").write_text(json.dumps(results, indent=1))
        if proc.returncode or not rows:
            lines.append(f"{name:>10} | failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-400:]}")
        else:
            lines.append(summary(name, rows))
        print(lines[-1], f"[{results[name]['wall_s']} s]", flush=True)
        for r in rows:
            print(f"{'':>10}   {json.dumps(r)}", flush=True)
    print("\n".join(["", "summary (medians of warm steps: step >= 4 and < 0.5 s compiling):", *lines]))


if __name__ == "__main__":
    main()
