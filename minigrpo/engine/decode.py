"""The inference side of the model: packed weights, batched prefill, and the decode step.

Weights are laid out for inference: q/k/v fused into one matmul and gate/up into another, one set per
layer (`LayerWeights`). When the policy's parameters have the engine's dtype and device (`--weights bf16` on CUDA),
`load_from` makes each one a view of the slice that holds it, so the optimizer updates the engine in
place; otherwise it copies after each update. The buffers never move, so captured CUDA graphs stay valid.

Shape legend: B batch slots (in a prefill: prompts), T prompt length, C hidden, Hq query heads, Hkv kv heads, D head
dim, F MLP width, V vocabulary, L layers, M block-table width, S page size, W output width (max_seq_len + 1, the
last column scratch).
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention import sdpa_kernel

import minigrpo.kernels  # noqa: F401  (registers torch.ops.minigrpo.*)
from minigrpo.engine.attention import decode_attention
from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import NOT_CUDNN, Qwen2ForCausalLM, apply_rope, rms_norm, rope_cos_sin
from minigrpo.model.sampling import SAMPLE_CHUNK, SamplingParams, sample


def qkv_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """Widths of q, k and v in the fused q/k/v projection's output: Hq * D, Hkv * D, Hkv * D."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return q, kv, kv


class LayerWeights(nn.Module):
    """One decoder layer's inference weights, as buffers, q/k/v fused and gate/up fused. Each is an allocation of
    its own, not a slice of one tensor stacked over layers: torch 2.11 reuses a compiled region
    (`decoder_layer`) only for inputs that are not views into a larger tensor."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        C, Fw, (Q, KV, _) = cfg.hidden_size, cfg.intermediate_size, qkv_sizes(cfg)
        shapes = {"ln1": (C,), "w_qkv": (Q + 2 * KV, C), "b_qkv": (Q + 2 * KV,), "w_o": (C, Q),
                  "ln2": (C,), "w_gate_up": (2 * Fw, C), "w_down": (C, Fw)}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The weights in the order `decoder_layer`'s function takes them."""
        return self.ln1, self.w_qkv, self.b_qkv, self.w_o, self.ln2, self.w_gate_up, self.w_down


