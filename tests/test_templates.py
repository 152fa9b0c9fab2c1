"""Prompt templates on the real Qwen2.5 tokenizer (the published strings, id for id), where each reads its
answer, and stop strings: caught when they span several tokens or share a token with the text around them,
the same for both rollout backends, and the completion length logged is the cut one."""

import pytest
from conftest import QWEN_DIR

from minigrpo.engine.rollout import ReferenceBackend, make_backend
from minigrpo.model.generate import Rollout
from minigrpo.model.tokenizer import Tokenizer
from minigrpo.rl.config import TrainConfig
from minigrpo.rl.trainer import Trainer
from minigrpo.tasks.qa import Example
from minigrpo.tasks.synthetic import CharTokenizer, CopyTask, tiny_policy
from minigrpo.tasks.task import QATask
from minigrpo.tasks.templates import TEMPLATES, Stops

Q = "What is 2 + 2?"
# The published template texts, written out here independently of templates.py: a typo in either fails.
EXPECTED = {
    "chat": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 2 + 2?\nPlease reason step by step, and put your final answer within "
            "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n",
    # understand-r1-zero, train_zero_math.py, apply_r1_template
    "r1": "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
          "Assistant first thinks about the reasoning process in the mind and then provides the User with the "
          "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
          "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer "
          "here </answer>.\nUser: What is 2 + 2?\nAssistant: <think>",
    # understand-r1-zero, apply_qwen_math_template: the Qwen2.5-Math CoT system prompt
    "qwen-math": "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                 "<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "none": "What is 2 + 2?",
}


@pytest.fixture(scope="module")
def tok():
    if not QWEN_DIR.exists():
        pytest.skip(f"Qwen tokenizer files not found at {QWEN_DIR}")
    return Tokenizer.from_dir(QWEN_DIR)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_prompt_ids_are_the_published_template(tok, name):
    ids = TEMPLATES[name].prompt(tok, "  " + Q + "\n")  # the question is stripped
    assert ids == tok.encode(EXPECTED[name])
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED[name]


def test_each_template_stops_on_its_turn_end_and_strings(tok):
    im_end, eot = tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]
    base = Tokenizer(tok._bpe, eos_id=eot, pad_id=eot, stop_ids=[eot])  # a base model's: <|endoftext|> only
    for name in TEMPLATES:
        stops = TEMPLATES[name].stops(base)
        assert stops.ids == ((eot, im_end) if TEMPLATES[name].chat else (eot,)), name
        assert stops.strings == (("</answer>",) if name == "r1" else ())


def _cut(tok, text, strings=("</answer>",)):
    ids = tok.encode(text)
    rollout, stopped = Stops(tuple(tok.stop_ids), strings, tok.decode).cut(Rollout([ids], [list(range(len(ids)))]))
    return ids, rollout.tokens[0], rollout.logprobs[0], stopped[0]


@pytest.mark.parametrize("text, kept, last_token", [
    ("</think> <answer> 4 </answer> and then more text", "</think> <answer> 4 </answer>", ">"),  # ' </', 'answer', '>'
    ("so it is 4.</answer> and more", "so it is 4.</answer>", ">"),          # '.</' merges the text before it
    ("<answer>4</answer>\n\nUser: next", "<answer>4</answer>\n\n", ">\n\n"),  # '>\n\n' merges the text after it
    ("a </answer> b </answer> c", "a </answer>", ">"),                       # the first one
])
def test_a_stop_string_spanning_tokens_is_caught(tok, text, kept, last_token):
    ids, cut, logprobs, stopped = _cut(tok, text)
    assert tok.decode(cut) == kept and stopped
    assert tok.decode(cut[-1:]) == last_token and len(tok.encode("</answer>")) == 3  # the string is 3 tokens
    assert cut == ids[:len(cut)] and logprobs == list(range(len(cut)))  # log-probs cut alongside


def test_stop_tokens_and_no_stop(tok):
    im_end = tok.encode("<|im_end|>")
    ids, cut, _, stopped = _cut(tok, "x </answer> y")
    assert tok.decode(cut) == "x </answer>" and stopped
    ids, cut, _, stopped = _cut(tok, "no stop here")
    assert cut == ids and not stopped                                    # truncated: kept whole
    text = tok.encode("4") + im_end + tok.encode(" </answer> after")  # a backend ends at the first stop id
    rollout, stopped = Stops(tuple(tok.stop_ids), ("</answer>",), tok.decode).cut(Rollout([text], [[0.0] * len(text)]))
    assert rollout.tokens == [tok.encode("4") + im_end] and stopped == [True]
    rollout, stopped = Stops(tuple(tok.stop_ids)).cut(Rollout([tok.encode("x </answer>")], [[]]))
    assert not stopped[0]                                              # no strings: only the ids stop


