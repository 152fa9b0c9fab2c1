"""bench/compile_decode.py on a CPU with the attention made one opaque, K/V-writing custom op per layer, as the
Triton kernel is on the GPU (which the CPU cannot compile: the interpreted kernel fails under Inductor). The op
runs the sdpa backend eagerly inside; what is timed is the compile around it.

    MINIGRPO_DATA=../shared/data PYTHONPATH=$PWD python bench/wip/opaque_attention_compile.py   # from a tree
"""
import sys

import torch

sys.argv[1:1] = ["--device", "cpu", "--attn", "sdpa"]
sys.path.insert(0, ".")
import bench.compile_decode as compile_decode  # noqa: E402  (sets the empty compile cache before torch compiles)
import minigrpo.engine.decode as decode  # noqa: E402
from minigrpo.engine.attention import decode_attention  # noqa: E402


@torch.library.custom_op("wip::opaque_decode_attention", mutates_args=("k_pool", "v_pool"))
def opaque(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           scale: float) -> torch.Tensor:
    return decode_attention("sdpa", q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale).clone()


@opaque.register_fake
def _(q, *_):
    return torch.empty_like(q)


def opaque_attention(backend, q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale, num_splits=0):
    return opaque(q, k, v, k_pool, v_pool, block_table, seq_lens, cos, sin, scale)


decode.decode_attention = opaque_attention  # the name the decode step calls
compile_decode.main()
