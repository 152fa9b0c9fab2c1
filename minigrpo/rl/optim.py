"""AdamW on bf16 weights with stochastic rounding: the memory-lean alternative to fp32 master weights.

Why not plain bf16 AdamW: RL fine-tuning runs at lr ~1e-6, so Adam moves a weight by about 1e-6 per
step, while bf16 spaces the numbers near a typical weight of 0.02 about 1.2e-4 apart. Round-to-nearest
throws every such update away and the weights never move. The second moment has the same problem:
beta2 = 0.999 changes v by 0.1% per step, under bf16's 0.2% half-spacing.

Stochastic rounding fixes both (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision";
Zamirai et al. 2020, "Revisiting BFloat16 Training"). The step is computed in fp32, and the result is
rounded up or down to a neighbouring bf16 number, with probability proportional to its distance from
each. The rounding is then unbiased: on average a weight follows the fp32 trajectory, and it costs no
extra memory. Weights, gradients and both moments all stay in bf16: 8 bytes per parameter, against 16
for fp32 master weights with fp32 moments.

The random bits are a hash of (seed, element index), the sampler's counter-based noise (sampling.mix31),
not a generator's stream: a step is a pure function of its seed, which the trainer derives from (seed,
step), so runs are reproducible and resumes exact. It also lets the whole update of a chunk compile
into one fused kernel (`compile=True`, on CUDA by default), instead of ~40 eager launches per chunk.
The fp32 arithmetic runs over chunks of at most `chunk` elements, which keeps its temporaries small next
to the model (the embedding alone is 136M elements).

Sharded parameters (FSDP: DTensors, each rank holding a block of rows) are updated shard by shard, each
element with the noise of its index in the whole model, so a sharded step equals the unsharded one. The
state is created with the optimizer, not at the first step: torch.distributed.checkpoint's state-dict
helpers would otherwise create it with a zero-learning-rate `step()`, which takes no seed here.

Shape legend: n elements of one chunk.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from minigrpo.model.sampling import M31, mix31


def round_stochastic(x: torch.Tensor, seed: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 -> bf16, rounding to one of the two neighbouring bf16 values, unbiasedly.

    bf16 is the top 16 bits of fp32. Adding uniform noise in [0, 2^16) to the low 16 bits and then
    truncating them rounds the magnitude up with probability (low bits) / 2^16. The bit pattern is
    sign-magnitude, so this works the same for negative numbers. The noise of element i is a hash of
    (seed, offset + i), seed an int64 tensor in [0, 2^31). The hash takes 31 bits at a time: the index's
    low 31 bits, then its high bits. So the noise never repeats with a period: element i and element
    i + 2^31 are as unrelated as any two (a wrap of the index would round them alike at every step)."""
    assert x.dtype == torch.float32 and x.is_contiguous(), (x.dtype, x.stride())
    idx = torch.arange(offset, offset + x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    noise = (mix31(mix31(seed ^ (idx & M31)) ^ (idx >> 31)) & 0xFFFF).int()         # (n,) in [0, 2^16)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def _adamw_chunk(w, g, m, v, hyper, seeds, offset: int) -> None:
    """One AdamW step of a chunk, in place. w, g, m, v (n,) bf16; hyper (6,) fp32 device tensor:
    [lr / (1 - beta1^t), beta1, beta2, eps, 1 - lr * weight_decay, 1 - beta2^t]; seeds (3,) int64: the
    rounding streams of w, m and v; offset: the chunk's first element index (for the noise)."""
    step_size, b1, b2, eps, decay, bias2 = hyper.unbind()
    g32 = g.float()
    m32 = m.float() * b1 + g32 * (1 - b1)
    v32 = v.float() * b2 + g32 * g32 * (1 - b2)
    w32 = w.float() * decay - step_size * m32 / ((v32 / bias2).sqrt() + eps)
    w.copy_(round_stochastic(w32, seeds[0], offset))
    m.copy_(round_stochastic(m32, seeds[1], offset))
    v.copy_(round_stochastic(v32, seeds[2], offset))


def _shard(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of x this process updates, flat, and the index in x of the first: all of a plain tensor,
    or this rank's block of rows of a DTensor that FSDP shards (dim 0, split as torch.chunk splits)."""
    if not isinstance(x, DTensor):
        return x.view(-1), 0
    assert x.placements == (Shard(0),), f"expected FSDP's dim-0 sharding, got {x.placements}"
    rows = -(-x.shape[0] // x.device_mesh.size())                                # rows per rank
    first_row = min(x.device_mesh.get_local_rank() * rows, x.shape[0])
    return x.to_local().view(-1), first_row * (x.numel() // max(1, x.shape[0]))


class StochasticAdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (torch.optim.AdamW's math) for bf16 parameters, rounding stochastically.

    compile: None = torch.compile the chunk update when the parameters are on CUDA (one compile, shapes
    symbolic), eager elsewhere; the two compute the same thing."""

    def __init__(self, params, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, chunk: int = 1 << 22, compile: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.chunk = chunk
        devices = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"StochasticAdamW is for bf16 parameters, got {p.dtype} "
                                     f"(use torch.optim.AdamW for fp32 master weights)")
                devices.add(p.device.type)
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # bf16, like p
        if compile is None:
            compile = devices == {"cuda"}
        self._update = torch.compile(_adamw_chunk, dynamic=True) if compile else _adamw_chunk

    @torch.no_grad()
    def step(self, seed: int) -> None:
        """One step; seed (any int) picks the rounding noise (module doc)."""
        streams = mix31(torch.tensor([seed & M31]) + torch.arange(3)) & M31              # (3,) w, m, v
        start = 0  # element index across all parameters: every element gets its own noise
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            consts = {}  # (device, t) -> (hyper, seeds) on that device: one small copy, not one per tensor
            for p in group["params"]:
                start, offset = start + p.numel(), start  # p.numel(): of the whole parameter, when sharded
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                t = state["step"].item()  # a CPU tensor, as torch's AdamW keeps it: no device sync
                if (p.device, t) not in consts:
                    hyper = torch.tensor([lr / (1 - b1 ** t), b1, b2, eps, 1 - lr * wd, 1 - b2 ** t])
                    consts[p.device, t] = (hyper.to(p.device), streams.to(p.device))
                hyper, seeds = consts[p.device, t]
                (w, first), (g, _), (m, _), (v, _) = map(_shard, (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
                offset += first
                for w, g, m, v in zip(*(x.split(self.chunk) for x in (w, g, m, v))):  # (n,) views into p, grad, m, v
                    self._update(w, g, m, v, hyper, seeds, offset)
                    offset += w.numel()
