"""Dr. GRPO math against hand-computed numbers (every expected value is derived in a comment)."""

import math

import pytest
import torch

from minigrpo.rl.distributed import Dist
from minigrpo.rl.grpo import dr_grpo_loss, group_advantages, nonzero_groups, truncated_is_weights
from minigrpo.rl.step_metrics import mismatch_metrics

# ---------------------------------------------------------------------------------------------- advantages


def test_group_advantages_two_groups_of_three():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0, 1.0])
    # group 0: mean 1/3 -> [1 - 1/3, 0 - 1/3, 0 - 1/3] = [2/3, -1/3, -1/3]
    # group 1: mean 1   -> [2 - 1, 0 - 1, 1 - 1]       = [1, -1, 0]
    # (GRPO would divide group 1 by its std sqrt(2/3) ~ 0.816 and give [1.22, -1.22, 0]: no std here)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 3), expected)


def test_group_advantages_int_rewards_become_float():
    adv = group_advantages(torch.tensor([1, 0]), 2)  # mean 0.5 -> [0.5, -0.5]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_group_advantages_rejects_ragged_batch():
    with pytest.raises(RuntimeError, match="invalid for input of size 5"):
        group_advantages(torch.zeros(5), 3)


# ---------------------------------------------------------------------------------------------- masks


def test_nonzero_groups():
    adv = torch.tensor([0.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    # group 1 has a nonzero advantage -> all three kept (including its zero-advantage sample)
    assert nonzero_groups(adv, 3).tolist() == [False] * 3 + [True] * 3 + [False] * 3


def test_nonzero_groups_from_equal_binary_rewards():
    rewards = torch.tensor([1.0] * 8 + [0.0] * 8 + [1.0, 0.0] * 4)
    keep = nonzero_groups(group_advantages(rewards, 8), 8)
    assert keep.tolist() == [False] * 16 + [True] * 8


def test_equal_fractional_rewards_give_exact_zero_advantages():
    # In fp32, 0.9 - mean([0.9] * 8) is -6e-8, not 0: such a group would be trained on noise and counted as
    # informative. Partial-credit rewards (CopyTask's 3/5, 1/6) make these groups common.
    rewards = torch.tensor([0.9] * 8 + [0.1] * 8 + [1 / 3] * 8 + [0.1] * 7 + [0.6])
    adv = group_advantages(rewards, 8)
    assert (adv[:24] == 0).all() and (adv[24:] != 0).all()
    assert nonzero_groups(adv, 8).tolist() == [False] * 24 + [True] * 8


# ---------------------------------------------------------------------------------------------- loss

# Two sequences, 3 tokens, eps = 0.2 (range [0.8, 1.2]), max_new_tokens L = 4, A = [+1, -1].
#   seq 0 (A=+1): ratio 1.1 unclipped     -> -min(1.1, 1.1)   = -1.1
#                 ratio 1.5 clipped above -> -min(1.5, 1.2)   = -1.2  (clip active: zero grad)
#                 ratio 3.0 masked out    -> 0
#   seq 1 (A=-1): ratio 0.5 clipped below -> -min(-0.5, -0.8) = 0.8   (clip active: zero grad)
#                 ratio 1.5, A<0          -> -min(-1.5, -1.2) = 1.5   (not clipped: the pessimistic side)
#                 ratio 1.0               -> 1.0
#   sum = -1.1 - 1.2 + 0.8 + 1.5 + 1.0 = 1.0;  loss = 1.0 / (N * L) = 1.0 / 8 = 0.125
RATIOS = [[1.1, 1.5, 3.0], [0.5, 1.5, 1.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
ADV = [1.0, -1.0]


def _case(requires_grad=False):
    old = torch.full((2, 3), -1.0)
    logp = (old + torch.tensor(RATIOS).log()).requires_grad_(requires_grad)
    return logp, old, torch.tensor(ADV), torch.tensor(MASK)


def test_loss_hand_computed():
    logp, old, adv, mask = _case()
    loss, stats = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(0.125, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)  # 2 of the 5 masked tokens clipped
    assert stats["kl"].item() == 0.0
    assert all(v.ndim == 0 and not v.requires_grad for v in stats.values())


def test_loss_normaliser_is_constant_not_length():
    logp, old, adv, mask = _case()
    # Same tokens, budget L = 8: 1.0 / (2 * 8) = 0.0625 (a per-sequence length mean would not change)
    loss, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=8)
    assert loss.item() == pytest.approx(0.0625, abs=1e-6)
    # Full batch is N = 4 (e.g. two zero-advantage sequences dropped): 1.0 / (4 * 4) = 0.0625
    loss, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4, num_sequences=4)
    assert loss.item() == pytest.approx(0.0625, abs=1e-6)
    with pytest.raises(ValueError, match="smaller than the completion length"):
        dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=2)


def test_loss_micro_batches_sum_to_full_batch():
    logp, old, adv, mask = _case()
    full, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4)
    parts = [
        dr_grpo_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                     eps_low=0.2, max_new_tokens=4, num_sequences=2)[0]
        for i in range(2)
    ]
    # seq 0: (-1.1 - 1.2) / 8 = -0.2875;  seq 1: (0.8 + 1.5 + 1.0) / 8 = 0.4125
    assert parts[0].item() == pytest.approx(-0.2875, abs=1e-6)
    assert parts[1].item() == pytest.approx(0.4125, abs=1e-6)
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_loss_clip_higher():
    logp, old, adv, mask = _case()
    # eps_high = 0.6 -> range [0.8, 1.6]: seq 0's ratio 1.5 is no longer clipped: -1.5 instead of -1.2
    # sum = -1.1 - 1.5 + 0.8 + 1.5 + 1.0 = 0.7; loss = 0.7 / 8 = 0.0875; only seq 1 token 0 clipped
    loss, stats = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.6, max_new_tokens=4)
    assert loss.item() == pytest.approx(0.0875, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(1 / 5)


def test_loss_gradient_zero_on_clipped_and_masked_tokens():
    logp, old, adv, mask = _case(requires_grad=True)
    loss, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4)
    loss.backward()
    # unclipped token: d(-ratio * A)/d logp = -ratio * A, divided by N*L = 8
    #   seq 0 tok 0: -1.1 * 1 / 8 = -0.1375; seq 0 tok 1 clipped -> 0; seq 0 tok 2 masked -> 0
    #   seq 1 tok 0 clipped -> 0; tok 1: -1.5 * -1 / 8 = 0.1875; tok 2: -1.0 * -1 / 8 = 0.125
    expected = torch.tensor([[-0.1375, 0.0, 0.0], [0.0, 0.1875, 0.125]])
    torch.testing.assert_close(logp.grad, expected)


