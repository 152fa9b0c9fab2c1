"""Reward verifier: hand-written cases for both answer formats, and a fuzz test that it never raises or hangs."""

import random
import sys
import time

import pytest

from minigrpo.tasks.verifier import extract_answer, is_correct, normalize_number, reward


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is \\boxed{72}.", "72"),
        ("first \\boxed{3}, no wait, \\boxed{4}", "4"),  # multiple boxed -> last
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # nested braces
        ("\\boxed{\\boxed{5}}", "5"),  # nested boxes -> innermost
        ("answer in \\boxed{} is 7", "7"),  # empty box (echoed instruction) is skipped
        ("\\boxed{9", "9"),  # unclosed box is not an answer; fall back to the last number
        ("Step 1 ... 3 + 4 = 7\n#### 1,234\n", "1,234"),  # GSM8K format
        ("#### 5\nthen \\boxed{6}", "6"),  # boxed beats ####
        ("#### Step 3: add them\nThe total is 18.", "18."),  # a markdown heading is no #### answer
        ("#### Final Answer\nThe total is 18.", "18."),
        ("48 / 2 = 24 clips, so 72 in total.", "72"),  # last number
        ("The answer is -3.", "-3."),
        ("The answer is \u22123.", "-3."),  # unicode minus kept on the last-number path
        ("Total: -$5", "-$5"),  # so is a sign before "$"
        ("no digits at all", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s, expected",
    [
        ("72", 72.0),
        ("1,000", 1000.0),
        ("1,000.50", 1000.5),
        ("$18", 18.0),
        ("\\$18", 18.0),
        ("50%", 50.0),
        ("50\\%", 50.0),
        ("72.00", 72.0),
        ("72.", 72.0),
        ("+3", 3.0),
        ("-4", -4.0),
        ("\u22124", -4.0),  # unicode minus
        ("0.25", 0.25),
        (".5", 0.5),
        ("18 dollars", 18.0),
        ("10 \\text{ cups}", 10.0),
        ("x = 5", 5.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{3}{4}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("\\frac34", 0.75),
        ("1{,}000", 1000.0),
        ("90^\\circ", 90.0),
        ("-\\$5", -5.0),
        ("**18**", 18.0),
        ("60 km/h", 60.0),
        ("3 half-hours", 3.0),
        ("", None),
        ("abc", None),
        ("nan", None),
        ("inf", None),
        ("1e999", None),  # two numbers to us, never float('inf')
        ("9" * 400, None),  # overflows to inf -> rejected
        ("5 or 6", None),
        ("2^3", None),
        ("5\\pi", None),
        ("3 - 2", None),
        ("1/0", None),
        (None, None),
    ],
)
def test_normalize_number(s, expected):
    assert normalize_number(s) == expected


@pytest.mark.parametrize(
    "text, truth",
    [
        ("... so she earned \\boxed{10} dollars.", "10"),
        ("\\boxed{\\$1,000.00}", "1000"),
        ("The final answer is \\boxed{1000 \\text{ dollars}}", "1000"),
        ("#### 1,234", "1234"),
        ("The answer is 7.", "7"),
        ("\\boxed{-5}", "-5"),
        ("\\boxed{0.5}", "0.5"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{25\\%}", "25"),
        ("\\boxed{18.0}", "18"),
    ],
)
def test_correct(text, truth):
    assert is_correct(text, truth)
    assert reward(text, truth) == 1.0


@pytest.mark.parametrize(
    "text, truth",
    [
        ("\\boxed{11}", "10"),
        ("\\boxed{10} wait no \\boxed{12}", "10"),  # last boxed counts
        ("\\boxed{5} and later 10", "10"),  # boxed beats the last number
        ("\\boxed{10.001}", "10"),  # outside the 1e-6 relative tolerance
        ("\\boxed{5 or 10}", "10"),  # hedging is wrong
        ("\\boxed{-10}", "10"),
        ("I don't know", "10"),
        ("", "10"),
        ("\\boxed{10}", "not a number"),  # unusable truth never matches
    ],
)
def test_wrong(text, truth):
    assert not is_correct(text, truth)
    assert reward(text, truth) == 0.0


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("The answer is \u22125.", "5", 0.0),  # unicode minus on the last-number path
        ("The answer is \u22125.", "-5", 1.0),
        ("Total: -$5", "5", 0.0),  # a sign before "$" is not dropped
        ("He lost -$5", "-5", 1.0),
        ("She ends with \u2212$20", "-20", 1.0),
        ("\\boxed{-\\$5}", "-5", 1.0),
        ("\\boxed{-\\$5}", "5", 0.0),
    ],
)
def test_sign_is_kept_before_currency_and_unicode_minus(text, truth, expected):
    assert reward(text, truth) == expected


@pytest.mark.parametrize(
    "text, truth",
    [
        ("#### **18**", "18"),  # markdown bold
        ("The answer is **18** dollars.", "18"),
        ("#### 60 km/h", "60"),  # "/" and "-" inside a unit or word are not arithmetic
        ("\\boxed{60 \\text{ km/h}}", "60"),
        ("#### 3 half-hours", "3"),
    ],
)
def test_markdown_and_units_around_the_number(text, truth):
    assert is_correct(text, truth)
    assert reward(text, truth) == 1.0


