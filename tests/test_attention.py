"""Decode-attention backends (eager, sdpa), the PyTorch rope + cache store and their composition, on the CPU.

The eager backend is checked against a hand-computed case and against an independent per-sequence dense
computation on shuffled, NaN-poisoned page tables; sdpa is checked against eager. The Triton backend is
tested in test_kernels.py (this module only sets up the interpreter for it, see below).
"""

import os

import torch

# The CPU tests run the Triton kernels under its interpreter, which Triton reads once, at its first import
# (and torch._dynamo imports it). This module is collected before test_kernels.py, so it sets the flag too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from minigrpo.engine.attention import cached_attention, decode_attention, rope_store  # noqa: E402
from minigrpo.engine.config import BACKENDS, EngineConfig  # noqa: E402
from minigrpo.model.qwen2 import apply_rope, rope_cos_sin  # noqa: E402


def make_paged_kv(lens, page_size, kv_heads, head_dim, dtype=torch.float32, seed=0, device="cpu"):
    """A paged cache holding random K/V for sequences of the given lengths, plus the same K/V dense.

    Pages are shuffled (non-contiguous), every byte not holding a valid token is NaN (spare pages and the
    tail of each last page), and table entries past a sequence's length are -1 or point at NaN pages:
    a backend that reads anything it should not will return NaN.
    Returns k_pool, v_pool (P, S, Hkv, D), block_table (B, M) int32, seq_lens (B,) int32,
    dense_k, dense_v (B, Tmax, Hkv, D).
    """
    g = torch.Generator().manual_seed(seed)
    S, B = page_size, len(lens)
    need = [math.ceil(n / S) for n in lens]
    M = max(need + [1]) + 1                                     # one extra column of pure garbage
    P = sum(need) + 3                                           # a few spare (poisoned) pages
    order = torch.randperm(P, generator=g)
    t_max = max(M * S, 1)
    dense_k = torch.randn(B, t_max, kv_heads, head_dim, generator=g)
    dense_v = torch.randn(B, t_max, kv_heads, head_dim, generator=g)
    k_pool = torch.full((P, S, kv_heads, head_dim), float("nan"))
    v_pool = torch.full((P, S, kv_heads, head_dim), float("nan"))
    garbage = torch.randint(-1, P, (B, M), generator=g)
    block_table = torch.where(garbage < 0, -1, garbage)
    used = 0
    for b, (n, npg) in enumerate(zip(lens, need)):
        pages = order[used:used + npg]
        used += npg
        block_table[b, :npg] = pages
        for i, page in enumerate(pages.tolist()):
            take = min(S, n - i * S)
            k_pool[page, :take] = dense_k[b, i * S:i * S + take]
            v_pool[page, :take] = dense_v[b, i * S:i * S + take]
    to = dict(device=device)
    return (k_pool.to(dtype=dtype, **to), v_pool.to(dtype=dtype, **to), block_table.int().to(**to),
            torch.tensor(lens, dtype=torch.int32, device=device), dense_k.to(dtype).to(**to),
            dense_v.to(dtype).to(**to))


def dense_reference(q, dense_k, dense_v, lens, scale):
    """Per-sequence softmax attention in float64 on contiguous K/V: independent of any paging code."""
    B, Hq, D = q.shape
    n_rep = Hq // dense_k.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k = dense_k[b, :n].double().repeat_interleave(n_rep, dim=1)     # (n, Hq, D)
        v = dense_v[b, :n].double().repeat_interleave(n_rep, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
    return out


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match=r"attn must be one of \('eager', 'sdpa', 'triton'\), got 'flash'"):
        EngineConfig(attn="flash")


def test_eager_hand_computed():
    # One sequence, 1 KV head serving 2 query heads, D = 2, page size 2, 3 tokens in pages [1, 0].
    k_pool = torch.full((2, 2, 1, 2), float("nan"))
    v_pool = torch.full((2, 2, 1, 2), float("nan"))
    k_pool[1, :, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])     # tokens 0, 1
    k_pool[0, 0, 0] = torch.tensor([1.0, 1.0])                   # token 2 (page 0 slot 1 stays NaN)
    v_pool[1, :, 0] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    v_pool[0, 0, 0] = torch.tensor([8.0, 6.0])
    q = torch.tensor([[[math.log(2), 0.0], [0.0, 0.0]]])        # (1, 2, 2)
    out = cached_attention("eager", q, k_pool, v_pool, torch.tensor([[1, 0]], dtype=torch.int32),
                           torch.tensor([3], dtype=torch.int32), scale=1.0)
    # Head 0 scores (ln2, 0, ln2) -> weights (2, 1, 2) / 5 -> ((2 + 3 + 16) / 5, (4 + 4 + 12) / 5).
    # Head 1 scores all 0 -> uniform thirds -> ((1 + 3 + 8) / 3, (2 + 4 + 6) / 3).
    expected = torch.tensor([[[4.2, 4.0], [4.0, 4.0]]])
    torch.testing.assert_close(out, expected)


