"""train.py's command line: its flags, the presets that set their defaults, and the TrainConfig they build.

A TrainConfig field has the flag of its name (--micro-batch-size sets micro_batch_size; the exceptions: kl_beta
is --beta, tis is --no-tis, task joins --task, --template and --reward), so an error TrainConfig raises names the
flag (flag_names), and the memory check's advice is a command line (as_flags).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import sys
from dataclasses import fields

import torch

from minigrpo.engine.rollout import ATTN_BACKENDS
from minigrpo.rl.config import PARALLEL, TrainConfig
from minigrpo.run.cli import OneLineParser, parse_device
from minigrpo.tasks.qa import SOURCES
from minigrpo.tasks.task import add_task_flags

# --preset sets these defaults; any flag given on the command line still wins.
PRESETS = {
    "gsm8k": {"out": "runs/gsm8k"},
    # Tuned so a 2-layer random model goes from reward ~0.05 to >= 0.8 in ~100 steps, in seconds on a CPU.
    "smoke": {"out": "runs/smoke", "device": "cpu", "attn": "reference", "prompts_per_step": 16,
              "samples_per_prompt": 8, "max_new_tokens": 3, "micro_batch_size": 128, "lr": 1e-3, "steps": 150,
              "eval_every": 50, "eval_limit": 256, "eval_batch_size": 256, "save_every": 50,
              "sample_every": 25},
    # The learning check's task (bench/learn.py): copy 3 digits, then stop. The same model goes from reward
    # ~0.1 to >= 0.8 in ~95-125 steps (seeds 0, 1). --attn follows --device.
    "learn": {"out": "runs/learn", "device": "cpu", "prompts_per_step": 32, "samples_per_prompt": 8,
              "max_new_tokens": 4, "micro_batch_size": 256, "lr": 1e-3, "steps": 200, "eval_every": 0,
              "save_every": 0, "sample_every": 25},
}
D = TrainConfig()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already states it or there is none."""

    def _get_help_string(self, action):
        if action.default is None or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """train.py's parser: one function below per group of --help."""
    p = OneLineParser(description=description, formatter_class=_HelpFormatter)
    _run_flags(p.add_argument_group("run"))
    add_task_flags(p.add_argument_group("task (not with --preset smoke / learn)"))
    _engine_flags(p.add_argument_group("rollout engine"))
    _grpo_flags(p.add_argument_group("Dr. GRPO"))
    _optimisation_flags(p.add_argument_group("optimisation"))
    _logging_flags(p.add_argument_group("evaluation, logging, checkpoints"))
    return p


def _run_flags(g) -> None:
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


def _engine_flags(g) -> None:
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


def _grpo_flags(g) -> None:
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
    g.add_argument("--tis-cap", type=float, default=D.tis_cap,
                   help="truncated importance sampling: weight each token's loss by min(pi_old / pi_rollout, CAP), "
                        "correcting for the rollout engine's own (bf16) distribution")
    g.add_argument("--no-tis", dest="tis", action="store_false",
                   help="no importance-sampling correction (the mismatch is still logged; default: corrected)")


def _optimisation_flags(g) -> None:
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


def _logging_flags(g) -> None:
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


def layer_count(text: str) -> int | str:
    """--recompute-layers' value: a whole number, or auto (resolved by train.py's fit_memory)."""
    if text.isdigit():
        return int(text)
    if text == "auto":
        return text
    raise argparse.ArgumentTypeError(f"expected a number of layers or auto, got {text!r}")


def _own_reward(args) -> str | None:
    """--reward as the run records it (TrainConfig.task): None for the task's own, so that typing it changes
    nothing a resume compares."""
    return args.reward if args.reward != SOURCES[args.task].reward else None


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """The flags of argv (default: sys.argv), checked, with args.cfg the TrainConfig they set; a bad one exits
    with one line (OneLineParser). description: --help's text (train.py's docstring)."""
    parser = build_parser(description)
    preset_parser = OneLineParser(add_help=False)
    preset_parser.add_argument("--preset", choices=sorted(PRESETS), default="gsm8k")
    preset, _ = preset_parser.parse_known_args(argv)
    parser.set_defaults(**PRESETS[preset.preset])
    args = parser.parse_args(argv)
    device = parse_device(parser, args.device)
    args.attn = args.attn or ("triton" if device.type == "cuda" else "reference")
    if args.out == "":  # Path("") is the current folder
        parser.error("--out is empty; name the run's folder (default: runs/<preset>)")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        parser.error(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    same = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name in vars(args)}  # flag = field
    try:
        args.cfg = TrainConfig(**{
            **same, "kl_beta": args.beta, "betas": tuple(args.betas),
            "recompute_layers": None if args.recompute_layers == "auto" else args.recompute_layers,  # settled later
            "task": (args.preset if args.preset != "gsm8k"
                     else " ".join(filter(None, (args.task, args.template, _own_reward(args))))),
            # the reference generator runs the policy itself at every length: compiled, a recompile per token
            "compile_policy": (args.compile_policy if args.compile_policy is not None
                               else device.type == "cuda" and args.attn != "reference")})
    except ValueError as e:
        parser.error(flag_names(str(e), parser))
    if not args.tis and args.tis_cap != D.tis_cap:
        parser.error(f"--tis-cap {args.tis_cap} caps the TIS weights that --no-tis turns off; drop one of them")
    if args.test_data and not args.eval_every:
        parser.error(f"--test-data {args.test_data} is read only for evaluation, which --eval-every 0 turns off; "
                     f"drop one of them")
    if args.recompute_layers == "auto" and not args.activation_checkpointing:
        parser.error("--recompute-layers auto needs --activation-checkpointing (without it no layer recomputes)")
    if args.parallel == "fsdp" and args.attn == "reference":
        parser.error("--parallel fsdp shards the policy, which --attn reference generates with; use the engine "
                     "(--attn sdpa on the CPU, triton on CUDA)")
    engine_only = [flag for flag, v in (("--compile", args.compile), ("--cuda-graphs", args.cuda_graphs),
                                        ("--sampler", args.sampler)) if v is not None]
    if engine_only and args.attn == "reference":
        parser.error(f"{', '.join(engine_only)}: settings of the fast engine, which --attn reference does not use; "
                     f"drop them, or pick the engine (--attn sdpa on the CPU, triton on CUDA)")
    if args.compile_policy and args.attn == "reference":
        parser.error("--compile-policy with --attn reference would recompile the policy for every generated token; "
                     "drop --compile-policy, or use the engine (--attn sdpa|triton)")
    real_only = [f for f, v in (("--model-dir", args.model_dir), ("--train-data", args.train_data),
                                ("--test-data", args.test_data), ("--task", args.task != "gsm8k"),
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


def as_flags(change: dict) -> str:
    """TrainConfig fields -> the command-line flags that set them: {"weights": "bf16"} -> "--weights bf16"."""
    flags = flag_of(build_parser())
    return " ".join(flags[k] if v is True else f"{flags[k]} {v}" for k, v in change.items())
