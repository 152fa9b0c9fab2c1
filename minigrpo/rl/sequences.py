"""Prompt + completion sequences as one padded batch, and the policy's log-probs of the completion tokens.

Layout of a row: prompt and completion back to back from column 0, padding only at the end:

    [p0 p1 p2 c0 c1 c2 pad pad]        prompt_len 3, completion_len 3, T = max over rows of the two summed

Right padding only: under a causal mask end padding never reaches a real token, so the training forward
needs no attention mask and no position bookkeeping (positions 0..T-1 in every row) and SDPA takes its plain
causal path. Completion token j of row i (column P_i + j) is scored by hidden[i, P_i - 1 + j] (`scored`);
only real completion tokens go through the LM head.

Shape legend: n rows, T columns, C completion length (padded, max over rows), D hidden size, M completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minigrpo.model.qwen2 import Qwen2ForCausalLM
from minigrpo.rl.logprobs import token_logprobs


@dataclass
class SequenceBatch:
    ids: torch.Tensor         # (n, T) long: prompt + completion from column 0, right-padded
    mask: torch.Tensor        # (n, C) fp32 loss mask: the completion tokens (each cut after its first stop)
    prompt_lens: list[int]
    completion_lens: list[int]

    @property
    def C(self) -> int:
        return self.mask.shape[1]

    @property
    def scored(self) -> torch.Tensor:
        """(3, M) long: for every completion token, row-major, its row i, its index j in the completion, and the
        column whose output scores it (P_i - 1 + j; the token sits one column later). Built on the host, one copy."""
        lens = torch.tensor(self.completion_lens)                                        # (n,)
        rows = torch.repeat_interleave(torch.arange(len(lens)), lens)                    # (M,)
        j = torch.arange(len(rows)) - (lens.cumsum(0) - lens)[rows]                      # (M,)
        return torch.stack([rows, j, torch.tensor(self.prompt_lens)[rows] - 1 + j]).to(self.ids.device)

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, device) -> SequenceBatch:
        """Rows of prompt i + completion i. Each completion ends at its first stop (Stops.cut), so the loss mask
        is its length: the stop token trains (the policy learns to emit it). Every prompt holds a token (the
        rollout backends check it): its last one scores the first completion token."""
        lens = [len(c) for c in completions]
        T = _aligned(max(len(p) + max(1, len(c)) for p, c in zip(prompts, completions)))
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        mask = torch.arange(max(1, max(lens)))[None, :] < torch.tensor(lens)[:, None]   # (n, C)
        return cls(ids.to(device), mask.float().to(device), [len(p) for p in prompts], lens)

    def select(self, rows: list[int], *, n_rows: int = 0) -> SequenceBatch:
        """The given rows without the columns that are padding in all of them, plus empty rows (mask 0) up to
        `n_rows`: padding never reaches a real token, and the zero mask keeps it out of every loss and metric."""
        C2 = max(1, max(self.completion_lens[r] for r in rows))
        T2 = _aligned(max(self.prompt_lens[r] + max(1, self.completion_lens[r]) for r in rows))
        extra = max(0, n_rows - len(rows))
        idx = torch.tensor(rows, device=self.ids.device)
        ids = torch.nn.functional.pad(self.ids[idx, :T2], (0, 0, 0, extra))             # (n + extra, T2)
        mask = torch.nn.functional.pad(self.mask[idx, :C2], (0, 0, 0, extra))            # (n + extra, C2)
        return SequenceBatch(ids, mask, [self.prompt_lens[r] for r in rows] + [1] * extra,
                             [self.completion_lens[r] for r in rows] + [0] * extra)


def _aligned(T: int) -> int:
    """T rounded up to a multiple of 8. The compiled decoder layer guards on T % 8 (Inductor's aligned loads):
    aligned widths share one graph, where an odd width would compile a second (~9 s at 0.5B)."""
    return -(-T // 8) * 8


def pad_rows(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Ragged per-token values -> (n, width) fp32, zero-padded on the right."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out.to(device)


def completion_logprobs(model: Qwen2ForCausalLM, batch: SequenceBatch, *, temperature: float,
                        chunk_size: int = 1024, amp_dtype: torch.dtype | None = None,
                        return_entropy: bool = False, recompute_layers: int = 0):
    """log p(completion token | prefix) under softmax(logits / temperature): (n, C) fp32 [, entropy (n, C)],
    0 past each row's completion. With amp_dtype (bf16 on CUDA) the decoder runs under autocast and the LM head
    is cast to amp_dtype by hand: autocast would not cover token_logprobs' hand-written backward, which would
    then recompute the softmax in another precision. recompute_layers: activation checkpointing of the first N
    decoder layers."""
    with torch.autocast(batch.ids.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        hidden = model.hidden_states(batch.ids, recompute_layers=recompute_layers)      # (n, T, D), no mask
    rows, j, col = batch.scored                                                            # (M,) each
    dtype = amp_dtype or model.lm_head.weight.dtype
    h, targets = hidden[rows, col].to(dtype), batch.ids[rows, col + 1]                     # (M, D), (M,)
    out = token_logprobs(h[None], model.lm_head.weight.to(dtype), targets[None], temperature=temperature,
                         chunk_size=chunk_size, return_entropy=return_entropy)
    zeros = hidden.new_zeros((len(batch.prompt_lens), batch.C), dtype=torch.float32)       # (n, C): 0 off the tokens
    if return_entropy:
        return zeros.index_put((rows, j), out[0][0]), zeros.index_put((rows, j), out[1][0])
    return zeros.index_put((rows, j), out[0])
