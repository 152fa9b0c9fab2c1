"""Run by test_fsdp.py, under `torchrun --nproc-per-node 2` (gloo) and in its own process: FSDP2 on what the
smoke preset does not cover, a tied embedding / LM head, bf16 weights and a sharded KL reference.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp_worker.py OUT

First checks StochasticAdamW on a sharded parameter against the whole one, bit for bit (each element keeps
its noise index); then runs `trainer(...)` for STEPS steps and writes the full weights and the step metrics
to OUT/params.pt (rank 0), the weights after each step.
"""

import sys
from pathlib import Path

import torch
from conftest import random_model, tiny_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from minigrpo.engine.rollout import make_backend
from minigrpo.rl import distributed
from minigrpo.rl.config import TrainConfig
from minigrpo.rl.optim import StochasticAdamW
from minigrpo.rl.trainer import Trainer
from minigrpo.tasks.synthetic import CharTokenizer, FirstDigitTask

STEPS = 2


def trainer(out: Path, dist: distributed.Dist = distributed.Dist(), **overrides) -> Trainer:
    """4 prompts x 8 samples, beta 0.1 (every row trains, the reference is sharded too), K = 2 epochs of two
    minibatches, micro-batches of 3, bf16 weights, activation checkpointing, the engine on the CPU."""
    tokenizer = CharTokenizer()
    cfg = TrainConfig(**{"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 3, "inner_epochs": 2,
                         "minibatch_size": 16, "micro_batch_size": 3, "lr": 1e-3, "kl_beta": 0.1, "weights": "bf16",
                         "activation_checkpointing": True, "parallel": "fsdp", "steps": STEPS, "eval_every": 0,
                         "sample_every": 0, "save_every": 0, "seed": 3, **overrides})
    model = random_model(tiny_config(vocab=tokenizer.vocab_size, tied=True), seed=1, dtype=torch.bfloat16).train()
    task = FirstDigitTask(tokenizer, num_examples=1000, seed=1)
    backend = make_backend("sdpa", model, pad_id=tokenizer.pad_id)
    return Trainer(cfg, model, tokenizer, task, backend, out, echo=False, dist=dist)


def check_sharded_optimizer_step() -> None:
    """Parameters of 37, 5 and 3 rows, split 19 + 18, 3 + 2 and 2 + 1 over the ranks: three steps on the shards
    give the whole parameters' steps exactly, with chunks of 16 elements (each shard cut) and of 1000 (the
    whole parameters grouped into one piece, which the shards must not be)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for chunk in (16, 1000):
        g = torch.Generator().manual_seed(0)
        whole = [torch.nn.Parameter(torch.randn(n, 6, generator=g).bfloat16()) for n in (37, 5, 3)]
        shards = [torch.nn.Parameter(distribute_tensor(w.detach().clone(), mesh, [Shard(0)])) for w in whole]
        opts = [StochasticAdamW(ps, lr=1e-2, weight_decay=0.1, chunk=chunk) for ps in (whole, shards)]
        for t in range(3):
            for w, s in zip(whole, shards):
                w.grad = torch.sin(torch.arange(w.numel(), dtype=torch.float32) + t).view_as(w).bfloat16()
                s.grad = distribute_tensor(w.grad, mesh, [Shard(0)])
            for opt in opts:
                opt.step(seed=t)
        for w, s in zip(whole, shards):
            assert torch.equal(s.full_tensor(), w), f"a sharded StochasticAdamW step differs (chunk {chunk})"


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist, _ = distributed.init_from_env("cpu")
    check_sharded_optimizer_step()
    run = trainer(out, dist)
    records, weights = [], []
    for _ in range(STEPS):  # the full weights after each step (gathered on every rank, kept on rank 0)
        records.append(run.step())
        weights.append(get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True)))
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"weights": weights, "records": records}, out / "params.pt")
    distributed.shutdown(dist, together=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
