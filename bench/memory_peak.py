"""What is live at each phase's peak of a training step, against the memory estimate (minigrpo/rl/memory.py).

    python bench/memory_peak.py lean|default|lean-offload     # on CUDA; writes $OUT/memory_peak_<flags>.txt

The run is tests/test_memory.py's GPU check (bench/workload.small_training_run). Step 1 warms up; step 2 is
recorded with torch.cuda.memory._record_memory_history and replayed allocation by allocation. Each allocation
belongs to the trainer phase on its stack (rollout, log-probs, update, optimizer step); at each phase's
highest point the live allocations are listed, grouped by the package code that made them.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workload import small_training_run

PHASES = ("_optimizer_step", "_update", "_reference_and_old_logprobs", "_rollout")  # innermost first


def phase(frames: list[dict]) -> str:
    names = {f["name"] for f in frames}
    return next((p.strip("_") for p in PHASES if p in names), "other")


def origin(frames: list[dict]) -> str:
    """The innermost three frames in minigrpo/ or bench/: where the tensor was made."""
    ours = [f for f in frames if "minigrpo" in f["filename"] or "bench" in f["filename"]][:3]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in ours) or "(no Python frame)"


def replay(trace: list[dict]) -> dict[str, tuple[int, dict]]:
    """Per phase: the most bytes live (of those allocated in the trace) at one of its allocations, and the
    live set then."""
    live, total, best = {}, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            p = phase(ev.get("frames", []))
            if total > best.get(p, (0,))[0]:
                best[p] = (total, dict(live))
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return best


def main():
    flags = sys.argv[1] if len(sys.argv) > 1 else "lean"
    trainer, e = small_training_run(flags, Path(tempfile.mkdtemp()))
    trainer.step()
    held = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    peak = trainer.step()["peak_mem_gib"]
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    lines = [f"{flags}: step 2 peak {peak:.3f} GiB, estimate {e.total / 2**30:.3f} GiB ({e})",
             f"held when step 2 began: {held / 2**30:.3f} GiB (estimated resident: "
             f"{sum(e.resident.values()) / 2**30:.3f})"]
    for p, (top, at) in sorted(replay(trace).items(), key=lambda kv: -kv[1][0]):
        lines.append(f"\n{p}: held + {top / 2**30:.3f} = {(held + top) / 2**30:.3f} GiB")
        groups = collections.Counter()
        for ev in at.values():
            groups[origin(ev.get("frames", []))] += ev["size"]
        lines += [f"  {v / 2**30:8.3f} GiB  {k}" for k, v in groups.most_common(12) if v >= 2**20]
    text = "\n".join(lines) + "\n"
    print(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"memory_peak_{flags}.txt").write_text(text)


if __name__ == "__main__":
    main()
