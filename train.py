"""Dr. GRPO on GSM8K, MATH or any question/answer jsonl for Qwen2.5 (or, with --preset smoke, on a tiny
offline task on the CPU).

    python train.py                                  # Qwen2.5-0.5B-Instruct on GSM8K, fast engine on CUDA
    python train.py --model-dir BASE --task math --template r1 --eval-samples 8 --eval-temperature 1
                                                     # the Dr. GRPO paper's setting: a base model, R1 template
    python train.py --preset smoke                   # CPU, tiny random model, synthetic task, under a minute
    python train.py --out runs/a --resume            # continue runs/a from its newest checkpoint, exactly
    torchrun --nproc-per-node 4 train.py -B 32       # data parallel: 8 prompts per rank, DDP update
    torchrun --nproc-per-node 4 train.py -B 32 --parallel fsdp   # the same, weights and AdamW state sharded

Defaults follow the Dr. GRPO recipe (Liu et al. 2025, "Understanding R1-Zero-Like Training"): G = 8
samples per prompt, temperature 1.0, lr 1e-6 with constant schedule, clip eps 0.2, one on-policy update per
rollout batch (K = 1), advantages without std normalisation, loss normalised by a constant (rows x
max_new_tokens), and no KL penalty (beta = 0: with a verifiable reward the KL anchor is unnecessary and
only slows learning; set --beta > 0 to add the k3 KL to a frozen copy of the initial policy).

Outputs in --out: metrics.jsonl (one JSON object per step), samples.jsonl, eval.jsonl (every evaluated
completion and its verdict), checkpoints/step_*/model (HF format) + trainer_state.pt, tensorboard/ with
--tensorboard. A run never deletes another run's files: a
new run into an --out that holds one is refused unless --overwrite moves the old one aside.

Ctrl-C (SIGINT) or SIGTERM: the run finishes its step, saves a checkpoint, prints the command that
resumes it and exits with 130 / 143; a second Ctrl-C stops at once, keeping the last complete checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import re
import shlex
import signal
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from minigrpo.engine.config import EngineConfig
from minigrpo.engine.rollout import ATTN_BACKENDS, make_backend
from minigrpo.rl import distributed
from minigrpo.rl.config import PARALLEL, WEIGHT_DTYPES, TrainConfig
from minigrpo.rl.loop import run
from minigrpo.rl.memory import estimate, fewest_recomputed, leaner
from minigrpo.rl.trainer import Trainer
from minigrpo.run.checkpoints import latest_name, remove_stale_temps
from minigrpo.run.cli import OneLineParser, parse_device
from minigrpo.run.metrics import DamagedLog
from minigrpo.run.run_dir import check_out, locked_out, move_aside
from minigrpo.run.stopping import Interrupted, NonFiniteError, nonfinite
from minigrpo.tasks.task import add_task_flags, prompt_budget
from weights.download import resolve_model_dir

# --preset sets these defaults; any flag given on the command line still wins.
PRESETS = {
    "gsm8k": {"out": "runs/gsm8k"},
    # Tuned so a 2-layer random model goes from reward ~0.05 to >= 0.8 in ~100 steps (5-15 s on 2 cores).
    "smoke": {"out": "runs/smoke", "device": "cpu", "attn": "reference", "prompts_per_step": 16,
              "samples_per_prompt": 8, "max_new_tokens": 3, "micro_batch_size": 128, "lr": 1e-3, "steps": 150,
              "eval_every": 50, "eval_limit": 256, "eval_batch_size": 256, "save_every": 50,
              "sample_every": 25},
    # The learning check's task (bench/learn.py): copy 3 digits, then stop. The same model goes from reward
    # ~0.1 to >= 0.8 in ~95-125 steps (seeds 0, 1; 1-2 minutes on a CPU core). --attn follows --device.
    "learn": {"out": "runs/learn", "device": "cpu", "prompts_per_step": 32, "samples_per_prompt": 8,
              "max_new_tokens": 4, "micro_batch_size": 256, "lr": 1e-3, "steps": 200, "eval_every": 0,
              "save_every": 0, "sample_every": 25},
}
D = TrainConfig()
# The fit check's headroom over the estimated peak (minigrpo/rl/memory.py counts allocated bytes): the caching
# allocator reserves more than it hands out (blocks rounded up, free blocks of one size not reusable for a
# larger one), a few percent to 10% over a training step.
MEMORY_MARGIN = 0.10


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already states it or there is none."""

    def _get_help_string(self, action):
        if action.default is None or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=_HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--preset", choices=sorted(PRESETS), default="gsm8k",
                   help="gsm8k: a Qwen2.5 model on --task (GSM8K by default); smoke: CPU, tiny random model, "
                        "built-in synthetic task (CI); "
                        "learn: the same model on a harder synthetic task, copying 3 digits (bench/learn.py)")
    g.add_argument("--model-dir", default=None, help="HF model directory to train (default: weights/download.py's "
                   "directory, downloaded when missing); not used by --preset smoke")
    g.add_argument("--train-data", default=None, help="train jsonl (for gsm8k the openai/grade-school-math "
                   "format); default: the task's train split from the Hugging Face Hub (parquet: needs pyarrow)")
    g.add_argument("--test-data", default=None, help="test jsonl for evaluation; default: the Hub")
    g.add_argument("--out", default=None, help="output directory (default: runs/<preset>); one that already "
                   "holds a run needs --resume or --overwrite")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                   help="continue exactly from a checkpoint directory, or without a value from the newest "
                        "checkpoint in --out")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds a run, after renaming that run to OUT.old-<time> "
                        "(nothing is deleted)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device")
    g.add_argument("--seed", type=int, default=D.seed, help="seeds data order, rollout sampling, shuffling")
    g.add_argument("--parallel", choices=PARALLEL, default=D.parallel,
                   help="under torchrun, the update: ddp replicates the weights, gradients and AdamW state on "
                        "every rank; fsdp shards them (FSDP2), for models whose state does not fit one GPU")
    g.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard (needs tensorboard)")
    add_task_flags(p.add_argument_group("task (not with --preset smoke / learn)"))
    g = p.add_argument_group("rollout engine")
    g.add_argument("--attn", choices=ATTN_BACKENDS, default=None,
                   help="reference: the plain generator (no KV cache); eager/sdpa/triton: the fast engine with "
                        "that decode attention (default: triton on CUDA, reference on CPU)")
    g.add_argument("--compile", choices=["none", "step"], default=None,
                   help="engine graph mode: torch.compile the decode step (fullgraph), or not "
                        "(default: step on CUDA, none on CPU)")
    g.add_argument("--sampler", choices=["torch", "triton"], default=None,
                   help="engine sampler: the reference PyTorch one, or the fused one-pass Triton kernel "
                        "(plain temperature sampling; same draws; default: triton on CUDA, torch on CPU)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the engine's decode step in CUDA graphs (default: on with CUDA)")
    g = p.add_argument_group("Dr. GRPO")
    g.add_argument("-B", "--prompts-per-step", type=int, default=D.prompts_per_step, help="prompts per step (B)")
    g.add_argument("-G", "--samples-per-prompt", type=int, default=D.samples_per_prompt,
                   help="completions per prompt, the group size (G)")
    g.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens,
                   help="generation budget per completion; also the loss normaliser")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt budget; sizes the engine (default: the longest prompt). Prompts longer than it, "
                        "or than the model's positions minus the new tokens, are refused at start, not dropped")
    g.add_argument("-K", "--inner-epochs", type=int, default=D.inner_epochs,
                   help="optimisation passes over each rollout batch (1 = on-policy)")
    g.add_argument("--minibatch-size", type=int, default=D.minibatch_size,
                   help="rows per optimizer step; 0 = all B*G rows (one step per inner epoch)")
    g.add_argument("--micro-batch-size", type=int, default=D.micro_batch_size,
                   help="rows per forward/backward (gradient accumulation; changes memory, not the math)")
    g.add_argument("--score-batch-size", type=int, default=D.score_batch_size,
                   help="rows per no-grad forward for the old / reference log-probs (no activations are kept, "
                        "so it can be larger than --micro-batch-size)")
    g.add_argument("--eps", type=float, default=D.eps, help="PPO clip range: ratio clipped to [1-eps, 1+eps_high]")
    g.add_argument("--eps-high", type=float, default=D.eps_high, help="upper clip (clip-higher); default = --eps")
    g.add_argument("--beta", type=float, default=D.kl_beta,
                   help="k3 KL penalty weight to the initial policy (Dr. GRPO: 0, no reference model kept)")
    g.add_argument("--temperature", type=float, default=D.temperature, help="sampling temperature (also used "
                   "for the training log-probs)")
    g.add_argument("--top-p", type=float, default=D.top_p, help="nucleus sampling threshold; only 1 (off) trains "
                   "without bias: the trainer scores the full distribution")
    g.add_argument("--tis-cap", type=float, default=D.tis_cap,
                   help="truncated importance sampling: weight each token's loss by min(pi_old / pi_rollout, CAP), "
                        "correcting for the rollout engine's own (bf16) distribution")
    g.add_argument("--no-tis", dest="tis", action="store_false",
                   help="no importance-sampling correction (the mismatch is still logged)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=D.lr, help="AdamW peak learning rate")
    g.add_argument("--betas", type=float, nargs=2, default=D.betas, metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--weight-decay", type=float, default=D.weight_decay, help="AdamW decoupled weight decay")
    g.add_argument("--max-grad-norm", type=float, default=D.max_grad_norm,
                   help="clip the global gradient norm (0 = off); the pre-clip norm is logged")
    g.add_argument("--warmup-steps", type=int, default=D.warmup_steps, help="linear LR warmup steps")
    g.add_argument("--lr-schedule", choices=["constant", "cosine"], default=D.lr_schedule, help="LR after warmup")
    g.add_argument("--min-lr-ratio", type=float, default=D.min_lr_ratio, help="cosine floor, as a fraction of --lr")
    g.add_argument("--steps", type=int, default=D.steps, help="RL steps (rollout + update) in total")
    g.add_argument("--weights", choices=["fp32", "bf16"], default=D.weights,
                   help="fp32: fp32 master weights and AdamW state, bf16 autocast on CUDA (16 bytes/param); "
                        "bf16: bf16 weights and AdamW moments, updated with stochastic rounding (8 bytes/param)")
    g.add_argument("--compile-policy", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the policy's decoder layers for the training and scoring forwards "
                        "(fused elementwise ops, fewer kernel launches). Batch and length dimensions are "
                        "dynamic: one graph per grad mode, compiled in the first step (default: on with CUDA, unless "
                        "--attn reference)")
    g.add_argument("--logprob-chunk-size", type=int, default=D.logprob_chunk_size,
                   help="tokens per LM-head chunk when computing log-probs (memory: up to chunk x vocab x 8 bytes, "
                        "minigrpo/rl/memory.py); 0 = full logits, the naive way (to compare memory)")
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                   default=D.activation_checkpointing,
                   help="recompute each decoder layer in backward: far less activation memory, one more forward")
    g.add_argument("--recompute-layers", type=layer_count, default=D.recompute_layers, metavar="N|auto",
                   help="with --activation-checkpointing, only the first N decoder layers recompute; the others keep "
                        "their activations: faster, more memory. auto: the fewest whose estimated peak fits the "
                        "GPU's free memory (all of them off CUDA; default: all layers)")
    g.add_argument("--offload-reference", action=argparse.BooleanOptionalAction, default=D.offload_reference,
                   help="keep the KL reference (--beta > 0) in pinned host memory, copied in during each rollout and "
                        "freed before the update: the update's peak lacks a copy of the model (PCIe time, hidden)")
    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval-every", type=int, default=D.eval_every,
                   help="test accuracy before training and every N steps (0 = never); every example's "
                        "completions and verdicts go to OUT/eval.jsonl")
    g.add_argument("--eval-samples", type=int, default=D.eval_samples,
                   help="completions per test example: with k > 1, mean@k and pass@1, 2, 4, ..., k")
    g.add_argument("--eval-temperature", type=float, default=D.eval_temperature,
                   help="evaluation sampling temperature (0 = greedy)")
    g.add_argument("--eval-limit", type=int, default=D.eval_limit, help="evaluate on the first N test examples "
                   "(default: all)")
    g.add_argument("--eval-batch-size", type=int, default=D.eval_batch_size, help="prompts per evaluation batch")
    g.add_argument("--eval-max-new-tokens", type=int, default=D.eval_max_new_tokens,
                   help="evaluation generation budget (default: --max-new-tokens)")
    g.add_argument("--save-every", type=int, default=D.save_every, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=D.keep_checkpoints, help="newest checkpoints kept (0 = all)")
    g.add_argument("--sample-every", type=int, default=D.sample_every,
                   help="write decoded sample completions to samples.jsonl every N steps (0 = never)")
    g.add_argument("--num-samples", type=int, default=D.num_samples, help="completions written each time")
    return p