def test_kl_term():
    # Zero advantage isolates the KL. N = 1, C = 2, L = 2, beta = 0.1, delta = ref - logp = [ln 2, -ln 2]
    #   k3(ln 2)  = e^{ln 2} - ln 2 - 1   = 2   - 0.693147 - 1 = 0.306853
    #   k3(-ln 2) = e^{-ln 2} + ln 2 - 1  = 0.5 + 0.693147 - 1 = 0.193147   (sum = 0.5 exactly)
    #   loss = beta * 0.5 / (N * L) = 0.1 * 0.5 / 2 = 0.025;  kl stat = 0.5 / 2 = 0.25
    # grad: d k3 / d logp = 1 - e^{delta} -> [1 - 2, 1 - 0.5] = [-1, 0.5], times beta / (N L) = 0.05
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = logp.detach() + torch.tensor([[math.log(2), -math.log(2)]])
    adv, mask = torch.zeros(1), torch.ones(1, 2)
    loss, stats = dr_grpo_loss(logp, logp.detach(), adv, mask, eps_low=0.2, ref_logp=ref, beta=0.1, max_new_tokens=2)
    assert loss.item() == pytest.approx(0.025, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.05, 0.025]]))


def test_kl_adds_to_policy_term_and_is_reported_at_beta_zero():
    logp, old, adv, mask = _case()
    ref = logp - 0.5  # delta = -0.5 everywhere: k3 = e^-0.5 + 0.5 - 1 = 0.106531
    k3 = math.exp(-0.5) - 0.5  # 0.1065306...
    base, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4)
    loss, stats = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4, ref_logp=ref, beta=0.1)
    # 5 masked tokens: + 0.1 * 5 * k3 / 8
    assert loss.item() == pytest.approx(base.item() + 0.1 * 5 * k3 / 8, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(k3, abs=1e-6)
    off, stats0 = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4, ref_logp=ref, beta=0.0)
    assert off.item() == pytest.approx(base.item(), abs=1e-7)
    assert stats0["kl"].item() == pytest.approx(k3, abs=1e-6)


