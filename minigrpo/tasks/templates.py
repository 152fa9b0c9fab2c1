"""Prompt templates (`--template`), and the stops that end a completion. The templates, whose strings are the
published ones character for character (tests/test_templates.py):

    chat       the Qwen2.5 chat template, one user turn: the question and the Qwen2.5-Math instruction
    r1         DeepSeek-R1-Zero's plain-text template as the Dr. GRPO paper's code (understand-r1-zero)
               uses it: reasoning in <think>, the answer in <answer>, ending at "</answer>"
    qwen-math  the chat template with the Qwen2.5-Math chain-of-thought system prompt, answer in \\boxed{}
    none       the bare question, as plain text

Stop strings: a string such as "</answer>" tokenises differently by context, so no token id catches it.
`Stops.cut` finds it in the decoded text on the host and drops the tokens after the one completing it.
So that a completion does not decode on to the budget, the engine also stops on the string's common
tokenisations (`stop_sequences`): each one's text holds the string, so the host's cut lands on the same
token. A rarer tokenisation decodes on and is cut all the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minigrpo.model.generate import Rollout
from minigrpo.model.tokenizer import IM_END

# The Qwen2.5-Math chain-of-thought prompt, verbatim (its model card's system prompt).
QWEN_MATH_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
# The R1-Zero template as understand-r1-zero's `apply_r1_template` writes it, verbatim.
R1_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\nAssistant: <think>"
)


def stop_sequences(tokenizer, string: str, most: int = 12, longest: int = 4) -> tuple[tuple[int, ...], ...]:
    """How `string` tokenises after a space, a word, a period or a brace, and before the end or newlines: in
    each, the tokens from the one holding its first character to the one completing it (their text holds
    the string). The first `most` distinct ones of at most `longest` tokens (the engine's STOP_LEN); with the
    tokenizer's stop ids, within the engine's MAX_STOPS (tests/test_templates.py)."""
    found = []
    for before in ("x ", "x", "x.", "x}"):
        for after in ("", "\n", "\n\n"):
            ids = tokenizer.encode(before + string + after)
            end = next(k for k in range(1, len(ids) + 1) if string in tokenizer.decode(ids[:k]))
            start = max(j for j in range(end) if string in tokenizer.decode(ids[j:end]))
            if end - start <= longest and tuple(ids[start:end]) not in found:
                found.append(tuple(ids[start:end]))
    return tuple(found[:most])


@dataclass(frozen=True)
class Stops:
    """What ends a completion: a stop token id, or a stop string found in the decoded text by `cut`, which needs
    `decode` (token ids -> text). `sequences` only make the engine stop early (module doc)."""
    ids: tuple[int, ...]
    strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None
    sequences: tuple[tuple[int, ...], ...] = ()

    @property
    def backend_stops(self) -> tuple[int | tuple[int, ...], ...]:
        """What a rollout backend's `generate` takes as `stop_ids`: the ids, then the token sequences."""
        return self.ids + self.sequences

    def end(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """(n, stopped): the completion is tokens[:n], up to and including its first stop."""
        tokens = list(tokens)
        n = next((i + 1 for i, t in enumerate(tokens) if t in self.ids), len(tokens))
        if self.strings and self._holds_string(tokens[:n]):
            # The shortest prefix whose text holds a stop string: its last token completes one.
            return 1 + bisect.bisect_left(range(1, n), True, key=lambda k: self._holds_string(tokens[:k])), True
        return n, n > 0 and tokens[n - 1] in self.ids

    def _holds_string(self, tokens: list[int]) -> bool:
        # A prefix's text is a prefix of the longer text (up to a split UTF-8 character at its end, decoded
        # as U+FFFD, which no stop string holds), so this is monotone in the prefix length: bisection works.
        text = self.decode(tokens)
        return any(s in text for s in self.strings)

    def cut(self, rollout: Rollout) -> tuple[Rollout, list[bool]]:
        """Every completion (and its log-probs) cut after its first stop, and whether it has one."""
        ends = [self.end(t) for t in rollout.tokens]
        tokens = [t[:n] for t, (n, _) in zip(rollout.tokens, ends)]
        logprobs = [lp[:n] for lp, (n, _) in zip(rollout.logprobs, ends)]
        return Rollout(tokens, logprobs), [stopped for _, stopped in ends]


@dataclass(frozen=True)
class Template:
    name: str
    text: str = "{question}"        # the prompt (plain text) or the user turn (chat); {question} is replaced
    chat: bool = False              # render as a Qwen2.5 chat: [system,] user, then the assistant's turn
    system: str | None = None       # the chat's system turn; None: the tokenizer's default
    stop: tuple[str, ...] = ()      # stop strings, besides the tokenizer's stop tokens
    answer_tag: str | None = None   # read the answer from <tag>...</tag> (r1), else from the whole text

    def prompt(self, tokenizer, question: str) -> list[int]:
        """The prompt ids for one question (stripped of surrounding whitespace)."""
        text = self.text.replace("{question}", question.strip())
        if not self.chat:
            return tokenizer.encode(text)
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return tokenizer.encode_chat(system + [{"role": "user", "content": text}])

    def stops(self, tokenizer) -> Stops:
        """The tokenizer's stop tokens (and a chat's end of turn, which a base model may not list), and this
        template's stop strings."""
        end_of_turn = tokenizer.encode(IM_END) if self.chat else []
        ids = tuple(tokenizer.stop_ids) + (tuple(end_of_turn) if len(end_of_turn) == 1 else ())
        sequences = tuple(seq for s in self.stop for seq in stop_sequences(tokenizer, s))
        return Stops(tuple(dict.fromkeys(ids)), self.stop, tokenizer.decode, sequences)

    def answer(self, completion: str) -> str | None:
        """The part of the completion that holds the answer; None if the template's format is not met
        (with a tag, understand-r1-zero's strict `answer_tag_reward_fn` format)."""
        if self.answer_tag is None:
            return completion
        open_, close = f"<{self.answer_tag}>", f"</{self.answer_tag}>"
        if f"</think> {open_}" not in completion or close not in completion:
            return None
        return completion.rpartition(open_)[2].replace(close, "")


TEMPLATES = {t.name: t for t in (
    Template("chat", text="{question}\n" + QWEN_MATH_PROMPT, chat=True),
    Template("r1", text=R1_PROMPT, stop=("</answer>",), answer_tag="answer"),
    Template("qwen-math", chat=True, system=QWEN_MATH_PROMPT),
    Template("none"),
)}
