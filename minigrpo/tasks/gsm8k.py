"""GSM8K loading and prompt construction.

Data format is openai/grade-school-math jsonl: one JSON object per line with "question" and "answer",
where the answer is a worked solution whose final line is "#### <number>". Local jsonl needs no extra
dependency; downloading ``openai/gsm8k`` from the Hugging Face Hub (parquet) needs pyarrow, shipped as
the optional extra ``minigrpo[hub-data]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minigrpo.tasks.verifier import normalize_number

HUB_REPO = "openai/gsm8k"
HUB_FILES = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}
# The Qwen2.5-Math chain-of-thought instruction, verbatim: the phrasing the Qwen2.5 family saw in training.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Example:
    question: str
    answer_text: str  # the full reference solution, "#### N" line included
    ground_truth: str  # text after the final "#### ", commas removed, e.g. "1000"
    source: str = ""  # where it was read, "file:line", for messages about it


def parse_ground_truth(answer_text: str) -> str:
    """The reference final answer: the text after the last "#### ", commas removed.

    Raises ValueError if there is no "####" or nothing follows it.
    """
    head, sep, tail = answer_text.rpartition("####")
    if not sep:
        raise ValueError("answer has no '#### <number>' line")
    truth = tail.strip().replace(",", "")
    if not truth:
        raise ValueError("nothing follows the final '####'")
    return truth


def _make_example(question, answer, where: str) -> Example:
    """Validate one record; `where` ("file:line") prefixes every error so the bad line can be found."""
    for key, value in (("question", question), ("answer", answer)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    if not question.strip():
        raise ValueError(f"{where}: 'question' is empty")
    try:
        truth = parse_ground_truth(answer)
    except ValueError as e:
        raise ValueError(f"{where}: {e} (answer ends with {answer[-60:]!r})") from None
    if normalize_number(truth) is None:
        raise ValueError(f"{where}: the final answer {truth!r} is not a number, so no completion could be "
                         f"scored correct")
    return Example(question=question, answer_text=answer, ground_truth=truth, source=where)


def load_jsonl(path: str | Path) -> list[Example]:
    """Read an openai/grade-school-math jsonl file. Blank lines are skipped; anything else malformed raises."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K file not found: {path}. Pass the path of a local openai/grade-school-math jsonl "
            f"(e.g. train.jsonl / test.jsonl from github.com/openai/grade-school-math), or leave the data "
            f"flag out to download {HUB_REPO} from the Hugging Face Hub (needs pyarrow)."
        )
    examples = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its line number
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 f"re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            missing = [k for k in ("question", "answer") if k not in record]
            if missing:
                raise ValueError(
                    f"{where}: missing key(s) {missing}; each line must be an object with "
                    f"'question' and 'answer' (found keys {sorted(record)})"
                )
            examples.append(_make_example(record["question"], record["answer"], where))
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples


def _download_parquet(split: str) -> list[Example]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"Reading {HUB_REPO} from the Hub needs pyarrow: `pip install pyarrow` (or `pip install -e "
            f"'.[hub-data]'`), or pass a local openai/grade-school-math jsonl with --{split}-data FILE."
        ) from None
    from huggingface_hub import hf_hub_download

    try:
        local = hf_hub_download(HUB_REPO, HUB_FILES[split], repo_type="dataset")
    except Exception as e:  # offline, proxy, auth, missing file: all mean "use a local file instead"
        raise RuntimeError(
            f"Could not download {HUB_REPO}/{HUB_FILES[split]} from the Hugging Face Hub "
            f"({type(e).__name__}: {e}). If this machine is offline, pass a local openai/grade-school-math "
            f"jsonl with --{split}-data .../{split}.jsonl."
        ) from None
    table = pq.read_table(local)
    if not {"question", "answer"} <= set(table.column_names):
        raise ValueError(f"{local}: expected columns 'question' and 'answer', found {table.column_names}")
    rows = table.select(["question", "answer"]).to_pylist()
    return [_make_example(r["question"], r["answer"], f"{local}:row {i}") for i, r in enumerate(rows)]


def load_gsm8k(split: str, path: str | Path | None = None) -> list[Example]:
    """GSM8K examples for `split` ("train" or "test") from a local jsonl `path`, or from the Hub if None."""
    if split not in HUB_FILES:
        raise ValueError(f"split must be one of {sorted(HUB_FILES)}, got {split!r}")
    if path is not None:
        return load_jsonl(path)
    return _download_parquet(split)


def build_messages(question: str) -> list[dict]:
    """Chat messages for one problem: a single user turn, question + step-by-step / \\boxed{} instruction.

    Why \\boxed{}: Qwen2.5-Instruct was trained on math data whose final answers are written as
    \\boxed{...} (this instruction is the Qwen2.5-Math CoT prompt), so the base policy already ends with a
    parseable answer. The binary reward then measures correctness from step 0 instead of first having to
    teach a new answer format, which would dominate early learning and confound the accuracy curve.
    No system message: the chat template inserts Qwen's default one.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    return [{"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"}]
