"""The Dr. GRPO loop end to end on tiny models: offsets, dropped groups, the exact gradient, learning, resume."""

import copy
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import QWEN_DIR, random_model, tiny_config

from minigrpo.engine.rollout import ReferenceBackend, make_backend
from minigrpo.model.generate import Rollout, generate
from minigrpo.model.sampling import SamplingParams
from minigrpo.rl.config import WEIGHT_DTYPES, TrainConfig, lr_factor
from minigrpo.rl.data import SHUFFLE, EpochSampler
from minigrpo.rl.evaluate import evaluate
from minigrpo.rl.sequences import SequenceBatch, completion_logprobs, pad_rows
from minigrpo.rl.trainer import Trainer
from minigrpo.run.checkpoints import STATE_FILE
from minigrpo.run.metrics import MetricsLogger, PhaseTimer, compile_seconds
from minigrpo.tasks.synthetic import CharTokenizer, CopyTask, FirstDigitTask, tiny_policy
from minigrpo.tasks.templates import Stops

STOP, PAD = 31, 0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: threading costs more than it saves, and a busy 2-core CI machine makes it 5x worse.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class FakeTokenizer:
    stop_ids, pad_id, eos_id = (STOP,), PAD, STOP

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class FakeTask:
    """Prompts given as token lists; reward 1 iff the completion starts with token 10, plus half the prompt's
    index: a reward scored against another group's prompt changes the advantages."""
    stops = Stops((STOP,))

    def __init__(self, prompts):
        self.prompts = prompts

    def __len__(self):
        return len(self.prompts)

    def prompt(self, i):
        return self.prompts[i]

    def score(self, i, completion):
        right = completion[:1] == [10]
        return float(right) + i / 2, right

    def describe(self, i):
        return {"question": str(self.prompts[i])}


class ScriptedBackend:
    """Returns fixed completions per prompt (keyed by the prompt's first token), each token's sampling log-prob
    rollout_logp(row, position) (default -1); counts weight syncs."""

    def __init__(self, script, rollout_logp=None):
        self.script, self.syncs = script, 0
        self.rollout_logp = rollout_logp or (lambda r, t: -1.0)

    def generate(self, prompts, samples_per_prompt, max_new_tokens, params, stop_ids, seeds):
        assert len(seeds) == len(prompts) * samples_per_prompt
        tokens = [list(self.script[p[0]][j]) for p in prompts for j in range(samples_per_prompt)]
        return Rollout(tokens, [[self.rollout_logp(r, t) for t in range(len(row))] for r, row in enumerate(tokens)])

    def load_weights(self, model):
        self.syncs += 1


def _count_forward_rows(model):
    """Wrap model.hidden_states to record the number of rows packed in every call."""
    rows, inner = [], model.hidden_states

    def counted(ids, *args, **kwargs):
        rows.append(len(kwargs["packed"].starts))
        return inner(ids, *args, **kwargs)

    model.hidden_states = counted
    return rows


def _capture_gradients(trainer) -> dict[str, torch.Tensor]:
    """The gradients the trainer's optimizer steps on, by parameter name (the last step's), filled as it runs."""
    grads, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return grads


# ------------------------------------------------------------------------------------------ sequence layout


@pytest.mark.parametrize(
    "row, expected",
    [
        ([5, STOP, 7, 7], [1, 1, 0, 0]),  # stop mid-row: kept, everything after dropped
        ([STOP, 5, 5, 5], [1, 0, 0, 0]),  # stop at position 0
        ([5, 5, 5, STOP], [1, 1, 1, 1]),  # stop at the last position
        ([5, 5, 5, 5], [1, 1, 1, 1]),  # no stop (truncated): all ones
        ([5, STOP, STOP, 7], [1, 1, 0, 0]),  # two stops: the first one wins
        ([5, 8, STOP, 7], [1, 1, 0, 0]),  # another stop id comes first
    ],
)
def test_loss_mask_ends_at_the_first_stop(row, expected):
    # The trainer cuts each completion after its first stop; the batch's loss mask covers what is left.
    rollout, _ = Stops((STOP, 8)).cut(Rollout([row, [5] * 4], [[0.0] * len(row), [0.0] * 4]))
    mask = SequenceBatch.build([[1], [1]], rollout.tokens, pad_id=PAD, device="cpu").mask
    assert mask.dtype == torch.float32 and mask[0].tolist() == expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_the_rollouts_sampling_logprobs(temperature):
    # End to end: sampling (its own forward, left padding, growing sequence) vs the trainer's one-shot scoring
    # of prompt + completion. Any off-by-one in the offsets or positions, or a missing temperature, breaks it.
    model = random_model(tiny_config(tied=False, vocab=64), seed=1, std=0.3)
    prompts = [p for p in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10]) for _ in range(3)]
    stops = tuple(range(52, 64))  # 12 of 64 ids: some rows stop early, some run out of budget
    rollout = generate(model, prompts, 8, params=SamplingParams(temperature=temperature), stop_ids=stops,
                       pad_id=PAD, seeds=list(range(100, 109)))
    lens = [len(t) for t in rollout.tokens]
    assert min(lens) < 8 and max(lens) == 8
    batch = SequenceBatch.build(prompts, rollout.tokens, pad_id=PAD, device="cpu")
    assert batch.mask.sum(1).tolist() == lens
    logp = completion_logprobs(model, batch, temperature=temperature)
    sampled = pad_rows(rollout.logprobs, batch.C, "cpu")
    assert ((logp - sampled).abs() * batch.mask).max().item() <= 1e-4


# ------------------------------------------------------------------------------------------ zero-advantage groups


