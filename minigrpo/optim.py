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

The random bits come from the generator passed to `step`. The trainer derives it from (seed, step), so a
run is reproducible and a resumed run stays exact. The fp32 arithmetic runs over chunks of at most
`chunk` elements, which keeps its temporaries small next to the model (the embedding alone is 136M
elements).
"""

from __future__ import annotations

import torch


def round_stochastic(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """fp32 -> bf16, rounding to one of the two neighbouring bf16 values, unbiasedly.

    bf16 is the top 16 bits of fp32. Adding uniform noise in [0, 2^16) to the low 16 bits and then
    truncating them rounds the magnitude up with probability (low bits) / 2^16. The bit pattern is
    sign-magnitude, so this works the same for negative numbers."""
    assert x.dtype == torch.float32, x.dtype
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class StochasticAdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (torch.optim.AdamW's math) for bf16 parameters, rounding stochastically."""

    def __init__(self, params, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, chunk: int = 1 << 22):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.chunk = chunk
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"StochasticAdamW is for bf16 parameters, got {p.dtype} "
                                     f"(use torch.optim.AdamW for fp32 master weights)")

    @torch.no_grad()
    def step(self, generator: torch.Generator | None = None) -> None:  # the random bits: see module doc
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)     # bf16, like p
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()  # a CPU tensor, as torch's AdamW keeps it: no device sync
                step_size, bias2 = lr / (1 - b1 ** t), 1 - b2 ** t
                flat = (p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
                for w, g, m, v in zip(*(x.split(self.chunk) for x in flat)):  # (chunk,) views into p, grad, m, v
                    g32 = g.float()
                    m32 = m.float().lerp_(g32, 1 - b1)
                    v32 = v.float().mul_(b2).addcmul_(g32, g32, value=1 - b2)
                    w32 = w.float().mul_(1 - lr * wd)
                    w32.addcdiv_(m32, (v32 / bias2).sqrt_().add_(eps), value=-step_size)
                    w.copy_(round_stochastic(w32, generator))
                    m.copy_(round_stochastic(m32, generator))
                    v.copy_(round_stochastic(v32, generator))
