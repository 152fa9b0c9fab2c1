"""Triton kernels for the decode step, registered by importing this package as the PyTorch ops
torch.ops.minigrpo.paged_decode_attention and .fused_sample. With TRITON_INTERPRET=1 set before triton is
first imported, they run on CPU tensors (the CPU tests).
"""

from minigrpo.kernels import decode_attention, sample  # noqa: F401  (import registers the ops)
