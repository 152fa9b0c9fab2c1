"""`EngineConfig`: the rollout engine's settings, read by the engine and by the runner below it."""

from __future__ import annotations

from dataclasses import dataclass, field

from minigrpo.engine.attention import BACKENDS


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
    kv_pages: int | None = None     # KV budget in pages; default: kv_memory_fraction of free GPU memory
    kv_memory_fraction: float = 0.3
    buckets: tuple[int, ...] = field(default=())  # default: powers of two from 8 up to max_batch

    def __post_init__(self):
        for name, choices in (("attn", BACKENDS), ("sampler", ("torch", "triton")), ("compile", ("none", "step"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name, least in (("sync_every", 1), ("max_batch", 1), ("max_seq_len", 2), ("page_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.buckets and (max(self.buckets) != self.max_batch or sorted(set(self.buckets)) != list(self.buckets)):
            raise ValueError(f"buckets must be increasing and end at max_batch {self.max_batch}, got {self.buckets}")

    def bucket_sizes(self) -> tuple[int, ...]:
        smaller = tuple(b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < self.max_batch)
        return self.buckets or smaller + (self.max_batch,)
