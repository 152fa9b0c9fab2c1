"""The Dr. GRPO training step (`Trainer.step` reads as this list; the run around it is loop.py):
  1. rollout   B prompts x G samples from the rollout backend, at the sampling temperature
  2. reward    task.score per completion; A = r - mean of its group (no std division: grpo.py)
  3. filter    with beta = 0 a group whose advantages are all zero has no gradient: its rows get no forward
               (the update is skipped when none is left); with beta > 0 the KL term trains every row
  4. logprobs  the frozen initial policy's (beta > 0) and the old policy's, no grad, in score_batch_size
               micro-batches; with one minibatch per epoch the old ones come free from the first epoch's forward.
               An offloaded reference is copied in from host memory during the rollout and freed here (offload.py)
  5. update    K epochs over shuffled minibatches of the B*G rows, one AdamW step each, on the clipped surrogate
               (+ beta * k3 KL) normalised by (minibatch rows x max_new_tokens): dropped rows still count, so
               the gradient is the full minibatch's. Each token is weighted by min(pi_old / pi_rollout, tis_cap)
               (grpo.py): the engine samples from its own bf16 distribution, not exactly from pi_old
  6. sync      the backend's weights are refreshed from the policy (nothing to do when they share memory)
The LR is a function of the step number; every random number derives from (seed, step, ...) (data.py). Under
torchrun each rank rolls out its block of the prompts; DDP or FSDP keep the single-process math (distributed.py).

Shape legend: B prompts per step, G samples per prompt, N = B*G rows, R = N/W rows of each of W ranks,
n kept rows (of this rank), C completion length; m rows of a micro-batch, C' its completion length (trimmed to
its longest row).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import state_dict as dcp

from minigrpo.model.sampling import SamplingParams
from minigrpo.model.transfer import to_device
from minigrpo.rl.compile_layers import compile_layers
from minigrpo.rl.config import RESUMABLE_CHANGES, WEIGHT_DTYPES, TrainConfig, lr_factor
from minigrpo.rl.data import ROLLOUT, ROUNDING, SHUFFLE, EpochSampler, derive_seeds
from minigrpo.rl.distributed import Dist, GradSync, frozen_forward
from minigrpo.rl.grpo import dr_grpo_loss, group_advantages, nonzero_groups, truncated_is_weights
from minigrpo.rl.offload import HostOffload
from minigrpo.rl.optim import StochasticAdamW
from minigrpo.rl.sequences import SequenceBatch, completion_logprobs, pad_rows
from minigrpo.rl.step_metrics import UpdateSums, mismatch_metrics, rollout_metrics, speed_and_memory
from minigrpo.run.checkpoints import fingerprint, load_checkpoint, resolve_checkpoint, save_checkpoint
from minigrpo.run.metrics import PhaseTimer
from minigrpo.run.stopping import NonFiniteError, nonfinite

INPUTS = {"prompts": "the training prompts (--train-data, --task, --template or the tokenizer)",
          "answers": "the training answers (--train-data or --answer-field)",
          "reference": "the KL reference's weights (the initial model, --model-dir)"}  # Trainer.inputs, in words


@dataclass
class _Rows:
    """This rank's n rows to train, and what the update needs of each."""
    batch: SequenceBatch              # prompt + completion tokens of n rows
    adv: torch.Tensor                 # advantages (n,)
    rollout_logp: torch.Tensor        # the sampler's log-probs of the completion tokens (n, C)
    position: dict[int, int]          # global rollout row -> row of `batch`; empty for a stand-in row
    most: int                         # the most rows any rank trains (>= 1): all run as many forwards

    @property
    def mask(self) -> torch.Tensor:
        """(n, C) the trained tokens; none for a stand-in row."""
        return self.batch.mask * bool(self.position)