def _trainer(model, script, prompts, tmp_path, rollout_logp=None, **cfg):
    cfg = TrainConfig(**{"prompts_per_step": len(prompts), "samples_per_prompt": 4, "max_new_tokens": 6,
                         "eval_every": 0, "sample_every": 0, "lr": 1e-2, **cfg})
    backend = ScriptedBackend(script, rollout_logp)
    return Trainer(cfg, model, FakeTokenizer(), FakeTask(prompts), backend, tmp_path, echo=False), backend


def test_all_zero_advantage_groups_cost_no_forward_and_skip_the_update(tmp_path):
    model = random_model(tiny_config(tied=False, vocab=32), seed=0).train()
    before = copy.deepcopy(model.state_dict())
    script = {1: [[10, STOP]] * 4, 4: [[11, 12, STOP]] * 4}  # all right / all wrong: zero spread everywhere
    trainer, backend = _trainer(model, script, [[1, 2, 3], [4, 5]], tmp_path, warmup_steps=4)
    rows = _count_forward_rows(model)
    first, second = trainer.step(), trainer.step()
    assert rows == [] and backend.syncs == 0
    assert first["skipped_update"] and first["zero_spread_frac"] == 1.0 and first["trained_rows"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (first["lr"], second["lr"]) == pytest.approx((1e-2 / 4, 1e-2 * 2 / 4))  # warmup counts skipped steps


def test_only_informative_groups_are_forwarded_and_the_gradient_is_the_full_batch_one(tmp_path):
    torch.manual_seed(0)
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    initial = copy.deepcopy(model)
    script = {1: [[10, STOP]] * 4,                                             # zero spread: dropped
              4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]],
              6: [[13, STOP], [10, 10, STOP], [14], [15, 16, STOP]]}
    prompts = [[1, 2, 3], [4, 5], [6]]

    def sampled(r, t):  # a sampling log-prob per row and token: kept rows must stay aligned with theirs
        return (-5.0, -1.0, -3.0, -4.2, -0.5)[(3 * r + t) % 5]
    trainer, backend = _trainer(model, script, prompts, tmp_path, rollout_logp=sampled, micro_batch_size=3,
                                max_grad_norm=0.0)
    rows, grads = _count_forward_rows(model), _capture_gradients(trainer)
    m = trainer.step()
    # 8 informative rows in micro-batches of 3, forwarded once: with one minibatch per epoch the old log-probs
    # come from the update's own forward. The dropped group is never forwarded.
    assert sorted(rows) == [2, 3, 3] and m["trained_rows"] == 8 and backend.syncs == 1

    for name, want in _full_batch_gradient(initial, trainer, prompts, sampled=sampled)[0].items():
        torch.testing.assert_close(grads[name], want, atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batches_take_a_prompts_rows_together(tmp_path):
    # 8 informative rows of 2 prompts in micro-batches of 2. The minibatch's shuffled order would mix the prompts
    # (a micro-batch packs a copy of each prompt it holds); in row order each micro-batch holds one prompt's rows.
    # The gradient stays the full minibatch's (the test above); here only the grouping.
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    script = {4: [[10], [11, STOP], [10, 13, 14, 15, STOP], [12, 13, 14, 15, 16, STOP]],
              6: [[13], [10, 10, STOP], [14, 15, 16, STOP], [10, 16, 17, 18, STOP]]}
    trainer, _ = _trainer(model, script, [[4, 5], [6]], tmp_path, micro_batch_size=2)
    copies, inner = [], model.hidden_states

    def record(ids, *args, **kwargs):
        copies.append(sorted(set(kwargs["packed"].prompt_ends)))
        return inner(ids, *args, **kwargs)

    model.hidden_states = record
    trainer.step()
    assert [len(ends) for ends in copies] == [1, 1, 1, 1]  # one prompt copy in each of the 4 micro-batches


def _rescored(trainer) -> torch.Tensor:
    """The last rollout's rewards, each completion scored here against its own group's prompt. (N,)"""
    r, G = trainer.last_rollout, trainer.cfg.samples_per_prompt
    return torch.tensor([trainer.task.score(r["examples"][i // G], c)[0] for i, c in enumerate(r["completions"])])


def _row_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    """Log-probs of one completion's tokens at a sampling temperature, the row scored alone from full logits. (c,)"""
    logp_all = (model(torch.tensor([prompt + completion]))[0] / temperature).log_softmax(-1)  # (T, V)
    # the logits at t score token t+1: completion token k sits at len(prompt) + k
    return torch.stack([logp_all[len(prompt) + k - 1, tok] for k, tok in enumerate(completion)])


def _full_batch_gradient(policy, trainer, prompts, ref=None, beta=0.0, sampled=lambda r, t: -1.0):
    """The gradient of the Dr. GRPO loss (+ beta x k3 KL to `ref`) over ALL rows of the trainer's last rollout,
    each token's surrogate weighted by min(pi_old / pi_rollout, 2) (pi_rollout: ScriptedBackend's `sampled`
    log-probs), at `policy`'s weights. Returns (gradients by name, the mean k3 KL per token)."""
    G, L = trainer.cfg.samples_per_prompt, trainer.cfg.max_new_tokens
    r = trainer.last_rollout
    rewards = _rescored(trainer).view(-1, G)
    advs = (rewards - rewards.mean(1, keepdim=True)).view(-1)                       # (N,)
    loss, kls = 0.0, []
    for i, completion in enumerate(r["completions"]):
        prompt = prompts[r["examples"][i // G]]
        logp = _row_logprobs(policy, prompt, completion)                            # (c,)
        rollout = torch.tensor([sampled(i, t) for t in range(len(completion))])
        weight = torch.exp(logp.detach() - rollout).clamp(max=2.0)
        loss = loss - (advs[i] * weight * torch.exp(logp - logp.detach())).sum()    # ratio 1: grad A * w * dlogp
        if ref is not None:
            delta = _row_logprobs(ref, prompt, completion).detach() - logp
            kls.append(torch.exp(delta) - delta - 1)
            loss = loss + beta * kls[-1].sum()
    (loss / (len(advs) * L)).backward()
    mean_kl = torch.cat(kls).mean().item() if kls else None
    return {n: p.grad for n, p in policy.named_parameters()}, mean_kl


def test_each_minibatch_step_clips_ratios_and_gradient_as_an_independent_computation_does(tmp_path):
    # Two epochs of two minibatches (4 optimizer steps). Each step's gradient must be that of its own minibatch's
    # clipped surrogate at the weights of that moment, against the old policy (the step's starting weights),
    # normalised by M x L (the minibatch's rows, not all N), each token weighted by min(pi_old / pi_rollout, 2)
    # with per-token sampling log-probs that the cap truncates, then clipped to max_grad_norm. The log-probs are
    # at the sampling temperature, and the ratio's upper clip is eps_high's (clip-higher), not eps's.
    # Recomputed here row by row from full logits; fp32 throughout, so only rounding separates the two
    # (tolerances as above).
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    initial = copy.deepcopy(model)
    script = {4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]],
              6: [[13, STOP], [10, 10, STOP], [14], [15, 16, STOP]]}
    prompts = [[4, 5], [6]]
    rollout_logp = [-5.0, -1.0, -3.0, -4.2, -0.5]  # pi_old ~ 1/32: weights ~4.6 and ~2.1 are capped at 2, ~0.6 not

    def sampled(r, t):
        return rollout_logp[(3 * r + t) % 5]
    max_norm, eps, eps_high, T = 1e-3, 0.05, 0.3, 0.7
    trainer, _ = _trainer(model, script, prompts, tmp_path, rollout_logp=sampled, minibatch_size=4, inner_epochs=2,
                          micro_batch_size=2, eps=eps, eps_high=eps_high, temperature=T, lr=1e-3,
                          max_grad_norm=max_norm)
    steps, real = [], trainer.optimizer.step

    def capture(*args, **kwargs):  # the weights each optimizer step starts from, and the gradient it steps on
        steps.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                      {n: p.grad.clone() for n, p in model.named_parameters()}))
        return real(*args, **kwargs)
    trainer.optimizer.step = capture
    m = trainer.step()
    assert m["optimizer_steps"] == len(steps) == 4 and m["clip_frac"] > 0  # the ratio clip binds somewhere

    G, L, M, N = 4, 6, 4, 8
    r = trainer.last_rollout
    rewards = _rescored(trainer).view(-1, G)
    advs = (rewards - rewards.mean(1, keepdim=True)).view(-1)                       # (N,)
    norms, between = [], 0  # between: tokens whose ratio lies where eps_high's clip differs from eps's
    for k, (weights, got) in enumerate(steps):
        epoch, j = divmod(k, N // M)
        order = np.random.default_rng([0, SHUFFLE, 1, epoch]).permutation(N)       # seed 0, step 1
        policy = copy.deepcopy(initial)
        policy.load_state_dict(weights)
        loss = 0.0
        for i in order[j * M:(j + 1) * M].tolist():
            prompt, completion = prompts[r["examples"][i // G]], r["completions"][i]
            logp = _row_logprobs(policy, prompt, completion, T)                     # (c,)
            old = _row_logprobs(initial, prompt, completion, T).detach()            # (c,)
            weight = torch.exp(old - torch.tensor([sampled(i, t) for t in range(len(completion))])).clamp(max=2.0)
            ratio = torch.exp(logp - old)
            clipped = ratio.clamp(1 - eps, 1 + eps_high)
            loss = loss - (weight * torch.minimum(ratio * advs[i], clipped * advs[i])).sum()
            between += int(((ratio > 1 + eps) & (ratio < 1 + eps_high) & (advs[i] > 0)).sum())
        (loss / (M * L)).backward()
        want = {n: p.grad for n, p in policy.named_parameters()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()]))
        assert norm > max_norm  # so the gradient clip binds at every step
        norms.append(norm.item())
        for name, g in want.items():
            torch.testing.assert_close(got[name], g * (max_norm / (norm + 1e-6)), atol=1e-9, rtol=1e-4, msg=name)
    assert m["grad_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-4)  # logged before the clip
    assert between > 0  # so a trainer that clipped at 1 + eps above would fail the gradients


def test_a_nonfinite_gradient_skips_its_optimizer_step_only(tmp_path):
    # An inf in the first minibatch's gradient (an overflow in the backward, with a finite loss): that step is
    # not taken, the weights and AdamW state stay finite, and the next minibatch still steps.
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    script = {4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]],
              6: [[13, STOP], [10, 10, STOP], [14], [15, 16, STOP]]}
    trainer, _ = _trainer(model, script, [[4, 5], [6]], tmp_path, minibatch_size=4, micro_batch_size=4)
    calls = []

    def overflow_once(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad
    model.lm_head.weight.register_hook(overflow_once)
    m = trainer.step()
    assert len(calls) == 2  # one backward per minibatch
    assert m["optimizer_steps"] == 1 and m["nonfinite_grad_steps"] == 1 and math.isfinite(m["grad_norm"])
    assert math.isfinite(m["loss"]) and all(p.isfinite().all() for p in model.parameters())
    assert all(s["exp_avg"].isfinite().all() and int(s["step"]) == 1 for s in trainer.optimizer.state.values())


def test_with_a_kl_term_every_group_trains_and_the_gradient_is_the_full_batch_one(tmp_path):
    # beta > 0: a flat group's policy-gradient term is zero, but its KL term is not once the policy has moved
    # from the reference. Dropping those rows would shrink the effective beta (and skip the KL entirely on a
    # step where every group is flat), so they must train, and the logged KL must cover them.
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    script = {1: [[10, STOP]] * 4, 2: [[11, 12, STOP]] * 4,                    # flat: all right, all wrong
              4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]]}
    prompts = [[1, 2, 3], [2, 5], [4, 5]]
    trainer, _ = _trainer(model, script, prompts, tmp_path, micro_batch_size=5, max_grad_norm=0.0, kl_beta=0.5)
    with torch.no_grad():  # move the policy away from the KL reference (a copy taken at construction)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    policy = copy.deepcopy(model)
    rows, grads = _count_forward_rows(model), _capture_gradients(trainer)
    m = trainer.step()
    assert sum(rows) == 12 and m["trained_rows"] == 12 and m["zero_spread_frac"] == pytest.approx(2 / 3)
    want, mean_kl = _full_batch_gradient(policy, trainer, prompts, ref=trainer.ref, beta=0.5)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert mean_kl > 1e-4 and m["kl"] == pytest.approx(mean_kl, rel=1e-5)  # over every row's tokens


def test_old_logprobs_from_the_first_epoch_equal_a_separate_scoring_pass(tmp_path):
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    initial = copy.deepcopy(model)
    script = {4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]],
              6: [[13, STOP], [10, 10, STOP], [14], [15, 16, STOP]]}
    trainer, _ = _trainer(model, script, [[4, 5], [6]], tmp_path, micro_batch_size=3, inner_epochs=2)
    real, seen = trainer._update, {}

    def spy(rows, old_logp, entropy, *rest):
        assert old_logp is None and entropy is None  # one minibatch per epoch: no separate pass
        out = real(rows, old_logp, entropy, *rest)
        seen.update(batch=rows.batch, old=out[1], entropy=out[2])
        return out

    trainer._update = spy
    m = trainer.step()
    assert m["optimizer_steps"] == 2 and not torch.equal(initial.lm_head.weight, model.lm_head.weight)
    assert "old_logp_gap_max" not in m  # the old log-probs are that forward's own
    old, entropy = trainer._score(lambda batch, ent: trainer._logprobs(initial, batch, ent), seen["batch"],
                                  return_entropy=True)  # the policy before the step
    mask = seen["batch"].mask.bool()
    torch.testing.assert_close(seen["old"][mask], old[mask], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(seen["entropy"][mask], entropy[mask], atol=1e-6, rtol=1e-6)


def test_several_minibatches_score_the_old_policy_in_a_separate_pass(tmp_path):
    model = random_model(tiny_config(tied=False, vocab=32), seed=3, std=0.1).train()
    script = {4: [[10, STOP], [11, 12, STOP], [10, 13, 14, 15, 16, 17], [12, STOP]],
              6: [[13, STOP], [10, 10, STOP], [14], [15, 16, STOP]]}
    trainer, _ = _trainer(model, script, [[4, 5], [6]], tmp_path, micro_batch_size=2, minibatch_size=4,
                          score_batch_size=5)
    rows = _count_forward_rows(model)
    m = trainer.step()
    # the no-grad pass in score-batches of 5, then two minibatches of 4 rows in micro-batches of 2
    assert rows[:2] == [5, 3] and rows[2:] == [2, 2, 2, 2] and m["optimizer_steps"] == 2
    # The first minibatch's forward sees the weights the scoring pass saw: in fp32 the same log-probs.
    assert 0 <= m["old_logp_gap_mean"] <= m["old_logp_gap_max"] < 1e-5


# ------------------------------------------------------------------------------------------ learning and resume


def _synthetic_trainer(out_dir, attn="reference", model_seed=0, task_seed=0, task_cls=FirstDigitTask, **overrides):
    tokenizer = CharTokenizer()
    cfg = TrainConfig(**{"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 3, "lr": 1e-3,
                         "micro_batch_size": 128, "eval_every": 0, "sample_every": 0, "save_every": 0,
                         "steps": 150, **overrides})
    model = tiny_policy(tokenizer.vocab_size, seed=model_seed).to(WEIGHT_DTYPES[cfg.weights])
    task = task_cls(tokenizer, 10_000, seed=task_seed)
    backend = make_backend(attn, model, pad_id=tokenizer.pad_id, max_seq_len=16)  # an engine shares fp32 weights
    return Trainer(cfg, model, tokenizer, task, backend, out_dir, echo=False)


@pytest.mark.slow
def test_synthetic_task_is_learned(tmp_path):
    trainer = _synthetic_trainer(tmp_path)
    rewards = []
    while trainer.step_idx < trainer.cfg.steps:
        rewards.append(trainer.step()["reward_mean"])
        if len(rewards) >= 5 and sum(rewards[-5:]) / 5 >= 0.8:
            break
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert start < 0.2, f"a random policy should start low, got {start:.3f}"
    assert end >= 0.8, f"reward reached only {end:.3f} after {len(rewards)} steps: {rewards[::10]}"


def test_samples_are_the_first_completion_of_each_of_the_first_prompts(tmp_path):
    from minigrpo.rl.loop import run

    trainer = _synthetic_trainer(tmp_path, prompts_per_step=2, samples_per_prompt=4, steps=1, sample_every=1,
                                 num_samples=4)  # more samples asked for than the step has prompts
    run(trainer)
    rows = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    r = trainer.last_rollout
    assert r["completions"][4] != r["completions"][1]  # so the second row tells group 1's first from another row
    assert [(x["question"], x["completion"], x["reward"]) for x in rows] == [
        (trainer.task.describe(r["examples"][j])["question"],
         trainer.tokenizer.decode(r["completions"][4 * j], skip_special_tokens=False), r["rewards"][4 * j])
        for j in range(2)]


_TIMING = ("time_", "tokens_per_s")


def _comparable(m):
    return {k: v for k, v in m.items() if not any(t in k for t in _TIMING)}


@pytest.mark.parametrize("weights, attn", [("fp32", "reference"), ("bf16", "reference"), ("fp32", "sdpa")])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, weights, attn):
    # Multiple inner epochs, shuffled minibatches, warmup + cosine, KL to a reference: every piece of state;
    # with bf16 weights also the stochastic rounding's random bits; with the engine (sdpa), weights it shares.
    if attn != "reference":
        pytest.importorskip("minigrpo.engine.engine", reason="the fast engine is not available")
    cfg = dict(steps=4, inner_epochs=2, minibatch_size=32, micro_batch_size=16, warmup_steps=2,
               lr_schedule="cosine", kl_beta=0.05, lr=3e-3, weights=weights)
    full = _synthetic_trainer(tmp_path / "full", attn, **cfg)
    expected = [full.step() for _ in range(4)]

    first = _synthetic_trainer(tmp_path / "split", attn, **cfg)
    first.step(), first.step()
    ckpt = first.save()
    torch.manual_seed(123)  # disturb the global RNGs: the resumed run must not depend on them
    second = _synthetic_trainer(tmp_path / "split", attn, **cfg)
    second.resume(tmp_path / "split")
    assert second.step_idx == 2
    resumed = [second.step(), second.step()]
    assert [_comparable(m) for m in resumed] == [_comparable(m) for m in expected[2:]]
    for name, w in full.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], w), name
    if attn != "reference":  # the checkpoint was loaded into the memory the engine reads
        assert second.model.model.norm.weight.data_ptr() == second.backend.model.norm.data_ptr()

    if weights == "bf16":  # the moments stay bf16, and the weights really moved
        assert all(v["exp_avg"].dtype == torch.bfloat16 for v in second.optimizer.state.values())
        assert not torch.equal(full.model.state_dict()["lm_head.weight"], first.ref.state_dict()["lm_head.weight"])
    with pytest.raises(ValueError, match="lr: checkpoint 0.003 vs now 0.001"):
        _synthetic_trainer(tmp_path / "other", **{**cfg, "lr": 1e-3}).resume(ckpt)
    with pytest.raises(ValueError, match=r"cannot resume exactly: the training prompts \(--train-data.*differ"):
        _synthetic_trainer(tmp_path / "data", task_seed=1, **cfg).resume(ckpt)  # as many examples, other ones
    with pytest.raises(ValueError, match=r"cannot resume exactly: the training answers \(--train-data"):
        _synthetic_trainer(tmp_path / "answers", task_cls=CopyTask, **cfg).resume(ckpt)  # same prompts, other answers
    with pytest.raises(ValueError, match=r"cannot resume exactly: the KL reference's weights \(the initial model"):
        _synthetic_trainer(tmp_path / "model", model_seed=1, **cfg).resume(ckpt)  # same shape, another model
    leaner = _synthetic_trainer(tmp_path / "leaner", **{**cfg, "micro_batch_size": 8, "logprob_chunk_size": 64})
    leaner.resume(ckpt)  # memory-only settings: what the memory check suggests after an out-of-memory stop
    assert leaner.step_idx == 2
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    del state["inputs"]["answers"]  # a checkpoint from before the answers were recorded: the rest is checked
    torch.save(state, ckpt / STATE_FILE)
    _synthetic_trainer(tmp_path / "older", **cfg).resume(ckpt)
    with pytest.raises(ValueError, match=r"the training prompts \(--train-data.*differ"):
        _synthetic_trainer(tmp_path / "older_data", task_seed=1, **cfg).resume(ckpt)
    del state["inputs"]  # without its fingerprints a resume could not tell another data set or model
    torch.save(state, ckpt / STATE_FILE)
    with pytest.raises(ValueError, match=r"trainer_state.pt cannot be read \(KeyError: 'it lacks inputs'\)"):
        _synthetic_trainer(tmp_path / "old", **cfg).resume(ckpt)


