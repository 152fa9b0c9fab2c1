"""On-device sampling: the right distribution, the filters, and seeds that do not depend on batch layout."""

import pytest
import torch
import torch.nn.functional as F

from minigrpo.model.sampling import GREEDY, SAMPLE_CHUNK, SamplingParams, filter_logits, sample, uniform_noise


def test_samples_follow_the_tempered_softmax():
    # 3 full chunks and a partial one. A likely token in each chunk, and a background of unlikely ones with
    # 14% of the mass in each full chunk. The chunks' masses are unequal (0.46, 0.18, 0.21, 0.16) and each
    # mixes a likely token with the background, so an error in either level of the draw shows in the counts.
    V = 3 * SAMPLE_CHUNK + 5
    hot = torch.tensor([7, SAMPLE_CHUNK + 100, 3 * SAMPLE_CHUNK - 1, 3 * SAMPLE_CHUNK + 4])
    logits = torch.zeros(V)
    logits[hot] = torch.tensor([6.4, 5.0, 5.3, 5.9])
    bins = torch.arange(V) // SAMPLE_CHUNK + len(hot)                 # background: one bin per chunk
    bins[hot] = torch.arange(len(hot))                                # each likely token: its own bin
    expected = torch.zeros(len(hot) + 4).index_add(0, bins, (logits / 0.7).softmax(-1))
    n, batch = 10000, 2500
    freq = torch.zeros_like(expected)
    for first in range(0, n, batch):                                  # many counters, one seed
        toks, logp = sample(logits.expand(batch, -1), SamplingParams(temperature=0.7),
                            torch.full((batch,), 3), torch.arange(first, first + batch))
        freq += torch.bincount(bins[toks], minlength=len(expected)).float() / n
        assert torch.allclose(logp, (logits / 0.7).double().log_softmax(-1)[toks].float(), atol=1e-5)
    assert (freq - expected).abs().max() < 0.02  # ~5 standard errors at n = 10000


def test_a_chunk_with_every_entry_filtered_out_is_never_drawn():
    # Top-k keeps 20 tokens of chunks 0 and 2; chunk 1 and the last (partial) chunk are all -inf.
    g = torch.Generator().manual_seed(1)
    V = 3 * SAMPLE_CHUNK + 5
    logits = torch.randn(V, generator=g)
    logits[SAMPLE_CHUNK:2 * SAMPLE_CHUNK] -= 100
    logits[3 * SAMPLE_CHUNK:] -= 100
    params = SamplingParams(temperature=1.0, top_k=20)
    x = filter_logits(logits[None], params)[0]                        # (V,)
    n = 2000
    toks, logp = sample(logits.expand(n, -1), params, torch.arange(n) % 7, torch.arange(n))
    assert x[toks].isfinite().all()
    assert set((toks // SAMPLE_CHUNK).tolist()) == {0, 2}
    assert torch.allclose(logp, x.double().log_softmax(-1)[toks].float(), atol=1e-5)


def test_noise_never_reaches_1():
    # Seed 6711, counter 0, index 836: the hash's top 24 bits are all ones. As a 24-bit uniform that rounds
    # to exactly 1 in fp32: Gumbel noise +inf, a token that always wins, even one filtered out.
    u = uniform_noise(torch.tensor([6711]), torch.tensor([0]), torch.tensor([836]))
    assert 0 < u.item() < 1
    logits = torch.zeros(1, 1000)
    logits[0, 3] = 1.0
    tok, _ = sample(logits, SamplingParams(top_k=1), torch.tensor([6711]), torch.tensor([0]))
    assert tok.item() == 3


def test_top_k_and_top_p_keep_exactly_the_nucleus():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])  # probs sorted: idx 1, 3, 2, 0
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))[0].tolist()
    assert kept == [False, True, False, True]
    p = logits.softmax(-1)[0]
    # top_p just above p[1]: token 1 alone is not enough, so token 3 joins; token 2 does not.
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=float(p[1]) + 1e-3)))[0].tolist()
    assert kept == [False, True, False, True]
    toks, _ = sample(logits.expand(500, -1), SamplingParams(top_k=2), torch.arange(500),
                     torch.zeros(500, dtype=torch.long))
    assert set(toks.tolist()) == {1, 3}


def test_a_sequence_samples_the_same_wherever_it_sits_in_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2 * SAMPLE_CHUNK + 50, generator=g)
    seeds, ctr = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 3, 1, 4, 1, 5])
    params = SamplingParams(temperature=1.0)
    a, _ = sample(logits, params, seeds, ctr)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    b, _ = sample(logits[perm], params, seeds[perm], ctr[perm])
    assert torch.equal(a[perm], b)
    c, _ = sample(logits, params, seeds + 1, ctr)
    assert not torch.equal(a, c)  # a different seed draws differently


def test_greedy():
    logits = torch.tensor([[0.1, 0.9, 0.3]])
    assert sample(logits, GREEDY, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))[0].item() == 1


@pytest.mark.parametrize("kwargs", [dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0), dict(top_k=-1)])
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError, match="sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("V", [37, SAMPLE_CHUNK - 1, SAMPLE_CHUNK])
def test_impossible_tokens_padding_the_vocabulary_change_no_draw(V):
    """A vocabulary under one chunk is drawn from a chunk of its own size; padded past one chunk with -inf
    logits, it must draw the same tokens, as the fused kernel (which masks a whole block) does."""
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(64, V, generator=g)
    seeds, ctr = torch.arange(64), torch.arange(64) % 5
    params = SamplingParams(temperature=0.7)
    padded = F.pad(logits, (0, SAMPLE_CHUNK + 100 - V), value=float("-inf"))   # two chunks, the second empty
    tokens, logp = sample(logits, params, seeds, ctr)
    want_tokens, want_logp = sample(padded, params, seeds, ctr)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)  # the same logsumexp, summed in another order
    assert len(set(tokens.tolist())) > 10  # a real spread of draws, not one token
