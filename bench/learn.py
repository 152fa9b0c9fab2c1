"""The learning check: the fast path trains the `--preset learn` task as far and as fast as the reference.

    python bench/learn.py --out $OUT/learn                                  # CUDA: the fast path as shipped
    python bench/learn.py --device cpu --steps 200 --out /tmp/learn         # CPU: the engine, eager

Three runs, same seeds, same task (copy 3 digits, then stop: minigrpo/tasks/synthetic.py's CopyTask), each in a
fresh process so that no run's compiled graphs or GPU state carry into the next:
  fast       the rollout engine as train.py runs it on CUDA: triton decode attention, bf16 engine weights,
             the decode step compiled and captured in CUDA graphs, the fused triton sampler, the compiled
             policy, the weights synced after every update. On the CPU: sdpa, eager, the torch sampler.
  reference  the plain generator on the policy module itself (nothing to sync).
  no-sync    fast, with the engine built on a frozen copy of the initial policy and every sync skipped: it
             keeps sampling the initial policy (a copy, since an engine in the policy's dtype would
             otherwise share its memory and follow every update).
It passes when fast and reference each reach reward 0.8 (the mean of WINDOW consecutive steps), their
steps to get there are within 1.5x of each other, and no-sync does not get there. Writes curves.json
(per-step rewards of each run) to --out, prints the curves side by side, exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train as train_cli  # noqa: E402
from minigrpo.rl.loop import run  # noqa: E402
from minigrpo.rl.trainer import Trainer  # noqa: E402

TARGET, WINDOW, MAX_RATIO = 0.8, 10, 1.5
ENGINE_FLAGS = {"cuda": ["--attn", "triton", "--compile", "step", "--cuda-graphs", "--sampler", "triton",
                         "--compile-policy"],
                "cpu": ["--attn", "sdpa", "--compile", "none", "--no-cuda-graphs", "--sampler", "torch",
                        "--no-compile-policy"]}
REFERENCE_FLAGS = ["--attn", "reference", "--no-compile-policy"]


def train_curve(argv: list[str], sync: bool) -> list[float]:
    """Train `train.py --preset learn` with these flags; the reward of each step's rollout.
    sync=False: the engine samples a frozen copy of the initial policy (module doc)."""
    args = train_cli.parse_args(["--preset", "learn", *argv])
    model, tokenizer, train, test, _ = train_cli.build_smoke(args)
    backend = train_cli.build_backend(args, model if sync else copy.deepcopy(model), tokenizer, train, test)
    if not sync:
        backend.load_weights = lambda model: None
    trainer = Trainer(args.cfg, model, tokenizer, train, backend, args.out, echo=False)
    return [m["reward_mean"] for m in run(trainer)]


def window_mean(rewards: list[float], step: int) -> float:
    """The mean reward of the WINDOW steps ending at `step` (1-based; fewer steps before step WINDOW)."""
    window = rewards[max(0, step - WINDOW):step]
    return sum(window) / len(window)


def steps_to_target(rewards: list[float]) -> int | None:
    """The first step whose full window's mean reward reaches TARGET, else None."""
    return next((s for s in range(WINDOW, len(rewards) + 1) if window_mean(rewards, s) >= TARGET), None)


def check(hit: dict[str, int | None]) -> list[str]:
    """The failed checks, as messages (empty: passed)."""
    failed = [f"{name} never reached {TARGET}" for name in ("fast", "reference") if hit[name] is None]
    if not failed and max(hit["fast"], hit["reference"]) > MAX_RATIO * min(hit["fast"], hit["reference"]):
        failed.append(f"steps to {TARGET}: fast {hit['fast']} vs reference {hit['reference']}, "
                      f"more than {MAX_RATIO}x apart")
    if hit["no-sync"] is not None:
        failed.append(f"no-sync reached {TARGET} at step {hit['no-sync']}: the check cannot see a broken sync")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for curves.json and each run's metrics")
    p.add_argument("--device", default="cuda", choices=sorted(ENGINE_FLAGS), help="cuda: the fast path; "
                   "cpu: the engine without compile, graphs or triton (to test this script)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="the seed of all three runs")
    p.add_argument("--print-every", type=int, default=10, help="table rows: every N steps")
    a = p.parse_args()
    out = Path(a.out)
    common = ["--device", a.device, "--seed", str(a.seed)] + (["--steps", str(a.steps)] if a.steps else [])
    runs = {"fast": (ENGINE_FLAGS[a.device], True), "reference": (REFERENCE_FLAGS, True),
            "no-sync": (ENGINE_FLAGS[a.device], False)}
    curves = {}
    for name, (flags, sync) in runs.items():
        print(f"{name}: train.py --preset learn {' '.join(common + flags)}" + ("" if sync else " (sync off)"),
              flush=True)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            curves[name] = pool.submit(train_curve, common + flags + ["--out", str(out / name)], sync).result()
    hit = {name: steps_to_target(r) for name, r in curves.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.json").write_text(json.dumps({"steps_to_target": hit, "target": TARGET, "window": WINDOW,
                                                 "rewards": curves}, indent=1))

    print(f"\nmean reward of the {WINDOW} steps ending at each step")
    print("step " + "".join(f"{name:>11}" for name in curves))
    n = max(len(r) for r in curves.values())
    for step in list(range(a.print_every, n, a.print_every)) + [n]:
        print(f"{step:4d} " + "".join(f"{window_mean(r, step):11.3f}" for r in curves.values()))
    print(f"steps to {TARGET}: " + ", ".join(f"{k} {v if v is not None else 'never'}" for k, v in hit.items()))
    print(f"checks: fast and reference reach {TARGET}, within {MAX_RATIO}x in steps; no-sync does not")
    failed = check(hit)
    print("\n".join(f"FAIL: {f}" for f in failed) or "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