@pytest.mark.parametrize(
    "text, truth",
    [
        ("#### 3/4 + 1", "1.75"),  # an unevaluated expression is not its value ...
        ("#### 3/4 + 1", "0.75"),  # ... nor its first number
        ("#### 5-2", "3"),
        ("#### 5-2", "5"),
        ("#### 2*x*y", "2"),  # a product, not markdown emphasis
        ("#### x-5", "5"),
        ("#### 5/x", "5"),
        ("\\boxed{x \u2265 5}", "5"),  # a comparison ...
        ("\\boxed{x > 5}", "5"),
        ("\\boxed{5!}", "5"),  # ... and a factorial are not the number in them
    ],
)
def test_expressions_are_still_not_numbers(text, truth):
    assert reward(text, truth) == 0.0


def test_tolerance_is_relative_to_truth():
    assert is_correct("\\boxed{1000000.5}", "1000000")  # |diff| 0.5 <= 1e-6 * 1e6 = 1.0
    assert not is_correct("\\boxed{1000002}", "1000000")  # 2 > 1.0
    assert is_correct("\\boxed{0.0000001}", "0")  # 1e-7 <= 1e-6 * max(1, 0)


def test_non_string_completion_is_a_type_error():
    with pytest.raises(TypeError):
        extract_answer(None)


def _adversarial(rng: random.Random) -> str:
    pieces = [
        "\\boxed{", "}", "{", "####", "#### ", "\\frac{", "\\dfrac", "\\text{", "$", "\\$", "%", "\\%", ",", ".",
        "-", "+", "/", "=", "\u2212", "nan", "inf", "1e999", "-0", "0", "9" * rng.randint(1, 5000), " ",
        "\n", "\\", "^\\circ", "(", ")", "1,000", ",000", "..", "e", "\x00", "\ud7ff", "\u0663", "\U0001d7d3",
    ]
    kind = rng.randrange(6)
    if kind == 0:  # random unicode soup
        return "".join(chr(rng.randint(0, 0x2FFFF)) for _ in range(rng.randint(0, 200)))
    if kind == 1:  # random ASCII
        return "".join(chr(rng.randint(0, 127)) for _ in range(rng.randint(0, 300)))
    if kind == 2:  # deep / unbalanced nesting
        n = rng.randint(1, 1000)
        return "\\boxed{" * n + rng.choice(["5", "", "\\frac{1}{2}", "}" * rng.randint(0, n)])
    if kind == 3:  # long runs that would expose super-linear regex backtracking (the huge ones are in `fixed`)
        unit = rng.choice(["1,", "1 ", " ", "-", "1.", "#", "{", "\\boxed ", "12,345", "/1"])
        return unit * rng.randint(1, 1500) + rng.choice(["", "x", "5", "}"])
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))


def test_fuzz_never_raises_and_is_fast():
    rng = random.Random(1234)
    fixed = ["9" * 5000, "\\boxed{" * 1000, "}" * 1000, "nan", "inf", "1e999", "-" * 10000, "#" * 20000,
             "\\boxed{" + "9" * 5000 + "}", "1," * 20000, "1 " * 20000, " " * 50000 + "1", "\\frac{" * 500 + "1",
             "#### " + " " * 20000 + "x", "\\boxed{" + " " * 20000, "1" + " " * 20000 + "/"]
    cases = fixed + [_adversarial(rng) for _ in range(10_000 - len(fixed))]
    start = time.perf_counter()
    for text in cases:
        truth = rng.choice(["72", "1000", "-5", "0.5", text[:50]])
        r = reward(text, truth)
        assert r in (0.0, 1.0)
        ans = extract_answer(text)
        assert ans is None or isinstance(ans, str)
        value = normalize_number(text)
        assert value is None or isinstance(value, float)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"fuzz took {elapsed:.1f}s: some input is slow (backtracking?)"


@pytest.mark.parametrize("answer, truth, mode, delimited, expected", [
    ("so \\boxed{42}", "42.0", "numeric", False, 1.0),          # numeric: the GSM8K check
    ("so \\boxed{Paris}", "paris", "exact", False, 1.0),         # exact: case, $ and \text{} do not count
    ("so \\boxed{\\text{Paris}}.", "$Paris$", "exact", False, 1.0),
    ("so \\boxed{Lyon}", "Paris", "exact", False, 0.0),
    ("Paris", "Paris", "exact", False, 0.0),                     # not delimited: the answer must be boxed
    (" Paris ", "Paris", "exact", True, 1.0),                    # an <answer> tag's content is the answer
    ("\\boxed{0.5}", "\\frac{1}{2}", "exact", False, 0.0),       # exact is text, not value
    ("\\boxed{0.5}", "\\frac{1}{2}", "boxed", False, 1.0),       # boxed: equal as numbers
    ("\\boxed{\\frac{1}{2}} and \\boxed{\\dfrac{3}{4}}", "0.75", "boxed", False, 1.0),  # the last box
    ("\\boxed{x^{2}}", "x^{2}", "boxed", False, 1.0),           # nested braces, equal as text
    ("no box here: 0.75", "0.75", "boxed", False, 0.0),
    (None, "4", "numeric", False, 0.0),                          # the template's format was not met
])
def test_reward_modes(answer, truth, mode, delimited, expected):
    assert reward(answer, truth, mode, delimited) == expected


@pytest.mark.parametrize("answer, truth, expected", [
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),                   # radicals
    ("\\boxed{(1,2]}", "(1, 2]", 1.0),                           # intervals
    ("\\boxed{[1, 2]}", "(1, 2]", 0.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x + 1}", "1 + x", 1.0),                            # expressions
])
def test_boxed_mode_is_symbolic_with_math_verify(answer, truth, expected, monkeypatch):
    pytest.importorskip("math_verify", reason="the optional extra minigrpo[math]")
    assert reward(answer, truth, "boxed") == expected
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: the numeric check alone
    assert reward(answer, truth, "boxed") == (expected if "frac" in truth else 0.0)