# Truncated importance sampling on the case above: the rollout engine's log-probs put pi_old / pi_rollout at
#   seq 0: [0.5, 4.0, 10.0 (masked)]    seq 1: [1.0, 1.5, 2.5];   cap C = 2 -> weights [0.5, 2, 2], [1, 1.5, 2]
# The weights multiply the per-token surrogate terms of the loss comment above:
#   -1.1 * 0.5 - 1.2 * 2 + 0.8 * 1 + 1.5 * 1.5 + 1.0 * 2 = -0.55 - 2.4 + 0.8 + 2.25 + 2.0 = 2.1;  loss = 2.1 / 8
# Gradient wrt logp (d ratio / d logp = ratio): unclipped tokens only, -A * ratio * w / 8:
#   (0, 0): -1.1 * 0.5 / 8 = -0.06875   (1, 1): 1.5 * 1.5 / 8 = 0.28125   (1, 2): 1.0 * 2 / 8 = 0.25
IS_RATIOS = [[0.5, 4.0, 10.0], [1.0, 1.5, 2.5]]


def test_truncated_importance_sampling_hand_computed():
    logp, old, adv, mask = _case(requires_grad=True)
    rollout = old - torch.tensor(IS_RATIOS).log()
    weight = truncated_is_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0, 2.0], [1.0, 1.5, 2.0]]))
    loss, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4, is_weight=weight)
    assert loss.item() == pytest.approx(2.1 / 8, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.06875, 0.0, 0.0], [0.0, 0.28125, 0.25]]))
    # the KL term is not weighted: it adds beta * k3 / 8 per masked token whatever the weights
    ref = logp.detach() - 0.5
    with_kl, _ = dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, max_new_tokens=4, is_weight=weight, ref_logp=ref,
                              beta=0.1)
    assert with_kl.item() == pytest.approx((2.1 + 0.1 * 5 * (math.exp(-0.5) - 0.5)) / 8, abs=1e-6)


def test_mismatch_metrics_hand_computed():
    # Over the 5 masked tokens (the 10.0 is masked out): log r = ln [0.5, 4], [1, 1.5, 2.5]
    #   sum |log r| = ln 2 + ln 4 + 0 + ln 1.5 + ln 2.5 = 3.401197
    #   sum k3 = sum (r - 1 - ln r) = 0.193147 + 1.613706 + 0 + 0.094535 + 0.583709 = 2.485097
    #   sum of capped weights = 0.5 + 2 + 1 + 1.5 + 2 = 7; capped: 4.0 and 2.5; max |log r| = ln 4; max r = 4
    _, old, _, mask = _case()
    m = mismatch_metrics(old, old - torch.tensor(IS_RATIOS).log(), torch.ones_like(old), mask, 2.0, Dist())
    expected = {"entropy": 1.0, "logp_diff_mean": 3.401197 / 5, "mismatch_kl": 2.485097 / 5, "tis_weight_mean": 7 / 5,
                "tis_capped_frac": 2 / 5, "logp_diff_max": math.log(4), "tis_ratio_max": 4.0}
    assert m == {k: pytest.approx(v, abs=1e-5) for k, v in expected.items()}


def test_loss_contract_errors():
    logp, old, adv, mask = _case()
    with pytest.raises(ValueError, match="needs ref_logp"):
        dr_grpo_loss(logp, old, adv, mask, eps_low=0.2, beta=0.1, max_new_tokens=4)
    with pytest.raises(ValueError, match="fp32"):
        dr_grpo_loss(logp.double(), old, adv, mask, eps_low=0.2, max_new_tokens=4)
    with pytest.raises(ValueError, match="adv must have shape"):
        dr_grpo_loss(logp, old, adv[:1], mask, eps_low=0.2, max_new_tokens=4)
