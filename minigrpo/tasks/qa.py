"""Question/answer data (`--task`): a jsonl of question/answer records, or GSM8K and MATH from the Hub.

A source names a record's two fields and where its final answer is in the answer field:
    gsm8k  "question", "answer": a worked solution ending "#### <number>"
    math   "problem", "solution": the final answer in its last \\boxed{} (test: MATH-500, the Dr. GRPO paper's)
    jsonl  your file: --question-field / --answer-field; the answer field is the final answer itself
Every record is checked at load time; a bad one is reported with its file and line. Hub parquet files
need pyarrow (`minigrpo[hub-data]`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from minigrpo.tasks.verifier import last_boxed, normalize_number


@dataclass(frozen=True)
class Example:
    question: str
    answer_text: str  # the answer field as written (for GSM8K the full solution, "#### N" line included)
    ground_truth: str  # the final answer read from it, e.g. "1000" (GSM8K: commas removed)
    source: str = ""  # where it was read, "file:line", for messages about it


@dataclass(frozen=True)
class Source:
    question: str    # the default field names
    answer: str
    final: str       # where the final answer is: "####" (after the last), "boxed" (the last), "" (all of it)
    reward: str      # the default reward mode
    hub: dict = field(default_factory=dict)  # split -> (dataset repo, file) on the Hub


SOURCES = {
    "gsm8k": Source("question", "answer", "####", "numeric", {
        "train": ("openai/gsm8k", "main/train-00000-of-00001.parquet"),
        "test": ("openai/gsm8k", "main/test-00000-of-00001.parquet")}),
    "math": Source("problem", "solution", "boxed", "boxed", {
        "train": ("DigitalLearningGmbH/MATH-lighteval", "data/train-00000-of-00001.parquet"),
        "test": ("HuggingFaceH4/MATH-500", "test.jsonl")}),
    "jsonl": Source("question", "answer", "", "numeric"),
}


def final_answer(answer: str, final: str) -> str:
    """The reference final answer in an answer field (`Source.final` says where). Raises ValueError if none."""
    if final == "####":
        _, sep, tail = answer.rpartition("####")
        if not sep:
            raise ValueError("answer has no '#### <number>' line")
        truth = tail.strip().replace(",", "")
    elif final == "boxed":
        truth = last_boxed(answer)
        if truth is None:
            raise ValueError("the solution has no \\boxed{...} final answer")
    else:
        truth = answer.strip()
    if not truth:
        raise ValueError("the final answer is empty")
    return truth


def _make_example(record: dict, fields: tuple[str, str], final: str, numeric: bool, where: str) -> Example:
    """Validate one record; `where` ("file:line") prefixes every error so the bad line can be found."""
    q, a = fields
    missing = [k for k in fields if k not in record]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; each line must be an object with {q!r} and {a!r} "
                         f"(found keys {sorted(record)}; --question-field / --answer-field name others)")
    question, answer = record[q], record[a]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):  # positional: 1e-05 -> 0.00001
        answer = str(answer) if isinstance(answer, int) else format(Decimal(repr(answer)), "f")
    if not isinstance(question, str) or not isinstance(answer, str):
        key, value = (q, question) if not isinstance(question, str) else (a, answer)
        raise ValueError(f"{where}: {key!r} must be a string{' or a number' if key == a else ''}, "
                         f"got {type(value).__name__}")
    if not question.strip():
        raise ValueError(f"{where}: {q!r} is empty")
    try:
        truth = final_answer(answer, final)
    except ValueError as e:
        raise ValueError(f"{where}: {e} (answer ends with {answer[-60:]!r})") from None
    if numeric and normalize_number(truth) is None:
        raise ValueError(f"{where}: the final answer {truth!r} is not a number, so no completion could be "
                         f"scored correct (for other answers: --reward exact or boxed)")
    return Example(question=question, answer_text=answer, ground_truth=truth, source=where)


def load_jsonl(path: str | Path, fields: tuple[str, str] = ("question", "answer"), final: str = "####",
               numeric: bool = True) -> list[Example]:
    """Read a jsonl file of `fields` (question, answer) records, skipping blank lines."""
    path = Path(path)
    examples = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its line number
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig")  # -sig: a byte-order mark some editors write is no text
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 f"re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # the error's column is then in this line
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            examples.append(_make_example(record, fields, final, numeric, where))
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples


def load_examples(task: str, split: str, path: str | Path | None = None, *, question_field: str | None = None,
                  answer_field: str | None = None, numeric: bool = True) -> list[Example]:
    """The examples of `task` (a SOURCES key) for `split` ("train" or "test"): from the local jsonl `path`,
    else from the Hub. numeric: every final answer must be a number (the numeric reward could match nothing else)."""
    src = SOURCES[task]
    fields = (question_field or src.question, answer_field or src.answer)
    if fields[0] == fields[1]:
        raise ValueError(f"--question-field and --answer-field are both {fields[0]!r}: the model would be shown "
                         f"the answer; name two different fields")
    hub = src.hub.get(split)
    if path is not None:
        if not Path(path).is_file():
            what = "not a file" if Path(path).exists() else "file not found"  # a folder, /dev/null
            raise FileNotFoundError(f"--{split}-data {path}: {what}; pass a local jsonl" + (
                f", or leave the flag out to download {hub[0]} from the Hugging Face Hub" if hub else ""))
        return load_jsonl(path, fields, src.final, numeric)
    if hub is None:
        raise ValueError(f"--task {task} reads local files only: pass --{split}-data FILE.jsonl")
    return _download(*hub, split, fields, src.final, numeric)


def _download(repo: str, file: str, split: str, fields, final: str, numeric: bool) -> list[Example]:
    parquet = file.endswith(".parquet")
    if parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"Reading {repo} from the Hub needs pyarrow: `pip install pyarrow` (or `pip install "
                              f"-e '.[hub-data]'`), or pass a local jsonl with --{split}-data FILE.") from None
    from huggingface_hub import hf_hub_download

    try:
        local = hf_hub_download(repo, file, repo_type="dataset")
    except Exception as e:  # offline, proxy, auth, missing file: all mean "use a local file instead"
        reason = (str(e).strip().splitlines() or [""])[0]
        raise RuntimeError(f"Could not download {repo}/{file} from the Hugging Face Hub ({type(e).__name__}: "
                           f"{reason}). If this machine is offline, pass a local jsonl with --{split}-data "
                           f".../{split}.jsonl.") from None
    if not parquet:
        return load_jsonl(local, fields, final, numeric)
    table = pq.read_table(local)
    if not set(fields) <= set(table.column_names):
        raise ValueError(f"{local}: expected columns {list(fields)}, found {table.column_names}")
    rows = table.select(list(fields)).to_pylist()
    return [_make_example(r, fields, final, numeric, f"{local}:row {i}") for i, r in enumerate(rows)]