def test_activation_checkpointing_trains_identically(tmp_path, monkeypatch):
    cfg = dict(steps=2, inner_epochs=2, minibatch_size=64, micro_batch_size=32, kl_beta=0.05, lr=3e-3)
    real, calls = torch.utils.checkpoint.checkpoint, []
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs, forwards = [], 2 * 2 * 4  # 2 steps x 2 epochs x 128 rows in micro-batches of 32
    for ckpt, layers in ((False, None), (True, None), (True, 1)):  # none, both layers, the first of two
        calls.clear()
        trainer = _synthetic_trainer(tmp_path / f"{ckpt}{layers}", activation_checkpointing=ckpt,
                                     recompute_layers=layers, **cfg)
        runs.append(([_comparable(trainer.step()) for _ in range(2)], trainer.model.state_dict()))
        assert len(calls) == forwards * (layers or 2 * ckpt)  # reaches the training forward; only it recomputes
    for run in runs[1:]:
        assert run[0] == runs[0][0]
        for name, w in runs[0][1].items():
            assert torch.equal(run[1][name], w), name
    with pytest.raises(ValueError, match="recompute_layers 3 is more than the model's 2 decoder layers"):
        _synthetic_trainer(tmp_path / "3", activation_checkpointing=True, recompute_layers=3, **cfg)


