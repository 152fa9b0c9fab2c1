"""Triton kernels (paged decode attention with the new token's rope + store, the sampler) against PyTorch.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, exact for fp32/fp16) at
tiny shapes; with one, the same tests run on CUDA and the `gpu` tests add bf16 accuracy at the real
model's shapes, torch.compile / CUDA-graph capture, and a check that compiling never copies the KV pool.
Every buffer the kernels allocate is NaN-filled first (see `nan_filled_empty`), and every pool byte that
holds no valid token is NaN (see `make_paged_kv`), so an unwritten output or a stray read shows up.
"""

import os

import torch

# Triton reads TRITON_INTERPRET once, at its first import (torch._dynamo imports it), so set it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from test_attention import make_paged_kv  # noqa: E402

import minigrpo.kernels.decode_attention as kda  # noqa: E402
from minigrpo.engine.attention import cached_attention, decode_attention, rope_store  # noqa: E402
from minigrpo.model.qwen2 import rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# False when something imported triton before the flag above was set (e.g. `pytest other_test.py
# tests/test_kernels.py`): the kernels cannot run on the CPU in this process, so the file reruns itself.
RUNS_HERE = DEVICE == "cuda" or kda.INTERPRETED


@pytest.fixture(autouse=True)
def _needs_runnable_kernels(request):
    if not RUNS_HERE and request.node.name != "test_rerun_in_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by test_rerun_in_fresh_process")


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests ran in this process")
def test_rerun_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@contextlib.contextmanager
def nan_filled_empty():
    """Inside, torch.empty returns NaN (ints: max int): an output element a kernel never writes stays NaN."""
    import torch.utils.deterministic as det
    was_on, was_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on)
        det.fill_uninitialized_memory = was_fill


