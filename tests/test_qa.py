"""Question/answer data: GSM8K, MATH and any jsonl (local files, the Hub with a stubbed or refused download),
the final answers read from them, and the errors that name the bad file and line."""

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import QWEN_DIR, SHARED_DATA

from minigrpo.tasks.qa import Example, final_answer, load_examples, load_jsonl
from minigrpo.tasks.verifier import normalize_number

DATA = SHARED_DATA / "gsm8k"


@pytest.mark.parametrize("split, count", [("train", 7473), ("test", 1319)])
def test_load_real_splits(split, count):
    path = DATA / f"{split}.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {path}")
    examples = load_examples("gsm8k", split, path=path)
    assert len(examples) == count
    assert all(isinstance(e, Example) for e in examples)
    # every reference answer must be usable by the reward, or that prompt could never be rewarded
    assert all(normalize_number(e.ground_truth) is not None for e in examples)
    if split == "train":
        assert examples[0].ground_truth == "72"  # Natalia's clips: 48 + 24
        assert examples[0].question.startswith("Natalia sold clips")


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _rec(question="Q?", answer="2 + 2 = 4\n#### 4"):
    return json.dumps({"question": question, "answer": answer})


def test_ground_truth_parsing(tmp_path):
    path = _write(tmp_path, [_rec(answer="a\n#### 1,234"), "", _rec(answer="#### 1\nfix\n#### -5 "), _rec()])
    examples = load_jsonl(path)  # the blank line is skipped
    assert [e.ground_truth for e in examples] == ["1234", "-5", "4"]  # commas dropped, last #### wins
    assert examples[0].answer_text == "a\n#### 1,234"
    with pytest.raises(AttributeError):
        examples[0].question = "mutated"  # frozen


def test_final_answer_by_format():
    assert final_answer("2 + 2 = 4\n#### 1,004", "####") == "1004"
    assert final_answer("So $x = \\boxed{\\frac{1}{2}}$, not \\boxed{3}.", "boxed") == "3"  # the last box
    assert final_answer("\\boxed{\\{1, 2\\}}", "boxed") == "\\{1, 2\\}"  # nested braces
    assert final_answer("  (1, 2]  ", "") == "(1, 2]"
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        final_answer("just a solution", "####")
    with pytest.raises(ValueError, match="empty"):
        final_answer("#### ", "####")
    with pytest.raises(ValueError, match=r"no \\boxed"):
        final_answer("x = 3", "boxed")


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--test-data .*: not a file; pass a local jsonl"):
        load_examples("gsm8k", "test", tmp_path)  # a folder
    with pytest.raises(ValueError, match=r"--question-field and --answer-field are both 'answer'"):
        load_examples("gsm8k", "test", tmp_path, question_field="answer")
    with pytest.raises(FileNotFoundError, match=r"--train-data .*nope\.jsonl: file not found; pass a local jsonl, "
                                                r"or leave the flag out to download openai/gsm8k"):
        load_examples("gsm8k", "train", path=tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="--task jsonl reads local files only: pass --test-data FILE.jsonl"):
        load_examples("jsonl", "test")


def test_malformed_line_names_file_line_and_column(tmp_path):
    path = _write(tmp_path, [_rec(), '{"question": "Q", "answer": "#### 1"'])  # the closing brace is missing
    with pytest.raises(ValueError, match=r"data\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 37\)"):
        load_jsonl(path)


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (_rec() + "\n").encode())  # UTF-8 as some Windows editors save it
    assert len(load_jsonl(path)) == 1


def test_non_object_line(tmp_path):
    path = _write(tmp_path, ["[1, 2]"])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: expected a JSON object, got list"):
        load_jsonl(path)


def test_missing_key(tmp_path):
    path = _write(tmp_path, [_rec(), _rec(), json.dumps({"question": "Q", "solution": "#### 1"})])
    expected = (r"data\.jsonl:3: missing key\(s\) \['answer'\].*found keys \['question', 'solution'\]; "
                r"--question-field / --answer-field name others")
    with pytest.raises(ValueError, match=expected):
        load_jsonl(path)


def test_missing_hashes(tmp_path):
    path = _write(tmp_path, [_rec(answer="the answer is 4")])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: answer has no '#### <number>' line"):
        load_jsonl(path)


def test_non_string_field(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "Q", "answer": [4]})])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: 'answer' must be a string or a number, got list"):
        load_jsonl(path)
    path = _write(tmp_path, [json.dumps({"question": 7, "answer": "#### 4"})])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: 'question' must be a string, got int"):
        load_jsonl(path)


@pytest.mark.parametrize("question", ["", "  \n"])
def test_empty_question_is_refused_at_load(tmp_path, question):
    path = _write(tmp_path, [_rec(), _rec(question=question)])
    with pytest.raises(ValueError, match=r"data\.jsonl:2: 'question' is empty"):
        load_jsonl(path)


