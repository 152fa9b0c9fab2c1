"""Tasks: the prompts to train or evaluate on, what ends a completion, and its verifiable reward.

The trainer sees a task only through `Task`, so question/answer data under any template (`QATask`) and
the synthetic tasks (`minigrpo.tasks.synthetic`) are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from minigrpo.tasks.qa import SOURCES, Example, load_examples
from minigrpo.tasks.templates import TEMPLATES, Stops, Template
from minigrpo.tasks.verifier import REWARD_MODES, reward


class Task(Protocol):
    stops: Stops  # stop token ids for the backend, stop strings cut on the host

    def __len__(self) -> int: ...

    def prompt(self, i: int) -> list[int]: ...  # the prompt's token ids, template applied

    # (reward, correct): correct is the exact-answer flag behind accuracy; the reward may give partial credit
    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]: ...

    def describe(self, i: int) -> dict: ...  # what a human needs to read a logged sample


class QATask:
    """Question/answer examples under a prompt template; reward 1.0 iff the answer matches (`reward_mode`)."""

    def __init__(self, examples: Sequence[Example], tokenizer, template: Template = TEMPLATES["chat"],
                 reward_mode: str = "numeric"):
        if not examples:
            raise ValueError("a task needs at least one example")
        self.examples, self.tokenizer = list(examples), tokenizer
        self.template, self.reward_mode = template, reward_mode
        self.stops = template.stops(tokenizer)
        self._prompts: dict[int, list[int]] = {}  # tokenised on first use: evaluation may touch only a few

    def __len__(self) -> int:
        return len(self.examples)

    def prompt(self, i: int) -> list[int]:
        if i not in self._prompts:
            self._prompts[i] = self.template.prompt(self.tokenizer, self.examples[i].question)
        return self._prompts[i]

    def score(self, i: int, completion_ids: Sequence[int]) -> tuple[float, bool]:
        answer = self.template.answer(self.tokenizer.decode(completion_ids))
        r = reward(answer, self.examples[i].ground_truth, self.reward_mode, self.template.answer_tag is not None)
        return r, r == 1.0

    def describe(self, i: int) -> dict:
        ex = self.examples[i]
        return {"question": ex.question, "ground_truth": ex.ground_truth, "source": ex.source}


def load_task(task: str, split: str, tokenizer, *, path=None, template: str = "chat", reward_mode: str | None = None,
              question_field: str | None = None, answer_field: str | None = None) -> QATask:
    """The QATask --task and its flags ask for: from the jsonl `path`, else the Hub; `reward_mode` None: its own."""
    reward_mode = reward_mode or SOURCES[task].reward
    examples = load_examples(task, split, path, question_field=question_field, answer_field=answer_field,
                             numeric=reward_mode == "numeric")
    return QATask(examples, tokenizer, TEMPLATES[template], reward_mode)


def add_task_flags(p) -> None:
    """The command-line flags that choose the data, the prompt template and the reward: load_task's arguments
    (train.py and evaluate.py)."""
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


def prompt_budget(tasks: Sequence[tuple[Task, int]], max_positions: int, max_new_tokens: int,
                  limit: int | None = None, new_tokens_flag: str = "--max-new-tokens") -> int:
    """The prompt budget in tokens: `limit` (--max-prompt-tokens), else the longest prompt of the first n examples
    of each (task, n) in `tasks`. A longer prompt is an error, never truncated or dropped silently. The errors
    name max_new_tokens by `new_tokens_flag`, the flag that set it."""
    room = max_positions - max_new_tokens
    if room < 1:
        raise ValueError(f"{new_tokens_flag} {max_new_tokens} leaves no room for a prompt in the model's "
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
                     ((f"the {room} tokens that the model's {max_positions} positions leave after {max_new_tokens} "
                       f"new tokens"), f"lower {new_tokens_flag}"))
        which = " (training and test)" if len(tasks) > 1 else ""
        raise ValueError(f"{len(over)} of {len(lengths)} prompts{which} are longer than {what} (longest: {longest} "
                         f"tokens, {where}); remove or shorten them, or {fix}")
    return budget if limit is not None else max(n for n, _, _ in lengths)
