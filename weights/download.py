"""Get a model directory: download Qwen2.5 from the Hugging Face Hub, or write a random-initialised one.

    python weights/download.py                                   # Qwen/Qwen2.5-0.5B-Instruct -> checkpoints/qwen2.5-0.5b-instruct
    python weights/download.py --repo Qwen/Qwen2.5-1.5B-Instruct --out checkpoints/qwen1.5b
    python weights/download.py --random-init --config path/to/config.json --out /tmp/random-qwen

Only the files a model directory needs are fetched (config, generation config, tokenizer, safetensors),
not the repository's other formats. A random directory is written with the same saver the trainer uses
for checkpoints, so every loading path can be exercised without a download.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from minigrpo.checkpoint import save_model
from minigrpo.config import ModelConfig
from minigrpo.model import Qwen2ForCausalLM, init_weights

DEFAULT_REPO = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULT_DIR = Path("checkpoints/qwen2.5-0.5b-instruct")
ALLOW = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "vocab.json", "merges.txt", "*.safetensors", "model.safetensors.index.json"]


def download(repo: str, out: Path, revision: str | None = None) -> Path:
    """Fetch the model files of `repo` into `out` (resumable; files already there are kept)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=out, allow_patterns=ALLOW)
    except LocalEntryNotFoundError:
        raise SystemExit(f"error: cannot reach the Hugging Face Hub to download {repo}. Either connect and run "
                         f"this again, copy a model directory (config.json, tokenizer files, *.safetensors) to "
                         f"{out} yourself, or pass an existing one with --model-dir. For a weight-free trial, "
                         f"`python weights/download.py --random-init --config CONFIG --out DIR`.") from None
    except HfHubHTTPError as e:
        raise SystemExit(f"error: the Hub refused {repo!r} ({e}). Check the repo name, or log in with "
                         f"`huggingface-cli login` for a gated model.") from None
    return out


def write_random(config_path: Path, out: Path, seed: int, dtype: torch.dtype,
                 tokenizer_dir: Path | None) -> Path:
    """A model directory with random weights for `config_path`'s architecture (HF's initialiser)."""
    cfg = ModelConfig.from_json(config_path)
    model = Qwen2ForCausalLM(cfg)
    init_weights(model, torch.Generator().manual_seed(seed), std=0.02)
    return save_model(model.to(dtype), out, tokenizer_dir=tokenizer_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=DEFAULT_REPO, help=f"Hub repository to download (default {DEFAULT_REPO})")
    p.add_argument("--revision", default=None, help="branch, tag or commit of --repo")
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"target directory (default {DEFAULT_DIR})")
    p.add_argument("--random-init", action="store_true",
                   help="write random weights for --config instead of downloading")
    p.add_argument("--config", type=Path, help="config.json (or its directory) for --random-init")
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="with --random-init: copy tokenizer and generation config from here "
                        "(default: the directory of --config)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-init")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the random weights")
    args = p.parse_args(argv)
    if args.random_init:
        if args.config is None:
            p.error("--random-init needs --config path/to/config.json")
        tok_dir = args.tokenizer_dir or (args.config if args.config.is_dir() else args.config.parent)
        out = write_random(args.config, args.out, args.seed, getattr(torch, args.dtype), tok_dir)
        print(f"wrote a random-initialised model to {out}")
    else:
        out = download(args.repo, args.out, args.revision)
        print(f"downloaded {args.repo} to {out}")


if __name__ == "__main__":
    sys.exit(main())
