"""Prompt + completion rows, and the policy's log-probs of their completion tokens.

A batch keeps its rows as token lists; each forward packs its rows (model/packing.py): one sequence in which
rows with the same prompt share one copy of it. Completion token j of row i is scored by the
hidden state before it, its prompt's last token for j = 0 and its own token j - 1 after (`scored`); only real
completion tokens go through the LM head. Results come back as (n, C) per row, 0 past each completion.

Shape legend: n rows, C completion length (padded, max over rows), T packed tokens, D hidden size, M completion
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minigrpo.model.packing import Packed, pack
from minigrpo.model.qwen2 import Qwen2ForCausalLM
from minigrpo.model.transfer import to_device
from minigrpo.rl.logprobs import token_logprobs


@dataclass
class SequenceBatch:
    prompts: list[list[int]]      # per row; every prompt holds a token
    completions: list[list[int]]  # per row, each cut after its first stop
    mask: torch.Tensor            # (n, C) fp32 loss mask: the completion tokens
    pad_id: int                   # fills a packing up to an aligned length

    @property
    def C(self) -> int:
        return self.mask.shape[1]

    @property
    def completion_lens(self) -> list[int]:
        return [len(c) for c in self.completions]

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, device) -> SequenceBatch:
        """Rows of prompt i + completion i. Each completion ends at its first stop (Stops.cut), so the loss mask
        is its length: the stop token trains (the policy learns to emit it). Every prompt holds a token (the
        rollout backends check it): its last one scores the first completion token."""
        lens = [len(c) for c in completions]
        mask = torch.arange(max(1, max(lens)))[None, :] < torch.tensor(lens)[:, None]   # (n, C)
        return cls(list(prompts), list(completions), to_device(mask.float(), device), pad_id)

    def select(self, rows: list[int]) -> SequenceBatch:
        """The given rows, their mask trimmed to the longest of their completions."""
        return SequenceBatch.build([self.prompts[r] for r in rows], [self.completions[r] for r in rows],
                                   pad_id=self.pad_id, device=self.mask.device)

    def pack(self) -> Packed:
        return pack(self.prompts, self.completions, pad_id=self.pad_id, device=self.mask.device)

    def scored(self, packed: Packed) -> torch.Tensor:
        """(4, M) long: for every completion token, row-major, its row i, its index j in the completion, the packed
        index of the hidden state that scores it (its prompt's last token for j = 0, else its own token j - 1), and
        its own packed index (the target). Built on the host, one copy."""
        lens = torch.tensor(self.completion_lens)                                        # (n,)
        rows = torch.repeat_interleave(torch.arange(len(lens)), lens)                    # (M,)
        j = torch.arange(len(rows)) - (lens.cumsum(0) - lens)[rows]                      # (M,)
        token = torch.tensor(packed.starts, dtype=torch.long)[rows] + j                  # (M,)
        col = torch.where(j == 0, torch.tensor(packed.prompt_ends, dtype=torch.long)[rows], token - 1)
        return to_device(torch.stack([rows, j, col, token]), self.mask.device)


def pad_rows(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Ragged per-token values -> (n, width) fp32, zero-padded on the right."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out.to(device)


def completion_logprobs(model: Qwen2ForCausalLM, batch: SequenceBatch, *, temperature: float,
                        chunk_size: int = 1024, amp_dtype: torch.dtype | None = None,
                        return_entropy: bool = False, recompute_layers: int = 0):
    """log p(completion token | prefix) under softmax(logits / temperature): (n, C) fp32 (fp64 for an fp64
    model) [, entropy (n, C)], 0 past each row's completion. With amp_dtype (bf16 on CUDA) the decoder runs under
    autocast and the LM head is cast to amp_dtype by hand: autocast would not cover token_logprobs' hand-written
    backward, which would then recompute the softmax in another precision. recompute_layers: activation
    checkpointing of the first N decoder layers."""
    packed = batch.pack()
    with torch.autocast(packed.ids.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        hidden = model.hidden_states(packed.ids, recompute_layers=recompute_layers, packed=packed)[0]  # (T, D)
    rows, j, col, token = batch.scored(packed)                                             # (M,) each
    dtype = amp_dtype or model.lm_head.weight.dtype
    h, targets = hidden[col].to(dtype), packed.ids[0, token]                               # (M, D), (M,)
    out = token_logprobs(h[None], model.lm_head.weight.to(dtype), targets[None], temperature=temperature,
                         chunk_size=chunk_size, return_entropy=return_entropy)
    logp = out[0] if return_entropy else out                                               # (1, M) fp32 (fp64)
    zeros = logp.new_zeros((len(batch.prompts), batch.C))                                  # (n, C): 0 off the tokens
    if return_entropy:
        return zeros.index_put((rows, j), logp[0]), zeros.index_put((rows, j), out[1][0])
    return zeros.index_put((rows, j), logp[0])
