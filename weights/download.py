"""Get a model directory: download Qwen2.5 from the Hugging Face Hub, or write a random-initialised one.

    python weights/download.py                      # Qwen/Qwen2.5-0.5B-Instruct -> checkpoints/qwen2.5-0.5b-instruct
    python weights/download.py --repo Qwen/Qwen2.5-1.5B-Instruct --out checkpoints/qwen1.5b
    python weights/download.py --random-init --out /tmp/random-qwen         # Qwen2.5-0.5B's shape and tokenizer
    python weights/download.py --random-init --config path/to/config.json --out /tmp/random-qwen   # offline

--random-init refuses an --out that holds files unless --overwrite is given (then it replaces the directory
once the new one is complete); a download resumes into --out, keeping the files already there.

Only the files a model directory needs are fetched (config, generation config, tokenizer, safetensors),
not the repository's other formats. A random directory is written with the same saver the trainer uses
for checkpoints, so every loading path can be exercised without downloading weights: from a local
config.json, or from --repo's config and tokenizer (a few MB).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import sys
import tempfile
from pathlib import Path

import torch

from minigrpo.model.checkpoint import save_model
from minigrpo.model.config import ModelConfig
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights
from minigrpo.model.tokenizer import Tokenizer
from minigrpo.run.cli import OneLineParser
from minigrpo.run.run_dir import run_owning

DEFAULT_REPO = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULT_DIR = Path("checkpoints/qwen2.5-0.5b-instruct")
NO_WEIGHTS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt"]
ALLOW = NO_WEIGHTS + ["*.safetensors", "model.safetensors.index.json"]


def download(repo: str, out: Path, revision: str | None = None, allow: list[str] = ALLOW) -> Path:
    """Fetch the model files of `repo` (those matching `allow`) into `out` (resumable; files already there are
    kept)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=out, allow_patterns=allow)
    except LocalEntryNotFoundError:
        raise SystemExit(f"error: cannot reach the Hugging Face Hub to download {repo}. Either connect and run "
                         f"this again, or give train.py / evaluate.py a model directory you have (config.json, "
                         f"tokenizer files, *.safetensors) with --model-dir. For a weight-free trial from a local "
                         f"config.json: `python weights/download.py --random-init --config CONFIG --out DIR`.") \
            from None
    except HfHubHTTPError as e:
        raise SystemExit(f"error: the Hub refused {repo!r} ({e}). Check the repo name, or log in with "
                         f"`huggingface-cli login` for a gated model.") from None
    return out


def write_random(config_path: Path, out: Path, seed: int, dtype: torch.dtype,
                 tokenizer_dir: Path | None, device: str = "cpu") -> Path:
    """A model directory with random weights for `config_path`'s architecture (HF's initialiser), drawn on
    `device` (each device's generator draws other numbers). Written atomically; what `out` held is replaced,
    so main refuses a non-empty `out` without --overwrite."""
    cfg = ModelConfig.from_json(config_path)
    with torch.device("meta"):  # no default initialisation: init_weights sets every parameter, once
        model = Qwen2ForCausalLM(cfg)
    model.to_empty(device=device).tie_weights()
    init_weights(model, torch.Generator(device).manual_seed(seed))
    return save_model(model, out, tokenizer_dir=tokenizer_dir, dtype=dtype)


