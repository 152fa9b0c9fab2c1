"""Evaluation: greedy accuracy, or k sampled completions per example with pass@k and mean@k (CLI: evaluate.py).

Greedy decoding (the default) makes the number a property of the weights alone, which is what a before/after
comparison needs. With k samples the report is mean@k (the accuracy over all k x n completions) and pass@j for
j = 1, 2, 4, ..., k, by the unbiased estimator of Chen et al. (2021). Each completion's seed is a function of
(seed, example, sample), so the numbers do not depend on the batch size or the number of ranks.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from minigrpo.model.sampling import SamplingParams
from minigrpo.rl.data import EVAL, derive_seeds
from minigrpo.rl.distributed import Dist


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), computed as the
    product 1 - prod_{i=n-c+1..n} (1 - k/i), which neither overflows nor cancels (Chen et al. 2021).
    Needs 0 <= c <= n and 1 <= k <= n (summarize's j are)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(backend, task, *, max_new_tokens: int, batch_size: int = 128, limit: int | None = None,
             samples: int = 1, temperature: float = 0.0, seed: int = 0, dist: Dist = Dist(),
             progress: bool = True) -> dict:
    """Accuracy over the first `limit` examples of `task` (all when None), `samples` completions each: summarize's
    metrics, n, seconds, examples_per_s and `records` (one dict per example: its completions' ids, rewards and
    verdicts). Rank r of W evaluates examples r, r+W, ...; the records are gathered on every rank."""
    n = len(task) if limit is None else min(limit, len(task))
    if n < 1:
        raise ValueError(f"nothing to evaluate: the task has {len(task)} examples and limit is {limit}")
    k, params = samples, SamplingParams(temperature=temperature)
    t0 = time.perf_counter()
    mine, records = list(range(dist.rank, n, dist.world)), []
    with tqdm(total=len(mine), desc="eval", unit="ex", leave=False,  # its rate: examples/s
              disable=None if progress and dist.is_main else True) as bar:
        for start in range(0, len(mine), batch_size):
            ids = mine[start:start + batch_size]
            seeds = [s for i in ids for s in derive_seeds(seed, EVAL, i, k)]
            rollout = backend.generate([task.prompt(i) for i in ids], k, max_new_tokens, params,
                                       task.stops.backend_stops, seeds)
            rollout, stopped = task.stops.cut(rollout)
            for r, i in enumerate(ids):
                rows = range(r * k, (r + 1) * k)
                scores = [task.score(i, rollout.tokens[j]) for j in rows]
                records.append({"index": i, **task.describe(i), "completion_ids": [rollout.tokens[j] for j in rows],
                                "rewards": [s[0] for s in scores], "correct": [s[1] for s in scores],
                                "stopped": [stopped[j] for j in rows]})
            bar.update(len(ids))
    records = sorted((r for part in dist.gather_objects(records) for r in part), key=lambda r: r["index"])
    seconds = time.perf_counter() - t0
    return {**summarize(records, k), "n": n, "seconds": seconds, "examples_per_s": n / seconds, "records": records}


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
        for j in sorted({2 ** e for e in range(k.bit_length())} | {k}):
            out[f"pass@{j}"] = sum(pass_at_k(k, sum(r["correct"]), j) for r in records) / n
    return out


def decoded(records: list[dict], decode) -> list[dict]:
    """The records as JSON-ready rows, completions decoded to text (special tokens kept: the stop shows)."""
    return [{**{k: v for k, v in r.items() if k != "completion_ids"},
             "completions": [decode(c, skip_special_tokens=False) for c in r["completion_ids"]]} for r in records]