def test_offloaded_reference_trains_identically_and_is_away_during_the_update(tmp_path):
    cfg = dict(steps=2, inner_epochs=2, minibatch_size=64, micro_batch_size=32, kl_beta=0.05, lr=3e-3)
    runs = []
    for offload in (False, True):
        trainer = _synthetic_trainer(tmp_path / str(offload), offload_reference=offload, **cfg)
        if offload:
            seen, update, score = [], trainer._update, trainer._score
            trainer._update = lambda *a: seen.append(("update", trainer.ref_offload.on_device)) or update(*a)
            trainer._score = lambda f, *a, **k: (seen.append(("ref" if f is trainer.ref_forward else "old",
                                                              trainer.ref_offload.on_device)) or score(f, *a, **k))
            assert not trainer.ref_offload.on_device  # from the start: only the host copy
        runs.append(([_comparable(trainer.step()) for _ in range(2)], trainer.model.state_dict()))
    assert runs[0][0] == runs[1][0] and runs[1][0][1]["kl"] > 0  # the reference really was scored, step 2
    for name, w in runs[0][1].items():
        assert torch.equal(runs[1][1][name], w), name
    assert seen == [("ref", True), ("old", False), ("update", False)] * 2  # two minibatches: old ones scored
    assert not trainer.ref_offload.on_device
    with pytest.raises(ValueError, match="offload_reference needs a KL reference"):
        TrainConfig(kl_beta=0.0, offload_reference=True)


