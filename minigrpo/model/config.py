"""Model configuration, read from a Hugging Face `config.json`.

Only the fields this Qwen2 implementation uses are kept. Any other setting that would change the
computation (sliding window, RoPE scaling, another activation or model type) is an error, not ignored:
a model that loads but computes something else shows up in RL only as a reward curve a little off.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    # Not used by the computation, but written back on save so the checkpoint loads everywhere.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        for name in (*_REQUIRED, "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if not all(t is None or _is_int(t) and t >= 0 for t in [self.bos_token_id, *eos]):
            raise ValueError(f"bos_token_id and eos_token_id must be token ids (integers >= 0, eos also a list of "
                             f"them), got {self.bos_token_id!r} and {self.eos_token_id!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no model config at {path}; a model directory needs a config.json "
                                    f"(download one with `python weights/download.py`)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object, found {type(d).__name__}")
        _check_supported(d, path)
        missing = [f for f in _REQUIRED if f not in d]
        if missing:
            raise ValueError(f"{path}: missing required field(s) {missing}")
        kwargs = {f: d[f] for f in cls.__dataclass_fields__ if f in d}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])  # HF's default: no GQA
        rope_params = d.get("rope_parameters")  # transformers 5 nests rope_theta here
        if isinstance(rope_params, dict) and "rope_theta" in rope_params:
            kwargs.setdefault("rope_theta", rope_params["rope_theta"])
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def to_hf_dict(self, torch_dtype: str = "bfloat16") -> dict:
        """A config.json that transformers' Qwen2ForCausalLM loads as this exact architecture."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                 attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
                 head_dim=self.head_dim, torch_dtype=torch_dtype, use_cache=True)
        return d


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]


def _check_supported(d: dict, source: Path) -> None:
    model_type = d.get("model_type")
    if model_type != "qwen2":
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; only 'qwen2' (Qwen2, Qwen2.5) is")
    if d.get("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported; set it to false, or use another model")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling not in (None, {}) and (not isinstance(rope_scaling, dict) or
                                           rope_scaling.get("rope_type", rope_scaling.get("type")) != "default"):
        raise ValueError(f"{source}: rope_scaling {rope_scaling!r} is not supported; only null (plain RoPE) is")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported; Qwen2 uses 'silu' (SwiGLU)")
    head_dim, heads = d.get("head_dim"), d.get("num_attention_heads")
    if head_dim is not None and heads and head_dim * heads != d.get("hidden_size"):
        raise ValueError(f"{source}: head_dim {head_dim} x num_attention_heads {heads} != "
                         f"hidden_size {d.get('hidden_size')}; a decoupled head_dim is not supported")
    rope_params = d.get("rope_parameters")
    if isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters {rope_params!r} are not supported; only plain RoPE is")
