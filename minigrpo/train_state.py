"""Trainer checkpoints: an HF model directory plus everything needed to continue *exactly*.

    OUT/checkpoints/step_000050/model/             HF format (save_model): transformers loads it as-is
    OUT/checkpoints/step_000050/trainer_state.pt   optimizer, step (the LR is a function of it), RNGs, data position
    OUT/checkpoints/latest                         name of the newest complete checkpoint

The model is saved in the policy's own dtype (fp32 master weights), not rounded to bf16: a resumed run
must start from bit-identical weights to reproduce the uninterrupted one. A checkpoint is assembled in a
temporary sibling directory and renamed into place when complete, and `latest` is replaced atomically
after that, so a crash at any moment leaves the previous checkpoint usable.

The file is read with `torch.load(weights_only=True)`: it holds only tensors and plain Python values
(the numpy RNG state is stored as lists for that reason), so loading one runs no pickled code.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from minigrpo.checkpoint import load_model, save_model

STATE_FILE = "trainer_state.pt"
LATEST = "latest"


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_root: str | Path, step: int, model, state: dict, *,
                    tokenizer_dir: str | Path | None = None, keep: int = 0) -> Path:
    """Write checkpoint `step_{step:06d}` under ckpt_root atomically; keep the newest `keep` (0 = all)."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, tmp / "model", tokenizer_dir=tokenizer_dir)
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
    if final.exists():  # re-saving a step (e.g. after a resume): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    if keep > 0:
        for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, or from the run's output / checkpoints directory (newest one)."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            return root / (root / LATEST).read_text().strip()
    if (path / STATE_FILE).is_file():
        return path
    raise FileNotFoundError(f"no checkpoint at {path}: expected a checkpoint directory (holding {STATE_FILE}) "
                            f"or a run directory with checkpoints/{LATEST}; was the run saved (--save-every)?")


def load_checkpoint(path: str | Path, model, device: str | torch.device) -> dict:
    """Copy the checkpoint's weights into `model` and return the trainer state (RNG states restored)."""
    path = resolve_checkpoint(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {STATE_FILE}; the checkpoint is incomplete")
    saved = load_model(path / "model", dtype=next(model.parameters()).dtype, device=device)
    model.load_state_dict(saved.state_dict())
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    set_rng_state(state["rng"])
    return state
