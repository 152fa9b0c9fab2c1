"""Token sampling on the device: greedy, temperature, top-k, top-p, with no host synchronisation.

Randomness is counter-based: the noise for a sequence's n-th token is a hash of (its seed, n, an index),
so a sample does not depend on the rest of the batch or on where the sequence sits in it: a rollout is
reproducible from its seeds alone. The hash is integer tensor arithmetic, so it runs inside
torch.compile(fullgraph=True) and CUDA graphs, where a `torch.Generator` per sequence could not.

A draw from softmax(x), x = logits / T, takes two levels:
  1. A chunk of SAMPLE_CHUNK consecutive indices, by inverse CDF over the chunks' softmax masses w_c,
     with one uniform per row (the noise at index M31, which no vocabulary index reaches).
  2. A token in that chunk, by Gumbel-max with the noise at the token's vocabulary index.
P(i) = (w_c / sum w) * (p_i / w_c) = p_i: exact. Two levels keep the fused kernel's (kernels/sample.py)
pass over every logit a plain max / sum-of-exp reduction, bound by memory; the hash and logs run on one
chunk per row. The chunk level resolves masses down to about 2^-23 of the total. The chunk size is a
constant, so that a draw stays a function of the seeds alone.

Shape legend: B sequences, V vocabulary, C = min(SAMPLE_CHUNK, V) indices per chunk, NC = ceil(V / C) chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter

    def __post_init__(self):
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(f"sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0; got temperature "
                             f"{self.temperature}, top_p {self.top_p}, top_k {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)

M31 = 0x7FFFFFFF         # 2^31 - 1: the hash's mask, and the index of the chunk draw's uniform
SAMPLE_CHUNK = 4096      # indices per chunk of the two-level draw; a power of two, a Triton block


def mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors holding values in [0, 2^31) (lowbias32's shape, 31-bit constants).
    Products stay below 2^62 and literals fit int32, so eager, Inductor C++ and Triton all compute it exactly."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M31
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M31
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) noise, a pure function of (seed, counter, index), at int64 indices in [0, 2^31).
    seeds, counters (B,); idx (B, N) or (N,) -> (B, N) fp32."""
    key = mix31((mix31(seeds.long() & M31) + counters.long()) & M31)             # (B,)
    bits = mix31(mix31(key[:, None] ^ idx))                                         # (B, N)
    # The top 23 of 31 random bits k -> (k + 0.5) / 2^23, exact in fp32 and never 0 or 1, so the Gumbel
    # transform stays finite. (With 24 bits the largest value rounds to 1: Gumbel noise +inf, a sure win.)
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 23))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits / T with everything outside top-k / top-p set to -inf. (B, V) -> (B, V) fp32."""
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]                      # (B, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)                      # (B, V)
        probs = sorted_x.softmax(-1)
        # Drop a token once the mass of the tokens strictly before it reaches top_p: the most likely one stays.
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
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    x = filter_logits(logits, params)                                                 # (B, V)
    B, V = x.shape
    # A vocabulary smaller than a chunk is one chunk of its own size: the noise a padded chunk would add at
    # indices >= V could not win against their -inf logits, so the draw is the same, without hashing them.
    C = min(SAMPLE_CHUNK, V)
    NC = -(-V // C)
    chunks = F.pad(x, (0, NC * C - V), value=float("-inf")).view(B, NC, C)           # (B, NC, C)
    # Level 1: the chunk, by inverse CDF over the chunks' masses (a chunk of only -inf has mass 0).
    cum = chunks.logsumexp(-1).softmax(-1).cumsum(-1)                                 # (B, NC)
    u = uniform_noise(seeds, counters, torch.full((1,), M31, device=x.device))        # (B, 1)
    # The first chunk whose cum exceeds u * total. u <= 1 - 2^-24 keeps u * total below the total in fp32,
    # so there always is one, and it has mass; the clamp only keeps a row of NaN logits in range.
    c = torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp(max=NC - 1).squeeze(1)   # (B,)
    # Level 2: Gumbel-max within the chosen chunk, with the noise at each entry's vocabulary index.
    idx = c[:, None] * C + torch.arange(C, device=x.device)                           # (B, C)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, idx)))              # (B, C)
    scores = chunks[torch.arange(B, device=x.device), c] + gumbel                     # (B, C)
    tokens = c * C + scores.argmax(-1)                                                # (B,)
    return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - x.logsumexp(-1)
