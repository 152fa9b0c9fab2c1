"""Trainer checkpoints: an HF model directory plus everything needed to continue *exactly*.

    OUT/checkpoints/step_000050/model/             HF format (save_model): transformers loads it as-is
    OUT/checkpoints/step_000050/trainer_state.pt   optimizer, step (the LR is a function of it), data position
    OUT/checkpoints/latest                         name of the newest complete checkpoint

The model is saved in the policy's own dtype, not rounded to bf16: a resumed run starts from bit-identical
weights. A checkpoint is assembled in a temporary sibling folder (`.step_*.tmp-PID`) and renamed into place
when complete, and only then is `latest` replaced (write, then rename), each flushed to the disk before its
rename, so a crash at any moment, of the process or of the machine, leaves `latest` naming a complete
checkpoint; the next start removes the leftovers (`remove_stale_temps`). A resume from an earlier checkpoint of
the run moves the later ones, and the logs as they were, to `checkpoints/abandoned-<time>/` (`set_aside_later`);
pruning keeps the newest `step_*` folders up to the step just written. The state file holds only
tensors and plain values, so it loads with `torch.load(weights_only=True)`, running no pickled code. No global
RNG state is saved: training draws every random number from (seed, step, ...).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import time
from pathlib import Path

import torch

from minigrpo.model.checkpoint import fsync_tree, load_model, replace_dir, save_model, written
from minigrpo.model.config import ModelConfig

STATE_FILE = "trainer_state.pt"
# The ModelConfig fields that set the weights' shapes: a checkpoint resumes only into the same architecture.
_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "tie_word_embeddings")
LATEST = "latest"
_DICTS = ("config", "optimizer", "sampler", "inputs")  # trainer_state.pt's entries besides the step


def save_checkpoint(ckpt_root: str | Path, step: int, model, state: dict, *, weights: dict | None = None,
                    tokenizer_dir: str | Path | None = None, keep: int = 0) -> Path:
    """Write checkpoint `step_{step:06d}` atomically, point `latest` at it, keep the newest `keep` up to it (0: all);
    a step `latest` names is not written twice. weights: the full state dict when `model` is sharded (FSDP)."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    if latest_name(ckpt_root) == final.name and (final / STATE_FILE).is_file():
        return final
    tmp = ckpt_root / f".{final.name}.tmp-{os.getpid()}"
    with written(tmp, f"checkpoint {final}"):
        save_model(model, tmp / "model", tokenizer_dir=tokenizer_dir, weights=weights)
        torch.save({**state, "step": step}, tmp / STATE_FILE)
    replace_dir(tmp, final)  # re-saving a step after a resume rewound the run: the new one replaces it
    set_latest(ckpt_root, final.name)
    if keep > 0:
        folders = step_folders(ckpt_root)
        for old in sorted(s for s in folders if s <= step)[:-keep]:
            doomed = ckpt_root / f".{folders[old].name}.pruned-{os.getpid()}"
            os.replace(folders[old], doomed)  # out of sight at once; a crash mid-delete leaves only a temp folder
            shutil.rmtree(doomed)
    return final


