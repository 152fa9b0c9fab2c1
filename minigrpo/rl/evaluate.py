"""Greedy evaluation: accuracy of one deterministic completion per example (GSM8K test split by default).

    python -m minigrpo.rl.evaluate --model-dir checkpoints/qwen2.5-0.5b-instruct --test-data test.jsonl --limit 200
    python -m minigrpo.rl.evaluate --model-dir runs/gsm8k/checkpoints/step_000200/model --out eval.jsonl

Greedy decoding makes the number a property of the weights alone (no sampling noise), which is what a
before/after comparison needs. The trainer calls `evaluate` with its own rollout backend, so evaluation
runs on the same engine and weights as the rollouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from minigrpo.model.sampling import GREEDY
from minigrpo.rl.distributed import Dist


@torch.no_grad()
def evaluate(backend, task, *, stop_ids, max_new_tokens: int, batch_size: int = 128, limit: int | None = None,
             progress: bool = True, dist: Dist = Dist()) -> dict:
    """Greedy accuracy over the first `limit` examples of `task` (all when None).

    Returns accuracy, reward_mean, completion_len_mean, truncated_frac, n, seconds, and `records`
    (one dict per example with the decoded completion) for inspection. Under torchrun (`dist`) every rank
    evaluates every W-th example, and the numbers are over all of them; `records` holds this rank's.
    """
    n = len(task) if limit is None else min(limit, len(task))
    if n < 1:
        raise ValueError(f"nothing to evaluate: the task has {len(task)} examples and limit is {limit}")
    t0 = time.perf_counter()
    stops = set(stop_ids)
    correct = rewards = lengths = truncated = 0
    records = []
    mine = range(dist.rank, n, dist.world)
    for start in tqdm(range(0, len(mine), batch_size), desc="eval", unit="batch", disable=None if progress else True):
        ids = list(mine[start:start + batch_size])
        rollout = backend.generate([task.prompt(i) for i in ids], 1, max_new_tokens, GREEDY, tuple(stop_ids),
                                   [0] * len(ids))
        for i, completion in zip(ids, rollout.tokens):
            reward, ok = task.score(i, completion)
            correct, rewards, lengths = correct + ok, rewards + reward, lengths + len(completion)
            truncated += not stops & set(completion)
            records.append({**task.describe(i), "completion_ids": completion, "reward": reward, "correct": ok})
    correct, rewards, lengths, truncated = dist.sum(torch.tensor([correct, rewards, lengths, truncated],
                                                                 dtype=torch.float64)).tolist()
    return {"accuracy": correct / n, "reward_mean": rewards / n, "completion_len_mean": lengths / n,
            "truncated_frac": truncated / n, "n": n, "seconds": time.perf_counter() - t0, "records": records}


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None,
                   help="HF model directory to evaluate (default: weights/download.py's directory, downloaded "
                        "when missing)")
    p.add_argument("--test-data", default=None,
                   help="GSM8K test jsonl (openai/grade-school-math format); default: openai/gsm8k from the Hub "
                        "(needs pyarrow)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N test examples (default all)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="generation budget per answer (default 512)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts generated together (default 128)")
    p.add_argument("--attn", choices=["reference", "eager", "sdpa", "triton"], default=None,
                   help="rollout backend: the reference generator or the fast engine with this attention "
                        "(default: triton on CUDA, reference on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available)")
    p.add_argument("--out", type=Path, default=None, help="write one JSON line per example (completion, verdict)")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")

    from minigrpo.engine.rollout import make_backend
    from minigrpo.model.checkpoint import load_model
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.tasks.gsm8k import load_gsm8k
    from minigrpo.tasks.task import GSM8KTask, prompt_budget

    try:
        model_dir = resolve_model_dir(args.model_dir)
        task = GSM8KTask(load_gsm8k("test", args.test_data), Tokenizer.from_dir(model_dir))
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        model = load_model(model_dir, dtype=dtype, device=args.device).eval()
        n = min(len(task), args.limit or len(task))
        prompt_budget([(task, n)], model.config.max_position_embeddings, args.max_new_tokens)
        attn = args.attn or ("triton" if model.lm_head.weight.is_cuda else "reference")
        backend = make_backend(attn, model, pad_id=task.tokenizer.pad_id)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None
    tokenizer = task.tokenizer
    res = evaluate(backend, task, stop_ids=tokenizer.stop_ids,
                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit)
    if args.out is not None:
        with args.out.open("w") as f:
            for r in res["records"]:
                text = tokenizer.decode(r.pop("completion_ids"))
                f.write(json.dumps({**r, "completion": text}) + "\n")
    print(f"greedy accuracy {res['accuracy']:.4f} on {res['n']} GSM8K test examples "
          f"(mean length {res['completion_len_mean']:.0f} tokens, {res['truncated_frac']:.1%} truncated, "
          f"{res['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