class DecodeModel(nn.Module):
    """Inference weights, as buffers: the engine never differentiates them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int):
        super().__init__()
        self.cfg = cfg
        C, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
        self.layers = nn.ModuleList(LayerWeights(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        for name, shape in {"embed": (V, C), "norm": (C,), "lm_head": (V, C)}.items():
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
        m, (q, k, _), Fw = model.model, qkv_sizes(self.cfg), self.cfg.intermediate_size
        pairs = [(m.embed_tokens.weight, self.embed), (m.norm.weight, self.norm)]
        if not self.cfg.tie_word_embeddings:  # tied: lm_head.weight is the embedding's Parameter
            pairs.append((model.lm_head.weight, self.lm_head))
        for layer, lw in zip(m.layers, self.layers):
            a, mlp, w, b = layer.self_attn, layer.mlp, lw.w_qkv, lw.b_qkv
            pairs += [(layer.input_layernorm.weight, lw.ln1), (layer.post_attention_layernorm.weight, lw.ln2),
                      (a.q_proj.weight, w[:q]), (a.k_proj.weight, w[q:q + k]), (a.v_proj.weight, w[q + k:]),
                      (a.q_proj.bias, b[:q]), (a.k_proj.bias, b[q:q + k]), (a.v_proj.bias, b[q + k:]),
                      (a.o_proj.weight, lw.w_o), (mlp.gate_proj.weight, lw.w_gate_up[:Fw]),
                      (mlp.up_proj.weight, lw.w_gate_up[Fw:]), (mlp.down_proj.weight, lw.w_down)]
        return pairs

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> torch.Tensor:
        """Run right-padded prompts, write their K/V at `slots`, return each prompt's last-token logits.
        ids (B, T), lens (B,), slots (B, T) flat cache slots (page * S + offset; pads point at scratch).
        Right padding needs no mask: causal attention never lets a real token see a pad after it."""
        cfg = self.cfg
        B, T = ids.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = F.embedding(ids, self.embed)                                           # (B, T, C)
        cos, sin = (t[:T].to(x.dtype)[None, :, None] for t in (self.cos, self.sin))  # (1, T, 1, D) each
        flat_slots, sizes = slots.reshape(-1), qkv_sizes(cfg)                       # (B*T,)
        for lw, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            h = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
            q, k, v = F.linear(h, lw.w_qkv, lw.b_qkv).split(sizes, dim=-1)
            q = apply_rope(q.view(B, T, Hq, D), cos, sin)                           # (B, T, Hq, D)
            k = apply_rope(k.view(B, T, Hkv, D), cos, sin)                          # (B, T, Hkv, D)
            v = v.view(B, T, Hkv, D)
            for pool, rows in ((k_pool, k), (v_pool, v)):                 # the K/V cache store
                pool.view(-1, Hkv, D).index_copy_(0, flat_slots, rows.reshape(-1, Hkv, D))
            with sdpa_kernel(NOT_CUDNN):  # the trainer's kernels (qwen2.Attention), so the first token's too
                y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True)  # (B, Hq, T, D)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, Hq * D), lw.w_o)
            gate, up = F.linear(rms_norm(x, lw.ln2, cfg.rms_norm_eps), lw.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.w_down)
        last = x[torch.arange(B, device=ids.device), lens - 1]                      # (B, C)
        return F.linear(rms_norm(last, self.norm, cfg.rms_norm_eps), self.lm_head)  # (B, V)

    def decode_logits(self, layer, tok, pos, block_table, live, k_pools: list[torch.Tensor],
                      v_pools: list[torch.Tensor]) -> torch.Tensor:
        """One token per slot -> next-token logits (B, V), each layer through `layer` (`decoder_layer`'s).
        Finished / empty slots (live False) store nothing and attend over nothing; their logits are garbage that
        the bookkeeping ignores."""
        seq_lens = torch.where(live, pos.int() + 1, 0)                              # (B,) int32, 0 = store nothing
        cos, sin = (t[pos].to(self.embed.dtype) for t in (self.cos, self.sin))     # (B, D) each, all layers
        # Layer 0 has no attention or MLP outputs to add.
        x, attn_out, mlp_out = F.embedding(tok, self.embed), None, None             # (B, C)
        for lw, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            x, attn_out, mlp_out = layer(x, attn_out, mlp_out, lw.tensors(), k_pool, v_pool, block_table, seq_lens,
                                         cos, sin)
        x = x + attn_out + mlp_out                                                  # (B, C)
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head)  # (B, V)


def decoder_layer(cfg: ModelConfig, attn: str, num_splits: int):
    """One decoder layer for one token per slot, for this model shape and attention backend. It takes the
    residual stream as three terms, (x, the previous layer's attention output, its MLP output), and returns the
    same three for the next layer, whose first norm adds them: the residual adds fuse with the norms, and the
    o-projection's output is not summed into a returned tensor (Inductor would then fold the add into the matmul
    as a cuBLAS addmm and copy the residual into its output first, one extra copy per layer).

    Its two halves, before and after attention, are nested compile regions: torch.compile traces and compiles
    each a few times, not once per layer (torch 2.11 reuses one from its third call on). Layer 0's first half
    has no residual terms to add and runs outside them. The attention, which writes the K/V cache, runs between
    them in the step's own graph: a region must not mutate its inputs (torch 2.11 fails to functionalise one
    that does). Dynamo inlines a region called with anything but tensors, hence the settings bound here. Eager,
    the decorator does nothing."""
    Hq, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    sizes = qkv_sizes(cfg)

    def qkv_projection(x, ln1, w_qkv, b_qkv):
        return x, F.linear(rms_norm(x, ln1, eps), w_qkv, b_qkv)                    # (B, C), (B, (Hq + 2Hkv) D)

    @torch.compiler.nested_compile_region
    def before_attention(x, attn_out, mlp_out, ln1, w_qkv, b_qkv):
        return qkv_projection(x + attn_out + mlp_out, ln1, w_qkv, b_qkv)

    @torch.compiler.nested_compile_region
    def after_attention(x, o, w_o, ln2, w_gate_up, w_down):
        attn_out = F.linear(o, w_o)                                                 # (B, C)
        gate, up = F.linear(rms_norm(x + attn_out, ln2, eps), w_gate_up).chunk(2, dim=-1)  # (B, F) each
        return attn_out, F.linear(F.silu(gate) * up, w_down)                        # (B, C) each

    def layer(x, attn_out, mlp_out, weights, k_pool, v_pool, block_table, seq_lens, cos, sin):
        ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down = weights
        B = x.shape[0]
        x, qkv = (qkv_projection(x, ln1, w_qkv, b_qkv) if attn_out is None else  # layer 0, outside any region
                  before_attention(x, attn_out, mlp_out, ln1, w_qkv, b_qkv))
        q, k, v = qkv.split(sizes, dim=-1)
        o = decode_attention(attn, q.view(B, Hq, D), k.view(B, Hkv, D), v.view(B, Hkv, D), k_pool, v_pool,
                             block_table, seq_lens, cos, sin, D ** -0.5, num_splits)   # (B, Hq, D)
        return (x, *after_attention(x, o.reshape(B, Hq * D), w_o, ln2, w_gate_up, w_down))
    return layer


def sample_tokens(logits, params: SamplingParams, seed, ctr, sampler: str):
    """-> tokens (B,), log-probs (B,): `sample`, or the fused Triton kernel (the same draw) for plain temperature."""
    if sampler == "triton" and not params.greedy and params.top_k == 0 and params.top_p == 1.0:
        return torch.ops.minigrpo.fused_sample(logits, seed, ctr, params.temperature, SAMPLE_CHUNK)
    return sample(logits, params, seed, ctr)


# Not token ids: in a row of `stops`, ANY_TOKEN pads a shorter sequence on the left and NO_STOP marks the row unused;
# NO_TOKEN stands for the columns before a slot's first output token, so that it matches neither.
ANY_TOKEN, NO_TOKEN, NO_STOP = -1, -2, -3


def ends_with_stop(out_tok, ctr, stops):
    """(B,) bool: whether each slot's first ctr output tokens end with one of the stop sequences.
    out_tok (B, W), ctr (B,), stops (n_stop, n) int64: sequences right-aligned, left-padded with ANY_TOKEN
    (a stop id is ANY_TOKEN x (n-1) then the id); unused rows hold NO_STOP."""
    n = stops.shape[1]
    idx = ctr[:, None] - n + torch.arange(n, device=ctr.device)                      # (B, n) the last n columns
    last = out_tok.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, NO_TOKEN)        # (B, n)
    return ((last[:, None, :] == stops) | (stops == ANY_TOKEN)).all(-1).any(-1)


def advance(logits, params: SamplingParams, tok, pos, ctr, seed, limit, done, stops, out_tok, out_logp,
            sampler: str) -> None:
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


def decode_step(model: DecodeModel, layer, params: SamplingParams, tok, pos, ctr, seed, limit, done,
                block_table, out_tok, out_logp, stops, k_pools, v_pools, sampler: str) -> None:
    """The whole decode step, the unit `--compile step` compiles and CUDA graphs capture, each layer through `layer`
    (`decoder_layer`'s): static shapes but the batch, every state update an in-place write into a preallocated
    buffer, so it replays N times in a row, no host input."""
    logits = model.decode_logits(layer, tok, pos, block_table, ~done, k_pools, v_pools)
    advance(logits, params, tok, pos, ctr, seed, limit, done, stops, out_tok, out_logp, sampler)
