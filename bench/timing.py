"""Timing helpers shared by the GPU benchmarks: CUDA-graph replay timing and the copy-bandwidth ceiling."""

from __future__ import annotations

import statistics

import torch

from minigrpo.engine.runner import capture_graph


def time_graph(fn, reps: int = 50, inner: int = 8, before=None) -> float:
    """Median ms of one call of fn, captured in a CUDA graph and replayed `inner` times back to back per
    timed sample: the way the engine's decode loop runs its steps (sync_every = 8), so neither the host's
    launch overhead nor the GPU's ramp after an idle sync counts. One replay per sample measured the
    whole decode step at 1.761 ms, where the loop's own timing gave 1.635 (H200, 256 sequences).
    before: called ahead of each sample, untimed, to reset state that the replays advance (positions,
    counters), so that no sample runs past the buffers it was set up for."""
    g = capture_graph(fn, warmup=3)
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def copy_bandwidth_tbs() -> float:
    """A 2 GiB streaming copy by an elementwise kernel: bytes read + written per second, in TB/s.

    An elementwise kernel rather than `copy_`: a same-dtype copy_ becomes a cudaMemcpy, which inside a
    CUDA graph measured only ~2.8 TB/s on the H200, below what kernels reach. Kernels are what we compare."""
    x = torch.randn(1 << 29, device="cuda")  # 2 GiB of fp32
    y = torch.empty_like(x)
    tbs = 2 * x.numel() * 4 / (time_graph(lambda: torch.neg(x, out=y), reps=20, inner=2) * 1e-3) / 1e12
    del x, y
    torch.cuda.empty_cache()
    return tbs
