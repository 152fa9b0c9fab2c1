"""Rows that share a prompt, packed: the layout of the training forward (Qwen2ForCausalLM.hidden_states).

GRPO trains G completions of every prompt. As right-padded rows, one per completion, a micro-batch runs each
prompt through the model G times, and every row as long as its longest. Packed, it is one sequence of its
distinct prompts and its completions, each token once (and at most 8 pad tokens). Nearly all FLOPs (the linear
layers) scale with those tokens: at 8 prompts x 8 samples on GSM8K, 29% fewer than padded rows (bench/NOTES.md).

Attention alone runs on rows: it gathers each row's q, k and v from the packed tokens (prompt, then completion;
right-padded to the longest row), runs causal SDPA on them (flash: no mask), and reads each token's output back
from one row that holds it. A prompt's queries are computed once per row there, a few percent of attention's
small share; their gradient flows from one row only, while its keys and values collect it from every row that
attends to them. Padding slots read tokens spread over the packing: no real token sees them, and their gradient,
zero, is not scattered onto one row.

Shape legend: T packed tokens, n rows (+ one for the alignment padding, if any), L the longest row rounded up to a
multiple of 8, D head dim.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minigrpo.model.transfer import to_device


class Rows(NamedTuple):
    """What attention needs of a packing. Tensors only: it enters the compiled decoder layers."""
    tokens: torch.Tensor  # (n, L) long: packed index of each row's tokens (spread over the packing in its padding)
    slots: torch.Tensor   # (T,) long: each packed token's flat slot r * L + t in one row that holds it


@dataclass(frozen=True)
class Packed:
    ids: torch.Tensor        # (1, T) long
    positions: torch.Tensor  # (1, T) long: RoPE positions, a completion's continuing its prompt's
    rows: Rows
    prompt_ends: list[int]   # per row: packed index of its prompt's last token (it scores the first completion token)
    starts: list[int]        # per row: packed index of its first completion token


def _aligned(n: int) -> int:
    """n rounded up to a multiple of 8. The compiled decoder layer guards on sizes % 8 (Inductor's aligned loads):
    aligned sizes share one graph, where an odd one would compile a second (~9 s at 0.5B)."""
    return -(-n // 8) * 8


def pack(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, device) -> Packed:
    """Row i is prompts[i] + completions[i]; rows with equal prompts share one copy of it. Every prompt holds a
    token. Tokens of pad_id fill T up to a multiple of 8, as a row of their own; a single row gets 8 of them, so
    that attention never sees one row (Dynamo would specialise that size: a graph more)."""
    if not all(prompts):
        raise ValueError("every prompt must hold a token: its last one scores the first completion token")
    n, ids, first = len(prompts), [], {}  # first: prompt -> packed index of its one copy
    rows = []  # per row: prompt length, completion length, their packed indices, whether it holds the prompt's copy
    for p, c in zip(prompts, completions):
        holds = tuple(p) not in first  # the prompt's first row
        if holds:
            first[tuple(p)] = len(ids)
            ids += p
        rows.append((len(p), len(c), first[tuple(p)], len(ids), holds))
        ids += c
    pad = -len(ids) % 8 or (8 if n == 1 else 0)
    if pad:  # a row with no prompt
        rows.append((0, pad, len(ids), len(ids), True))
        ids += [pad_id] * pad
    tokens, slots = _rows(torch.tensor(rows), T=len(ids))
    positions = slots % tokens.shape[1]                         # (T,): a token's column in its row
    ids = torch.frombuffer(array("q", ids), dtype=torch.long)   # (T,); 10x faster than torch.tensor(list)
    prompt_ends = [at + length - 1 for length, _, at, _, _ in rows[:n]]
    starts = [start for _, _, _, start, _ in rows[:n]]
    return Packed(to_device(ids[None], device), to_device(positions[None], device),
                  Rows(to_device(tokens, device), to_device(slots, device)), prompt_ends, starts)


def _rows(rows: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (n, 5) as pack() lists them -> the rows' packed indices (n, L), right-padded with indices spread over
    the T tokens, and each token's flat slot r * L + t (T,) in the one row that holds it: a prompt's first row, a
    completion's own."""
    prompt_len, completion_len, prompt_at, start, holds = rows.T[:, :, None]      # (n, 1) each
    n, L = len(rows), _aligned(int((prompt_len + completion_len).max()))
    col = torch.arange(L)                                                           # (L,)
    in_prompt, real = col < prompt_len, col < prompt_len + completion_len           # (n, L) each
    flat = torch.arange(n * L).view(n, L)                                           # r * L + t
    tokens = torch.where(real, torch.where(in_prompt, prompt_at + col, start + col - prompt_len), flat % T)
    held = real & (holds.bool() | ~in_prompt)                                       # each token in one row
    slots = torch.empty(T, dtype=torch.long)
    slots[tokens[held]] = flat[held]                                                # (T,)
    return tokens, slots


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Causal attention of packed tokens within their rows. q (Hq, T, D), k and v (Hkv, T, D) -> (T, Hq * D)."""
    n, L = rows.tokens.shape
    qr = q[:, rows.tokens].transpose(0, 1)                                                   # (n, Hq, L, D)
    # a shared prompt's k and v are read by all its rows: their gradients sum in fp32 (fp64 for fp64), as the
    # unpacked rows' sum in the weight-gradient matmul
    acc = torch.promote_types(k.dtype, torch.float32)
    kr, vr = (t.to(acc)[:, rows.tokens].to(t.dtype).transpose(0, 1) for t in (k, v))       # (n, Hkv, L, D)
    y = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).reshape(n * L, -1)[rows.slots]                                # (T, Hq*D)
