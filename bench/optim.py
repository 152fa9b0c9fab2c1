"""The bf16 optimizer step alone: StochasticAdamW at several chunk sizes against its byte floor, on the
parameter shapes of a Qwen2.5 config (random values; the step's cost does not depend on them).

    python bench/optim.py --config ../shared/data/qwen2.5-0.5b-instruct/config.json

Reports the median ms per step (CUDA events, after warm-up), the floor (14 bytes per parameter: w, g, m, v
read in bf16, w, m, v written, at the copy bandwidth measured in the same run), and torch's fused AdamW on
the same bf16 tensors (round-to-nearest, no noise: the same bytes, for scale). `per-tensor` is the step
as it was before small tensors were grouped: one compiled call per tensor chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import copy_bandwidth_tbs  # noqa: E402
from minigrpo.model.config import ModelConfig  # noqa: E402
from minigrpo.model.qwen2 import Qwen2ForCausalLM  # noqa: E402
from minigrpo.rl import optim  # noqa: E402


def params_like(config: ModelConfig) -> list[torch.nn.Parameter]:
    with torch.device("meta"):
        shapes = [p.shape for p in Qwen2ForCausalLM(config).parameters()]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def per_tensor_step(opt: optim.StochasticAdamW, seed: int) -> None:
    """The pre-grouping step: each tensor alone, in chunks of opt.chunk (same math and noise)."""
    chunks = optim._chunks
    optim._chunks = lambda quads, chunk: (c for q in quads for c in chunks([q], min(chunk, 4 * q[0].numel())))
    try:
        opt.step(seed)
    finally:
        optim._chunks = chunks


def time_ms(fn, reps: int = 10) -> float:
    for i in range(3):
        fn(i)
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    args = p.parse_args()
    ps = params_like(ModelConfig.from_json(args.config))
    n = sum(x.numel() for x in ps)
    floor = 14 * n / (copy_bandwidth_tbs() * 1e12) * 1e3
    res = {"params": n, "tensors": len(ps), "floor_ms": floor}
    for chunk in (1 << 22, 1 << 24, 1 << 26):
        opt = optim.StochasticAdamW(ps, lr=1e-6, chunk=chunk)
        if chunk == 1 << 22:
            res["per_tensor_ms"] = time_ms(lambda i: per_tensor_step(opt, i))
        res[f"grouped_{chunk >> 20}M_ms"] = time_ms(opt.step)
        del opt
    fused = torch.optim.AdamW(ps, lr=1e-6, fused=True)
    res["torch_fused_adamw_ms"] = time_ms(lambda i: fused.step())
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
    out = Path(os.environ.get("OUT", "."))
    (out / f"optim_{n // 10**8}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
