"""Host-to-device copies queued behind the GPU's work instead of waiting for it.

`tensor.to("cuda")` from ordinary (pageable) host memory is a synchronising copy: the host waits until every
kernel already queued on the stream has run. Each training micro-batch copies its packing's indices to the GPU,
so such copies would drain the GPU's queue at every micro-batch, and the GPU would then idle while the host
prepares the next one. Staged in pinned memory, the copy is queued like a kernel (non_blocking); torch's caching
host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, without a host sync on CUDA."""
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
