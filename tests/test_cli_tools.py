"""weights/download.py and evaluate.py given bad input, as a user runs them: a one-line error (exit code 2, no
traceback) before any work, and no file of the user's lost or half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GSM8K, tiny_config

from minigrpo.model.checkpoint import load_model
from minigrpo.run.run_dir import locked_out

REPO = Path(__file__).resolve().parents[1]
GSM8K_TEST = GSM8K / "test.jsonl"


def run(args, cwd=REPO, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], check=False, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def refused(proc, message):
    """Exit code 2, no traceback, and `message` on the one line of stderr."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    return lines[0]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config().to_hf_dict()))
    return path


# --- weights/download.py ------------------------------------------------------------------------------------

def test_download_refuses_the_random_init_flags_without_random_init(config):
    refused(run(["weights/download.py", "--config", str(config), "--seed", "3"]),
            "--config, --seed: for --random-init only")


def test_random_init_keeps_a_non_empty_out_unless_told_to_overwrite(tmp_path, config):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(out)]),
            f"--out {out} already exists and is not empty; pass --overwrite to replace it")
    # --overwrite deletes the folder, so only ever a model directory: not one with anything else in it
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(out), "--overwrite"]),
            f"--out {out} holds more than a model directory (notes.txt); --overwrite would delete it all")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"

    (out / "notes.txt").unlink()
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(out), "--overwrite",
                 "--tokenizer-dir", str(tmp_path)]), f"--tokenizer-dir {tmp_path} holds no tokenizer.json")
    proc = run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "without a tokenizer" in proc.stdout  # no tokenizer beside the config: said, not left to train.py
    first = load_model(out, torch.float32).model.layers[0].mlp.up_proj.weight.clone()
    refused(run([str(REPO / "weights/download.py"), "--random-init", "--config", str(config), "--out", ".",
                 "--overwrite"], cwd=out), "--out . is the folder you are working in; --overwrite would delete it")
    proc = run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(out), "--overwrite",
                "--seed", "1"])  # a model directory is replaced
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = load_model(out, torch.float32)
    assert model.config.num_hidden_layers == 2 and not torch.equal(model.model.layers[0].mlp.up_proj.weight, first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model"]  # no temporary directory left

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory holds nothing to lose: written without --overwrite
    proc = run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(empty)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (empty / "model.safetensors").is_file()


def test_random_init_refuses_a_tokenizer_larger_than_the_config_and_a_symlinked_out(tmp_path, config):
    from conftest import QWEN_DIR
    if not QWEN_DIR.exists():
        pytest.skip(f"no tokenizer at {QWEN_DIR}")
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--tokenizer-dir", str(QWEN_DIR),
                 "--out", str(tmp_path / "m")]), "has 151665 token ids but the config's vocab_size is 256")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(tmp_path / "link"),
                 "--overwrite"]), f"--out {tmp_path / 'link'} is a symbolic link; give the directory it points to")
    assert not (tmp_path / "m").exists() and (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("case, message", [
    ("missing config", "--config {tmp}/nope.json: no such file or directory; pass a config.json"),
    ("malformed config", "--config: {tmp}/bad.json is not valid JSON"),
    ("invalid config", "--config: {tmp}/bad.json: missing required field(s)"),
    ("out under a file", "--out {tmp}/afile/sub: {tmp}/afile is a file, not a directory; choose another --out"),
    ("seed too large", "--seed must be in [0, 2^63), got 9223372036854775808"),
])
def test_download_bad_config_or_out_is_one_line(tmp_path, config, case, message):
    (tmp_path / "afile").write_text("")
    (tmp_path / "bad.json").write_text("{" if case == "malformed config" else '{"model_type": "qwen2"}')
    cfg = {"missing config": tmp_path / "nope.json", "malformed config": tmp_path / "bad.json",
           "invalid config": tmp_path / "bad.json"}.get(case, config)
    out = tmp_path / ("afile/sub" if case == "out under a file" else "m")
    seed = ["--seed", str(2**63)] if case == "seed too large" else []
    refused(run(["weights/download.py", "--random-init", "--config", str(cfg), "--out", str(out), *seed]),
            message.format(tmp=tmp_path))
    assert not (tmp_path / "m").exists() and (tmp_path / "afile").read_text() == ""


# --- evaluate.py --------------------------------------------------------------------------------------------
# A model directory that does not exist: each flag must be refused before anything is loaded or evaluated.

@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--max-new-tokens=-3"], "--max-new-tokens must be >= 1, got -3"),
    (["--seed=-1", "--eval-temperature", "1"], "--seed must be >= 0, got -1"),
])
def test_evaluate_refuses_an_empty_batch_or_budget(tmp_path, flags, message):
    refused(run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"), "--device", "cpu", *flags]), message)


@pytest.mark.parametrize("out, message", [
    ("nodir/e.jsonl", "--out nodir/e.jsonl: nodir is not an existing directory; create it first"),
    ("nodir/metrics.jsonl", "--out nodir/metrics.jsonl: nodir is not an existing directory; create it first"),
    (".", "--out . is a directory; give a file path"),
    ("old.jsonl", "--out old.jsonl already exists; pass --overwrite to replace it, or choose another --out"),
])
def test_evaluate_checks_out_before_evaluating(tmp_path, out, message):
    (tmp_path / "old.jsonl").write_text("earlier results\n")
    refused(run([str(REPO / "evaluate.py"), "--model-dir", str(tmp_path / "no-model"), "--device", "cpu",
                 "--out", out], cwd=tmp_path), message)
    assert (tmp_path / "old.jsonl").read_text() == "earlier results\n" and not (tmp_path / "nodir").exists()


def test_evaluate_out_is_replaced_only_with_overwrite_and_whole(tmp_path, tiny_qwen_dir):
    out = tmp_path / "eval.jsonl"
    out.write_text("earlier results\n")
    common = ["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--test-data", str(GSM8K_TEST), "--eval-limit", "2",
              "--eval-max-new-tokens", "2", "--device", "cpu", "--out", str(out)]  # train.py's names for these
    refused(run(common), f"--out {out} already exists; pass --overwrite")
    assert out.read_text() == "earlier results\n"
    proc = run([*common, "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(ln)["index"] for ln in out.read_text().splitlines()] == [0, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["eval.jsonl"]  # no temporary file left beside it


def test_evaluate_never_writes_over_its_test_data(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    refused(run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"), "--device", "cpu", "--test-data", str(data),
                 "--out", str(data), "--overwrite"]), f"--out {data} is the --test-data file")
    assert data.read_text() == '{"question": "1+1?", "answer": "#### 2"}\n'


def test_evaluate_never_writes_into_the_model_it_evaluates(tmp_path, tiny_qwen_dir):
    weights = tiny_qwen_dir / "model.safetensors"
    before = weights.read_bytes()
    refused(run(["evaluate.py", "--model-dir", str(tiny_qwen_dir), "--device", "cpu", "--out", str(weights),
                 "--overwrite"]), f"--out {weights} lies in the --model-dir it evaluates")
    assert weights.read_bytes() == before


def test_neither_tool_writes_over_a_runs_own_files(tmp_path, config):
    # A run's logs and checkpoints are train.py's alone: evaluate.py --out metrics.jsonl would cut its history,
    # and download.py --out into a checkpoint would swap its trained weights for random ones, even with --overwrite.
    run_dir, log = tmp_path / "run", "{\"step\": 1}\n"
    ckpt = run_dir / "checkpoints" / "step_000002" / "model"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(config.read_text())
    (run_dir / "metrics.jsonl").write_text(log)
    refused(run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"), "--device", "cpu", "--out",
                 str(run_dir / "metrics.jsonl"), "--overwrite"]),
            f"--out {run_dir / 'metrics.jsonl'} is one of the files of the run in {run_dir}, which only train.py")
    refused(run(["weights/download.py", "--random-init", "--config", str(config), "--out", str(ckpt), "--overwrite"]),
            f"--out {ckpt} lies among the files of the run in {run_dir}")
    assert (run_dir / "metrics.jsonl").read_text() == log and sorted(os.listdir(ckpt)) == ["config.json"]
    early, other = tmp_path / "early", tmp_path / "evals"  # a run before its first checkpoint; a plain folder
    for folder in (early, other):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(log)
    with locked_out(early):  # the run is writing there now
        refused(run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"), "--device", "cpu", "--out",
                     str(early / "metrics.jsonl"), "--overwrite"]), f"is one of the files of the run in {early}")
    assert "no-model is not a model directory" in run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"),
                                                       "--out", str(other / "metrics.jsonl"), "--overwrite"]).stderr


