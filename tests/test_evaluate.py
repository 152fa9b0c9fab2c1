"""Sampled evaluation: the unbiased pass@k estimator against hand-computed values, mean@k, per-example seeds
that do not depend on the batch or the rank, and the shards of a multi-rank evaluation."""

import math
from fractions import Fraction

import pytest

from minigrpo.model.generate import Rollout
from minigrpo.rl.distributed import Dist
from minigrpo.rl.evaluate import evaluate, pass_at_k, summarize
from minigrpo.tasks.templates import Stops


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),                 # pass@1 is the share correct
    (5, 2, 2, 1 - 3 / 10),            # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),            # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),                   # fewer than 4 wrong: any 4 hold a right one
    (10, 0, 5, 0.0),
    (4, 4, 4, 1.0),
    (4, 1, 4, 1.0),                   # n = k: any correct sample passes
    (100, 1, 10, 1 - 90 / 100),       # C(99,10)/C(100,10) = 90/100
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_is_stable_where_the_binomials_are_huge():
    n, c, k = 2000, 7, 300  # C(2000, 300) has ~400 digits: the ratio of floats would overflow
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_summary_of_k_samples():
    rec = lambda correct: {"correct": correct, "rewards": [float(x) for x in correct],  # noqa: E731
                           "completion_ids": [[1, 2]] * len(correct), "stopped": [True] * len(correct)}
    res = summarize([rec([1, 0, 0, 0]), rec([1, 1, 0, 0]), rec([0, 0, 0, 0])], k=4)
    assert res["accuracy"] == res["mean@4"] == 3 / 12
    assert res["pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert res["pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)  # 1 - C(3,2)/C(4,2), 1 - C(2,2)/C(4,2)
    assert res["pass@4"] == pytest.approx(2 / 3) and set(res) >= {"pass@1", "pass@2", "pass@4"}
    assert res["truncated_frac"] == 0 and res["completion_len_mean"] == 2


class EchoTask:
    """n examples; completion = [seed-derived token, STOP]; correct iff that token is even."""
    stops = Stops((99,))

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def prompt(self, i):
        return [i]

    def score(self, i, completion):
        return float(completion[0] % 2 == 0), completion[0] % 2 == 0

    def describe(self, i):
        return {"question": str(i)}


class SeedBackend:
    """Each completion is a function of its seed alone, as with the real counter-based samplers."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, samples_per_prompt, max_new_tokens, params, stop_ids, seeds):
        self.calls.append((len(prompts), params.temperature))
        return Rollout([[s % 1000, 99] for s in seeds], [[0.0, 0.0] for _ in seeds])


def test_sampled_results_do_not_depend_on_batch_or_rank(monkeypatch):
    task = EchoTask(7)
    run = lambda **kw: evaluate(SeedBackend(), task, max_new_tokens=4, samples=4, temperature=1.0,  # noqa: E731
                                progress=False, **kw)
    whole, small_batches = run(batch_size=7), run(batch_size=2)
    assert whole["records"] == small_batches["records"] and 0 < whole["accuracy"] < 1
    assert len({tuple(c[0] for c in r["completion_ids"]) for r in whole["records"]}) == 7  # distinct seeds
    # Two ranks: each evaluates examples r, r+2, ...; the gather (stubbed: no process group) joins them.
    monkeypatch.setattr(Dist, "gather_objects", lambda self, obj: [obj])
    parts = [run(batch_size=3, dist=Dist(rank=r, world=2))["records"] for r in (0, 1)]
    monkeypatch.setattr(Dist, "gather_objects", lambda self, obj: parts)
    joined = run(batch_size=3, dist=Dist(rank=0, world=2))
    assert [r["index"] for r in parts[0]] == [0, 2, 4, 6] and [r["index"] for r in parts[1]] == [1, 3, 5]
    assert joined["records"] == whole["records"] and joined["pass@4"] == whole["pass@4"]
