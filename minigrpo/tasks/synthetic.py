"""Offline, verifiable toy tasks, their tiny tokenizer and a tiny random policy: RL on CPU in a minute.

`FirstDigitTask` (the smoke task): prompt "4071=", answer the first digit then <eos>, "4<eos>". Reward
1.0 for exactly that, 0.5 for the right digit not followed by the stop, 0 otherwise: a random policy is
right ~1/13 of the time, so every batch has signal. The first digit, not the last, because a random model
tends to repeat its last input token; fetching position 0 has to be learned by attention.

`CopyTask` (`--preset learn`): the same prompts, answered with all the digits then <eos>: "407=" ->
"407<eos>". Several tokens, so the engine's decode loop, KV cache and multi-step sampling all shape what
is learned. Reward: the fraction of positions right (over the longer of answer and completion), 1.0 only
for the exact answer; with 3 digits the digits alone score 0.75, so passing 0.8 takes the stop too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights
from minigrpo.tasks.templates import Stops


class CharTokenizer:
    """One token per character of "0123456789=", then <eos> (the stop token) and <pad>; duck-types what the
    trainer uses of `minigrpo.model.tokenizer.Tokenizer`."""

    def __init__(self):
        self.tokens = list("0123456789=") + ["<eos>", "<pad>"]
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.eos_id, self.pad_id = self._ids["<eos>"], self._ids["<pad>"]
        self.stop_ids = (self.eos_id,)
        self.vocab_size = len(self.tokens)

    def encode(self, text: str) -> list[int]:
        return [self._ids[c] for c in text]  # KeyError for a character outside the vocabulary

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        special = {self.eos_id, self.pad_id}
        return "".join(self.tokens[i] for i in ids if not (skip_special_tokens and i in special))


class FirstDigitTask:
    """`num_examples` random digit strings of length `num_digits`; answer = the first digit (see module doc)."""

    def __init__(self, tokenizer: CharTokenizer, num_examples: int, seed: int, num_digits: int = 4):
        self.tokenizer, self.stops = tokenizer, Stops(tokenizer.stop_ids)
        rng = np.random.default_rng([seed, num_digits])
        self.digits = ["".join(map(str, row)) for row in rng.integers(0, 10, size=(num_examples, num_digits))]

    def __len__(self) -> int:
        return len(self.digits)

    def prompt(self, i: int) -> list[int]:
        return self.tokenizer.encode(self.digits[i] + "=")

    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]:
        target = self.tokenizer.encode(self.digits[i][0])
        completion = list(completion_ids)
        if completion == target + [self.tokenizer.eos_id]:
            return 1.0, True
        return (0.5 if completion[:1] == target else 0.0), False

    def describe(self, i: int) -> dict:
        return {"question": self.digits[i] + "=", "ground_truth": self.digits[i][0]}


class CopyTask(FirstDigitTask):
    """FirstDigitTask's prompts; answer = all the digits, then <eos>, with credit per position (module doc)."""

    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]:
        target, completion = self.tokenizer.encode(self.digits[i]) + [self.tokenizer.eos_id], list(completion_ids)
        right = sum(a == b for a, b in zip(completion, target))
        return right / max(len(target), len(completion)), completion == target

    def describe(self, i: int) -> dict:
        return {"question": self.digits[i] + "=", "ground_truth": self.digits[i]}


def tiny_policy(vocab_size: int, seed: int, device: str | torch.device = "cpu") -> Qwen2ForCausalLM:
    """A randomly initialised fp32 policy for the synthetic task, reproducible from `seed`: 2 layers, width 64,
    untied embeddings (76k parameters with CharTokenizer's 13 tokens)."""
    config = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    init_weights(model, torch.Generator().manual_seed(seed), std=0.02)
    return model.to(device)
