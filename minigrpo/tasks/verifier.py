"""Rule-based rewards: pull the final answer out of a completion and compare it to the reference.

The reward is RL's only signal, so it is boring and robust: it never raises or hangs on any string the
policy can emit (linear-time regexes, capped inputs); it compares numbers, not strings ("$1,000.00",
"1000" and "\\boxed{1000 \\text{ dollars}}" agree); an ambiguous answer ("5 or 6") is wrong. A sign is never
lost ("\u22125", "-$5" are -5), and markdown or unit words around the number ("**18**", "60 km/h") are not
mistaken for arithmetic, while an unevaluated expression ("3/4 + 1", "5-2") is still not a number.
"""

from __future__ import annotations

import math
import re

MAX_TEXT_CHARS = 16_384  # only this tail is scanned (the answer is at the end): bounds pathological completions
MAX_ANSWER_CHARS = 512   # no honest final answer is longer
REL_TOL = 1e-6           # |pred - truth| <= REL_TOL * max(1, |truth|)
REWARD_MODES = ("numeric", "exact", "boxed")  # reward()'s modes (--reward)

_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|[{}]")
_HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
# GSM8K's marker is "#### N"; "#### Step 3: ..." or "#### Final Answer" is a markdown heading (a word first,
# where "#### x = 5" starts with a variable), not an answer.
_HEADING = re.compile(r"[^\W\d_]{2,}")

# A plain decimal: "1000", "1,000", "1,000.50", "3.", ".5". Thousands groups must be exactly 3 digits,
# so a list like "1,2,3" reads as three numbers rather than 123.
_DECIMAL = r"(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)"
# A sign only counts when it is not a binary minus ("5-3" is not the number -3); it may precede a currency
# sign ("-$5", "-\\$5" are -5), so the last-number fallback does not drop it.
_SIGNED = r"(?:(?<![\w)\]}])[-+](?:\\?\$)?)?" + _DECIMAL
_NUMBER = re.compile(_SIGNED + r"(?:\s*/\s*" + _SIGNED + r")?")  # optionally a fraction a/b

_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_DIGITS = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")  # LaTeX shorthand: \frac34 = 3/4
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# LaTeX spacing / decoration that carries no value: \, \! \; \: "\ " \left \right ^\circ and friends.
# (\$ is not noise but a dollar sign: turned into "$" and dropped with it, so "-\$5" keeps its sign.)
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\(?:left|right|displaystyle|quad|qquad)\b|\^\s*\{?\\circ\}?|\\%")
# Markdown emphasis around a span ("**18**", "*18* km"): the stars are not products. Not when glued to a
# word on the outside, so "2*x*y" stays an expression.
_MARKDOWN_EMPHASIS = re.compile(r"(?<![\w*])(\*{1,3})(?=\S)([^*]+?)(?<=\S)\1(?![\w*])")
_UNICODE_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-", "\uff0d": "-"})
# Left over after the number is removed, any of these means the answer is an expression, a comparison or a
# factorial, not a number.
# "-" and "/" between two letters are part of a word or unit ("half-hours", "km/h"), not arithmetic.
_LETTER = r"[^\W\d_]"
_OPERATOR_LEFTOVER = re.compile(r"[+*^×÷\\<>≤≥≠!]|(?<!" + _LETTER + r")[-/]|[-/](?!" + _LETTER + r")")


def last_boxed(text: str) -> str | None:
    """Content of the last-opened, properly closed, non-empty ``\\boxed{...}``; None if there is none.
    One linear pass with a stack of open braces; for nested boxes the innermost wins."""
    stack: list[int | None] = []  # per open brace: content start if it opened a \boxed, else None
    best_start, best = -1, None
    for m in _BOXED_OR_BRACE.finditer(text):
        tok = m.group()
        if tok == "}":
            if stack:
                start = stack.pop()
                if start is not None and start > best_start:
                    content = text[start : m.start()].strip()
                    if content:
                        best_start, best = start, content
        else:
            stack.append(m.end() if tok != "{" else None)
    return best


def extract_answer(text: str) -> str | None:
    """The model's final answer, not yet normalised: the last non-empty \\boxed{...}, else the last "#### N"
    (GSM8K's format), else the last number; None if the text holds none."""
    text = text[-MAX_TEXT_CHARS:]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = [h for m in _HASH_ANSWER.finditer(text) if (h := m.group(1).strip()) and not _HEADING.match(h)]
    if hashes:
        return hashes[-1]
    numbers = _NUMBER.findall(text.translate(_UNICODE_MINUS))  # "\u22125" is -5 here too, not 5
    return numbers[-1] if numbers else None


