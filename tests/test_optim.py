"""Stochastic rounding and the bf16 AdamW built on it (minigrpo/rl/optim.py)."""

import io
import weakref

import pytest
import torch

from minigrpo.rl.optim import StochasticAdamW, round_stochastic


def _bf16_neighbours(x: torch.Tensor):
    """The bf16 values either side of fp32 x: truncated toward zero, and one bf16 spacing further out."""
    bits = x.view(torch.int32) & -65536
    return bits.view(torch.float32), (bits + 65536).view(torch.float32)


SEED = torch.tensor(12345)


def test_round_stochastic_is_unbiased_and_lands_on_a_neighbour():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(8, generator=g) * 10.0 ** torch.arange(-4, 4), torch.tensor([1e-30, -3e20])])
    lo, hi = _bf16_neighbours(x)
    frac = (x - lo) / (hi - lo)                                    # where x sits between them, in [0, 1)
    r = round_stochastic(x.repeat(50_000, 1), SEED).float()        # (n, 10): each element its own noise
    assert ((r == lo) | (r == hi)).all()
    p_hi = (r == hi).float().mean(0)
    assert torch.allclose(p_hi, frac, atol=0.01), (p_hi, frac)    # unbiased: P(further out) = frac
    assert torch.equal(round_stochastic(lo.repeat(100, 1), SEED).float(), lo.repeat(100, 1))  # exact stays exact


def test_round_stochastic_noise_is_a_function_of_seed_and_index():
    x = torch.full((4096,), 1.0 + 2**-9)
    a, b = round_stochastic(x, SEED), round_stochastic(x, SEED)
    assert torch.equal(a, b) and not torch.equal(a, round_stochastic(x, SEED + 1))
    # offset = index of the first element: a slice rounds exactly as it does inside the whole tensor
    assert torch.equal(round_stochastic(x[1000:].contiguous(), SEED, offset=1000), a[1000:])


@pytest.mark.parametrize("period", [2**30, 2**31, 2**32])
def test_round_stochastic_noise_does_not_repeat_at_large_indices(period):
    # An 8B model has 2^33 elements; their noise must not repeat with the index (the old wrap was at 2^30).
    x = torch.full((4096,), 1.0 + 2**-8)          # half a bf16 spacing above 1: rounds up with probability 1/2
    a = round_stochastic(x, SEED, offset=5)
    b = round_stochastic(x, SEED, offset=5 + period)
    same = (a == b).float().mean().item()
    assert 0.4 < same < 0.6, f"elements {period} apart round alike {same:.0%} of the time, not ~50%"


def test_every_element_of_an_8b_model_gets_its_own_noise_index(monkeypatch):
    # Meta tensors: the bookkeeping of an 8B-parameter step without the memory. Each chunk's noise index
    # must start where the previous chunk ended, across parameters, never wrapping.
    import minigrpo.rl.optim as optim

    starts = []
    monkeypatch.setattr(optim, "_adamw_chunk",
                        lambda w, g, m, v, hyper, seeds, offset: starts.append((offset, w.numel())))
    params = [torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device="meta"))
              for n in (2**31 + 3, 2**32, 2**31)]
    for p in params:
        p.grad = torch.empty_like(p)
    StochasticAdamW(params, chunk=2**28).step(seed=0)
    offsets = [0]
    for _, n in starts:
        offsets.append(offsets[-1] + n)
    assert [o for o, _ in starts] == offsets[:-1] and offsets[-1] == 2**33 + 3