def test_kl_is_measured_against_the_initial_policy(tmp_path):
    trainer = _synthetic_trainer(tmp_path, steps=2, kl_beta=0.1, lr=1e-2)
    first, second = trainer.step(), trainer.step()
    assert first["kl"] == 0.0  # K = 1, one minibatch: the policy is still the reference during step 1
    assert second["kl"] > 0.0


def test_checkpoint_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    trainer = _synthetic_trainer(tmp_path, steps=1)
    trainer.step()
    ckpt = trainer.save()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == ckpt.name
    hf = transformers.Qwen2ForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4, 10]])
    with torch.no_grad():
        assert (hf(ids).logits - trainer.model(ids)).abs().max().item() <= 1e-5


def test_keep_checkpoints_prunes_old_ones(tmp_path):
    trainer = _synthetic_trainer(tmp_path, steps=3, keep_checkpoints=2)
    for _ in range(3):
        trainer.step()
        trainer.save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]


@pytest.mark.parametrize("share", [True, False])
def test_engine_backend_agrees_with_the_reference_and_follows_updates(tmp_path, share):
    pytest.importorskip("minigrpo.engine.engine", reason="the fast engine is not available")
    reference = _synthetic_trainer(tmp_path / "ref", lr=1e-2, kl_beta=0.05)
    engine = _synthetic_trainer(tmp_path / "engine", "sdpa", lr=1e-2, kl_beta=0.05)
    if not share:  # the copy path (fp32 master weights with a bf16 engine): a private copy, synced after updates
        backend = engine.backend = make_backend("sdpa", copy.deepcopy(engine.model), pad_id=engine.tokenizer.pad_id,
                                                max_seq_len=16)
        backend.load_weights = lambda model: backend.model.load_from(model, share=False)
    for _ in range(3):  # after step 1 the engine only agrees if it samples the updated policy
        a, b = reference.step(), engine.step()
        assert engine.last_rollout == reference.last_rollout  # same seeds -> same completions
        assert b["logp_diff_max"] <= 1e-4
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3)  # the KL anchor is a copy, not the shared weights


