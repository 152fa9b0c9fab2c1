"""Qwen2.5 tokenizer: byte-level BPE from `tokenizer.json` plus the chat template in plain Python.

The package must not import transformers at run time. The BPE is the Rust `tokenizers` library reading the
published `tokenizer.json` (what transformers wraps), so encode/decode are bit-identical; `render_chat` re-implements
the Qwen2.5 Jinja chat template for plain system/user/assistant turns (no tools), checked against
`apply_chat_template` id for id in tests/test_tokenizer.py. Stop tokens come from `generation_config.json`
(`<|im_end|>` and `<|endoftext|>` for Qwen2.5-Instruct). The model's embedding has more rows than the tokenizer
has tokens; `decode` drops ids in that padding.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as _BPE

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")

# sha256 of the Qwen2.5(-Instruct) Jinja chat template that `render_chat` re-implements. A directory with a
# different template still loads, but with a warning: its model expects prompts we would not produce.
_QWEN25_TEMPLATE_SHA256 = "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"

_DOWNLOAD_HINT = "Download the tokenizer and weights first: `python weights/download.py`."


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it and re-download. {_DOWNLOAD_HINT}") from None


class Tokenizer:
    """Text <-> token ids for Qwen2.5, plus chat-prompt rendering. Build with `Tokenizer.from_dir(path)`."""

    def __init__(self, bpe: _BPE, eos_id: int, pad_id: int, stop_ids: Sequence[int]):
        self._bpe = bpe
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.stop_ids: tuple[int, ...] = tuple(stop_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (tokenizer.json, tokenizer_config.json, generation_config.json)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist. {_DOWNLOAD_HINT}")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path / name} is missing (the directory is incomplete). {_DOWNLOAD_HINT}")
        try:
            bpe = _BPE.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ValueError(f"{path / 'tokenizer.json'} could not be parsed ({e}); re-download it. "
                             f"{_DOWNLOAD_HINT}") from None
        config = _read_json(path / "tokenizer_config.json")
        _check_added_tokens_agree(bpe, config, path)
        template = config.get("chat_template")
        if isinstance(template, str) and hashlib.sha256(template.encode()).hexdigest() != _QWEN25_TEMPLATE_SHA256:
            warnings.warn(f"{path / 'tokenizer_config.json'} has a chat template different from Qwen2.5's; render_chat "
                          "still produces Qwen2.5 prompts, which this model may not expect", stacklevel=2)
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}

        def id_of(token: str | Mapping[str, Any] | None) -> int | None:
            # tokenizer_config.json spells a special token either "<|x|>" or {"content": "<|x|>", ...}
            token = token.get("content") if isinstance(token, Mapping) else token
            return None if token is None else bpe.token_to_id(token)

        eos_id = id_of(config.get("eos_token"))
        # Without an eos_token_id in generation_config.json: the declared eos plus the turn and document terminators
        # Qwen emits.
        stop = gen.get("eos_token_id")
        stop = [eos_id, id_of(IM_END), id_of(ENDOFTEXT)] if stop is None else stop
        stop = [stop] if not isinstance(stop, list) else stop
        stop_ids = list(dict.fromkeys(i for i in stop if i is not None))
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < bpe.get_vocab_size(True)
                   for i in stop_ids):
            raise ValueError(f"{gen_path}: eos_token_id {gen['eos_token_id']!r} is not a token id of this tokenizer "
                             f"(an integer, or a list of them); fix it, or delete the file to stop at Qwen's "
                             f"terminators")
        if not stop_ids:
            raise ValueError(f"no stop token in {path}: no eos_token in tokenizer_config.json, no eos_token_id in "
                             f"generation_config.json, and neither {IM_END} nor {ENDOFTEXT} in the vocabulary")
        eos_id = stop_ids[0] if eos_id is None else eos_id
        # Pad only fills positions that are masked out, so any valid id works; prefer the declared one.
        pad_id = next((i for i in (id_of(config.get("pad_token")), gen.get("pad_token_id")) if i is not None), eos_id)
        return cls(bpe, eos_id=eos_id, pad_id=pad_id, stop_ids=stop_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (BPE vocab + added/special tokens)."""
        return self._bpe.get_vocab_size(with_added_tokens=True)

    def check_fits(self, model_vocab_size: int, model_dir: str | Path) -> None:
        """Refuse a model whose embedding has fewer rows than this tokenizer has ids (its tokenizer files are
        another model's): a prompt token past the table would fail deep inside the first forward."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"{model_dir}: the tokenizer has {self.vocab_size} token ids but the model's embedding "
                             f"only {model_vocab_size}; its tokenizer files belong to another model: put the "
                             f"model's own beside its config.json")

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. Adds no BOS/EOS (Qwen uses none). Special-token strings in `text` become special ids."""
        return self._bpe.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = True) -> str:
        """ids (list or 1-D tensor) -> text. Special tokens (<|im_end|>, ...) are dropped unless asked for."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a conversation exactly as Qwen2.5's Jinja chat template does (tools excluded)."""
        _validate_messages(messages)
        # The template always opens with a system turn: the default one unless the chat starts with its own.
        # A later system message is not special-cased by the template: it is rendered like any other turn.
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *messages]
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """`render_chat` then `encode`: the prompt ids the model sees."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt))


def _check_added_tokens_agree(bpe: _BPE, config: Mapping[str, Any], path: Path) -> None:
    for str_id, entry in config.get("added_tokens_decoder", {}).items():
        content = entry.get("content") if isinstance(entry, Mapping) else entry
        if bpe.token_to_id(content) != int(str_id):
            raise ValueError(f"{path}: tokenizer_config.json maps {content!r} to id {str_id} but tokenizer.json maps "
                             f"it to {bpe.token_to_id(content)}; the files are from different models. {_DOWNLOAD_HINT}")


def _validate_messages(messages: Any) -> None:
    if isinstance(messages, (Mapping, str)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}}, got {messages!r}")
    for i, m in enumerate(messages):
        if (not isinstance(m, Mapping) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str)
                or m.get("tool_calls")):
            raise ValueError(f"messages[{i}] is {m!r}; render_chat renders only {CHAT_ROLES} turns with str "
                             "content (no tools, no multimodal content)")