def _inputs(task, ref) -> dict[str, str]:
    """What a resume must find as the checkpoint left it, besides the config: the training prompts (data, template
    and tokenizer), the answers the rewards check, and the KL anchor, read again from the initial model
    (Trainer.resume): the first values of each tensor, enough to tell another model apart."""
    inputs = {"prompts": fingerprint(np.asarray(task.prompt(i), np.int64).tobytes() for i in range(len(task))),
              "answers": fingerprint(str(task.describe(i).get("ground_truth", "")).encode() for i in range(len(task)))}
    if ref is not None:  # a copy: numpy sharing a parameter's storage pins its size
        inputs["reference"] = fingerprint(p.detach().reshape(-1)[:1024].to("cpu", copy=True).view(torch.uint8)
                                          .numpy().tobytes() for p in ref.parameters())
    return inputs


class Trainer:
    def __init__(self, cfg: TrainConfig, model, tokenizer, task, backend, out_dir: str | Path, *,
                 eval_task=None, tokenizer_dir: str | Path | None = None, tensorboard: bool = False,
                 echo: bool = True, dist: Dist = Dist()):
        want = WEIGHT_DTYPES[cfg.weights]
        bad = sorted({str(p.dtype) for p in model.parameters()} - {str(want)})
        if bad:
            raise ValueError(f"weights={cfg.weights!r} needs the policy in {want}, found {bad}; load it with "
                             f"dtype={want}")
        self.cfg, self.model, self.tokenizer, self.task, self.backend = cfg, model, tokenizer, task, backend
        self.eval_task, self.tokenizer_dir, self.dist = eval_task, tokenizer_dir, dist
        self.out_dir, self.tensorboard, self.echo = Path(out_dir), tensorboard, echo
        self.device = next(model.parameters()).device
        self.amp_dtype = torch.bfloat16 if self.device.type == "cuda" and cfg.weights == "fp32" else None
        # Plain temperature sampling, never top-k or top-p: the trainer scores the full distribution, and tokens
        # outside a nucleus are never drawn, a bias no importance weight can correct.
        self.params = SamplingParams(temperature=cfg.temperature)
        self.recompute_layers = cfg.recomputed_layers(model.config.num_hidden_layers)  # in the training forward
        # The KL anchor is the policy as it is now, before any update: train.py builds the Trainer before resuming,
        # and resume() checks the anchor's fingerprint against the checkpoint's.
        self.ref = copy.deepcopy(model).requires_grad_(False).eval() if cfg.kl_beta > 0 else None
        if cfg.compile_policy:
            compile_layers([m for m in (model, self.ref) if m is not None])
        self.inputs = _inputs(task, self.ref)  # before FSDP shards the reference
        self.sampler = EpochSampler(len(task), cfg.seed)  # the global prompt order, the same on every rank
        dist.shard(range(cfg.prompts_per_step), "prompts per step (-B)")  # fails now, not at step 1
        self.policy = GradSync(model, self._logprobs, dist, cfg.parallel)  # the training forward (DDP / FSDP)
        self.ref_forward = (frozen_forward(self.ref, self._logprobs, dist, cfg.parallel)  # scores the KL anchor
                            if self.ref is not None else None)
        # on the device only from the rollout to its scoring pass, so never during the update (offload.py)
        self.ref_offload = HostOffload(self.ref) if cfg.offload_reference else None
        adamw = (StochasticAdamW if cfg.weights == "bf16"
                 else functools.partial(torch.optim.AdamW, fused=self.device.type == "cuda"))
        # after GradSync: FSDP replaces the parameters by their shards
        self.optimizer = adamw(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.step_idx = 0
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded
        self.last_rollout: dict | None = None  # the latest step's prompts, completions and rewards

    # ------------------------------------------------------------------------------------------- one step

    def step(self) -> dict:
        """One Dr. GRPO step, stages 1-6 of the module doc. Returns its metrics (listed in metrics.py)."""
        cfg, G = self.cfg, self.cfg.samples_per_prompt
        self.step_idx += 1
        lr = self._begin_step()
        timer = PhaseTimer(self.device, ("rollout", "reward", "logprobs", "update", "sync"))
        if self.ref_offload is not None:
            self.ref_offload.fetch()  # copied in on a side stream while the rollout runs

        examples, prompts, rollout, stopped = self._rollout()                                   # 1. rollout
        timer.lap("rollout")
        rewards, correct = self._rewards(examples, rollout)                                     # 2. reward (R,)
        adv = group_advantages(rewards, G)                                                      # (R,)
        informative = nonzero_groups(adv, G)                                                    # 3. filter (R,)
        train_mine = informative if cfg.kl_beta == 0 else torch.ones_like(informative)          # (R,) this rank's
        train_all = self.dist.gather(train_mine)                                                # (N,) all ranks'
        m = {"step": self.step_idx, **rollout_metrics(rollout.tokens, stopped, rewards, correct, informative,
                                                     train_all, self.dist), "lr": lr}
        timer.lap("reward")

        if not train_all.any():  # no group on any rank has a reward spread (and beta = 0): nothing to learn
            m["skipped_update"] = True
        else:
            rows = self._training_rows(prompts, rollout, adv, train_mine, train_all)
            ref_logp, old_logp, entropy = self._reference_and_old_logprobs(rows)               # 4. log-probs
            timer.lap("logprobs")
            with self._update_memory(m):
                update, old_logp, entropy = self._update(rows, ref_logp, old_logp, entropy, train_all)  # 5. update
            m.update(update)
            timer.lap("update")
            m.update(mismatch_metrics(old_logp, rows.rollout_logp, entropy, rows.mask, self.cfg.tis_cap, self.dist))
            self.backend.load_weights(self.model)                                               # 6. weight sync
            timer.lap("sync")
        m.update(speed_and_memory(timer, m, self.device, compiled=self.cfg.compile_policy))
        return m

    # ------------------------------------------------------------------------------------------- its stages

    def _begin_step(self) -> float:
        """Training mode, this step's LR (a pure function of the step: no scheduler state), peak memory reset."""
        self.model.train()
        lr = self.cfg.lr * lr_factor(self.step_idx - 1, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return lr

    def _rollout(self):
        """Stage 1: this rank's B/W prompts and their completions, each from its own seed, cut after the first
        stop. Returns (example indices, prompt token lists, Rollout, whether each completion stopped)."""
        cfg, dist = self.cfg, self.dist
        examples = dist.shard(self.sampler.next(cfg.prompts_per_step))
        seeds = dist.shard(derive_seeds(cfg.seed, ROLLOUT, self.step_idx, cfg.rows_per_step))
        prompts = [self.task.prompt(i) for i in examples]
        rollout = self.backend.generate(prompts, cfg.samples_per_prompt, cfg.max_new_tokens, self.params,
                                        self.task.stops.backend_stops, seeds)
        return examples, prompts, *self.task.stops.cut(rollout)

    def _rewards(self, examples: list[int], rollout) -> tuple[torch.Tensor, list[bool]]:
        """Stage 2: the task's reward of each completion (R,), and whether each is exactly correct."""
        G = self.cfg.samples_per_prompt
        scores = [self.task.score(examples[r // G], c) for r, c in enumerate(rollout.tokens)]
        self.last_rollout = {"examples": examples, "completions": rollout.tokens, "rewards": [s[0] for s in scores]}
        return torch.tensor([s[0] for s in scores], dtype=torch.float32), [s[1] for s in scores]

    def _training_rows(self, prompts, rollout, adv: torch.Tensor, train_mine: torch.Tensor,
                       train_all: torch.Tensor) -> _Rows:
        """This rank's rows to train (train_mine (R,); train_all (N,): every rank's) as one batch. A rank with none
        still joins every gradient reduction: it gets a stand-in row, trained at weight 0."""
        G = self.cfg.samples_per_prompt
        kept = train_mine.nonzero().squeeze(1).tolist()
        index = kept or [0]
        batch = SequenceBatch.build([prompts[r // G] for r in index], [rollout.tokens[r] for r in index],
                                    pad_id=self.tokenizer.pad_id, device=self.device)
        offset = self.dist.rank * len(train_mine)  # the global index of this rank's first rollout row
        most = max(1, int(train_all.view(self.dist.world, -1).sum(1).max()))  # the most rows of one rank
        rollout_logp = pad_rows([rollout.logprobs[r] for r in index], batch.C, self.device)  # (n, C)
        return _Rows(batch, adv[index].to(self.device), rollout_logp, {offset + r: j for j, r in enumerate(kept)}, most)

    def _reference_and_old_logprobs(self, rows: _Rows):
        """Stage 4: the KL reference's log-probs (beta > 0), and the old policy's with its entropy, (n, C) each;
        None, None for the old ones that the first epoch's forward will give (one minibatch per epoch)."""
        ref_logp = None
        if self.ref is not None:
            with self.ref_offload or contextlib.nullcontext():  # fetched, then freed before the update
                ref_logp = self._score(self.ref_forward, rows.batch, rows.most)[0]
        if self.cfg.rows_per_minibatch == self.cfg.rows_per_step:
            return ref_logp, None, None
        return (ref_logp, *self._score(self.policy, rows.batch, rows.most, return_entropy=True))

    def _update(self, rows: _Rows, ref_logp, old_logp, entropy, train_all: torch.Tensor):
        """Stage 5: K epochs of minibatch AdamW steps. ref/old_logp, entropy (n, C); train_all (N,): the rows that
        train, on any rank. Returns (metrics, old_logp, entropy). With old_logp None the first epoch's forward,
        before any optimizer step, is the old policy's: it fills old_logp (and entropy), its ratios exactly 1."""
        fill = old_logp is None
        if fill:
            old_logp, entropy = torch.zeros_like(rows.rollout_logp), torch.zeros_like(rows.rollout_logp)
        sums = UpdateSums(self.device)
        for k, epoch, minibatch, count in self._minibatches(rows, train_all):  # _optimizer_step leaves no gradient
            for u, (micro, last, scale) in enumerate(self._micro_batches(minibatch, count)):
                mb, idx = rows.batch.select(micro), to_device(torch.tensor(micro), self.device)  # m rows, (m,)
                with self.policy.accumulate(u == 0, last):  # the last backward reduces (DDP / FSDP)
                    logp = self._forward(mb, idx, old_logp, entropy, fill and epoch == 0 and scale > 0)
                    if scale and not fill and not sums.norms:  # no optimizer step yet: the old policy, scored twice
                        sums.add_old_gap(logp, old_logp[idx, :mb.C], mb.mask)
                    loss, stats = self._loss(logp, mb.mask, idx, rows, old_logp, ref_logp)
                    (loss * scale).backward()
                if scale:  # 0: a stand-in micro-batch (_micro_batches)
                    sums.add(loss, stats, mb.mask.sum())
            sums.norms.append(self._optimizer_step(k))
        return sums.metrics(self.dist, with_kl=ref_logp is not None, with_old_gap=not fill), old_logp, entropy

    def _forward(self, mb: SequenceBatch, idx, old_logp, entropy, fill: bool) -> torch.Tensor:
        """The policy's log-probs of micro-batch `mb` (m, C'), rows idx. fill: this forward is the old policy's
        (first epoch, no optimizer step yet), so it also writes those rows' old_logp and entropy."""
        if not fill:
            return self.policy(mb)
        logp, ent = self.policy(mb, True)                                                      # (m, C') each
        old_logp[idx, :mb.C], entropy[idx, :mb.C] = logp.detach(), ent
        return logp

    def _loss(self, logp, mask, idx, rows: _Rows, old_logp, ref_logp):
        """dr_grpo_loss of the micro-batch of rows `idx`, normalised by the whole minibatch, each token weighted by
        its truncated importance weight (unless --no-tis)."""
        cfg, C = self.cfg, logp.shape[1]
        old = old_logp[idx, :C]
        tis = truncated_is_weights(old, rows.rollout_logp[idx, :C], cfg.tis_cap) if cfg.tis else None
        return dr_grpo_loss(logp, old, rows.adv[idx], mask, eps_low=cfg.eps, eps_high=cfg.eps_high,
                            ref_logp=ref_logp[idx, :C] if ref_logp is not None else None, beta=cfg.kl_beta,
                            max_new_tokens=cfg.max_new_tokens, num_sequences=cfg.rows_per_minibatch, is_weight=tis)

    # ------------------------------------------------------------------------------------------- plumbing

    def _minibatches(self, rows: _Rows, train_all: torch.Tensor):
        """(k, epoch, this rank's rows, micro-batches per rank) of each of the K x N/M minibatches that trains a
        row on any rank. One permutation of all ranks' rows draws them, so every rank takes the same steps; k
        counts skipped minibatches too. Every rank runs as many micro-batches as the fullest rank needs."""
        cfg, W = self.cfg, self.dist.world
        N, M, R = cfg.rows_per_step, cfg.rows_per_minibatch, cfg.rows_per_step // W
        train_all = train_all.tolist()
        for epoch in range(cfg.inner_epochs):
            order = np.random.default_rng([cfg.seed, SHUFFLE, self.step_idx, epoch]).permutation(N).tolist()
            for start in range(0, N, M):
                drawn = [r for r in order[start:start + M] if train_all[r]]
                if drawn:
                    mine = [rows.position[r] for r in drawn if r in rows.position]
                    most = max(sum(r // R == q for r in drawn) for q in range(W))  # rows of the fullest rank
                    yield epoch * (N // M) + start // M, epoch, mine, -(-most // cfg.micro_batch_size)

    def _micro_batches(self, minibatch: list[int], count: int):
        """(rows, last, loss scale) of each of `count` micro-batches, in row order: a prompt's rows are
        neighbours, so a micro-batch packs few distinct prompts (each loss is normalised by the whole
        minibatch: the grouping leaves the gradient as it is). Past its own rows a rank backwards a stand-in row at
        weight 0: every rank makes the same backwards."""
        size = self.cfg.micro_batch_size
        minibatch = sorted(minibatch)
        for u in range(count):
            sub = minibatch[u * size:(u + 1) * size]
            yield sub or [0], u == count - 1, self.policy.loss_scale if sub else 0.0

    def _optimizer_step(self, k: int) -> torch.Tensor | None:
        """Clip the gradient and take the update's k-th optimizer step. Returns the pre-clip gradient norm, or None
        without a step for a NaN or inf one, so that no later minibatch trains on poisoned weights. An inf
        gradient from a finite loss (an overflow in the backward) is counted (nonfinite_grad_steps) and the run
        goes on; a NaN or inf loss stops the run after this step, unsaved (loop.run)."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm or float("inf"))
        finite = bool(torch.isfinite(norm))
        if finite and isinstance(self.optimizer, StochasticAdamW):  # its rounding noise: a function of (seed, step, k)
            self.optimizer.step(derive_seeds(self.cfg.seed, ROUNDING, self.step_idx, k + 1)[k])  # k-th of any count
        elif finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm if finite else None

    @contextlib.contextmanager
    def _update_memory(self, m: dict):
        """On CUDA, record in `m` the update's peak memory, and its working memory: that peak above what was
        allocated when the update began (weights, optimizer state once created, this step's rows and log-probs)."""
        dev = self.device
        if dev.type != "cuda":
            yield
            return
        peak_before, resident = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield
        peak = torch.cuda.max_memory_allocated(dev)
        m.update(peak_mem_update_gib=peak / 2**30, update_working_mem_gib=(peak - resident) / 2**30,
                 peak_mem_before_update_gib=peak_before / 2**30)

    @torch.no_grad()
    def _score(self, forward, batch: SequenceBatch, most: int = 0, return_entropy: bool = False):
        """Log-probs and entropy (or None) (n, C) of every row of `batch` under `forward`, no grad, in as many
        micro-batches as `most` rows need (the most of any rank): past n, on stand-ins."""
        n, size = len(batch.prompts), self.cfg.score_batch_size
        out = torch.zeros((1 + return_entropy, n, batch.C), dtype=torch.float32, device=self.device)  # logp [, entropy]
        for s in range(0, max(n, most), size):
            rows = list(range(s, min(s + size, n)))
            mb = batch.select(rows or [0])
            scores = forward(mb, return_entropy)
            scores = torch.stack(scores if return_entropy else [scores])[:, :len(rows)]  # a stand-in dropped
            out[:, s:s + len(rows), :mb.C] = scores
        return out[0], out[1] if return_entropy else None

    def _logprobs(self, model, batch: SequenceBatch, return_entropy: bool = False):
        return completion_logprobs(model, batch, temperature=self.cfg.temperature,
                                   chunk_size=self.cfg.logprob_chunk_size, amp_dtype=self.amp_dtype,
                                   return_entropy=return_entropy,
                                   recompute_layers=self.recompute_layers)

    # ------------------------------------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        """Rank 0 writes the full weights and AdamW state (gathered under FSDP) while the others wait. Weights with
        NaN or inf are never saved (NonFiniteError)."""
        bad = nonfinite(self.model)
        if bad:
            raise NonFiniteError(self.step_idx, bad)
        full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0, in host memory; {} elsewhere
        weights = dcp.get_model_state_dict(self.model, options=full)
        optimizer = dcp.get_optimizer_state_dict(self.model, self.optimizer, options=full)
        state = {"config": asdict(self.cfg), "optimizer": optimizer, "sampler": self.sampler.state_dict(),
                 "inputs": self.inputs}
        if self.dist.is_main:
            save_checkpoint(self.out_dir / "checkpoints", self.step_idx, self.model, state, weights=weights,
                            tokenizer_dir=self.tokenizer_dir, keep=self.cfg.keep_checkpoints)
        self.dist.barrier()
        return self.out_dir / "checkpoints" / f"step_{self.step_idx:06d}"

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint (its directory, or a run directory's newest). Nothing on disk changes until
        training starts (`loop.run` rewinds the logs and `latest` to it), so a refused resume changes nothing."""
        ckpt = resolve_checkpoint(path)
        state = load_checkpoint(ckpt, self.model)
        saved = state["config"]
        changed = {k: (saved.get(k), v) for k, v in asdict(self.cfg).items()
                   if k not in RESUMABLE_CHANGES and saved.get(k) != v}
        if self.cfg.lr_schedule == "cosine" and saved.get("steps") != self.cfg.steps:
            changed["steps (sets the cosine schedule)"] = (saved.get("steps"), self.cfg.steps)
        if changed:
            diffs = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"cannot resume exactly: settings differ from the checkpoint's ({diffs}); "
                             f"rerun with the original values")
        # an input a checkpoint of an earlier version did not record (the answers) is not checked
        other = [INPUTS[k] for k, v in self.inputs.items() if state["inputs"].get(k, v) != v]
        if other:
            raise ValueError(f"cannot resume exactly: {' and '.join(other)} differ from the checkpoint's; resume "
                             f"with the run's own")
        dcp.set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=dcp.StateDictOptions(full_state_dict=True))
        self.sampler.load_state_dict(state["sampler"])
        self.step_idx = state["step"]
        self.backend.load_weights(self.model)
        self.resumed_from = ckpt