def test_r1_reads_the_answer_tag_in_the_paper_format(tok):
    task = QATask([Example(Q, "4", "4")], tok, TEMPLATES["r1"], "numeric")
    assert task.stops.strings == ("</answer>",)

    def score(text):
        return task.score(0, tok.encode(text))
    assert score(" 2 + 2 = 4 </think> <answer> 4 </answer>") == (1.0, True)
    assert score(" 2 + 2 = 5? no </think> <answer> \\boxed{4} </answer>") == (1.0, True)
    assert score(" 4 </think> <answer> 5 </answer>") == (0.0, False)          # the answer is in the tag
    assert score(" so 4 </think>\n<answer> 4 </answer>") == (0.0, False)      # not the paper's strict format
    assert score(" so 4 </think> <answer> 4") == (0.0, False)                 # never closed
    chat = QATask([Example(Q, "4", "4")], tok, TEMPLATES["chat"], "numeric")
    assert chat.score(0, tok.encode("2 + 2 = \\boxed{4}<|im_end|>")) == (1.0, True)


def test_backends_give_the_same_cut_completions_and_log_their_length(tmp_path):
    """Two-character stop strings on the copy task's random policy: caught in both backends' output (the
    engine also stops on them in its decode loop), the completions identical, and the step's logged length
    and truncation those of the cut completions."""
    tokenizer, strings = CharTokenizer(), ("12", "21", "33")
    task = CopyTask(tokenizer, 16, seed=0, num_digits=3)
    sequences = tuple(tuple(tokenizer.encode(s)) for s in strings)  # one character, one token
    task.stops = Stops(tokenizer.stop_ids, strings, tokenizer.decode, sequences)
    cfg = TrainConfig(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=24, lr=1e-3, eval_every=0)
    runs, raws = {}, {}
    for attn in ("reference", "sdpa"):
        model = tiny_policy(tokenizer.vocab_size, seed=0)
        backend = ReferenceBackend(model, tokenizer.pad_id) if attn == "reference" else make_backend(
            attn, model, pad_id=tokenizer.pad_id, max_seq_len=32, max_batch=64)
        raw, generate = [], backend.generate
        backend.generate = lambda *a: raw.append(generate(*a)) or raw[-1]  # noqa: B023 (used in this iteration)
        trainer = Trainer(cfg, model, tokenizer, task, backend, tmp_path / attn, echo=False)
        m = trainer.step()
        runs[attn] = cut = trainer.last_rollout["completions"]
        texts = [tokenizer.decode(c) for c in cut]
        caught = [t for t in texts if any(s in t for s in strings)]
        assert len(caught) >= 3
        assert all(any(t.endswith(s) for s in strings) and not any(s in t[:-1] for s in strings) for t in caught)
        raws[attn] = sum(map(len, raw[0].tokens))
        assert sum(map(len, cut)) <= raws[attn]  # the tokens after a stop string were dropped
        assert m["completion_len_mean"] == sum(map(len, cut)) / len(cut)
        stopped = sum(c[-1:] == [tokenizer.eos_id] for c in cut) + len(caught)
        assert m["truncated_frac"] == 1 - stopped / len(cut)
    assert runs["sdpa"] == runs["reference"]
    assert raws["sdpa"] < raws["reference"]  # the engine stopped at the strings, the reference decoded on


def test_r1_stops_early_on_the_common_tokenisations(tok):
    stops = TEMPLATES["r1"].stops(tok)
    assert stops.backend_stops[:2] == stops.ids and len(stops.backend_stops) <= 16  # the engine's MAX_STOPS
    texts = {tok.decode(s) for s in stops.sequences}
    assert {" </answer>", "</answer>", ".</answer>", "</answer>\n", " </answer>\n\n"} <= texts
    assert all("</answer>" in tok.decode(s) and "</answer>" not in tok.decode(s[1:]) for s in stops.sequences)
    for text in ("x </answer> y", "4.</answer>\n\nUser:", "}</answer>"):  # the engine's exit = the host's cut
        ids = tok.encode(text)
        first = next(k for k in range(1, len(ids) + 1) if any(tuple(ids[max(0, k - len(s)):k]) == s
                                                               for s in stops.sequences))
        assert first == stops.end(ids)[0]
