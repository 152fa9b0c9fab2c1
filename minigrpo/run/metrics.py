"""Metric logging: one readable stdout line per step, `metrics.jsonl` (one JSON object per step), optional
TensorBoard, `samples.jsonl` (a few decoded completions now and then), `eval.jsonl` (every evaluated
example, its completions and verdicts); and `PhaseTimer`, which measures the time_* keys.

jsonl is the source of truth: append-only, flushed every step. A fresh logger refuses a folder that already
has records; on resume, records past the resumed step and a last line cut short by a crash are dropped, so
the file reads as one uninterrupted run.

Step record keys (rollout statistics over all B*G completions; entropy and the mismatch keys over the trained
rows only: with kl_beta = 0 zero-advantage groups get no forward):
  reward_mean/std, accuracy (exactly correct), zero_spread_frac (rows in groups with all-equal rewards),
  completion_len_mean/max, completion_tokens, truncated_frac (no stop within max_new_tokens), trained_rows,
  loss (mean per optimizer step), clip_frac (tokens where the PPO clip bound), kl (k3 to the reference, with
  kl_beta > 0), entropy (per token, at the sampling temperature), grad_norm (pre-clip, mean over optimizer
  steps), optimizer_steps (taken), nonfinite_grad_steps (skipped for a NaN or inf gradient; only when there
  were any), logp_diff_mean/max (|rollout engine - trainer| log-prob of the sampled tokens), mismatch_kl (k3
  KL(rollout || trainer) on them), tis_weight_mean (as applied), tis_ratio_max (before the cap),
  tis_capped_frac, old_logp_gap_mean/max (with several minibatches: the first minibatch's training forward
  against its separately scored old log-probs, before any optimizer step; 0 up to rounding), lr,
  time_{rollout,reward,logprobs,update,sync,step} (seconds), rollout_tokens_per_s and tokens_per_s
  (completion tokens / rollout time, / step time), compile_s (seconds of the step compiling), peak_mem_gib
  (CUDA; 0 on CPU) and on CUDA peak_mem_before_update_gib, peak_mem_update_gib and update_working_mem_gib
  (the update's peak above what was allocated when it began), compiled_graphs (with compile_policy: the
  process's graphs so far), skipped_update (no group had a reward spread), eval_* (evaluate.py's keys).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from minigrpo.model.checkpoint import fsync_tree

# (key, label, format, meaning) of what the stdout line shows, in order; keys missing from a record are skipped.
_LINE = [
    ("reward_mean", "reward", "{:.3f}", None), ("accuracy", "acc", "{:.3f}", "share exactly correct"),
    ("zero_spread_frac", "flat", "{:.2f}", "share of rows in groups with equal rewards (no policy gradient)"),
    ("completion_len_mean", "len", "{:.0f}", "mean completion length"),
    ("truncated_frac", "trunc", "{:.2f}", "share cut off at --max-new-tokens"), ("loss", "loss", "{:+.4f}", None),
    ("kl", "kl", "{:.4f}", "k3 KL to the initial policy"),
    ("clip_frac", "clip", "{:.3f}", "share of tokens clipped"), ("entropy", "ent", "{:.3f}", "entropy per token"),
    ("grad_norm", "gnorm", "{:.3f}", "gradient norm before clipping"),
    ("logp_diff_max", "dlogp", "{:.1e}", "max |rollout - trainer| log-prob of a sampled token"),
    ("lr", "lr", "{:.1e}", None), ("tokens_per_s", "tok/s", "{:.0f}", "completion tokens per second"),
    ("time_rollout", "roll", "{:.2f}s", "rollout seconds"),
    ("time_logprobs", "lp", "{:.2f}s", "seconds scoring old / reference log-probs"),
    ("time_update", "upd", "{:.2f}s", "update seconds"),
    ("time_sync", "sync", "{:.3f}s", "seconds copying the weights to the rollout engine"),
    ("compile_s", "comp", "{:.1f}s", "seconds of the step spent compiling (torch.compile)"),
    ("peak_mem_gib", "mem", "{:.1f}Gi", "peak GPU memory, GiB"),
    ("eval_accuracy", "EVAL acc", "{:.4f}", "test accuracy (mean over --eval-samples)"),
]
LEGEND = "columns: " + "; ".join(f"{label} = {meaning}" for _, label, _, meaning in _LINE if meaning)


def format_line(record: dict) -> str:
    parts = [f"step {record['step']}"]
    if record.get("skipped_update"):
        parts.append("(no update: every group had zero advantage)")
    parts += [f"{label} {fmt.format(record[key])}" for key, label, fmt, _ in _LINE if record.get(key) is not None]
    return " | ".join(parts)


class DamagedLog(ValueError):
    """A complete line of a run's jsonl log is not JSON: the file was edited or damaged, not cut short."""