def test_make_backend_sizes_the_engine_to_the_rollout_and_picks_cpu_defaults():
    pytest.importorskip("minigrpo.engine.engine", reason="the fast engine is not available")
    model = tiny_policy(CharTokenizer().vocab_size, seed=0)
    engine = make_backend("sdpa", model, pad_id=0, max_seq_len=40, max_batch=24)
    assert (engine.cfg.compile, engine.cfg.cuda_graphs, engine.cfg.sampler) == ("none", False, "torch")
    assert engine.cfg.bucket_sizes() == (8, 16, 24)
    pages_per_seq = -(-40 // engine.cfg.page_size)
    assert engine.kv.capacity <= 24 * pages_per_seq + 1  # no pool for sequences that never run


# ------------------------------------------------------------------------------------------ small pieces


def test_lr_schedule_hand_values():
    cfg = TrainConfig(steps=6, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.0)
    # warmup: (s+1)/2; then cosine over the 4 remaining steps: progress (s-2)/4 -> 0.5 * (1 + cos(pi * p))
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + 2 ** -0.5), 0.5, 0.5 * (1 - 2 ** -0.5)]
    assert [lr_factor(s, cfg) for s in range(6)] == pytest.approx(expected)
    # a floor of 0.2 scales the decay into [0.2, 1]: 0.2 + 0.8 x the cosine, not max(0.2, cosine)
    floored = replace(cfg, min_lr_ratio=0.2)
    want = [0.5, 1.0] + [0.2 + 0.8 * f for f in expected[2:]]
    assert [lr_factor(s, floored) for s in range(6)] == pytest.approx(want)
    assert lr_factor(5, TrainConfig(steps=6, warmup_steps=2)) == 1.0  # constant after warmup