def _run(opt_cls, w0, steps, lr, dtype, weight_decay=0.1, flip=True):
    w = torch.nn.Parameter(w0.clone().to(dtype))
    opt = opt_cls([w], lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    for t in range(steps):
        phase = torch.arange(w.numel()).float() + (t if flip else 0)
        w.grad = (torch.sin(phase) * 1e-3).view_as(w).to(dtype)
        opt.step(t) if opt_cls is StochasticAdamW else opt.step()
    return w.detach().float()


def test_one_step_is_torch_adamw_rounded_to_a_neighbour():
    # lr 1e-2 and weight decay 1.0 move a weight of ~1 by >= 1% (over one bf16 spacing, 0.4-0.8%) through
    # each term, so a wrong bias correction or decay lands outside the two neighbours of the fp32 result.
    w0 = torch.randn(4096, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    ref = _run(torch.optim.AdamW, w0, steps=1, lr=1e-2, dtype=torch.float32, weight_decay=1.0)
    ours = _run(StochasticAdamW, w0, steps=1, lr=1e-2, dtype=torch.bfloat16, weight_decay=1.0)
    lo, hi = _bf16_neighbours(ref)
    assert ((ours == lo) | (ours == hi)).all()


def test_many_steps_stay_within_a_spacing_per_step_of_torch_adamw():
    w0 = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    ref = _run(torch.optim.AdamW, w0, steps=5, lr=1e-2, dtype=torch.float32)
    ours = _run(StochasticAdamW, w0, steps=5, lr=1e-2, dtype=torch.bfloat16)
    bound = 5 * 2**-7 * (w0.abs() + 5 * 1e-2)  # each of the 5 roundings is under one spacing of |w| <= this
    assert ((ours - ref).abs() <= bound).all()


def test_small_lr_updates_survive_where_round_to_nearest_loses_them():
    # lr 1e-6 on weights of ~0.02 (bf16 spacing ~1.2e-4): the RL regime. 50 steps move each weight ~5e-5.
    w0 = (0.02 + 0.001 * torch.rand(32768, generator=torch.Generator().manual_seed(0))).bfloat16().float()
    kw = dict(steps=50, lr=1e-6, flip=False)
    ref = _run(torch.optim.AdamW, w0, dtype=torch.float32, **kw) - w0
    nearest = _run(torch.optim.AdamW, w0, dtype=torch.bfloat16, **kw) - w0
    ours = _run(StochasticAdamW, w0, dtype=torch.bfloat16, **kw) - w0
    assert nearest.abs().max() == 0                                # plain bf16 AdamW never moves
    assert ref.abs().mean() > 3e-5
    # ours moves each weight by its fp32 displacement on average (the per-weight noise averages out)
    assert abs((ours - ref).mean()) < 0.05 * ref.abs().mean(), ((ours - ref).mean(), ref.abs().mean())
    assert torch.corrcoef(torch.stack([ours, ref]))[0, 1] > 0.3


def test_state_dict_round_trip_continues_exactly():
    w0 = torch.randn(300, generator=torch.Generator().manual_seed(0))

    def make():
        w = torch.nn.Parameter(w0.clone().bfloat16())
        return w, StochasticAdamW([w], lr=1e-3, chunk=128)  # several chunks per tensor

    def step(w, opt, t):
        w.grad = torch.full_like(w, 0.5 - t % 2)
        opt.step(t)

    a, opt_a = make()
    for t in range(3):
        step(a, opt_a, t)
    b, opt_b = make()
    b.data.copy_(a.data)
    saved = io.BytesIO()
    torch.save(opt_a.state_dict(), saved)  # as a checkpoint does: no tensor shared with opt_a
    saved.seek(0)
    opt_b.load_state_dict(torch.load(saved))
    step(a, opt_a, 3)
    step(b, opt_b, 3)
    assert torch.equal(a, b)
    assert opt_b.state[b]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.slow
def test_compiled_update_equals_the_eager_one():
    w0 = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = []
    for compile in (False, True):
        w = torch.nn.Parameter(w0.clone().bfloat16())
        opt = StochasticAdamW([w], lr=1e-3, weight_decay=0.1, chunk=300, compile=compile)
        for t in range(3):
            w.grad = torch.sin(torch.arange(1000.0) + t).bfloat16()
            opt.step(t)
        out.append((w.detach().clone(), opt.state[w]["exp_avg_sq"].clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_lone_and_concatenated_pieces_share_one_compiled_graph():
    # A large parameter is updated in place through views of itself, small ones through a concatenation; a
    # parameter view requires grad and a concatenation does not, which Dynamo guards on: a second graph
    # (~6 s on the GPU) unless the lone piece is detached.
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (1000, 10, 20)]  # pieces 300 x 3, 100, 30
    for p in params:
        p.grad = torch.randn_like(p)
    opt = StochasticAdamW(params, chunk=300, compile=False)
    opt._update = torch.compile(opt._update, backend="eager", dynamic=True)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    opt.step(seed=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    torch._dynamo.reset()


def test_rejects_fp32_parameters():
    with pytest.raises(ValueError, match="bf16 parameters, got torch.float32"):
        StochasticAdamW([torch.nn.Parameter(torch.zeros(3))])


def test_bf16_micro_batch_gradients_are_summed_in_fp32():
    # One large micro-batch gradient (64..128, where bf16 numbers are 0.5 apart), then 15 small positive ones
    # (0.1..0.24): summed in bf16, each small one rounds away against the running sum, and 15 of them are
    # lost. GradSync sums in fp32 and rounds twice at the end: within bf16's unit roundoff u = 2^-8 of the
    # sum of the first 15 micro-batches, and of the result.
    from minigrpo.rl.distributed import Dist, GradSync

    g = torch.Generator().manual_seed(0)
    grads = [(64 + 64 * torch.rand(4096, generator=g)).bfloat16()]
    grads += [(0.1 + 0.14 * torch.rand(4096, generator=g)).bfloat16() for _ in range(15)]
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    sync = GradSync(model, lambda m, grad: (m.w * grad).sum(), Dist())      # d loss / d w = grad, exactly
    for u, grad in enumerate(grads):
        with sync.accumulate(first=u == 0, last=u == 15):
            sync(grad).backward()
    exact = torch.stack([x.double() for x in grads]).sum(0)
    first15 = torch.stack([x.double() for x in grads[:15]]).sum(0)
    bound = 2**-8 * (first15.abs() + exact.abs()) + 16 * 2**-24 * exact.abs()  # + the fp32 sum's own rounding
    err = (model.w.grad.double() - exact).abs()
    assert model.w.grad.dtype == torch.bfloat16 and (err <= bound).all(), f"worst {(err - bound).max():.3g} over"
    naive = grads[0]
    for x in grads[1:]:
        naive = naive + x                                                  # round to nearest bf16 each time
    assert ((naive.double() - exact).abs() > bound).all()                  # what the fp32 sum avoids


def test_grouping_small_tensors_changes_no_rounding():
    # Concatenated small tensors keep each element's global noise index: the same bits as one tensor at a time.
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (40,), (2,), (64, 3), (1,), (30,)]
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(3)]
    out = []
    for chunk in (4, 100, 10**6):  # each tensor alone in chunks of 4; some grouped, some alone; all in one
        ws = [torch.nn.Parameter(w.clone().bfloat16()) for w in w0]
        opt = StochasticAdamW(ws, lr=1e-2, weight_decay=0.1, chunk=chunk)
        for t in range(3):
            for w, gr in zip(ws, grads[t]):
                w.grad = gr.clone()
            opt.step(t)
        out.append([torch.cat([w.detach().view(-1), opt.state[w]["exp_avg"].view(-1),
                               opt.state[w]["exp_avg_sq"].view(-1)]) for w in ws])
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))

