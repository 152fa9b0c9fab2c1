"""Paged KV cache: per-layer K and V pools of fixed-size pages, and a host-side page allocator.

A sequence owns a list of pages (its block table), so it needs no contiguous memory and pages can be
shared: the G samples of a prompt share its full pages, counted by reference, and each owns a copy of
the partial last page plus the pages it generates into. Page 0 is never handed out: a padded prefill's pad
tokens write into it, and a new slot's unused block-table entries point at it. A finished slot's row keeps the
ids of pages since freed: every index a static-shape step reads is in range either way, and a slot with
seq_len 0 (empty or finished) stores nothing and attends over nothing. Pages are handed out between decode
steps, never inside the step.

Shape legend: L layers, P pages, S page size (token slots per page), Hkv kv heads, D head dim.
"""

from __future__ import annotations

import torch

from minigrpo.model.config import ModelConfig
from minigrpo.model.transfer import to_device

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    """The KV budget cannot hold what was asked; the message names the setting to raise."""


class KVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        """num_pages >= 2 (page 0 is scratch) of page_size (a power of two) tokens: EngineConfig checks both."""
        L = cfg.num_hidden_layers
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        # One allocation per layer: torch.compile then writes the step's graph inputs in place, not via copies.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]  # L x (P, S, Hkv, D)
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]  # L x (P, S, Hkv, D)
        self.page_size = page_size
        self.num_pages = num_pages
        self.capacity = num_pages - 1  # pages that can ever be handed out (all but the scratch page)
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low page ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, holders: int = 1) -> list[int]:
        """n free pages, each held by `holders` sequences (the G samples of a prompt share its full pages)."""
        if n > len(self._free):
            raise OutOfPages(f"KV cache needs {n} more pages but only {len(self._free)} of {self.capacity} are "
                             f"free; raise the engine's kv_pages (or kv_memory_fraction)")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = holders
        return pages

    def release(self, pages: list[int]) -> None:
        """A sequence lets go of its pages; each returns to the pool when nobody holds it any more."""
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released more often than it was taken"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages src[i] -> dst[i], K and V, all layers, in one indexed copy per pool."""
        assert len(src) == len(dst) and not set(src) & set(dst), "copy_pages: src and dst must pair up, disjoint"
        if not src:
            return
        s, d = (to_device(torch.tensor(x, dtype=torch.long), self.k[0].device) for x in (src, dst))
        for pool in self.k + self.v:
            pool.index_copy_(0, d, pool.index_select(0, s))