CASES = [  # (lengths, page_size, q_heads, kv_heads, head_dim)
    ([5, 0, 16, 33], 8, 14, 2, 64),       # GQA 7 as in Qwen2.5-0.5B, an empty slot, partial last pages
    ([1, 40], 16, 4, 4, 32),              # plain multi-head attention
    ([17, 3, 64], 32, 8, 2, 128),
]


@pytest.mark.parametrize("lens,S,Hq,Hkv,D", CASES)
def test_eager_matches_dense_reference(lens, S, Hq, Hkv, D):
    k_pool, v_pool, bt, sl, dk, dv = make_paged_kv(lens, S, Hkv, D, seed=1)
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(2))
    out = cached_attention("eager", q, k_pool, v_pool, bt, sl, D ** -0.5)
    torch.testing.assert_close(out.double(), dense_reference(q, dk, dv, lens, D ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,S,Hq,Hkv,D", CASES)
def test_sdpa_matches_eager(lens, S, Hq, Hkv, D, dtype):
    k_pool, v_pool, bt, sl, _, _ = make_paged_kv(lens, S, Hkv, D, dtype=dtype, seed=3)
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = cached_attention("eager", q, k_pool, v_pool, bt, sl, 0.3)
    out = cached_attention("sdpa", q, k_pool, v_pool, bt, sl, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert (out[torch.tensor(lens) == 0] == 0).all()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_backend_compiles_without_graph_breaks(backend):
    k_pool, v_pool, bt, sl, _, _ = make_paged_kv([3, 0, 20], 8, 2, 16, seed=5)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(6))

    def step(q, k_pool, v_pool, bt, sl):
        return cached_attention(backend, q, k_pool, v_pool, bt, sl, 0.25) * 2

    explain = torch._dynamo.explain(step)(q, k_pool, v_pool, bt, sl)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k_pool, v_pool, bt, sl), step(q, k_pool, v_pool, bt, sl))