def normalize_number(s: str | None) -> float | None:
    """Parse a final answer into a float, or None if it is not exactly one finite number.
    Accepts: "1,000.50", "$5", "50%", "+3", "\u22124", "18 dollars", "x = 5", "3/4", "-\\frac{1}{2}",
    "10 \\text{ cups}", "\\$1{,}000", "-\\$5", "**18**", "60 km/h". Rejects: "nan", "inf", "1e999" (2 numbers),
    "5 or 6", "2^3", "5\\pi", "5-2", "2*x*y", "x > 5", "5!"."""
    if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS:
        return None
    s = s.translate(_UNICODE_MINUS)
    s = _MARKDOWN_EMPHASIS.sub(r"\2", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _FRAC_DIGITS.sub(r"\1/\2", s)
    s = _TEXT_WRAPPER.sub(r" \1 ", s)
    s = _LATEX_NOISE.sub(" ", s).replace("\\$", "$")
    s = s.replace("{,}", ",")  # LaTeX thousands separator 1{,}000
    s = s.rsplit("=", 1)[-1]  # "x = 5": the value is what follows the last "="
    # Braces and brackets are only grouping once \frac / \text are gone: "(3)/(4)" -> "3/4", "-(3)" -> "-3".
    s = re.sub(r"[{}()\[\]$%]", "", s).strip()
    matches = list(_NUMBER.finditer(s))
    if len(matches) != 1:
        return None
    m = matches[0]
    leftover = (s[: m.start()] + " " + s[m.end() :]).strip().rstrip(".")
    if _OPERATOR_LEFTOVER.search(leftover):
        return None
    num, _, den = m.group().replace(",", "").partition("/")  # each part holds a digit, so float() parses it
    if den and float(den) == 0:
        return None
    value = float(num) / float(den) if den else float(num)
    return value if math.isfinite(value) else None


def is_correct(completion_text: str, ground_truth: str) -> bool:
    """True iff the completion's final answer equals the ground truth within REL_TOL (relative to truth)."""
    pred = extract_answer(completion_text)
    return pred is not None and _same_number(pred, ground_truth)


def _plain(s: str) -> str:
    """A final answer for string comparison: \\text{} unwrapped, $ dropped, spaces collapsed, case folded."""
    s = _TEXT_WRAPPER.sub(r"\1", s).replace("$", "")
    return " ".join(s.split()).rstrip(".").casefold()


def _same_number(pred: str, truth: str) -> bool:
    p, t = normalize_number(pred), normalize_number(truth)
    return p is not None and t is not None and abs(p - t) <= REL_TOL * max(1.0, abs(t))


def _math_verify_equal(pred: str, truth: str) -> bool:
    """Symbolic equivalence (fractions, radicals, intervals, ...) by math-verify, when it is installed
    (`pip install minigrpo[math]`); False without it, or when it fails (its timeouts need the main thread)."""
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"${truth}$"), parse(f"${pred}$")))
    except Exception:  # not installed, or a parser error or timeout on a string the policy wrote: not a match
        return False


def reward(answer_text: str | None, ground_truth: str, mode: str = "numeric", delimited: bool = False) -> float:
    """1.0 if the answer matches the ground truth, else 0.0 (no format bonus).

    `answer_text`: the part of a completion holding the answer (None: the template's format is not met);
    `delimited`: it is the answer alone (an <answer> tag's content). Modes:
      numeric  `is_correct`: the last \\boxed{}, "#### N" or number, compared as a number (GSM8K)
      exact    the last \\boxed{} (delimited without one: all of it) equals the truth as `_plain` text
      boxed    that answer, equal as text, as a number, or symbolically by math-verify when installed"""
    if not isinstance(answer_text, str):
        return 0.0
    if mode == "numeric":
        return 1.0 if is_correct(answer_text, ground_truth) else 0.0
    pred = last_boxed(answer_text[-MAX_TEXT_CHARS:])
    if pred is None and delimited:
        pred = answer_text.strip()
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    same = _plain(pred) == _plain(ground_truth)
    if mode == "boxed" and not same:
        same = _same_number(pred, ground_truth) or _math_verify_equal(pred, ground_truth)
    return 1.0 if same else 0.0
