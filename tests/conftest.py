"""Shared test fixtures: tiny random configs, the shared data folder, and the GPU marker's skip."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter. Triton reads the flag once, on first import
    # (torch._dynamo imports it), so it is set here, before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is importable from the tests
from bench.workload import data_dir  # noqa: E402

SHARED_DATA = data_dir()  # $MINIGRPO_DATA, else ../shared/data beside the checkout
QWEN_DIR = SHARED_DATA / "qwen2.5-0.5b-instruct"
GSM8K = SHARED_DATA / "gsm8k"


def tiny_config(n_heads=14, n_kv_heads=2, head_dim=8, tied=True, vocab=256, layers=2, **kw) -> ModelConfig:
    """A few-layer Qwen2 config; n_heads / n_kv_heads sets the GQA ratio (7 as in Qwen2.5-0.5B by default)."""
    return ModelConfig(vocab_size=vocab, hidden_size=n_heads * head_dim, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                       tie_word_embeddings=tied, **kw)


def random_model(cfg: ModelConfig, seed=0, std=0.02, dtype=torch.float32, device="cpu") -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    init_weights(model, torch.Generator().manual_seed(seed), std=std)
    return model.eval()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_qwen_dir(tmp_path_factory):
    """A random 2-layer model with Qwen2.5's vocabulary and tokenizer files: the real GSM8K code path, fast."""
    if not (QWEN_DIR.exists() and GSM8K.exists()):
        pytest.skip(f"shared data not found under {SHARED_DATA}")
    from minigrpo.model.checkpoint import save_model
    out = tmp_path_factory.mktemp("tiny_qwen")
    save_model(random_model(tiny_config(vocab=151936, n_heads=2, n_kv_heads=1, head_dim=8)), out,
               tokenizer_dir=QWEN_DIR)
    return out
