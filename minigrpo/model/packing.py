"""Rows that share a prompt, packed: the layout of the training forward (Qwen2ForCausalLM.hidden_states).

GRPO trains G completions of every prompt. As right-padded rows, one per completion, a micro-batch runs each
prompt through the model G times, and every row as long as its longest. Packed, it is one sequence of its
distinct prompts and its completions, each token once and no padding. Nearly all of a step's FLOPs (the linear
layers) scale with those tokens: at 8 prompts x 8 samples on GSM8K, 29% fewer than padded rows (bench/NOTES.md).

Only attention sees the structure. It regroups the packed tokens into segments, one per distinct prompt and one
per completion, as the rows of one SDPA call:

    queries  the segment's own tokens                            (S, Lq)
    keys     [its prompt's tokens | its own tokens]               (S, Lk = Lp + Lq)

A prompt has no prompt part: it attends causally to itself. A completion attends to its whole prompt and
causally to itself, and its positions (RoPE) continue its prompt's: each computes what its row computes alone.
Padding slots (past a segment's tokens) see their own earlier slots, so no softmax row is empty; no real token
sees them, and `slots` reads back only real tokens' outputs.

Shape legend: T packed tokens, S segments, Lq the longest segment, Lp the longest prompt part (each rounded up
to a multiple of 16), Lk = Lp + Lq, n rows (one per completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Segments(NamedTuple):
    """What attention needs of a packing. Tensors only: it enters the compiled decoder layers."""
    queries: torch.Tensor   # (S, Lq) long: packed index of each segment's own tokens (any in padding slots)
    keys: torch.Tensor      # (S, Lk) long: packed index of its prompt's tokens, then of its own
    allowed: torch.Tensor   # (S, 1, Lq, Lk) bool: which key slot each query slot sees
    slots: torch.Tensor     # (T,) long: each packed token's flat slot s * Lq + i in (S, Lq)


@dataclass(frozen=True)
class Packed:
    ids: torch.Tensor        # (1, T) long
    positions: torch.Tensor  # (1, T) long: RoPE positions, a completion's continuing its prompt's
    segments: Segments
    prompt_ends: list[int]   # per row: packed index of its prompt's last token (it scores the first completion token)
    starts: list[int]        # per row: packed index of its first completion token


def _aligned(n: int, to: int = 8) -> int:
    """n rounded up to a multiple of `to`. The compiled decoder layer guards on sizes % 8 (Inductor's aligned loads):
    aligned sizes share one graph, where an odd one would compile a second (~9 s at 0.5B)."""
    return -(-n // to) * to


def pack(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, device) -> Packed:
    """Row i is prompts[i] + completions[i]; rows with equal prompts share one copy of it. Every prompt holds a
    token. Tokens of pad_id fill T up to a multiple of 8, as a segment of their own that no other sees."""
    ids, positions, own, prefix = [], [], [], []    # own, prefix: each segment's (start, length) in ids
    first, ends, starts = {}, [], []                # first: prompt -> start of its one copy

    def add(tokens: list[int], position: int, prompt_part: tuple[int, int]) -> None:
        own.append((len(ids), len(tokens)))
        prefix.append(prompt_part)
        ids.extend(tokens)
        positions.extend(range(position, position + len(tokens)))

    for p, c in zip(prompts, completions):
        if tuple(p) not in first:
            first[tuple(p)] = len(ids)
            add(p, 0, (0, 0))
        s = first[tuple(p)]
        ends.append(s + len(p) - 1)
        starts.append(len(ids))
        add(c, len(p), (s, len(p)))
    if len(ids) % 8:
        add([pad_id] * (-len(ids) % 8), 0, (0, 0))
    segments = _segments(own, prefix)
    as_row = lambda x: torch.tensor(x, dtype=torch.long)[None].to(device)  # noqa: E731
    return Packed(as_row(ids), as_row(positions), Segments(*(t.to(device) for t in segments)), ends, starts)


def _segments(own: list[tuple[int, int]], prefix: list[tuple[int, int]]) -> Segments:
    """The gather indices and the mask of segments with these (start, length) own tokens and prompt parts. Lq and Lp
    are multiples of 16: SDPA's mem-efficient kernel copies a mask whose rows are not into one that is, every call."""
    S, Lq, Lp = len(own), _aligned(max(n for _, n in own), 16), _aligned(max(n for _, n in prefix), 16)
    # Padding slots read tokens spread over the packing: their gradient is zero, but scattered into one row
    # the backward's atomic adds would queue on it.
    T = sum(n for _, n in own)
    queries = (torch.arange(S * Lq) % T).view(S, Lq)
    keys = (torch.arange(S * (Lp + Lq)) % T).view(S, Lp + Lq)
    slots = []
    for s, ((o, n), (p, m)) in enumerate(zip(own, prefix)):
        queries[s, :n] = keys[s, Lp:Lp + n] = torch.arange(o, o + n)
        keys[s, :m] = torch.arange(p, p + m)
        slots.append(torch.arange(s * Lq, s * Lq + n))
    i, j = torch.arange(Lq)[:, None], torch.arange(Lp + Lq)[None, :]                        # (Lq, 1), (1, Lk)
    prompt_len = torch.tensor([m for _, m in prefix])[:, None, None]                        # (S, 1, 1)
    allowed = (j < prompt_len) | ((j >= Lp) & (j - Lp <= i))                                # (S, Lq, Lk)
    return Segments(queries, keys, allowed[:, None], torch.cat(slots))


def attention_bias(segments: Segments, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """(S, 1, n_rep * Lq, Lk) additive mask for segment_attention's queries, which fold the n_rep query heads of a
    kv head into the query axis (head-major). Built once per forward: every layer's attention saves the same one."""
    bias = torch.zeros(segments.allowed.shape, dtype=dtype, device=segments.allowed.device)
    return bias.masked_fill(~segments.allowed, float("-inf")).repeat(1, 1, n_rep, 1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                      bias: torch.Tensor) -> torch.Tensor:
    """Attention of packed tokens within their segments. q (Hq, T, D), k and v (Hkv, T, D) -> (T, Hq * D).

    Grouped-query attention as one SDPA call over the kv heads: the n_rep query heads that share a kv head are
    stacked along the query axis, so k and v are gathered once per kv head, not repeated n_rep times (SDPA's
    enable_gqa with a mask would fall back to its math kernel, which materialises every score)."""
    (Hq, _, D), Hkv = q.shape, k.shape[0]
    S, Lq = segments.queries.shape
    qs = q[:, segments.queries].view(Hkv, Hq // Hkv, S, Lq, D)                               # (Hkv, r, S, Lq, D)
    qs = qs.permute(2, 0, 1, 3, 4).reshape(S, Hkv, Hq // Hkv * Lq, D)                        # (S, Hkv, r*Lq, D)
    ks, vs = (t[:, segments.keys].transpose(0, 1) for t in (k, v))                           # (S, Hkv, Lk, D)
    y = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)       # (S, Hkv, r*Lq, D)
    y = y.view(S, Hkv, Hq // Hkv, Lq, D).permute(0, 3, 1, 2, 4).reshape(S * Lq, Hq * D)     # (S*Lq, Hq*D)
    return y[segments.slots]                                                                # (T, Hq*D)
