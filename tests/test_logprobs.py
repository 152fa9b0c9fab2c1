"""Chunked log-probs: equal to the naive full-logits computation in value and gradient, smaller in memory."""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minigrpo.rl import logprobs
from minigrpo.rl.logprobs import VOCAB_SLICE, _chunk_grad, _chunk_stats, _compiled, token_logprobs

N, T, D, V = 3, 5, 8, 50


def _naive(hidden, weight, targets, temperature=1.0):
    logits = (hidden @ weight.T).float() / temperature  # (N, T, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _inputs(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, D, generator=g, dtype=dtype) * 2
    weight = torch.randn(V, D, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (N, T), generator=g)
    return hidden, weight, targets


def _values_and_grads(fn, hidden, weight, targets, upstream):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp = fn(h, w, targets)
    (logp * upstream).sum().backward()  # non-uniform upstream grad exercises the per-token scaling
    return logp.detach(), h.grad, w.grad


# N*T = 15 tokens: 1 and 4 and 7 do not divide 15, 15 is exact, 1024 is a single chunk, 0 full logits
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1024, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_values_and_grads(chunk_size, temperature):
    hidden, weight, targets = _inputs(seed=chunk_size)
    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(1))
    ours = _values_and_grads(
        lambda h, w, t: token_logprobs(h, w, t, temperature=temperature, chunk_size=chunk_size),
        hidden, weight, targets, upstream,
    )
    ref = _values_and_grads(lambda h, w, t: _naive(h, w, t, temperature)[0], hidden, weight, targets, upstream)
    assert ours[0].dtype == torch.float32 and ours[0].shape == (N, T)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gradcheck_double():
    # Small shapes: gradcheck perturbs every input element (2 forwards each).
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    fn = lambda h, w: token_logprobs(h, w, targets, temperature=0.8, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_temperature_changes_result():
    hidden, weight, targets = _inputs(seed=0)
    cold = token_logprobs(hidden, weight, targets, temperature=0.5)
    assert not torch.allclose(token_logprobs(hidden, weight, targets), cold)


def test_entropy_matches_naive_and_has_no_grad():
    hidden, weight, targets = _inputs(seed=5)
    hidden.requires_grad_(True)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=4, return_entropy=True)
    ref_logp, ref_entropy = _naive(hidden.detach(), weight, targets, 0.9)
    torch.testing.assert_close(logp.detach(), ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    assert logp.requires_grad and not entropy.requires_grad
    assert entropy.dtype == torch.float32 and entropy.shape == (N, T)


def test_with_the_weight_frozen_the_hidden_gradient_is_still_exact():
    # The backward computes both gradients; autograd drops the weight's (weight.grad stays None).
    hidden, weight, targets = _inputs(seed=6)
    hidden.requires_grad_(True)
    token_logprobs(hidden, weight, targets, chunk_size=4).sum().backward()
    ref = hidden.detach().clone().requires_grad_(True)
    _naive(ref, weight, targets)[0].sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref.grad)


def test_bf16_inputs_close_to_naive():
    # Mixed precision path: bf16 matmuls, fp32 softmax, fp32 accumulation of the weight grad.
    hidden, weight, targets = _inputs(seed=7, dtype=torch.bfloat16)
    upstream = torch.ones(N, T)
    ours = _values_and_grads(lambda h, w, t: token_logprobs(h, w, t, chunk_size=4), hidden, weight, targets, upstream)
    ref = _values_and_grads(lambda h, w, t: _naive(h, w, t)[0], hidden, weight, targets, upstream)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == torch.bfloat16
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=2e-2)


def test_bad_inputs():  # torch's matmul rejects them
    hidden, weight, targets = _inputs(seed=0)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        token_logprobs(hidden, weight[:, :4], targets)
    with pytest.raises(RuntimeError, match="same dtype"):
        token_logprobs(hidden.double(), weight, targets)


class _LargestAlloc(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward both dispatch through here)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_bytes = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())
        return out


def _largest_alloc(fn, hidden, weight, targets):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with _LargestAlloc() as probe:
        fn(h, w, targets).sum().backward()
    return probe


def test_peak_tensor_is_one_chunk_of_logits():
    # 512 tokens x V 4096: full logits would be 2M elements; chunks of 32 tokens are 131k.
    g = torch.Generator().manual_seed(0)
    n, t, d, v, chunk = 4, 128, 16, 4096, 32
    hidden, weight = torch.randn(n, t, d, generator=g), torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n, t), generator=g)
    naive = _largest_alloc(lambda h, w, y: _naive(h, w, y)[0], hidden, weight, targets)
    ours = _largest_alloc(lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk), hidden, weight, targets)
    assert naive.largest >= n * t * v  # the probe sees the full logits when they exist...
    assert "eq" in ours.ops  # ...and it also sees our backward (the one-hot is made there)...
    assert ours.largest == max(chunk * v, v * d, n * t * d)  # ...where nothing exceeds one chunk (or the weight)