def new_token_case(lens, S, Hq, Hkv, D, dtype=torch.float32, seed=0, device=DEVICE):
    """A paged cache (`make_paged_kv`) whose sequences' last positions hold NaN, plus the new token's q, k, v
    (before RoPE) and the rope tables: a kernel that reads the new token from the cache returns NaN.
    Returns a dict of `decode_attention`'s tensor arguments."""
    k_pool, v_pool, bt, sl, _, _ = make_paged_kv(lens, S, Hkv, D, dtype=dtype, seed=seed, device=device)
    for b, n in enumerate(lens):
        if n:
            k_pool[bt[b, (n - 1) // S], (n - 1) % S] = v_pool[bt[b, (n - 1) // S], (n - 1) % S] = float("nan")
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(len(lens), h, D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    tables = rope_cos_sin(torch.arange(max(lens + [1])), D, 10000.0, torch.float32)         # (T, D) each, fp32
    pos = (torch.tensor(lens) - 1).clamp(min=0)
    cos, sin = (t[pos].to(device, dtype) for t in tables)                  # (B, D) this step's rotation rows
    return dict(q=q, k=k, v=v, k_pool=k_pool, v_pool=v_pool, block_table=bt, seq_lens=sl, cos=cos, sin=sin)


def rope_tolerance(dtype):
    """Exact under the interpreter. Compiled for the H200, 16% of fp16 rotations differed by one ulp of a
    product (up to 0.0039 at |x*c| in [2, 4)), as if x*c - y*s had become one FMA that skips one product's
    rounding (as fp32 showed earlier); a cancelling difference makes that large relative to the result.
    So on a GPU: two ulps of the largest product (inputs are N(0, 1), |x| < 8, ulp <= 4 eps)."""
    if DEVICE != "cuda":
        return dict(atol=0, rtol=0, equal_nan=True)
    return dict(atol=2 * 4 * torch.finfo(dtype).eps, rtol=0, equal_nan=True)


def check_against_eager(case, scale, num_splits=0, launch=None, tol=1e-5):
    """The kernel (or `launch`, a launcher with the op's arguments) against the eager backend on a copy of the
    pools: the same output, and the same pools, new rows included, every other byte untouched."""
    ref_case = {**case, "k_pool": case["k_pool"].clone(), "v_pool": case["v_pool"].clone()}
    ref = decode_attention("eager", **ref_case, scale=scale)
    with nan_filled_empty():
        if launch is None:
            out = torch.ops.minigrpo.paged_decode_attention(**case, scale=scale, num_splits=num_splits)
        else:
            out = launch(**case, scale=scale)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert out.isfinite().all()
    assert (out[case["seq_lens"] == 0] == 0).all()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for pool in ("k_pool", "v_pool"):
        torch.testing.assert_close(case[pool], ref_case[pool], **rope_tolerance(case["q"].dtype))


# ----------------------------------------------------------------------------------------------------
# Paged decode attention, with the new token's RoPE and cache store
# ----------------------------------------------------------------------------------------------------

GEOMETRIES = {  # lengths (0 = padded slot), page size, q heads, kv heads, head dim
    "qwen-gqa7": ([0, 1, 15, 16, 17, 100], 16, 14, 2, 64),
    "gqa8-page8": ([3, 200, 64], 8, 8, 1, 64),
    "mha-d128-page64": ([130, 0, 257], 64, 4, 4, 128),
    "page256": ([300, 5], 256, 14, 2, 64),          # pages larger than one 64-token block
}


@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["unsplit", "split3", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_decode_matches_eager(geometry, dtype, num_splits):
    lens, S, Hq, Hkv, D = geometry
    case = new_token_case(lens, S, Hq, Hkv, D, dtype=dtype, seed=len(lens))
    check_against_eager(case, D ** -0.5, num_splits, tol=1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_sequence_filling_its_whole_table(num_splits):
    lens, S = [48, 33], 16
    case = new_token_case(lens, S, 14, 2, 64, seed=7)
    case["block_table"] = case["block_table"][:, :math.ceil(max(lens) / S)].contiguous()  # 48 uses every column
    check_against_eager(case, 0.125, num_splits)


@pytest.mark.parametrize("block_n, page_size", [(16, 64), (128, 16)])
def test_decode_other_block_sizes(block_n, page_size):
    # The sweep's other tiles: 16 tokens take several steps per page, 128 span 8 pages per step. Two splits
    # give each sequence multi-step, partial-last-block and single-block splits.
    case = new_token_case([0, 5, 130, 300], page_size, 14, 2, 64, seed=11)
    check_against_eager(case, 0.125, launch=lambda scale, **a: kda.launch_paged_decode(
        **a, scale=scale, num_splits=2, block_n=block_n))


def test_decode_strided_qkv():
    # q, k, v as views into one fused qkv projection output: rows are not contiguous.
    case = new_token_case([20, 9, 0], 8, 14, 2, 64, seed=9)
    qkv = torch.cat([case["q"], case["k"], case["v"]], dim=1)            # (3, 18, 64)
    case.update(q=qkv[:, :14], k=qkv[:, 14:16], v=qkv[:, 16:])           # stride(0) = 18 * 64
    check_against_eager(case, 0.125, num_splits=2)


def test_num_splits_from_static_shapes():
    # want = cdiv(3 programs/SM * 132 SMs, batch * kv_heads); cap = max_tokens // 128; at most 32.
    assert kda.choose_num_splits(256, 2, 2048, 132) == 1       # 512 programs already: 3.9 per SM
    assert kda.choose_num_splits(64, 2, 512, 132) == 4         # 128 programs: 4 splits reach 3 per SM
    assert kda.choose_num_splits(64, 2, 256, 132) == 2         # capped by 256 // 128
    assert kda.choose_num_splits(16, 2, 4096, 132) == 13
    assert kda.choose_num_splits(1, 2, 64, 132) == 1           # too short to split
    assert kda.choose_num_splits(1, 1, 1 << 20, 132) == 32     # never more than MAX_SPLITS
    assert kda.choose_num_splits(1024, 2, 4096, 132) == 1


def test_decode_rejects_bad_geometry():
    case = new_token_case([4], 8, 4, 2, 48)                              # head_dim 48: not a power of 2
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        torch.ops.minigrpo.paged_decode_attention(**case, scale=1.0)
    case = new_token_case([4], 8, 4, 2, 64)
    with pytest.raises(ValueError, match="num_splits must be 0"):
        torch.ops.minigrpo.paged_decode_attention(**case, scale=1.0, num_splits=-2)


# ----------------------------------------------------------------------------------------------------
# torch.compile: the registered op traces with no graph break
# ----------------------------------------------------------------------------------------------------

def test_triton_backend_compiles_fullgraph():
    # CPU: Dynamo only (backend="eager"; the interpreter cannot run on fake tensors). CUDA: full Inductor.
    backend = "inductor" if DEVICE == "cuda" else "eager"
    case = new_token_case([5, 0, 40], 16, 14, 2, 64, seed=11)
    ref_case = {**case, "k_pool": case["k_pool"].clone(), "v_pool": case["v_pool"].clone()}

    def step(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin):
        return decode_attention("triton", q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, 0.125) * 2

    explain = torch._dynamo.explain(step)(**{**case, "k_pool": case["k_pool"].clone(),
                                             "v_pool": case["v_pool"].clone()})
    assert explain.graph_break_count == 0, explain.break_reasons
    ref = step(**ref_case)
    out = torch.compile(step, fullgraph=True, backend=backend)(**case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case["k_pool"], ref_case["k_pool"], **rope_tolerance(torch.float32))


# ----------------------------------------------------------------------------------------------------
# GPU only: real shapes in bf16, CUDA graphs, no pool copies under Inductor
# ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [(14, 2, 64), (28, 4, 128)], ids=["qwen0.5b-d64", "qwen7b-d128"])
def test_bf16_accuracy_at_model_shapes(heads, page_size):
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(page_size + D)
    lens = torch.randint(1, 2048, (24,), generator=g).tolist() + [0, 1, 2047]
    case = new_token_case(lens, page_size, Hq, Hkv, D, seed=D, device="cuda")
    bf = {name: t.bfloat16() if t.is_floating_point() else t for name, t in case.items()}
    # fp32 math on the same bf16 inputs, q rotated in bf16 as both backends rotate it: the error measured is
    # the attention's own. The new rows the kernel stores must equal the eager backend's.
    for num_splits in (0, 1):
        pools = {"k_pool": bf["k_pool"].clone(), "v_pool": bf["v_pool"].clone()}
        out = torch.ops.minigrpo.paged_decode_attention(**{**bf, **pools}, scale=D ** -0.5,
                                                        num_splits=num_splits).float()
        ref_pools = {"k_pool": bf["k_pool"].clone(), "v_pool": bf["v_pool"].clone()}
        decode_attention("eager", **{**bf, **ref_pools}, scale=D ** -0.5)
        torch.testing.assert_close(pools["k_pool"], ref_pools["k_pool"], **rope_tolerance(torch.bfloat16))
        torch.testing.assert_close(pools["v_pool"], ref_pools["v_pool"], atol=0, rtol=0, equal_nan=True)
        q_rot = rope_store(bf["q"], bf["k"], bf["v"], *(p.clone() for p in ref_pools.values()),
                           torch.full_like(bf["seq_lens"], -1), bf["cos"], bf["sin"])  # stores nothing
        ref = cached_attention("eager", q_rot.float(), ref_pools["k_pool"].float(), ref_pools["v_pool"].float(),
                               bf["block_table"], bf["seq_lens"], D ** -0.5)
        assert out.isfinite().all()
        rel = (out - ref).norm() / ref.norm()
        assert rel <= 1e-2, f"relative error {rel:.2e} with num_splits={num_splits}"


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_lengths():
    case = new_token_case([700, 0, 33, 2000], 16, 14, 2, 64, dtype=torch.bfloat16, seed=13, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                                      # warm up (compiles the kernels)
        decode_attention("triton", **case, scale=0.125)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention("triton", **case, scale=0.125)
    case["seq_lens"].copy_(torch.tensor([1, 0, 17, 1500], dtype=torch.int32))  # shorter: pages still valid
    case["q"].normal_()
    ref_case = {**case, "k_pool": case["k_pool"].clone(), "v_pool": case["v_pool"].clone()}
    graph.replay()
    ref = decode_attention("eager", **ref_case, scale=0.125)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert (out[1] == 0).all()
    torch.testing.assert_close(case["k_pool"], ref_case["k_pool"], **rope_tolerance(torch.bfloat16))


@pytest.mark.gpu
def test_compiled_op_does_not_copy_the_pool():
    P, S, Hkv, D = 16384, 16, 2, 64                                      # 64 MiB per pool in bf16
    pool_bytes = P * S * Hkv * D * 2
    k_pool, v_pool = (torch.randn(P, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    B = 8
    bt = torch.randperm(P, device="cuda")[:B * 64].view(B, 64).int()
    sl = torch.full((B,), 1000, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, h, D, device="cuda", dtype=torch.bfloat16) for h in (14, Hkv, Hkv))
    cos, sin = (torch.randn(B, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    @torch.compile(fullgraph=True)
    def step(q, k, v, k_pool, v_pool):
        return decode_attention("triton", q, k, v, k_pool, v_pool, bt, sl, cos, sin, 0.125)

    step(q, k, v, k_pool, v_pool)                                        # compile
    new_rows = (bt[:, 999 // S] * S + 999 % S).long()                    # position seq_len - 1 = 999
    k_pool.view(-1, Hkv, D)[new_rows] = 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(q, k, v, k_pool, v_pool)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < pool_bytes // 4, f"compiled step allocated {extra / 2**20:.1f} MiB: a pool was copied"
    row = k_pool.view(-1, Hkv, D)[new_rows]                              # the rotated k landed in place
    assert not torch.equal(row, torch.zeros_like(row)) and row.isfinite().all()


# --- fused two-level sampler -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("B", [1, 6, 40])
def test_fused_sample_draws_what_the_reference_draws(dtype, temperature, B):
    from minigrpo.model.sampling import SAMPLE_CHUNK, SamplingParams, sample
    g = torch.Generator().manual_seed(7)
    V = 2 * SAMPLE_CHUNK + 1808                        # 3 chunks, the last one partial
    logits = (3 * torch.randn(B, V, generator=g)).to(dtype).to(DEVICE)
    logits[-1, V - 3] = 40.0                           # a sure winner in the last chunk's tail
    seeds = torch.arange(11, 11 + B, device=DEVICE) * 7919
    ctr = torch.randint(0, 1000, (B,), generator=g).to(DEVICE)
    tok, logp = torch.ops.minigrpo.fused_sample(logits, seeds, ctr, temperature, SAMPLE_CHUNK)
    ref_tok, ref_logp = sample(logits, SamplingParams(temperature=temperature), seeds, ctr)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    assert tok[-1] == V - 3
    if B == 40:
        assert len(set((tok[:-1] // SAMPLE_CHUNK).tolist())) == 3  # every chunk gets drawn


def test_fused_sample_rejects_bad_input():
    logits = torch.randn(2, 10, device=DEVICE)
    seeds = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="temperature > 0"):
        torch.ops.minigrpo.fused_sample(logits, seeds, seeds, 0.0, 4096)
    with pytest.raises(ValueError, match="seeds and counters must be int64"):
        torch.ops.minigrpo.fused_sample(logits, seeds.int(), seeds, 1.0, 4096)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        torch.ops.minigrpo.fused_sample(logits, seeds, seeds, 1.0, 1000)


class _NoLaunch:
    """Stands in for wrap_triton: kernel[grid](...) launches nothing."""

    def __init__(self, kernel):
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_ops_add_no_guard_on_a_symbolic_batch(monkeypatch):
    # The engine compiles its decode step once for every batch bucket, and on CUDA Inductor traces into these ops'
    # Python with the batch symbolic: a Python branch on it there adds a guard (a recompile per bucket). Here that
    # Python runs on fake tensors, launches stubbed. A split count left to the op (0) is picked from B: it guards.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    import minigrpo.kernels.sample as ks
    for module in (kda, ks):
        monkeypatch.setattr(module, "wrap_triton", _NoLaunch)
        monkeypatch.setattr(module, "check_runnable", lambda device: None)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def fake(*shape, dtype=torch.bfloat16, batch=True):  # dim 0 symbolic (one symbol for all) if batch
        dims = [DimDynamic.DUCK if batch and i == 0 else DimDynamic.STATIC for i in range(len(shape))]
        return mode.from_tensor(torch.empty(shape, dtype=dtype), symbolic_context=StatelessSymbolicContext(dims))

    B, Hq, Hkv, D, S, M, V = 64, 14, 2, 64, 16, 32, 151_936  # Qwen2.5-0.5B's heads and vocabulary
    q, k, v = fake(B, Hq, D), fake(B, Hkv, D), fake(B, Hkv, D)
    k_pool, v_pool = fake(65, S, Hkv, D, batch=False), fake(65, S, Hkv, D, batch=False)
    cos, sin = fake(B, D), fake(B, D)
    lens = fake(B, dtype=torch.int32)
    seeds, ctr = fake(B, dtype=torch.int64), fake(B, dtype=torch.int64)
    table, logits = fake(B, M, dtype=torch.int32), fake(B, V)
    splits = kda.choose_num_splits(B, Hkv, M * S, 132)  # what the engine passes: its largest bucket's count
    with mode:
        assert isinstance(q.shape[0], torch.SymInt)
        kda.paged_decode_attention._init_fn(q, k, v, k_pool, v_pool, table, lens, cos, sin, 0.125, splits)
        ks.fused_sample._init_fn(logits, seeds, ctr, 0.9, 4096)
        assert env.guards == []
        kda.paged_decode_attention._init_fn(q, k, v, k_pool, v_pool, table, lens, cos, sin, 0.125, 0)
        assert env.guards
