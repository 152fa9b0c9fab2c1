"""The KL reference's weights in host memory between steps (`--offload-reference`).

The frozen reference is read once per step, by the log-prob pass (trainer stage 4), yet on the GPU it is a
whole copy of the policy held through the update, where the step's memory peaks (15.2 GB at 7B in bf16).
Offloaded, its weights live in pinned host memory. Each step copies them back on a side stream while the
rollout runs (PCIe moves ~50 GB/s, so at 7B ~0.3 s, well inside the rollout) and frees them once scored, so
the update's peak lacks them.

The parameters stay the same tensor objects: only their storage is freed and re-allocated (as FSDP2 does with
unsharded parameters), so compiled layers, the scoring forward and state-dict names see nothing change.
"""

from __future__ import annotations

import itertools

import torch

ALIGN = 64  # bytes: each parameter's slice of the host buffer starts aligned for any dtype and for DMA


class HostOffload:
    """Pinned host copies of a frozen module's parameters; on the device only between `fetch` and `release`.
    `with offload:` waits for them and frees them at the end."""

    def __init__(self, module: torch.nn.Module):
        self.params = list(module.parameters())  # a tied weight once
        for p in self.params:
            if p.requires_grad or p.storage_offset() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                raise ValueError("only a frozen module whose parameters each own their whole storage can be "
                                 "offloaded (copy.deepcopy gives that)")
        cuda = self.params[0].is_cuda
        # One pinned (page-locked) buffer on CUDA, copied in by DMA asynchronously to the host. torch's caching host
        # allocator rounds each pinned allocation up to a power of two: one per parameter would pin up to 2x.
        sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in self.params]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=cuda)
        self.host = [flat[o:o + p.numel() * p.element_size()].view(p.dtype).view(p.shape).copy_(p.detach())
                     for p, o in zip(self.params, itertools.accumulate(sizes, initial=0))]
        self.stream = torch.cuda.Stream(self.params[0].device) if cuda else None
        self.ready: torch.cuda.Event | None = None
        self.release()

    @property
    def on_device(self) -> bool:
        return self.params[0].untyped_storage().nbytes() > 0

    def fetch(self) -> None:
        """Allocate the weights on the device and start copying them in (on CUDA, on a side stream: call
        `wait` before using them). The memory belongs to the current stream, which frees it in `release`."""
        if self.on_device:
            return
        for p in self.params:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        if self.stream is None:
            for p, h in zip(self.params, self.host):
                p.detach().copy_(h)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the allocation is ready before the copy
        with torch.cuda.stream(self.stream):
            for p, h in zip(self.params, self.host):
                p.detach().copy_(h, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self) -> None:
        """Make the current stream wait for `fetch`'s copies (fetching first if it was not called)."""
        self.fetch()
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
            self.ready = None

    def __enter__(self) -> HostOffload:
        self.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Free the device copy. Work already queued on the current stream, which waited for the copies,
        finishes before the allocator hands this memory to anything later on it."""
        for p in self.params:
            p.untyped_storage().resize_(0)
