"""Triton kernels for the decode step, registered as PyTorch ops (importing this package registers them).

    torch.ops.minigrpo.paged_decode_attention(q, k_pool, v_pool, block_table, seq_lens, scale, num_splits=0)
    torch.ops.minigrpo.rope_store(q, k, v, k_pool, v_pool, positions, slots, cos, sin)
    torch.ops.minigrpo.fused_sample(logits, seeds, counters, temperature, chunk)

CUDA tensors run the compiled kernels; with TRITON_INTERPRET=1 set before triton is first imported, CPU
tensors run them under Triton's interpreter (the CPU tests).
"""

from kernels import decode_attention, rope_store, sample  # noqa: F401  (import registers the ops)