def test_vocab_sliced_backward_matches_naive_and_holds_no_fp32_weight_gradient():
    # V above VOCAB_SLICE: the backward runs over four vocabulary slices (and several token chunks).
    g = torch.Generator().manual_seed(0)
    n, t, d, v, chunk = 2, 32, 64, 3 * VOCAB_SLICE + 100, 16
    hidden, weight = torch.randn(n, t, d, generator=g), torch.randn(v, d, generator=g) / 8
    targets = torch.randint(0, v, (n, t), generator=g)
    targets[0, :4] = torch.tensor([0, VOCAB_SLICE - 1, VOCAB_SLICE, v - 1])  # both sides of a slice edge
    upstream = torch.randn(n, t, generator=g)
    ours = _values_and_grads(lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk, temperature=0.7),
                             hidden, weight, targets, upstream)
    ref = _values_and_grads(lambda h, w, y: _naive(h, w, y, temperature=0.7)[0], hidden, weight, targets, upstream)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # bf16: no (V, D) fp32 accumulator beside the bf16 gradient (0.55 GB at Qwen2.5-0.5B's shape)
    probe = _largest_alloc(lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk),
                           hidden.bfloat16(), weight.bfloat16(), targets)
    assert "eq" in probe.ops and probe.largest_bytes <= v * d * 2


@pytest.mark.slow
def test_compiled_chunk_kernels_equal_the_eager_ones():
    # On CUDA each chunk's softmax arithmetic runs compiled (one kernel, no fp32 logits in memory). Compiling
    # reorders the fp32 reductions over V: ~sqrt(V) x 6e-8 relative, far inside 1e-5.
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(37, 5000, generator=g) * 3).bfloat16()                   # an uneven chunk of bf16 logits
    targets = torch.randint(0, 5000, (37,), generator=g)
    eager, compiled = _chunk_stats(raw, targets, 0.7), _compiled(_chunk_stats)(raw, targets, 0.7)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    lse, gl = eager[0], torch.randn(37, generator=g)
    block, offset = raw[:, 1000:3000], targets - 1000                           # a vocabulary slice
    want, got = _chunk_grad(block, lse, gl, offset, 0.7), _compiled(_chunk_grad)(block, lse, gl, offset, 0.7)
    assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max() <= 2**-8 * want.float().abs().max()


def test_a_one_token_chunk_is_not_compiled(monkeypatch):
    # Dynamo specialises a dimension of size 1, so a one-token chunk (M = k x chunk + 1 tokens, ~1 micro-batch
    # in chunk_size) sent to the compiled function would compile a graph of its own in the middle of a run.
    rows = []  # the row count of every compiled call
    monkeypatch.setattr(logprobs, "_compiled", lambda fn: lambda raw, *a: rows.append(len(raw)) or fn(raw, *a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # as on CUDA, where _fused compiles
    hidden, weight, targets = _inputs(seed=0)  # 15 tokens: chunks of 7, 7 and 1, forward and backward
    _values_and_grads(lambda h, w, y: token_logprobs(h, w, y, chunk_size=7), hidden, weight, targets, torch.ones(N, T))
    assert rows == [7, 7] * 2  # the values: test_matches_naive_values_and_grads (chunk_size 7)


def test_every_block_of_either_kernel_shares_one_graph(monkeypatch):
    # Chunks of 7 tokens (and an eager one of 1), vocabulary slices of 16, 16, 16 and 2, with and without the
    # entropy: Dynamo captures _chunk_stats once and _chunk_grad once. Without the symbolic slice width the
    # last slice recaptures (a ~4 s compile at Qwen's V, whose last slice is 4480 of 8192).
    monkeypatch.setattr(logprobs, "_compiled", functools.cache(lambda fn: torch.compile(fn, backend="eager")))
    monkeypatch.setattr(logprobs, "VOCAB_SLICE", 16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # as on CUDA, where _fused compiles
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    hidden, weight, targets = _inputs(seed=0)
    for entropy in (True, False):
        fn = lambda h, w, y: token_logprobs(h, w, y, chunk_size=7, return_entropy=entropy)[0] if entropy \
            else token_logprobs(h, w, y, chunk_size=7)
        _values_and_grads(fn, hidden, weight, targets, torch.ones(N, T))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    torch._dynamo.reset()
