"""`EngineConfig`: the rollout engine's settings, read by the engine and by the runner below it, and by the
trainer's memory estimate. Imports nothing heavy: no Triton, so the estimate and the command line can read it
on a machine that cannot run the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minigrpo.model.config import ModelConfig

BACKENDS = ("eager", "sdpa", "triton")  # decode attention (minigrpo/engine/attention.py)


@dataclass(frozen=True)
class EngineConfig:
    attn: str = "sdpa"              # decode attention backend: eager | sdpa | triton
    compile: str = "none"           # none | step (torch.compile(fullgraph=True) over the whole decode step)
    cuda_graphs: bool = False       # capture the step per bucket, and the prefill per padded shape
    sampler: str = "torch"          # torch (reference) | triton (fused one-pass kernel, plain temperature)
    sync_every: int = 8             # decode steps between host syncs (stop detection, compaction)
    page_size: int = 16
    max_batch: int = 256            # largest bucket: sequences decoded at once
    max_seq_len: int = 1024         # prompt + completion, per sequence; sets the block-table width
    kv_pages: int | None = None     # KV budget in pages; default: kv_page_count's
    kv_memory_fraction: float = 0.3
    buckets: tuple[int, ...] = field(default=())  # default: powers of two from 8 up to max_batch

    def __post_init__(self):
        for name, choices in (("attn", BACKENDS), ("sampler", ("torch", "triton")), ("compile", ("none", "step"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name, least in (("sync_every", 1), ("max_batch", 1), ("max_seq_len", 2)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_pages is not None and self.kv_pages < 2:
            raise ValueError(f"kv_pages must be at least 2 (page 0 is scratch), got {self.kv_pages}")
        if self.buckets and (max(self.buckets) != self.max_batch or sorted(set(self.buckets)) != list(self.buckets)):
            raise ValueError(f"buckets must be increasing and end at max_batch {self.max_batch}, got {self.buckets}")

    @property
    def table_width(self) -> int:
        """Block-table entries per sequence: pages for max_seq_len tokens."""
        return math.ceil(self.max_seq_len / self.page_size)

    def page_bytes(self, model: ModelConfig, itemsize: int) -> int:
        """Bytes one KV page holds: K and V of page_size tokens in every layer, itemsize bytes per value."""
        return 2 * model.num_hidden_layers * self.page_size * model.num_key_value_heads * model.head_dim * itemsize

    def kv_page_count(self, free_bytes: int | None, page_bytes: int) -> int:
        """The KV pool's pages: kv_pages, or enough for every slot at max_seq_len (plus the scratch page),
        capped at kv_memory_fraction of free_bytes where that is known (on CUDA)."""
        if self.kv_pages is not None:
            return self.kv_pages
        pages = 1 + self.max_batch * self.table_width
        if free_bytes is None:
            return pages
        return max(2, min(pages, int(free_bytes * self.kv_memory_fraction) // page_bytes))

    def bucket_sizes(self) -> tuple[int, ...]:
        smaller = tuple(1 << i for i in range(3, (self.max_batch - 1).bit_length()))  # 8, 16, ... below max_batch
        return self.buckets or smaller + (self.max_batch,)
