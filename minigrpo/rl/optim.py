"""AdamW on bf16 weights with stochastic rounding: the memory-lean alternative to fp32 master weights.

Why not plain bf16 AdamW: RL fine-tuning runs at lr ~1e-6, so Adam moves a weight by about 1e-6 per step,
while bf16 numbers near a typical weight of 0.02 are about 1.2e-4 apart: round-to-nearest throws every
update away. The second moment has the same problem (beta2 = 0.999 changes v by 0.1%, under bf16's 0.2%
half-spacing). Stochastic rounding fixes both (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting BFloat16
Training"): the step is computed in fp32 and rounded up or down to a neighbouring bf16 number with
probability proportional to its distance from each, so on average a weight follows the fp32 trajectory.
Weights, gradients and both moments stay in bf16: 8 bytes per parameter, against 16 with fp32 master weights.

The random bits are a hash of (seed, element index) (sampling.mix31), not a generator's stream: a step is a
pure function of its seed, so resumes are exact, and a chunk's whole update compiles into one kernel. The
update walks the parameters' elements in chunks: a large parameter is cut into chunks, consecutive small
ones are concatenated into one (each compiled call costs host time); element i keeps its global index, so
the grouping changes no rounding. FSDP shards (DTensors) are updated with the noise of their elements'
indices in the whole model, so a sharded step equals the unsharded one. The state is created with the
optimizer: torch.distributed.checkpoint would otherwise create it with a `step()` that takes no seed.

Shape legend: n elements of one chunk.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, Shard

from minigrpo.model.sampling import M31, mix31

CHUNK = 1 << 26  # elements per compiled update call; eager: CHUNK // 16, which bounds its fp32 temporaries


def round_stochastic(x: torch.Tensor, seed: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 -> bf16, rounding to one of the two neighbouring bf16 values, unbiasedly.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits and truncating them
    rounds the magnitude up with probability (low bits) / 2^16, for either sign (sign-magnitude). The noise of
    element i hashes (seed, offset + i), seed an int64 tensor in [0, 2^31), 31 index bits at a time, so that
    elements 2^31 apart do not round alike."""
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


class StochasticAdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (torch.optim.AdamW's math) for bf16 parameters, rounding stochastically.

    compile: None = torch.compile the chunk update when the parameters are on CUDA (one compile, shapes
    symbolic), eager elsewhere; the two compute the same thing. chunk: None = CHUNK compiled, CHUNK // 16 eager."""

    def __init__(self, params, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, chunk: int | None = None, compile: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"StochasticAdamW is for bf16 parameters, got {p.dtype} "
                                     f"(use torch.optim.AdamW for fp32 master weights)")
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32),  # on the CPU, as torch's AdamW
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # bf16, like p
        if compile is None:
            compile = all(p.device.type == "cuda" for group in self.param_groups for p in group["params"])
        self.chunk = chunk or (CHUNK if compile else CHUNK // 16)  # compiled, fewer calls are faster (bench/optim.py)
        self._update = torch.compile(_adamw_chunk, dynamic=True) if compile else _adamw_chunk

    @torch.no_grad()
    def step(self, seed: int) -> None:
        """One step; seed (any int) picks the rounding noise (module doc)."""
        streams = mix31(torch.tensor([seed & M31]) + torch.arange(3)) & M31              # (3,) w, m, v
        start = 0  # element index across all parameters: every element gets its own noise
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            params = []  # (parameter, the index of its first element here: on this rank, when sharded)
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] += 1
                    params.append((p, start + _first_index(p)))
                start += p.numel()  # of the whole parameter, when sharded
            # Runs of parameters on one device at one step count share the step's constants.
            for (device, t), run in itertools.groupby(params, lambda q: (q[0].device, self.state[q[0]]["step"].item())):
                hyper = torch.tensor([lr / (1 - b1 ** t), b1, b2, eps, 1 - lr * wd, 1 - b2 ** t]).to(device)
                seeds = streams.to(device)
                quads = [((p, p.grad, self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]), first)
                         for p, first in run]
                for piece, offset in _chunks(quads, self.chunk):
                    self._update_piece(piece, offset, hyper, seeds)

    def _update_piece(self, piece, offset: int, hyper: torch.Tensor, seeds: torch.Tensor) -> None:
        """Several small parameters are concatenated, updated, and copied back: one piece's copies at a time."""
        # detached: a parameter (requires_grad) and a concatenation (not) would compile two graphs
        w, g, m, v = (torch.cat(x) if len(piece) > 1 else x[0].detach() for x in zip(*piece))  # (n,) each
        self._update(w, g, m, v, hyper, seeds, offset)
        if len(piece) > 1:
            for j, new in ((0, w), (2, m), (3, v)):
                torch._foreach_copy_([q[j] for q in piece], new.split([q[0].numel() for q in piece]))


def _first_index(p: torch.Tensor) -> int:
    """The index in p of its first element this process holds: 0, or where this rank's block of rows starts
    in a DTensor that FSDP shards (dim 0, split as torch.chunk splits)."""
    if not isinstance(p, DTensor):
        return 0
    assert p.placements == (Shard(0),), f"expected FSDP's dim-0 sharding, got {p.placements}"
    rows = -(-p.shape[0] // p.device_mesh.size())                                  # rows per rank
    return min(p.device_mesh.get_local_rank() * rows, p.shape[0]) * (p.numel() // p.shape[0])


def _chunks(quads, chunk: int):
    """((w, g, m, v), index of w's first element in the model) quadruples, in order, as pieces: (lists of flat
    views that hold at most `chunk` elements together, the index of the piece's first element). A tensor of
    at least chunk / 4 elements is cut alone into chunks; smaller ones share a piece when their elements
    follow each other in the model."""
    piece, size, begin = [], 0, 0
    for quad, first in quads:
        flat = [(x.to_local() if isinstance(x, DTensor) else x).view(-1) for x in quad]  # (n,) each: this rank's
        n = flat[0].numel()
        if piece and (size + n > chunk or 4 * n >= chunk or first != begin + size):
            yield piece, begin
            piece, size = [], 0
        if 4 * n >= chunk:
            yield from (([c], first + k * chunk) for k, c in enumerate(zip(*(x.split(chunk) for x in flat))))
        else:
            begin = begin if piece else first
            piece.append(flat)
            size += n
    if piece:
        yield piece, begin
