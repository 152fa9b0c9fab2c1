"""Data-parallel plumbing for `torchrun --nproc-per-node N train.py ...`: process group, sharding, reductions.

A data-parallel run is a re-partitioning of the single-process step:
  - every rank derives the full prompt order and rollout seeds and takes its contiguous block of B/W prompts:
    groups never span ranks, and the ranks' rollouts together are the single-process rollout.
  - the update goes through DDP (`--parallel ddp`: state replicated) or FSDP2 (`--parallel fsdp`: sharded),
    which average gradients over ranks; each rank scales its loss by W, so the gradient is the single-process
    one. Every rank runs the same forwards and backwards, padding with zero-weight stand-in rows.
  - checkpoints hold the full state, written by rank 0: they resume in either mode, any world size dividing B.
`Dist()` (world 1) is the single process: every helper is the identity and torch.distributed is untouched.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where collectives run: NCCL only moves CUDA tensors, gloo CPU ones

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items, what: str = "items"):
        """This rank's contiguous block of `items`, a list or range whose length W divides."""
        if len(items) % self.world:
            raise ValueError(f"cannot split the {len(items)} {what} evenly over {self.world} ranks: "
                             f"use a multiple of {self.world}, or --nproc-per-node dividing {len(items)}")
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's equal-shaped tensor along dim 0, in rank order. (n, ...) -> (W*n, ...)"""
        if self.world == 1:
            return t
        x = t.to(self.device).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        tdist.all_gather(parts, x)
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every rank's `t` reduced elementwise by `op` ("sum", "max" or "min"), on every rank."""
        if self.world == 1:
            return t
        x = t.to(self.device, copy=True)
        tdist.all_reduce(x, op=getattr(tdist.ReduceOp, op.upper()))
        return x.to(t.device)

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()


def init_from_env(device: str) -> tuple[Dist, str]:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA), if its environment is set. Returns (dist, device):
    on CUDA each rank takes the GPU of its LOCAL_RANK. Without torchrun: Dist() and the device unchanged."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        if torch.cuda.device_count() <= local_rank:
            raise RuntimeError(f"rank {rank} needs GPU {local_rank} but only {torch.cuda.device_count()} are "
                               f"visible; use --nproc-per-node <= the GPU count")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    tdist.init_process_group("nccl" if on_cuda else "gloo", rank=rank, world_size=world,
                             device_id=torch.device(device) if on_cuda else None,
                             timeout=timedelta(minutes=30))  # rank 0 writes checkpoints alone: others wait
    return Dist(rank, world, device if on_cuda else "cpu"), device


def shutdown(dist: Dist, together: bool = False) -> None:
    """Leave the process group. together=True (all ranks finished cleanly) first waits for every rank, so none
    tears down under a finishing peer (a gloo rank can abort then); after an error a barrier could hang."""
    if dist.world > 1 and tdist.is_initialized():
        if together:
            tdist.barrier()
        tdist.destroy_process_group()


class _Forward(torch.nn.Module):
    """`fn(model, batch)` as a module's forward, so that DDP / FSDP wrap the trainer's log-prob computation
    (model.hidden_states and the LM head, not model.forward)."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, batch, *args):
        return self.fn(self.model, batch, *args)


def _fully_shard(module: _Forward, **root) -> _Forward:
    """FSDP2 units: each decoder layer, and the root (embedding, final norm, LM head). Weights keep their dtype
    in the forward (autocast does the rest, as with DDP); gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in module.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(module, mp_policy=policy, **root)


def frozen_forward(model: torch.nn.Module, fn, dist: Dist, parallel: str) -> torch.nn.Module:
    """`fn(model, batch)` as a module for a model that is only scored (the KL reference): under FSDP sharded like
    the policy, resharding after each forward (no backward does it)."""
    module = _Forward(model, fn)
    return _fully_shard(module, reshard_after_forward=True) if parallel == "fsdp" and dist.world > 1 else module


class GradSync:
    """The policy's training forward, with gradient accumulation that reduces once per optimizer step.

    For each micro-batch, run `policy(batch)` and the backward of its loss (times `loss_scale`) inside
    `policy.accumulate(first, last)`: only the last backward all-reduces (DDP's no_sync for the others). FSDP
    reduce-scatters each micro-batch's fp32 gradient into the shards, except for bf16 weights, whose shards
    would sum in bf16: there it keeps the fp32 sum whole until the last one. With W = 1 nothing is reduced.

    bf16 weights sum three or more micro-batch gradients in fp32: in bf16 each addition would round to 8
    significant bits of the running sum, losing a micro-batch small against it. From the second micro-batch
    on, the first one's gradient moves into an fp32 sum and a hook moves each later one there as it lands; the
    last backward adds to that sum rounded to bf16. So the gradient is the exact sum up to two bf16 roundings.
    Two micro-batches need no fp32 sum: one bf16 addition rounds their exact sum once."""

    def __init__(self, model: torch.nn.Module, fn, dist: Dist, parallel: str = "ddp"):
        self.dist, self.sharded = dist, parallel == "fsdp" and dist.world > 1
        self.loss_scale = float(dist.world)  # W: DDP and FSDP average gradients over ranks, the loss sums rows
        self._bf16_weights = next(model.parameters()).dtype == torch.bfloat16
        module = _Forward(model, fn)
        if self.sharded:  # replaces the parameters by their shards (DTensors): build the optimizer after this
            self.module = _fully_shard(module)
        else:  # DDP broadcasts rank 0's weights here: the ranks start identical even if their inits differed
            self.module = DistributedDataParallel(module) if dist.world > 1 else module
        self._sums: dict[torch.nn.Parameter, torch.Tensor] = {}  # fp32 sums of this step's earlier micro-batches
        self._summing = False
        self._bf16 = [p for p in model.parameters()
                      if p.requires_grad and p.dtype == torch.bfloat16 and not self.sharded]
        for p in self._bf16:
            p.register_post_accumulate_grad_hook(self._add_to_fp32_sum)

    def _add_to_fp32_sum(self, p: torch.nn.Parameter) -> None:
        if self._summing:
            g = p.grad.float()
            self._sums[p] = self._sums[p].add_(g) if p in self._sums else g
            p.grad = None  # the next micro-batch's gradient lands alone, unrounded

    @contextlib.contextmanager
    def accumulate(self, first: bool, last: bool):
        if self.sharded:
            self.module.set_requires_gradient_sync(last or not self._bf16_weights)
            yield
            return
        self._summing = not first and not last
        if self._summing:  # a middle micro-batch: the first one's gradient moves into the fp32 sum
            for p in self._bf16:
                if p.grad is not None and p not in self._sums:
                    self._sums[p], p.grad = p.grad.float(), None
        while last and self._sums:  # the last backward adds to the sum so far, then all-reduces; each fp32
            p, total = self._sums.popitem()  # sum is freed as its bf16 gradient is made (peak 4, not 6 B/param)
            p.grad = total.to(p.dtype)
        try:
            with self.module.no_sync() if self.dist.world > 1 and not last else contextlib.nullcontext():
                yield
        finally:
            self._summing = False

    def __call__(self, batch, *args):
        return self.module(batch, *args)
