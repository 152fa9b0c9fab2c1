"""On-device sampling: the right distribution, the filters, and seeds that do not depend on batch layout."""

import pytest
import torch

from minigrpo.sampling import GREEDY, SamplingParams, filter_logits, sample


def test_samples_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.7)
    n = 20000
    seeds = torch.arange(n)
    toks, logp = sample(logits.expand(n, -1), params, seeds, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(toks, minlength=5).float() / n
    expected = (logits[0] / 0.7).softmax(-1)
    assert (freq - expected).abs().max() < 0.015  # ~4 standard errors at n = 20000
    assert torch.allclose(logp, expected.log()[toks], atol=1e-6)


def test_top_k_and_top_p_keep_exactly_the_nucleus():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])  # probs sorted: idx 1, 3, 2, 0
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))[0].tolist()
    assert kept == [False, True, False, True]
    p = logits.softmax(-1)[0]
    # top_p just above p[1]: token 1 alone is not enough, so token 3 joins; token 2 does not.
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=float(p[1]) + 1e-3)))[0].tolist()
    assert kept == [False, True, False, True]
    toks, _ = sample(logits.expand(500, -1), SamplingParams(top_k=2), torch.arange(500), torch.zeros(500, dtype=torch.long))
    assert set(toks.tolist()) == {1, 3}


def test_a_sequence_samples_the_same_wherever_it_sits_in_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    seeds, ctr = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 3, 1, 4, 1, 5])
    params = SamplingParams(temperature=1.0)
    a, _ = sample(logits, params, seeds, ctr)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    b, _ = sample(logits[perm], params, seeds[perm], ctr[perm])
    assert torch.equal(a[perm], b)
    c, _ = sample(logits, params, seeds + 1, ctr)
    assert not torch.equal(a, c)  # a different seed draws differently


def test_greedy_and_bad_params():
    logits = torch.tensor([[0.1, 0.9, 0.3]])
    assert sample(logits, GREEDY, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))[0].item() == 1
    for bad, msg in (({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)