def test_epoch_sampler_permutes_each_epoch_and_resumes():
    s = EpochSampler(5, seed=1)
    first = s.next(3) + s.next(2)
    second = s.next(5)
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4] and first != second
    state = s.state_dict()
    ahead = s.next(7)
    t = EpochSampler(5, seed=1)
    t.load_state_dict(state)
    assert t.next(7) == ahead
    with pytest.raises(ValueError, match="same training data"):
        EpochSampler(6, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"a data-order state needs \['epoch', 'num_examples', 'pos', 'seed'\]"):
        EpochSampler(5, seed=1).load_state_dict({k: v for k, v in state.items() if k != "seed"})


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="minibatch_size 48 must divide"):
        TrainConfig(prompts_per_step=4, samples_per_prompt=8, minibatch_size=48)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 2"):
        TrainConfig(samples_per_prompt=1)
    with pytest.raises(ValueError, match="tis_cap must be >= 1"):
        TrainConfig(tis_cap=0.5)
    with pytest.raises(ValueError, match="need 0 < eps < 1 and eps_high > 0, got eps=1.5"):
        TrainConfig(eps=1.5)
    with pytest.raises(ValueError, match="logprob_chunk_size must be >= 0, got -1"):
        TrainConfig(logprob_chunk_size=-1)
    with pytest.raises(ValueError, match="temperature must be > 0 for RL sampling, got 0"):
        TrainConfig(temperature=0)


def test_greedy_evaluation_counts_exact_answers():
    tokenizer = CharTokenizer()
    task = FirstDigitTask(tokenizer, 4, seed=0)
    eos = tokenizer.eos_id
    answers = {0: [task.prompt(0)[0], eos], 1: [task.prompt(1)[0]], 2: [eos], 3: [task.prompt(3)[0], eos]}

    class Answering:  # right for examples 0 and 3, half credit for 1, wrong for 2
        def generate(self, prompts, samples_per_prompt, max_new_tokens, params, stop_ids, seeds):
            assert params.greedy and samples_per_prompt == 1
            return Rollout([answers[[task.prompt(i) for i in range(4)].index(p)] for p in prompts], [])

    res = evaluate(Answering(), task, max_new_tokens=3, batch_size=3, progress=False)
    assert res["accuracy"] == 0.5 and res["reward_mean"] == (1 + 0.5 + 0 + 1) / 4 and res["n"] == 4
    assert res["truncated_frac"] == 0.25  # example 1 has no stop token


def test_metrics_log_and_resume_truncation(tmp_path):
    log = MetricsLogger(tmp_path, echo=False)
    for s in (1, 2, 3):
        log.log({"step": s, "reward_mean": s / 10})
    MetricsLogger(tmp_path, resume_step=2, echo=False)  # the run is resumed from step 2's checkpoint
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_phase_timer_counts_the_seconds_spent_compiling():
    # A compile is counted once, with the backward graph compiled at its first use; a cached call costs nothing;
    # torch._dynamo.reset() (which drops Dynamo's callbacks) does not stop the count.
    compile_seconds()
    torch._dynamo.reset()
    timer = PhaseTimer(torch.device("cpu"), ("a",))
    f = torch.compile(lambda x: (x * 2).sin().sum(), backend="aot_eager", dynamic=False)
    x = torch.randn(3, requires_grad=True)
    f(x).backward()
    first = timer.compiling
    f(x).backward()
    assert first > 0 and timer.compiling == first


def test_tensorboard_logs(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")  # without it train.py says how to install it (test_train_cli.py)
    log = MetricsLogger(tmp_path, tensorboard=True, echo=False)
    log.log({"step": 1, "reward_mean": 0.5})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_qa_task_prompt_and_reward():
    if not QWEN_DIR.exists():
        pytest.skip(f"Qwen tokenizer files not found at {QWEN_DIR}")
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.tasks.qa import Example
    from minigrpo.tasks.task import QATask
    from minigrpo.tasks.templates import QWEN_MATH_PROMPT

    tokenizer = Tokenizer.from_dir(QWEN_DIR)
    task = QATask([Example("How many legs do 2 cats have?", "2*4=8\n#### 8", "8")], tokenizer)  # chat, numeric
    user = "How many legs do 2 cats have?\n" + QWEN_MATH_PROMPT
    assert task.prompt(0) == tokenizer.encode_chat([{"role": "user", "content": user}])
    assert task.score(0, tokenizer.encode("So \\boxed{8}.<|im_end|>")) == (1.0, True)
    assert task.score(0, tokenizer.encode("So \\boxed{9}.<|im_end|>")) == (0.0, False)


def test_policy_dtype_must_match_the_weights_setting(tmp_path):
    tokenizer = CharTokenizer()
    cfg = TrainConfig(prompts_per_step=2, samples_per_prompt=2, eval_every=0, weights="bf16")
    model = tiny_policy(tokenizer.vocab_size, seed=0)  # fp32
    with pytest.raises(ValueError,
                       match=r"weights='bf16' needs the policy in torch.bfloat16, found \['torch.float32'\]"):
        Trainer(cfg, model, tokenizer, FirstDigitTask(tokenizer, 10, seed=0), ReferenceBackend(model, 0), tmp_path)
    with pytest.raises(ValueError, match="weights must be one of"):
        TrainConfig(weights="fp16")


def _record_gradients(trainer) -> list[dict[str, torch.Tensor]]:
    """Make the trainer's optimizer plain SGD that records every step's gradients (the list returned).

    SGD, not AdamW: Adam divides by sqrt(v), so a gradient element near zero whose rounding differs in sign
    moves its weight by a whole lr either way, and the epochs after the first would start from weights
    that differ by far more than rounding. SGD keeps weight differences at lr x the gradient difference."""
    grads, sgd = [], torch.optim.SGD(trainer.model.parameters(), lr=trainer.cfg.lr)
    step = sgd.step

    def recording_step(*args):
        grads.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        return step()

    sgd.step, trainer.optimizer = recording_step, sgd
    return grads


def _assert_gradients_close(got: dict, want: dict, rtol: float) -> None:
    """Each tensor's worst element within rtol x that gradient's norm; the message names the worst one."""
    for name, g in want.items():
        diff = (got[name] - g).abs()
        worst = int(diff.argmax())
        tol = rtol * float(g.norm())
        assert float(diff.flatten()[worst]) <= tol, (
            f"{name}[{worst}]: compiled {float(got[name].flatten()[worst]):.6g} vs eager "
            f"{float(g.flatten()[worst]):.6g}, "
            f"difference {float(diff.flatten()[worst]):.3g} > {rtol} x |grad| = {tol:.3g}")


@pytest.mark.slow
def test_compiled_policy_trains_like_the_eager_one(tmp_path, monkeypatch):
    # Compiling reorders fp32 reductions, so the two differ by rounding: about sqrt(n) x 6e-8 relative for
    # a sum of n terms, a few 1e-6 of the gradient's norm after a backward through the tiny model. 1e-4 is
    # far above that and far below what a real difference makes (a wrong mask, row, scale or padding changes
    # the gradient by O(1) of its norm).
    # Compiled with activation checkpointing too: the recomputation is compiled into the layer's backward.
    import torch._dynamo
    for name in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))  # the trainer sets them
    cfg = dict(steps=1, inner_epochs=2, micro_batch_size=32, kl_beta=0.05, lr=3e-3)
    runs = []
    for compiled, ckpt in ((False, False), (True, False), (True, True)):
        trainer = _synthetic_trainer(tmp_path / f"{compiled}{ckpt}", compile_policy=compiled,
                                     activation_checkpointing=ckpt, **cfg)
        grads = _record_gradients(trainer)
        runs.append((trainer.step(), grads))
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in trainer.model.model.layers)
    (eager, eager_grads), *compiled_runs = runs
    for compiled, compiled_grads in compiled_runs:
        for key in ("loss", "kl", "entropy", "grad_norm", "logp_diff_mean"):
            assert compiled[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-7), key
        assert len(eager_grads) == len(compiled_grads) == 2  # one optimizer step per epoch
        for got, want in zip(compiled_grads, eager_grads):
            assert got.keys() == want.keys()  # same names: compiling in place keeps them
            _assert_gradients_close(got, want, rtol=1e-4)