LOGS = ("metrics", "samples", "eval")  # the run's <name>.jsonl logs


def check_logs(out_dir: Path) -> None:
    """Raise DamagedLog where a run's log holds a complete line that is not a step's record: a resume checks
    this before it changes anything in the run."""
    for name in LOGS:
        _records_upto(out_dir / f"{name}.jsonl", step=-1)


def _records_upto(path: Path, step: int) -> list[str]:
    """The lines of `path` that record steps <= `step`, after checking every complete line (a last line a
    crash cut short is dropped)."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # complete lines only
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            if line.strip() and _step_of(json.loads(line)) <= step:
                kept.append(line.decode())
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError):
            raise DamagedLog(f"{path}:{number} is not a JSON record of a step; repair or remove that line, then "
                             f"resume again") from None
    return kept


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records of steps <= `step` (and no line a crash cut short), rewriting the file atomically."""
    if not path.is_file():
        return
    kept = _records_upto(path, step)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    fsync_tree(tmp)
    os.replace(tmp, path)
    fsync_tree(path.parent, recursive=False)


def _step_of(record: dict) -> int:
    """A record's step (0 for none); TypeError when it has no integer one."""
    step = record.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step {step!r} is not an integer")
    return step


class MetricsLogger:
    def __init__(self, out_dir: str | Path, *, tensorboard: bool = False, resume_step: int | None = None,
                 echo: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {name: self.out_dir / f"{name}.jsonl" for name in LOGS}
        for p in self.paths.values():
            if resume_step is not None:
                _truncate_after(p, resume_step)
            elif p.exists():  # a fresh run never writes over (or after) another run's records
                raise FileExistsError(f"{p} exists: it holds another run's records; resume that run or "
                                      f"write to a new folder")
        self.echo = echo
        if echo:
            tqdm.write(LEGEND)
        self._tb = None
        if tensorboard:  # needs the tensorboard package: train.py checks for it before anything runs
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)

    def log(self, record: dict) -> None:
        """Write one step's record (a flat dict of numbers with a 'step' key) everywhere."""
        self.log_rows("metrics", record["step"], [record])
        if self.echo:
            tqdm.write(format_line(record))  # plays well with an active progress bar
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    def log_rows(self, name: str, step: int, rows: list[dict]) -> None:
        """Append `step`'s rows to `name`.jsonl ("metrics", "samples" or "eval")."""
        with self.paths[name].open("a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class _CompileClock:
    """Wall seconds this process has spent in torch.compile (tracing, code generation, backward graphs at first
    use), from Dynamo's callbacks at the start and end of each outermost compile. Counts from the first read."""

    def __init__(self):
        self.total, self.since = 0.0, None

    def read(self) -> float:
        from torch._dynamo.callback import callback_handler
        if self._start not in callback_handler.start_callbacks:  # the first read, or torch._dynamo.reset() since
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
        return self.total + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def _start(self, *_):
        self.since = time.perf_counter()

    def _end(self, *_):
        self.total, self.since = self.total + time.perf_counter() - self.since, None


compile_seconds = _CompileClock().read


class PhaseTimer:
    """Wall time per phase (CUDA synchronised: each is charged for its own kernels) and seconds spent compiling."""

    def __init__(self, device: torch.device, phases: tuple[str, ...]):
        self.device, self.times = device, dict.fromkeys(phases, 0.0)  # phases not reached stay at 0
        self._sync()
        self.start = self.last = time.perf_counter()
        self.compile_start = compile_seconds()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def lap(self, phase: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.times[phase], self.last = now - self.last, now

    @property
    def total(self) -> float:
        return self.last - self.start

    @property
    def compiling(self) -> float:
        return compile_seconds() - self.compile_start
