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

import contextlib
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch

from minigrpo.engine.config import EngineConfig
from minigrpo.engine.rollout import make_backend
from minigrpo.rl import distributed
from minigrpo.rl.config import RESUMABLE_CHANGES, WEIGHT_DTYPES, TrainConfig
from minigrpo.rl.loop import run
from minigrpo.rl.memory import estimate, fewest_recomputed, leaner
from minigrpo.rl.train_flags import as_flags, build_parser, flag_names, parse_args, resume_command
from minigrpo.rl.trainer import Trainer
from minigrpo.run.checkpoints import latest_name, remove_stale_temps
from minigrpo.run.metrics import DamagedLog
from minigrpo.run.run_dir import check_out, locked_out, move_aside
from minigrpo.run.stopping import Interrupted, NonFiniteError, nonfinite
from minigrpo.tasks.task import prompt_budget
from weights.download import resolve_model_dir

# The fit check's headroom over the estimated peak (minigrpo/rl/memory.py counts allocated bytes): the caching
# allocator reserves more than it hands out (blocks rounded up, free blocks of one size not reusable for a
# larger one), a few percent to 10% over a training step.
MEMORY_MARGIN = 0.10


def build_smoke(args):
    from minigrpo.tasks.synthetic import CharTokenizer, CopyTask, FirstDigitTask, tiny_policy

    # The tiny model's ops are too small to split across threads: with several, OpenMP synchronisation
    # dominates, and on a busy machine a step gets several times slower. One thread is the fastest.
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
    model_cfg = ModelConfig.from_json(model_dir)
    tokenizer.check_fits(model_cfg.vocab_size, model_dir)
    args.cfg = fit_memory(args, model_cfg, train, test, dist)  # before any weight is on the device
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
    flag = "--max-new-tokens" if new_tokens == cfg.max_new_tokens else "--eval-max-new-tokens"
    prompt_tokens = prompt_budget(used, max_positions, new_tokens, args.max_prompt_tokens, flag)
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
    """The run's estimated peak memory exceeds the device's free memory (fit_memory)."""


def free_memory(device: str) -> int | None:
    """Bytes free on a CUDA device before the run allocates anything; None elsewhere (no check)."""
    return torch.cuda.mem_get_info(device)[0] if torch.device(device).type == "cuda" else None


def fit_memory(args, model_cfg, train, test, dist: distributed.Dist) -> TrainConfig:
    """args.cfg, with --recompute-layers auto settled: the fewest recomputed layers whose estimated peak (plus
    MEMORY_MARGIN) fits the device's free memory (the least of all ranks', so that every rank decides alike).
    When the run cannot fit, DoesNotFit: one line naming a setting that does. Off CUDA, args.cfg unchecked."""
    cfg, free = args.cfg, free_memory(args.device)
    if free is None:
        return cfg
    free = int(dist.all_reduce(torch.tensor(free), "min"))
    peak = memory_estimator(args, model_cfg, train, test, dist.world, free)

    def fits(c: TrainConfig) -> bool:
        return peak(c).total * (1 + MEMORY_MARGIN) <= free
    L, auto = model_cfg.num_hidden_layers, ""
    if args.recompute_layers == "auto":
        cfg = replace(cfg, recompute_layers=fewest_recomputed(cfg, L, fits))
        auto = f"; --recompute-layers auto: {cfg.recompute_layers} of {L} layers recompute"
    need, gib = peak(cfg), 2**30
    if fits(cfg):
        if dist.is_main:
            print(f"memory: about {need.total / gib:.1f} of the {free / gib:.1f} GiB free on {args.device} ({need})"
                  f"{auto}", file=sys.stderr)
        return cfg
    resuming = args.resume is not None  # a resume takes only the memory settings (RESUMABLE_CHANGES)
    change = leaner(cfg, fits, RESUMABLE_CHANGES if resuming else None)
    if change:
        fix = f"it fits with {as_flags(change)} (about {peak(replace(cfg, **change)).total / gib:.1f} GiB)"
    elif resuming:
        fix = ("no memory setting a resume may change fits (--weights does not resume): free GPU memory, or start a "
               "new run")
    else:
        fix = ("no setting of --weights, --activation-checkpointing, --logprob-chunk-size, --offload-reference and "
               "--micro-batch-size fits: use a smaller model, or shorter --max-new-tokens or prompts")
    raise DoesNotFit(f"this run needs about {need.total / gib:.1f} GiB ({need}) and {MEMORY_MARGIN:.0%} more for "
                     f"the allocator, but {args.device} has {free / gib:.1f} GiB free; {fix}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, description=__doc__)
    out = Path(args.out)
    try:
        check_out(out, resume=args.resume, overwrite=args.overwrite)  # every rank, before any rank moves it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a name too long for the filesystem, a folder we may not look into
        print(f"error: --out {out}: {e.strerror or e}; choose another --out", file=sys.stderr)
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
    """Take the run folder, build, resume and run; rank 0 holds the folder's locks (`locked_out`) in `locks`, the
    caller's."""
    try:
        dist.barrier()  # every rank's check_out has probed the folder's lock before rank 0 takes it
        if dist.is_main:
            _take_out(args, dist, out, locks)
        dist.barrier()
        trainer = _build_trainer(args, dist, out)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(trainer, dist, out, argv)


def _take_out(args, dist, out: Path, locks: contextlib.ExitStack) -> None:
    """Rank 0: lock the run folder (after moving an old run aside, with --overwrite) and clear a save's leftovers."""
    locks.enter_context(locked_out(out))
    aside = move_aside(out) if args.overwrite else None
    if aside:
        locks.enter_context(locked_out(out))  # the new, empty folder
    remove_stale_temps(out / "checkpoints")  # an interrupted save's leftovers
    print(f"run folder: {out}" + (f" (the run that was there is now {aside})" if aside else ""), file=sys.stderr)
    if args.parallel == "fsdp" and dist.world == 1:
        print("note: --parallel fsdp in one process shards nothing; start it with torchrun to shard", file=sys.stderr)


def _build_trainer(args, dist, out: Path) -> Trainer:
    """The model, data, rollout backend and Trainer of args, resumed where --resume says."""
    model, tokenizer, train, test, model_dir = build_qa(args, dist) if args.preset == "gsm8k" else build_smoke(args)
    if nonfinite(model):
        raise ValueError(f"the weights in {model_dir or 'the initial model'} hold NaN or inf; train from a sound model")
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
    return trainer


def _run(trainer: Trainer, dist, out: Path, argv: list[str]) -> int:
    """Train; each way the run can end is one line and an exit code (0 done, 1 failed, 2 bad input, 128 + signal)."""
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
    except torch.OutOfMemoryError as e:  # past the estimate (another process took memory, a longer batch than seen)
        if dist.is_main:
            print(f"error: out of GPU memory ({str(e).splitlines()[0]}); {_last_checkpoint(out)}. Resume with a "
                  f"smaller --micro-batch-size or --score-batch-size, or --activation-checkpointing --recompute-layers "
                  f"auto (memory settings resume the same run, rounded differently)", file=sys.stderr)
        return 1
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