def test_one_piece_of_concatenated_parameters_lives_at_a_time(monkeypatch):
    """Small parameters are concatenated into pieces (w, g, m, v: four copies); a piece's copies are freed
    before the next piece's are made, so the step needs one piece's memory (memory.py's optimizer_step)."""
    params = [torch.nn.Parameter(torch.randn(100).bfloat16()) for _ in range(40)]
    for p in params:
        p.grad = torch.randn_like(p)
    made, most, cat = [], 0, torch.cat

    def counting_cat(tensors, *args, **kwargs):
        nonlocal most
        out = cat(tensors, *args, **kwargs)
        made.append(weakref.ref(out))
        most = max(most, sum(r() is not None for r in made))
        return out
    monkeypatch.setattr(torch, "cat", counting_cat)
    StochasticAdamW(params, chunk=1024, compile=False).step(seed=0)  # 4 pieces of 10 parameters
    assert len(made) == 16 and most == 4


def test_two_bf16_micro_batch_gradients_need_no_fp32_sum():
    # bf16 addition computes in fp32 and rounds once, so the sum of two bf16 gradients is already the exact sum
    # rounded once: no fp32 buffer (4 bytes per parameter) is made, and the result is that single rounding.
    from minigrpo.rl.distributed import Dist, GradSync

    g = torch.Generator().manual_seed(0)
    grads = [(64 + 64 * torch.rand(4096, generator=g)).bfloat16(),
             (0.1 + 0.14 * torch.rand(4096, generator=g)).bfloat16()]
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    sync = GradSync(model, lambda m, grad: (m.w * grad).sum(), Dist())
    with sync.accumulate(first=True, last=False):
        sync(grads[0]).backward()
    assert not sync._sums and model.w.grad.dtype == torch.bfloat16
    with sync.accumulate(first=False, last=True):
        sync(grads[1]).backward()
    assert torch.equal(model.w.grad, (grads[0].float() + grads[1].float()).bfloat16())
