"""Load and save Hugging Face model directories (safetensors), with errors that name the problem.

Loading builds the model on the meta device and reads each tensor straight onto the target device and
dtype, so a bf16 GPU model never exists as an fp32 host copy. Saving writes a directory transformers
loads as-is, never half-written: into a temporary sibling renamed into place only when complete (replace_dir).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Copied into a saved model from the directory it was loaded from, when there.
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Buffers some older checkpoints carry that this model recomputes instead of storing.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read: the index's shards when the checkpoint is sharded, else the one file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} is not a valid safetensors index: its 'weight_map' must map tensor names to "
                             f"file names")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that are not there: {missing}; "
                                    f"the download is incomplete, run `python weights/download.py` again")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    raise FileNotFoundError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}, found {present}. "
                            f"Download with `python weights/download.py`, or write a random model with "
                            f"`python weights/download.py --random-init --config CONFIG --out DIR`")


def _read_state_dict(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    device = str(torch.device(device))
    state = {}
    for path in _weight_files(model_dir):
        try:
            with safe_open(path, framework="pt", device=device) as f:
                for key in f.keys():
                    if key in state:
                        raise ValueError(f"tensor {key!r} appears in more than one file (again in {path})")
                    state[key] = f.get_tensor(key).to(dtype)
        except SafetensorError as e:
            raise ValueError(f"{path} is truncated or corrupt ({e}); download the model again, or, for a "
                             f"training checkpoint, resume from another checkpoint") from None
    return state


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu") -> Qwen2ForCausalLM:
    """A Qwen2ForCausalLM from an HF model directory: config.json + (sharded) safetensors."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist; download one with "
                                f"`python weights/download.py --out {model_dir}`")
    cfg = ModelConfig.from_json(model_dir / "config.json")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    # Some tied checkpoints store lm_head.weight anyway; the embedding is the truth.
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    state = {k: v for k, v in _read_state_dict(model_dir, dtype, device).items()
             if not k.endswith(_IGNORED_SUFFIXES) and k not in tied}
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match config.json: missing {len(missing)} tensor(s) "
                         f"{missing[:20]}, unexpected {len(unexpected)} tensor(s) {unexpected[:20]}")
    bad = [f"{k}: expected {tuple(expected[k])}, found {tuple(v.shape)}"
           for k, v in state.items() if v.shape != expected[k]]
    if bad:
        raise ValueError(f"{model_dir}: shape mismatch with config.json, {len(bad)} tensor(s): {'; '.join(bad[:20])}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter; share it again
    return model


def save_model(model: Qwen2ForCausalLM, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
               dtype: torch.dtype | None = None, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write an HF model directory, whole or not at all (replace_dir): model.safetensors, config.json,
    generation_config.json and the tokenizer files of `tokenizer_dir`. weights: the state dict to write (default:
    the model's own)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"cannot save a model to {out_dir}: it exists and is not a directory")
    cfg = model.config
    # Tied: no lm_head.weight; transformers re-ties it from the embedding on load.
    state = {k: v.detach().to(dtype or v.dtype, copy=False).contiguous().cpu()
             for k, v in (model.state_dict() if weights is None else weights).items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    saved_dtype = next(iter(state.values())).dtype
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    with written(tmp, f"the model to {out_dir}"):
        save_file(state, tmp / SINGLE_FILE, metadata={"format": "pt"})
        config = cfg.to_hf_dict(str(saved_dtype).removeprefix("torch."))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.copymode(tmp / "config.json", tmp / SINGLE_FILE)  # safetensors writes 0600: the umask's mode instead
        gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
               if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))  # unless the source has its own
        for name in COPIED_FILES if tokenizer_dir is not None else ():
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    replace_dir(tmp, out_dir)
    return out_dir


@contextlib.contextmanager
def written(tmp: Path, what: str):
    """Write into the fresh folder `tmp` inside. A failed write (a full disk: torch.save and safetensors report
    it as RuntimeError / SafetensorError, not OSError) removes `tmp` and is an OSError that names `what`; an
    interrupted one (Ctrl-C) removes `tmp` too."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (RuntimeError, SafetensorError)):  # torch's message for a full disk names no disk
            free = shutil.disk_usage(tmp.parent).free
            raise OSError(f"writing {what} failed ({e}); its disk has {free / 2**30:.1f} GiB free") from e
        raise


def fsync_tree(path: Path, recursive: bool = True) -> None:
    """Flush a file, or a folder (and, recursive, everything in it), to the disk: a rename that publishes it
    then survives a power loss or a kernel crash too, not only a crash of this process."""
    for p in ([*path.rglob("*"), path] if recursive and path.is_dir() else [path]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(new: Path, target: Path) -> None:
    """Move `new`, flushed to the disk, into place at `target`; an old `target` is removed only after the new one
    is in place. A directory cannot be swapped in one rename: a crash between the two leaves no `target`, the old
    copy whole at `.NAME.old-PID` beside it, and `new` whole at its own name."""
    fsync_tree(new)
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old)
    else:
        os.replace(new, target)
    fsync_tree(target.parent, recursive=False)  # the rename itself
