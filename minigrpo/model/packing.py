"""Rows that share a prompt, packed: the layout of the training forward (Qwen2ForCausalLM.hidden_states).

GRPO trains G completions of every prompt. As right-padded rows, one per completion, a micro-batch runs each
prompt through the model G times, and every row as long as its longest. Packed, it is one sequence of its
distinct prompts and its completions, each token once (and 1-8 pad tokens at most). Nearly all FLOPs (the linear
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

from dataclasses import dataclass
from typing import NamedTuple

import torch


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
    ids, positions, rows, slots = [], [], [], []   # rows: each row's packed indices; slots: (row, column) per token
    first, ends, starts = {}, [], []               # first: prompt -> start of its one copy

    def add(tokens: list[int], position: int) -> list[int]:
        at = list(range(len(ids), len(ids) + len(tokens)))
        slots.extend((len(rows), position + t) for t in range(len(tokens)))
        ids.extend(tokens)
        positions.extend(range(position, position + len(tokens)))
        return at

    for p, c in zip(prompts, completions):
        if tuple(p) not in first:
            first[tuple(p)] = add(p, 0)
        prompt_at = first[tuple(p)]
        ends.append(prompt_at[-1])
        starts.append(len(ids))
        rows.append(prompt_at + add(c, len(p)))
    if len(ids) % 8 or len(rows) == 1:
        rows.append(add([pad_id] * (-len(ids) % 8 or 8), 0))
    tokens, flat = _rows(rows, slots, len(ids))
    as_row = lambda x: torch.tensor(x, dtype=torch.long)[None].to(device)  # noqa: E731
    return Packed(as_row(ids), as_row(positions), Rows(tokens.to(device), flat.to(device)), ends, starts)


def _rows(rows: list[list[int]], slots: list[tuple[int, int]], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, L) packed indices of the rows, right-padded with indices spread over the T tokens, and (T,) the flat
    slot of each token."""
    L = _aligned(max(map(len, rows)))
    tokens = (torch.arange(len(rows) * L) % T).view(len(rows), L)
    for r, row in enumerate(rows):
        tokens[r, :len(row)] = torch.tensor(row, dtype=torch.long)
    flat = torch.tensor([r * L + t for r, t in slots], dtype=torch.long)
    return tokens, flat


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
