"""Token sampling on the device: greedy, temperature, top-k, top-p, with no host synchronisation.

Randomness is counter-based: the noise for a sequence's n-th token is a hash of (that sequence's seed, n,
vocabulary index). So a sequence's samples do not depend on which other sequences share its batch, where
it sits in the batch, or whether the engine compacted the batch since the last step: a rollout is
reproducible from its seeds alone. The hash is plain integer tensor arithmetic, so it runs inside
torch.compile(fullgraph=True) and CUDA graphs, where a `torch.Generator` per sequence could not.

Sampling uses the Gumbel-max trick: argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T).

Shape legend: B sequences, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)

M31 = 0x7FFFFFFF


def mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors holding values in [0, 2^31) (lowbias32's shape, 31-bit constants).

    Every product stays below 2^62 and every literal fits in int32, so the arithmetic is exact and the
    same in eager PyTorch and in Inductor's C++ and Triton code, whatever index width Inductor picks
    (signed overflow would be undefined behaviour there, and Triton rejects wider literals in int32 math)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M31
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M31
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise, a pure function of (seed, counter, vocab index). (B,), (B,) -> (B, V) fp32."""
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)          # (V,)
    key = mix31((mix31(seeds.long() & M31) + counters.long()) & M31)             # (B,)
    bits = mix31(mix31(key[:, None] ^ idx))                                         # (B, V)
    # The top 24 of 31 random bits -> (0, 1), never exactly 0 or 1, so the Gumbel transform stays finite.
    return ((bits >> 7).float() + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits / T with everything outside top-k / top-p set to -inf. (B, V) -> (B, V) fp32."""
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]                      # (B, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)                      # (B, V)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p;
        # the most likely token is always kept.
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, counters: torch.Tensor):
    """Pick one token per row. Returns tokens (B,) int64 and their log-probs (B,) fp32 under the distribution
    actually sampled from (temperature, top-k and top-p applied; for greedy, under the plain softmax)."""
    if params.greedy:
        logp = logits.float().log_softmax(-1)                                         # (B, V)
        tokens = logp.argmax(-1)                                                      # (B,)
    else:
        logp = filter_logits(logits, params).log_softmax(-1)                          # (B, V)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, logits.shape[-1])))
        tokens = (logp + gumbel).argmax(-1)                                           # (B,)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