def test_evaluate_refuses_weights_with_nan_and_names_sampled_accuracy(tmp_path, tiny_qwen_dir):
    common = ["evaluate.py", "--test-data", str(GSM8K_TEST), "--limit", "1", "--max-new-tokens", "2", "--device", "cpu"]
    proc = run([*common, "--model-dir", str(tiny_qwen_dir), "--eval-temperature", "1"])
    assert proc.returncode == 0 and proc.stdout.startswith("sampled (temperature 1) accuracy"), proc.stdout
    model = load_model(tiny_qwen_dir, torch.float32)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    from minigrpo.model.checkpoint import save_model
    nan_dir = save_model(model, tmp_path / "nan", tokenizer_dir=tiny_qwen_dir)
    refused(run([*common, "--model-dir", str(nan_dir)]), f"the weights in {nan_dir} hold NaN or inf")


INTERRUPTED_EVAL = """
import sys, evaluate
def interrupted(*args, **kwargs):  # Ctrl-C in the middle of the evaluation
    raise KeyboardInterrupt
evaluate.evaluate = interrupted
evaluate.main(sys.argv[1:])
"""


def test_ctrl_c_during_the_evaluation_is_one_line_and_writes_nothing(tmp_path, tiny_qwen_dir):
    out = tmp_path / "eval.jsonl"
    proc = run(["-c", INTERRUPTED_EVAL, "--model-dir", str(tiny_qwen_dir), "--test-data", str(GSM8K_TEST),
                "--limit", "2", "--max-new-tokens", "2", "--device", "cpu", "--out", str(out)])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted: nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_random_weights_are_written_leaves_nothing(tmp_path, config, monkeypatch):
    import minigrpo.model.checkpoint as checkpoint
    from weights import download

    def interrupted(state, path, **kwargs):  # Ctrl-C with half the weights on the disk
        path.write_bytes(b"half a file")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "save_file", interrupted)
    with pytest.raises(SystemExit, match="interrupted: nothing was written"):
        download.main(["--random-init", "--config", str(config), "--out", str(tmp_path / "model")])
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary folder, no --out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_evaluate_on_cuda_without_cuda_says_to_use_the_cpu(tmp_path):
    refused(run(["evaluate.py", "--model-dir", str(tmp_path / "no-model"), "--device", "cuda"]),
            "--device cuda: CUDA is not available here; use --device cpu")


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path):
    """Qwen2.5's tokenizer (151,665 ids) beside a model of 1,000 embedding rows: both commands refuse it at load, not
    with an IndexError from the first forward."""
    from conftest import QWEN_DIR, random_model

    from minigrpo.model.checkpoint import save_model
    if not QWEN_DIR.exists():
        pytest.skip(f"no tokenizer at {QWEN_DIR}")
    model_dir = save_model(random_model(tiny_config(vocab=1000)), tmp_path / "m", tokenizer_dir=QWEN_DIR)
    message = "the tokenizer has 151665 token ids but the model's embedding only 1000"
    refused(run(["evaluate.py", "--model-dir", str(model_dir), "--test-data", str(GSM8K_TEST), "--device", "cpu",
                 "--limit", "1"]), message)
    proc = run(["train.py", "--model-dir", str(model_dir), "--train-data", str(GSM8K_TEST), "--eval-every", "0",
                "--device", "cpu", "--out", str(tmp_path / "run")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and message in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()  # the folder it made for the run, left empty, is gone


def test_a_checkpoint_or_run_folder_as_model_dir_points_at_its_model(tmp_path):
    from weights.download import resolve_model_dir

    (tmp_path / "checkpoints" / "step_000050" / "model").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000050" / "model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"step_000050 is a checkpoint, not a model directory: pass "
                                                r"--model-dir .*step_000050/model$"):
        resolve_model_dir(tmp_path / "checkpoints" / "step_000050")
    (tmp_path / "checkpoints" / "latest").write_text("step_000050\n")
    for run_dir in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(FileNotFoundError, match=r"is a run folder, not a model directory: pass --model-dir "
                                                    r".*/checkpoints/step_<N>/model$"):
            resolve_model_dir(run_dir)
    with pytest.raises(FileNotFoundError, match=r"model holds no tokenizer.json: .*--preset smoke or learn has none"):
        resolve_model_dir(tmp_path / "checkpoints" / "step_000050" / "model")  # a smoke run's: no tokenizer files
