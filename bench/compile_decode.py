"""The decode step's cold compile: seconds torch.compile spends on the engine's step, at a real model shape.

    python bench/compile_decode.py                                  # 0.5B shape, CUDA, triton attention
    python bench/compile_decode.py --device cpu --attn sdpa         # the same trace on a CPU (Inductor's C++)
    python bench/compile_decode.py --config ../shared/data/configs/qwen2.5-7b-instruct
    python bench/compile_decode.py --layers 1                       # the part of it that is not the layers

One engine (compile=step, no CUDA graphs: this times the compile, not the capture; the sampler the trainer
picks for the device), random weights, one bucket of 8 sequences, 16 new tokens, twice. `--layers N` keeps N of
the model's layers: the 24-layer figure minus the 1-layer one is what 23 more layers cost. Reports Dynamo's compile seconds (its start / end callbacks, as the
trainer's `compile_s` metric) and both rollouts' wall seconds: the first compiles, the second runs warm. Inductor
and Triton write to an empty cache of this process's own, so the figures are a cold start's; run each code
version in its own process (PYTHONPATH=TREE python TREE/bench/compile_decode.py). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

_CACHE = tempfile.mkdtemp(prefix="compile_decode_")  # before torch is imported: Inductor reads these at import
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _CACHE)
os.environ.setdefault("TRITON_CACHE_DIR", f"{_CACHE}/triton")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workload import qwen_dir  # noqa: E402
from minigrpo.engine.config import EngineConfig  # noqa: E402
from minigrpo.engine.engine import Engine  # noqa: E402
from minigrpo.model.config import ModelConfig  # noqa: E402
from minigrpo.model.qwen2 import Qwen2ForCausalLM, init_weights  # noqa: E402
from minigrpo.model.sampling import SamplingParams  # noqa: E402
from minigrpo.run.metrics import compile_seconds  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="triton", help="eager | sdpa | triton")
    p.add_argument("--config", type=Path, default=None, help="folder with config.json (default: the 0.5B's)")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (default: all)")
    args = p.parse_args()
    on_cuda = args.device == "cuda"
    model_cfg = ModelConfig.from_json((args.config or qwen_dir()) / "config.json")
    model_cfg = replace(model_cfg, num_hidden_layers=args.layers or model_cfg.num_hidden_layers)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(model_cfg)
    init_weights(model, torch.Generator(args.device).manual_seed(0), std=0.02)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    cfg = EngineConfig(attn=args.attn, compile="step", sampler="triton" if on_cuda else "torch", max_batch=8,
                       max_seq_len=64, page_size=16)
    engine = Engine(model_cfg, cfg, device=args.device, dtype=dtype)
    engine.load_weights(model.to(dtype))
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(8)]
    row = {"torch": torch.__version__, "attn": args.attn, "sampler": cfg.sampler, "layers": model_cfg.num_hidden_layers}
    compile_seconds()  # start counting
    for run in ("first", "second"):
        start = time.perf_counter()
        engine.generate(prompts, 1, 16, SamplingParams(temperature=1.0))
        if args.device == "cuda":
            torch.cuda.synchronize()
        row[f"{run}_s"] = round(time.perf_counter() - start, 2)
    row["compile_s"] = round(compile_seconds(), 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