def fingerprint(parts) -> str:
    """A short digest of a sequence of byte strings (each length-prefixed: [ab][c] and [a][bc] differ), to tell on
    resuming whether an input is the one the checkpoint was trained on."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:16]


def step_folders(ckpt_root: Path) -> dict[int, Path]:
    """The checkpoint folders `step_<N>` under ckpt_root, by step."""
    return {int(p.name.removeprefix("step_")): p for p in ckpt_root.glob("step_*")
            if p.is_dir() and p.name.removeprefix("step_").isdigit()}


def latest_name(ckpt_root: str | Path) -> str | None:
    """The folder name `latest` holds, or None without one."""
    path = Path(ckpt_root) / LATEST
    return path.read_text().strip() if path.is_file() else None


def set_latest(ckpt_root: str | Path, name: str) -> None:
    """Point `latest` at the complete checkpoint `name`, atomically."""
    tmp = Path(ckpt_root) / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(name + "\n")
    fsync_tree(tmp)
    os.replace(tmp, Path(ckpt_root) / LATEST)
    fsync_tree(Path(ckpt_root), recursive=False)


def set_aside_later(out_dir: Path, step: int) -> Path | None:
    """A resume that rewinds the run to `step`, before `latest`: its later checkpoints, and its logs as they
    stand, go into `checkpoints/abandoned-<UTC time>/` (never pruned, never resumed from), so the future being
    replaced stays on the disk. None when no checkpoint is later."""
    root = out_dir / "checkpoints"
    later = [p for s, p in step_folders(root).items() if s > step]
    if not later:
        return None
    aside = root / f"abandoned-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    aside.mkdir()
    for log in out_dir.glob("*.jsonl"):
        shutil.copy2(log, aside / log.name)
    fsync_tree(aside)
    for ckpt in later:
        os.replace(ckpt, aside / ckpt.name)
    for folder in (root, aside):  # each move changed both folders' entries
        fsync_tree(folder, recursive=False)
    return aside


def remove_stale_temps(ckpt_root: str | Path) -> None:
    """Delete the temporary folders and files an interrupted save or prune left under ckpt_root (names starting
    with a dot). Call only while no process is writing checkpoints there."""
    for path in [*Path(ckpt_root).glob(".step_*"), *Path(ckpt_root).glob(f".{LATEST}.tmp-*")]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, or from the run's output / checkpoints directory (newest one)."""
    path = Path(path)
    if path.name == LATEST and path.is_file():  # RUN/checkpoints/latest: the checkpoint it names
        path = path.parent
    for root in (path, path / "checkpoints"):
        name = latest_name(root)
        if name is not None:
            if not (name.startswith("step_") and name.removeprefix("step_").isdigit()):  # edited by hand
                raise ValueError(f"{root / LATEST} names {name!r}, not a checkpoint folder of this run (step_<N>); "
                                 f"write the name of one of {root}'s step_* folders into it")
            if not (root / name / STATE_FILE).is_file():
                raise FileNotFoundError(f"{root / LATEST} names {name}, which is missing or incomplete; resume "
                                        f"from a complete checkpoint folder under {root} instead")
            return root / name
    if (path / STATE_FILE).is_file():
        return path
    raise FileNotFoundError(f"no checkpoint at {path}: expected a checkpoint directory (holding {STATE_FILE}) "
                            f"or a run directory with checkpoints/{LATEST}; was the run saved (--save-every)?")


def load_checkpoint(path: str | Path, model) -> dict:
    """Copy the checkpoint's weights into `model` (into its shards, under FSDP) and return the trainer state. The
    weights are read into host memory, then copied tensor by tensor: no second full model on the device."""
    path = resolve_checkpoint(path)  # holds STATE_FILE
    ours, theirs = model.config, ModelConfig.from_json(path / "model" / "config.json")
    differ = [f"{k} {getattr(theirs, k)} vs {getattr(ours, k)}" for k in _SHAPE
              if getattr(theirs, k) != getattr(ours, k)]
    if differ:
        raise ValueError(f"cannot resume from {path}: its model has another shape than this run's "
                         f"(checkpoint vs now: {', '.join(differ)}); resume with the model it was trained from")
    saved = load_model(path / "model", dtype=next(model.parameters()).dtype, device="cpu").state_dict()
    # Imported here: ~1 s of start-up that weights/download.py (which imports this module through run_dir) never uses.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP: each full tensor in turn, cut to its shard
        set_model_state_dict(model, saved, options=StateDictOptions(full_state_dict=True))
    else:  # copied in place; set_model_state_dict would first copy the whole state dict to the device
        model.load_state_dict(saved)
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        missing = sorted({*_DICTS, "step"} - state.keys())
        if missing:
            raise KeyError(f"it lacks {', '.join(missing)}")
        if not isinstance(state["step"], int) or not all(isinstance(state[k], dict) for k in _DICTS):
            raise TypeError(f"its step must be an integer and its {', '.join(_DICTS)} dicts")
    except Exception as e:  # truncated, not a torch file, or not ours: the message names the file, not the parser
        why = ("not a torch file of tensors and plain values" if isinstance(e, pickle.UnpicklingError)  # torch's
               else (str(e).strip().splitlines() or [""])[0][:200])  # own message suggests loading it unsafely
        raise ValueError(f"{path / STATE_FILE} cannot be read ({type(e).__name__}: {why}); resume from another "
                         f"checkpoint") from e
    return state
