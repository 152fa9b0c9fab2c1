"""Peak GPU memory of the trainer's log-prob stage: chunked LM head + log-softmax vs full logits.

    python bench/logprobs_memory.py [--rows 64 --tokens 400 --chunk 1024]

Forward and backward of sum(log p(target)) over hidden states (rows, tokens, 896) bf16 through Qwen's
tied LM head (151936 x 896): the part of the update the chunking exists for. Peak is measured above what
is resident before the call (hidden states, weights), after a warm-up. Values and gradients of the two
are compared too. JSON to $OUT/logprobs_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from minigrpo.rl.logprobs import token_logprobs


def naive(hidden, weight, targets):
    logits = (hidden @ weight.T).float()                                         # (N, T, V) fp32
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)    # (N, T)


def measure(fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp = fn(hidden, weight, targets)
    logp.sum().backward()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - resident) / 2**30
    return logp.detach(), hidden.grad.clone(), weight.grad.clone(), peak_gib


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--chunk", type=int, default=1024)
    args = p.parse_args()
    if min(args.rows, args.tokens, args.chunk) < 1:
        p.error("--rows, --tokens and --chunk must be >= 1")
    if not torch.cuda.is_available():
        p.error("no CUDA device: this benchmark measures GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    V, D = 151936, 896
    hidden = torch.randn(args.rows, args.tokens, D, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(V, D, device="cuda", generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (args.rows, args.tokens), device="cuda", generator=g)
    chunked = lambda h, w, t: token_logprobs(h, w, t, chunk_size=args.chunk)  # noqa: E731
    res = {}
    for name, fn in (("chunked", chunked), ("full_logits", naive)):
        measure(fn, hidden, weight, targets)  # warm-up
        res[name] = measure(fn, hidden, weight, targets)
    (lc, hc, wc, mc), (lf, hf, wf, mf) = res["chunked"], res["full_logits"]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    out = dict(rows=args.rows, tokens=args.tokens, chunk=args.chunk, peak_gb_chunked=mc, peak_gb_full=mf,
               ratio=mf / mc, logp_rel_diff=rel(lc, lf), grad_hidden_rel_diff=rel(hc, hf),
               grad_weight_rel_diff=rel(wc, wf))
    print(json.dumps(out))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "logprobs_memory.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