@pytest.mark.parametrize("bad,match", [
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table must be int32"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens must be int32 \(batch=2,\)"),
    (dict(q=torch.zeros(2, 3, 8)), r"multiple of kv_heads \(2\)"),
    (dict(k_pool=torch.zeros(4, 8, 2, 8).transpose(0, 1)), "must both be"),
    (dict(k=torch.zeros(2, 1, 8)), r"k and v must be \(batch=2, kv_heads=2, head_dim=8\)"),
    (dict(v=torch.zeros(2, 2, 8, dtype=torch.float16)), "q, k and v must share a dtype"),
    (dict(cos=torch.zeros(2, 8, dtype=torch.float64)), r"cos and sin must be this step's rotation rows"),
    (dict(sin=torch.zeros(16, 8)), r"\(batch=2, head_dim=8\) in q's dtype"),
])
def test_contract_errors_are_specific(bad, match):
    args = dict(q=torch.zeros(2, 4, 8), k=torch.zeros(2, 2, 8), v=torch.zeros(2, 2, 8), k_pool=torch.zeros(4, 8, 2, 8),
                v_pool=torch.zeros(4, 8, 2, 8), block_table=torch.zeros(2, 3, dtype=torch.int32),
                seq_lens=torch.zeros(2, dtype=torch.int32), cos=torch.zeros(2, 8), sin=torch.zeros(2, 8))
    args.update(bad)
    for backend in BACKENDS:
        with pytest.raises((ValueError, TypeError), match=match):
            decode_attention(backend, scale=1.0, **args)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_new_token_is_rotated_stored_and_attended(backend):
    # seq_lens counts the new token: it lands at position seq_len - 1 of its pages; seq_len 0 stores nothing.
    lens, S, Hq, Hkv, D = [5, 0, 16, 33], 8, 14, 2, 16
    k_pool, v_pool, bt, sl, dk, dv = make_paged_kv(lens, S, Hkv, D, seed=21)
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(len(lens), h, D, generator=g) for h in (Hq, Hkv, Hkv))
    cos, sin = (t[(sl - 1).clamp(min=0)] for t in rope_cos_sin(torch.arange(64), D, 10000.0, torch.float32))
    before = k_pool.clone()
    out = decode_attention(backend, q, k, v, k_pool, v_pool, bt, sl, cos, sin, D ** -0.5)
    changed = ((k_pool != before) & ~before.isnan()) | (before.isnan() & ~k_pool.isnan())
    assert changed.any(-1).any(-1).sum() == 3                   # exactly the three live sequences' new rows
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all()
            continue
        c, s = cos[b], sin[b]
        page, offset = bt[b, (n - 1) // S], (n - 1) % S
        torch.testing.assert_close(k_pool[page, offset], apply_rope(k[b], c, s), atol=0, rtol=0)
        torch.testing.assert_close(v_pool[page, offset], v[b], atol=0, rtol=0)
        dk[b, n - 1], dv[b, n - 1] = apply_rope(k[b], c, s), v[b]
    ref = dense_reference(apply_rope(q, cos[:, None], sin[:, None]), dk, dv, lens, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# rope + store
# ----------------------------------------------------------------------------------------------------

def make_rope_inputs(B=4, Hq=14, Hkv=2, D=16, P=5, S=4, dtype=torch.float32, seed=0, device="cpu"):
    """Fresh random q/k/v, NaN pools, slots with one skipped (-1) row, and each row's rotation: the HF-layout
    fp32 tables at random positions, cast to the dtype (as the model casts them)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    positions = torch.randint(0, 50, (B,), generator=g, dtype=torch.int32)
    slots = torch.randperm(P * S, generator=g)[:B].int()
    slots[1] = -1
    cos, sin = (t[positions].to(dtype) for t in rope_cos_sin(torch.arange(64), D, 10000.0, torch.float32))
    k_pool = torch.full((P, S, Hkv, D), float("nan"), dtype=dtype)
    ts = (q, k, v, k_pool, k_pool.clone(), slots, cos, sin)                          # cos, sin (B, D)
    return tuple(t.to(device) for t in ts)


def test_rope_store_rotates_and_stores():
    q, k, v, k_pool, v_pool, slots, cos, sin = make_rope_inputs()
    q_rot = rope_store(q, k, v, k_pool, v_pool, slots, cos, sin)
    c, s = cos[:, None], sin[:, None]                                                # (B, 1, D)
    torch.testing.assert_close(q_rot, apply_rope(q, c, s), atol=0, rtol=0)
    flat_k, flat_v = k_pool.view(-1, 2, 16), v_pool.view(-1, 2, 16)
    for b, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], apply_rope(k[b], c[b], s[b]), atol=0, rtol=0)
            torch.testing.assert_close(flat_v[slot], v[b], atol=0, rtol=0)
    written = slots[slots >= 0].long()
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()      # the -1 row stored nothing


def test_rope_matches_hand_computed_rotation():
    # D = 2: one pair, rotated by angle = position * theta^0 = position.
    x = torch.tensor([[[1.0, 0.0]]])
    cos, sin = rope_cos_sin(torch.arange(4), 2, 10000.0, torch.float32)
    pools = torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2)
    q_rot = rope_store(x, x, x, *pools, torch.tensor([2], dtype=torch.int32), cos[1:2], sin[1:2])  # position 1
    torch.testing.assert_close(q_rot, torch.tensor([[[math.cos(1.0), math.sin(1.0)]]]))
    torch.testing.assert_close(pools[0][0, 2, 0], torch.tensor([math.cos(1.0), math.sin(1.0)]))


def test_rope_store_all_rows_skipped_leaves_pools_alone():
    q, k, v, k_pool, v_pool, slots, cos, sin = make_rope_inputs(seed=1)
    k_pool.normal_(generator=torch.Generator().manual_seed(0))
    v_pool.copy_(k_pool)
    before = k_pool.clone()
    rope_store(q, k, v, k_pool, v_pool, torch.full_like(slots, -1), cos, sin)
    assert torch.equal(k_pool, before) and torch.equal(v_pool, before)


def test_rope_store_compiles_and_mutates_pools():
    q, k, v, k_pool, v_pool, slots, cos, sin = make_rope_inputs(seed=2)
    ref_pools = k_pool.clone(), v_pool.clone()
    ref_q = rope_store(q, k, v, *ref_pools, slots, cos, sin)
    step = torch.compile(rope_store, fullgraph=True, backend="aot_eager")
    out_q = step(q, k, v, k_pool, v_pool, slots, cos, sin)
    torch.testing.assert_close(out_q, ref_q, atol=0, rtol=0)
    torch.testing.assert_close(k_pool, ref_pools[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_pool, ref_pools[1], atol=0, rtol=0, equal_nan=True)
