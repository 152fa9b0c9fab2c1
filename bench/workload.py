"""The standard benchmark workload: a random-initialised model of the exact Qwen2.5-0.5B shape, and real
GSM8K prompts through the real tokenizer and chat template.

No weights exist offline, and decode speed does not depend on weight values, so the benchmarks and GPU
checks use random weights at the real shape. The data folder (config.json, tokenizer files, GSM8K jsonl)
is found at $MINIGRPO_DATA, else at ../shared/data beside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights
from minigrpo.model.tokenizer import Tokenizer
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


def gsm8k_prompts(n: int, split: str = "test") -> tuple[Tokenizer, list[list[int]]]:
    """The first n GSM8K questions as chat-templated token ids."""
    tok = Tokenizer.from_dir(qwen_dir())
    examples = load_jsonl(data_dir() / "gsm8k" / f"{split}.jsonl")[:n]
    return tok, [TEMPLATES["chat"].prompt(tok, e.question) for e in examples]
