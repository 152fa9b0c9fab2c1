"""Prompt + completion sequences as one padded batch, and the policy's log-probs of the completion tokens.

Layout of a row: the prompt left-padded to P, then the completion right-padded to C, T = P + C:

    [pad pad p0 p1 p2 | c0 c1 c2 pad]      attn = [0 0 1 1 1 | 1 1 1 0]

Left-padding the prompts puts every completion at the same columns [P, T), so all rows are scored by one
slice. The model's positions count real tokens only, so a padded row computes exactly what it would alone.
The causal LM's output at t predicts token t+1: completion tokens ids[:, P:T] are scored by hidden[:, P-1:T-1].

Shape legend: n rows, P prompt length (padded), C completion length (padded), T = P + C, D hidden size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from minigrpo.grpo import completion_mask
from minigrpo.logprobs import shift_for_completion, token_logprobs
from minigrpo.model import Qwen2ForCausalLM


@dataclass
class SequenceBatch:
    ids: torch.Tensor         # (n, T) long: prompt left-padded to P, completion right-padded to C
    attn: torch.Tensor        # (n, T) long: 1 = real token
    mask: torch.Tensor        # (n, C) fp32 loss mask: completion tokens up to and including the first stop
    prompt_lens: list[int]
    completion_lens: list[int]

    @property
    def C(self) -> int:
        return self.mask.shape[1]

    @property
    def P(self) -> int:
        return self.ids.shape[1] - self.C

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], *, pad_id: int,
              stop_ids: tuple[int, ...], device) -> "SequenceBatch":
        if len(prompts) != len(completions) or not prompts:
            raise ValueError(f"need one completion per prompt and at least one row, got {len(prompts)} prompts "
                             f"and {len(completions)} completions")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt must hold at least one token (its last one scores the first "
                             "completion token)")
        P = max(len(p) for p in prompts)
        C = max(1, max(len(c) for c in completions))
        ids = torch.full((len(prompts), P + C), pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P + C), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, P - len(p):P + len(c)] = torch.tensor(p + c, dtype=torch.long)
            attn[i, P - len(p):P + len(c)] = 1
        lens = [len(c) for c in completions]
        # completion_mask stops after the first stop id; the length mask also drops the right padding, which
        # matters when the pad id is not a stop id and a row ended without one (truncated by a shorter budget).
        real = torch.arange(C)[None, :] < torch.tensor(lens)[:, None]                    # (n, C)
        mask = completion_mask(ids[:, P:], stop_ids) * real                              # (n, C)
        return cls(ids.to(device), attn.to(device), mask.to(device), [len(p) for p in prompts], lens)

    def select(self, rows: list[int]) -> "SequenceBatch":
        """The given rows, with columns that are padding in all of them trimmed off both ends."""
        P2 = max(self.prompt_lens[r] for r in rows)
        C2 = max(1, max(self.completion_lens[r] for r in rows))
        idx = torch.tensor(rows, device=self.ids.device)
        cols = slice(self.P - P2, self.P + C2)
        return SequenceBatch(self.ids[idx, cols], self.attn[idx, cols], self.mask[idx, :C2],
                             [self.prompt_lens[r] for r in rows], [self.completion_lens[r] for r in rows])


def pad_rows(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Ragged per-token values -> (n, width) fp32, zero-padded on the right."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out.to(device)


def completion_logprobs(model: Qwen2ForCausalLM, batch: SequenceBatch, *, temperature: float,
                        chunk_size: int = 1024, amp_dtype: torch.dtype | None = None,
                        return_entropy: bool = False, checkpoint_layers: bool = False):
    """log p(completion token | prefix) under softmax(logits / temperature): (n, C) fp32 [, entropy (n, C)].

    With amp_dtype (bf16 on CUDA) the decoder runs under autocast and the LM head in amp_dtype, cast
    explicitly outside autocast: autocast would cover only the hand-written forward of token_logprobs and
    not its backward, which would then recompute the softmax in another precision than the forward's.
    checkpoint_layers: activation checkpointing of the decoder layers (see `Qwen2ForCausalLM.hidden_states`).
    """
    amp = (torch.autocast(batch.ids.device.type, dtype=amp_dtype) if amp_dtype is not None
           else contextlib.nullcontext())
    with amp:
        hidden = model.hidden_states(batch.ids, batch.attn, checkpoint_layers=checkpoint_layers)  # (n, T, D)
    h, targets = shift_for_completion(hidden, batch.ids, batch.P)                          # (n, C, D), (n, C)
    weight = model.lm_head.weight                                                          # (V, D)
    if amp_dtype is not None:
        h, weight = h.to(amp_dtype), weight.to(amp_dtype)
    else:
        h = h.to(weight.dtype)
    return token_logprobs(h, weight, targets, temperature=temperature, chunk_size=chunk_size,
                          return_entropy=return_entropy)
