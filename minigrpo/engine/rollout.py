"""Rollout backends: what generates the completions the trainer learns from, behind two calls:

    generate(prompts, samples_per_prompt, max_new_tokens, params, stop_ids, seeds) -> Rollout
    load_weights(model)      # the policy's current weights, after each update

`stop_ids` holds stop token ids, and token sequences (tuples) on which the engine stops early (the
caller cuts at the stop strings anyway; the reference generator ignores them). `seeds` holds one seed
per completion, group-major like the result: a completion is a pure function of (weights, prompt, seed).
"""

from __future__ import annotations

import os

import torch

from minigrpo.engine.config import BACKENDS, EngineConfig
from minigrpo.model.generate import Rollout, check_rollout_request, generate
from minigrpo.model.qwen2 import Qwen2ForCausalLM

ATTN_BACKENDS = ("reference", *BACKENDS)


class ReferenceBackend:
    """Reference generation on the policy module itself (eval mode, bf16 autocast on CUDA): slow, obviously correct."""

    def __init__(self, model: Qwen2ForCausalLM, pad_id: int):
        self.model = model
        self.pad_id = pad_id

    def generate(self, prompts, samples_per_prompt, max_new_tokens, params, stop_ids, seeds) -> Rollout:
        expanded = [p for p in prompts for _ in range(samples_per_prompt)]  # group-major
        check_rollout_request(prompts, samples_per_prompt, seeds)
        on_cuda = next(self.model.parameters()).device.type == "cuda"
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
                ids = tuple(s for s in stop_ids if isinstance(s, int))  # token sequences: the engine's early exit
                return generate(self.model, expanded, max_new_tokens, params=params, stop_ids=ids,
                                pad_id=self.pad_id, seeds=seeds)
        finally:
            self.model.train(was_training)

    def load_weights(self, model: Qwen2ForCausalLM) -> None:
        """Nothing to load: this backend generates with the policy module itself."""


def make_backend(attn: str, model: Qwen2ForCausalLM, *, pad_id: int, compile: str | None = None,
                 cuda_graphs: bool | None = None, max_seq_len: int | None = None,
                 max_batch: int | None = None, sampler: str | None = None):
    """The rollout backend for `--attn`: the reference generator, or the fast engine with that attention, in bf16
    on CUDA, fp32 on the CPU (where bf16 rounding would hide real mismatches). None picks the fastest setting for
    the device (bench/NOTES.md), or keeps the engine's default sizes."""
    if attn == "reference":
        return ReferenceBackend(model, pad_id)
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    if "triton" in (attn, sampler) and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        flag, fix = ("--attn triton", "--attn sdpa") if attn == "triton" else ("--sampler triton", "--sampler torch")
        raise ValueError(f"{flag} runs Triton kernels, which need a CUDA GPU; on the CPU use {fix} "
                         f"(or set TRITON_INTERPRET=1 to run them, slowly, in Triton's interpreter)")
    if cuda_graphs and not on_cuda:
        raise ValueError("--cuda-graphs captures CUDA graphs, which need a CUDA GPU; drop it on the CPU")
    try:  # imported here so the trainer runs (with --attn reference) wherever the engine cannot
        from minigrpo.engine.engine import Engine
    except ImportError as e:
        raise RuntimeError(f"--attn {attn} needs the fast engine (minigrpo/engine/engine.py), which failed to import "
                           f"({e}); use --attn reference") from None
    extra = {k: v for k, v in (("max_seq_len", max_seq_len), ("max_batch", max_batch)) if v is not None}
    cfg = EngineConfig(attn=attn, compile=compile or ("step" if on_cuda else "none"),
                       cuda_graphs=on_cuda if cuda_graphs is None else cuda_graphs,
                       sampler=sampler or ("triton" if on_cuda else "torch"), **extra)
    engine = Engine(model.config, cfg, device=device, dtype=torch.bfloat16 if on_cuda else torch.float32)
    engine.load_weights(model)
    return engine
