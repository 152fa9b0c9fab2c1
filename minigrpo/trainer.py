"""The Dr. GRPO training loop: rollout -> reward -> advantages -> clipped policy-gradient updates.

One step (`Trainer.step`):
  1. rollout   B prompts x G samples from the rollout backend, at the sampling temperature / top-p
  2. reward    task.score per completion; A = r - mean of its group (no std division: Dr. GRPO, grpo.py)
  3. filter    with beta = 0, a group whose advantages are all zero has no gradient: its rows are dropped
               before any forward; if no group is left the update is skipped (and logged as such). With
               beta > 0 every row trains: the KL term of a flat group has a gradient too
  4. logprobs  reference log-probs from a frozen copy of the initial policy, only when kl_beta > 0; old
               log-probs (the policy before this step's updates): with one minibatch per epoch (the default)
               they come free from the first epoch's own forward, during which the policy has not moved
               yet; otherwise from a separate pass without grad. Both passes keep no activations, so they
               run in larger micro-batches (score_batch_size)
  5. update    K epochs over shuffled minibatches of the B*G rows; each minibatch is one AdamW step on the
               clipped surrogate (+ beta * k3 KL), normalised as token-sum / (minibatch rows x max_new_tokens)
               and accumulated over micro-batches (memory only). Dropped rows still count in the normaliser,
               so dropping them is a pure saving: the gradient is exactly the full minibatch's. Each token's
               surrogate is weighted by min(pi_old / pi_rollout, tis_cap) (truncated importance sampling,
               grpo.py): the engine samples from its own bf16 distribution, not exactly from pi_old
  6. sync      the backend's weights are refreshed from the policy (`load_weights`), timed
The LR (linear warmup, then constant or cosine) is a function of the step number: no scheduler state.
Data parallel (torchrun, `dist`): each rank rolls out its block of the B prompts and the update runs
through DDP; the math is the single-process step's (distributed.py). Step metrics are over all ranks.
All randomness is derived from (seed, step, ...) on the spot, never from a global generator, so a
resumed run reproduces an uninterrupted one.

Precision (`weights`): "fp32" keeps fp32 master weights and AdamW state; on CUDA the policy forward runs
under bf16 autocast (tensor cores) and the LM head in bf16 with fp32 softmax (sequences.completion_logprobs);
on CPU, fp32. "bf16" keeps the weights, gradients and AdamW moments in bf16 and updates them with
stochastic rounding (optim.py): half the memory, for the same expected trajectory.

Shape legend: B prompts per step, G samples per prompt, N = B*G rows, R = N/W rows of each of W ranks,
n kept rows (of this rank), C completion length.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minigrpo.data import EpochSampler
from minigrpo.distributed import Dist, GradSync
from minigrpo.evaluate import evaluate
from minigrpo.grpo import dr_grpo_loss, group_advantages, mismatch_stats, nonzero_groups, truncated_is_weights
from minigrpo.metrics import MetricsLogger, PhaseTimer
from minigrpo.optim import StochasticAdamW
from minigrpo.sampling import SamplingParams
from minigrpo.sequences import SequenceBatch, completion_logprobs, pad_rows
from minigrpo.stopping import Interrupted, NonFiniteError, StopSignals, nonfinite
from minigrpo.train_config import RESUMABLE_CHANGES, WEIGHT_DTYPES, TrainConfig, lr_factor
from minigrpo.train_state import load_checkpoint, resolve_checkpoint, save_checkpoint, set_latest

_ROLLOUT, _SHUFFLE, _ROUND = 0x5A3D, 0x5AFF, 0x5A40  # stream tags for (seed, tag, step, ...) derivation
SEQ_BUCKET = 64  # a compiled policy's batches are padded to a multiple of this many columns (Trainer._select)


def derive_seeds(seed: int, tag: int, step: int, n: int) -> list[int]:
    """n distinct-in-practice int64 seeds, a pure function of (seed, tag, step)."""
    state = np.random.SeedSequence([seed, tag, step]).generate_state(n, dtype=np.uint64)
    return (state >> np.uint64(1)).astype(np.int64).tolist()


def _allow_every_length_bucket(max_positions: int) -> None:
    """Let Dynamo compile a decoder layer for every length bucket the model's positions allow, and make
    running out an error.

    Every layer shares one code object, whose graphs count against Dynamo's recompile limit (8 by default):
    one per length bucket and grad mode, 2 x (prompt + max_new_tokens) / SEQ_BUCKET of them; a 2,048-token
    budget needs about 72. Past the limit Dynamo would run new shapes eager without a word. Process-wide
    settings: they also cover the engine's compiled step."""
    graphs = 2 * -(-max_positions // SEQ_BUCKET)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, graphs)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, graphs)
    cfg.fail_on_recompile_limit_hit = True


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
        self.eval_task, self.tokenizer_dir = eval_task, tokenizer_dir
        self.out_dir, self.tensorboard, self.echo = Path(out_dir), tensorboard, echo
        self.device = next(model.parameters()).device
        self.amp_dtype = torch.bfloat16 if self.device.type == "cuda" and cfg.weights == "fp32" else None
        self.stop_ids, self.pad_id = tuple(tokenizer.stop_ids), tokenizer.pad_id
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
        # The KL anchor is the policy as it is now, before any update (also when resuming: see resume()).
        self.ref = copy.deepcopy(model).requires_grad_(False).eval() if cfg.kl_beta > 0 else None
        if cfg.compile_policy:
            # Eager, a decoder layer is ~50 small kernels forward (norms, RoPE, SwiGLU, casts) and twice that
            # backward; the 0.5B model's micro-batches leave the GPU waiting on their launches. Compiled, the
            # elementwise ops fuse. Parameters are graph inputs, so one compile serves every layer of both
            # models; nn.Module.compile keeps the state-dict names. Static shapes: the trainer pads its
            # batches to fixed row counts and length buckets (_select), so a layer compiles once per bucket and
            # grad mode. Ragged shapes recompiled mid-run instead, 8-12 s a time, with automatic dynamic shapes
            # as well as with dynamic=True (seen on the H200); `compiled_graphs` in the metrics shows any.
            for m in (model, self.ref) if self.ref is not None else (model,):
                for layer in m.model.layers:
                    layer.compile(dynamic=False)
            _allow_every_length_bucket(model.config.max_position_embeddings)
        if cfg.weights == "bf16":
            self.optimizer = StochasticAdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                             weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                               weight_decay=cfg.weight_decay, fused=self.device.type == "cuda")
        self.sampler = EpochSampler(len(task), cfg.seed)  # the global prompt order, the same on every rank
        self.dist = dist
        dist.shard(range(cfg.prompts_per_step), "prompts per step (-B)")  # fails now, not at step 1
        self.policy = GradSync(model, self._logprobs, dist)  # the training forward (DDP when W > 1)
        self.step_idx = 0
        self.last_rollout: dict | None = None  # the latest step's prompts, completions and rewards

    # ------------------------------------------------------------------------------------------- one step

    def step(self) -> dict:
        cfg, dev = self.cfg, self.device
        B, G, L = cfg.prompts_per_step, cfg.samples_per_prompt, cfg.max_new_tokens
        N = B * G
        self.step_idx += 1
        self.model.train()
        lr = cfg.lr * lr_factor(self.step_idx - 1, cfg)  # a pure function of the step: no scheduler state
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        timer = PhaseTimer(dev, ("rollout", "reward", "logprobs", "update", "sync"))

        dist = self.dist  # W ranks; W = 1 without torchrun, where every dist call is the identity
        examples = dist.shard(self.sampler.next(B))                    # this rank's b = B/W prompts
        seeds = dist.shard(derive_seeds(cfg.seed, _ROLLOUT, self.step_idx, N))  # and their b*G seeds
        prompts = [self.task.prompt(i) for i in examples]
        rollout = self.backend.generate(prompts, G, L, self.params, self.stop_ids, seeds)
        if len(rollout.tokens) != len(seeds):
            raise RuntimeError(f"rollout backend returned {len(rollout.tokens)} completions, expected {len(seeds)}")
        timer.lap("rollout")

        scores = [self.task.score(examples[r // G], c) for r, c in enumerate(rollout.tokens)]
        rewards = torch.tensor([s[0] for s in scores], dtype=torch.float32)              # (R,)
        adv = group_advantages(rewards, G)                                               # (R,)
        informative = nonzero_groups(adv, G)                                             # (R,)
        keep = informative if cfg.kl_beta == 0 else torch.ones_like(informative)        # (R,) step 3
        kept = keep.nonzero().squeeze(1).tolist()
        self.last_rollout = {"examples": examples, "completions": rollout.tokens, "rewards": rewards.tolist()}
        # Rollout statistics over all N rows: each rank's rows, gathered in rank (= global row) order.
        stats = dist.gather(torch.tensor([[len(c), s[1], not set(c) & set(self.stop_ids)]
                                          for c, s in zip(rollout.tokens, scores)], dtype=torch.int64))  # (N, 3)
        all_rewards, all_keep = dist.gather(rewards), dist.gather(keep)                  # (N,), (N,)
        lens = stats[:, 0].tolist()
        m = {"step": self.step_idx, "reward_mean": all_rewards.mean().item(),
             "reward_std": all_rewards.std(0).item(), "accuracy": int(stats[:, 1].sum()) / N,
             "zero_spread_frac": 1.0 - dist.gather(informative).float().mean().item(),
             "completion_len_mean": sum(lens) / N, "completion_len_max": max(lens),
             "truncated_frac": int(stats[:, 2].sum()) / N, "trained_rows": int(all_keep.sum()), "lr": lr}
        timer.lap("reward")

        if m["trained_rows"]:  # a rank with no rows of its own still joins every gradient all-reduce
            rows = kept or [0]  # a stand-in row, trained with zero weight (_update), when this rank has none
            batch = SequenceBatch.build([prompts[r // G] for r in rows], [rollout.tokens[r] for r in rows],
                                        pad_id=self.pad_id, stop_ids=self.stop_ids, device=dev)
            ref_logp = self._score(self.ref, batch)[0] if self.ref is not None else None  # (n, C)
            if (cfg.minibatch_size or N) == N:  # old log-probs from the first epoch's forward (step 4)
                old_logp, entropy = None, None
            else:
                old_logp, entropy = self._score(self.model, batch, return_entropy=True)  # (n, C) each
            timer.lap("logprobs")
            if dev.type == "cuda":  # the update's own peak, above the resident weights and optimizer state
                peak_before, resident = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            sampled = pad_rows([rollout.logprobs[r] for r in rows], batch.C, dev)        # (n, C) pi_rollout
            update, old_logp, entropy = self._update(batch, old_logp, entropy, ref_logp, sampled,
                                                     adv[rows].to(dev), kept, all_keep)
            m.update(update)
            timer.lap("update")
            if dev.type == "cuda":
                update_peak = torch.cuda.max_memory_allocated(dev)
                m.update(peak_mem_update_gb=update_peak / 2**30, update_working_mem_gb=(update_peak - resident) / 2**30,
                         peak_mem_before_update_gb=peak_before / 2**30)
            m.update(self._mismatch_metrics(old_logp, sampled, entropy, batch.mask * bool(kept)))
            self.backend.load_weights(self.model)
            timer.lap("sync")
        else:
            m["skipped_update"] = True

        m.update({f"time_{k}": v for k, v in timer.times.items()}, time_step=timer.total)
        m.update(rollout_tokens_per_s=sum(lens) / max(timer.times["rollout"], 1e-9),
                 tokens_per_s=sum(lens) / max(timer.total, 1e-9),
                 peak_mem_gb=max(torch.cuda.max_memory_allocated(dev) / 2**30,
                                 m.get("peak_mem_before_update_gb", 0.0)) if dev.type == "cuda" else 0.0)
        if cfg.compile_policy:  # the process's torch.compile graphs so far: a step where this grows compiled
            m["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        return m

    @torch.no_grad()
    def _score(self, model, batch: SequenceBatch, return_entropy: bool = False):
        """Log-probs (and entropy) of every row of `batch` under `model`, micro-batched, no grad. (n, C) each."""
        n, C = len(batch.prompt_lens), batch.C
        logp = torch.zeros((n, C), dtype=torch.float32, device=self.device)
        entropy = torch.zeros((n, C), dtype=torch.float32, device=self.device) if return_entropy else None
        for s in range(0, n, self.cfg.score_batch_size):
            rows = list(range(s, min(s + self.cfg.score_batch_size, n)))
            mb = self._select(batch, rows, self.cfg.score_batch_size)
            out = self._logprobs(model, mb, return_entropy)
            lp, ent = out if return_entropy else (out, None)
            logp[s:s + len(rows), :mb.C] = lp[:len(rows)]                # padding rows dropped
            if return_entropy:
                entropy[s:s + len(rows), :mb.C] = ent[:len(rows)]
        return logp, entropy

    def _select(self, batch: SequenceBatch, rows: list[int], size: int) -> SequenceBatch:
        """batch.select(rows); for a compiled policy padded to `size` rows and T to a multiple of SEQ_BUCKET.

        Static shapes, so each decoder layer compiles once per length bucket and grad mode, and never again
        (see __init__). Costs the padding's compute: up to SEQ_BUCKET - 1 columns, and a short last micro-batch."""
        if not self.cfg.compile_policy:
            return batch.select(rows)
        return batch.select(rows, n_rows=size, col_multiple=SEQ_BUCKET)

    def _logprobs(self, model, batch: SequenceBatch, return_entropy: bool = False):
        return completion_logprobs(model, batch, temperature=self.cfg.temperature,
                                   chunk_size=self.cfg.logprob_chunk_size, amp_dtype=self.amp_dtype,
                                   return_entropy=return_entropy,
                                   checkpoint_layers=self.cfg.activation_checkpointing)

    def _mismatch_metrics(self, old_logp, rollout_logp, entropy, mask) -> dict:
        """The policy before the update (pi_old) against the sampler (pi_rollout) on this step's trained tokens,
        over all ranks: mean and max |log-prob difference|, k3 KL(pi_rollout || pi_old), the TIS weight's mean
        (as applied, capped), the uncapped ratio's max and the fraction of tokens capped; and the entropy."""
        st = mismatch_stats(old_logp, rollout_logp, mask, self.cfg.tis_cap)
        sums = self.dist.sum(torch.stack([mask.sum(), (entropy * mask).sum(), st["logp_diff_sum"],
                                          st["mismatch_kl_sum"], st["tis_weight_sum"], st["tis_capped"]]))
        ent, diff, kl, weight, capped = (sums[1:] / sums[0].clamp(min=1)).tolist()   # per trained token
        maxima = self.dist.max(torch.stack([st["logp_diff_max"], st["tis_ratio_max"]])).tolist()
        return {"entropy": ent, "logp_diff_mean": diff, "logp_diff_max": maxima[0], "mismatch_kl": kl,
                "tis_weight_mean": weight, "tis_ratio_max": maxima[1], "tis_capped_frac": capped}

    def _update(self, batch, old_logp, entropy, ref_logp, rollout_logp, adv, kept: list[int], all_keep: torch.Tensor):
        """K epochs of minibatch AdamW steps over the kept rows. adv (n,), old/ref/rollout_logp, entropy (n, C),
        all_keep (N,).

        old_logp None (one minibatch per epoch): the first epoch's forward, before any optimizer step, is
        the old policy's; its log-probs (and entropy) fill old_logp, and its ratios are exactly 1.
        Minibatches are drawn from all ranks' rows, so the ranks take the same optimizer steps. A rank with
        none of a minibatch's rows backwards a stand-in row at zero weight: DDP needs every rank's backward.
        Returns (metrics, old_logp, entropy)."""
        cfg = self.cfg
        fill = old_logp is None
        if fill:
            old_logp = torch.zeros(batch.mask.shape, dtype=torch.float32, device=self.device)  # (n, C)
            entropy = torch.zeros_like(old_logp)
        N = cfg.prompts_per_step * cfg.samples_per_prompt
        M = cfg.minibatch_size or N
        offset = self.dist.rank * (N // self.dist.world)  # global index of this rank's first rollout row
        row_of = {offset + r: j for j, r in enumerate(kept)}  # global rollout row -> row of `batch`
        scale = self.policy.loss_scale
        params = [p for p in self.model.parameters() if p.requires_grad]
        zero = torch.zeros((), device=self.device)
        loss_sum, clip_sum, kl_sum, tok_sum = zero.clone(), zero.clone(), zero.clone(), zero.clone()
        norms, skipped_nonfinite = [], 0
        opt_steps = cfg.inner_epochs * (N // M)
        rounding = derive_seeds(cfg.seed, _ROUND, self.step_idx, opt_steps)  # per optimizer step (optim.py)
        for epoch in range(cfg.inner_epochs):
            order = np.random.default_rng([cfg.seed, _SHUFFLE, self.step_idx, epoch]).permutation(N).tolist()
            for start in range(0, N, M):
                if not all_keep[order[start:start + M]].any():  # only zero-advantage groups: nothing to learn
                    continue
                rows = [row_of[r] for r in order[start:start + M] if r in row_of]
                micro = [rows[u:u + cfg.micro_batch_size] for u in range(0, len(rows), cfg.micro_batch_size)]
                self.optimizer.zero_grad(set_to_none=True)
                for u, sub in enumerate(micro or [[0]]):  # [[0]]: the zero-weight stand-in (docstring)
                    mb = self._select(batch, sub, cfg.micro_batch_size)
                    k = len(sub)                                       # real rows; any after them are padding
                    idx = torch.tensor(sub + sub[:1] * (len(mb.prompt_lens) - k), device=self.device)  # (m,)
                    with self.policy.accumulate(last=u == max(len(micro), 1) - 1):  # all-reduce on the last
                        if fill and epoch == 0:
                            logp, ent = self.policy(mb, True)                            # (m, C') each
                            old_logp[idx[:k], :mb.C], entropy[idx[:k], :mb.C] = logp[:k].detach(), ent[:k]
                        else:
                            logp = self.policy(mb)                                       # (m, C')
                        old = old_logp[idx, :mb.C]
                        loss, stats = dr_grpo_loss(
                            logp, old, adv[idx], mb.mask, eps_low=cfg.eps, eps_high=cfg.eps_high,
                            ref_logp=ref_logp[idx, :mb.C] if ref_logp is not None else None, beta=cfg.kl_beta,
                            max_new_tokens=cfg.max_new_tokens, num_sequences=M,
                            is_weight=truncated_is_weights(old, rollout_logp[idx, :mb.C], cfg.tis_cap)
                            if cfg.tis else None)
                        (loss * (scale if micro else 0.0)).backward()  # x 1.0 is exact: W=1 is unchanged
                    if not micro:
                        continue
                    ntok = mb.mask.sum()
                    loss_sum += loss.detach()
                    clip_sum += stats["clip_frac"] * ntok
                    kl_sum += stats["kl"] * ntok
                    tok_sum += ntok
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
                if torch.isfinite(norm):
                    if isinstance(self.optimizer, StochasticAdamW):
                        k = epoch * (N // M) + start // M
                        self.optimizer.step(rounding[k])
                    else:
                        self.optimizer.step()
                    norms.append(norm)
                else:  # one bad batch must not poison the weights: drop its gradient
                    skipped_nonfinite += 1
                self.optimizer.zero_grad(set_to_none=True)
        n_steps = max(1, len(norms) + skipped_nonfinite)
        loss_sum, clip_sum, kl_sum, tok_sum = self.dist.sum(torch.stack([loss_sum, clip_sum, kl_sum, tok_sum]))
        out = {"loss": (loss_sum / n_steps).item(), "clip_frac": (clip_sum / tok_sum.clamp(min=1)).item(),
               "grad_norm": torch.stack(norms).mean().item() if norms else None,
               "optimizer_steps": len(norms)}
        if skipped_nonfinite:
            out["nonfinite_grad_steps"] = skipped_nonfinite
        if ref_logp is not None:
            out["kl"] = (kl_sum / tok_sum.clamp(min=1)).item()
        return out, old_logp, entropy

    # ------------------------------------------------------------------------------------------- the loop

    def evaluate(self) -> dict:
        cfg = self.cfg
        res = evaluate(self.backend, self.eval_task, stop_ids=self.stop_ids, limit=cfg.eval_limit,
                       max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, batch_size=cfg.eval_batch_size)
        return {f"eval_{k}": v for k, v in res.items() if k != "records"}

    def run(self) -> list[dict]:
        """Train until cfg.steps, logging, evaluating and checkpointing on schedule. Returns the step records.

        Stops early, raising, on SIGINT / SIGTERM (after the current step and a checkpoint: `Interrupted`)
        and on a NaN or inf loss or weight (before saving them: `NonFiniteError`); see stopping.py."""
        cfg, main = self.cfg, self.dist.is_main  # rank 0 alone evaluates, logs and saves
        logger = MetricsLogger(self.out_dir, tensorboard=self.tensorboard, echo=self.echo,
                               resume_step=self.step_idx if self.step_idx else None) if main else None
        evaluating = main and self.eval_task is not None and cfg.eval_every
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step_idx, desc="train", unit="step", disable=None if main else True)
        try:
            with StopSignals() as signals:
                if evaluating and self.step_idx == 0:
                    logger.log({"step": 0, **self.evaluate()})
                while self.step_idx < cfg.steps:
                    signum = int(self.dist.max(torch.tensor(signals.received or 0)))  # any rank's signal stops all
                    if signum:
                        raise Interrupted(signum, self.step_idx, self.save())
                    m = self.step()
                    bad = nonfinite(self.model, m)
                    if bad:
                        if main:
                            logger.log(m)
                        raise NonFiniteError(self.step_idx, bad)
                    done = self.step_idx == cfg.steps
                    if evaluating and (self.step_idx % cfg.eval_every == 0 or done):
                        m.update(self.evaluate())
                    if main and cfg.sample_every and self.step_idx % cfg.sample_every == 0:
                        logger.log_samples(self.step_idx, self._samples())
                    if main:
                        logger.log(m)
                    history.append(m)
                    if (cfg.save_every and self.step_idx % cfg.save_every == 0) or done:
                        self.save()
                    bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
                    bar.update()
        finally:
            bar.close()
            if logger is not None:
                logger.close()
        return history

    def _samples(self) -> list[dict]:
        r, G = self.last_rollout, self.cfg.samples_per_prompt
        out = []
        for j in range(min(self.cfg.num_samples, len(r["completions"]))):
            row = j * G  # the first sample of each of the first prompts
            ex = r["examples"][row // G]
            text = self.tokenizer.decode(r["completions"][row], skip_special_tokens=False)  # show the stop
            out.append({**self.task.describe(ex), "completion": text, "reward": r["rewards"][row]})
        return out

    # ------------------------------------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        """Rank 0 writes the checkpoint (the state is replicated); the others wait until it is complete.
        Weights with NaN or inf are never saved (NonFiniteError)."""
        bad = nonfinite(self.model)
        if bad:
            raise NonFiniteError(self.step_idx, bad)
        state = {"config": asdict(self.cfg), "optimizer": self.optimizer.state_dict(),
                 "sampler": self.sampler.state_dict()}
        if self.dist.is_main:
            save_checkpoint(self.out_dir / "checkpoints", self.step_idx, self.model, state,
                            tokenizer_dir=self.tokenizer_dir, keep=self.cfg.keep_checkpoints)
        self.dist.barrier()
        return self.out_dir / "checkpoints" / f"step_{self.step_idx:06d}"

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint (its directory, or a run directory: the newest one there). A checkpoint
        of this run's own folder rewinds the run to it: `latest` names it again (train_state.py)."""
        ckpt = resolve_checkpoint(path)
        state = load_checkpoint(ckpt, self.model, self.device)
        saved = state["config"]
        changed = {f.name: (saved.get(f.name), getattr(self.cfg, f.name)) for f in fields(self.cfg)
                   if f.name not in RESUMABLE_CHANGES and saved.get(f.name) != getattr(self.cfg, f.name)}
        if self.cfg.lr_schedule == "cosine" and saved.get("steps") != self.cfg.steps:
            changed["steps (sets the cosine schedule)"] = (saved.get("steps"), self.cfg.steps)
        if changed:
            diffs = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"cannot resume exactly: settings differ from the checkpoint's ({diffs}); "
                             f"rerun with the original values")
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.step_idx = state["step"]
        self.backend.load_weights(self.model)
        own = self.out_dir / "checkpoints"
        if self.dist.is_main and ckpt.parent.resolve() == own.resolve():
            set_latest(own, ckpt.name)