def test_compiled_layers_serve_every_batch_shape_with_one_graph_per_grad_mode(monkeypatch):
    # hidden_states marks the batch and length dimensions dynamic, so a run compiles its decoder layer once per
    # grad mode whatever the micro-batch shapes; with static shapes it was a graph per length bucket, 8-12 s
    # each on the H200. Past RECOMPILE_LIMIT graphs Dynamo raises instead of running eager without a word.
    import torch._dynamo

    from minigrpo.rl.compile_layers import RECOMPILE_LIMIT, fail_past_recompile_limit

    for name in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))  # restored after
    fail_past_recompile_limit()
    torch._dynamo.reset()
    model = random_model(tiny_config(), seed=0)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    counters = torch._dynamo.utils.counters["stats"]
    graphs = counters["unique_graphs"]
    shapes = [(2, 5), (3, 9), (7, 4), (2, 17), (6, 6)]
    with torch.no_grad():
        for B, T in shapes:
            model.hidden_states(torch.randint(0, 256, (B, T)))
    assert counters["unique_graphs"] - graphs == 1
    for B, T in shapes:  # with grad and activation checkpointing: one more graph
        model.hidden_states(torch.randint(0, 256, (B, T)), recompute_layers=2).sum().backward()
    assert counters["unique_graphs"] - graphs == 2
    for B, T in shapes:  # the first layer recomputed, the second not: one more, whatever the shapes
        model.hidden_states(torch.randint(0, 256, (B, T)), recompute_layers=1).sum().backward()
    assert counters["unique_graphs"] - graphs == 3
    layer = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    for n in range(1, RECOMPILE_LIMIT + 1):
        layer(torch.ones(n))
    with pytest.raises(Exception, match="recompile_limit"):  # one graph too many is an error, not a quiet eager run
        layer(torch.ones(RECOMPILE_LIMIT + 1))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("default", [False, True], ids=["layer_options", "inductor_defaults"])
def test_compiled_layer_trains_micro_batches_either_side_of_the_mix_order_bound_with_one_graph(default):
    # On CUDA, Inductor fuses each norm's two backward reductions (over rows, over columns) when B x T x C >= 5 x 2^20
    # and by default guards on that: a micro-batch on the other side of the bound compiles a second graph (~10 s at
    # 0.5B). layer_options() drops the guard; the defaults' second graph shows what this test can catch.
    from minigrpo.rl.compile_layers import layer_options

    torch._dynamo.reset()
    model = random_model(tiny_config(head_dim=64), dtype=torch.bfloat16, device="cuda")  # C = 896, as the 0.5B
    for layer in model.model.layers:
        layer.compile(options={} if default else layer_options())
    counters = torch._dynamo.utils.counters["stats"]
    graphs = counters["unique_graphs"]
    # B x T: 8192 and 7488 above 5852, 2048 below; widths are multiples of 8, as the trainer's (SequenceBatch):
    # Inductor also guards on T % 8
    for B, T in ((4, 2048), (2, 1024), (3, 2496)):
        model.hidden_states(torch.randint(0, 256, (B, T), device="cuda"), recompute_layers=2).sum().backward()
    assert counters["unique_graphs"] - graphs == (2 if default else 1)
    torch._dynamo.reset()
