"""Dr. GRPO: group-relative advantages and the clipped policy-gradient loss.

Reference: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO).
GRPO (Shao et al. 2024) normalises in two places that bias the optimisation:
  * advantages are divided by the group's reward std: prompts almost always (or almost never) solved get
    *up-weighted*, a difficulty bias;
  * each sequence's token losses are averaged over its own length: a wrong long answer is penalised less per
    token than a wrong short one, which makes GRPO responses grow without bound.
Dr. GRPO removes both: A = r - mean_group(r), and the loss is a token *sum* divided by a constant
(number of sequences x max_new_tokens), so every token gets the same weight no matter the length.
Everything here is batched torch with no host syncs, so it does not stall a CUDA stream.

Shape legend: B prompts, G samples per prompt (group size), N = B*G sequences, group-major (the G samples
of prompt b are rows [b*G, (b+1)*G)), C completion length (padded, <= max_new_tokens).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean of r over i's group. No division by the group std (see module docstring).
    A group of equal rewards gets exact zeros: r - mean(r) in floating point is not exactly 0 for rewards
    such as 0.1 or 1/3, and `nonzero_groups` must see such a group as the no-signal group it is."""
    if not rewards.is_floating_point():
        rewards = rewards.float()
    r = rewards.view(-1, group_size)  # (B, G)
    spread = r.amax(dim=1, keepdim=True) > r.amin(dim=1, keepdim=True)  # (B, 1)
    return torch.where(spread, r - r.mean(dim=1, keepdim=True), 0.0).view(-1)  # (N,)


def nonzero_groups(adv: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool: False for every sample of a group whose advantages are all exactly zero (all right or all
    wrong): it adds nothing to the policy gradient, so the trainer skips its forward and backward."""
    keep = adv.view(-1, group_size).ne(0).any(dim=1, keepdim=True)  # (B, 1)
    return keep.expand(-1, group_size).reshape(-1)  # (N,)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights min(pi_old / pi_rollout, cap). (N, C) -> (N, C), no grad.

    The engine samples in bf16 with its own kernels: the tokens come from pi_rollout, not from pi_old.
    Weighting each token's policy-gradient term by pi_old / pi_rollout makes the estimate on-policy again
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"); the cap bounds
    the variance of tokens the engine found unlikely, at the price of a small bias."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def _check_inputs(logp, old_logp, adv, mask, ref_logp, is_weight, max_new_tokens: int, beta: float) -> None:
    """dr_grpo_loss's inputs as its docstring gives them: a wrong shape would broadcast into a wrong loss."""
    N, C = logp.shape
    for name, t in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp), ("is_weight", is_weight)):
        if t is not None and (t.shape != (N, C) or t.dtype != torch.float32):
            raise ValueError(f"{name} must be fp32 of shape {(N, C)}, got {t.dtype} {tuple(t.shape)}")
    for name, t, shape in (("adv", adv, (N,)), ("mask", mask, (N, C))):
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if max_new_tokens < C:
        raise ValueError(f"max_new_tokens={max_new_tokens} is smaller than the completion length C={C}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (the reference policy's log-probs)")


def dr_grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                 eps_low: float, eps_high: float | None = None, ref_logp: torch.Tensor | None = None,
                 beta: float = 0.0, max_new_tokens: int, num_sequences: int | None = None,
                 is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss with the Dr. GRPO constant normaliser.

    logp, old_logp, ref_logp: (N, C) fp32 log-probs of the sampled tokens under the current policy (with
      grad), the policy that sampled them, and the frozen reference. adv: (N,). mask: (N, C).
    eps_low / eps_high: clip range [1 - eps_low, 1 + eps_high]; eps_high None = eps_low (DAPO's clip-higher).
    beta: weight of the per-token k3 KL exp(ref - logp) - (ref - logp) - 1; 0: none. As a value it is an
      unbiased, >= 0 estimate of KL(pi || ref); as a loss on tokens sampled from pi its expected gradient is
      that of KL(ref || pi) (as in GRPO, which uses it the same way).
    max_new_tokens L: the loss is sum(token losses * mask) / (num_sequences * L). num_sequences: default N;
      a call that sees part of the batch (a micro-batch, or rows dropped by nonzero_groups) passes the full
      batch's, so that the parts sum to the full-batch loss and gradient.
    is_weight: (N, C) weight of each token's policy-gradient term, not of the KL (truncated_is_weights).

    Returns (loss, stats), stats 0-d detached tensors: clip_frac (masked tokens where the clip is active on
    the side the sign of A makes binding: zero gradient), kl (mean k3 KL when ref_logp is given, else 0)."""
    _check_inputs(logp, old_logp, adv, mask, ref_logp, is_weight, max_new_tokens, beta)
    eps_high = eps_low if eps_high is None else eps_high
    num_sequences = len(logp) if num_sequences is None else num_sequences

    mask = mask.to(logp.dtype)
    A = adv.to(logp.dtype)[:, None]  # (N, 1)
    ratio = torch.exp(logp - old_logp)  # (N, C)
    unclipped = ratio * A  # (N, C)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * A  # (N, C)
    # Pessimistic bound: where clipping binds, min() picks the constant-in-logp branch -> zero gradient.
    per_token = -torch.minimum(unclipped, clipped)  # (N, C)
    if is_weight is not None:
        per_token = per_token * is_weight

    kl = None
    if ref_logp is not None:
        # With beta == 0 the KL is still reported as a metric, just kept out of the graph.
        with torch.set_grad_enabled(beta > 0 and torch.is_grad_enabled()):
            delta = ref_logp - logp  # (N, C)
            kl = torch.exp(delta) - delta - 1.0  # (N, C), >= 0
        if beta > 0:
            per_token = per_token + beta * kl

    loss = (per_token * mask).sum() / (num_sequences * max_new_tokens)

    with torch.no_grad():
        clip_active = ((ratio > 1.0 + eps_high) & (A > 0)) | ((ratio < 1.0 - eps_low) & (A < 0))
        stats = {"clip_frac": _masked_mean(clip_active.to(mask.dtype), mask),
                 "kl": _masked_mean(kl.detach(), mask) if kl is not None else logp.new_zeros(())}
    return loss, stats
