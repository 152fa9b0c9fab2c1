"""The numbers each training step reports (metrics.py lists them), computed over all ranks; here, so that the
step in trainer.py reads as the algorithm.

Shape legend: R rows of this rank, N = R*W rows of all W ranks, n trained rows of this rank, C completion length.
"""

from __future__ import annotations

import torch

from minigrpo.rl.distributed import Dist
from minigrpo.run.metrics import PhaseTimer


def rollout_metrics(completions: list[list[int]], stopped: list[bool], rewards: torch.Tensor, correct: list[bool],
                    informative: torch.Tensor, trained: torch.Tensor, dist: Dist) -> dict:
    """Rollout statistics over all N rows: each rank's R rows, gathered in rank (= global row) order.
    stopped (R,): whether each completion ended at a stop; rewards, informative (R,): this rank's; trained
    (N,): already gathered."""
    stats = dist.gather(torch.tensor([[len(c), ok, not s] for c, ok, s in zip(completions, correct, stopped)],
                                     dtype=torch.int64))                                                # (N, 3)
    all_rewards, lens, N = dist.gather(rewards), stats[:, 0], len(trained)
    return {"reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std(0).item(),
            "accuracy": int(stats[:, 1].sum()) / N,
            "zero_spread_frac": 1.0 - dist.gather(informative).float().mean().item(),
            "completion_len_mean": int(lens.sum()) / N, "completion_len_max": int(lens.max()),
            "completion_tokens": int(lens.sum()), "truncated_frac": int(stats[:, 2].sum()) / N,
            "trained_rows": int(trained.sum())}


class UpdateSums:
    """The update's metrics: summed on the device over micro-batches (no host sync), over ranks at the end."""

    def __init__(self, device):
        self.sums = torch.zeros(4, device=device)  # loss, clipped tokens, KL x tokens, tokens
        self.norms: list[torch.Tensor | None] = []  # each optimizer step's pre-clip gradient norm; None: skipped
        self.gap = torch.zeros(3, device=device)   # |old log-prob gap| summed, its tokens, its max

    def add(self, loss: torch.Tensor, stats: dict, tokens: torch.Tensor) -> None:
        """One micro-batch's loss and dr_grpo_loss stats, over `tokens` trained tokens."""
        self.sums += torch.stack([loss.detach(), stats["clip_frac"] * tokens, stats["kl"] * tokens, tokens])

    def add_old_gap(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """A training forward before the update's first optimizer step against the old log-probs scored for the
        same rows (m, C') each: the same weights, so a gap is the scoring pass's and the training forward's
        numerics (bf16 kernels at other batch shapes), which the first ratios carry as noise."""
        diff = (logp.detach() - old_logp).abs() * mask                                  # (m, C')
        self.gap[:2] += torch.stack([diff.sum(), mask.sum()])
        self.gap[2] = torch.maximum(self.gap[2], diff.max())

    def metrics(self, dist: Dist, with_kl: bool, with_old_gap: bool) -> dict:
        loss, clip, kl, tokens = dist.all_reduce(self.sums)
        tokens = tokens.clamp(min=1)
        norms = [n for n in self.norms if n is not None]
        out = {"loss": (loss / max(1, len(self.norms))).item(), "clip_frac": (clip / tokens).item(),
               "grad_norm": torch.stack(norms).mean().item() if norms else None, "optimizer_steps": len(norms)}
        if len(norms) < len(self.norms):
            out["nonfinite_grad_steps"] = len(self.norms) - len(norms)
        if with_kl:
            out["kl"] = (kl / tokens).item()
        if with_old_gap:  # every rank reduces (a rank may have trained no row before the first step)
            gap_sum, gap_tokens = dist.all_reduce(self.gap[:2]).tolist()
            out.update(old_logp_gap_mean=gap_sum / max(gap_tokens, 1),
                       old_logp_gap_max=dist.all_reduce(self.gap[2:], "max").item())
        return out


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                     cap: float, dist: Dist) -> dict:
    """The policy before the update (pi_old) against the sampler (pi_rollout) on the trained tokens, (n, C)
    each, over all ranks: mean and max |log-prob difference|, k3 KL(pi_rollout || pi_old) (r - 1 - log r with
    r = pi_old / pi_rollout: unbiased and >= 0 under the rollout's samples), the TIS weight's mean (capped: as
    applied with --tis, what it would be without), the uncapped ratio's max and the fraction of tokens capped;
    and the entropy."""
    log_r = (old_logp - rollout_logp).detach() * mask                                # (n, C)
    ratio = torch.exp(log_r)                                                         # (n, C); 1 off the mask
    sums = dist.all_reduce(torch.stack([mask.sum(), (entropy * mask).sum(), log_r.abs().sum(),
                                        ((ratio - 1 - log_r) * mask).sum(), (ratio.clamp(max=cap) * mask).sum(),
                                        ((ratio > cap) * mask).sum()]))
    ent, diff, kl, weight, capped = (sums[1:] / sums[0].clamp(min=1)).tolist()   # per trained token
    maxima = dist.all_reduce(torch.stack([log_r.abs().max(), (ratio * mask).max()]), "max").tolist()
    return {"entropy": ent, "logp_diff_mean": diff, "logp_diff_max": maxima[0], "mismatch_kl": kl,
            "tis_weight_mean": weight, "tis_ratio_max": maxima[1], "tis_capped_frac": capped}


def speed_and_memory(timer: PhaseTimer, step: dict, device: torch.device, compiled: bool) -> dict:
    """Seconds per phase and spent compiling, completion tokens per second, the step's peak memory (before and
    during the update), and, for a compiled policy, the process's compiled graphs so far."""
    tokens = step["completion_tokens"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    m = {**{f"time_{k}": v for k, v in timer.times.items()}, "time_step": timer.total,
         "rollout_tokens_per_s": tokens / max(timer.times["rollout"], 1e-9),
         "tokens_per_s": tokens / max(timer.total, 1e-9), "compile_s": timer.compiling,
         "peak_mem_gib": max(peak, step.get("peak_mem_before_update_gib", 0.0))}
    if compiled:
        m["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return m
