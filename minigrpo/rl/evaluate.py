"""Evaluation: greedy accuracy, or k sampled completions per example with pass@k and mean@k.

    python -m minigrpo.rl.evaluate --model-dir checkpoints/qwen2.5-0.5b-instruct --test-data test.jsonl --limit 200
    python -m minigrpo.rl.evaluate --model-dir DIR --task math --template r1 --eval-samples 8 --eval-temperature 1
    torchrun --nproc-per-node 4 -m minigrpo.rl.evaluate ...     # each rank evaluates its share of the examples

Greedy decoding (the default: 1 sample at temperature 0) makes the number a property of the weights alone,
which is what a before/after comparison needs. With --eval-samples k the report is mean@k (the accuracy
over all k x n completions) and pass@j for j = 1, 2, 4, ..., k, by the unbiased estimator of Chen et al.
(2021). Each completion's seed is a function of (seed, example, sample), so the numbers do not depend on
the batch size or the number of ranks. The trainer calls `evaluate` with its own rollout backend, so
evaluation runs on the same engine and weights as the rollouts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minigrpo.model.sampling import SamplingParams
from minigrpo.rl.distributed import Dist

_EVAL = 0xE7A1  # keeps the evaluation's sampling seeds apart from other (seed, ...) users


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), computed as the
    product 1 - prod_{i=n-c+1..n} (1 - k/i), which neither overflows nor cancels (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(backend, task, *, max_new_tokens: int, batch_size: int = 128, limit: int | None = None,
             samples: int = 1, temperature: float = 0.0, seed: int = 0, dist: Dist = Dist(),
             progress: bool = True) -> dict:
    """Accuracy over the first `limit` examples of `task` (all when None), `samples` completions each.

    Rank r of W evaluates examples r, r+W, ...; the records are gathered on every rank. Returns accuracy
    (= mean@k), pass@j (k > 1), reward_mean, completion_len_mean, truncated_frac, n, seconds,
    examples_per_s and `records` (one dict per example, its completions' ids, rewards and verdicts)."""
    n = len(task) if limit is None else min(limit, len(task))
    if n < 1:
        raise ValueError(f"nothing to evaluate: the task has {len(task)} examples and limit is {limit}")
    k, params = samples, SamplingParams(temperature=temperature)
    if k > 1 and params.greedy:
        raise ValueError(f"{k} greedy samples would be {k} copies of one completion; sample at a temperature > 0")
    t0 = time.perf_counter()
    mine, records = list(range(dist.rank, n, dist.world)), []
    bar = tqdm(total=len(mine), desc="eval", unit="ex", leave=False,  # its rate: examples/s
               disable=None if progress and dist.is_main else True)
    for start in range(0, len(mine), batch_size):
        ids = mine[start:start + batch_size]
        seeds = [s for i in ids for s in _seeds(seed, i, k)]
        rollout = backend.generate([task.prompt(i) for i in ids], k, max_new_tokens, params, task.stops.backend_stops,
                                   seeds)
        rollout, stopped = task.stops.cut(rollout)
        for r, i in enumerate(ids):
            rows = range(r * k, (r + 1) * k)
            scores = [task.score(i, rollout.tokens[j]) for j in rows]
            records.append({"index": i, **task.describe(i), "completion_ids": [rollout.tokens[j] for j in rows],
                            "rewards": [s[0] for s in scores], "correct": [s[1] for s in scores],
                            "stopped": [stopped[j] for j in rows]})
        bar.update(len(ids))
    bar.close()
    records = sorted((r for part in dist.gather_objects(records) for r in part), key=lambda r: r["index"])
    seconds = time.perf_counter() - t0
    return {**summarize(records, k), "n": n, "seconds": seconds, "examples_per_s": n / seconds, "records": records}


def _seeds(seed: int, example: int, k: int) -> list[int]:
    state = np.random.SeedSequence([seed, _EVAL, example]).generate_state(k, dtype=np.uint64)
    return (state >> np.uint64(1)).astype(np.int64).tolist()


def summarize(records: list[dict], k: int) -> dict:
    """The metrics of per-example records with k completions each."""
    def flat(key):
        return [x for r in records for x in r[key]]
    correct, n = flat("correct"), len(records)
    out = {"accuracy": sum(correct) / len(correct), "reward_mean": sum(flat("rewards")) / len(correct),
           "completion_len_mean": sum(map(len, flat("completion_ids"))) / len(correct),
           "truncated_frac": 1 - sum(flat("stopped")) / len(correct)}
    if k > 1:
        out[f"mean@{k}"] = out["accuracy"]
        for j in sorted({2 ** e for e in range(k.bit_length()) if 2 ** e <= k} | {k}):
            out[f"pass@{j}"] = sum(pass_at_k(k, sum(r["correct"]), j) for r in records) / n
    return out


def decoded(records: list[dict], decode) -> list[dict]:
    """The records as JSON-ready rows, completions decoded to text (special tokens kept: the stop shows)."""
    return [{**{k: v for k, v in r.items() if k != "completion_ids"},
             "completions": [decode(c, skip_special_tokens=False) for c in r["completion_ids"]]} for r in records]


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """`model_dir` if given; otherwise weights/download.py's default directory, downloaded when missing."""
    from weights.download import DEFAULT_DIR, DEFAULT_REPO, download

    if model_dir is not None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json); download one with "
                                    f"`python weights/download.py --out {model_dir}`")
        return model_dir
    if not (DEFAULT_DIR / "config.json").is_file() or not any(DEFAULT_DIR.glob("*.safetensors")):
        print(f"no model at {DEFAULT_DIR}: downloading {DEFAULT_REPO} ...", file=sys.stderr)
        download(DEFAULT_REPO, DEFAULT_DIR)  # offline: exits with a message saying what to do
    return DEFAULT_DIR


