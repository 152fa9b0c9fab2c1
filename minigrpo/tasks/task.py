"""Tasks: the prompts to train or evaluate on and the verifiable reward of a completion.

The trainer sees a task only through this small interface, so GSM8K and the offline synthetic task
(`minigrpo.tasks.synthetic`) are interchangeable:

    len(task)                                  number of examples
    task.prompt(i) -> list[int]                the prompt's token ids (chat template already applied)
    task.score(i, completion_ids) -> (reward, correct)
    task.describe(i) -> dict                   what a human needs to read a logged sample (question, answer)

`correct` is the exact-answer flag behind the accuracy metric; the reward may give partial credit.

`prompt_budget` checks, at load time, that every prompt fits the model with its completion budget.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from minigrpo.tasks.gsm8k import Example, build_messages
from minigrpo.tasks.verifier import reward as gsm8k_reward


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
        ex = self.examples[i]
        return {"question": ex.question, "ground_truth": ex.ground_truth, "source": ex.source}


def prompt_budget(tasks: Sequence[tuple[Task, int]], max_positions: int, max_new_tokens: int,
                  limit: int | None = None) -> int:
    """The prompt budget in tokens: `limit` (--max-prompt-tokens), by default the longest prompt used.

    `tasks` pairs each task with how many of its first examples the run uses. Every one of those prompts
    must fit the budget, and the budget plus `max_new_tokens` the model's positions: a longer prompt is
    refused now, naming how many there are and where the longest is, never truncated or dropped silently
    (the run trains on exactly the data it was given)."""
    room = max_positions - max_new_tokens
    if room < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                         f"{max_positions} positions")
    if limit is not None and limit > room:
        raise ValueError(f"--max-prompt-tokens {limit} plus {max_new_tokens} new tokens exceeds the model's "
                         f"{max_positions} positions; use at most {room}")
    lengths = [(len(task.prompt(i)), task, i) for task, n in tasks for i in range(n)]
    budget = room if limit is None else limit
    over = [x for x in lengths if x[0] > budget]
    if over:
        longest, task, i = max(over, key=lambda x: x[0])
        where = task.describe(i).get("source") or f"example {i}"
        what, fix = ((f"--max-prompt-tokens {limit}", "raise --max-prompt-tokens") if limit is not None else
                     (f"the {room} tokens that the model's {max_positions} positions leave after {max_new_tokens} "
                      f"new tokens", "lower --max-new-tokens"))
        raise ValueError(f"{len(over)} of {len(lengths)} prompts are longer than {what} (longest: {longest} tokens, "
                         f"{where}); remove or shorten them, or {fix}")
    return budget if limit is not None else max(n for n, _, _ in lengths)