def layer_count(text: str) -> int | str:
    """--recompute-layers' value: a whole number, or auto (resolved by check_memory)."""
    if text.isdigit():
        return int(text)
    if text == "auto":
        return text
    raise argparse.ArgumentTypeError(f"expected a number of layers or auto, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    preset_parser = OneLineParser(add_help=False)
    preset_parser.add_argument("--preset", choices=sorted(PRESETS), default="gsm8k")
    preset, _ = preset_parser.parse_known_args(argv)
    parser.set_defaults(**PRESETS[preset.preset])
    args = parser.parse_args(argv)
    device = parse_device(parser, args.device)
    args.attn = args.attn or ("triton" if device.type == "cuda" else "reference")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        parser.error(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    same = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name in vars(args)}  # flag = field
    try:
        args.cfg = TrainConfig(**{
            **same, "kl_beta": args.beta, "betas": tuple(args.betas),
            "recompute_layers": None if args.recompute_layers == "auto" else args.recompute_layers,  # settled later
            "task": (args.preset if args.preset != "gsm8k"
                     else " ".join(filter(None, (args.task, args.template, args.reward)))),
            # the reference generator runs the policy itself at every length: compiled, a recompile per token
            "compile_policy": (args.compile_policy if args.compile_policy is not None
                               else device.type == "cuda" and args.attn != "reference")})
    except ValueError as e:
        parser.error(flag_names(str(e), parser))
    if args.recompute_layers == "auto" and not args.activation_checkpointing:
        parser.error("--recompute-layers auto needs --activation-checkpointing (without it no layer recomputes)")
    if args.parallel == "fsdp" and args.attn == "reference":
        parser.error("--parallel fsdp shards the policy, which --attn reference generates with; use the engine "
                     "(--attn sdpa on the CPU, triton on CUDA)")
    if args.compile_policy and args.attn == "reference":
        parser.error("--compile-policy with --attn reference would recompile the policy for every generated token; "
                     "drop --compile-policy, or use the engine (--attn sdpa|triton)")
    real_only = [f for f, v in (("--model-dir", args.model_dir), ("--task", args.task != "gsm8k"),
                                ("--template", args.template != "chat"), ("--reward", args.reward),
                                ("--question-field", args.question_field), ("--answer-field", args.answer_field)) if v]
    if args.preset != "gsm8k" and real_only:
        parser.error(f"--preset {args.preset} trains its own tiny random model on its own task; drop "
                     f"{', '.join(real_only)} (or use --preset gsm8k)")
    if args.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            parser.error("--tensorboard needs the tensorboard package: `pip install tensorboard` (metrics.jsonl "
                         "is written either way)")
    return args


def flag_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each TrainConfig field (and other option) -> the long flag that sets it (--X, not --no-X)."""
    flags = {a.dest: next(o for o in a.option_strings if o.startswith("--"))
             for a in parser._actions if a.option_strings}
    return {**flags, "kl_beta": "--beta"}


def flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """`message` with TrainConfig's field names replaced by the flags that set them (kl_beta -> --beta)."""
    flags = flag_of(parser)
    names = sorted((f.name for f in fields(TrainConfig) if f.name in flags), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: flags[m.group()], message)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: its own flags, less --resume / --overwrite (or a prefix argparse
    took for one), plus --resume; under torchrun, torchrun with this node's process count."""
    def means(arg: str, flag: str) -> bool:
        return len(arg) > 3 and flag.startswith(arg.split("=")[0])
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif means(arg, "--resume"):
            skip = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("-")  # its optional value
        elif not means(arg, "--overwrite"):
            kept.append(arg)
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    launcher = ("python" if "LOCAL_WORLD_SIZE" not in os.environ else
                f"torchrun --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']}"
                + (f" --nnodes {nodes} <your rendezvous flags>" if nodes > 1 else ""))
    return f"{launcher} " + shlex.join([sys.argv[0], *kept, "--resume"])


def build_smoke(args):
    from minigrpo.tasks.synthetic import CharTokenizer, CopyTask, FirstDigitTask, tiny_policy

    # The tiny model's ops are too small to split across threads: with several, OpenMP synchronisation
    # dominates, and on a busy CI machine a step gets 5x slower. One thread is the fastest.
    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    model = tiny_policy(tokenizer.vocab_size, seed=args.seed, device=args.device).to(WEIGHT_DTYPES[args.weights])
    task, digits = (CopyTask, 3) if args.preset == "learn" else (FirstDigitTask, 4)
    train = task(tokenizer, num_examples=10_000, seed=args.seed, num_digits=digits)
    test = task(tokenizer, num_examples=1_000, seed=args.seed + 1, num_digits=digits)
    return model, tokenizer, train, test, None


def build_qa(args, dist: distributed.Dist):
    from minigrpo.model.checkpoint import load_model
    from minigrpo.model.config import ModelConfig
    from minigrpo.model.tokenizer import Tokenizer
    from minigrpo.tasks.task import load_task

    model_dir = resolve_model_dir(args.model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    flags = dict(template=args.template, reward_mode=args.reward, question_field=args.question_field,
                 answer_field=args.answer_field)
    train = load_task(args.task, "train", tokenizer, path=args.train_data, **flags)
    test = load_task(args.task, "test", tokenizer, path=args.test_data, **flags) if args.cfg.eval_every else None
    check_memory(args, ModelConfig.from_json(model_dir), train, test, dist)  # before any weight is on the device
    model = load_model(model_dir, dtype=WEIGHT_DTYPES[args.weights], device=args.device)  # the trained copy
    return model, tokenizer, train, test, model_dir


def engine_shape(args, max_positions: int, train, test, world: int = 1) -> tuple[int, dict]:
    """(prompt budget, the rollout engine's size): block tables for the prompt budget (every prompt checked
    against it and the model's positions, task.prompt_budget) plus the completion budget, and this rank's
    share of the rollout, B x G / W sequences, for the batch buckets and the KV pool (at least an evaluation
    example's --eval-samples: its samples decode together)."""
    cfg = args.cfg
    new_tokens = max(cfg.max_new_tokens, cfg.eval_max_new_tokens or 0)
    used = [(train, len(train))] + ([(test, min(len(test), cfg.eval_limit or len(test)))] if test else [])
    prompt_tokens = prompt_budget(used, max_positions, new_tokens, args.max_prompt_tokens)
    rows = max(cfg.rows_per_step // world, cfg.eval_samples if test else 1)
    return prompt_tokens, {"max_seq_len": prompt_tokens + new_tokens, "max_batch": rows}


def build_backend(args, model, tokenizer, train, test, world: int = 1):
    """The rollout backend for these flags, its engine sized by engine_shape."""
    _, shape = engine_shape(args, model.config.max_position_embeddings, train, test, world)
    return make_backend(args.attn, model, pad_id=tokenizer.pad_id, compile=args.compile,
                        cuda_graphs=args.cuda_graphs, sampler=args.sampler, **shape)


def memory_estimator(args, model_cfg, train, test, world: int = 1, capacity: int | None = None,
                     longest_prompt: int | None = None):
    """TrainConfig -> minigrpo.rl.memory.estimate of this run's peak per rank (its model, engine, device).
    longest_prompt: the longest prompt a training batch holds (default: the data's longest; a benchmark
    compares the estimate with steps that never drew it)."""
    prompt_tokens, shape = engine_shape(args, model_cfg.max_position_embeddings, train, test, world)
    prompt_tokens = longest_prompt or prompt_tokens
    engine = None
    if args.attn != "reference":
        engine = EngineConfig(**shape)
    return lambda cfg: estimate(model_cfg, cfg, prompt_tokens=prompt_tokens, engine=engine, world=world,
                                cuda=torch.device(args.device).type == "cuda", capacity=capacity)


class DoesNotFit(ValueError):
    """The run's estimated peak memory exceeds the device's free memory (check_memory)."""


def free_memory(device: str) -> int | None:
    """Bytes free on a CUDA device before the run allocates anything; None elsewhere (no check)."""
    return torch.cuda.mem_get_info(device)[0] if torch.device(device).type == "cuda" else None


def check_memory(args, model_cfg, train, test, dist: distributed.Dist) -> None:
    """Stop at start, with one line naming a setting that fits, when the estimated peak (plus MEMORY_MARGIN)
    exceeds the device's free memory (the least of all ranks', so that every rank decides alike). First, with
    --recompute-layers auto, settle how many layers recompute."""
    free = free_memory(args.device)
    if free is None:
        return
    free = int(dist.all_reduce(torch.tensor(free), "min"))
    peak = memory_estimator(args, model_cfg, train, test, dist.world, free)

    def fits(cfg: TrainConfig) -> bool:
        return peak(cfg).total * (1 + MEMORY_MARGIN) <= free
    L, auto = model_cfg.num_hidden_layers, ""
    if args.recompute_layers == "auto":
        args.cfg = replace(args.cfg, recompute_layers=fewest_recomputed(args.cfg, L, fits))
        auto = f"; --recompute-layers auto: {args.cfg.recompute_layers} of {L} layers recompute"
    need, gib = peak(args.cfg), 2**30
    if fits(args.cfg):
        if dist.is_main:
            print(f"memory: about {need.total / gib:.1f} of the {free / gib:.1f} GiB free on {args.device} ({need})"
                  f"{auto}", file=sys.stderr)
        return
    change = leaner(args.cfg, fits)
    fix = (f"it fits with {as_flags(change)} (about {peak(replace(args.cfg, **change)).total / gib:.1f} GiB)"
           if change else "no setting of --weights, --activation-checkpointing, --logprob-chunk-size, "
           "--offload-reference and --micro-batch-size fits: use a smaller model, or shorter --max-new-tokens or "
           "prompts")
    raise DoesNotFit(f"this run needs about {need.total / gib:.1f} GiB ({need}) and {MEMORY_MARGIN:.0%} more for "
                     f"the allocator, but {args.device} has {free / gib:.1f} GiB free; {fix}")


def as_flags(change: dict) -> str:
    """TrainConfig fields -> the command-line flags that set them: {"weights": "bf16"} -> "--weights bf16"."""
    flags = flag_of(build_parser())
    return " ".join(flags[k] if v is True else f"{flags[k]} {v}" for k, v in change.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    try:
        check_out(out, resume=args.resume, overwrite=args.overwrite)  # every rank, before any rank moves it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        dist, args.device = distributed.init_from_env(args.device)  # torchrun: one GPU (or CPU share) per rank
    except (ValueError, RuntimeError) as e:
        print(f"error: cannot join the torchrun process group: {e}", file=sys.stderr)
        return 2
    rc = 1
    try:
        with contextlib.ExitStack() as locks:
            rc = _train(args, dist, out, argv, locks)
        return rc
    except KeyboardInterrupt:  # while loading: nothing was trained, nothing needs saving
        print("interrupted before training started", file=sys.stderr)
        return 130
    finally:
        distributed.shutdown(dist, together=rc == 0)


def _train(args, dist, out: Path, argv: list[str], locks: contextlib.ExitStack) -> int:
    """Build, resume and run; rank 0 holds the run folder's locks (`locked_out`) in `locks`, the caller's."""
    try:
        if dist.is_main:
            locks.enter_context(locked_out(out))
            aside = move_aside(out) if args.overwrite else None
            if aside:
                locks.enter_context(locked_out(out))  # the new, empty folder
            remove_stale_temps(out / "checkpoints")  # an interrupted save's leftovers
            print(f"run folder: {out}" + (f" (the run that was there is now {aside})" if aside else ""),
                  file=sys.stderr)
        dist.barrier()
        model, tokenizer, train, test, model_dir = (build_qa(args, dist) if args.preset == "gsm8k"
                                                    else build_smoke(args))
        if nonfinite(model):
            raise ValueError(f"the weights in {model_dir or 'the initial model'} hold NaN or inf; train from a "
                             f"sound model")
        try:
            args.cfg.recomputed_layers(model.config.num_hidden_layers)  # the one setting checked against the model
        except ValueError as e:
            raise ValueError(flag_names(str(e), build_parser())) from None
        backend = build_backend(args, model, tokenizer, train, test, dist.world)
        # Built before resuming: with --beta > 0 the KL reference is the initial policy, not the checkpoint.
        trainer = Trainer(args.cfg, model, tokenizer, train, backend, out, eval_task=test,
                          tokenizer_dir=model_dir, tensorboard=args.tensorboard, dist=dist)
        if args.resume is not None:
            trainer.resume(args.resume or out)
            if trainer.step_idx >= args.cfg.steps:
                raise ValueError(f"the checkpoint is at step {trainer.step_idx} and --steps is {args.cfg.steps}: "
                                 f"nothing to train; pass a larger --steps to continue")
            if dist.is_main:
                print(f"resumed from step {trainer.step_idx}", file=sys.stderr)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        history = run(trainer)
    except Interrupted as e:
        if dist.is_main:
            print(f"{signal.Signals(e.signum).name} at step {e.step}: saved {e.checkpoint}; resume with: "
                  f"{resume_command(argv)}", file=sys.stderr)
        return 128 + e.signum
    except DamagedLog as e:  # found on resuming, before any step
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        if dist.is_main:
            print(f"error: {e}; this step was not saved, {_last_checkpoint(out)}. Lower --lr or --max-grad-norm, "
                  f"or check the data", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if dist.is_main:
            resume = f"; resume with: {resume_command(argv)}" if latest_name(out / "checkpoints") else ""
            print(f"stopped at once; {_last_checkpoint(out)}{resume}", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk or a lost mount mid-run: saves are atomic, so the last complete one stands
        if dist.is_main:
            print(f"error: {e}; {_last_checkpoint(out)}", file=sys.stderr)
        return 1
    if history and dist.is_main:
        first, last = history[0], history[-1]
        print(f"done: {len(history)} steps, reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}; "
              f"metrics in {out / 'metrics.jsonl'}, checkpoints in {out / 'checkpoints'}")
    return 0


def _last_checkpoint(out: Path) -> str:
    """Where the run can continue from, in words."""
    name = latest_name(out / "checkpoints")
    return f"the last complete checkpoint is {out / 'checkpoints' / name}" if name else "no checkpoint was written yet"


if __name__ == "__main__":
    sys.exit(main())
