"""Evaluate a model directory: greedy accuracy, or k sampled completions per example with pass@k and mean@k.

    python evaluate.py --model-dir checkpoints/qwen2.5-0.5b-instruct --test-data test.jsonl --limit 200
    python evaluate.py --model-dir DIR --task math --template r1 --eval-samples 8 --eval-temperature 1
    torchrun --nproc-per-node 4 evaluate.py ...     # each rank evaluates its share of the examples

It takes train.py's task, template and evaluation flags (--eval-limit, --eval-max-new-tokens and --eval-batch-size
also as --limit, --max-new-tokens and --batch-size); the numbers are minigrpo/rl/evaluate.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from minigrpo.engine.rollout import ATTN_BACKENDS, make_backend
from minigrpo.model.checkpoint import load_model
from minigrpo.model.tokenizer import Tokenizer
from minigrpo.rl import distributed
from minigrpo.rl.evaluate import decoded, evaluate
from minigrpo.run.cli import OneLineParser, parse_device
from minigrpo.run.run_dir import run_owning
from minigrpo.run.stopping import nonfinite
from minigrpo.tasks.task import add_task_flags, load_task, prompt_budget
from weights.download import resolve_model_dir


def check_out(p: argparse.ArgumentParser, out: Path, overwrite: bool, *, test_data: str | None,
              model_dir: str | None) -> None:
    """A one-line error, before anything is evaluated, where the results could not be written to `out`, or would
    be written over the inputs (--test-data, or a file in --model-dir)."""
    if test_data is not None and Path(test_data).exists() and out.exists() and out.samefile(test_data):
        p.error(f"--out {out} is the --test-data file; write the results elsewhere")
    if model_dir is not None and out.resolve().is_relative_to(Path(model_dir).resolve()):
        p.error(f"--out {out} lies in the --model-dir it evaluates; write the results elsewhere")
    if (run := run_owning(out)) is not None:
        p.error(f"--out {out} is one of the files of the run in {run}, which only train.py writes; write the "
                f"results elsewhere")
    if out.is_dir():
        p.error(f"--out {out} is a directory; give a file path, e.g. {out / 'eval.jsonl'}")
    parent = out.parent
    if not parent.is_dir():
        p.error(f"--out {out}: {parent} is not an existing directory; create it first or choose another --out")
    if out.is_file() and not overwrite:
        p.error(f"--out {out} already exists; pass --overwrite to replace it, or choose another --out")
    if (out.is_file() or not out.exists()) and not os.access(parent, os.W_OK | os.X_OK):  # the temporary file
        p.error(f"--out {out}: cannot write in {parent}; choose another --out")


def write_records(out: Path, lines: list[str]) -> None:
    """Write `lines` to `out` whole or not at all: a temporary file beside it, renamed over it. A special file
    that exists (/dev/stdout, a pipe) is written to directly."""
    if out.exists() and not out.is_file():
        with open(out, "w") as fh:
            fh.writelines(lines)
        return
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # same folder: the rename is atomic
    try:
        with open(tmp, "w") as fh:
            fh.writelines(lines)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags of argv (default: sys.argv), each checked before anything loads; a bad one exits with one line."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None,
                   help="HF model directory to evaluate (default: weights/download.py's directory, downloaded "
                        "when missing)")
    p.add_argument("--test-data", default=None, help="test jsonl (default: the task's test split from the Hub)")
    add_task_flags(p)
    p.add_argument("--limit", "--eval-limit", type=int, default=None,
                   help="evaluate only the first N test examples (default all)")
    p.add_argument("--eval-samples", type=int, default=1, help="completions per example (default 1)")
    p.add_argument("--eval-temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampled completions (default 0)")
    p.add_argument("--max-new-tokens", "--eval-max-new-tokens", type=int, default=512,
                   help="generation budget per answer (default 512)")
    p.add_argument("--batch-size", "--eval-batch-size", type=int, default=128,
                   help="prompts generated together (default 128)")
    p.add_argument("--attn", choices=ATTN_BACKENDS, default=None,
                   help="rollout backend: the reference generator or the fast engine with this attention "
                        "(default: triton on CUDA, reference on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available)")
    p.add_argument("--out", type=Path, default=None, help="write one JSON line per example (completions, verdicts)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out file that already exists")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    parse_device(p, args.device)
    if args.out is not None:
        check_out(p, args.out, args.overwrite, test_data=args.test_data, model_dir=args.model_dir)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.eval_samples < 1 or args.eval_temperature < 0 or not math.isfinite(args.eval_temperature):
        p.error(f"need --eval-samples >= 1 and a finite --eval-temperature >= 0, got {args.eval_samples} and "
                f"{args.eval_temperature}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.eval_samples > 1 and args.eval_temperature == 0:
        p.error(f"--eval-samples {args.eval_samples} at --eval-temperature 0 would be copies of one greedy "
                f"completion; pass --eval-temperature > 0")
    return args


def load(args: argparse.Namespace):
    """(process group, tokenizer, task, rollout backend) for args; bad input (a missing model, a damaged file, a
    prompt past the model's positions) exits 2 with one line, as train.py and argparse do."""
    try:
        dist, args.device = distributed.init_from_env(args.device)
        model_dir = resolve_model_dir(args.model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        task = load_task(args.task, "test", tokenizer, path=args.test_data, template=args.template,
                         reward_mode=args.reward, question_field=args.question_field, answer_field=args.answer_field)
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        model = load_model(model_dir, dtype=dtype, device=args.device).eval()
        if nonfinite(model):
            raise ValueError(f"the weights in {model_dir} hold NaN or inf; nothing to evaluate")
        tokenizer.check_fits(model.config.vocab_size, model_dir)
        n = min(len(task), args.limit or len(task))
        prompt_tokens = prompt_budget([(task, n)], model.config.max_position_embeddings, args.max_new_tokens)
        attn = args.attn or ("triton" if model.lm_head.weight.is_cuda else "reference")
        backend = make_backend(attn, model, pad_id=tokenizer.pad_id, max_seq_len=prompt_tokens + args.max_new_tokens)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return dist, tokenizer, task, backend


def report(args: argparse.Namespace, res: dict, tokenizer: Tokenizer) -> str | None:
    """Print the scores and write --out; returns the error line where --out could not be written."""
    sampled = f"sampled (temperature {args.eval_temperature:g})" if args.eval_temperature else "greedy"
    scores = (f"{sampled} accuracy {res['accuracy']:.4f}" if args.eval_samples == 1 else
              ", ".join(f"{key} {res[key]:.4f}" for key in res if key.startswith(("mean@", "pass@"))))
    print(f"{scores} on {res['n']} {args.task} test examples ({args.template} template; mean length "
          f"{res['completion_len_mean']:.0f} tokens, {res['truncated_frac']:.1%} truncated, {res['seconds']:.0f}s, "
          f"{res['examples_per_s']:.2f} examples/s)")
    if args.out is not None:
        try:
            write_records(args.out, [json.dumps(r) + "\n" for r in decoded(res["records"], tokenizer.decode)])
        except OSError as e:  # checked at start; the disk filled up, or the folder went, since
            return f"error: could not write --out {args.out}: {e}"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist, tokenizer, task, backend = load(args)
    try:
        res = evaluate(backend, task, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       limit=args.limit, samples=args.eval_samples, temperature=args.eval_temperature, seed=args.seed,
                       dist=dist)
    except KeyboardInterrupt:
        distributed.shutdown(dist, together=False)
        raise SystemExit("interrupted: nothing was written") from None
    except torch.OutOfMemoryError:
        distributed.shutdown(dist, together=False)
        raise SystemExit(f"error: out of GPU memory at --batch-size {args.batch_size}; lower --batch-size (or "
                         f"--max-new-tokens)") from None
    failed = report(args, res, tokenizer) if dist.is_main else None
    distributed.shutdown(dist, together=True)
    if failed:
        raise SystemExit(failed)


if __name__ == "__main__":
    main()