def check_out(p: argparse.ArgumentParser, out: Path, random_init: bool, overwrite: bool) -> Path:
    """`out` as an absolute path, or a one-line error (before any download or drawing) where it cannot be the
    model directory: a file, under a file, or (for --random-init, without --overwrite) a directory with files."""
    given, out = out, Path(os.path.abspath(out))  # "x/.." -> its real name: the temporary directories go beside it
    if not out.name:
        p.error(f"--out {given}: the root cannot be a model directory; choose another --out")
    if out.exists() and not out.is_dir():
        p.error(f"--out {given} is a file, not a directory; choose another --out")
    if (run := run_owning(out)) is not None:
        p.error(f"--out {given} lies among the files of the run in {run} (its checkpoints are written by train.py "
                f"only); choose another --out")
    if random_init and out.is_symlink():  # replacing the directory would replace the link, not what it names
        p.error(f"--out {given} is a symbolic link; give the directory it points to, {out.resolve()}")
    parent = next(a for a in out.parents if a.exists())
    if not parent.is_dir():
        p.error(f"--out {given}: {parent} is a file, not a directory; choose another --out")
    if random_init and not overwrite and out.is_dir() and any(out.iterdir()):
        p.error(f"--out {given} already exists and is not empty; pass --overwrite to replace it (its files are "
                f"deleted), or choose another --out")
    if random_init and overwrite and out.is_dir():
        others = sorted(f.name for f in out.iterdir() if not (f.is_file() and _model_file(f.name)))
        if others:  # --overwrite deletes the folder: only ever a model directory
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            p.error(f"--out {given} holds more than a model directory ({shown}); --overwrite would delete it all: "
                    f"choose another --out")
        if Path.cwd().resolve().is_relative_to(out.resolve()):
            p.error(f"--out {given} is the folder you are working in; --overwrite would delete it: run from outside "
                    f"it, or choose another --out")
    return out