def add_task_flags(p) -> None:
    """The flags that choose the data, the prompt template and the reward: train.py has the same."""
    from minigrpo.tasks.qa import SOURCES
    from minigrpo.tasks.templates import TEMPLATES
    from minigrpo.tasks.verifier import REWARD_MODES

    p.add_argument("--task", choices=sorted(SOURCES), default="gsm8k",
                   help="gsm8k or math (the Hub's, or local jsonl of their format), or jsonl: your own file, "
                        "given with the data flags, with the fields below")
    p.add_argument("--template", choices=list(TEMPLATES), default="chat",
                   help="prompt template: chat (Qwen2.5 chat, the Qwen2.5-Math instruction), r1 (the R1-Zero "
                        "plain-text template: <think>, then <answer>), qwen-math (chat with the Qwen2.5-Math "
                        "system prompt), none (the bare question)")
    p.add_argument("--question-field", default=None, help="the question's field in a jsonl record "
                   "(default: the task's, 'question' for gsm8k and jsonl, 'problem' for math)")
    p.add_argument("--answer-field", default=None, help="the answer's field (default: 'answer'; for math "
                   "'solution', whose last \\boxed{} is the answer)")
    p.add_argument("--reward", choices=REWARD_MODES, default=None,
                   help="numeric: the final number; exact: the boxed (or <answer>) text; boxed: that, or "
                        "symbolically equal by math-verify if installed (default: boxed for math, else numeric)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None,
                   help="HF model directory to evaluate (default: weights/download.py's directory, downloaded "
                        "when missing)")
    p.add_argument("--test-data", default=None, help="test jsonl (default: the task's test split from the Hub)")
    add_task_flags(p)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N test examples (default all)")
    p.add_argument("--eval-samples", type=int, default=1, help="completions per example (default 1)")
    p.add_argument("--eval-temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampled completions (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="generation budget per answer (default 512)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts generated together (default 128)")
    p.add_argument("--attn", choices=["reference", "eager", "sdpa", "triton"], default=None,
                   help="rollout backend: the reference generator or the fast engine with this attention "
                        "(default: triton on CUDA, reference on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available)")
    p.add_argument("--out", type=Path, default=None, help="write one JSON line per example (completions, verdicts)")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.eval_samples < 1 or args.eval_temperature < 0 or not math.isfinite(args.eval_temperature):
        p.error(f"need --eval-samples >= 1 and a finite --eval-temperature >= 0, got {args.eval_samples} and "
                f"{args.eval_temperature}")
    if args.eval_samples > 1 and args.eval_temperature == 0:
        p.error(f"--eval-samples {args.eval_samples} at --eval-temperature 0 would be copies of one greedy "
                f"completion; pass --eval-temperature > 0")

    from minigrpo.engine.rollout import make_backend
    from minigrpo.model.checkpoint import load_model
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.rl import distributed
    from minigrpo.tasks.task import load_task, prompt_budget

    try:
        dist, args.device = distributed.init_from_env(args.device)
        model_dir = resolve_model_dir(args.model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        task = load_task(args.task, "test", tokenizer, path=args.test_data, template=args.template,
                         reward_mode=args.reward, question_field=args.question_field, answer_field=args.answer_field)
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        model = load_model(model_dir, dtype=dtype, device=args.device).eval()
        n = min(len(task), args.limit or len(task))
        prompt_tokens = prompt_budget([(task, n)], model.config.max_position_embeddings, args.max_new_tokens)
        attn = args.attn or ("triton" if model.lm_head.weight.is_cuda else "reference")
        backend = make_backend(attn, model, pad_id=tokenizer.pad_id, max_seq_len=prompt_tokens + args.max_new_tokens)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None
    res = evaluate(backend, task, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
                   samples=args.eval_samples, temperature=args.eval_temperature, seed=args.seed, dist=dist)
    if dist.is_main:
        if args.out is not None:
            args.out.write_text("".join(json.dumps(r) + "\n" for r in decoded(res["records"], tokenizer.decode)))
        k = args.eval_samples
        scores = (f"greedy accuracy {res['accuracy']:.4f}" if k == 1 else
                  ", ".join(f"{key} {res[key]:.4f}" for key in res if key.startswith(("mean@", "pass@"))))
        print(f"{scores} on {res['n']} {args.task} test examples ({args.template} template; mean length "
              f"{res['completion_len_mean']:.0f} tokens, {res['truncated_frac']:.1%} truncated, {res['seconds']:.0f}s, "
              f"{res['examples_per_s']:.2f} examples/s)")
    distributed.shutdown(dist, together=True)


if __name__ == "__main__":
    main()
