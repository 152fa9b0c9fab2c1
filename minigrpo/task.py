"""Tasks: the prompts to train or evaluate on and the verifiable reward of a completion.

The trainer sees a task only through this small interface, so GSM8K and the offline synthetic task
(`minigrpo.synthetic`) are interchangeable:

    len(task)                                  number of examples
    task.prompt(i) -> list[int]                the prompt's token ids (chat template already applied)
    task.score(i, completion_ids) -> (reward, correct)
    task.describe(i) -> dict                   what a human needs to read a logged sample (question, answer)

`correct` is the exact-answer flag behind the accuracy metric; the reward may give partial credit.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from minigrpo.gsm8k import Example, build_messages
from minigrpo.verifier import reward as gsm8k_reward


class Task(Protocol):
    def __len__(self) -> int: ...

    def prompt(self, i: int) -> list[int]: ...

    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]: ...

    def describe(self, i: int) -> dict: ...


class GSM8KTask:
    """GSM8K with the Qwen2.5 chat template; reward 1.0 iff the final answer equals the reference number."""

    def __init__(self, examples: Sequence[Example], tokenizer):
        if not examples:
            raise ValueError("GSM8KTask needs at least one example")
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self._prompts: dict[int, list[int]] = {}  # tokenised on first use: evaluation may touch only a few

    def __len__(self) -> int:
        return len(self.examples)

    def prompt(self, i: int) -> list[int]:
        if i not in self._prompts:
            self._prompts[i] = self.tokenizer.encode_chat(build_messages(self.examples[i].question))
        return self._prompts[i]

    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]:
        r = gsm8k_reward(self.tokenizer.decode(completion_ids), self.examples[i].ground_truth)
        return r, r == 1.0

    def describe(self, i: int) -> dict:
        return {"question": self.examples[i].question, "ground_truth": self.examples[i].ground_truth}