def test_json_number_answers_are_read_positionally(tmp_path):
    # json.loads gives 1e-05 and 1e+16 as floats; their str() has an exponent, which no answer is written with
    path = _write(tmp_path, [json.dumps({"question": "Q", "answer": a}) for a in (0.00001, 1e16, 72, 2.5)])
    examples = load_jsonl(path, final="")
    assert [e.ground_truth for e in examples] == ["0.00001", "10000000000000000", "72", "2.5"]
    assert [normalize_number(e.ground_truth) for e in examples] == [0.00001, 1e16, 72.0, 2.5]


def test_non_numeric_answer_is_refused_at_load(tmp_path):
    path = _write(tmp_path, [_rec(answer="so\n#### four")])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: the final answer 'four' is not a number.*--reward exact"):
        load_jsonl(path)


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes((_rec() + "\n").encode() + b'{"question": "caf\xe9?", "answer": "#### 1"}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        load_jsonl(path)


def test_examples_know_where_they_were_read(tmp_path):
    path = _write(tmp_path, [_rec(), "", _rec()])
    assert [e.source for e in load_jsonl(path)] == [f"{path}:1", f"{path}:3"]


def test_empty_file(tmp_path):
    with pytest.raises(ValueError, match="no examples"):
        load_jsonl(_write(tmp_path, []))


def test_hub_without_pyarrow_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"needs pyarrow: `pip install pyarrow`.*with --train-data FILE"):
        load_examples("gsm8k", "train")


def test_hub_offline_says_how_to_pass_a_local_file(monkeypatch):
    pytest.importorskip("pyarrow", reason="the hub path needs pyarrow (minigrpo[hub-data])")
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline and not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match=r"Could not download openai/gsm8k.*offline.*--test-data \.\.\./test\.jsonl"):
        load_examples("gsm8k", "test")


def test_hub_parquet_is_read(monkeypatch, tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the hub path needs pyarrow (minigrpo[hub-data])")
    import huggingface_hub
    import pyarrow.parquet as pq

    local = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.table({"question": ["Q1", "Q2"], "answer": ["x\n#### 3", "y\n#### 1,000"]}), local)
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs.get("repo_type")))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    examples = load_examples("gsm8k", "test")
    assert calls == [("openai/gsm8k", "main/test-00000-of-00001.parquet", "dataset")]
    assert [(e.question, e.ground_truth) for e in examples] == [("Q1", "3"), ("Q2", "1000")]


TINY = Path(__file__).parent / "data" / "tiny_qa.jsonl"  # five records, fields "q" and "a", mixed answers


def test_any_jsonl_trains_with_its_own_fields():
    if not QWEN_DIR.exists():
        pytest.skip(f"Qwen tokenizer files not found at {QWEN_DIR}")
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.tasks.task import load_task

    tok = Tokenizer.from_dir(QWEN_DIR)
    task = load_task("jsonl", "train", tok, path=TINY, template="r1", reward_mode="boxed", question_field="q",
                     answer_field="a")
    assert [e.ground_truth for e in task.examples] == ["\\frac{3}{4}", "2\\sqrt{2}", "(1, 2]", "Paris", "8"]
    assert task.describe(3)["source"] == f"{TINY}:4"
    assert tok.decode(task.prompt(3)).endswith("User: What is the capital of France?\nAssistant: <think>")

    def score(i, answer):
        return task.score(i, tok.encode(f" thinking </think> <answer> {answer} </answer>"))[0]
    assert [score(i, a) for i, a in enumerate(["\\frac{3}{4}", "2\\sqrt{2}", "(1, 2]", "paris", "\\boxed{8.0}"])] \
        == [1.0] * 5
    assert [score(i, a) for i, a in enumerate(["1", "\\sqrt{2}", "[1, 2]", "Lyon", "6"])] == [0.0] * 5
    msg = f"{TINY}:2: the final answer '2\\\\sqrt{{2}}' is not a number, so no completion could be scored correct (for"
    with pytest.raises(ValueError, match=re.escape(msg)):  # line 1, \\frac{3}{4}, is a number
        load_task("jsonl", "train", tok, path=TINY, question_field="q", answer_field="a")  # numeric by default
    with pytest.raises(ValueError, match=re.escape(f"{TINY}:1: missing key(s) ['question', 'answer']")):
        load_task("jsonl", "train", tok, path=TINY, reward_mode="exact")


def test_math_from_the_hub_reads_the_boxed_answer(monkeypatch, tmp_path):
    import huggingface_hub

    local = _write(tmp_path, [json.dumps({"problem": "Compute $1+1$.", "solution": "$1+1=\\boxed{2}$.",
                                          "answer": "2"})], name="test.jsonl")
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, file, **kw: calls.append((repo, file)) or str(local))
    (ex,) = load_examples("math", "test", numeric=False)
    assert calls == [("HuggingFaceH4/MATH-500", "test.jsonl")]  # MATH-500: jsonl, no pyarrow needed
    assert (ex.question, ex.ground_truth) == ("Compute $1+1$.", "2")

