"""bench/decode.py's step breakdown lays its block table out as a rollout does (Engine._reserve): each group
of G sequences shares its prompt's full pages and owns the rest, and no page is the scratch page or used twice
otherwise. If it gave every sequence its own pages, the breakdown's attention would read G times the prompt's
K/V from DRAM where the rollout reads it once (NOTES, session 35)."""

import torch

from bench.workload import shared_prompt_pages
from minigrpo.engine.kv_cache import SCRATCH_PAGE


def test_groups_share_their_prompt_pages_and_own_the_rest():
    torch.manual_seed(0)
    B, G, M, shared = 12, 4, 7, 3
    table = shared_prompt_pages(num_pages=100, B=B, G=G, M=M, shared=shared, device="cpu")
    assert table.shape == (B, M) and table.dtype == torch.int32
    groups = table.view(B // G, G, M)
    assert (groups[:, :, :shared] == groups[:, :1, :shared]).all()          # one copy of the prompt per group
    distinct = groups[:, 0, :shared].flatten().tolist() + table[:, shared:].flatten().tolist()
    assert len(set(distinct)) == len(distinct)                              # nothing else is shared
    assert SCRATCH_PAGE not in distinct and max(distinct) < 100
