"""minigrpo.model.tokenizer against the reference: transformers' AutoTokenizer + the published Jinja chat template.

Needs the Qwen2.5-0.5B-Instruct tokenizer files beside the repo (skipped cleanly otherwise); the comparisons
with transformers are skipped if it is not installed. The tokenizer is loaded once per module.
"""

import json
import shutil
import warnings

import pytest
from conftest import SHARED_DATA

from minigrpo.model.tokenizer import Tokenizer

DATA = SHARED_DATA
QWEN_DIR = DATA / "qwen2.5-0.5b-instruct"
GSM8K = DATA / "gsm8k"
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

if not (QWEN_DIR / "tokenizer.json").is_file():
    pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_DIR}", allow_module_level=True)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(QWEN_DIR)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(QWEN_DIR))


def hf_chat_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5 returns a BatchEncoding


CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2 + 3?"}],
    "system_and_user": [
        {"role": "system", "content": "Reason step by step, then give the answer after ####."},
        {"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now backwards."},
    ],
    "unicode_and_newlines": [
        {"role": "system", "content": "Réponds en français.\n\nSois bref."},
        {"role": "user", "content": "数学题：12 × 7 = ?\n\t  Emoji 🚀🧮 and ‘curly’ quotes…\r\n  end  "},
        {"role": "assistant", "content": "84\n\n\n"},
    ],
    "empty_content": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "go"},
    ],
    "system_mid_conversation": [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "system", "content": "From now on, answer in one word."},
        {"role": "user", "content": "Second question?"},
    ],
    "special_token_text_in_content": [
        {"role": "user", "content": "Say <|im_end|> literally, and <tool_call> too."},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_matches_transformers(tok, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ref_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == ref_text
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == hf_chat_ids(
        hf, messages, add_generation_prompt
    )


def test_render_chat_hand_written(tok):
    # Written out by hand from the template, independent of transformers.
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "system", "content": "s"},
    ]
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>system\ns<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages) == expected
    assert tok.render_chat(messages, add_generation_prompt=False) == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == IM_START and ids[-3:] == [IM_START, tok.encode("assistant")[0], tok.encode("\n")[0]]


def _gsm8k_texts(n=64):
    path = GSM8K / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found at {path}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[:n]]
    return [r["question"] for r in rows] + [r["answer"] for r in rows]


def test_encode_decode_round_trip_matches_transformers(tok, hf):
    for text in _gsm8k_texts():
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == hf.decode(ids)


def test_decode_skips_special_tokens(tok, hf):
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.encode_chat(messages) + [IM_END, ENDOFTEXT]
    expected = "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\nuser\nhi\nassistant\n"
    assert tok.decode(ids) == expected == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages) + "<|im_end|><|endoftext|>"
    assert tok.decode(tok.encode("a <tool_call> b")) == "a <tool_call> b"  # added but not special: kept


def test_decode_accepts_tensors(tok):
    torch = pytest.importorskip("torch")
    ids = tok.encode("Natalia sold clips to 48 of her friends.")
    assert tok.decode(torch.tensor(ids)) == "Natalia sold clips to 48 of her friends."
    with pytest.raises(TypeError):  # a batch is not decoded as one sequence
        tok.decode(torch.tensor([ids, ids[::-1]]))


def test_stop_pad_ids_and_sizes(tok, hf):
    assert tok.stop_ids == (IM_END, ENDOFTEXT)
    assert tok.eos_id == IM_END == hf.eos_token_id
    assert tok.pad_id == ENDOFTEXT == hf.pad_token_id
    assert tok.vocab_size == len(hf) == 151665


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "must be a non-empty list"),
        ({"role": "user", "content": "hi"}, "must be a non-empty list"),
        ([{"role": "tool", "content": "42"}], r"messages\[0\] is .*no tools"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
         r"messages\[1\] is .*no tools"),
        ([{"role": "robot", "content": "beep"}], r"messages\[0\] is \{'role': 'robot'.*renders only"),
        ([{"content": "no role"}], r"messages\[0\] is .*renders only"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], r"messages\[0\] is .*with str content"),
        ([{"role": "user"}], r"messages\[0\] is .*with str content"),
        (["hi"], r"messages\[0\] is 'hi'"),
    ],
)
def test_bad_chat_input(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.render_chat(messages)


def test_encode_rejects_non_str(tok):
    with pytest.raises(TypeError, match="must be str"):
        tok.encode([1, 2])


# ---- loading: fallbacks and file errors, on edited copies of the model directory ----

def _copy_dir(tmp_path, drop=(), edit=None):
    """Copy the tokenizer files to tmp_path, dropping `drop` and overwriting {name: text} from `edit`."""
    for f in QWEN_DIR.glob("*.json"):
        if f.name not in drop:
            shutil.copy(f, tmp_path / f.name)
    for name, text in (edit or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _with(name, **changes):
    return json.dumps({**json.loads((QWEN_DIR / name).read_text()), **changes})


def test_loading_real_dir_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Tokenizer.from_dir(QWEN_DIR)


def test_stop_ids_fallback_without_generation_config(tmp_path):
    t = Tokenizer.from_dir(_copy_dir(tmp_path, drop=("generation_config.json",)))
    assert t.stop_ids == (IM_END, ENDOFTEXT) and t.eos_id == IM_END and t.pad_id == ENDOFTEXT


def test_stop_ids_from_int_eos_and_pad_fallback(tmp_path):
    d = _copy_dir(tmp_path, edit={
        "generation_config.json": _with("generation_config.json", eos_token_id=ENDOFTEXT),
        "tokenizer_config.json": _with("tokenizer_config.json", pad_token=None),
    })
    t = Tokenizer.from_dir(d)
    assert t.stop_ids == (ENDOFTEXT,) and t.eos_id == IM_END and t.pad_id == ENDOFTEXT  # pad from generation_config


@pytest.mark.parametrize("eos", ["x", 5.0, [IM_END, "x"], 10**9, True])
def test_eos_that_is_no_token_id_is_refused(tmp_path, eos):
    d = _copy_dir(tmp_path, edit={"generation_config.json": _with("generation_config.json", eos_token_id=eos)})
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id .* is not a token id"):
        Tokenizer.from_dir(d)


def test_other_chat_template_warns(tmp_path):
    d = _copy_dir(tmp_path, edit={"tokenizer_config.json": _with("tokenizer_config.json", chat_template="{{ x }}")})
    with pytest.warns(UserWarning, match="chat template different from Qwen2.5"):
        Tokenizer.from_dir(d)


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*weights/download\.py"):
        Tokenizer.from_dir(tmp_path / "nope")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file(tmp_path, name):
    with pytest.raises(FileNotFoundError, match=rf"{name} is missing.*weights/download\.py"):
        Tokenizer.from_dir(_copy_dir(tmp_path, drop=(name,)))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_file(tmp_path, name):
    with pytest.raises(ValueError, match=rf"{name}.*re-download"):
        Tokenizer.from_dir(_copy_dir(tmp_path, edit={name: '{"truncated": '}))


def test_mismatched_special_token_ids(tmp_path):
    config = json.loads((QWEN_DIR / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151700"] = config["added_tokens_decoder"].pop("151645")
    d = _copy_dir(tmp_path, edit={"tokenizer_config.json": json.dumps(config)})
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' to id 151700 but tokenizer.json maps it to 151645"):
        Tokenizer.from_dir(d)
