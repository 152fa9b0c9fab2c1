"""Every prompt template (`--template`) through the fast engine, and a sampled evaluation, in one process.

    python bench/templates.py --model-dir /tmp/rand05b --data ../shared/data     # bash bench/h200.sh templates

On a random-initialised model of the Qwen2.5-0.5B shape: for each template, --steps trainer steps of
8 GSM8K prompts x 8 samples x 256 new tokens (the engine as train.py builds it: --attn triton, the step
compiled and captured in CUDA graphs), printing seconds per step, rollout tokens/s, and how each
completion ended: at a stop token, at a stop string (cut on the host), or at the budget. Then one sampled
evaluation, r1 template, --eval-samples 4 on the first --eval-limit test examples: pass@k, mean@k, examples/s.
One engine serves all of it, so the decode step compiles once (the templates share its sampling params).

Random weights almost never write "</answer>" (nor a stop token: 2 of 151,936 ids), so expect ~0 stops
and every completion at the budget. The stop path is therefore also run on the engine's own output by a
probe: a rollout cut at the string "a " (a token ending in "a" followed by one starting with a space:
about 0.6% of random positions, so ~3/4 of 256-token completions), checked (the cut text holds the string
once, at its end) and counted, with how many cuts span two tokens (all: no token holds "a "); then the
same rollout again with two token sequences taken from its output as stops in the decode loop: expect
1-2 completions to hold one, each ending at its first occurrence. Random weights never answer right: the
rewards are 0, no group has a reward spread, and each step is a rollout and scoring (no update).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minigrpo.engine.rollout import make_backend  # noqa: E402
from minigrpo.model.checkpoint import load_model  # noqa: E402
from minigrpo.model.tokenizer import Tokenizer  # noqa: E402
from minigrpo.rl.config import TrainConfig  # noqa: E402
from minigrpo.rl.data import derive_seeds  # noqa: E402
from minigrpo.rl.evaluate import evaluate  # noqa: E402
from minigrpo.rl.trainer import Trainer  # noqa: E402
from minigrpo.tasks.qa import load_examples  # noqa: E402
from minigrpo.tasks.task import QATask, prompt_budget  # noqa: E402
from minigrpo.tasks.templates import TEMPLATES, Stops  # noqa: E402

PROBE = "a "


def endings(task: QATask, completions: list[list[int]]) -> dict:
    """How each (cut) completion ended: at a stop token, a stop string, or neither (the budget)."""
    token = sum(c[-1:] != [] and c[-1] in task.stops.ids for c in completions)
    string = sum(c[-1:] != [] and c[-1] not in task.stops.ids and task.stops.end(c)[1] for c in completions)
    return {"stop_token": token, "stop_string": string, "budget": len(completions) - token - string}


def probe(trainer: Trainer, tok: Tokenizer) -> dict:
    """One more rollout of the trainer's prompts, cut at PROBE: the host-side stop path on the engine's output."""
    cfg, task = trainer.cfg, trainer.task
    prompts = [task.prompt(i) for i in range(cfg.prompts_per_step)]
    raw = trainer.backend.generate(prompts, cfg.samples_per_prompt, cfg.max_new_tokens, trainer.params, task.stops.ids,
                                   derive_seeds(cfg.seed, 1, 0, cfg.rows_per_step))
    cut, stopped = Stops(task.stops.ids, (PROBE,), tok.decode).cut(raw)
    at_string = [c for c, s in zip(cut.tokens, stopped) if s and c[-1] not in task.stops.ids]
    # The decode loop's stop sequences: two taken from this rollout's output, the same prompts and seeds again.
    seqs = (tuple(raw.tokens[0][10:12]), tuple(raw.tokens[1][20:23]))
    again = trainer.backend.generate(prompts, cfg.samples_per_prompt, cfg.max_new_tokens, trainer.params,
                                     task.stops.ids + seqs, derive_seeds(cfg.seed, 1, 0, cfg.rows_per_step))
    hits = [next((k for k in range(1, len(c) + 1) if any(tuple(c[max(0, k - len(q)):k]) == q for q in seqs)), None)
            for c in again.tokens]
    return {"cut": len(at_string), "of": len(cut.tokens),  # checked: the string ends in the last token
            "checked": sum(PROBE in tok.decode(c) and PROBE not in tok.decode(c[:-1]) for c in at_string),
            "spanning_tokens": sum(PROBE not in tok.decode(c[-1:]) for c in at_string),
            "len_before": sum(map(len, raw.tokens)) / len(raw.tokens),
            "len_after": sum(map(len, cut.tokens)) / len(cut.tokens),
            # in-graph: how many completions hold a stop sequence, and whether each ends at its first one
            "sequence_stops": sum(h is not None for h in hits),
            "sequence_stops_at_first": sum(h == len(c) for h, c in zip(hits, again.tokens))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True, help="folder holding gsm8k/train.jsonl and gsm8k/test.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="triton")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval-limit", type=int, default=32)
    p.add_argument("--eval-samples", type=int, default=4)
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer.from_dir(args.model_dir)
    model = load_model(args.model_dir, dtype=torch.float32, device=args.device)
    data = Path(args.data) / "gsm8k"
    train = load_examples("gsm8k", "train", data / "train.jsonl")[:64]
    tasks = {name: QATask(train, tok, t) for name, t in TEMPLATES.items()}
    test = QATask(load_examples("gsm8k", "test", data / "test.jsonl"), tok, TEMPLATES["r1"])
    used = [(t, len(train)) for t in tasks.values()] + [(test, args.eval_limit)]
    prompt_tokens = prompt_budget(used, model.config.max_position_embeddings, args.max_new_tokens)
    backend = make_backend(args.attn, model, pad_id=tok.pad_id, max_seq_len=prompt_tokens + args.max_new_tokens,
                           max_batch=args.prompts * args.samples)
    cfg = TrainConfig(prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                      max_new_tokens=args.max_new_tokens, steps=args.steps,
                      compile_policy=torch.device(args.device).type == "cuda")
    result = {}
    for name, task in tasks.items():
        trainer = Trainer(cfg, model, tok, task, backend, out / name, echo=False)
        rows = []
        for _ in range(args.steps):
            m = trainer.step()
            rows.append({k: m[k] for k in ("time_step", "time_rollout", "rollout_tokens_per_s", "completion_len_mean",
                                           "truncated_frac", "reward_mean")}
                        | endings(task, trainer.last_rollout["completions"]))
        last = rows[-1]
        result[name] = {"prompt_tokens": len(task.prompt(0)), "stop_strings": task.stops.strings,
                        "stop_ids": task.stops.ids, "steps": rows}
        print(f"{name:9s} prompt {len(task.prompt(0)):3d} tok | step {last['time_step']:.2f} s (rollout "
              f"{last['time_rollout']:.2f} s, {last['rollout_tokens_per_s']:.0f} tok/s) | len "
              f"{last['completion_len_mean']:.0f} | ended: stop token {last['stop_token']}, stop string "
              f"{last['stop_string']} {task.stops.strings}, budget {last['budget']} | every step "
              f"{[round(r['time_step'], 2) for r in rows]} s", flush=True)
        if name == "r1":
            result["probe"] = probe(trainer, tok)
            print(f"stop probe {PROBE!r} on the engine's r1 rollout: {result['probe']}", flush=True)
            res = evaluate(backend, test, max_new_tokens=args.max_new_tokens, batch_size=args.eval_limit,
                           limit=args.eval_limit, samples=args.eval_samples, temperature=1.0, progress=False)
            result["eval"] = {k: v for k, v in res.items() if k != "records"}
            keys = [k for k in res if "@" in k or k in ("n", "seconds", "examples_per_s", "truncated_frac")]
            print("sampled eval (r1):", ", ".join(f"{k} {res[k]:.3g}" for k in keys), flush=True)
        (out / "templates.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
