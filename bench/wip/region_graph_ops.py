"""Ops in Dynamo's graph of the decode step, outside and inside nested compile regions, at the 0.5B shape (CPU).

    TRITON_INTERPRET=1 PYTHONPATH=TREE python bench/wip/region_graph_ops.py triton|sdpa   # from TREE (main or .rev/x)

Works on code with and without bench/wip/regional-decode.patch (the step's second argument differs).
"""
import sys

import torch

sys.path.insert(0, ".")
from bench.workload import random_qwen  # noqa: E402
from minigrpo.engine.config import EngineConfig  # noqa: E402
from minigrpo.engine.decode import decode_step  # noqa: E402
from minigrpo.engine.engine import Engine  # noqa: E402
from minigrpo.model.sampling import SamplingParams  # noqa: E402

attn = sys.argv[1]
model = random_qwen("cpu", torch.float32)
engine = Engine(model.config, EngineConfig(attn=attn, compile="step", max_batch=8, max_seq_len=64), device="cpu",
                dtype=torch.float32)
engine.load_weights(model)
kw = dict(k_pools=engine.kv.k, v_pools=engine.kv.v, sampler="torch")
if hasattr(engine.runner, "layer"):  # the patch: the step takes the layer function
    second = engine.runner.layer
else:
    second, kw["num_splits"] = attn, engine.runner.num_splits
ex = torch._dynamo.explain(decode_step)(engine.model, second, SamplingParams(1.0), **engine.state.step_args(8), **kw)
graph = ex.graphs[0]
ops = lambda g: sum(n.op in ("call_function", "call_method") for n in g.graph.nodes)  # noqa: E731
bodies = [m for _, m in graph.named_children() if hasattr(m, "graph")]
print(f"{attn}: graphs {ex.graph_count}, breaks {ex.graph_break_count}, outer ops {ops(graph)}, "
      f"regions {len(bodies)}, ops in their bodies {sum(map(ops, bodies))}")