def _model_file(name: str) -> bool:
    """Whether `name` is a file a model directory holds (what --random-init --overwrite may delete)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in ALLOW)


def check_config(p: argparse.ArgumentParser, config: Path) -> None:
    """A one-line error where --config is not a readable Qwen2 config.json (or a directory holding one)."""
    if not config.exists():
        p.error(f"--config {config}: no such file or directory; pass a config.json (or the directory holding one)")
    try:
        ModelConfig.from_json(config)
    except (OSError, ValueError) as e:
        p.error(f"--config: {e}")  # the message names the file


def check_tokenizer(p: argparse.ArgumentParser, tok_dir: Path, vocab_size: int) -> None:
    """A one-line error where the tokenizer beside the model (if any) has ids past the config's vocab_size: the
    model could not embed its prompts."""
    if not (tok_dir / "tokenizer.json").is_file():
        return
    try:
        ids = Tokenizer.from_dir(tok_dir).vocab_size
    except (OSError, ValueError) as e:
        p.error(f"the tokenizer in {tok_dir} cannot be read: {e}")
    if ids > vocab_size:
        p.error(f"the tokenizer in {tok_dir} has {ids} token ids but the config's vocab_size is {vocab_size}; use a "
                f"config and a tokenizer of the same model (--tokenizer-dir)")


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """`model_dir` if given (train.py's and evaluate.py's --model-dir); otherwise DEFAULT_DIR, downloaded when
    missing."""
    if model_dir is not None:
        model_dir = Path(model_dir)
        if (model_dir / "model" / "config.json").is_file():  # a training checkpoint: its model is one level down
            raise FileNotFoundError(f"{model_dir} is a checkpoint, not a model directory: pass --model-dir "
                                    f"{model_dir / 'model'}")
        if (model_dir / "checkpoints").is_dir() or (model_dir / "latest").is_file():  # a run's: its models are
            ckpts = model_dir / "checkpoints" if (model_dir / "checkpoints").is_dir() else model_dir  # in step_*/
            raise FileNotFoundError(f"{model_dir} is a run folder, not a model directory: pass --model-dir "
                                    f"{ckpts / 'step_<N>' / 'model'}")
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json); download one with "
                                    f"`python weights/download.py --out {model_dir}`")
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir} holds no tokenizer.json: a model directory needs its tokenizer "
                                    f"files beside config.json (a checkpoint of train.py --preset smoke or learn has "
                                    f"none: its tokenizer is built in, and only that preset runs it)")
        return model_dir
    if not (DEFAULT_DIR / "config.json").is_file() or not any(DEFAULT_DIR.glob("*.safetensors")):
        print(f"no model at {DEFAULT_DIR}: downloading {DEFAULT_REPO} ...", file=sys.stderr)
        download(DEFAULT_REPO, DEFAULT_DIR)  # offline: exits with a message saying what to do
    return DEFAULT_DIR


@contextlib.contextmanager
def _interrupted_writes_nothing():
    """Ctrl-C while drawing or writing the weights: one line, and --out as it was (save_model writes a temporary
    folder, removed when interrupted, and renames it into place only when complete)."""
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit("interrupted: nothing was written") from None


RANDOM_INIT_ONLY = ("config", "tokenizer_dir", "seed", "dtype", "device", "overwrite")  # main's flags


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=DEFAULT_REPO, help=f"Hub repository to download (default {DEFAULT_REPO})")
    p.add_argument("--revision", default=None, help="branch, tag or commit of --repo")
    p.add_argument("--out", type=Path, default=None,
                   help=f"target directory (default {DEFAULT_DIR}; needed with --random-init)")
    p.add_argument("--random-init", action="store_true",
                   help="write random weights instead of downloading them, for --config (default: --repo's "
                        "config and tokenizer, downloaded)")
    p.add_argument("--config", type=Path, help="config.json (or its directory) for --random-init")
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="with --random-init: copy tokenizer and generation config from here "
                        "(default: the directory of --config)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-init, in [0, 2^63)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the random weights")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where --random-init draws the weights: cuda takes seconds for a 7B model, the CPU minutes")
    p.add_argument("--overwrite", action="store_true",
                   help="with --random-init: replace an --out that already holds files (they are deleted)")
    args = p.parse_args(argv)
    given = [f"--{d.replace('_', '-')}" for d in RANDOM_INIT_ONLY if getattr(args, d) != p.get_default(d)]
    if given and not args.random_init:
        p.error(f"{', '.join(given)}: for --random-init only; a download takes --repo, --revision and --out (and "
                f"resumes into --out, keeping the files already there)")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be in [0, 2^63), got {args.seed}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here; use --device cpu")
    if args.random_init:
        if args.out is None:
            p.error(f"--random-init needs --out DIR: {DEFAULT_DIR} is for the downloaded weights")
        out = check_out(p, args.out, random_init=True, overwrite=args.overwrite)
        if args.config is not None:
            check_config(p, args.config)
        if args.tokenizer_dir is not None and not (args.tokenizer_dir / "tokenizer.json").is_file():
            p.error(f"--tokenizer-dir {args.tokenizer_dir} holds no tokenizer.json; pass the folder holding it")
        with tempfile.TemporaryDirectory() as tmp, _interrupted_writes_nothing():
            config = args.config or download(args.repo, Path(tmp), args.revision, allow=NO_WEIGHTS)
            tok_dir = args.tokenizer_dir or (config if config.is_dir() else config.parent)
            check_tokenizer(p, tok_dir, ModelConfig.from_json(config).vocab_size)
            try:
                write_random(config, out, args.seed, getattr(torch, args.dtype), tok_dir, args.device)
            except (OSError, ValueError) as e:  # the Hub's config unsupported, --out unwritable, disk full
                p.exit(1, f"error: {e}\n")
            except (RuntimeError, MemoryError) as e:  # torch's out-of-memory, on the host or the GPU
                p.exit(1, f"error: drawing the model's weights failed ({str(e).splitlines()[0][:200]}); a model this "
                          f"size needs more free memory on --device {args.device}\n")
            missing = "" if (tok_dir / "tokenizer.json").is_file() else (
                f", without a tokenizer (none in {tok_dir}): train.py and evaluate.py need one, so rerun with "
                f"--tokenizer-dir DIR --overwrite")
        print(f"wrote a random-initialised model to {args.out}{missing}")
    else:
        out = check_out(p, args.out or DEFAULT_DIR, random_init=False, overwrite=False)
        download(args.repo, out, args.revision)
        print(f"downloaded {args.repo} to {args.out or DEFAULT_DIR}")


if __name__ == "__main__":
    sys.exit(main())
