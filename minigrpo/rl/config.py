"""The trainer's settings: one frozen dataclass, validated on construction, and the LR schedule it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # TrainConfig.weights -> the policy's dtype
PARALLEL = ("ddp", "fsdp")  # TrainConfig.parallel: under torchrun, weights replicated or sharded over ranks
CHOICES = {"weights": tuple(WEIGHT_DTYPES), "parallel": PARALLEL, "lr_schedule": ("constant", "cosine")}
# StochasticAdamW forms w * (1 - lr * wd) in fp32 (spacing 2^-24 near 1) and rounds to bf16 with 16 noise bits
# (2^-24 of a weight): a smaller per-step decay is lost in whole or in part (1e-7 came out 20% off on the CPU,
# 1e-8 wholly lost); 1e-6 came out 4% off.
MIN_BF16_DECAY = 1e-6


@dataclass(frozen=True)
class TrainConfig:
    prompts_per_step: int = 32        # B
    samples_per_prompt: int = 8       # G
    max_new_tokens: int = 512         # L: generation budget, and the Dr. GRPO loss normaliser
    inner_epochs: int = 1             # K: passes over each rollout batch (1 = on-policy)
    minibatch_size: int = 0           # rows per optimizer step; 0 = all B*G rows (one step per epoch)
    micro_batch_size: int = 16        # rows per forward/backward (gradient accumulation: memory only)
    score_batch_size: int = 64        # rows per no-grad scoring forward (old / reference log-probs)
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0        # 0 = no clipping (the norm is logged either way)
    warmup_steps: int = 0
    lr_schedule: str = "constant"     # after warmup: "constant" or "cosine" (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.0
    eps: float = 0.2                  # clip range [1 - eps, 1 + eps_high]
    eps_high: float | None = None     # None = eps (symmetric); DAPO's clip-higher uses e.g. 0.28
    kl_beta: float = 0.0              # Dr. GRPO drops the KL term: 0
    temperature: float = 1.0
    tis: bool = True                  # truncated importance sampling against the rollout engine (grpo.py)
    tis_cap: float = 2.0              # its cap C: weight = min(pi_old / pi_rollout, C)
    steps: int = 200
    eval_every: int = 25              # 0 = never (also skips the evaluation before training)
    eval_limit: int | None = None     # evaluate on the first N eval examples; None = all
    eval_batch_size: int = 128
    eval_max_new_tokens: int | None = None  # None = max_new_tokens
    eval_samples: int = 1             # k completions per eval example: mean@k and pass@k (evaluate.py)
    eval_temperature: float = 0.0     # 0 = greedy
    save_every: int = 50              # 0 = only at the end
    keep_checkpoints: int = 2         # 0 = keep all
    sample_every: int = 10            # write a few decoded completions to samples.jsonl; 0 = never
    num_samples: int = 4
    seed: int = 0
    logprob_chunk_size: int = 1024    # tokens per LM-head chunk (memory.py: up to chunk x vocab x 8 B); 0 = full
    activation_checkpointing: bool = False  # recompute layers in backward: far fewer activations, +1 forward
    recompute_layers: int | None = None     # with it: only the first N layers recompute, the rest keep theirs
    offload_reference: bool = False   # the KL reference in host memory outside its scoring pass (offload.py)
    weights: str = "fp32"             # fp32 master weights (+ bf16 autocast on CUDA), or bf16 (optim.py)
    compile_policy: bool = False      # torch.compile each decoder layer of the policy and the KL reference
    parallel: str = "ddp"             # the update under torchrun: DDP or FSDP2 (distributed.py); none alone
    task: str = "gsm8k chat"          # what the rollout reads (train.py's task, template, reward): kept on resume

    def recomputed_layers(self, layers: int) -> int:
        """How many of a model's `layers` decoder layers recompute in backward (the first ones)."""
        if not self.activation_checkpointing:
            return 0
        if self.recompute_layers is not None and self.recompute_layers > layers:
            raise ValueError(f"recompute_layers {self.recompute_layers} is more than the model's {layers} decoder "
                             f"layers; use at most {layers}")
        return layers if self.recompute_layers is None else self.recompute_layers

    @property
    def rows_per_step(self) -> int:
        """N = B x G completions per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def rows_per_minibatch(self) -> int:
        """M rows per optimizer step: minibatch_size, or all N."""
        return self.minibatch_size or self.rows_per_step

    def __post_init__(self):
        self._check_ranges()
        self._check_optimizer()
        self._check_combinations()

    def _check_ranges(self) -> None:
        """Settings one by one: finite, in range, one of the choices."""
        for f in fields(self):  # argparse's float() takes "inf" and "nan"
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "inner_epochs", "micro_batch_size",
                     "score_batch_size", "steps", "eval_batch_size", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("minibatch_size", "logprob_chunk_size", "warmup_steps", "eval_every", "save_every",
                     "keep_checkpoints", "sample_every", "num_samples", "kl_beta", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("eval_limit", "eval_max_new_tokens"):  # None: all examples / max_new_tokens
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:  # below 0 the cosine schedule's LR turns negative: gradient ascent
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not 0 <= self.seed < 2 ** 63:  # an int64, as torch.Generator.manual_seed takes it
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2: a group of one always has zero advantage")
        if not 0.0 < self.temperature:
            raise ValueError(f"temperature must be > 0 for RL sampling, got {self.temperature}")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap must be >= 1 (a weight of 1 is on-policy), got {self.tis_cap}")
        if not 0.0 < self.eps < 1.0 or (self.eps_high is not None and self.eps_high <= 0):
            raise ValueError(f"need 0 < eps < 1 and eps_high > 0, got eps={self.eps}, eps_high={self.eps_high}")

    def _check_optimizer(self) -> None:
        """The learning rate, its schedule and weight decay: values that would erase the model, or that bf16
        weights cannot carry."""
        if self.min_lr_ratio and self.lr_schedule != "cosine":
            raise ValueError(f"min_lr_ratio {self.min_lr_ratio} is the cosine schedule's floor, and lr_schedule is "
                             f"{self.lr_schedule!r}: add lr_schedule cosine, or drop min_lr_ratio")
        if not 0 < self.lr < 1:  # AdamW moves every weight by up to ~lr per step: 1 erases a model at once
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.lr * self.weight_decay >= 1:  # AdamW multiplies every weight by 1 - lr x weight_decay
            raise ValueError(f"weight_decay {self.weight_decay} at lr {self.lr} multiplies every weight by "
                             f"1 - lr x weight_decay = {1 - self.lr * self.weight_decay:g} per step, erasing the "
                             f"model; use weight_decay < {1 / self.lr:g} (0.01-0.1 is usual)")
        lr = self.lr * (self.min_lr_ratio or 1)  # the schedule's floor (a cosine to 0 ends every update anyway)
        if self.weights == "bf16" and 0 < lr * self.weight_decay < MIN_BF16_DECAY:
            at = f"lr {self.lr}" + (f" x min_lr_ratio {self.min_lr_ratio}" if self.min_lr_ratio else "")
            raise ValueError(f"weight_decay {self.weight_decay} at {at} shrinks bf16 parameters by "
                             f"{lr * self.weight_decay:.1e} per step, below the {MIN_BF16_DECAY:.0e} that their "
                             f"fp32 update and 16-bit stochastic rounding carry (it would be lost, wholly or in part): "
                             f"use weights fp32, or weight_decay 0 or >= {MIN_BF16_DECAY / lr:g}")

    def _check_combinations(self) -> None:
        """Settings that need one another (each message also gives the range of what it names)."""
        if self.minibatch_size and self.rows_per_step % self.minibatch_size:
            raise ValueError(f"minibatch_size {self.minibatch_size} must divide the B*G = {self.rows_per_step} rows "
                             f"of a step")
        if self.recompute_layers is not None and (self.recompute_layers < 0 or not self.activation_checkpointing):
            raise ValueError(f"recompute_layers {self.recompute_layers} needs activation_checkpointing, and must be "
                             f">= 0 (it counts the decoder layers that recompute)")
        if self.offload_reference and (self.kl_beta == 0 or self.parallel == "fsdp"):
            raise ValueError("offload_reference needs a KL reference (kl_beta > 0) and parallel 'ddp' (FSDP shards "
                             "the reference across ranks instead)")
        if self.eval_temperature < 0 or (self.eval_samples > 1 and self.eval_temperature == 0):
            raise ValueError(f"eval_samples={self.eval_samples} needs eval_temperature > 0 (greedy samples are copies "
                             f"of one completion), and eval_temperature must be >= 0; got {self.eval_temperature}")


# A checkpoint stores its config; resuming refuses a different one, except for these settings: they do not
# alter the training trajectory. Evaluation, logging and saving; and what changes only memory, speed or the
# rounding (a run that ran out of memory resumes with the smaller micro-batch the memory check names, and
# `--recompute-layers auto` may settle on another count on another GPU; parallel, like the world size, changes
# the rounding: checkpoints hold the full state either way).
RESUMABLE_CHANGES = {"steps", "eval_every", "eval_limit", "eval_batch_size", "eval_max_new_tokens", "eval_samples",
                     "eval_temperature", "save_every", "keep_checkpoints", "sample_every", "num_samples", "parallel",
                     "offload_reference", "micro_batch_size", "score_batch_size", "logprob_chunk_size",
                     "activation_checkpointing", "recompute_layers", "compile_policy"}


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """LR multiplier for the step-th update (0-based): linear warmup, then constant or cosine decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
