"""The Qwen2 / Qwen2.5 decoder: the reference forward over full (optionally left-padded) sequences, or over
rows packed with one copy of each prompt (packing.py), the trainer's layout.

The model the trainer differentiates, and the yardstick the rollout engine is checked against: plain code,
SDPA attention, no KV cache. Parameter names are Hugging Face's, so a state dict
moves between this model, safetensors files and transformers with no rename table. Numerics follow HF op for op.

Shape legend: B batch, T sequence length, C hidden, Hq query heads, Hkv kv heads, D head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from minigrpo.model.config import ModelConfig
from minigrpo.model.packing import Packed, Rows, row_attention

# SDPA's kernels less cuDNN's, which builds an execution plan for each new shape on the host (bench/NOTES.md)
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the activation dtype; cast back *before* the weight, as HF does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for explicit integer positions, computed in fp32 then cast. (..., ) -> (..., D) each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
                                / head_dim))                          # (D/2,)
    freqs = positions.float()[..., None] * inv_freq                  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                          # (..., D): HF's non-interleaved layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of the last dim. x (..., D); cos/sin broadcastable to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = Hq, Hkv, D
        self.q_proj = nn.Linear(C, Hq * D, bias=True)
        self.k_proj = nn.Linear(C, Hkv * D, bias=True)
        self.v_proj = nn.Linear(C, Hkv * D, bias=True)
        self.o_proj = nn.Linear(Hq * D, C, bias=False)

    def forward(self, x, cos, sin, mask):
        """mask: None (causal), a boolean mask (B, 1, T, T), or the Rows of a packing (B = 1)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        cos, sin = cos[:, None], sin[:, None]                                           # (B, 1, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with sdpa_kernel(NOT_CUDNN):
            if isinstance(mask, Rows):  # packed
                y = row_attention(q[0], k[0], v[0], mask)[None]                         # (1, T, Hq*D)
            else:  # with no mask (no padding) the fused causal kernels apply
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                y = y.transpose(1, 2).reshape(B, T, -1)                                 # (B, T, Hq*D)
        return self.o_proj(y)                                                           # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, Fw = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, Fw, bias=False)
        self.up_proj = nn.Linear(C, Fw, bias=False)
        self.down_proj = nn.Linear(Fw, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, recompute: bool = False):
        """recompute: activation checkpointing, inside the layer so that a compiled layer compiles the
        recomputation into its own backward graph."""
        if recompute:
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)

    def _forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # HF's `model.*` submodule: embedding, decoder stack, final norm
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (also after `load_state_dict(assign=True)`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      recompute_layers: int = 0, packed: Packed | None = None) -> torch.Tensor:
        """Final-norm hidden states, (B, T) -> (B, T, C); the trainer applies the LM head in chunks itself.
        attention_mask (B, T): 1 for real tokens, 0 for left padding; a token's position counts the real tokens
        before it, so a left-padded row computes exactly what it computes alone. packed: rows that share prompts
        as one sequence (packing.py; input_ids is packed.ids, (1, T); no attention_mask), the training forward's layout.
        recompute_layers: with gradients on, the first N decoder layers recompute in backward (one tensor kept per
        layer, not ~20; the same gradients), the others keep their activations."""
        B, T = input_ids.shape
        mask = None
        if packed is not None:
            positions = packed.positions                                                  # (1, T)
            mask = packed.rows
            for t in mask:  # compiled layers: one graph for every packing
                torch._dynamo.maybe_mark_dynamic(t, list(range(t.dim())))
        elif attention_mask is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)             # (B, T)
        else:
            real = attention_mask.bool()                                                  # (B, T)
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)                         # (B, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()   # (T, T)
            # A query sees earlier real keys; it always sees itself, so padding rows stay finite (their
            # outputs are never used) instead of softmaxing over nothing and producing NaN.
            mask = (causal & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=input_ids.device)
            mask = mask[:, None]                                                          # (B, 1, T, T)
        cfg = self.config
        x = self.model.embed_tokens(input_ids)                                            # (B, T, C)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)         # (B, T, D)
        recompute = recompute_layers if torch.is_grad_enabled() else 0
        # compiled layers (the trainer's): one graph for every B and T, whichever layer compiles it; eager: a no-op
        for t in (cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, [0, 1])
        for i, layer in enumerate(self.model.layers):
            torch._dynamo.maybe_mark_dynamic(x, [0, 1])  # each layer's input: a new tensor
            x = layer(x, cos, sin, mask, i < recompute)
        return self.model.norm(x)                                                         # (B, T, C)

    def forward(self, input_ids, attention_mask=None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask))


@torch.no_grad()
def init_weights(model: Qwen2ForCausalLM, generator: torch.Generator, std: float = 0.02) -> None:
    """Random initialisation as transformers does it (normal(0, std), zero biases, unit norms) from `generator`."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if module is model.lm_head and model.config.tie_word_embeddings:
                continue  # shares the embedding, already initialised
            w = torch.empty(module.weight.shape, dtype=torch.float32, device=generator.device)
            module.weight.copy_(w.normal_(0.0, std, generator=generator))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
