"""Memory-safe per-token log-probs (and entropy) through the LM head.

RL needs log p(token) for every sampled token: log_softmax(hidden @ W^T) gathered at the targets. Naively
that materialises (N, T, V) fp32 logits: with Qwen's V = 151936, 64 sequences x 400 tokens is 15.5 GB, plus
as much again for the softmax and the gradient. Only one number per token is needed, so we stream over
chunks of tokens and never hold more than (chunk_size, V) logits at a time.

The custom autograd.Function's backward *recomputes* each chunk's logits from the closed form
d log_softmax(z)_y / dz = onehot(y) - softmax(z), needing one (chunk, V) fp32 buffer; torch.utils.checkpoint
would replay the chunk's forward graph and hold the logits, the softmax and their grads together. It walks
(token chunk x vocabulary slice) blocks, slices outermost, so each weight-gradient slice is summed in fp32
while small and written once: no (V, D) fp32 accumulator beside the result.

Each block's softmax arithmetic is a small function that torch.compile fuses into one kernel on CUDA, which
reads the matmul's bf16 output once; eager, those ops move each block through memory five or six times.
The matmuls stay cuBLAS, in the input dtype (bf16 on GPU); softmax and gradient sums are fp32.

Shape legend: N sequences, T positions, D model width, V vocabulary, M = N*T flattened tokens.
"""

from __future__ import annotations

import functools

import torch

VOCAB_SLICE = 8192  # vocabulary rows per backward block (see backward)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / accumulation dtype: fp32, or fp64 for fp64 inputs (lets gradcheck run in double)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(raw: torch.Tensor, targets: torch.Tensor, temperature: float):
    """A chunk's logsumexp, target log-prob and entropy, (m,) each, from its logits raw (m, V) in the matmul's
    dtype. The entropy is computed also where unwanted: one pass more over the block in the same kernel, where
    a second compiled variant would cost ~4 s once."""
    z = raw.to(_acc_dtype(raw.dtype)) / temperature                                  # (m, V)
    lse = torch.logsumexp(z, dim=-1)                                                 # (m,)
    z = z - lse[:, None]                                                             # (m, V) log-softmax
    logp = z.gather(-1, targets[:, None]).squeeze(-1)                                # (m,)
    # -sum p log p on log-probs directly: "lse - sum p z" cancels badly for peaked distributions
    return lse, logp, -(z.exp() * z).sum(-1)


def _chunk_grad(raw: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, temperature: float):
    """d (g . logp) / d raw for one block, in raw's dtype: (onehot(target) - softmax) x g / temperature.
    raw (m, v) holds the block's vocabulary columns; targets are offset into them (out of range: no one-hot)."""
    p = torch.exp(raw.to(lse.dtype) / temperature - lse[:, None])                     # (m, v) softmax
    onehot = torch.arange(raw.shape[1], device=raw.device) == targets[:, None]      # (m, v)
    return ((onehot * g[:, None] - p * g[:, None]) / temperature).to(raw.dtype)


_compiled = functools.cache(torch.compile)  # fn -> its compiled version, compiled once


def _fused(fn, raw: torch.Tensor, *args):
    """fn, compiled into one kernel on CUDA (eager elsewhere: the same arithmetic). The token count varies
    (the last chunk), and so does the vocabulary slice (the backward's last), so both dimensions of raw and
    the first of every other tensor are symbolic: one compile covers every block but one of a single token,
    which runs eager (Dynamo specialises a size of 1: it would compile anew)."""
    if not raw.is_cuda or len(raw) == 1:
        return fn(raw, *args)
    torch._dynamo.maybe_mark_dynamic(raw, 1)
    for t in (raw, *args):
        if isinstance(t, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return _compiled(fn)(raw, *args)


class _ChunkedLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, want_entropy):
        # hidden (M, D), weight (V, D), targets (M,) long
        M, acc = hidden.shape[0], _acc_dtype(hidden.dtype)
        logp = hidden.new_empty(M, dtype=acc)  # (M,)
        lse = hidden.new_empty(M, dtype=acc)  # (M,) saved: backward needs softmax = exp(z - lse)
        entropy = hidden.new_empty(M, dtype=acc) if want_entropy else None
        for s in range(0, M, chunk_size):
            e = min(s + chunk_size, M)
            out = _fused(_chunk_stats, hidden[s:e] @ weight.T, targets[s:e], temperature)
            lse[s:e], logp[s:e] = out[0], out[1]
            if want_entropy:
                entropy[s:e] = out[2]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if want_entropy:
            ctx.mark_non_differentiable(entropy)
            return logp, entropy
        return logp

    @staticmethod
    def backward(ctx, grad_logp, *_):
        hidden, weight, targets, lse = ctx.saved_tensors
        (M, D), V, acc = hidden.shape, weight.shape[0], lse.dtype
        g = grad_logp.to(acc)                                                            # (M,)
        vs = min(V, VOCAB_SLICE)  # blocks of (tokens x vocabulary slice), as large as the forward's chunks
        tc = max(1, ctx.chunk_size * V // vs)
        grad_h = torch.zeros((M, D), dtype=acc, device=hidden.device)                    # (M, D)
        grad_w = torch.empty_like(weight)                                                # (V, D)
        for v0 in range(0, V, vs):
            v1 = min(v0 + vs, V)
            w = weight[v0:v1]                                                            # (v, D)
            gw = torch.zeros((v1 - v0, D), dtype=acc, device=weight.device)              # (v, D)
            for s in range(0, M, tc):
                e = min(s + tc, M)
                h = hidden[s:e]                                                          # (m, D)
                dz = _fused(_chunk_grad, h @ w.T, lse[s:e], g[s:e], targets[s:e] - v0, ctx.temperature)  # (m, v)
                grad_h[s:e] += dz @ w                                                    # (m, D)
                gw += dz.T @ h                                                           # (v, D)
            grad_w[v0:v1] = gw
        # both gradients, also where one input needs none (never in training): autograd drops it
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float = 1.0, chunk_size: int = 1024, return_entropy: bool = False):
    """log softmax(hidden @ W^T / temperature)[targets] per token, without materialising (N, T, V) logits.

    hidden (N, T, D) final-norm hidden states; lm_head_weight (V, D), hidden's dtype; targets (N, T) in [0, V).
    Returns logp (N, T) fp32 (fp64 for fp64 inputs), and with return_entropy the tempered distribution's
    entropy (N, T), a metric without gradient. Values and gradients (w.r.t. hidden and the weight) equal the
    naive computation's up to fp32 rounding; chunk_size 0 is that naive computation, the benchmarks' baseline.
    Inputs are checked by torch's own ops (matmul: shapes, dtypes, devices); targets are not range-checked
    (a host sync): out-of-range ids fail inside gather."""
    N, T, D = hidden.shape
    if chunk_size == 0:
        logp_all = torch.log_softmax((hidden @ lm_head_weight.T).to(_acc_dtype(hidden.dtype)) / temperature, -1)
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)                       # (N, T)
        if return_entropy:
            return logp, -(logp_all.exp() * logp_all).sum(-1).detach()
        return logp
    out = _ChunkedLogProb.apply(hidden.reshape(N * T, D), lm_head_weight, targets.reshape(N * T), float(temperature),
                                chunk_size, return_entropy)
    return tuple(o.view(N, T) for o in out) if return_entropy else out.view(N, T)
