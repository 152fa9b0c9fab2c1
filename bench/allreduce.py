"""All-reduce bandwidth between the GPUs of this host, at the size of the trainer's gradient.

    torchrun --standalone --nproc-per-node 2 bench/allreduce.py [--params N]

DDP all-reduces the whole gradient once per optimizer step: Qwen2.5-0.5B's 494M parameters are 0.99 GB in
bf16 (`--weights bf16`) and 1.98 GB in fp32. This times `dist.all_reduce` of one such buffer with CUDA
events, plus a sweep of bucket-sized messages (DDP reduces in 25 MB buckets), and prints the bus bandwidth
as nccl-tests defines it: size x 2 (W - 1) / W / time, the per-link rate, comparable across world sizes.
Rough yardsticks for 2 H200s: NVLink P2P a few hundred GB/s; through host memory (NCCL's SHM transport,
when P2P is unavailable, e.g. in a VM) ~10-20 GB/s; over sockets a few GB/s. Rank 0 prints one JSON line
per size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def time_all_reduce(x: torch.Tensor, reps: int) -> float:
    """Median seconds of one all-reduce of x (after two warm-up calls)."""
    for _ in range(2):
        dist.all_reduce(x)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dist.all_reduce(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=494e6, help="gradient elements (default: Qwen2.5-0.5B's)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W = dist.get_world_size()
    sizes = [(f"grad_{dt}", int(args.params), dt) for dt in ("bf16", "fp32")]
    sizes += [(f"{mb}MB_bf16", mb * 2**20 // 2, "bf16") for mb in (1, 25, 100)]
    for name, n, dt in sizes:
        x = torch.ones(n, dtype=torch.bfloat16 if dt == "bf16" else torch.float32, device="cuda")
        t = time_all_reduce(x, args.reps)
        gb = x.numel() * x.element_size() / 1e9
        if dist.get_rank() == 0:
            print(json.dumps({"what": name, "world": W, "GB": round(gb, 4), "ms": round(t * 1e3, 3),
                              "algbw_GBps": round(gb / t, 1), "busbw_GBps": round(gb / t * 2 * (W - 1) / W, 1)}),
                  flush=True)
        del x
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
