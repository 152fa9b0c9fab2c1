"""FSDP2 data parallel (`--parallel fsdp`; torchrun, 2 CPU ranks, gloo) equals the single-process run, and resumes
exactly, from its own checkpoints and in a single process.

Run A is train.py under torchrun (the smoke task, fp32, the engine on the CPU: its weights are gathered from the
shards after every update). Seed 6, B=4, G=8: step 1 trains groups on both ranks, step 2 on rank 0 only, step 3
on rank 1 only. FSDP gathers each layer's weights in every forward, so a rank without rows must run as many
forwards and backwards as the other, on zero-weight stand-ins. Minibatches of 8 rows (four per epoch, so the
old log-probs come from a separate scoring pass), micro-batches of 3: the ranks' own counts differ. Each
rank evaluates every other one of 37 examples, before step 1 and after step 3.
Run B (tests/fsdp_worker.py) covers what the smoke model does not: a tied embedding and LM head, bf16 weights
(StochasticAdamW on the shards), a sharded KL reference, activation checkpointing.
"""

import json
import shutil

import pytest
import torch
from fsdp_worker import trainer
from test_distributed import assert_close, checkpoint_params, torchrun

import train
from minigrpo.rl.loop import _evaluate
from minigrpo.rl.trainer import Trainer

ARGS = ["--preset", "smoke", "--attn", "sdpa", "--parallel", "fsdp", "-B", "4", "-G", "8", "--minibatch-size", "8",
        "--micro-batch-size", "3", "-K", "2", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "0",
        "--eval-every", "3", "--eval-limit", "37", "--sample-every", "0", "--seed", "6"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def single_process_trainer(out) -> Trainer:
    args = train.parse_args([*ARGS, "--out", str(out)])
    model, tokenizer, task, test, _ = train.build_smoke(args)
    backend = train.build_backend(args, model, tokenizer, task, test)
    return Trainer(args.cfg, model, tokenizer, task, backend, out, eval_task=test, echo=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A on 2 ranks, and the single-process reference's metrics and parameters after each step, and its
    evaluations before step 1 and after step 3."""
    tmp = tmp_path_factory.mktemp("fsdp")
    torchrun(tmp / "fsdp", args=ARGS)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference, ref, rewards = single_process_trainer(tmp / "single"), [], []
        evals = [_evaluate(reference, None)]
        for _ in range(3):
            ref.append(reference.step())
            rewards.append(torch.tensor(reference.last_rollout["rewards"]).view(2, -1, 8))  # (rank, group, G)
            ref[-1]["params"] = {k: v.clone() for k, v in reference.model.state_dict().items()}
        ref[-1].update(_evaluate(reference, None))
    finally:
        torch.set_num_threads(n)
    return tmp, ref, rewards, evals[0]


def test_two_ranks_equal_one_process(runs):
    tmp, ref, rewards, eval0 = runs
    spread = [(r.amax(-1) > r.amin(-1)).any(-1).tolist() for r in rewards]  # (step) -> [rank has a group to train]
    assert spread == [[True, True], [True, False], [False, True]], "the scenario no longer has a rank without rows"
    records = [json.loads(ln) for ln in (tmp / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("eval_n", "eval_reward_mean", "eval_completion_len_mean", "eval_truncated_frac"):
        assert records[0][key] == pytest.approx(eval0[key]) and records[3][key] == pytest.approx(ref[2][key]), key
    for step, (rec, want) in enumerate(zip(records[1:], ref), start=1):
        assert_close(checkpoint_params(tmp / "fsdp", step), want["params"])  # the same HF names, gathered
        for key in ("reward_mean", "accuracy", "trained_rows", "completion_len_mean", "optimizer_steps"):
            assert rec[key] == want[key], key
        for key in ("loss", "clip_frac", "grad_norm", "entropy"):
            assert rec[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_resume_is_exact_and_a_checkpoint_resumes_in_one_process(runs):
    tmp, ref, _, _ = runs
    resumed = tmp / "resumed"  # interrupted after step 2
    shutil.copytree(tmp / "fsdp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    (resumed / "checkpoints" / "latest").write_text("step_000002\n")
    assert "resumed from step 2" in torchrun(resumed, "--resume", args=ARGS)
    want, got = checkpoint_params(tmp / "fsdp", 3), checkpoint_params(resumed, 3)
    assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run left the uninterrupted one"
    assert [json.loads(ln)["step"] for ln in (resumed / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]

    one = single_process_trainer(tmp / "single_resumed")  # the checkpoint holds the full state, not shards
    one.resume(tmp / "fsdp" / "checkpoints" / "step_000002")
    one.step()
    assert_close(ref[2]["params"], one.model.state_dict())


def test_tied_bf16_weights_and_a_sharded_reference_equal_one_process(tmp_path):
    """bf16 weights round stochastically (the noise is the same: fsdp_worker checks it bit for bit), so a gradient
    summed in another order (FSDP sums micro-batches and ranks in fp32 and rounds once, a single process rounds
    twice) flips a few roundings. The yardstick is the single process itself with its micro-batches split
    otherwise (2 and 6 rows, not 3), which changes only such roundings: after step 1, FSDP must stay within 2x of
    the farther split. A bug moves the weights 30x as far or more: the KL term lost (a broken sharded reference),
    half the learning rate, one rank's micro-batch lost. Only step 1 is compared: step 2's rollout is drawn from
    weights that differ in a few roundings, so it may sample a token otherwise, and the weights then take a path
    of their own (seen: 4x the roundings' distance, on one CPU and not another); so do the splits' own.
    Adam hides a wrong gradient scale from the weights; the logged pre-clip gradient norm shows it."""
    torchrun(tmp_path / "two", script="tests/fsdp_worker.py")
    two = torch.load(tmp_path / "two" / "params.pt", weights_only=True)
    got = two["weights"]  # after each step
    for weights in got:
        assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]), "tied weights came apart"
    (want, records), *resplits = (_single(tmp_path / f"mb{m}", micro_batch_size=m) for m in (3, 2, 6))
    assert got[0].keys() == want.keys()
    assert two["records"][0]["reward_mean"] == records[0]["reward_mean"]  # the same rollout: the same initial weights
    assert two["records"][0]["grad_norm"] == pytest.approx(records[0]["grad_norm"], rel=2 * 2**-8)  # two roundings
    worst = 2 * max(_mean_difference(resplit, want) for resplit, _ in resplits)
    diff = _mean_difference(got[0], want)
    assert diff <= worst, f"step 1: mean |2-rank - 1-rank| {diff:.3g} > {worst:.3g}"


def _single(out, **overrides):
    """A single process's weights after step 1, and its step metrics."""
    one = trainer(out, **overrides)
    records = [one.step()]
    return one.model.state_dict(), records


def _mean_difference(a: dict, b: dict) -> float:
    return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in b]).mean().item()


def test_fsdp_with_the_reference_generator_is_refused(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--preset", "smoke", "--parallel", "fsdp", "--attn", "reference"])
    assert "--parallel fsdp shards the policy" in capsys.readouterr().err
