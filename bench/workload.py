"""The standard benchmark workload: a random-initialised model of the exact Qwen2.5-0.5B shape, and real
GSM8K prompts through the real tokenizer and chat template.

No weights exist offline, and decode speed does not depend on weight values, so the benchmarks and GPU
checks use random weights at the real shape. The data folder (config.json, tokenizer files, GSM8K jsonl)
is found at $MINIGRPO_DATA, else at ../shared/data beside the checkout.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights
from minigrpo.model.tokenizer import Tokenizer
from minigrpo.rl.config import TrainConfig
from minigrpo.rl.memory import estimate
from minigrpo.tasks.qa import load_jsonl
from minigrpo.tasks.templates import TEMPLATES


def data_dir() -> Path:
    env = os.environ.get("MINIGRPO_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def qwen_dir() -> Path:
    return data_dir() / "qwen2.5-0.5b-instruct"


def random_qwen(device="cuda", dtype=torch.bfloat16, seed=0, std=0.02, config_dir: Path | None = None
                ) -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B-Instruct's architecture with transformers' initialiser (normal(0, std))."""
    cfg = ModelConfig.from_json((config_dir or qwen_dir()) / "config.json")
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    init_weights(model, torch.Generator(device=device).manual_seed(seed), std=std)
    return model.to(dtype).eval()


def shared_prompt_pages(num_pages: int, B: int, G: int, M: int, shared: int, device="cuda",
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """A block table (B, M) on shuffled pages (never the scratch page 0) whose rows, in groups of G, share their
    first `shared` pages and own the rest."""
    groups = B // G
    perm = torch.randperm(num_pages - 1, device=device, generator=generator) + 1
    common = perm[:groups * shared].view(groups, 1, shared).expand(groups, G, shared).reshape(B, shared)
    own = perm[groups * shared:groups * shared + B * (M - shared)].view(B, M - shared)
    return torch.cat([common, own], dim=1).int()                                       # (B, M)


def gsm8k_prompts(n: int, split: str = "test") -> tuple[Tokenizer, list[list[int]]]:
    """The first n GSM8K questions as chat-templated token ids."""
    tok = Tokenizer.from_dir(qwen_dir())
    examples = load_jsonl(data_dir() / "gsm8k" / f"{split}.jsonl")[:n]
    return tok, [TEMPLATES["chat"].prompt(tok, e.question) for e in examples]


class StandInReward:
    """A task's prompts, scored by the parity of the completion's token ids: random weights never solve GSM8K,
    and about half of each group scores 1, so every group trains (timing does not depend on reward values)."""

    def __init__(self, task):
        self.task, self.stops = task, task.stops
        self.longest = 0  # the longest prompt the steps drew: the memory estimate's like-for-like input

    def __len__(self):
        return len(self.task)

    def prompt(self, i):
        p = self.task.prompt(i)
        self.longest = max(self.longest, len(p))
        return p

    def score(self, i, completion_ids):
        return float(sum(completion_ids) % 2 == 0), False

    def describe(self, i):
        return self.task.describe(i)


class ParityTask:
    """StandInReward's reward over a list of prompts."""

    def __init__(self, prompts, tokenizer):
        self.prompts, self.stops = prompts, TEMPLATES["chat"].stops(tokenizer)

    def __len__(self):
        return len(self.prompts)

    def prompt(self, i):
        return self.prompts[i]

    score = StandInReward.score

    def describe(self, i):
        return {}


def small_training_run(flags: str, out_dir: Path):
    """tests/test_memory.py's GPU run: random Qwen2.5-0.5B, 4 prompts x 4 samples x 64 tokens, K = 2, beta 0.04,
    8-row micro-batches, eager engine and policy (no compile warm-up); flags "default", "lean" (bf16 weights,
    activation checkpointing, 256-token LM-head chunks) or "lean-offload" (and the KL reference offloaded,
    only half of the 24 layers recomputed).
    Returns the Trainer and the memory estimate of its run."""
    from minigrpo.engine.rollout import make_backend  # the engine loads the Triton kernels
    from minigrpo.rl.trainer import Trainer

    tok, prompts = gsm8k_prompts(8)
    cfg = TrainConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=64, inner_epochs=2, micro_batch_size=8,
                      kl_beta=0.04, steps=2, eval_every=0, save_every=0, sample_every=0)
    if flags.startswith("lean"):
        cfg = replace(cfg, weights="bf16", activation_checkpointing=True, logprob_chunk_size=256)
    if flags == "lean-offload":
        cfg = replace(cfg, offload_reference=True, recompute_layers=12)
    model = random_qwen(device="cuda", dtype=torch.float32 if cfg.weights == "fp32" else torch.bfloat16).train()
    longest = max(len(p) for p in prompts)
    backend = make_backend("sdpa", model, pad_id=tok.pad_id, compile="none", cuda_graphs=False,
                           max_seq_len=longest + 64, max_batch=16)
    trainer = Trainer(cfg, model, tok, ParityTask(prompts, tok), backend, out_dir, echo=False)
    return trainer, estimate(model.config, cfg, prompt_tokens=longest, engine=backend.cfg)
