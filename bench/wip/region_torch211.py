"""Does the compiled decode step get through torch.compile on this torch? (CPU, the tests' tiny config)

    PYTHONPATH=TREE python bench/wip/region_torch211.py triton|sdpa        # from TREE, e.g. under torch 2.11

Prints tokens, or the exception's first lines. On a CPU without TRITON_INTERPRET the Triton op compiles but
cannot launch: a failure at the launch means the compile itself went through.
"""
import sys

import torch

sys.path.insert(0, "tests")
from conftest import random_model, tiny_config  # noqa: E402

from minigrpo.engine.config import EngineConfig  # noqa: E402
from minigrpo.engine.engine import Engine  # noqa: E402
from minigrpo.model.sampling import GREEDY  # noqa: E402

attn, cfg = sys.argv[1], tiny_config(tied=False, head_dim=16)
engine = Engine(cfg, EngineConfig(page_size=8, max_batch=16, max_seq_len=64, attn=attn, compile="step"),
                device="cpu", dtype=torch.float32)
engine.load_weights(random_model(cfg, seed=0, std=0.2))
try:
    print(torch.__version__, attn, "tokens", engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], 2, 8, GREEDY).tokens[0])
except Exception as e:  # the point is which error: print it, not its stack
    print(torch.__version__, attn, "FAIL", type(e).__name__, [ln for ln in str(e).splitlines() if ln.strip()][:2])
