"""Reference generation: the simplest correct decoder, the yardstick for the fast rollout engine.

No KV cache: every step runs the full forward over the left-padded batch, so no cache, paging or graph
capture can hide a bug. The engine must reproduce its greedy tokens exactly (fp32, CPU), and with the
same `sample` and per-sequence seeds, its sampled ones too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from minigrpo.model.qwen2 import Qwen2ForCausalLM
from minigrpo.model.sampling import GREEDY, SamplingParams, sample


@dataclass
class Rollout:
    """What any generator returns: one completion per (prompt, sample), group-major (a prompt's samples adjacent)."""
    tokens: list[list[int]]      # completion ids, ending with the first stop (an id, or the engine's sequences)
    logprobs: list[list[float]]  # log-prob of each token under the distribution it was sampled from


def check_rollout_request(prompts: list[list[int]], samples_per_prompt: int, seeds: list[int] | None) -> None:
    """One-line errors for a request no rollout backend can serve: no prompt or an empty one (the last prompt
    token's logits give the first sample), or not one seed per completion."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    n = len(prompts) * samples_per_prompt
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"need one seed per completion ({n} = {len(prompts)} prompts x {samples_per_prompt} "
                         f"samples), got {len(seeds)}")


@torch.no_grad()
def generate(model: Qwen2ForCausalLM, prompts: list[list[int]], max_new_tokens: int, *, params: SamplingParams = GREEDY,
             stop_ids: tuple[int, ...] = (), pad_id: int = 0, seeds: list[int] | None = None) -> Rollout:
    """A completion of up to max_new_tokens per prompt; for G samples of a prompt, pass it G times, G seeds
    (default 0, 1, ..., B-1, as the engine's)."""
    device = next(model.parameters()).device
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left").to(device)  # (B, T)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left").to(device)
    if len({len(p) for p in prompts}) == 1:
        mask = None  # nothing is padded: the fused causal attention kernels apply (what transformers runs)
    B, T = ids.shape
    seeds_t = torch.tensor(seeds if seeds is not None else range(B), dtype=torch.long, device=device)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    out_logp = torch.empty((B, 0), dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logits = model(ids, attention_mask=mask)[:, -1]                               # (B, V)
        counters = torch.full((B,), step, dtype=torch.long, device=device)
        tok, logp = sample(logits, params, seeds_t, counters)                         # (B,)
        tok = torch.where(done, pad_id, tok)
        out_logp = torch.cat([out_logp, logp[:, None]], dim=1)
        done |= torch.isin(tok, stops)
        ids = torch.cat([ids, tok[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(tok)[:, None]], dim=1)
        if bool(done.all()):
            break
    tokens, logprobs = [], []
    for row, row_logp in zip(ids[:, T:].tolist(), out_logp.tolist()):
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        tokens.append(row[:cut])
        logprobs.append(row_logp[:cut])
    return Rollout(tokens, logprobs)
