"""Seeded streams: the prompt order, and the seeds of rollouts, evaluation, the minibatch shuffle and rounding.

Every random number is a pure function of (seed, stream tag, step, ...), never a generator's state, so a
resumed run reproduces an uninterrupted one. The prompt order is an endless stream of example indices, a
fresh permutation every epoch: the sampler's whole state is (epoch, position).
"""

from __future__ import annotations

import numpy as np

# Stream tags, one per user of (seed, tag, ...): the prompt order, the rollout's sampling seeds, the update's
# minibatch shuffle, the bf16 optimizer's rounding noise and the evaluation's sampling seeds.
ORDER, ROLLOUT, SHUFFLE, ROUNDING, EVAL = 0x5EED_DA7A, 0x5A3D, 0x5AFF, 0x5A40, 0xE7A1


def derive_seeds(seed: int, tag: int, step: int, n: int) -> list[int]:
    """n distinct-in-practice int64 seeds, a pure function of (seed, tag, step); the first n of any longer list."""
    state = np.random.SeedSequence([seed, tag, step]).generate_state(n, dtype=np.uint64)
    return (state >> np.uint64(1)).astype(np.int64).tolist()


class EpochSampler:
    def __init__(self, num_examples: int, seed: int):
        if num_examples < 1:
            raise ValueError(f"the training set is empty (num_examples={num_examples})")
        self.num_examples, self.seed = num_examples, seed
        self.epoch, self.pos = 0, 0

    def next(self, k: int) -> list[int]:
        """The next k example indices (crossing into the next epoch, and its new order, when needed)."""
        out = []
        while len(out) < k:
            if self.pos == self.num_examples:
                self.epoch, self.pos = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, ORDER, self.epoch]).permutation(self.num_examples)
            take = min(k - len(out), self.num_examples - self.pos)
            out += order[self.pos:self.pos + take].tolist()
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"num_examples": self.num_examples, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.state_dict()):
            raise ValueError(f"a data-order state needs {sorted(self.state_dict())}, got {sorted(state)}")
        if (state["num_examples"], state["seed"]) != (self.num_examples, self.seed):
            raise ValueError(f"cannot resume the data order: the checkpoint was taken on {state['num_examples']} "
                             f"examples with seed {state['seed']}, this run has {self.num_examples} examples with "
                             f"seed {self.seed}; resume with the same training data and --seed")
        self.epoch, self.pos = state["epoch"], state["pos"]
