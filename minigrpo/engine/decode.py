"""The inference side of the model: packed weights, batched prefill, and the decode step.

Weights are laid out for inference: q/k/v fused into one matmul and gate/up into another, stacked over
layers. When the policy's parameters have the engine's dtype and device (`--weights bf16` on CUDA),
`load_from` makes each one a view of the slice that holds it, so the optimizer updates the engine in
place; otherwise it copies after each update. The buffers never move, so captured CUDA graphs stay valid.

Shape legend: B batch slots (in a prefill: prompts), T prompt length, C hidden, H query heads, K kv heads, D head
dim, F MLP width, V vocabulary, L layers, M block-table width, S page size, W output width (max_seq_len + 1, the
last column scratch).
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import kernels  # noqa: F401  (registers torch.ops.minigrpo.*)
from minigrpo.engine.attention import decode_attention
from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, apply_rope, rms_norm, rope_cos_sin
from minigrpo.model.sampling import SAMPLE_CHUNK, SamplingParams, sample


class DecodeModel(nn.Module):
    """Inference weights, as buffers: the engine never differentiates them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int):
        super().__init__()
        self.cfg = cfg
        L, C, H, K, D, Fw, V = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                                cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
        self.qkv_sizes = (H * D, K * D, K * D)
        shapes = {"embed": (V, C), "ln1": (L, C), "w_qkv": (L, (H + 2 * K) * D, C), "b_qkv": (L, (H + 2 * K) * D),
                  "w_o": (L, C, H * D), "ln2": (L, C), "w_gate_up": (L, 2 * Fw, C), "w_down": (L, C, Fw),
                  "norm": (C,), "lm_head": (V, C)}
        for name, shape in shapes.items():
            tied = name == "lm_head" and cfg.tie_word_embeddings
            self.register_buffer(name, self.embed if tied else torch.empty(shape, dtype=dtype, device=device))
        # RoPE tables in fp32, cast at use: the same values the reference model computes per call.
        cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), D, cfg.rope_theta, torch.float32)
        self.register_buffer("cos", cos)  # (max_positions, D)
        self.register_buffer("sin", sin)  # (max_positions, D)

    @torch.no_grad()
    def load_from(self, model: Qwen2ForCausalLM, share: bool = True) -> None:
        """Take the policy's weights: shared where possible (module doc), else copied (and cast), in place.
        A parameter already shared is skipped; one replaced since is copied in and shared again."""
        if model.config != self.cfg:
            diff = [f.name for f in fields(self.cfg) if getattr(model.config, f.name) != getattr(self.cfg, f.name)]
            raise ValueError(f"the policy's config differs from the engine's in {diff}; build the engine from the "
                             f"policy's config")
        pairs = self._views(model)
        share = share and all(type(p.data) is torch.Tensor and (p.dtype, p.device) == (v.dtype, v.device)
                              for p, v in pairs)  # a sharded (DTensor) parameter has no full tensor to view
        for p, v in pairs:
            if isinstance(p, DTensor):  # gathered by every rank at once, one at a time: never a second full model
                v.copy_(p.full_tensor())
            elif p.data_ptr() != v.data_ptr():
                v.copy_(p)
                if share:
                    p.data = v  # the same Parameter (optimizer, hooks, names unchanged), on the engine's memory

    def _views(self, model: Qwen2ForCausalLM) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(policy parameter, the view of these buffers that holds it), for every parameter of the policy."""
        m, (q, k, _), Fw = model.model, self.qkv_sizes, self.cfg.intermediate_size
        pairs = [(m.embed_tokens.weight, self.embed), (m.norm.weight, self.norm)]
        if not self.cfg.tie_word_embeddings:  # tied: lm_head.weight is the embedding's Parameter
            pairs.append((model.lm_head.weight, self.lm_head))
        for i, layer in enumerate(m.layers):
            a, mlp, w, b = layer.self_attn, layer.mlp, self.w_qkv[i], self.b_qkv[i]
            pairs += [(layer.input_layernorm.weight, self.ln1[i]), (layer.post_attention_layernorm.weight, self.ln2[i]),
                      (a.q_proj.weight, w[:q]), (a.k_proj.weight, w[q:q + k]), (a.v_proj.weight, w[q + k:]),
                      (a.q_proj.bias, b[:q]), (a.k_proj.bias, b[q:q + k]), (a.v_proj.bias, b[q + k:]),
                      (a.o_proj.weight, self.w_o[i]), (mlp.gate_proj.weight, self.w_gate_up[i, :Fw]),
                      (mlp.up_proj.weight, self.w_gate_up[i, Fw:]), (mlp.down_proj.weight, self.w_down[i])]
        return pairs

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.ln2[i], self.cfg.rms_norm_eps)
        gate, up = F.linear(h, self.w_gate_up[i]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down[i])

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> torch.Tensor:
        """Run right-padded prompts, write their K/V at `slots`, return each prompt's last-token logits.
        ids (B, T), lens (B,), slots (B, T) flat cache slots (page * S + offset; pads point at scratch).
        Right padding needs no mask: causal attention never lets a real token see a pad after it."""
        cfg = self.cfg
        B, T = ids.shape
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = F.embedding(ids, self.embed)                                           # (B, T, C)
        cos, sin = (t[:T].to(x.dtype)[None, :, None] for t in (self.cos, self.sin))  # (1, T, 1, D) each
        flat_slots = slots.reshape(-1)                                              # (B*T,)
        for i in range(cfg.num_hidden_layers):
            h = rms_norm(x, self.ln1[i], cfg.rms_norm_eps)
            q, k, v = F.linear(h, self.w_qkv[i], self.b_qkv[i]).split(self.qkv_sizes, dim=-1)
            q = apply_rope(q.view(B, T, H, D), cos, sin)                            # (B, T, H, D)
            k = apply_rope(k.view(B, T, K, D), cos, sin)                            # (B, T, K, D)
            v = v.view(B, T, K, D)
            for pool, rows in ((k_pools[i], k), (v_pools[i], v)):                 # the K/V cache store
                pool.view(-1, K, D).index_copy_(0, flat_slots, rows.reshape(-1, K, D))
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)     # (B, H, T, D)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, H * D), self.w_o[i])
            x = self._mlp(i, x)
        last = x[torch.arange(B, device=ids.device), lens - 1]                      # (B, C)
        return F.linear(rms_norm(last, self.norm, cfg.rms_norm_eps), self.lm_head)  # (B, V)

    def decode_logits(self, attn: str, tok, pos, block_table, live, k_pools: list[torch.Tensor],
                      v_pools: list[torch.Tensor], num_splits: int = 0) -> torch.Tensor:
        """One token per slot -> next-token logits (B, V). Finished / empty slots (live False) store nothing
        and attend over nothing; their logits are garbage that the bookkeeping ignores."""
        cfg = self.cfg
        B = tok.shape[0]
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        seq_lens = torch.where(live, pos.int() + 1, 0)                              # (B,) int32, 0 = store nothing
        x = F.embedding(tok, self.embed)                                            # (B, C)
        cos, sin = (t[pos].to(x.dtype) for t in (self.cos, self.sin))              # (B, D) each, all layers
        for i in range(cfg.num_hidden_layers):
            h = rms_norm(x, self.ln1[i], cfg.rms_norm_eps)
            q, k, v = F.linear(h, self.w_qkv[i], self.b_qkv[i]).split(self.qkv_sizes, dim=-1)
            o = decode_attention(attn, q.view(B, H, D), k.view(B, K, D), v.view(B, K, D), k_pools[i], v_pools[i],
                                 block_table, seq_lens, cos, sin, D ** -0.5, num_splits)  # (B, H, D)
            x = x + F.linear(o.reshape(B, H * D), self.w_o[i])
            x = self._mlp(i, x)
        return F.linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head)     # (B, V)


def sample_tokens(logits, params: SamplingParams, seed, ctr, sampler: str):
    """-> tokens (B,), log-probs (B,): `sample`, or the fused Triton kernel (the same draw) for plain temperature."""
    if sampler == "triton" and not params.greedy and params.top_k == 0 and params.top_p == 1.0:
        return torch.ops.minigrpo.fused_sample(logits, seed, ctr, params.temperature, SAMPLE_CHUNK)
    return sample(logits, params, seed, ctr)


ANY_TOKEN, NO_STOP = -1, -3  # in a row of `stops`: pads a shorter sequence on the left / marks a row unused


def ends_with_stop(out_tok, ctr, stops):
    """(B,) bool: whether each slot's first ctr output tokens end with one of the stop sequences.
    out_tok (B, W), ctr (B,), stops (n_stop, L) int64: sequences right-aligned, left-padded with ANY_TOKEN
    (a stop id is ANY_TOKEN x (L-1) then the id); unused rows hold NO_STOP."""
    L = stops.shape[1]
    idx = ctr[:, None] - L + torch.arange(L, device=ctr.device)                      # (B, L) the last L columns
    last = out_tok.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, -2)              # before the output: no token
    return ((last[:, None, :] == stops) | (stops == ANY_TOKEN)).all(-1).any(-1)


def advance(logits, params: SamplingParams, tok, pos, ctr, seed, limit, done, stops, out_tok, out_logp,
            sampler: str = "torch") -> None:
    """Sample each live slot's next token and update the slot state in place (no host sync): tok/pos/ctr/
    seed/limit (B,) int64, done (B,) bool, stops (`ends_with_stop`), out_tok/out_logp (B, W).
    A finished slot keeps its state; its sample goes to the scratch column W-1."""
    live = ~done
    new_tok, new_logp = sample_tokens(logits, params, seed, ctr, sampler)           # (B,), (B,)
    col = torch.where(live, ctr, out_tok.shape[1] - 1)[:, None]                     # (B, 1)
    out_tok.scatter_(1, col, new_tok[:, None])
    out_logp.scatter_(1, col, new_logp[:, None])
    step = live.long()
    ctr.add_(step)
    pos.add_(step)
    tok.copy_(torch.where(live, new_tok, tok))
    done.logical_or_(live & (ends_with_stop(out_tok, ctr, stops) | (ctr >= limit)))


def decode_step(model: DecodeModel, attn: str, params: SamplingParams, tok, pos, ctr, seed, limit, done,
                block_table, out_tok, out_logp, stops, k_pools, v_pools, sampler: str = "torch",
                num_splits: int = 0) -> None:
    """The whole decode step, the unit `--compile step` compiles and CUDA graphs capture: static shapes but the batch,
    every state update an in-place write into a preallocated buffer, so it replays N times in a row, no host input."""
    logits = model.decode_logits(attn, tok, pos, block_table, ~done, k_pools, v_pools, num_splits)
    advance(logits, params, tok, pos, ctr, seed, limit, done, stops, out_tok, out_logp, sampler)
