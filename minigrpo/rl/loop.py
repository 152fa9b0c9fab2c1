"""The run around the training step (`history = run(trainer)`): steps until done, evaluation, logging,
samples and checkpoints on schedule, and a clean stop on Ctrl-C, SIGTERM or a NaN. Rank 0 alone logs and
writes; every rank steps, evaluates its share and saves (evaluation and checkpoints are collective).
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from minigrpo.rl.evaluate import decoded, evaluate
from minigrpo.rl.trainer import Trainer
from minigrpo.run.checkpoints import latest_name, set_aside_later, set_latest
from minigrpo.run.metrics import MetricsLogger, check_logs
from minigrpo.run.stopping import Interrupted, NonFiniteError, StopSignals, nonfinite


def run(trainer: Trainer) -> list[dict]:
    """Train until cfg.steps; returns the step records. Raises `Interrupted` on SIGINT / SIGTERM (after the step
    and a checkpoint) and `NonFiniteError` on a NaN or inf loss or weight (before saving them)."""
    t, cfg, main = trainer, trainer.cfg, trainer.dist.is_main
    resumed = t.resumed_from is not None
    if main and resumed:
        check_logs(t.out_dir)  # a damaged log refuses the resume before the rewind moves anything
        _rewind(t)
    logger = MetricsLogger(t.out_dir, tensorboard=t.tensorboard, echo=t.echo,
                           resume_step=t.step_idx if resumed else None) if main else None
    evaluating = t.eval_task is not None and cfg.eval_every
    history = []
    bar = tqdm(total=cfg.steps, initial=t.step_idx, desc="train", unit="step", disable=None if main else True)
    try:
        with bar, StopSignals(announce=main) as signals:
            if evaluating and t.step_idx == 0 and not resumed:  # resumed at 0: that evaluation was logged
                record = {"step": 0, **_evaluate(t, logger)}
                if main:
                    logger.log(record)
            while t.step_idx < cfg.steps:
                signum = int(t.dist.all_reduce(torch.tensor(signals.received or 0), "max"))  # any rank's stops all
                if signum:
                    raise Interrupted(signum, t.step_idx, t.save())
                m = t.step()
                bad = nonfinite(t.model, m)
                if bad:
                    if main:
                        logger.log(m)
                    raise NonFiniteError(t.step_idx, bad)
                done = t.step_idx == cfg.steps
                if evaluating and (t.step_idx % cfg.eval_every == 0 or done):
                    m.update(_evaluate(t, logger))
                if main and cfg.sample_every and t.step_idx % cfg.sample_every == 0:
                    logger.log_rows("samples", t.step_idx, _samples(t))
                if main:
                    logger.log(m)
                history.append(m)
                if (cfg.save_every and t.step_idx % cfg.save_every == 0) or done:
                    t.save()
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
                bar.update()
    finally:
        if logger is not None:
            logger.close()
    return history


def _rewind(t: Trainer) -> None:
    """One of this run's own checkpoints rewinds the run to it: `latest` names it (the logger then cuts the logs
    back to it). Past `latest` (a crash resumes from `latest` itself) the future being replaced is kept aside."""
    own = t.out_dir / "checkpoints"
    if t.resumed_from.parent.resolve() != own.resolve():
        return
    newest = latest_name(own)
    set_latest(own, t.resumed_from.name)
    aside = set_aside_later(t.out_dir, t.step_idx) if newest != t.resumed_from.name else None
    if aside is not None:
        print(f"resumed from an earlier checkpoint: the later ones and the logs are kept in {aside}", file=sys.stderr)


def _evaluate(t: Trainer, logger: MetricsLogger | None) -> dict:
    """Accuracy on the eval task through the rollout backend (greedy, or pass@k / mean@k), as eval_* metrics;
    every rank evaluates its share, and the logger (rank 0's) writes each example to eval.jsonl."""
    cfg = t.cfg
    res = evaluate(t.backend, t.eval_task, limit=cfg.eval_limit, samples=cfg.eval_samples,
                   temperature=cfg.eval_temperature, seed=cfg.seed, dist=t.dist,
                   max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, batch_size=cfg.eval_batch_size)
    if logger is not None:
        logger.log_rows("eval", t.step_idx, decoded(res["records"], t.tokenizer.decode))
    return {f"eval_{k}": v for k, v in res.items() if k != "records"}


def _samples(t: Trainer) -> list[dict]:
    """The latest step's first completion of each of the first prompts, decoded with its stop token."""
    r, G = t.last_rollout, t.cfg.samples_per_prompt
    return [{**t.task.describe(r["examples"][j]),
             "completion": t.tokenizer.decode(r["completions"][j * G], skip_special_tokens=False),
             "reward": r["rewards"][j * G]} for j in range(min(t.cfg.num_samples, len(r["examples"])))]
