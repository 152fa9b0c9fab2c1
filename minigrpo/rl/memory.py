"""A run's peak device memory per rank, estimated from its configs alone, before anything is allocated.

train.py compares the estimate with the GPU's free memory and stops at start, naming a setting that fits
(`leaner`), rather than running out of memory a minute in. Pure arithmetic, in allocated bytes (what
torch.cuda.max_memory_allocated reports) for the longest prompt; train.py adds a margin for the allocator.

    peak = resident + max(update, scoring)

resident (held from the first step on):
  weights           P x 4 bytes (fp32 master) or 2 (--weights bf16)
  optimizer         AdamW's two moments, each like the weights (optim.py)
  reference         the KL anchor (beta > 0): a copy of the policy; offloaded, on the device only from the
                    rollout to its scoring pass: counted with scoring instead
  weight_casts      fp32 weights on CUDA: autocast's bf16 copy of every matmul weight, kept for the backward
  engine_copy       the engine's own bf16 weights and RoPE tables (none when it shares the policy's)
  kv_pool           the engine's KV pages: this rank's full rollout, or kv_memory_fraction of free memory if less
  engine_workspace  the decode step's logits and sampler buffers, and a prefill of this rank's prompts
update (one micro-batch's forward and backward, the optimizer step's gradients):
  gradients         P x 4 (fp32); bf16: P x 2, or P x 4 while 3+ micro-batches are summed in fp32 (GradSync)
  ddp_buckets       with W > 1, DDP's flat gradient buckets: another P x gradient size
  activations       saved for the backward (_layer_bytes) by a micro-batch packed as the trainer packs it (its
                    rows' distinct prompts once: model/packing.py); a checkpointed layer only its input; + one
                    layer of backward work (with every layer checkpointed: + the one recomputed, too)
  lm_head           the log-probs' logits block and temporaries, the hidden states and their gradient, and
                    the head's weight gradient, whole before it is added to the weight's .grad
  optimizer_step    bf16 weights: StochasticAdamW's piece of concatenated small parameters (w, g, m, v; optim.py),
                    where it outgrows the backward's activations and lm_head, freed by then
scoring (the no-grad log-prob passes): one layer's working set for a scoring batch, plus its LM-head chunk
  (and an offloaded reference)

Under FSDP (W > 1) weights, optimizer and reference divide by W, the gradients are this rank's shard (plus,
with bf16 weights and several micro-batches, their whole fp32 sum), fsdp_gathered holds the root unit and
two layers gathered whole, and there are no DDP buckets.

Shape legend: P parameters, V vocabulary, C hidden size, F MLP width, Hq query heads, Hkv kv heads, D head dim,
L layers, W ranks, a / r bytes per activation / residual element.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minigrpo.engine.config import EngineConfig
from minigrpo.model.config import ModelConfig
from minigrpo.rl.config import TrainConfig
from minigrpo.rl.optim import CHUNK

# An eager layer also keeps the elementwise intermediates (fp32 norms, autocast's casts, SwiGLU's activation): 1.5x
# to 1.65x the compiled layer's per-token bytes, counted op by op (measured 1.55x before packing: bench/NOTES.md).
# The estimate is an upper bound, so it takes the top of that range with a margin.
EAGER_FACTOR = 1.75
# Per (token, vocabulary) element of an LM-head block at its peak: chunked, fp32 logits and one fp32 temporary;
# full logits (chunk 0), the log-softmax kept for the backward, its gradient and one temporary.
CHUNK_LOGIT_BYTES, FULL_LOGIT_BYTES = 8, 12


@dataclass(frozen=True)
class MemoryEstimate:
    resident: dict[str, int]   # bytes held all run long, by term
    update: dict[str, int]     # bytes added during the update, by term
    scoring: int               # bytes added during the no-grad log-prob passes instead

    @property
    def total(self) -> int:
        return sum(self.resident.values()) + max(sum(self.update.values()), self.scoring)

    def __str__(self) -> str:
        terms = {**self.resident, **self.update} if sum(self.update.values()) >= self.scoring else \
            {**self.resident, "scoring": self.scoring}
        return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in terms.items() if v) + " GiB"


def parameter_count(m: ModelConfig) -> int:
    """P: the model's parameters, a tied embedding counted once."""
    C, qkv = m.hidden_size, (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    layer = C * qkv + qkv + C * C + 3 * C * m.intermediate_size + 2 * C   # q/k/v (+ biases), o, MLP, 2 norms
    return m.vocab_size * C * (1 if m.tie_word_embeddings else 2) + m.num_hidden_layers * layer + C


@dataclass(frozen=True)
class _Packing:
    """The largest packed micro-batch of `rows` rows from `prompts` distinct prompts (model/packing.py)."""
    tokens: int   # each prompt once, every completion, the padding (at most 8 tokens)
    slots: int    # attention's row slots: rows (+ the padding's) x the longest row

    @classmethod
    def of(cls, rows: int, prompts: int, prompt_tokens: int, new_tokens: int) -> _Packing:
        longest = -(-(prompt_tokens + new_tokens) // 8) * 8
        return cls(prompts * prompt_tokens + rows * new_tokens + 8, (rows + 1) * longest)


def _layer_bytes(m: ModelConfig, a: int, r: int, p: _Packing, eager: bool = False) -> int:
    """Bytes a compiled decoder layer keeps for its backward over packing p (Inductor recomputes the elementwise
    ops and keeps the inputs of matmuls and attention). Per token: its input and the mid-layer residual (each
    norm's backward reads them) 2rC; the two normed matmul inputs 2aC; the attention output read back from its
    row aC; gate, up and their SwiGLU product 3aF; eager, EAGER_FACTOR times that (the elementwise
    intermediates are per token). Per row slot of attention (packing.row_attention): q, k, v a(C + 2KD), the
    output aC, its log-sum-exp 4H."""
    C, KD, H = m.hidden_size, m.num_key_value_heads * m.head_dim, m.num_attention_heads
    per_token = (2 * r * C + a * (3 * C + 3 * m.intermediate_size)) * (EAGER_FACTOR if eager else 1)
    return int(p.tokens * per_token + p.slots * (a * (2 * C + 2 * KD) + 4 * H))


def _engine(m: ModelConfig, engine: EngineConfig, P: int, prompts: int, prompt_tokens: int, e: int,
            free: int | None, shared: bool) -> dict:
    """The rollout engine's terms, its dtype e bytes; free: what its KV pool may take a fraction of; shared:
    the engine's weights are the policy's (same dtype: engine/decode.py)."""
    C, D = m.hidden_size, m.head_dim
    copy = P * e * (not shared) + 2 * engine.max_seq_len * D * 4  # shared: the policy's own weights; cos / sin
    page = engine.page_bytes(m, e)
    pages = engine.kv_page_count(None if free is None else free - copy, page)  # free once the copy is made
    workspace = (engine.max_batch * m.vocab_size * (e + CHUNK_LOGIT_BYTES)                # the decode step
                 + prompts * prompt_tokens * (4 * C + 3 * m.intermediate_size) * e)    # a prefill
    return {"engine_copy": copy, "kv_pool": pages * page, "engine_workspace": workspace}


def _logits(cfg: TrainConfig, tokens: int, V: int) -> int:
    """The LM-head block's peak bytes for `tokens` scored tokens (logprobs.py)."""
    if cfg.logprob_chunk_size == 0:
        return tokens * V * FULL_LOGIT_BYTES
    return min(cfg.logprob_chunk_size, tokens) * V * CHUNK_LOGIT_BYTES


def estimate(m: ModelConfig, cfg: TrainConfig, *, prompt_tokens: int, engine: EngineConfig | None = None,
             world: int = 1, cuda: bool = True, capacity: int | None = None) -> MemoryEstimate:
    """Peak bytes of one rank. prompt_tokens: the longest prompt of a training batch; engine: the rollout
    engine's EngineConfig (max_batch = this rank's B x G / W), None for the reference generator; cuda: bf16
    engine and, with fp32 weights, bf16 autocast (else everything in the weights' dtype); capacity: the
    device's free bytes before the run, which caps the KV pool (None: uncapped)."""
    C, V, L = m.hidden_size, m.vocab_size, m.num_hidden_layers
    P, w = parameter_count(m), 4 if cfg.weights == "fp32" else 2
    amp = cuda and cfg.weights == "fp32"
    a, r = (2 if amp else w), w                      # matmul activations in bf16 under autocast; residual in w
    # the most rows of one rank in a minibatch: one permutation of all ranks' rows draws it (Trainer._minibatches),
    # so a rank's share can pass M / W, up to all of its own rows
    rows = min(cfg.rows_per_minibatch, cfg.rows_per_step // world)
    prompts = max(1, cfg.prompts_per_step // world)  # ... and its prompts: a micro-batch packs at most these
    mb, ms = min(cfg.micro_batch_size, rows), min(cfg.score_batch_size, cfg.rows_per_step // world)
    packing = _Packing.of(mb, min(mb, prompts), prompt_tokens, cfg.max_new_tokens)
    scoring_packing = _Packing.of(ms, min(ms, prompts), prompt_tokens, cfg.max_new_tokens)

    fsdp = cfg.parallel == "fsdp" and world > 1
    micro_batches = -(-rows // cfg.micro_batch_size)
    # bf16 gradients are summed in fp32 from three micro-batches on, and whole under FSDP from two (GradSync)
    fp32_sums = w == 2 and micro_batches >= (2 if fsdp else 3)
    reference = P * w if cfg.kl_beta > 0 else 0
    resident = {"weights": P * w, "optimizer": 2 * P * w, "reference": 0 if cfg.offload_reference else reference}
    gradients = P * (4 if fp32_sums else w)
    if fsdp:
        root = V * C * (1 if m.tie_word_embeddings else 2) + C
        resident = {k: v // world for k, v in resident.items()} | {"fsdp_gathered": (root + 2 * (P - root) // L) * w}
        gradients = P * w // world + (P * 4 if fp32_sums else 0)
    # autocast casts every matmul weight but the embedding, and the LM head (the embedding itself when tied)
    resident["weight_casts"] = 2 * (P - L * 2 * C - C - (0 if m.tie_word_embeddings else V * C)) if amp else 0
    if engine is not None:
        free = None if capacity is None else capacity - resident["weights"]
        e = 2 if cuda else 4
        resident.update(_engine(m, engine, P, max(1, cfg.prompts_per_step // world), prompt_tokens, e, free,
                                shared=e == w and not fsdp))

    layer = _layer_bytes(m, a, r, packing, eager=not cfg.compile_policy)                   # one layer's batch
    # The recomputed layers keep their inputs, the others all they save, and the backward works on one layer more:
    # the top layer's gradients at first, later a recomputed layer's, once the kept layers are freed (hence >= 2).
    Lr = cfg.recomputed_layers(L)
    kept = Lr * packing.tokens * r * C + max(L - Lr + 1, 2) * layer
    scored = mb * cfg.max_new_tokens                                                      # log-probs taken
    update = {"gradients": gradients, "ddp_buckets": P * w if world > 1 and not fsdp else 0, "activations": int(kept),
              "lm_head": _logits(cfg, scored, V) + scored * C * (a + 4) + V * C * w}  # hidden states, fp32 grads
    piece = 4 * 2 * min(CHUNK, P // world) if w == 2 else 0
    update["optimizer_step"] = max(0, piece - update["activations"] - update["lm_head"])
    scoring = (_layer_bytes(m, a, r, scoring_packing)                                       # one layer, no grad
               + _logits(cfg, ms * cfg.max_new_tokens, V) + (reference if cfg.offload_reference else 0))
    return MemoryEstimate(resident, update, scoring)


def fewest_recomputed(cfg: TrainConfig, layers: int, fits) -> int:
    """`--recompute-layers auto`: the fewest of the model's `layers` decoder layers that must recompute (the first
    ones; the others keep their activations, which is faster) for fits(cfg with them) to hold. All of them when
    even that does not fit: the memory check then names a setting that does."""
    return next((r for r in range(layers) if fits(replace(cfg, recompute_layers=r))), layers)


def leaner(cfg: TrainConfig, fits, allowed: set[str] | None = None) -> dict | None:
    """The first change to cfg, in order of what it costs, for which fits(changed cfg) holds: the KL reference
    offloaded (where there is one: under 1% of a 7B step), a smaller micro-batch (down to a quarter), activation
    checkpointing (one more forward), 256-token LM-head chunks, bf16 weights, and their combinations; last, the
    leanest settings with micro-batches down to 1 row. A change the config refuses (bf16 weights with a weight
    decay they cannot carry) is passed over, and so is one touching a field outside `allowed` (a resume's
    RESUMABLE_CHANGES: it refuses bf16 weights). Returns the changed TrainConfig fields, or None when nothing fits."""
    checkpointed = {"activation_checkpointing": True, "logprob_chunk_size": 256}
    lean = {"weights": "bf16", **checkpointed}
    changes = [{}, {"activation_checkpointing": True}, checkpointed,
               {"weights": "bf16"}, {"weights": "bf16", "activation_checkpointing": True}, lean]
    offload = [{}, {"offload_reference": True}] if cfg.kl_beta > 0 and cfg.parallel != "fsdp" else [{}]
    mb = cfg.micro_batch_size
    tries = [({**c, **o}, n) for c in changes for n in (mb, mb // 2, mb // 4) if n >= 1 for o in offload]
    tries += [({**c, **o}, mb >> k) for k in range(3, mb.bit_length()) for c in (lean, checkpointed) for o in offload]
    for change, n in tries:
        change = {**change, "micro_batch_size": n}
        if 0 < cfg.logprob_chunk_size < change.get("logprob_chunk_size", 0):
            del change["logprob_chunk_size"]  # never a larger chunk
        diff = {k: v for k, v in change.items() if getattr(cfg, k) != v}
        if allowed is not None and not diff.keys() <= allowed:
            continue
        changed = _replaced(cfg, diff) if diff else None
        if changed is not None and fits(changed):
            return diff
    return None


def _replaced(cfg: TrainConfig, change: dict) -> TrainConfig | None:
    """cfg with this change, or None where TrainConfig refuses it."""
    try:
        return replace(cfg, **change)
    except ValueError:
        return None
