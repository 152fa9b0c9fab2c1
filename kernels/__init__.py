"""Triton kernels for the decode step, registered as PyTorch ops by importing this package:

    torch.ops.minigrpo.paged_decode_attention(q, k_pool, v_pool, block_table, seq_lens, scale, num_splits=0)
    torch.ops.minigrpo.rope_store(q, k, v, k_pool, v_pool, positions, slots, cos, sin)
    torch.ops.minigrpo.fused_sample(logits, seeds, counters, temperature, chunk)

With TRITON_INTERPRET=1 set before triton is first imported, they run on CPU tensors (the CPU tests).
"""

from kernels import decode_attention, rope_store, sample  # noqa: F401  (import registers the ops)
