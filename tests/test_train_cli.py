"""train.py and `python evaluate.py` as a user runs them: subprocesses, exit codes, files, messages
(and train.main in this process where a test pretends the GPU's free memory)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import GSM8K

REPO = Path(__file__).resolve().parents[1]

TINY = REPO / "tests" / "data" / "tiny_qa.jsonl"


def run(args, cwd=REPO, timeout=300, **env):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}  # tiny models: 1 thread is fastest
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["reference", "sdpa"])  # sdpa: the engine, its own weights synced every step
def test_smoke_preset_trains_and_writes_metrics(tmp_path, attn):
    proc = run(["train.py", "--preset", "smoke", "--attn", attn, "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(151))  # step 0: evaluation before training
    assert records[0]["eval_accuracy"] < 0.2 and records[-1]["eval_accuracy"] >= 0.8
    rewards = [r["reward_mean"] for r in records[1:]]
    assert sum(rewards[:5]) / 5 < 0.2 and sum(rewards[-10:]) / 10 >= 0.8
    assert (tmp_path / "checkpoints" / "step_000150" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "samples.jsonl").read_text().count("\n") > 0


def test_help_documents_every_flag_and_each_default_once():
    proc = run(["train.py", "--help"])
    assert proc.returncode == 0
    sys.path.insert(0, str(REPO))
    from train import build_parser

    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
        assert action.option_strings[-1] in proc.stdout
        text = formatter._expand_help(action)
        assert text.count("default") <= 1, f"{action.option_strings}: {text}"
    assert "(default: None)" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--preset", "smoke", "--minibatch-size", "7"], "--minibatch-size 7 must divide the B*G = 128 rows"),
    (["--preset", "smoke", "--model-dir", "x"], "--preset smoke trains its own tiny random model"),
    (["--preset", "smoke", "--template", "r1"], "--preset smoke trains its own tiny random model on its own task; "
                                                "drop --template"),
    (["--eval-samples", "4"], "--eval-samples=4 needs --eval-temperature > 0"),
    (["--model-dir", "/nonexistent/model"], "/nonexistent/model is not a model directory"),
    (["--device", "xpu"], "--device xpu: minigrpo runs on cpu or cuda; use --device cpu, cuda or cuda:N"),
    (["--device", "banana"], "--device banana: not a torch device; use cpu, cuda or cuda:N"),
    (["--preset", "smoke", "--out", ""], "--out is empty; name the run's folder"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--beta", "nan"], "--beta must be a finite number, got nan"),
    (["--lr=-1e-3"], "--lr must be in (0, 1), got -0.001"),
    (["--seed", "-1"], "--seed must be in [0, 2^63), got -1"),
    (["--min-lr-ratio=-0.1"], "--min-lr-ratio must be in [0, 1], got -0.1"),
    (["--no-tis", "--tis-cap", "5"], "--tis-cap 5.0 caps the TIS weights that --no-tis turns off; drop one of them"),
    (["--test-data", "test.jsonl", "--eval-every", "0"], "--test-data test.jsonl is read only for evaluation, which "
     "--eval-every 0 turns off; drop one of them"),
    (["--min-lr-ratio", "0.5"], "--min-lr-ratio 0.5 is the cosine schedule's floor, and --lr-schedule is 'constant': "
     "add --lr-schedule cosine, or drop --min-lr-ratio"),
    (["--weight-decay", "1e6"], "--weight-decay 1000000.0 at --lr 1e-06 multiplies every weight by 1 - --lr x "
     "--weight-decay = 0 per step, erasing the model; use --weight-decay < 1e+06"),
    (["--betas", "1", "0.9"], "--betas must be two numbers in [0, 1), got (1.0, 0.9)"),
    (["--eval-limit", "0"], "--eval-limit must be >= 1 (or unset), got 0"),
    (["--recompute-layers", "3"], "--recompute-layers 3 needs --activation-checkpointing, and must be >= 0"),
    (["--preset", "smoke", "--activation-checkpointing", "--recompute-layers", "9", "--out", "{tmp}/out"],
     "--recompute-layers 9 is more than the model's 2 decoder layers; use at most 2"),
    (["--activation-checkpointing", "--recompute-layers", "half"], "argument --recompute-layers: expected a number "
                                                                  "of layers or auto, got 'half'"),
    (["--recompute-layers", "auto"], "--recompute-layers auto needs --activation-checkpointing"),
    (["--beta", "0", "--offload-reference"], "--offload-reference needs a KL reference (--beta > 0) and --parallel "
                                              "'ddp'"),
    (["--preset", "smoke", "--attn", "sdpa", "--sampler", "triton", "--out", "{tmp}/out"],
     "--sampler triton runs Triton kernels, which need a CUDA GPU; on the CPU use --sampler torch"),
    (["--preset", "smoke", "--attn", "sdpa", "--cuda-graphs", "--out", "{tmp}/out"],
     "--cuda-graphs captures CUDA graphs, which need a CUDA GPU; drop it on the CPU"),
    (["--preset", "smoke", "--sampler", "torch", "--cuda-graphs"], "--cuda-graphs, --sampler: settings of the fast "
     "engine, which --attn reference does not use"),
    (["--preset", "smoke", "--train-data", "train.jsonl"], "--preset smoke trains its own tiny random model on its own "
     "task; drop --train-data"),
    (["--preset", "smoke", "--out", "README.md/run"], "README.md, which is a file, not a folder; choose another --out"),
    (["--weights", "bf16", "--weight-decay", "0.01"], "--weight-decay 0.01 at --lr 1e-06 shrinks bf16 parameters by "
     "1.0e-08 per step, below the 1e-06 that their fp32 update and 16-bit stochastic rounding carry (it would be "
     "lost, wholly or in part): use --weights fp32, or --weight-decay 0 or >= 1"),
    (["--weights", "bf16", "--lr", "1e-5", "--weight-decay", "0.1", "--lr-schedule", "cosine", "--min-lr-ratio",
      "0.1"], "--weight-decay 0.1 at --lr 1e-05 x --min-lr-ratio 0.1 shrinks bf16 parameters by 1.0e-07 per step"),
    (["--preset", "smoke", "--out", "x" * 300], f"--out {'x' * 300}: File name too long; choose another --out"),
    (["--preset", "smoke", "--out", "README.md"], "--out README.md is a file, not a folder; choose another --out"),
    (["--preset", "smoke", "--attn", "triton", "--out", "{tmp}/out"],
     "--attn triton runs Triton kernels, which need a CUDA GPU; on the CPU use --attn sdpa (or set TRITON_INTERPRET=1 "
     "to run them, slowly, in Triton's interpreter)"),
])
def test_bad_input_gives_a_message_not_a_traceback(args, message, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]  # a run folder may be created before the error
    proc = run(["train.py", *args], TRITON_INTERPRET="0")  # the tests' Triton interpreter is off, as for a user
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.splitlines()[-1]


def test_tensorboard_without_the_package_says_how_to_install_it(capsys, monkeypatch):
    from minigrpo.rl.train_flags import parse_args

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(SystemExit) as stop:
        parse_args(["--preset", "smoke", "--tensorboard"])
    assert stop.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err


def test_offline_without_a_model_explains_what_to_do(tmp_path):
    # No --model-dir: the default directory (relative to the working directory) is missing and must be downloaded.
    proc = run([str(REPO / "train.py"), "--device", "cpu"], cwd=tmp_path, HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "cannot reach the Hugging Face Hub" in proc.stderr


def test_gsm8k_path_runs_one_step_and_resumes(tmp_path, tiny_qwen_dir):
    common = ["train.py", "--model-dir", str(tiny_qwen_dir), "--train-data", str(GSM8K / "train.jsonl"),
              "--test-data", str(GSM8K / "test.jsonl"), "--device", "cpu", "-B", "2", "-G", "2",
              "--max-new-tokens", "3", "--eval-limit", "2", "--eval-every", "1", "--out", str(tmp_path)]
    proc = run([*common, "--steps", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = tmp_path / "checkpoints" / "step_000001" / "model"
    assert (model_dir / "tokenizer.json").is_file()  # the checkpoint is a complete HF directory
    proc = run([*common, "--steps", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def _small_train_file(tmp_path, lines=3):
    path = tmp_path / "train.jsonl"
    path.write_text("".join((GSM8K / "train.jsonl").read_text().splitlines(keepends=True)[:lines]))
    return path


def test_resume_refuses_another_template_not_a_typed_default(tmp_path, tiny_qwen_dir):
    common = ["train.py", "--model-dir", str(tiny_qwen_dir), "--train-data", str(_small_train_file(tmp_path)),
              "--eval-every", "0", "--device", "cpu", "-B", "2", "-G", "2", "--max-new-tokens", "3",
              "--out", str(tmp_path / "run")]
    assert run([*common, "--steps", "1"]).returncode == 0
    proc = run([*common, "--steps", "2", "--template", "r1", "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "task: checkpoint 'gsm8k chat' vs now 'gsm8k r1'" in proc.stderr.splitlines()[-1]
    typed = run([*common, "--steps", "2", "--reward", "numeric", "--resume"])  # gsm8k's own reward, named
    assert typed.returncode == 0, typed.stderr[-2000:]


def test_a_data_error_is_one_line_at_load_with_file_and_line(tmp_path, tiny_qwen_dir):
    path = _small_train_file(tmp_path)
    path.write_text(path.read_text() + '{"question": "", "answer": "#### 1"}\n')
    proc = run(["train.py", "--model-dir", str(tiny_qwen_dir), "--train-data", str(path), "--eval-every", "0",
                "--device", "cpu", "--out", str(tmp_path / "run")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: {path}:4: 'question' is empty"


@pytest.mark.parametrize("flags, message", [
    (["--max-prompt-tokens", "20", "--max-new-tokens", "3"], "3 of 3 prompts are longer than --max-prompt-tokens 20"),
    (["--max-new-tokens", "500"], "3 of 3 prompts are longer than the 12 tokens that the model's 512 positions "
                                  "leave after 500 new tokens"),
])
def test_prompts_over_the_budget_are_refused_at_start(tmp_path, tiny_qwen_dir, flags, message):
    path = _small_train_file(tmp_path)
    proc = run(["train.py", "--model-dir", str(tiny_qwen_dir), "--train-data", str(path), "--eval-every", "0",
                "--device", "cpu", "--out", str(tmp_path / "run"), *flags])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"error: {message}") and f"{path}:" in last


def test_evaluation_without_test_data_says_what_to_pass(tmp_path, tiny_qwen_dir):
    proc = run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--device", "cpu"],
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--test-data" in proc.stderr


def test_standalone_evaluation(tmp_path, tiny_qwen_dir):
    out = tmp_path / "eval.jsonl"
    proc = run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--test-data",
                str(GSM8K / "test.jsonl"), "--limit", "3", "--max-new-tokens", "4", "--device", "cpu",
                "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "greedy accuracy 0.0000 on 3 gsm8k test examples (chat template" in proc.stdout  # random: never right
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == 3 and {"question", "ground_truth", "completions", "correct"} <= set(rows[0])


def test_sampled_evaluation_of_any_jsonl(tmp_path, tiny_qwen_dir):
    out = tmp_path / "eval.jsonl"
    proc = run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--task", "jsonl", "--test-data",
                str(TINY), "--question-field", "q", "--answer-field", "a", "--reward", "boxed", "--template", "r1",
                "--eval-samples", "4", "--eval-temperature", "1", "--max-new-tokens", "4", "--device", "cpu",
                "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mean@4 0.0000, pass@1 0.0000, pass@2 0.0000, pass@4 0.0000 on 5 jsonl test examples (r1 template" \
        in proc.stdout and "examples/s" in proc.stdout
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5)) and all(len(r["completions"]) == 4 for r in rows)
    proc = run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--eval-samples", "4"])
    assert proc.returncode == 2 and "pass --eval-temperature > 0" in proc.stderr.splitlines()[-1]


def test_r1_template_on_a_jsonl_trains_and_evaluates_by_sampling(tmp_path, tiny_qwen_dir):
    proc = run(["train.py", "--model-dir", str(tiny_qwen_dir), "--task", "jsonl", "--train-data", str(TINY),
                "--test-data", str(TINY), "--question-field", "q", "--answer-field", "a", "--reward", "boxed",
                "--template", "r1", "--device", "cpu", "-B", "2", "-G", "2", "--max-new-tokens", "3",
                "--eval-every", "1", "--eval-samples", "2", "--eval-temperature", "1", "--steps", "1",
                "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all("eval_pass@2" in r for r in records)
    rows = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in rows] == [(s, i) for s in (0, 1) for i in range(5)]


def test_a_jsonl_task_needs_its_files(tmp_path, tiny_qwen_dir):
    proc = run(["train.py", "--task", "jsonl", "--model-dir", str(tiny_qwen_dir), "--eval-every", "0", "--device",
                "cpu", "--out", str(tmp_path / "run")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: --task jsonl reads local files only: pass --train-data FILE.jsonl"


def test_math_offline_is_one_line_naming_the_flag(tmp_path, tiny_qwen_dir):
    proc = run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--task", "math", "--device", "cpu"],
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: Could not download HuggingFaceH4/MATH-500/test.jsonl from the Hugging "
                                  "Face Hub")
    assert proc.stderr.strip().endswith("--test-data .../test.jsonl.")


def test_recompute_layers_auto_keeps_the_activations_that_fit(tiny_qwen_dir, tmp_path, monkeypatch, capsys):
    """--recompute-layers auto, free memory pretended between the estimates of 1 and 0 recomputed layers (of 2):
    the memory check settles on 1 and says so."""
    sys.path.insert(0, str(REPO))
    import train
    from minigrpo.model.config import ModelConfig
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.rl.distributed import Dist
    from minigrpo.tasks.task import load_task

    path = _small_train_file(tmp_path)
    args = train.parse_args(["--model-dir", str(tiny_qwen_dir), "--train-data", str(path), "--device", "cpu",
                             "--attn", "sdpa", "-B", "2", "-G", "2", "--max-new-tokens", "3",
                             "--activation-checkpointing", "--recompute-layers", "auto"])
    model_cfg, task = ModelConfig.from_json(tiny_qwen_dir), load_task("gsm8k", "train", Tokenizer.from_dir(
        tiny_qwen_dir), path=path)
    peak = train.memory_estimator(args, model_cfg, task, None)
    need = [peak(replace(args.cfg, recompute_layers=r)).total * (1 + train.MEMORY_MARGIN) for r in (0, 1)]
    assert need[0] > need[1]
    monkeypatch.setattr(train, "free_memory", lambda device: int(need[1]) + 1)
    args.cfg = train.fit_memory(args, model_cfg, task, None, Dist())
    assert args.cfg.recompute_layers == 1
    assert capsys.readouterr().err.strip().endswith("--recompute-layers auto: 1 of 2 layers recompute")


def test_a_run_that_would_not_fit_stops_at_start_naming_a_setting_that_does(tmp_path, tiny_qwen_dir, monkeypatch,
                                                                            capsys):
    """train.main in this process, its free memory pretended (train.free_memory; None on a CPU, no check):
    between the lean setting's estimate and the default's, the default stops before loading the model, with
    one line naming flags; with those flags the same run starts and trains."""
    sys.path.insert(0, str(REPO))
    import train
    from minigrpo.model.config import ModelConfig
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.tasks.task import load_task

    path = _small_train_file(tmp_path)
    argv = ["--model-dir", str(tiny_qwen_dir), "--train-data", str(path), "--eval-every", "0", "--device", "cpu",
            "--attn", "sdpa", "-B", "2", "-G", "2", "--max-new-tokens", "3", "--steps", "1", "--save-every", "0"]
    args = train.parse_args(argv)
    task = load_task("gsm8k", "train", Tokenizer.from_dir(tiny_qwen_dir), path=path)
    peak = train.memory_estimator(args, ModelConfig.from_json(tiny_qwen_dir), task, None)
    lean = replace(args.cfg, weights="bf16", activation_checkpointing=True, logprob_chunk_size=256)
    free = int(peak(lean).total * (1 + train.MEMORY_MARGIN)) + 1
    assert peak(args.cfg).total * (1 + train.MEMORY_MARGIN) > free
    monkeypatch.setattr(train, "free_memory", lambda device: free)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the memory check stopped the run")
    with monkeypatch.context() as patch:
        patch.setattr("minigrpo.model.checkpoint.load_model", no_load)
        assert train.main([*argv, "--out", str(tmp_path / "a")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: this run needs about ") and "cpu has" in last and " it fits with --" in last
    flags = last.split(" it fits with ")[1].split(" (about ")[0].split()
    assert train.main([*argv, *flags, "--parallel", "fsdp", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "memory: about " in err and "note: --parallel fsdp in one process shards nothing" in err
    assert (tmp_path / "b" / "metrics.jsonl").read_text().count("\n") == 1


def test_resume_command_drops_abbreviated_flags_and_names_torchrun(monkeypatch):
    # argparse takes "--over" for --overwrite: kept, the printed command would pass --overwrite and --resume.
    sys.path.insert(0, str(REPO))
    import train

    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert train.resume_command(["--over", "--out", "x", "--res", "old"]) == "python train.py --out x --resume"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.resume_command(["--out", "x"]) == "torchrun --nproc-per-node 2 train.py --out x --resume"
